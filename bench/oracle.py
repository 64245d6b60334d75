"""Behaviour oracle: plan-file hashes, scores and simulated steps for a fixed matrix of batches.

A refactor must leave every entry unchanged: plan files byte-identical (their sha256), every score and
simulated figure equal. ``tests/e2e/test_oracle.py`` recomputes the matrix and compares it with
``tests/data/oracle.json``; regenerate that file only for a change in behaviour made on purpose (and say
which in the commit):

    python bench/oracle.py --write tests/data/oracle.json      # record
    python bench/oracle.py --check tests/data/oracle.json      # compare (what the test does)

Matrix: every strategy x {real GPT-OSS-20B EP8 (2 x 4) r = 2, synthetic qwen3-30b-a3b mixed EP16 (2 x 8)
r = 2} x seeds {0, 1}, through ``plan_batch`` and (relibra, relibra-inter) through an inline ``Planner``.
The GPT-OSS cases need ``../shared/traces`` and are left out (named in ``skipped``) when it is absent.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import math
import sys
import tempfile
from pathlib import Path
from typing import Any

STRATEGY_NAMES = ("static", "lpt", "eplb", "lplb", "relibra-inter", "relibra", "balanced")
SEEDS = (0, 1)
SCORE_KEYS = {"t_moe_total_s": "t_moe_s", "t_moe_smooth_total_s": "t_moe_smooth_s", "comp_total_s": "moe_fwd_comp_s",
              "comm_total_s": "moe_fwd_comm_s", "rank_skew_mean": "rank_skew_mean", "rank_skew_max": "rank_skew_max"}
STEP_KEYS = {"step_s": "step_s", "t_moe_fwd_s": "t_moe_s", "experts_moved": "experts_moved",
             "reorder_bytes": "reorder_bytes", "replica_push_s": "replica_push_s", "replica_pull_s": "replica_pull_s"}
"""The recorded figures: the key in the oracle file (the names the figures had when it was recorded, kept so that
the record stays valid) -> the ``PlanScore`` field / ``StepTime.to_dict`` key of today (docs/architecture.md,
"One name per figure")."""


def _scenarios(seed: int) -> dict[str, tuple[Any, Any, Any]]:
    """name -> (batch, ModelSpec, ClusterSpec); GPT-OSS only when the traces are present."""
    from relibra_moe import cluster_preset, model_preset
    from relibra_moe.errors import RelibraError
    from relibra_moe.synthetic import rl_batch

    out: dict[str, tuple[Any, Any, Any]] = {}
    try:
        from relibra_moe.datasets import gpt_oss_batch

        out["gpt-oss-ep8"] = (gpt_oss_batch(num_requests=128, seed=seed).with_micro_batch_size(16),
                              model_preset("gpt-oss-20b"), cluster_preset("hopper-rail", nodes=2, gpus_per_node=4))
    except (RelibraError, FileNotFoundError, OSError):
        pass
    model = model_preset("qwen3-30b-a3b")
    out["qwen3-30b-mixed-ep16"] = (rl_batch(model, "mixed", 16, seed=seed, micro_batch_size=8), model,
                                   cluster_preset("hopper-rail", nodes=2, gpus_per_node=8))
    return out


def _plan_sha(plan: Any) -> str:
    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / "plan.npz"
        plan.save(p)
        return hashlib.sha256(p.read_bytes()).hexdigest()


def compute() -> dict[str, Any]:
    """The oracle matrix as a JSON-ready dict ``{"cases": {key: {...}}, "skipped": [...]}``."""
    from relibra_moe import Planner
    from relibra_moe.evaluate import score_plan
    from relibra_moe.planners.strategies import plan_batch
    from relibra_moe.sim import simulate_step

    cases: dict[str, Any] = {}
    have = set()
    for seed in SEEDS:
        for name, (batch, model, cluster) in _scenarios(seed).items():
            have.add(name)
            runs = [(s, "plan_batch") for s in STRATEGY_NAMES] + [(s, "planner") for s in ("relibra-inter", "relibra")]
            for strategy, via in runs:
                r = 2 if strategy in ("eplb", "lplb", "relibra") else 0
                if via == "plan_batch":
                    plan = plan_batch(batch, model, cluster, strategy, replica_slots=r, seed=seed)
                else:
                    # workers fixed: the Planner's default (the CPU count) sets num_seeds
                    plan = Planner(model, cluster, strategy=strategy, replica_slots=r, seed=seed, workers=2,
                                   executor="inline").plan(batch)
                score = score_plan(plan, batch, model, cluster).to_dict()
                step = simulate_step(plan, batch, model, cluster).to_dict()
                cases[f"{name}/{strategy}/{via}/seed{seed}"] = {
                    "plan_sha256": _plan_sha(plan),
                    "score": {k: score[f] for k, f in SCORE_KEYS.items()},
                    "step": {k: step[f] for k, f in STEP_KEYS.items()},
                }
    skipped = [] if "gpt-oss-ep8" in have else ["gpt-oss-ep8 (traces absent)"]
    return {"cases": cases, "skipped": skipped}


def compare(expected: dict[str, Any], got: dict[str, Any], rel: float = 1e-12) -> list[str]:
    """Differences between two oracle dicts (cases missing from ``got`` because of skips are ignored)."""
    diffs = []
    for key, want in expected["cases"].items():
        if key not in got["cases"]:
            if not any(key.startswith(s.split()[0]) for s in got["skipped"]):
                diffs.append(f"{key}: missing")
            continue
        have = got["cases"][key]
        if have["plan_sha256"] != want["plan_sha256"]:
            diffs.append(f"{key}: plan file differs")
        for part in ("score", "step"):
            for k, v in want[part].items():
                h = have[part][k]
                if not math.isclose(h, v, rel_tol=rel, abs_tol=0.0):
                    diffs.append(f"{key}: {part}.{k} {h!r} != {v!r}")
    return diffs


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--write", type=Path, help="record the oracle into this JSON file")
    g.add_argument("--check", type=Path, help="compare with this recorded JSON file")
    args = p.parse_args(argv)
    got = compute()
    if args.write:
        buf = io.StringIO()
        json.dump(got, buf, indent=1, sort_keys=True)
        args.write.write_text(buf.getvalue() + "\n")
        print(f"wrote {len(got['cases'])} cases to {args.write} (skipped: {got['skipped']})")
        return 0
    diffs = compare(json.loads(args.check.read_text()), got)
    for d in diffs:
        print(d)
    print(f"{len(got['cases'])} cases, {len(diffs)} differences (skipped: {got['skipped']})")
    return 1 if diffs else 0


if __name__ == "__main__":
    sys.exit(main())
