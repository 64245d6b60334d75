"""Planner benchmark: strategies x scenarios, exact cost model (docs/method.md, "Cost model").

For each scenario, one table: strategy, sum over micro-batches and layers of the exact T_MoE, speedup
over static (Megatron-LM), percent of the Balanced ideal (uniform routing, each source GPU keeping its
tokens; the "even" column spreads tokens evenly over sources as well), mean rank skew, solve seconds.

Scenarios (issue 3):
- gptoss-ep8 / gptoss-ep16: GPT-OSS-20B real routing (../shared/traces), 256 requests, 32 micro-batches
  of 8, EP8 = 2 x 4 and EP16 = 2 x 8;
- qwen3-30b-mixed-ep16: synthetic mixed-domain RL batch (labelled synthetic), qwen3-30b-a3b, EP16 = 2 x 8,
  32 micro-batches of 32 (256 prompts x 4 responses);
- qwen3-235b-mixed-ep32: the same on qwen3-235b-a22b (94 layers), EP32 = 4 x 8.

Cost-model rows price no expert re-layout, so the ReLibra rows here run with ``migration=False``,
``price_replicas=False``, ``portfolio=False`` and ``step_objective=False`` (like every baseline, they are not
charged for moving experts or replica traffic, and anneal T_MoE itself); the ``(priced)`` rows run the
defaults, which trade some T_MoE for less traffic in the step (``relibra demo`` / ``relibra simulate`` charge that
traffic).

Sections imported from bench/replication.py (issue 4): ``--gap N`` the greedy-vs-MILP optimality gap on N
random small cells, ``--solve-time`` the whole qwen3-235b-a22b relibra plan wall time.

Usage::

    python bench/planners.py                # all scenarios, writes bench/results/planners.json
    python bench/planners.py --gap 200 --solve-time --scenarios gptoss-ep8
    python bench/planners.py --quick        # GPT-OSS EP8 only, fewer rows (bench/results/planners_quick.json)
    python bench/planners.py --scenarios qwen3-235b-mixed-ep32 --replicas 2 --workers 2
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import numpy as np

from relibra_moe.atomic import write_text
from relibra_moe.evaluate import bound_t_moe, score_plan
from relibra_moe.planners.strategies import plan_batch
from relibra_moe.specs import ClusterSpec, ModelSpec, cluster_preset, model_preset
from relibra_moe.trace import TraceBatch

SCENARIOS = {
    "gptoss-ep8": dict(model="gpt-oss-20b", nodes=2, gpus_per_node=4, data="gpt-oss", requests=256, mb=8),
    "gptoss-ep16": dict(model="gpt-oss-20b", nodes=2, gpus_per_node=8, data="gpt-oss", requests=256, mb=8),
    "qwen3-30b-mixed-ep16": dict(model="qwen3-30b-a3b", nodes=2, gpus_per_node=8, data="synthetic", prompts=256,
                                 mb=32),
    "qwen3-235b-mixed-ep32": dict(model="qwen3-235b-a22b", nodes=4, gpus_per_node=8, data="synthetic",
                                  prompts=256, mb=32),
}

# (row label, strategy, plan_batch keyword arguments)
FREE = {"migration": False}  # cost-model rows: re-layout not charged, as for the baselines
ROWS = [
    ("static (Megatron)", "static", {}),
    ("LPT reorder", "lpt", {}),
    ("EPLB+ reorder only", "eplb", {}),
    ("relibra-inter, aggregate objective", "relibra-inter", {"objective": "aggregate", **FREE}),
    ("relibra-inter", "relibra-inter", dict(FREE)),
    ("relibra-inter (priced)", "relibra-inter", {}),
    ("static + repack", "static", {"repack": True}),
    ("relibra-inter + repack", "relibra-inter", {"repack": True, **FREE}),
    ("relibra-inter, 1 round", "relibra-inter", {"rounds": 1, **FREE}),
    ("relibra-inter + repack, 1 round", "relibra-inter", {"repack": True, "rounds": 1, **FREE}),
]
QUICK_ROWS = ["static (Megatron)", "LPT reorder", "EPLB+ reorder only", "relibra-inter", "relibra-inter + repack"]


def load_scenario(name: str) -> tuple[TraceBatch, ModelSpec, ClusterSpec]:
    """``(batch, model, cluster)`` of a ``SCENARIOS`` entry (real GPT-OSS trace or synthetic mixed batch)."""
    sc = SCENARIOS[name]
    if sc["data"] == "gpt-oss":
        from relibra_moe.datasets import gpt_oss_batch

        batch = gpt_oss_batch(sc["requests"], seed=0).with_micro_batch_size(sc["mb"])
    else:
        from relibra_moe.synthetic import rl_batch

        batch = rl_batch(sc["model"], "mixed", sc["prompts"], 4, seed=0, micro_batch_size=sc["mb"])
    model = model_preset(sc["model"])
    cluster = cluster_preset("hopper-rail", nodes=sc["nodes"], gpus_per_node=sc["gpus_per_node"])
    return batch, model, cluster


def run_scenario(name: str, rows: list[tuple[str, str, dict]], workers: int, seed: int, replicas: int) -> dict:
    """Plan and score every row ``(label, strategy, plan_batch keywords)`` on one scenario (plus the r-slot
    replication rows when ``replicas``); returns the scenario's JSON record (times in ms, solve seconds)."""
    t0 = time.perf_counter()
    batch, model, cluster = load_scenario(name)
    load_s = time.perf_counter() - t0
    # the bound of every row: the most replica slots any row has, any packing (the repack rows)
    bal = bound_t_moe(batch, model, cluster, replicas)
    rows = list(rows)
    if replicas:
        free = {"migration": False, "price_replicas": False, "portfolio": False, "step_objective": False}
        rows += [(f"EPLB+ r={replicas}", "eplb", {"replica_slots": replicas}),
                 (f"LPLB+ r={replicas}", "lplb", {"replica_slots": replicas}),
                 (f"relibra r={replicas}", "relibra", {"replica_slots": replicas, **free}),
                 (f"relibra r={replicas} (priced)", "relibra", {"replica_slots": replicas}),
                 (f"relibra r={replicas} + repack", "relibra", {"replica_slots": replicas, "repack": True, **free})]
    results = []
    static_total = None
    for label, strategy, kw in rows:
        plan = plan_batch(batch, model, cluster, strategy, seed=seed, workers=workers, **kw)
        s = score_plan(plan, batch, model, cluster, bound_t_moe_s=bal)
        if strategy == "static" and not kw:
            static_total = s.t_moe_s
        results.append({
            "row": label, "strategy": strategy, "options": kw, "t_moe_total_ms": 1e3 * s.t_moe_s,
            "percent_of_bound": s.percent_of_bound,
            "rank_skew_mean": s.rank_skew_mean, "solve_s": plan.stats.solve_seconds,
            "timing": (plan.stats.timing or {}),
        })
        print(f"  {name}: {label:38s} {1e3 * s.t_moe_s:9.2f} ms  {plan.stats.solve_seconds:7.2f} s",
              flush=True)
    for r in results:
        r["speedup_vs_static"] = static_total / (r["t_moe_total_ms"] / 1e3) if static_total else None
    return {"scenario": name, **SCENARIOS[name], "num_samples": batch.num_sequences, "num_tokens": batch.num_tokens,
            "bound_ms": 1e3 * bal, "load_seconds": load_s, "rows": results}


def print_table(res: dict) -> None:
    """Print one scenario's markdown table (sum T_MoE, speedup vs static, % of the bound, skew, solve s)."""
    print(f"\n## {res['scenario']}: {res['model']}, EP{res['nodes'] * res['gpus_per_node']} = {res['nodes']} x "
          f"{res['gpus_per_node']}, {res['num_samples']} samples, {res['num_tokens']} tokens; bound "
          f"{res['bound_ms']:.1f} ms")
    hdr = f"| {'strategy':38s} | sum T_MoE ms | vs static | % of bound | rank skew | solve s |"
    print(hdr)
    print("|" + "|".join("-" * (len(c)) for c in hdr.split("|")[1:-1]) + "|")
    for r in res["rows"]:
        print(f"| {r['row']:38s} | {r['t_moe_total_ms']:12.2f} | {r['speedup_vs_static']:8.3f}x | "
              f"{r['percent_of_bound']:9.1f}% | {r['rank_skew_mean']:9.3f} "
              f"| {r['solve_s']:7.2f} |")


def main(argv: list[str] | None = None) -> None:
    """Run the chosen scenarios, print their tables and write the JSON under bench/results/."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="GPT-OSS EP8 only, fewer rows")
    ap.add_argument("--scenarios", nargs="*", choices=sorted(SCENARIOS), default=None)
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--replicas", type=int, default=0, help="also run EPLB+, LPLB+, relibra with r slots")
    ap.add_argument("--out", default=None, help="JSON path (default bench/results/planners[_quick].json)")
    ap.add_argument("--gap", type=int, default=0, help="also the MILP gap study on N cells (bench/replication.py)")
    ap.add_argument("--solve-time", action="store_true", help="also the qwen3-235b relibra solve time")
    args = ap.parse_args(argv)
    names = args.scenarios or (["gptoss-ep8"] if args.quick else list(SCENARIOS))
    rows = [r for r in ROWS if r[0] in QUICK_ROWS] if args.quick else ROWS
    out = Path(args.out) if args.out else Path(__file__).parent / "results" / (
        "planners_quick.json" if args.quick else "planners.json")
    all_res = []
    for name in names:
        res = run_scenario(name, rows, args.workers, args.seed, args.replicas)
        print_table(res)
        all_res.append(res)
    extra = {}
    if args.gap or args.solve_time:
        import sys

        sys.path.insert(0, str(Path(__file__).parent))
        import replication  # bench/replication.py: the issue-4 sections

        if args.gap:
            extra["gap"] = replication.bench_gap(args.gap, seed=args.seed)
            replication._print_gap(extra["gap"])
        if args.solve_time:
            t = extra["solve_time"] = replication.bench_time(256, seed=args.seed, workers=max(2, args.workers))
            print(f"\n== solve time, qwen3-235b-a22b relibra r=2, EP32 4x8, {t['micro_batches']} micro-batches x "
                  f"{t['layers']} layers: wall {t['wall_s']:.1f} s (CPU {t['cpu_s']:.1f} s); Planner service "
                  f"{t['service_wall_s']:.1f} s")
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"machine": platform.processor() or platform.machine(), "python": platform.python_version(),
            "numpy": np.__version__, "workers": args.workers, "seed": args.seed, "quick": args.quick}
    write_text(out, json.dumps({"meta": meta, "scenarios": all_res, **extra}, indent=2, sort_keys=True, default=float))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
