"""``relibra plan`` and ``relibra score``: make a plan file for a trace, and re-score any plan file.

``relibra plan TRACE --model PRESET --nodes N --gpus-per-node P --strategy S [--replica-slots r]
[--micro-batch-size B] [--repack] [--seed S] [--workers W] --out PLAN.npz [--json]`` plans the batch in
TRACE (a ``TraceBatch`` .npz) with ``planners.strategies.plan_batch``, writes the plan, and prints its
exact cost (``planners.scoring.score_plan``). ``relibra score TRACE PLAN --model PRESET [--json]``
re-scores a plan file with the same function, so the two agree.
"""

from __future__ import annotations

import argparse
import json
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import PlanError

if TYPE_CHECKING:
    from ..plan import BatchPlan
    from ..specs import ClusterSpec, ModelSpec
    from ..trace import TraceBatch

STRATEGY_NAMES = ("static", "lpt", "eplb", "balanced", "relibra-inter", "lplb", "relibra", "online")


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``relibra plan`` and ``relibra score`` to the CLI."""
    p = subparsers.add_parser(
        "plan", help="plan a batch (expert placement, sample placement, replicas) and write a plan file",
        description="Plan the batch in TRACE with a strategy, write the plan (.npz) and print its exact cost.")
    p.add_argument("trace", help="trace file (.npz from `relibra trace import/synth`)")
    p.add_argument("--model", required=True, help="model preset, e.g. qwen3-30b-a3b, gpt-oss-20b")
    p.add_argument("--cluster", default="hopper-rail", help="cluster fabric preset (default: hopper-rail)")
    p.add_argument("--nodes", type=int, required=True, help="nodes in the EP group")
    p.add_argument("--gpus-per-node", type=int, default=8, help="GPUs per node (default 8)")
    p.add_argument("--strategy", required=True, choices=STRATEGY_NAMES, help="planning strategy")
    p.add_argument("--replica-slots", type=int, default=0, help="replica slots per GPU r (eplb, lplb, relibra)")
    p.add_argument("--micro-batch-size", type=int, default=None,
                   help="assign sample i to micro-batch i // B (default: the trace's own assignment)")
    p.add_argument("--repack", action="store_true", help="also choose each sample's micro-batch")
    p.add_argument("--token-cap", type=int, default=None,
                   help="with --repack: micro-batches may change sample counts, tokens at most this")
    p.add_argument("--seed", type=int, default=0, help="plan seed (same inputs and seed -> same file)")
    p.add_argument("--workers", type=int, default=1, help="processes for the parallel parts (default 1)")
    p.add_argument("--objective", choices=("batch", "aggregate"), default="batch",
                   help="reorder objective: sum over micro-batches of T_MoE (default) or aggregated loads")
    p.add_argument("--iters", type=int, default=None, help="annealing proposals per layer and seed")
    p.add_argument("--locality-iters", type=int, default=None, help="sample-placement annealing proposals")
    p.add_argument("--rounds", type=int, default=None, help="reorder + locality rounds (relibra*; default 2)")
    p.add_argument("--skew-cap", type=float, default=None,
                   help="rank-balance mode (relibra*): soft cap on the node-level compute skew, e.g. 0.05; trades "
                        "communication for rank balance (off by default: it lengthens T_MoE on multi-node clusters)")
    p.add_argument("--balanced", action="store_true", help="also report percent of the Balanced ideal")
    p.add_argument("--out", required=True, help="plan file to write (.npz)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=run_plan)

    s = subparsers.add_parser(
        "score", help="exact cost of a plan file on a trace",
        description="Re-score PLAN on the batch in TRACE with the exact cost model (the same numbers as "
                    "`relibra plan` prints).")
    s.add_argument("trace", help="trace file (.npz)")
    s.add_argument("plan", help="plan file (.npz from `relibra plan`)")
    s.add_argument("--model", required=True, help="model preset")
    s.add_argument("--cluster", default="hopper-rail", help="cluster fabric preset (default: hopper-rail)")
    s.add_argument("--balanced", action="store_true", help="also report percent of the Balanced ideal")
    s.add_argument("--json", action="store_true", help="print JSON instead of a table")
    s.set_defaults(func=run_score)


def _model(name: str) -> ModelSpec:
    from ..specs import model_preset

    try:
        return model_preset(name)
    except ValueError as exc:
        raise PlanError(str(exc)) from None


def _cluster(name: str, nodes: int, gpus_per_node: int) -> ClusterSpec:
    from ..specs import cluster_preset

    try:
        return cluster_preset(name, nodes=nodes, gpus_per_node=gpus_per_node)
    except ValueError as exc:
        raise PlanError(str(exc)) from None


def _check_batch(batch, model, path: str) -> None:
    if (batch.num_layers, batch.num_experts) != (model.num_layers, model.num_experts):
        raise PlanError(f"trace {path} has {batch.num_layers} MoE layers and {batch.num_experts} experts; "
                        f"model {model.name} has {model.num_layers} and {model.num_experts}")


def cluster_of_plan(plan: BatchPlan, plan_path: str, cluster_name: str) -> ClusterSpec:
    """The ClusterSpec a plan file was made for: its ``num_gpus`` / ``gpus_per_node`` on fabric ``cluster_name``."""
    if plan.num_gpus % plan.gpus_per_node:
        raise PlanError(f"plan {plan_path}: num_gpus={plan.num_gpus} is not a multiple of "
                        f"gpus_per_node={plan.gpus_per_node}")
    return _cluster(cluster_name, plan.num_gpus // plan.gpus_per_node, plan.gpus_per_node)


def load_inputs(trace_path: str, plan_path: str, model_name: str, cluster_name: str
                ) -> tuple[ModelSpec, TraceBatch, BatchPlan, ClusterSpec]:
    """``(model, batch, plan, cluster)`` for ``relibra score`` / ``relibra simulate``: the preset, the trace
    (checked against the model), the plan file and the cluster it was made for."""
    from ..plan import BatchPlan
    from ..trace import TraceBatch

    model = _model(model_name)
    batch = TraceBatch.load(trace_path)
    _check_batch(batch, model, trace_path)
    plan = BatchPlan.load(plan_path)
    return model, batch, plan, cluster_of_plan(plan, plan_path, cluster_name)


def _score(plan, batch, model, cluster, balanced: bool) -> dict[str, Any]:
    from ..planners.baselines import balanced_t_moe
    from ..planners.scoring import json_summary, score_plan

    bal = None
    if balanced:
        bal = balanced_t_moe(batch, model, cluster, seed=int(plan.stats.get("seed", 0)),
                             micro_batch=plan.samples.micro_batch)
    out = json_summary(score_plan(plan, batch, model, cluster, balanced_total_s=bal))
    if bal is not None:
        out["balanced_total_s"] = bal
    return out


def plan_file(args: argparse.Namespace) -> dict[str, Any]:
    """Plan, save, score: the JSON-ready result (what ``relibra plan --json`` prints)."""
    from ..planners.strategies import RELIBRA_STRATEGIES, REPLICA_STRATEGIES, plan_batch
    from ..trace import TraceBatch

    model = _model(args.model)
    cluster = _cluster(args.cluster, args.nodes, args.gpus_per_node)
    batch = TraceBatch.load(args.trace)
    _check_batch(batch, model, args.trace)
    if args.replica_slots and args.strategy not in REPLICA_STRATEGIES:
        raise PlanError(f"--replica-slots={args.replica_slots} only applies to {', '.join(REPLICA_STRATEGIES)}, "
                        f"not --strategy {args.strategy}")
    if args.micro_batch_size is None and (batch.micro_batch is None or int(np.min(batch.micro_batch)) < 0):
        raise PlanError(f"trace {args.trace} has no micro-batch assignment (for every sample): pass "
                        "--micro-batch-size B")
    options: dict[str, Any] = {"objective": args.objective}
    if args.skew_cap is not None and args.strategy not in RELIBRA_STRATEGIES:
        raise PlanError(f"--skew-cap={args.skew_cap} only applies to {' and '.join(RELIBRA_STRATEGIES)}, not "
                        f"--strategy {args.strategy}")
    for k in ("iters", "locality_iters", "token_cap", "rounds", "skew_cap"):
        v = getattr(args, k)
        if v is not None:
            options[k] = v
    plan = plan_batch(batch, model, cluster, args.strategy, replica_slots=args.replica_slots, seed=args.seed,
                      workers=args.workers, repack=args.repack, micro_batch_size=args.micro_batch_size, **options)
    plan.save(args.out)
    if args.micro_batch_size is not None:
        batch = batch.with_micro_batch_size(args.micro_batch_size)
    out: dict[str, Any] = {"trace": str(args.trace), "plan": str(args.out), "model": model.name,
                           "cluster": {"name": cluster.name, "nodes": cluster.nodes,
                                       "gpus_per_node": cluster.gpus_per_node}}
    out.update(_score(plan, batch, model, cluster, args.balanced))
    out["solve_seconds"] = float(plan.stats["solve_seconds"])
    out["replica_slots"] = plan.replica_slots
    out["repack"] = bool(args.repack)
    out["seed"] = args.seed
    return out


def score_file(trace_path: str, plan_path: str, model_name: str, cluster_name: str = "hopper-rail",
               balanced: bool = False) -> dict[str, Any]:
    """Load a trace and a plan file, score the plan (what ``relibra score --json`` prints)."""
    model, batch, plan, cluster = load_inputs(trace_path, plan_path, model_name, cluster_name)
    out: dict[str, Any] = {"trace": str(trace_path), "plan": str(plan_path), "model": model.name,
                           "cluster": {"name": cluster.name, "nodes": cluster.nodes,
                                       "gpus_per_node": cluster.gpus_per_node}}
    out.update(_score(plan, batch, model, cluster, balanced))
    return out


def _print(res: dict[str, Any], as_json: bool) -> None:
    if as_json:
        print(json.dumps(res, indent=2, sort_keys=True))
        return
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"{res.get('strategy')} on {res['trace']}")
    t.add_column("metric")
    t.add_column("value", justify="right")
    for k in ("t_moe_total_s", "comp_total_s", "comm_total_s", "rank_skew_mean", "rank_skew_max",
              "percent_of_balanced", "solve_seconds", "num_micro_batches"):
        if k in res:
            v = res[k]
            t.add_row(k, f"{v:.6g}" if isinstance(v, float) else str(v))
    Console().print(t)


def run_plan(args: argparse.Namespace) -> int:
    """``relibra plan``: plan, write the file, print the score; exit status 0."""
    _print(plan_file(args), args.json)
    return 0


def run_score(args: argparse.Namespace) -> int:
    """``relibra score``: re-score a plan file; exit status 0."""
    _print(score_file(args.trace, args.plan, args.model, args.cluster, args.balanced), args.json)
    return 0
