"""``relibra compare TRACE --model M --nodes N --strategies a,b,c``: every strategy on the same batch, one table.

The first comparison a user makes: each strategy plans the trace's batch, and every plan gets the same
evaluation (``relibra_moe.steady.evaluate``): the sum of the forward T_MoE (the paper's metric, moves free),
the simulated training step (moves from the static placement, replica and reorder traffic charged to every
strategy alike), the experts moved, the rank skew and the solve seconds.

``--batches K`` is the steady-state mode: the trace's micro-batches are cut into K consecutive global batches
(arrival order), planned one after another, each plan's previous placement the strategy's last plan
(``relibra_moe.steady``); the table shows the first step and the steady-state mean of steps 2..K.
``eplb-history`` plans from past batches' loads, so on one batch (no history yet) it is the static layout; it
needs ``--batches`` >= 2 to re-balance. The baselines' models: docs/baselines.md.

``--rate-band [LO,HI]`` (TFLOP/s; default ``specs.GEMM_RATE_BAND``, 300,600) plans and simulates every strategy again
with the expert-GEMM rate at each end of the band and adds ``rate_band`` to the JSON: the reference's (relibra's)
steady speedup over every strategy at each end (docs/method.md, "Rates": the rate at a model's own expert shape is
a band where it was not measured).

``--placements a,b`` (``sample_placements.SAMPLE_PLACEMENTS``; default round-robin,length-balanced): the baselines
(every strategy but relibra*, which places its samples itself, from the length-balanced placement) run on each
placement; the rows after the first placement's are labelled with theirs ("static, length-balanced (verl's
balance_batch)": what a verl user already has). With ``--sample-owner trainer`` every strategy runs on each
placement as the trainer's.

``--sample-owner trainer`` plans every strategy for the trainer's own sample placement (``--sample-gpu FILE.npy``,
default round-robin within each micro-batch): only expert homes, replicas and splits are planned.
``--sample-owner both`` prints both modes on one table, the trainer-owned rows under the planner-owned ones, with
the trainer-owned step over the planner-owned one per strategy (what the trainer's placement costs).
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from ..atomic import write_text
from ..errors import PlanError
from ..sample_placements import SAMPLE_PLACEMENTS
from ..specs import DEFAULT_CLUSTER, GEMM_RATE_BAND
from .plan import (
    add_cluster_args,
    add_model_args,
    add_sample_owner_flags,
    add_seed_workers_flags,
    check_micro_batches,
    cluster_by_name,
    load_sample_gpu,
    model_by_name,
    model_from_args,
    option_default,
)

DEFAULT_COMPARE = "static,eplb,eplb-history,online,relibra"
DEFAULT_PLACEMENTS = "round-robin,length-balanced"
"""The baselines' sample placements ``relibra compare`` shows by default: Megatron's round-robin and verl's
length-balanced ``balance_batch`` (what a verl user already has; ``sample_placements``)."""


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``relibra compare`` to the CLI."""
    from ..planners.strategies import STRATEGIES

    p = subparsers.add_parser(
        "compare", help="plan a trace with several strategies and compare them on one evaluation",
        description="Plan the batch in TRACE with every strategy of --strategies and print one table: sum of "
                    "T_MoE (moves free), simulated step (moves, replica and reorder traffic charged), experts "
                    "moved, rank skew, solve seconds. --batches K: the steady state of K consecutive batches.")
    p.add_argument("trace", help="trace file (.npz from `relibra trace import/synth`)")
    add_model_args(p)
    add_cluster_args(p)
    p.add_argument("--nodes", type=int, required=True, help="nodes in the EP group")
    p.add_argument("--gpus-per-node", type=int, default=8, help="GPUs per node (default %(default)s)")
    p.add_argument("--strategies", default=DEFAULT_COMPARE,
                   help=f"comma-separated strategies (default {DEFAULT_COMPARE}; known: {', '.join(STRATEGIES)})")
    p.add_argument("--replica-slots", type=int, default=2,
                   help="replica slots per GPU r for the strategies that place replicas (default %(default)s)")
    p.add_argument("--micro-batch-size", type=int, default=None,
                   help="samples per micro-batch (default: the trace's own assignment)")
    p.add_argument("--layers", type=int, default=None,
                   help="plan and simulate only the first N MoE layers (the model is restricted to match)")
    p.add_argument("--batches", type=int, default=1,
                   help="steady state: cut the trace into K consecutive batches planned one after another "
                        "(default %(default)s: one batch from the static placement)")
    p.add_argument("--rebalance-every", type=int, default=1,
                   help="eplb-history: re-balance every n batches (default %(default)s); with one batch it has no "
                        "history and keeps the static layout")
    p.add_argument("--window", type=int, default=1,
                   help="eplb-history: batches of load history EPLB sees (default %(default)s: the previous batch)")
    p.add_argument("--move-horizon", type=int, default=option_default("move_horizon"),
                   help="with --batches > 1, relibra: the batches a re-layout of its experts is expected to serve; "
                        "from the second batch on, a move is credited H - 1 times what its homes save on the batch "
                        "before (default %(default)s: a move pays for itself on its own step; the table charges "
                        "every move in full either way)")
    add_sample_owner_flags(p, both=True)
    p.add_argument("--rate-band", nargs="?", const="default", default=None, metavar="LO,HI",
                   help="also run at the ends of the expert-GEMM rate band, TFLOP/s (default "
                        f"{','.join(format(r / 1e12, 'g') for r in GEMM_RATE_BAND)}: specs.GEMM_RATE_BAND); the "
                        "JSON's rate_band has the speedups there")
    p.add_argument("--placements", default=DEFAULT_PLACEMENTS,
                   help=f"comma-separated sample placements the baselines run on (default {DEFAULT_PLACEMENTS}; "
                        f"known: {', '.join(SAMPLE_PLACEMENTS)}); relibra places its own samples")
    add_seed_workers_flags(p)
    p.add_argument("--json", default=None, metavar="OUT", help="also write the full result as JSON to OUT")
    p.set_defaults(func=run)


def parse_names(flag: str, text: str, known: Any, what: str) -> list[str]:
    """The names of ``a,b,c`` given to ``flag``; PlanError for an unknown or repeated name, or an empty list."""
    names = [s.strip() for s in str(text).split(",") if s.strip()]
    if not names:
        raise PlanError(f"{flag}={text!r} names no {what}; known: {', '.join(known)}")
    for s in names:
        if s not in known:
            raise PlanError(f"{flag}: unknown {what} {s!r}; known: {', '.join(known)}")
    dup = sorted({s for s in names if names.count(s) > 1})
    if dup:
        raise PlanError(f"{flag} names {dup[0]!r} twice")
    return names


def parse_strategies(text: str) -> list[str]:
    """The strategy names of ``a,b,c`` (:func:`parse_names`)."""
    from ..planners.strategies import STRATEGIES

    return parse_names("--strategies", text, STRATEGIES, "strategy")


def parse_placements(text: str) -> list[str]:
    """The sample placements of ``a,b`` (:func:`parse_names`)."""
    return parse_names("--placements", text, SAMPLE_PLACEMENTS, "sample placement")


def compare_file(trace_path: str, model_name: Any, nodes: int, gpus_per_node: int = 8, *,
                 strategies: str = DEFAULT_COMPARE, cluster_name: str = DEFAULT_CLUSTER, replica_slots: int = 2,
                 micro_batch_size: int | None = None, layers: int | None = None, batches: int = 1,
                 rebalance_every: int = 1, window: int = 1, seed: int = 0, workers: int = 1,
                 sample_owner: str = "planner", sample_gpu_path: str | None = None,
                 cluster_profile: str | None = None, dispatcher: str | None = None,
                 overlap: str | None = None, rate_band: tuple[float, float] | None = None,
                 placements: str = DEFAULT_PLACEMENTS, move_horizon: int = 1) -> dict[str, Any]:
    """Load the trace, run the comparison, return the JSON-ready result (what ``--json OUT`` writes).

    ``sample_owner``: "planner", "trainer" or "both" (``steady.run_steady``); ``sample_gpu_path``: the trainer's
    ranks, an int ``[N]`` .npy file over the trace's samples (default round-robin within each micro-batch).
    ``rate_band``: ``(low, high)`` expert-GEMM FLOP/s; every strategy runs again at each (``rate_band`` in the
    result: ``{"flops": [low, high], "speedup": {"low": {...}, "high": {...}}}``, the reference's steady
    speedups; a cluster profile's GEMM curve is dropped there: the band replaces the rate).
    ``placements``: the baselines' sample placements, ``a,b`` (``parse_placements``; ``steady.run_steady``).
    ``move_horizon``: relibra*'s ``PlanOptions.move_horizon`` (``steady.run_steady``).

    Raises:
        PlanError / TraceError: a bad argument (named with its value), a trace for another model, a trace
            without micro-batch assignment and no ``micro_batch_size``.
    """
    from ..evaluate import check_batch_model
    from ..steady import consecutive_batches, consecutive_indices, run_steady
    from ..trace import TraceBatch
    from ..validate import check_choice

    names = parse_strategies(strategies)
    places = parse_placements(placements)
    check_choice("--sample-owner", sample_owner, ("planner", "trainer", "both"))
    for flag, v, lo in (("--replica-slots", replica_slots, 0), ("--batches", batches, 1),
                        ("--rebalance-every", rebalance_every, 1), ("--window", window, 1), ("--seed", seed, 0),
                        ("--workers", workers, 1), ("--nodes", nodes, 1), ("--gpus-per-node", gpus_per_node, 1),
                        ("--move-horizon", move_horizon, 1)):
        if v < lo:
            raise PlanError(f"{flag}={v} must be >= {lo}")
    if layers is not None and layers < 1:
        raise PlanError(f"--layers={layers} must be >= 1")
    model = model_by_name(model_name)
    cluster = cluster_by_name(cluster_name, nodes, gpus_per_node, cluster_profile, dispatcher, overlap)
    batch = TraceBatch.load(trace_path)
    check_batch_model(batch, model, f"trace {trace_path}")  # before --layers cuts both to their first layers
    check_micro_batches(batch, trace_path, micro_batch_size)
    if micro_batch_size is not None:
        if micro_batch_size < 1:
            raise PlanError(f"--micro-batch-size={micro_batch_size} must be >= 1")
        batch = batch.with_micro_batch_size(micro_batch_size)
    if layers is not None and layers > model.num_layers:
        raise PlanError(f"--layers={layers} exceeds the {model.num_layers} MoE layers of {model.name}")
    batch = batch.restrict_layers(layers)
    model = model.with_(num_layers=batch.num_layers)
    seq = consecutive_batches(batch, batches)
    ranks = load_sample_gpu(sample_gpu_path, sample_owner, batch.num_sequences)
    per_batch = None if ranks is None else [ranks[idx] for idx in consecutive_indices(batch, batches)]
    res = run_steady(seq, model, cluster, names, replica_slots=replica_slots, seed=seed, workers=workers,
                     rebalance_every=rebalance_every, window=window,
                     reference="relibra" if "relibra" in names else names[0], sample_owner=sample_owner,
                     sample_gpu=per_batch, placements=places, move_horizon=move_horizon)
    if rate_band is not None:
        res["rate_band"] = _rate_band(rate_band, seq, model, cluster, names, replica_slots=replica_slots, seed=seed,
                                      workers=workers, rebalance_every=rebalance_every, window=window,
                                      reference=res.get("reference", names[0]), sample_owner=sample_owner,
                                      sample_gpu=per_batch, placements=places, move_horizon=move_horizon)
    if sample_owner != "planner":
        res["sample_gpu"] = "round-robin" if sample_gpu_path is None else str(sample_gpu_path)
    res.update({"trace": str(trace_path), "mode": "steady" if batches > 1 else "single",
                "layers_total": model_by_name(model_name).num_layers})
    return res


def parse_rate_band(text: str | None) -> tuple[float, float] | None:
    """``--rate-band``: None (off), "default" (``specs.GEMM_RATE_BAND``) or ``LO,HI`` in TFLOP/s -> FLOP/s."""
    from ..specs import GEMM_RATE_BAND

    if text is None:
        return None
    if text == "default":
        return GEMM_RATE_BAND
    try:
        lo, hi = (float(v) * 1e12 for v in str(text).split(","))
    except ValueError:
        raise PlanError(f"--rate-band={text!r} must be LO,HI in TFLOP/s, e.g. 300,600") from None
    if not (0 < lo <= hi and hi < float("inf")):
        raise PlanError(f"--rate-band={text!r} must hold 0 < LO <= HI (TFLOP/s)")
    return lo, hi


def _rate_band(band: tuple[float, float], seq: Any, model: Any, cluster: Any, names: list[str], *,
               reference: str, **kwargs: Any) -> dict[str, Any]:
    """The reference's steady speedups with the expert-GEMM rate at each end of ``band`` (FLOP/s)."""
    from ..steady import run_steady

    out: dict[str, Any] = {"flops": [float(band[0]), float(band[1])], "reference": reference, "speedup": {},
                           "step_s": {}}
    for end, flops in zip(("low", "high"), band):
        r = run_steady(seq, model, cluster.with_(flops=float(flops), gemm_curve=()), names, reference=reference,
                       **kwargs)
        out["speedup"][end] = r.get("speedup", {})
        out["step_s"][end] = {s: v["steady"]["step_s"] for s, v in r["strategies"].items()}
    return out


def run(args: argparse.Namespace) -> int:
    """``relibra compare``: print the table (and write ``--json OUT``); exit status 0."""
    from rich.console import Console

    from ..plan import json_default
    from ..steady import steady_table

    res = compare_file(args.trace, model_from_args(args), args.nodes, args.gpus_per_node, strategies=args.strategies,
                       cluster_name=args.cluster, replica_slots=args.replica_slots,
                       micro_batch_size=args.micro_batch_size, layers=args.layers, batches=args.batches,
                       rebalance_every=args.rebalance_every, window=args.window, seed=args.seed,
                       workers=args.workers, sample_owner=args.sample_owner, sample_gpu_path=args.sample_gpu,
                       cluster_profile=args.cluster_profile, dispatcher=args.dispatcher, overlap=args.overlap,
                       rate_band=parse_rate_band(args.rate_band), placements=args.placements,
                       move_horizon=args.move_horizon)
    console = Console()
    if not console.is_terminal:  # a pipe or a file: keep the table's rows and title unwrapped
        console = Console(width=max(console.width, 200))
    console.print(steady_table(res))
    if args.json:
        write_text(args.json, json.dumps(res, indent=2, default=json_default))
        print(f"wrote {args.json}")
    return 0
