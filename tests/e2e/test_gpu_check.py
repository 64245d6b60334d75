"""bench/gpu_check.sh: the dry run (every stage on CPU: interpreter, tiny shapes) passes and writes its
files under OUTDIR, and a failing stage does not stop the others."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "gpu_check.sh"
STAGES = ("env", "tests", "kernels", "layer", "graph", "replay_graph", "calibrate")


def _summary(out: Path) -> dict[str, str]:
    lines = (out / "summary.txt").read_text().splitlines()[1:]
    return {line.split()[0]: line for line in lines}


@pytest.mark.timeout(900)
def test_dry_run_passes_every_stage(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "RELIBRA_TEST_DEVICE")}
    res = subprocess.run(["bash", str(SCRIPT), "--dry-run", str(tmp_path)], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=840)
    summary = _summary(tmp_path)
    assert list(summary) == list(STAGES), res.stdout[-3000:]
    assert res.returncode == 0, res.stdout[-6000:] + res.stderr[-2000:]
    assert all(" rc=0 " in line for line in summary.values()), summary
    assert json.loads((tmp_path / "env.json").read_text())["device"] == "cpu (Triton interpreter)"
    kernels = json.loads((tmp_path / "kernels.json").read_text())
    checks = kernels["correctness"]["bfloat16"]
    assert kernels["correctness_ok"] and len(checks) >= 13
    assert all(c["ok"] and c["triton"] for c in checks.values())  # every op ran its Triton kernel
    layer = json.loads((tmp_path / "layer.json").read_text())
    assert layer["ok"] and layer["experts"]["relibra"]["rel_err_vs_eager_loop"]["y"] < 1e-4
    assert layer["replica_slot_rows"] > 0 and "layer_world1_fwd_bwd_ms" in layer
    graph = json.loads((tmp_path / "graph.json").read_text())
    assert graph["ok"] and graph["eager_bitwise_deterministic"] and graph["capture"].startswith("not run")
    rgraph = json.loads((tmp_path / "replay_graph.json").read_text())
    assert rgraph["ok"] and rgraph["routing_a_differs_from_b"] and rgraph["max_abs_err_vs_eager_b"] < 1e-5
    assert rgraph["capture"].startswith("not run")
    assert (tmp_path / "tests.xml").exists() and (tmp_path / "tests.log").exists()
    prof = json.loads((tmp_path / "cluster_profile.json").read_text())
    assert prof["name"] == "h200" and prof["measurements"] == {"dry_run": True, "model": "qwen3-30b-a3b",
                                                              "expert_shape": [2048, 768]}
    assert "dry run: nothing measured" in (tmp_path / "calibrate.log").read_text()


def test_a_failing_stage_does_not_stop_the_others(tmp_path):
    """With a Python that always fails, every stage still runs, is recorded, and the script exits 1."""
    res = subprocess.run(["bash", str(SCRIPT), "--dry-run", str(tmp_path)], cwd=ROOT,
                         env={**os.environ, "PYTHON": "false"}, capture_output=True, text=True, timeout=120)
    summary = _summary(tmp_path)
    assert res.returncode == 1
    assert list(summary) == list(STAGES)
    assert all(" rc=0 " not in line for name, line in summary.items() if name != "env"), summary


def test_usage_is_checked(tmp_path):
    res = subprocess.run(["bash", str(SCRIPT)], cwd=ROOT, capture_output=True, text=True, timeout=30)
    assert res.returncode == 2 and "usage" in res.stderr


def test_kernel_benchmark_timing_code_runs_end_to_end(tmp_path, monkeypatch):
    """The CUDA-only timing code of bench/kernels.py at tiny shapes on CPU (torch reference, a stand-in
    timer of 1 ms per call): every figure lands in the JSON, and every target is evaluated from it."""
    import sys

    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    monkeypatch.delitem(sys.modules, "kernels", raising=False)  # imported from bench/ below, removed after
    import kernels

    from relibra_moe.triton_kernels.backend import force_backend

    calls = []
    monkeypatch.setattr(kernels, "bench_ms", lambda fn: (calls.append(fn()), 1.0)[1])
    rep = kernels.JsonReport(tmp_path / "k.json")
    with force_backend("torch"):
        for routing in ("uniform", "skewed"):
            kernels.bench_routing(rep, ("results", "qwen3-30b-a3b", routing), "qwen3-30b-a3b", 32, 4, 8, 32, 16,
                                  routing, 2, 16, dev="cpu")
        kernels.bench_replica_copy(rep, ("results", "qwen3-30b-a3b", "replica"), 8, 32, 16, 2, dev="cpu")
    saved = json.loads((tmp_path / "k.json").read_text())["results"]["qwen3-30b-a3b"]
    assert saved["skewed"]["max_slot_share"] >= 0.3 > saved["uniform"]["max_slot_share"]
    gate_up = saved["uniform"]["gemm"]["gate_up"]
    assert gate_up["fwd_vs_dense"] == 1.0 and "expert_weights_fwd_tflops" in gate_up
    assert "torch_grouped_mm_error" in gate_up or "torch_grouped_mm_tflops" in gate_up  # never silently dropped
    mlp = saved["uniform"]["expert_mlp"]
    assert set(mlp) >= {"plain", "replica_slots", "dense", "fwd_bwd_vs_dense"} and mlp["fwd_bwd_vs_dense"] == 1.0
    assert saved["uniform"]["k1_permute_vs_copy"] > 0 and saved["replica"]["add_slot_grads_vs_copy"] > 0
    rows = kernels.evaluate_targets({"qwen3-30b-a3b": saved})
    by = {r["target"]: r for r in rows}
    assert by["gemm_fwd_vs_dense[gate_up]"]["minimum"] == 0.60 and by["gemm_fwd_vs_dense[gate_up]"]["status"] == "met"
    assert by["mlp_fwd_bwd_vs_dense"]["status"] == "met"
    # ratios to copy_ with a constant timer are byte ratios: the replica copy moves 2x, the add-back 3x
    assert by["replica_copy_vs_copy"]["ratio"] == 1.0 and by["add_slot_grads_vs_copy"]["ratio"] == 1.5
    assert {r["target"].split("[")[0] for r in rows} == set(kernels.TARGETS)
    assert all(r["status"] in ("met", "missed", "not measured") for r in rows)
    missed = kernels.evaluate_targets({"qwen3-235b-a22b": {"uniform": {"gemm": {"down": {"fwd_vs_dense": 0.65}}}}})
    down = [(r["minimum"], r["status"]) for r in missed if r["target"] == "gemm_fwd_vs_dense[down]"]
    assert down == [(0.70, "missed")]
    assert all(r["status"] == "not measured" for r in missed if not r["target"].startswith("gemm_fwd_vs_dense"))
    assert len(calls) >= 2 * 20  # every measurement ran its op (the stand-in timer calls it once)
