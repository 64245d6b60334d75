"""Wall time of relibra's default plan on multi-node cells, and what its portfolio built and pruned.

The cells (``CELLS``): the oracle's synthetic Qwen3-30B case (16 prompts x 4, micro-batches of 8, EP 2 x 8), a
synthetic Qwen3-30B mixed batch (128 prompts x 4, micro-batches of 32, first 4 layers) on EP 2 x 4, 2 x 8 and
4 x 4, and the held-out GPT-OSS-20B batch of ``bench/bound_gap.py`` (256 requests drawn with seed 1, micro-batches
of 8, EP 2 x 4, moves and replicas free); preset ``hopper-rail``, r = 2. Each plan runs once after one warm-up
plan (numba's compilation), on one process. Per cell: seconds, the chosen candidate and its score, how many
candidates were built and pruned (``stats.portfolio``), and the plan's sha256, so that two checkouts' plans can
be compared (``arrays_sha256``: the plan's arrays, not its stats).

``--root DIR`` times the ``relibra_moe`` of another checkout (e.g. ``git worktree add /tmp/old HEAD~1``) instead
of the installed one: an A/B of a planner change on the same machine, back to back.

    python bench/planning_time.py                         # ~1.5 min on 2 cores; bench/results/planning_time.json
    python bench/planning_time.py --root /tmp/old --out /tmp/planning_time_old.json
"""

from __future__ import annotations

import argparse
import hashlib
import sys
import time
from pathlib import Path

import numpy as np

CELLS = (
    ("oracle qwen3-30b mixed 16x4 mb8, 2x8", "qwen3-30b-a3b", (16, 8, None), (2, 8), False),
    ("qwen3-30b mixed 128x4 mb32 4 layers, 2x4", "qwen3-30b-a3b", (128, 32, 4), (2, 4), False),
    ("qwen3-30b mixed 128x4 mb32 4 layers, 2x8", "qwen3-30b-a3b", (128, 32, 4), (2, 8), False),
    ("qwen3-30b mixed 128x4 mb32 4 layers, 4x4", "qwen3-30b-a3b", (128, 32, 4), (4, 4), False),
    ("gpt-oss 256 requests mb8, 2x4, moves free", "gpt-oss-20b", (256, 8, None), (2, 4), True),
)
"""(name, model preset, (prompts or requests, micro-batch size, layers or None: all), (nodes, GPUs a node),
held-out setting: GPT-OSS with moves and replicas free, seed 1)."""


def _use_checkout(root: str) -> None:
    """Import ``relibra_moe`` from ``root`` rather than the editable install (whose finder would win)."""
    sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in repr(f).lower()]
    sys.path.insert(0, root)


def _arrays_sha(plan) -> str:
    """sha256 of the plan's arrays (homes, samples, copies, split), not its stats: equal when two checkouts plan
    the same, whatever their portfolios recorded."""
    h = hashlib.sha256()
    for a in (plan.placement.expert_gpu, plan.samples.micro_batch, plan.samples.gpu, plan.replicas.replica_expert,
              plan.replicas.split_index, plan.replicas.split_share):
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--root", default=None, help="time the relibra_moe of this checkout")
    ap.add_argument("--out", default="bench/results/planning_time.json")
    args = ap.parse_args()
    if args.root:
        _use_checkout(str(Path(args.root).resolve()))
    from common import JsonReport, environment

    import relibra_moe
    from relibra_moe import cluster_preset, model_preset
    from relibra_moe.datasets import gpt_oss_batch
    from relibra_moe.planners.strategies import plan_batch
    from relibra_moe.synthetic import rl_batch

    rep = JsonReport(Path(args.out), environment=environment(), command="bench/planning_time.py" + (
        f" --root {args.root}" if args.root else ""))
    rep.set("relibra_moe", str(Path(relibra_moe.__file__).parent))
    rows = []
    for k, (name, preset, (n, mbs, layers), (nodes, per_node), held_out) in enumerate(CELLS):
        model = model_preset(preset)
        if held_out:
            batch = gpt_oss_batch(num_requests=n, seed=1).with_micro_batch_size(mbs)
        else:
            batch = rl_batch(model, "mixed", n, seed=0, micro_batch_size=mbs).restrict_layers(layers)
            model = model.with_(num_layers=batch.num_layers)
        cluster = cluster_preset("hopper-rail", nodes=nodes, gpus_per_node=per_node)
        kw = {"migration": False, "price_replicas": False, "seed": 1} if held_out else {"seed": 0}
        if k == 0:
            plan_batch(batch, model, cluster, "relibra", replica_slots=2, **kw)  # numba's compilation
        t0 = time.perf_counter()
        plan = plan_batch(batch, model, cluster, "relibra", replica_slots=2, **kw)
        seconds = time.perf_counter() - t0
        pf = plan.stats.portfolio
        row = {"cell": name, "seconds": seconds, "chosen": pf.chosen, "score_s": pf.step_s[pf.chosen],
               "built": len(pf.step_s), "pruned": len(pf.pruned or {}), "arrays_sha256": _arrays_sha(plan)}
        rows.append(row)
        print(f"{name:45s} {seconds:6.1f} s  {pf.chosen} {row['score_s']:.6f} s  built {row['built']}, pruned "
              f"{row['pruned']}", flush=True)
    rep.set("cells", rows)


if __name__ == "__main__":
    main()
