"""`relibra trace import|synth|stats` through relibra_moe.cli.main."""

from __future__ import annotations

import json

import numpy as np
import pytest

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
