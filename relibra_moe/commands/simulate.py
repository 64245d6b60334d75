"""``relibra simulate TRACE PLAN --model PRESET [--json]``: simulated step time of a batch under a plan.

The plan file comes from ``relibra plan`` (or ``BatchPlan.save``); its GPU count and GPUs per node
size the cluster (``--cluster`` names the fabric). The formulas are those of ``relibra_moe.sim``.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from ..specs import DEFAULT_CLUSTER
from ..timing import DEFAULT_OPTIMIZER_BYTES_PER_PARAM, REPLICA_MODES
from .plan import add_trace_plan_parser, load_inputs, load_previous, model_from_args, placement_of


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``relibra simulate`` to the CLI."""
    p = add_trace_plan_parser(subparsers, "simulate", "simulated training-step time of a trace under a plan",
                              "Simulate one training step (attention + MoE forward/backward per micro-batch and "
                              "layer, replica transfers, reorder traffic) of the batch in TRACE under the plan in "
                              "PLAN.")
    p.add_argument("--previous", default=None,
                   help="plan file whose placement precedes this one (default: the static placement)")
    p.add_argument("--optimizer-bytes", type=float, default=None,
                   help="optimizer-state bytes per parameter that move with a re-laid-out expert (default "
                        f"{DEFAULT_OPTIMIZER_BYTES_PER_PARAM:g})")
    p.add_argument("--replica-mode", choices=REPLICA_MODES, default="auto",
                   help="how replica weights travel (see relibra_moe.sim; default auto: after-router for online "
                        "plans, persistent for replicas fixed over the batch, else per-layer)")
    p.add_argument("--allow-unfingerprinted", action="store_true",
                   help="simulate a plan that records no batch fingerprint (stats batch_sha1), which therefore "
                        "cannot be checked against TRACE")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=run)


def simulate_files(trace_path: str, plan_path: str, model_name: Any, cluster_name: str = DEFAULT_CLUSTER,
                   previous_path: str | None = None, optimizer_bytes: float | None = None,
                   replica_mode: str = "auto", allow_unfingerprinted: bool = False,
                   cluster_profile: str | None = None, dispatcher: str | None = None,
                   overlap: str | None = None) -> dict[str, Any]:
    """Load the files, simulate, return the JSON-ready result (what ``--json`` prints); ``allow_unfingerprinted``
    accepts a plan without a batch fingerprint (``check_plan_batch``)."""
    from ..sim import simulate_step

    model, batch, plan, cluster = load_inputs(trace_path, plan_path, model_name, cluster_name, cluster_profile,
                                              dispatcher, overlap)
    previous = load_previous(previous_path, model, cluster) if previous_path else None
    opt = DEFAULT_OPTIMIZER_BYTES_PER_PARAM if optimizer_bytes is None else optimizer_bytes
    step = simulate_step(plan, batch, model, cluster, previous=previous, optimizer_bytes_per_param=opt,
                         replica_mode=replica_mode, allow_missing_fingerprint=allow_unfingerprinted)
    out = {"trace": str(trace_path), "plan": str(plan_path), "model": model.name,
           "cluster": {"name": cluster.name, "nodes": cluster.nodes, "gpus_per_node": cluster.gpus_per_node,
                       "dispatcher": cluster.dispatcher, "overlap": cluster.overlap},
           "strategy": plan.stats.strategy, "num_micro_batches": plan.num_micro_batches,
           "replica_slots": plan.replica_slots, "sample_owner": plan.stats.sample_owner or "planner",
           "sample_placement": placement_of(plan)}
    out.update(step.to_dict())
    return out


def run(args: argparse.Namespace) -> int:
    """``relibra simulate``: print the simulated step (JSON or a table); exit status 0."""
    res = simulate_files(args.trace, args.plan, model_from_args(args), args.cluster, args.previous,
                         args.optimizer_bytes, args.replica_mode, args.allow_unfingerprinted, args.cluster_profile,
                         args.dispatcher, args.overlap)
    if args.json:
        print(json.dumps(res, indent=2))
        return 0
    from rich.console import Console
    from rich.table import Table

    c = res["cluster"]
    table = Table(title=f"simulated step: {res['model']} on {c['nodes']} x {c['gpus_per_node']} GPUs "
                        f"({res['num_micro_batches']} micro-batches, strategy {res['strategy'] or '?'})")
    table.add_column("component")
    table.add_column("seconds", justify="right")
    table.add_column("share", justify="right")
    for name, sec in res["breakdown"].items():
        table.add_row(name, f"{sec:.4f}", f"{100 * sec / res['step_s']:.1f}%" if res["step_s"] else "-")
    table.add_row("step", f"{res['step_s']:.4f}", "100%", style="bold")
    console = Console()
    console.print(table)
    console.print(f"tokens {res['tokens']:,}  throughput {res['tokens_per_s']:,.0f} tokens/s  "
                  f"rank skew {res['rank_skew_mean']:.3f}  experts moved {res['experts_moved']}  "
                  f"replica mode {res['replica_mode']}  samples placed by the {res['sample_owner']} "
                  f"({res['sample_placement']})")
    return 0
