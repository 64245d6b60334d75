"""``relibra plan`` and ``relibra score``: make a plan file for a trace, and re-score any plan file.

``relibra plan TRACE --model PRESET --nodes N --gpus-per-node P --strategy S [--replica-slots r]
[--micro-batch-size B] [--repack] [--seed S] [--workers W] [plan options] --out PLAN.npz [--json]`` plans
the batch in TRACE (a ``TraceBatch`` .npz): the flags build one ``planners.options.PlanOptions`` (every
option a user may set: ``--previous PLAN.npz``, ``--migration price|free``, ``--replica-pricing
price|free``, ``--iters``, ``--rounds``, ``--skew-cap``, ``--token-cap``, ...), ``plan_with_options``
plans, the plan is written and its exact cost printed (``evaluate.score_plan``). The strategy choices are
the registry's (``planners.strategies.STRATEGIES``). ``relibra score TRACE PLAN --model PRESET [--json]``
re-scores a plan file with the same function, so the two agree.
"""

from __future__ import annotations

import argparse
import json
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import PlanError
from ..specs import DEFAULT_CLUSTER

if TYPE_CHECKING:
    from ..plan import BatchPlan, Placement
    from ..planners.options import PlanOptions
    from ..specs import ClusterSpec, ModelSpec
    from ..trace import TraceBatch

PRICE_CHOICES = ("price", "free")
"""``--migration`` / ``--replica-pricing``: charge the traffic in the plan's objective, or plan as if it were free."""

# flag -> (PlanOptions field, type, help); None-valued flags leave the option at its default. "{default}" in a help
# text is the field's default (``option_default``), so the help cannot drift from ``PlanOptions``.
_OPTION_FLAGS: tuple[tuple[str, str, type, str], ...] = (
    ("--iters", "iters", int, "annealing proposals per layer, seed and round (default: from the problem size)"),
    ("--locality-iters", "locality_iters", int, "sample-placement annealing proposals per round"),
    ("--num-seeds", "num_seeds", int, "annealing runs per layer (default: one per worker)"),
    ("--rounds", "rounds", int, "reorder + locality rounds (relibra*; default {default})"),
    ("--tol", "tol", float, "attention-work tolerance of the sample placement over the mean (default {default})"),
    ("--beta", "beta", float, "LSE sharpness of the smoothed objectives (default {default})"),
    ("--token-cap", "token_cap", int, "with --repack: micro-batches may change sample counts, tokens at most this"),
    ("--num-groups", "num_groups", int, "EPLB expert groups (eplb, lplb; default: no hierarchy)"),
    ("--final-iters", "final_iters", int, "proposals of --final-reorder (default {final_iters_factor} x a round's)"),
    ("--move-horizon", "move_horizon", int,
     "relibra*: the batches a re-layout of the experts is expected to serve; with --previous and --previous-trace a "
     "move is credited H - 1 times what its homes save on the previous batch, which they were not planned for (at "
     "most what they save on this one). Default {default}: a move pays for itself on the step that makes it"),
    ("--optimizer-bytes", "optimizer_bytes_per_param", float,
     "optimizer-state bytes per parameter that move with a re-laid-out expert (default {default})"),
    ("--skew-cap", "skew_cap", float,
     "rank-balance mode (relibra*): soft cap on the node-level compute skew, e.g. 0.05; trades communication for "
     "rank balance (off by default: it lengthens T_MoE on multi-node clusters)"),
    ("--cell-chunk", "cell_chunk", int, "replication cells per task (default: about 16 tasks per worker)"),
)


def option_default(name: str) -> Any:
    """The default of ``PlanOptions`` field ``name``: the one value every planning command's flag of that option
    defaults to and shows in its help (floats without a trailing ``.0``, as ``format(v, "g")``)."""
    import dataclasses

    from ..planners.options import PlanOptions

    for f in dataclasses.fields(PlanOptions):
        if f.name == name:
            return f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
    raise PlanError(f"unknown plan option {name!r}; known: {sorted(PlanOptions.names())}")


def option_help(name: str, text: str) -> str:
    """``text`` with ``{default}`` replaced by ``option_default(name)`` (``{final_iters_factor}``: the
    ``final_iters`` rule's ``options.FINAL_ITERS_FACTOR``)."""
    from ..planners.options import FINAL_ITERS_FACTOR

    default = option_default(name)
    return text.format(default=format(default, "g") if isinstance(default, float) else default,
                       final_iters_factor=FINAL_ITERS_FACTOR)


def add_seed_workers_flags(p: argparse.ArgumentParser, workers_help: str | None = None) -> None:
    """``--seed`` and ``--workers`` with ``PlanOptions``' defaults (``workers_help``: a command's own help text,
    and then no default: the command chooses, e.g. the CPU count)."""
    p.add_argument("--seed", type=int, default=option_default("seed"),
                   help=option_help("seed", "plan seed (same inputs and seed -> same plan; default {default})"))
    if workers_help is None:
        p.add_argument("--workers", type=int, default=option_default("workers"),
                       help=option_help("workers", "processes for the parallel parts (default {default})"))
    else:
        p.add_argument("--workers", type=int, default=None, help=workers_help)


def _strategy_registry() -> tuple[str, ...]:
    from ..planners.strategies import STRATEGIES

    return tuple(STRATEGIES)


def add_trace_plan_parser(subparsers: argparse._SubParsersAction, name: str, help: str, description: str
                          ) -> argparse.ArgumentParser:
    """The parser of a subcommand that reads a TRACE and a PLAN file (``relibra score``, ``relibra simulate``):
    the two positionals, the model and the cluster arguments."""
    p = subparsers.add_parser(name, help=help, description=description)
    p.add_argument("trace", help="trace file (.npz from `relibra trace import/synth`)")
    p.add_argument("plan", help="plan file (.npz from `relibra plan`)")
    add_model_args(p)
    add_cluster_args(p)
    return p


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``relibra plan`` and ``relibra score`` to the CLI."""
    p = subparsers.add_parser(
        "plan", help="plan a batch (expert placement, sample placement, replicas) and write a plan file",
        description="Plan the batch in TRACE with a strategy, write the plan (.npz) and print its exact cost.")
    p.add_argument("trace", help="trace file (.npz from `relibra trace import/synth`)")
    add_model_args(p)
    add_cluster_args(p)
    p.add_argument("--nodes", type=int, required=True, help="nodes in the EP group")
    p.add_argument("--gpus-per-node", type=int, default=8, help="GPUs per node (default %(default)s)")
    p.add_argument("--strategy", required=True, choices=_strategy_registry(), help="planning strategy")
    from ..planners.options import OBJECTIVES, REPLICA_STRATEGIES

    p.add_argument("--replica-slots", type=int, default=option_default("replica_slots"),
                   help=f"replica slots per GPU r ({', '.join(REPLICA_STRATEGIES)}; default %(default)s)")
    p.add_argument("--micro-batch-size", type=int, default=None,
                   help="assign sample i to micro-batch i // B (default: the trace's own assignment)")
    p.add_argument("--repack", action="store_true", help="also choose each sample's micro-batch")
    p.add_argument("--keep-cell-sizes", action="store_true",
                   help="the sample placement only swaps samples: every (micro-batch, GPU) cell keeps its sample "
                        "count, so a trainer with a fixed per-rank micro-batch size (verl, slime) can follow the "
                        "plan (relibra_moe.sample_order)")
    add_sample_owner_flags(p, both=False)
    add_seed_workers_flags(p)
    p.add_argument("--objective", choices=OBJECTIVES, default=None,
                   help=option_help("objective", "reorder objective: batch (sum over micro-batches of T_MoE) or "
                                                 "aggregate (T_MoE of the aggregated loads); default {default}"))
    for flag, name, typ, help_ in _OPTION_FLAGS:
        p.add_argument(flag, dest=name, type=typ, default=None, help=option_help(name, help_))
    p.add_argument("--final-reorder", action="store_true",
                   help="re-anneal the homes once more after the last locality pass (relibra*)")
    p.add_argument("--previous", default=None, metavar="PLAN.npz",
                   help="plan file whose placement precedes this batch: moves are priced against it "
                        "(default: the static placement)")
    p.add_argument("--previous-trace", default=None, metavar="TRACE.npz",
                   help="with --move-horizon > 1 and --previous: the trace of the batch the previous plan was made "
                        "for (checked against it); its loads under that plan judge the new homes")
    p.add_argument("--history", action="append", default=None, metavar="TRACE.npz",
                   help="eplb-history: a past batch's trace whose expert loads EPLB re-balances on (repeat for a "
                        "window, oldest first; default: none, the trivial layout); relibra: its portfolio then "
                        "includes that eplb-history plan")
    p.add_argument("--migration", choices=PRICE_CHOICES, default=price_choice("migration"),
                   help="expert moves: priced against the previous placement or free (relibra*; default "
                        "%(default)s)")
    p.add_argument("--replica-pricing", choices=PRICE_CHOICES, default=price_choice("price_replicas"),
                   help="replica pushes / pulls not hidden behind their window (max(attention, dispatch)): priced "
                        "or free (relibra; default %(default)s)")
    p.add_argument("--no-resident-replicas", dest="resident_replicas", action="store_false",
                   help="relibra never chooses replicas resident for the whole batch (its locality-resident "
                        "candidate, eplb-history's redundant experts): for GPUs without memory for L x r extra "
                        "experts")
    p.add_argument("--bound", "--balanced", dest="bound", action="store_true",
                   help="also report percent of the bound (a lower bound of every plan's sum of T_MoE)")
    p.add_argument("--out", required=True, help="plan file to write (.npz)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=run_plan)

    s = add_trace_plan_parser(subparsers, "score", "exact cost of a plan file on a trace",
                              "Re-score PLAN on the batch in TRACE with the exact cost model (the same numbers as "
                              "`relibra plan` prints).")
    s.add_argument("--bound", "--balanced", dest="bound", action="store_true",
                   help="also report percent of the bound (a lower bound of every plan's sum of T_MoE)")
    s.add_argument("--previous", default=None, metavar="PLAN.npz",
                   help="charge the simulated step's expert moves against this plan's placement (default: static)")
    s.add_argument("--allow-unfingerprinted", action="store_true",
                   help="score a plan that records no batch fingerprint (stats batch_sha1), which therefore cannot "
                        "be checked against TRACE")
    s.add_argument("--json", action="store_true", help="print JSON instead of a table")
    s.set_defaults(func=run_score)


SAMPLE_GPU_HELP = ("with --sample-owner trainer: the trainer's rank of every sample of the trace, an int [N] .npy "
                   "file (after --micro-batch-size; default: round-robin within each micro-batch, k-th sample on "
                   "rank k mod G, what a trainer that does not reorder its micro-batches does)")


def price_choice(name: str) -> str:
    """``PRICE_CHOICES``' value of the boolean ``PlanOptions`` field ``name`` at its default ("price" for True)."""
    return PRICE_CHOICES[0] if option_default(name) else PRICE_CHOICES[1]


def add_sample_owner_flags(p: argparse.ArgumentParser, both: bool) -> None:
    """``--sample-owner`` (``both``: also the value "both") and ``--sample-gpu FILE.npy``."""
    from ..planners.options import SAMPLE_OWNERS

    choices = (*SAMPLE_OWNERS, "both") if both else SAMPLE_OWNERS
    p.add_argument("--sample-owner", choices=choices, default=option_default("sample_owner"),
                   help="who places the samples: the planner chooses every sample's rank, or the trainer "
                        "owns them and only expert homes, replicas and splits are planned"
                        + ("; both: every strategy in both modes, one table" if both else "")
                        + " (default %(default)s)")
    p.add_argument("--sample-gpu", default=None, metavar="FILE.npy", help=SAMPLE_GPU_HELP)
    if not both:
        add_sample_placement_flag(p)


def placement_of(plan: BatchPlan) -> str:
    """The sample placement a plan started from (its ``stats``): ``sample_placement`` when recorded, "given ranks"
    for a trainer's ``sample_gpu``, else "round-robin" (plans record nothing for it)."""
    if plan.stats.sample_placement is not None:
        return str(plan.stats.sample_placement)
    return "given ranks" if "sample_gpu" in (plan.stats.options or {}) else "round-robin"


def add_sample_placement_flag(p: argparse.ArgumentParser) -> None:
    """``--sample-placement`` (``PlanOptions.sample_placement``; choices ``sample_placements.SAMPLE_PLACEMENTS``)."""
    from ..sample_placements import PLACEMENT_USERS, SAMPLE_PLACEMENTS

    p.add_argument("--sample-placement", choices=SAMPLE_PLACEMENTS, default=None,
                   help="the samples' placement before planning: "
                        + ", ".join(f"{k} ({v})" for k, v in PLACEMENT_USERS.items())
                        + "; the strategies that do not place samples run on it, relibra's locality starts from it, "
                          "with --sample-owner trainer it is the trainer's (default: relibra starts from "
                          "length-balanced, everything else runs on round-robin)")


def load_sample_gpu(path: str | None, owner: str, num_samples: int) -> np.ndarray | None:
    """The trainer's ranks of ``--sample-gpu FILE.npy`` (int ``[N]``; None without a file); PlanError naming the
    file when it is unreadable, not an int ``[N]`` array of the trace's N, or given with ``--sample-owner
    planner``. The ranks' range is checked by the planner (``PlanOptions.sample_gpu``)."""
    if path is None:
        return None
    if owner == "planner":
        raise PlanError(f"--sample-gpu {path} only applies with --sample-owner trainer (or both), not planner")
    try:
        sg = np.load(path, allow_pickle=False)
    except (OSError, ValueError) as exc:
        raise PlanError(f"--sample-gpu {path}: not a readable .npy file ({type(exc).__name__}: {exc})") from None
    if sg.ndim != 1 or sg.shape[0] != num_samples or (sg.size and sg.dtype.kind not in "iu"):
        raise PlanError(f"--sample-gpu {path}: must be an int [N={num_samples}] array of ranks (one per sample of "
                        f"the trace), got shape {sg.shape} of dtype {sg.dtype}")
    return sg.astype(np.int64)


def add_model_args(parser: argparse.ArgumentParser) -> None:
    """``--model PRESET`` or ``--model-config config.json`` (exactly one) on a command that needs a ModelSpec."""
    g = parser.add_mutually_exclusive_group(required=True)
    g.add_argument("--model", default=None, help="model preset, e.g. qwen3-30b-a3b, gpt-oss-20b")
    g.add_argument("--model-config", default=None, metavar="CONFIG.json",
                   help="the model's Hugging Face config.json (or its directory) instead of a preset "
                        "(ModelSpec.from_hf_config)")


def model_from_args(args: argparse.Namespace) -> ModelSpec:
    """The ModelSpec of a command line: the ``--model`` preset, or ``--model-config`` read by
    ``ModelSpec.from_hf_config`` (PlanError naming the file and the field for a bad one)."""
    if getattr(args, "model_config", None) is not None:
        from ..specs import ModelSpec

        try:
            return ModelSpec.from_hf_config(args.model_config)
        except ValueError as exc:
            raise PlanError(f"--model-config: {exc}") from None
    if getattr(args, "model", None) is None:
        raise PlanError("pass --model PRESET or --model-config config.json")
    return model_by_name(args.model)


def model_by_name(name: str | ModelSpec) -> ModelSpec:
    """The model preset ``name`` (PlanError naming it and the known ones); a ModelSpec is returned as is."""
    from ..specs import ModelSpec, model_preset

    if isinstance(name, ModelSpec):
        return name
    try:
        return model_preset(name)
    except ValueError as exc:
        raise PlanError(str(exc)) from None


def cluster_by_name(name: str, nodes: int, gpus_per_node: int, profile: str | None = None,
                    dispatcher: str | None = None, overlap: str | None = None) -> ClusterSpec:
    """The cluster of a command: the cluster profile file ``profile`` (``relibra calibrate``) when given, else the
    fabric preset ``name``, with ``nodes`` x ``gpus_per_node`` GPUs; ``dispatcher`` overrides the preset's
    (``alltoall``) and must match a profile's; ``overlap`` (``specs.OVERLAPS``, default ``none``) is the trainer's
    compute / all-to-all overlap. PlanError for a bad name, file or mismatch."""
    from ..specs import OVERLAPS, cluster_preset, load_cluster_profile
    from ..validate import check_choice

    overlap = "none" if overlap is None else overlap
    check_choice("--overlap", overlap, OVERLAPS)
    if profile is not None:
        cluster = load_cluster_profile(profile, nodes, gpus_per_node)
        if dispatcher is not None and dispatcher != cluster.dispatcher:
            raise PlanError(f"--dispatcher {dispatcher} differs from the profile {profile}'s dispatcher "
                            f"{cluster.dispatcher!r} (its bandwidths were measured for that one)")
        return cluster.with_(overlap=overlap)
    try:
        return cluster_preset(name, nodes=nodes, gpus_per_node=gpus_per_node, dispatcher=dispatcher or "alltoall",
                              overlap=overlap)
    except ValueError as exc:
        raise PlanError(str(exc)) from None


def add_cluster_args(p: argparse.ArgumentParser) -> None:
    """``--cluster``, ``--cluster-profile``, ``--dispatcher`` and ``--overlap``: the flags ``cluster_by_name``
    reads."""
    from ..specs import CLUSTER_PRESETS, DEFAULT_CLUSTER, DISPATCHERS, OVERLAPS

    p.add_argument("--cluster", default=DEFAULT_CLUSTER,
                   help=f"cluster fabric preset: {', '.join(sorted(CLUSTER_PRESETS))} (default: {DEFAULT_CLUSTER}; "
                        "rates and sources in docs/method.md)")
    p.add_argument("--cluster-profile", default=None, metavar="FILE",
                   help="cluster profile JSON from `relibra calibrate` (replaces --cluster's rates)")
    p.add_argument("--dispatcher", default=None, choices=DISPATCHERS,
                   help="token dispatcher whose traffic and bandwidths are charged (default: alltoall, or the "
                        "profile's)")
    p.add_argument("--overlap", default=None, choices=OVERLAPS,
                   help="the trainer's compute / all-to-all overlap: none (default), megatron "
                        "(overlap_moe_expert_parallel_comm) or dualpipe (DeepSeek-V3); docs/method.md, 'Overlap'")


def check_micro_batches(batch: TraceBatch, path: str, micro_batch_size: int | None) -> None:
    """PlanError naming the trace file when it has no micro-batch assignment for every sample and no
    ``--micro-batch-size`` is given (``relibra plan``, ``relibra compare``)."""
    if micro_batch_size is None and (batch.micro_batch is None or int(np.min(batch.micro_batch)) < 0):
        raise PlanError(f"trace {path} has no micro-batch assignment (for every sample): pass --micro-batch-size B")


def cluster_of_plan(plan: BatchPlan, plan_path: str, cluster_name: str, profile: str | None = None,
                    dispatcher: str | None = None, overlap: str | None = None) -> ClusterSpec:
    """The ClusterSpec a plan file was made for: its ``num_gpus`` / ``gpus_per_node`` on fabric ``cluster_name``
    (or the cluster profile ``profile``, see ``cluster_by_name``)."""
    if plan.num_gpus % plan.gpus_per_node:
        raise PlanError(f"plan {plan_path}: num_gpus={plan.num_gpus} is not a multiple of "
                        f"gpus_per_node={plan.gpus_per_node}")
    return cluster_by_name(cluster_name, plan.num_gpus // plan.gpus_per_node, plan.gpus_per_node, profile, dispatcher,
                           overlap)


def load_previous(path: str, model: ModelSpec, cluster: ClusterSpec, flag: str = "--previous") -> Placement:
    """The placement of plan file ``path`` (for ``--previous``): ``load_previous_plan``'s."""
    return load_previous_plan(path, model, cluster, flag).placement


def load_previous_plan(path: str, model: ModelSpec, cluster: ClusterSpec, flag: str = "--previous") -> BatchPlan:
    """Plan file ``path`` (for ``--previous``); PlanError naming the file and the field when it is not a plan for
    this model (``num_layers``, ``num_experts``) and cluster (``num_gpus``, ``gpus_per_node``)."""
    from ..plan import BatchPlan

    try:
        prev = BatchPlan.load(path)
    except (OSError, ValueError, KeyError) as exc:
        raise PlanError(f"{flag} {path}: not a readable plan file ({type(exc).__name__}: {exc})") from None
    for field, have, want, of in (("num_layers", prev.num_layers, model.num_layers, f"model {model.name}"),
                                  ("num_experts", prev.num_experts, model.num_experts, f"model {model.name}"),
                                  ("num_gpus", prev.num_gpus, cluster.num_gpus, "the cluster"),
                                  ("gpus_per_node", prev.gpus_per_node, cluster.gpus_per_node, "the cluster")):
        if have != want:
            raise PlanError(f"{flag} {path}: {field}={have}, but {of} has {field}={want}")
    return prev


def plan_options(args: argparse.Namespace, *, previous: Placement | None = None, history: np.ndarray | None = None,
                 sample_gpu: np.ndarray | None = None, previous_loads: np.ndarray | None = None) -> PlanOptions:
    """The ``PlanOptions`` of a ``relibra plan`` command line (flags left unset keep their defaults), with what
    ``plan_file`` loaded from the files the flags name: ``previous`` (``--previous``), ``history`` int64
    ``[W, L, E]`` (``--history``), ``sample_gpu`` int ``[N]`` (``--sample-gpu``), ``previous_loads`` int64
    ``[M, L, G, E]`` (``--previous-trace``). ``args`` is only read; the options check themselves (``PlanOptions``),
    once."""
    from ..planners.options import PlanOptions

    kw: dict[str, Any] = {"replica_slots": args.replica_slots, "seed": args.seed, "workers": args.workers,
                          "repack": bool(args.repack), "migration": args.migration == "price",
                          "price_replicas": args.replica_pricing == "price",
                          "final_reorder": bool(args.final_reorder)}
    if getattr(args, "keep_cell_sizes", False):
        kw["keep_cell_sizes"] = True
    if not getattr(args, "resident_replicas", True):
        kw["resident_replicas"] = False
    for _, name, _, _ in _OPTION_FLAGS:
        if getattr(args, name) is not None:
            kw[name] = getattr(args, name)
    if args.objective is not None:
        kw["objective"] = args.objective
    for name, value in (("previous", previous), ("history", history), ("sample_gpu", sample_gpu),
                        ("previous_loads", previous_loads)):
        if value is not None:
            kw[name] = value
    if getattr(args, "sample_owner", "planner") != "planner":
        kw["sample_owner"] = args.sample_owner
    if getattr(args, "sample_placement", None) is not None:
        kw["sample_placement"] = args.sample_placement
    return PlanOptions.from_kwargs(**kw)


def load_history(paths: list[str], model: ModelSpec) -> np.ndarray:
    """int64 ``[W, L, E]``: the per-(layer, expert) token loads of the past batches in trace files ``paths``
    (for ``--history``); PlanError naming the file when it is not a trace of ``model``."""
    from ..evaluate import check_batch_model
    from ..trace import TraceBatch

    loads = []
    for path in paths:
        try:
            past = TraceBatch.load(path)
        except (OSError, ValueError, KeyError) as exc:
            raise PlanError(f"--history {path}: not a readable trace file ({type(exc).__name__}: {exc})") from None
        check_batch_model(past, model, f"--history {path}: trace")
        loads.append(past.sample_expert_counts().sum(axis=0))
    return np.stack(loads).astype(np.int64)


def load_previous_loads(args: argparse.Namespace, previous: BatchPlan | None, model: ModelSpec,
                        cluster: ClusterSpec) -> np.ndarray | None:
    """``--previous-trace``'s loads, int64 ``[M, L, G, E]``: that trace under the sample placement of the
    ``--previous`` plan ``previous`` (``load_previous_plan``: checked against the model and cluster), which must
    have been made for it (``evaluate.check_plan_batch``). None without ``--move-horizon`` > 1 or without
    ``--previous`` (the first batch of a run: nothing to credit a move against).

    Raises:
        PlanError: ``--previous-trace`` without ``--move-horizon`` > 1 and ``--previous``; ``--previous`` with
            ``--move-horizon`` > 1 but no ``--previous-trace``; a trace the previous plan was not made for.
    """
    from ..evaluate import check_plan_batch, plan_loads
    from ..trace import TraceBatch

    horizon = getattr(args, "move_horizon", None) or 1
    path = getattr(args, "previous_trace", None)
    if path is None:
        if horizon > 1 and previous is not None:
            raise PlanError(f"--move-horizon={horizon} with --previous {args.previous} needs --previous-trace: the "
                            "trace that plan was made for, on which the new homes' savings are judged")
        return None
    if horizon == 1 or previous is None:
        raise PlanError(f"--previous-trace {path} only applies with --move-horizon > 1 and --previous PLAN.npz "
                        f"(got --move-horizon={horizon}, --previous={args.previous})")
    batch = TraceBatch.load(path)
    try:
        check_plan_batch(previous, batch, model)
    except PlanError as exc:
        raise PlanError(f"--previous-trace {path} against --previous {args.previous}: {exc}") from None
    return plan_loads(previous, batch, cluster.num_gpus)


def load_inputs(trace_path: str, plan_path: str, model_name: str | ModelSpec, cluster_name: str,
                profile: str | None = None, dispatcher: str | None = None, overlap: str | None = None
                ) -> tuple[ModelSpec, TraceBatch, BatchPlan, ClusterSpec]:
    """``(model, batch, plan, cluster)`` for ``relibra score`` / ``relibra simulate``: the preset, the trace
    (checked against the model), the plan file and the cluster it was made for."""
    from ..plan import BatchPlan
    from ..trace import TraceBatch

    model = model_by_name(model_name)
    batch = TraceBatch.load(trace_path)  # checked against the model and the plan by check_plan_batch
    plan = BatchPlan.load(plan_path)
    return model, batch, plan, cluster_of_plan(plan, plan_path, cluster_name, profile, dispatcher, overlap)


def _score(plan, batch, model, cluster, bound: bool, allow_unfingerprinted: bool = False) -> dict[str, Any]:
    """``PlanScore.to_dict`` of ``plan`` on ``batch`` (with ``bound``: ``percent_of_bound`` and ``bound_t_moe_s``,
    the bound for the plan's replica slots, ``evaluate.bound_t_moe``)."""
    from ..evaluate import bound_t_moe, score_plan

    bnd = None
    if bound:
        bnd = bound_t_moe(batch, model, cluster, plan.planned_replica_slots)
    out = score_plan(plan, batch, model, cluster, bound_t_moe_s=bnd,
                     allow_missing_fingerprint=allow_unfingerprinted).to_dict()
    if bnd is not None:
        out["bound_t_moe_s"] = bnd
    return out


def _step(plan, batch, model, cluster, previous: Placement | None, previous_path: str | None,
          allow_unfingerprinted: bool = False) -> dict[str, Any]:
    """``StepTime.to_dict`` of ``plan``'s simulated step (moves charged against ``previous``, else the static
    placement; replica and reorder traffic charged) and ``moves_charged_against``: the same call and figures as
    ``relibra simulate``, for every strategy alike."""
    from ..sim import simulate_step

    step = simulate_step(plan, batch, model, cluster, previous=previous,
                         allow_missing_fingerprint=allow_unfingerprinted)
    return {**step.to_dict(), "moves_charged_against": previous_path or "static"}


def plan_file(args: argparse.Namespace) -> dict[str, Any]:
    """Plan, save, score: the JSON-ready result (what ``relibra plan --json`` prints). The trace's fit to the
    model and the options' checks are the planner's (``plan_with_options``: ``PlanOptions``, ``check_for``,
    ``check_batch_fits``); here only what the flags alone decide."""
    from ..planners.strategies import REPLICA_STRATEGIES, plan_with_options
    from ..trace import TraceBatch

    model = model_from_args(args)
    cluster = cluster_by_name(args.cluster, args.nodes, args.gpus_per_node, args.cluster_profile, args.dispatcher,
                              args.overlap)
    batch = TraceBatch.load(args.trace)
    if args.replica_slots and args.strategy not in REPLICA_STRATEGIES:
        raise PlanError(f"--replica-slots={args.replica_slots} only applies to {', '.join(REPLICA_STRATEGIES)}, "
                        f"not --strategy {args.strategy}")
    check_micro_batches(batch, args.trace, args.micro_batch_size)
    prev_plan = None if args.previous is None else load_previous_plan(args.previous, model, cluster)
    previous = None if prev_plan is None else prev_plan.placement
    previous_loads = load_previous_loads(args, prev_plan, model, cluster)
    options = plan_options(args, previous=previous, previous_loads=previous_loads,
                           history=load_history(args.history, model) if args.history else None,
                           sample_gpu=load_sample_gpu(args.sample_gpu, args.sample_owner, batch.num_sequences))
    plan = plan_with_options(batch, model, cluster, args.strategy, options, micro_batch_size=args.micro_batch_size)
    plan.save(args.out)
    if args.micro_batch_size is not None:
        batch = batch.with_micro_batch_size(args.micro_batch_size)
    out: dict[str, Any] = {"trace": str(args.trace), "plan": str(args.out), "model": model.name,
                           "cluster": {"name": cluster.name, "nodes": cluster.nodes,
                                       "gpus_per_node": cluster.gpus_per_node, "dispatcher": cluster.dispatcher,
                                       "overlap": cluster.overlap}}
    out.update(_score(plan, batch, model, cluster, args.bound))
    out.update(_step(plan, batch, model, cluster, previous, args.previous))
    out["solve_s"] = float(plan.stats.solve_seconds)
    out["replica_slots"] = plan.replica_slots
    out["repack"] = bool(args.repack)
    out["seed"] = args.seed
    out["sample_owner"] = plan.stats.sample_owner or "planner"
    out["sample_placement"] = placement_of(plan)
    return out


def score_file(trace_path: str, plan_path: str, model_name: str | ModelSpec, cluster_name: str = DEFAULT_CLUSTER,
               bound: bool = False, previous_path: str | None = None, allow_unfingerprinted: bool = False,
               cluster_profile: str | None = None, dispatcher: str | None = None,
               overlap: str | None = None) -> dict[str, Any]:
    """Load a trace and a plan file, score the plan (what ``relibra score --json`` prints): Σ T_MoE (moves free)
    and the simulated step (moves charged against ``previous_path``'s placement, else the static one).
    ``allow_unfingerprinted``: accept a plan without a batch fingerprint (``check_plan_batch``)."""
    model, batch, plan, cluster = load_inputs(trace_path, plan_path, model_name, cluster_name, cluster_profile,
                                              dispatcher, overlap)
    previous = load_previous(previous_path, model, cluster) if previous_path else None
    out: dict[str, Any] = {"trace": str(trace_path), "plan": str(plan_path), "model": model.name,
                           "cluster": {"name": cluster.name, "nodes": cluster.nodes,
                                       "gpus_per_node": cluster.gpus_per_node, "dispatcher": cluster.dispatcher,
                                       "overlap": cluster.overlap}}
    out.update(_score(plan, batch, model, cluster, bound, allow_unfingerprinted))
    out.update(_step(plan, batch, model, cluster, previous, previous_path, allow_unfingerprinted))
    out["sample_owner"] = plan.stats.sample_owner or "planner"
    out["sample_placement"] = placement_of(plan)
    return out


def _print(res: dict[str, Any], as_json: bool) -> None:
    if as_json:
        print(json.dumps(res, indent=2, sort_keys=True))
        return
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"{res.get('strategy')} on {res['trace']}",
              caption="t_moe_s: sum of T_MoE, moves free (the paper's metric); step_s: simulated step, "
                      f"moves (against {res.get('moves_charged_against', 'static')}), replica and reorder traffic "
                      "charged (relibra simulate)")
    t.add_column("metric")
    t.add_column("value", justify="right")
    for k in ("t_moe_s", "step_s", "experts_moved", "moe_fwd_comp_s", "moe_fwd_comm_s", "rank_skew_mean",
              "rank_skew_max", "percent_of_bound", "solve_s", "num_micro_batches", "sample_owner",
              "sample_placement"):
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
    _print(score_file(args.trace, args.plan, model_from_args(args), args.cluster, args.bound, args.previous,
                      args.allow_unfingerprinted, args.cluster_profile, args.dispatcher, args.overlap), args.json)
    return 0
