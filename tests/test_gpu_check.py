"""bench/gpu_check.sh: the dry run (every stage on CPU: interpreter, tiny shapes) passes and writes its
files under OUTDIR, and a failing stage does not stop the others."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "gpu_check.sh"
STAGES = ("env", "tests", "kernels", "layer", "graph")


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
    assert (tmp_path / "tests.xml").exists() and (tmp_path / "tests.log").exists()


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
