"""Trace-file I/O benchmark: synth -> save -> load -> sample_expert_counts, and `relibra plan` on the file.

Times, in seconds of wall clock (and, under ``cpu_s``, CPU seconds of each stage, since the machine may be
shared), for one synthetic RL batch (labelled synthetic):

- ``synth_s``: ``synthetic.rl_batch`` (per-sample expert counts; no per-token ids are made);
- ``save_counts_only_s`` / ``save_ids_s``: ``TraceBatch.save`` without / with the per-token ids
  (the ids are materialized one sequence at a time); file sizes in bytes next to them;
- ``load_s`` and ``counts_s``: ``TraceBatch.load`` of each file and its ``sample_expert_counts()``
  (a version-2 file is read without its ids, so both are the same for the two files);
- ``cli_synth_s`` / ``cli_plan_s`` / ``cli_simulate_s`` (with ``--cli``): the commands ``relibra trace synth
  ... --counts-only``, ``relibra plan FILE ...`` and ``relibra simulate FILE PLAN`` run as subprocesses, as a
  user runs them; ``cli_end_to_end_s`` is their sum (issue 14's targets: plan <= 15 s, all three <= 30 s).

The loaded counts are checked equal to the in-memory batch's (and the lengths and micro-batches).

Usage::

    python bench/trace_io.py                                   # qwen3-235b-a22b mixed, 256 prompts, seed 5
    python bench/trace_io.py --no-ids --cli --plan-args "--nodes 4 --gpus-per-node 8 --strategy relibra \\
        --replica-slots 2 --workers 2"
    python bench/trace_io.py --model qwen3-30b-a3b --prompts 32 --out bench/results/trace_io_small.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

CPU_S: dict[str, float] = {}  # stage -> CPU seconds (this process, or the child): the machine is shared


def _timed(fn: Any, stage: str) -> tuple[Any, float]:
    t0, c0 = time.perf_counter(), time.process_time()
    out = fn()
    CPU_S[stage] = time.process_time() - c0
    return out, time.perf_counter() - t0


def _cli(argv: list[str], stage: str) -> float:
    """Wall seconds to run ``python -m relibra_moe.cli ARGV`` (raises on a non-zero exit); CPU seconds to CPU_S."""
    r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "relibra_moe.cli", *argv], check=True, stdout=subprocess.DEVNULL)
    wall = time.perf_counter() - t0
    r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    CPU_S[stage] = (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)
    return wall


def run(model: str, domain: str, prompts: int, seed: int, ids: bool, cli: bool, plan_args: str,
        workdir: Path) -> dict[str, Any]:
    """The measurements as a JSON-ready dict (see the module docstring)."""
    from relibra_moe.synthetic import rl_batch
    from relibra_moe.trace import TraceBatch

    out: dict[str, Any] = {"model": model, "domain": domain, "prompts": prompts, "seed": seed,
                           "machine": {"cpus": os.cpu_count(), "python": platform.python_version()}}
    batch, out["synth_s"] = _timed(lambda: rl_batch(model, domain, prompts, seed=seed, micro_batch_size=32), "synth")
    out["samples"], out["tokens"] = batch.num_sequences, batch.num_tokens
    ref = batch.sample_expert_counts()
    files = {"counts_only": workdir / "counts_only.npz"}
    _, out["save_counts_only_s"] = _timed(lambda: batch.save(files["counts_only"], counts_only=True),
                                          "save_counts_only")
    if ids:
        files["ids"] = workdir / "ids.npz"
        _, out["save_ids_s"] = _timed(lambda: batch.save(files["ids"]), "save_ids")
    for name, path in files.items():
        out[f"file_{name}_bytes"] = path.stat().st_size
        loaded, out[f"load_{name}_s"] = _timed(lambda path=path: TraceBatch.load(path), f"load_{name}")
        counts, out[f"counts_{name}_s"] = _timed(loaded.sample_expert_counts, f"counts_{name}")
        if not (np.array_equal(counts, ref) and np.array_equal(loaded.lengths, batch.lengths)
                and np.array_equal(loaded.micro_batch, batch.micro_batch)):
            raise SystemExit(f"{path}: the loaded batch differs from the batch in memory")
    if cli:
        path = workdir / "cli.npz"
        out["cli_synth_s"] = _cli(["trace", "synth", "--model", model, "--domain", domain, "--prompts", str(prompts),
                                   "--seed", str(seed), "--counts-only", "--out", str(path)], "cli_synth")
        out["plan_args"] = plan_args
        out["cli_plan_s"] = _cli(["plan", str(path), "--model", model, *shlex.split(plan_args),
                                  "--out", str(workdir / "plan.npz"), "--json"], "cli_plan")
        out["cli_simulate_s"] = _cli(["simulate", str(path), str(workdir / "plan.npz"), "--model", model, "--json"],
                                     "cli_simulate")
        out["cli_end_to_end_s"] = out["cli_synth_s"] + out["cli_plan_s"] + out["cli_simulate_s"]
    out["cpu_s"] = dict(CPU_S)
    out["load_average_1min_after"] = os.getloadavg()[0]
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen3-235b-a22b")
    ap.add_argument("--domain", default="mixed")
    ap.add_argument("--prompts", type=int, default=256)
    ap.add_argument("--seed", type=int, default=5)
    ap.add_argument("--no-ids", action="store_true", help="skip the file with per-token ids")
    ap.add_argument("--cli", action="store_true",
                    help="also time `relibra trace synth`, `relibra plan` and `relibra simulate`")
    ap.add_argument("--plan-args", default="--nodes 4 --gpus-per-node 8 --strategy relibra --replica-slots 2",
                    help="arguments of `relibra plan` after the trace and model (default: %(default)s)")
    ap.add_argument("--out", default="bench/results/trace_io.json", help="JSON output (default: %(default)s)")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as d:
        res = run(args.model, args.domain, args.prompts, args.seed, not args.no_ids, args.cli, args.plan_args, Path(d))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=2) + "\n")
    print(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
