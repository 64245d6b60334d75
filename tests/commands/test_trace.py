"""`relibra trace import|synth|stats` through relibra_moe.cli.main.

``relibra trace import FORMAT FILE``: one dump per framework, written the way that framework writes it, gives
back exactly the routing put in (padding dropped, prompt + response joined, dense layers removed), errors name the
file and the field, and ``relibra compare`` runs on the result. ``--model-config`` on plan / score / simulate /
compare gives the same numbers as the preset it describes.
"""

from __future__ import annotations

import base64
import io
import json
import pickle
import sys
import types

import numpy as np
import pytest
import torch

from relibra_moe.cli import main
from relibra_moe.errors import TraceError
from relibra_moe.trace import RoutingTrace, TraceBatch


def _stats(capsys, *argv: str) -> dict:
    capsys.readouterr()
    assert main(["trace", "stats", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def _reference(path, mb: np.ndarray, hot_k: int) -> tuple[float, float]:
    """Skew and intersection straight from the raw file arrays with plain loops."""
    with np.load(path) as f:
        ids, offsets, e = f["experts"], f["offsets"], int(f["num_experts"])
    num_layers = ids.shape[1]
    m = int(mb.max()) + 1
    load = np.zeros((m, num_layers, e))
    for n in range(offsets.size - 1):
        rows = ids[offsets[n]:offsets[n + 1]]
        for l in range(num_layers):
            load[mb[n], l] += np.bincount(rows[:, l][rows[:, l] >= 0], minlength=e)
    skew = np.mean([np.mean([load[i, l].max() / load[i, l].mean() for l in range(num_layers)]) for i in range(m)])
    inter = []
    for i in range(m - 1):
        for l in range(num_layers):
            a = set(sorted(range(e), key=lambda x: (-load[i, l, x], x))[:hot_k])
            b = set(sorted(range(e), key=lambda x: (-load[i + 1, l, x], x))[:hot_k])
            inter.append(len(a & b) / hot_k)
    return float(skew), float(np.mean(inter))


def test_synth_then_stats(tmp_path, capsys):
    out = tmp_path / "s.npz"
    assert main(["trace", "synth", "--model", "olmoe-1b-7b", "--domain", "mixed", "--prompts", "6", "--seed", "3",
                 "--micro-batch-size", "4", "--out", str(out)]) == 0
    assert "SYNTHETIC" in capsys.readouterr().out
    s = _stats(capsys, str(out))
    assert (s["num_sequences"], s["num_layers"], s["num_experts"], s["topk"]) == (24, 16, 64, 8)
    assert s["num_micro_batches"] == 6 and s["micro_batch_rule"] == "file's assignment"
    assert s["synthetic"] is True and "synthetic" in s["source"]
    batch = TraceBatch.load(out)
    assert s["num_tokens"] == batch.num_tokens
    np.testing.assert_array_equal(batch.micro_batch, np.arange(24) // 4)
    skew, inter = _reference(out, np.arange(24) // 4, 8)
    assert s["skew_mean"] == pytest.approx(skew) and s["intersection_mean"] == pytest.approx(inter)
    # --micro-batch-size overrides the file's assignment
    s2 = _stats(capsys, str(out), "--micro-batch-size", "8")
    assert s2["num_micro_batches"] == 3 and s2["micro_batch_rule"] == "8 per micro-batch"
    skew, inter = _reference(out, np.arange(24) // 8, 8)
    assert s2["skew_mean"] == pytest.approx(skew) and s2["intersection_mean"] == pytest.approx(inter)


def test_synth_counts_only_plans_like_the_full_file(tmp_path, capsys):
    full, counts = tmp_path / "full.npz", tmp_path / "counts.npz"
    argv = ["trace", "synth", "--model", "olmoe-1b-7b", "--domain", "mixed", "--prompts", "4", "--seed", "2",
            "--micro-batch-size", "4"]
    assert main([*argv, "--out", str(full)]) == 0
    assert main([*argv, "--counts-only", "--out", str(counts)]) == 0
    assert "counts only (no per-token ids)" in capsys.readouterr().out
    with np.load(counts) as f:
        assert bool(f["counts_only"]) and "experts" not in f.files
    a, b = TraceBatch.load(full), TraceBatch.load(counts)
    np.testing.assert_array_equal(a.sample_expert_counts(), b.sample_expert_counts())
    np.testing.assert_array_equal(a.lengths, b.lengths)
    assert _stats(capsys, str(full)) == _stats(capsys, str(counts))
    plans = []
    for src in (full, counts):
        out = tmp_path / f"plan_{src.stem}.npz"
        assert main(["plan", str(src), "--model", "olmoe-1b-7b", "--nodes", "1", "--gpus-per-node", "4",
                     "--strategy", "eplb", "--replica-slots", "1", "--out", str(out), "--json"]) == 0
        plans.append(out.read_bytes())
    assert plans[0] == plans[1]
    with pytest.raises(TraceError, match=r"counts.npz: a counts-only trace file .*field 'experts'"):
        b.trace(0)


def test_stats_one_sequence_per_micro_batch_and_small_e(tmp_path, capsys):
    rng = np.random.default_rng(0)
    traces = [RoutingTrace(np.argsort(rng.random((s, 2, 16)), axis=2)[:, :, :2], [0, 1], 16, 2) for s in (5, 9, 3)]
    path = tmp_path / "t.npz"
    TraceBatch(traces).save(path)
    s = _stats(capsys, str(path))
    assert s["micro_batch_rule"] == "one sequence per micro-batch" and s["num_micro_batches"] == 3
    assert s["hot_k"] == 4  # E / 4 when E < 32
    skew, inter = _reference(path, np.arange(3), 4)
    assert s["skew_mean"] == pytest.approx(skew) and s["intersection_mean"] == pytest.approx(inter)
    capsys.readouterr()
    assert main(["trace", "stats", str(path)]) == 0
    table = capsys.readouterr().out
    assert "expert skew per micro-batch" in table and "top-4 intersection" in table


def test_stats_errors(tmp_path, capsys):
    assert main(["trace", "stats", str(tmp_path / "missing.npz"), "--json"]) == 1
    err = capsys.readouterr().err
    assert "TraceError" in err and "missing.npz: no such trace file" in err
    rng = np.random.default_rng(1)
    tr = RoutingTrace(np.argsort(rng.random((4, 1, 8)), axis=2)[:, :, :2], [0], 8, 2)
    path = tmp_path / "p.npz"
    TraceBatch([tr, tr, tr], micro_batch=[0, -1, 1]).save(path)
    assert main(["trace", "stats", str(path), "--json"]) == 1
    assert "not sample 1 (micro_batch -1)" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        main(["trace", "stats", str(path), "--micro-batch-size", "0"])
    assert exc.value.code == 2
    assert "expected a positive integer, got 0" in capsys.readouterr().err
    assert main(["trace", "synth", "--model", "nope", "--domain", "math", "--prompts", "1",
                 "--out", str(tmp_path / "x.npz")]) == 1
    assert "unknown model preset 'nope'" in capsys.readouterr().err


def test_import_gpt_oss(traces_dir, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("RELIBRA_TRACES", str(traces_dir))
    out = tmp_path / "g.npz"
    assert main(["trace", "import", "gpt-oss", "--requests", "10", "--seed", "2", "--micro-batch-size", "4",
                 "--out", str(out)]) == 0
    b = TraceBatch.load(out)
    np.testing.assert_array_equal(b.micro_batch, [0, 0, 0, 0, 1, 1, 1, 1, 2, 2])
    np.testing.assert_array_equal(b.sample_info["request"], np.random.default_rng(2).choice(703, 10, replace=False))
    assert "real routing" in b.source and "gpt-oss-20b" in b.source

    full = tmp_path / "all.npz"
    assert main(["trace", "import", "gpt-oss", "--out", str(full)]) == 0
    s = _stats(capsys, str(full))
    assert s["num_sequences"] == 703 and s["micro_batch_rule"] == "one sequence per micro-batch"
    assert 4.0 <= s["skew_mean"] <= 5.5  # issue 2 target (README: about 4.6)
    assert s["synthetic"] is False


def test_import_without_data_says_where_it_looked(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("RELIBRA_TRACES", str(tmp_path / "absent"))
    assert main(["trace", "import", "gpt-oss", "--out", str(tmp_path / "g.npz")]) == 1
    err = capsys.readouterr().err
    assert "TracesNotFoundError" in err and "absent" in err and "RELIBRA_TRACES" in err
    assert not (tmp_path / "g.npz").exists()


def test_stats_without_routed_tokens_gives_valid_json(tmp_path, capsys):
    """All rows padded (-1): skew is undefined, reported as null (never NaN, which is not JSON)."""
    tr = RoutingTrace(np.full((3, 2, 2), -1), [0, 1], 8, 2)
    path = tmp_path / "pad.npz"
    TraceBatch([tr, tr]).save(path)
    capsys.readouterr()
    assert main(["trace", "stats", str(path), "--json"]) == 0
    out = capsys.readouterr().out
    assert "NaN" not in out
    s = json.loads(out)
    assert s["skew_mean"] is None and s["skew_min"] is None and s["num_tokens"] == 6
    assert main(["trace", "stats", str(path)]) == 0
    assert "n/a (no routed tokens)" in capsys.readouterr().out


def test_stats_hot_k_and_help_texts(tmp_path, capsys):
    rng = np.random.default_rng(4)
    tr = RoutingTrace(np.argsort(rng.random((4, 1, 8)), axis=2)[:, :, :2], [0], 8, 2)
    path = tmp_path / "h.npz"
    TraceBatch([tr, tr]).save(path)
    assert main(["trace", "stats", str(path), "--hot-k", "9"]) == 1
    assert "--hot-k 9 exceeds num_experts=8" in capsys.readouterr().err
    s = _stats(capsys, str(path), "--hot-k", "3")
    assert s["hot_k"] == 3 and s["intersection_mean"] == 1.0  # identical samples: identical hot sets
    for argv in (["trace", "--help"], ["trace", "stats", "--help"], ["trace", "import", "--help"]):
        with pytest.raises(SystemExit) as exc:
            main(argv)
        assert exc.value.code == 0
    text = capsys.readouterr().out
    assert "``" not in text  # no reStructuredText markup in --help
    assert "i*B .. i*B+B-1" in text and "skew_mean" in text


def test_relibra_without_command_prints_help(capsys):
    assert main([]) == 2
    out = capsys.readouterr().out
    assert "usage: relibra" in out and "trace" in out and "relibra COMMAND -h" in out


E, K, L = 8, 2, 4
LENGTHS = [(3, 4), (5, 2), (2, 6)]  # (prompt, response) tokens per sample


def _truth(seed: int = 0) -> list[np.ndarray]:
    """The routing of each sample: ``[P + R, L, k]`` distinct ids per row."""
    rng = np.random.default_rng(seed)
    return [np.argsort(rng.random((p + r, L, E)), axis=-1)[..., :K].astype(np.int64) for p, r in LENGTHS]


@pytest.fixture(scope="module")
def model_config(tmp_path_factory):
    transformers = pytest.importorskip("transformers")
    d = tmp_path_factory.mktemp("cfg")
    transformers.Qwen3MoeConfig(hidden_size=64, moe_intermediate_size=32, num_experts=E, num_experts_per_tok=K,
                                num_hidden_layers=L, num_attention_heads=4, num_key_value_heads=2,
                                head_dim=16).save_pretrained(d)
    return d / "config.json"


def _import(capsys, fmt, files, out, *extra):
    rc = main(["trace", "import", fmt, *map(str, files), "--out", str(out), *extra])
    cap = capsys.readouterr()
    return rc, cap.out + cap.err


def _check(out, truth, starts=None):
    batch = TraceBatch.load(out)
    assert batch.num_sequences == len(truth)
    for i, (tr, want) in enumerate(zip(batch.traces, truth, strict=True)):
        np.testing.assert_array_equal(tr.experts, want, err_msg=f"sample {i}")
        assert tr.start == (0 if starts is None else starts[i])
    assert (batch.num_layers, batch.num_experts, batch.top_k) == (L, E, K)
    return batch


def _padded(truth):
    """verl's layout: left-padded prompt then right-padded response in one row; pads hold 0 (never read)."""
    P = max(p for p, _ in LENGTHS)
    R = max(r for _, r in LENGTHS)
    ids = np.zeros((len(truth), P + R, L, K), np.int64)
    mask = np.zeros((len(truth), P + R), np.int64)
    for b, ((p, r), t) in enumerate(zip(LENGTHS, truth, strict=True)):
        ids[b, P - p:P + r], mask[b, P - p:P + r] = t, 1
    return torch.from_numpy(ids), torch.from_numpy(mask)


def test_verl_dataproto_pickle(tmp_path, capsys, model_config):
    truth = _truth(1)
    ids, mask = _padded(truth)

    # verl.protocol.DataProto pickles as (torch.save bytes of its batch, non_tensor_batch, meta_info) and
    # save_to_disk pickle.dumps it; here the batch is a dict (a TensorDict needs the tensordict package)
    mod = types.ModuleType("verl.protocol")

    class DataProto:
        def __init__(self, batch, non_tensor_batch, meta_info):
            self.batch, self.non_tensor_batch, self.meta_info = batch, non_tensor_batch, meta_info

        def __getstate__(self):
            buffer = io.BytesIO()
            torch.save(self.batch, buffer)
            return buffer, self.non_tensor_batch, self.meta_info

    DataProto.__module__, DataProto.__qualname__ = "verl.protocol", "DataProto"
    mod.DataProto = DataProto
    sys.modules.update({"verl": types.ModuleType("verl"), "verl.protocol": mod})
    try:
        data = DataProto({"routed_experts": ids, "attention_mask": mask, "input_ids": torch.zeros_like(mask)},
                         {"uid": np.array(["a", "b", "c"], dtype=object)}, {"global_steps": 3})
        with open(tmp_path / "step3.pkl", "wb") as f:
            pickle.dump(data, f)
    finally:
        del sys.modules["verl.protocol"], sys.modules["verl"]
    rc, text = _import(capsys, "verl", [tmp_path / "step3.pkl"], tmp_path / "out.npz", "--model-config",
                       str(model_config), "--micro-batch-size", "1")
    assert rc == 0, text
    _check(tmp_path / "out.npz", truth)

    # the batch alone, saved with torch.save (data.batch.to_dict())
    torch.save({"routed_experts": ids, "attention_mask": mask}, tmp_path / "batch.pt")
    rc, text = _import(capsys, "verl", [tmp_path / "batch.pt"], tmp_path / "out2.npz", "--num-experts", str(E))
    assert rc == 0, text
    _check(tmp_path / "out2.npz", truth)
    # relibra compare on the imported dump
    rc = main(["compare", str(tmp_path / "out.npz"), "--model-config", str(model_config), "--nodes", "1",
               "--gpus-per-node", "2", "--strategies", "static,eplb", "--json", str(tmp_path / "cmp.json")])
    assert rc == 0
    res = json.loads((tmp_path / "cmp.json").read_text())
    assert sorted(res["strategies"]) == ["eplb", "eplb@length-balanced", "static", "static@length-balanced"]


def test_verl_missing_field_names_file_and_field(tmp_path, capsys):
    ids, _ = _padded(_truth())
    torch.save({"routed_experts": ids}, tmp_path / "batch.pt")
    rc, text = _import(capsys, "verl", [tmp_path / "batch.pt"], tmp_path / "o.npz", "--num-experts", str(E))
    assert rc == 1
    assert "batch.pt: field 'attention_mask' is missing" in text


def test_slime_debug_rollout_data(tmp_path, capsys):
    truth = _truth(2)
    samples = []
    for i, t in enumerate(truth):
        # slime's num_layers counts every decoder layer: layer 0 is dense here (SGLang fills it with 0)
        full = np.concatenate([np.zeros((t.shape[0], 1, K), np.int32), t.astype(np.int32)], axis=1)
        payload = base64.b64encode(full.tobytes()).decode("ascii")
        tokens = list(range(t.shape[0] + 1))  # rows = len(tokens) - 1: the last token is never fed
        routed = np.frombuffer(base64.b64decode(payload.encode("ascii")), dtype=np.int32).reshape(
            len(tokens) - 1, L + 1, K)
        samples.append({"index": i, "group_index": 0, "tokens": tokens, "response_length": LENGTHS[i][1],
                        "rollout_routed_experts": routed, "status": "completed", "reward": 1.0})
    torch.save(dict(rollout_id=0, samples=samples), tmp_path / "rollout_data_0.pt")
    rc, text = _import(capsys, "slime", [tmp_path / "rollout_data_0.pt"], tmp_path / "out.npz",
                       "--num-experts", str(E), "--dense-layers", "0")
    assert rc == 0, text
    batch = _check(tmp_path / "out.npz", truth)
    assert batch.traces[0].layer_ids.tolist() == [1, 2, 3, 4]  # decoder indices of the MoE layers

    # without --dense-layers the dense placeholder rows are read as routes: a duplicate id, named
    rc, text = _import(capsys, "slime", [tmp_path / "rollout_data_0.pt"], tmp_path / "o.npz", "--num-experts", str(E))
    assert rc == 1 and "rollout_data_0.pt: samples[0]['rollout_routed_experts']: row 0, layer 0: duplicate" in text
    del samples[1]["rollout_routed_experts"]
    torch.save(dict(rollout_id=0, samples=samples), tmp_path / "bad.pt")
    rc, text = _import(capsys, "slime", [tmp_path / "bad.pt"], tmp_path / "o.npz", "--num-experts", str(E),
                       "--dense-layers", "0")
    assert rc == 1 and "bad.pt: field samples[1]'rollout_routed_experts' is missing" in text


def test_nemo_rl_data_dict(tmp_path, capsys, model_config):
    truth = _truth(3)
    S = max(p + r for p, r in LENGTHS)
    ids = torch.zeros(len(truth), S, L, K, dtype=torch.int64)
    for b, t in enumerate(truth):
        ids[b, :t.shape[0]] = torch.from_numpy(t)
    lengths = torch.tensor([t.shape[0] for t in truth])
    torch.save({"routed_experts": ids, "input_lengths": lengths, "input_ids": torch.zeros(len(truth), S)},
               tmp_path / "train_data.pt")
    rc, text = _import(capsys, "nemo-rl", [tmp_path / "train_data.pt"], tmp_path / "out.npz", "--model-config",
                       str(model_config))
    assert rc == 0, text
    _check(tmp_path / "out.npz", truth)
    torch.save({"routed_experts": ids[:, :, :3], "input_lengths": lengths}, tmp_path / "three.pt")
    rc, text = _import(capsys, "nemo-rl", [tmp_path / "three.pt"], tmp_path / "o.npz", "--model-config",
                       str(model_config))
    assert rc == 1 and "has MoE layers=3" in text


def test_vllm_requests(tmp_path, capsys):
    truth = _truth(4)
    reqs = [{"prompt_routed_experts": t[:p].astype(np.int16), "routed_experts": t[p:].astype(np.int16)}
            for (p, _), t in zip(LENGTHS, truth, strict=True)]
    torch.save(reqs, tmp_path / "rollout.pt")
    rc, text = _import(capsys, "vllm", [tmp_path / "rollout.pt"], tmp_path / "out.npz", "--num-experts", str(E))
    assert rc == 0, text
    _check(tmp_path / "out.npz", truth)
    torch.save([reqs[0], {"prompt_routed_experts": reqs[1]["prompt_routed_experts"]}], tmp_path / "bad.pt")
    rc, text = _import(capsys, "vllm", [tmp_path / "bad.pt"], tmp_path / "o.npz", "--num-experts", str(E))
    assert rc == 1 and "bad.pt: field [1]'routed_experts' is missing" in text
    # the batched layout (SkyRL-style), response only, as an .npz
    R = max(r for _, r in LENGTHS)
    resp = np.zeros((3, R, L, K), np.int16)
    rmask = np.zeros((3, R), bool)
    for b, ((p, r), t) in enumerate(zip(LENGTHS, truth, strict=True)):
        resp[b, :r], rmask[b, :r] = t[p:], True
    np.savez(tmp_path / "batched.npz", routed_experts=resp, response_mask=rmask,
             prompt_lengths=np.array([p for p, _ in LENGTHS]))
    rc, text = _import(capsys, "vllm", [tmp_path / "batched.npz"], tmp_path / "out2.npz", "--num-experts", str(E))
    assert rc == 0, text
    _check(tmp_path / "out2.npz", [t[p:] for (p, _), t in zip(LENGTHS, truth, strict=True)],
           starts=[p for p, _ in LENGTHS])


def test_sglang_jsonl(tmp_path, capsys):
    truth = _truth(5)
    lines = []
    for (p, r), t in zip(LENGTHS, truth, strict=True):
        # the payload covers P + C - 1 fed tokens: our truth rows are those fed tokens (C = r + 1 generated)
        lines.append(json.dumps({"text": "...", "meta_info": {
            "prompt_tokens": p, "completion_tokens": r + 1,
            "routed_experts": base64.b64encode(t.astype(np.int32).tobytes()).decode("ascii")}}))
    (tmp_path / "responses.jsonl").write_text("\n".join(lines) + "\n")
    rc, text = _import(capsys, "sglang", [tmp_path / "responses.jsonl"], tmp_path / "out.npz", "--num-experts",
                       str(E), "--top-k", str(K))
    assert rc == 0, text
    _check(tmp_path / "out.npz", truth)
    (tmp_path / "bad.jsonl").write_text(lines[0] + "\n{not json\n")
    rc, text = _import(capsys, "sglang", [tmp_path / "bad.jsonl"], tmp_path / "o.npz", "--top-k", str(K))
    assert rc == 1 and "bad.jsonl: line 2 is not JSON" in text


def test_megatron_router_replay(tmp_path, capsys):
    truth = _truth(6)
    files = []
    for i, t in enumerate(truth):  # RouterReplay.get_recorded_data(): one [T, k] tensor per MoE layer
        torch.save([torch.from_numpy(t[:, layer]) for layer in range(L)], tmp_path / f"mb{i}.pt")
        files.append(tmp_path / f"mb{i}.pt")
    rc, text = _import(capsys, "megatron", files, tmp_path / "out.npz", "--num-experts", str(E))
    assert rc == 0, text
    _check(tmp_path / "out.npz", truth)
    torch.save({"indices": 1}, tmp_path / "dict.pt")
    rc, text = _import(capsys, "megatron", [tmp_path / "dict.pt"], tmp_path / "o.npz", "--num-experts", str(E))
    assert rc == 1 and "dict.pt: expected RouterReplay.get_recorded_data()" in text


def test_plain_ids_offsets(tmp_path, capsys):
    truth = _truth(7)
    offsets = np.concatenate([[0], np.cumsum([t.shape[0] for t in truth])])
    np.savez(tmp_path / "mine.npz", ids=np.concatenate(truth).astype(np.int16), offsets=offsets, num_experts=E)
    rc, text = _import(capsys, "npz", [tmp_path / "mine.npz"], tmp_path / "out.npz")
    assert rc == 0, text
    _check(tmp_path / "out.npz", truth)
    np.savez(tmp_path / "bad.npz", ids=np.concatenate(truth), offsets=offsets[:-1], num_experts=E)
    rc, text = _import(capsys, "npz", [tmp_path / "bad.npz"], tmp_path / "o.npz")
    assert rc == 1 and "bad.npz: field 'offsets' must be [B + 1]" in text
    np.savez(tmp_path / "e.npz", ids=np.concatenate(truth), offsets=offsets)
    rc, text = _import(capsys, "npz", [tmp_path / "e.npz"], tmp_path / "o.npz")
    assert rc == 1 and "needs the expert count" in text


def test_import_argument_errors(tmp_path, capsys):
    rc, text = _import(capsys, "npz", [tmp_path / "none.npz"], tmp_path / "o.npz", "--num-experts", "8")
    assert rc == 1 and "none.npz: no such file" in text
    rc, text = _import(capsys, "npz", [], tmp_path / "o.npz", "--num-experts", "8")
    assert rc == 1 and "needs at least one dump file" in text
    rc, text = _import(capsys, "npz", [tmp_path / "x.npz"], tmp_path / "o.npz", "--requests", "3")
    assert rc == 1 and "--requests only applies to trace import gpt-oss" in text


# ------------------------------------------------------------------------------- --model-config
@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory):
    transformers = pytest.importorskip("transformers")
    d = tmp_path_factory.mktemp("gptoss")
    transformers.GptOssConfig(hidden_size=2880, intermediate_size=2880, num_local_experts=32, num_experts_per_tok=4,
                              num_hidden_layers=24, num_attention_heads=64, num_key_value_heads=8, head_dim=64,
                              dtype="bfloat16").save_pretrained(d)
    rng = np.random.default_rng(0)
    traces = [RoutingTrace(np.argsort(rng.random((int(rng.integers(5, 20)), 24, 32)), axis=-1)[..., :4], np.arange(24),
                           32, 4) for _ in range(8)]
    TraceBatch(traces, micro_batch=np.arange(8) // 2).save(d / "trace.npz")
    return d / "config.json", d / "trace.npz"


def _json(capsys, argv):
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out)


def test_model_config_matches_preset(gpt_oss, tmp_path, capsys):
    cfg, trace = gpt_oss
    common = ["--nodes", "2", "--gpus-per-node", "2", "--strategy", "eplb", "--replica-slots", "1", "--json"]
    a = _json(capsys, ["plan", str(trace), "--model", "gpt-oss-20b", "--out", str(tmp_path / "a.npz"), *common])
    b = _json(capsys, ["plan", str(trace), "--model-config", str(cfg), "--out", str(tmp_path / "b.npz"), *common])
    for d in (a, b):
        d.pop("plan"), d.pop("model"), d.pop("solve_s")
    assert a == b
    for cmd in ("score", "simulate"):
        x = _json(capsys, [cmd, str(trace), str(tmp_path / "a.npz"), "--model", "gpt-oss-20b", "--json"])
        y = _json(capsys, [cmd, str(trace), str(tmp_path / "a.npz"), "--model-config", str(cfg), "--json"])
        x.pop("model"), y.pop("model")
        assert x == y, cmd
    outs = []
    for flag in (["--model", "gpt-oss-20b"], ["--model-config", str(cfg)]):
        out = tmp_path / f"cmp{len(outs)}.json"
        assert main(["compare", str(trace), *flag, "--nodes", "1", "--gpus-per-node", "4", "--strategies",
                     "static,eplb", "--json", str(out)]) == 0
        res = json.loads(out.read_text())
        outs.append({s: {k: v["first"][k] for k in ("experts_moved", "rank_skew_mean", "step_s", "t_moe_s")}
                     for s, v in res["strategies"].items()})
    capsys.readouterr()
    assert outs[0] == outs[1] and set(outs[0]) == {"static", "eplb", "static@length-balanced", "eplb@length-balanced"}


def test_model_flags_are_exclusive_and_required(gpt_oss, tmp_path, capsys):
    cfg, trace = gpt_oss
    with pytest.raises(SystemExit):
        main(["compare", str(trace), "--nodes", "1"])
    assert "one of the arguments --model --model-config is required" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["compare", str(trace), "--nodes", "1", "--model", "gpt-oss-20b", "--model-config", str(cfg)])
    assert "not allowed with argument" in capsys.readouterr().err
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    assert main(["compare", str(trace), "--nodes", "1", "--model-config", str(tmp_path / "config.json")]) == 1
    assert "--model-config: model config" in capsys.readouterr().err


def test_trace_synth_with_model_config(model_config, tmp_path, capsys):
    out = tmp_path / "s.npz"
    assert main(["trace", "synth", "--model-config", str(model_config), "--domain", "math", "--prompts", "2",
                 "--responses", "2", "--out", str(out)]) == 0
    capsys.readouterr()
    batch = TraceBatch.load(out)
    assert (batch.num_layers, batch.num_experts, batch.top_k, batch.num_sequences) == (L, E, K, 4)
