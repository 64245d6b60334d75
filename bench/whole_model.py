"""relibra on the whole Qwen3-235B-A22B (all 94 MoE layers) against the length-balanced baselines, with its
planning time.

The paper table (``bench/paper_table.py``) plans only the first 4 MoE layers of each cell; this plans the whole
model once: a SYNTHETIC mixed batch (``synthetic.rl_batch``, 256 prompts x 4 responses, micro-batches of 32), EP 32
= 4 x 8, preset ``h100`` at 413 TFLOP/s with Megatron's overlap (``--overlap``), r = 2, one batch from the static
placement (moves charged), stepped by ``sim.simulate_step``. Rows: static, EPLB+ and online on verl's
length-balanced placement, and relibra's default plan (its portfolio's choice recorded). Planning seconds are wall
time with ``workers`` processes.

    python bench/whole_model.py                          # ~5 min on 2 cores; bench/results/whole_model.json
    python bench/whole_model.py --overlap none --workers 8
    python bench/whole_model.py --layers 16 --workers 1 --out /tmp/whole_model_16.json   # the planning-time A/B
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from common import JsonReport, environment

from relibra_moe.planners.strategies import plan_batch
from relibra_moe.sim import simulate_step
from relibra_moe.specs import cluster_preset, model_preset
from relibra_moe.synthetic import rl_batch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--overlap", default="megatron", help="overlap rule (none, megatron, dualpipe)")
    ap.add_argument("--workers", type=int, default=2, help="planner processes")
    ap.add_argument("--layers", type=int, default=None,
                    help="plan only the first N MoE layers of the same batch (default: all 94)")
    ap.add_argument("--out", default="bench/results/whole_model.json")
    args = ap.parse_args()
    model = model_preset("qwen3-235b-a22b")
    batch = rl_batch(model, "mixed", 256, 4, seed=0, micro_batch_size=32)
    if args.layers is not None:  # synthesized at full depth, then cut: the first layers of the same batch
        batch, model = batch.restrict_layers(args.layers), model.with_(num_layers=args.layers)
    cluster = cluster_preset("h100", nodes=4, gpus_per_node=8, overlap=args.overlap).with_(flops=413e12)
    rep = JsonReport(Path(args.out), environment=environment(), model=model.name, layers=model.num_layers,
                     samples=batch.num_sequences, ep="4x8", replica_slots=2, overlap=args.overlap,
                     workers=args.workers, command="bench/whole_model.py " + " ".join(
                         f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k != "out"))
    rows = (("static@length-balanced", "static", 0, {"sample_placement": "length-balanced"}),
            ("eplb@length-balanced", "eplb", 2, {"sample_placement": "length-balanced"}),
            ("online@length-balanced", "online", 2, {"sample_placement": "length-balanced"}),
            ("relibra", "relibra", 2, {}))
    for name, strategy, r, kw in rows:
        t0 = time.perf_counter()
        plan = plan_batch(batch, model, cluster, strategy, replica_slots=r, seed=0, workers=args.workers, **kw)
        solve = time.perf_counter() - t0
        step = simulate_step(plan, batch, model, cluster).step_s
        row = {"step_s": step, "planning_s": solve}
        if plan.stats.portfolio is not None:
            row["chosen"] = plan.stats.portfolio.chosen
            row["portfolio_s"] = {k: v for k, v in (plan.stats.timing or {}).items() if k.startswith("portfolio_")}
        rep.set("rows", name, row)
        print(f"{name:26s} step {step:.3f} s  planning {solve:.1f} s  {row.get('chosen', '')}", flush=True)
    steps = {k: v["step_s"] for k, v in rep.data["rows"].items()}
    best = min(v for k, v in steps.items() if k != "relibra")
    rep.set("relibra_vs_best_length_balanced", best / steps["relibra"])
    print(f"relibra / best length-balanced baseline: {best / steps['relibra']:.3f}x")


if __name__ == "__main__":
    main()
