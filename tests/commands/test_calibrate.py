"""relibra calibrate: --dry-run writes the preset's profile (and says so), the measurement code runs on CPU at tiny
shapes, and plan / compare accept the profile."""

from __future__ import annotations

import json

import numpy as np
import pytest

from relibra_moe.cli import main
from relibra_moe.commands.calibrate import calibrate, measure_all_to_all, measure_attention, measure_gemm
from relibra_moe.errors import PlanError
from relibra_moe.specs import ModelSpec, cluster_from_profile, cluster_preset, load_cluster_profile, model_preset
from relibra_moe.synthetic import rl_batch

TINY = ModelSpec("tiny", hidden=32, ffn=16, num_experts=8, top_k=2, num_layers=2, num_heads=4, num_kv_heads=2,
                 head_dim=8)


def test_dry_run_writes_the_preset_profile(tmp_path, capsys):
    out = tmp_path / "h200.json"
    assert main(["calibrate", "--model", "qwen3-30b-a3b", "--preset", "h200", "--dry-run", "--rdma-bw", "40",
                 "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "dry run: nothing measured" in text
    prof = json.loads(out.read_text())
    assert prof["measurements"] == {"dry_run": True, "model": "qwen3-30b-a3b", "expert_shape": [2048, 768]}
    assert "dry run, nothing measured" in prof["source"] and "2048 x 768" in prof["source"]
    c = load_cluster_profile(out, nodes=2)
    ref = cluster_preset("h200", nodes=2)
    assert (c.flops, c.attention_flops, c.nvlink_bw, c.dispatcher) == (ref.flops, ref.attention_flops,
                                                                        ref.nvlink_bw, "alltoall")
    assert c.rdma_bw == 40e9  # the user's inter-node rate
    assert main(["calibrate", "--model", "qwen3-30b-a3b", "--preset", "nope", "--dry-run", "--out",
                 str(tmp_path / "x.json")]) == 1
    assert "--preset 'nope' is unknown" in capsys.readouterr().err


def test_calibrate_measures_the_models_own_shape(tmp_path, capsys):
    """--model-config: the shape of the given HF config is the one the profile records (and, on a GPU, measures);
    --model and --model-config exclude each other."""
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"model_type": "qwen3_moe", "hidden_size": 4096, "moe_intermediate_size": 1536,
                               "num_experts": 128, "num_experts_per_tok": 8, "num_hidden_layers": 94,
                               "num_attention_heads": 64, "num_key_value_heads": 4, "head_dim": 128,
                               "intermediate_size": 12288, "vocab_size": 151936}))
    out = tmp_path / "p.json"
    assert main(["calibrate", "--model-config", str(cfg), "--dry-run", "--out", str(out)]) == 0
    prof = json.loads(out.read_text())
    assert prof["measurements"]["expert_shape"] == [4096, 1536] and "4096 x 1536" in prof["source"]
    capsys.readouterr()
    with pytest.raises(SystemExit):
        main(["calibrate", "--model", "qwen3-30b-a3b", "--model-config", str(cfg), "--dry-run", "--out", str(out)])
    # on CPU the measurement runs at the config's shape: the curve's FLOPs are 18 h h' R / t for h x h' = 32 x 16
    prof = calibrate(TINY, "h100", rows=(2,), rows_per_expert=2, local_experts=2, seq_len=8, device="cpu", iters=1)
    assert prof["measurements"]["expert_shape"] == [32, 16] and "32 x 16" in prof["source"]


def test_measurements_run_on_cpu():
    """The GEMM (Triton interpreter) and attention measurements at tiny shapes: positive rates whose FLOPs are
    18 h h' R (GEMM) and 3 x timing.attention_flops (attention)."""
    pts = measure_gemm(TINY, (2, 4), local_experts=2, device=__import__("torch").device("cpu"), iters=1, warmup=0)
    assert [p["rows_per_expert"] for p in pts] == [2.0, 4.0]
    for p, rows in zip(pts, (2, 4)):
        assert p["flops"] == pytest.approx(18 * 32 * 16 * rows * 2 / p["seconds"])
    att = measure_attention(TINY, seq_len=8, batch=1, device=__import__("torch").device("cpu"), iters=1, warmup=0)
    from relibra_moe.timing import attention_flops

    assert att["flops"] == pytest.approx(3 * attention_flops(np.array([8]), TINY)[0] / att["seconds"])


def test_calibrate_on_cpu_builds_a_profile():
    prof = calibrate(TINY, "h100", rows=(2, 4), rows_per_expert=2, local_experts=2, seq_len=8, device="cpu",
                     iters=1)
    assert prof["flops"] == pytest.approx(prof["measurements"]["gemm"][0]["flops"])
    assert prof["gemm_curve"][1][0] == 4.0 and prof["attn_flops"] == prof["measurements"]["attention"]["flops"]
    assert prof["nvlink_bw"] == cluster_preset("h100").nvlink_bw and "not measured" in prof["measurements"]["nvlink"]
    assert prof["source"].startswith("NOT A GPU PROFILE") and prof["name"] == "h100-cpu-check"
    with pytest.raises(PlanError, match="not a GPU profile"):
        cluster_from_profile(prof, nodes=1)
    assert cluster_from_profile(prof, nodes=1, allow_cpu_profile=True).flops == prof["flops"]


@pytest.mark.parametrize("flags,fragment", [
    (["--iters", "-1"], "--iters must be a positive int, got -1"),
    (["--rows", "4,-2"], "--rows=[4, -2] must be positive row counts"),
    (["--seq-len", "0"], "--seq-len must be a positive int, got 0"),
    (["--local-experts", "-3"], "--local-experts must be a positive int, got -3"),
    (["--rows-per-expert", "nan"], "--rows-per-expert=nan must be a finite number > 0"),
    (["--gpus-per-node", "0"], "--gpus-per-node must be a positive int, got 0"),
    (["--rdma-bw", "1e-300"], "--rdma-bw (bytes/s) must be a rate in [1e-06, 1e+20], got 1e-291"),
    (["--device", "foo"], "--device 'foo' is not a torch device"),
    (["--device", "meta"], "--device 'meta': calibrate measures a CUDA GPU"),
])
def test_calibrate_flags_are_checked(flags, fragment, tmp_path, capsys):
    out = tmp_path / "p.json"
    assert main(["calibrate", "--model", "qwen3-30b-a3b", *flags, "--out", str(out)]) == 1
    err = capsys.readouterr().err
    assert "error: PlanError: " in err and fragment in err and "Traceback" not in err, err
    assert not out.exists()


def test_calibrate_out_is_checked_before_measuring(tmp_path, capsys):
    for out, want in ((tmp_path / "missing" / "p.json", "does not exist"), (tmp_path, "is a directory")):
        assert main(["calibrate", "--model", "qwen3-30b-a3b", "--device", "foo", "--out", str(out)]) == 1
        err = capsys.readouterr().err
        assert want in err and "--device" not in err, err


@pytest.mark.timeout(120)
def test_all_to_all_measurement_gloo():
    res = measure_all_to_all(2, nbytes=1 << 16, iters=2, backend="gloo", timeout_s=90)
    assert res["world"] == 2 and res["bytes_per_gpu"] == 1 << 16 and res["bw"] > 0


@pytest.mark.timeout(300)
def test_plan_and_compare_accept_the_profile(tmp_path, capsys):
    """plan --cluster-profile charges the profile's rates: its T_MoE is the library's under that ClusterSpec."""
    from relibra_moe.evaluate import score_plan
    from relibra_moe.plan import BatchPlan
    from relibra_moe.trace import TraceBatch

    trace = tmp_path / "t.npz"
    prof = tmp_path / "p.json"
    assert main(["calibrate", "--model", "qwen3-30b-a3b", "--preset", "h800", "--dispatcher", "deepep",
                 "--gpus-per-node", "4", "--dry-run", "--out", str(prof)]) == 0
    capsys.readouterr()
    cluster = load_cluster_profile(prof, nodes=2)
    plan_path = tmp_path / "plan.npz"
    full = model_preset("qwen3-30b-a3b")
    big = rl_batch(full, "mixed", 4, seed=0, micro_batch_size=4, max_len=256)
    big.save(trace)
    assert main(["plan", str(trace), "--model", "qwen3-30b-a3b", "--nodes", "2", "--gpus-per-node", "4",
                 "--strategy", "static", "--cluster-profile", str(prof), "--out", str(plan_path), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    ref = score_plan(BatchPlan.load(plan_path), TraceBatch.load(trace), full, cluster)
    assert out["t_moe_s"] == pytest.approx(ref.t_moe_s)
    assert out["cluster"]["dispatcher"] == "deepep" and out["cluster"]["name"] == "h800"
    assert main(["score", str(trace), str(plan_path), "--model", "qwen3-30b-a3b", "--cluster-profile", str(prof),
                 "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["t_moe_s"] == pytest.approx(ref.t_moe_s)
    assert main(["score", str(trace), str(plan_path), "--model", "qwen3-30b-a3b", "--json"]) == 0
    default = score_plan(BatchPlan.load(plan_path), TraceBatch.load(trace), full, cluster_preset(nodes=2,
                                                                                                 gpus_per_node=4))
    assert json.loads(capsys.readouterr().out)["t_moe_s"] == pytest.approx(default.t_moe_s)
    assert default.t_moe_s != pytest.approx(ref.t_moe_s, rel=1e-3)
    assert main(["compare", str(trace), "--model", "qwen3-30b-a3b", "--nodes", "2", "--gpus-per-node", "4",
                 "--strategies", "static", "--layers", "1", "--cluster-profile", str(prof), "--json",
                 str(tmp_path / "c.json")]) == 0
    assert json.loads((tmp_path / "c.json").read_text())["strategies"]["static"]["steady"]["step_s"] > 0


def test_planner_accepts_a_profile(tmp_path):
    """The library path: Planner on load_cluster_profile's ClusterSpec plans under the profile's rates."""
    from relibra_moe import Planner, load_cluster_profile
    from relibra_moe.evaluate import score_plan

    prof = tmp_path / "p.json"
    assert main(["calibrate", "--model", "qwen3-30b-a3b", "--preset", "h800", "--gpus-per-node", "4", "--dry-run",
                 "--out", str(prof)]) == 0
    model = model_preset("qwen3-30b-a3b").with_(num_layers=1)
    cluster = load_cluster_profile(prof, nodes=2)
    batch = rl_batch(model, "math", 4, seed=0, micro_batch_size=8, max_len=128)
    plan = Planner(model, cluster, strategy="relibra-inter", replica_slots=0).plan(batch)
    plan.validate(model, cluster)
    s = score_plan(plan, batch, model, cluster).t_moe_s
    assert s == pytest.approx(score_plan(plan, batch, model, cluster_preset("h800", nodes=2, gpus_per_node=4)).t_moe_s)
