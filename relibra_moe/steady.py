"""Steady state of an RL run: consecutive global batches planned one after another, each from the last plan.

In an RL run every global batch starts from the placement the previous batch left behind. A strategy that
moves experts pays for the move (weights + optimizer state over the fabric, ``sim.reorder_traffic``) on the
step that makes it; a strategy that keeps its experts pays nothing. The per-step figures here are those of
the simulator on that chain:

- ``plan_steady`` plans batch k with every strategy, each plan's ``previous`` the strategy's plan of batch
  k - 1 (static before the first batch): relibra and relibra-inter *price* their moves against it
  (``planners.migration``), eplb-history relabels towards it and re-balances on its schedule
  (``planners.history.EplbSchedule``), eplb and lplb re-plan from scratch, static, balanced and online never
  move;
- ``evaluate_plan`` is the one evaluation used for everyone (a ``sim.StepResult``): the paper's metric, the sum
  of the forward T_MoE over micro-batches and layers with moves free (``t_moe_s``), and the simulated step with
  the moves, the replica traffic and the reorder traffic charged to every strategy alike (``step_s``,
  ``sim.simulate_step`` with ``previous`` = the strategy's last placement);
- the first step (from the static placement) is reported apart from the steady state (steps 2..K);
- ``run_steady(placements=...)`` also runs the baselines on other sample placements (``sample_placements``: verl's
  length-balanced ``balance_batch``, longest-first), rows ``"strategy@placement"``; relibra places its own samples.

Batch sequences: ``consecutive_batches`` splits a trace in arrival (file) order into K consecutive batches
(e.g. the real GPT-OSS trace); ``drifting_batches`` builds synthetic RL batches whose domain mix drifts from
batch to batch (``relibra_moe.synthetic``, labelled synthetic). The models of the baselines are in
docs/baselines.md.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from .errors import PlanError, TraceError
from .evaluate import plan_loads
from .plan import BatchPlan
from .planners.history import EplbSchedule
from .planners.options import HISTORY_STRATEGIES, RELIBRA_STRATEGIES, REPLICA_STRATEGIES
from .planners.strategies import check_strategy, plan_batch
from .sample_placements import PLACEMENT_USERS, SAMPLE_PLACEMENTS
from .sim import StepResult, simulate_step
from .specs import ClusterSpec, ModelSpec
from .trace import TraceBatch
from .validate import check_choice, check_int

DEFAULT_STRATEGIES = ("static", "eplb", "eplb-history", "online", "relibra")
"""The strategies of a steady-state comparison by default: Megatron-LM, EPLB+ (oracle loads), EPLB from
history, online replication without replay, relibra."""
PRICED_STRATEGIES = RELIBRA_STRATEGIES
"""Strategies that price their moves against the ``previous`` placement (option ``previous``): the ReLibra ones
(their migration pricing, ``migration.migrate``)."""


# ---------------------------------------------------------------------------------------- batches
def consecutive_indices(batch: TraceBatch, num_batches: int) -> list[np.ndarray]:
    """int64 sample indices ``[N_k]`` of each of the ``num_batches`` batches ``consecutive_batches`` cuts (in order).

    Raises:
        TraceError: as ``consecutive_batches``.
    """
    num_batches = check_int("num_batches", num_batches, 1, error=TraceError)
    mb = batch.resolve_micro_batch()
    M = int(mb.max()) + 1
    if num_batches > M:
        raise TraceError(f"num_batches={num_batches} exceeds the {M} micro-batches of the trace: a global batch "
                         "needs at least one micro-batch")
    out = []
    for run in np.array_split(np.arange(M), int(num_batches)):
        idx = np.flatnonzero((mb >= run[0]) & (mb <= run[-1]))
        if idx.size == 0:
            raise TraceError(f"micro-batches {int(run[0])}..{int(run[-1])} hold no sample")
        out.append(idx.astype(np.int64))
    return out


def consecutive_batches(batch: TraceBatch, num_batches: int) -> list[TraceBatch]:
    """Split ``batch`` (with a micro-batch assignment) into ``num_batches`` consecutive global batches.

    The micro-batches ``0 .. M-1`` are cut into ``num_batches`` contiguous runs of ``M // K`` or
    ``M // K + 1`` (``np.array_split``); batch k holds the samples of its run in their order
    (``consecutive_indices``), its micro-batches renumbered from 0. With the assignment ``i // B`` of a trace in
    arrival order this is the trace in arrival order, K batches after one another; every sample lands in exactly
    one batch.

    Raises:
        TraceError: no assignment, ``num_batches`` not an int >= 1, or more batches than micro-batches.
    """
    runs = consecutive_indices(batch, num_batches)
    if len(runs) == 1:
        return [batch]
    mb = batch.resolve_micro_batch()
    out = []
    for idx in runs:
        # micro-batches renumbered densely (a gap in the assignment would leave an empty micro-batch)
        _, dense = np.unique(mb[idx], return_inverse=True)
        out.append(batch.subset(idx, micro_batch=dense.astype(np.int32)))
    return out


def domain_mix(step: int, drift: float) -> np.ndarray:
    """float64 ``[3]``: shares of the base domains (math, code, instruction) in batch ``step``.

    ``p_d = (1 + cos(2 pi (drift * step - d / 3))) / 3`` (the three cosines sum to 0, so the shares sum to 1):
    the mix rotates by ``drift`` of a full turn per batch. Batch 0 is 2/3 math, 1/6 code, 1/6 instruction;
    ``drift = 0`` keeps that mix for every batch; ``drift = 0.25`` moves the dominant domain on every few batches.
    """
    d = np.arange(3)
    p = (1.0 + np.cos(2.0 * np.pi * (float(drift) * step - d / 3.0))) / 3.0
    return np.clip(p, 0.0, None) / np.clip(p, 0.0, None).sum()


def drifting_batches(model: ModelSpec, num_batches: int, num_prompts: int, *, responses_per_prompt: int = 4,
                     micro_batch_size: int = 32, drift: float = 0.25, seed: int = 0) -> list[TraceBatch]:
    """Synthetic RL batches (labelled synthetic) whose domain mix drifts: batch k draws the domain of each of its
    micro-batches from ``domain_mix(k, drift)`` (one domain per micro-batch, as ``synthetic`` "mixed" does) and
    builds each domain's samples with ``synthetic.rl_batch`` (seeded by ``seed``, k and the domain; the model's
    hot-expert profiles are the same for every batch).

    Args:
        model: the ModelSpec (its ``num_layers`` MoE layers are built; restrict it to keep runs short).
        num_batches: K; num_prompts: prompts per batch (samples = prompts x responses).
        micro_batch_size: samples per micro-batch (a multiple of ``responses_per_prompt``; must divide the
            batch's samples).
        drift: turns of the domain mix per batch (``domain_mix``).

    Returns:
        K count-built TraceBatches with micro-batches assigned; ``sample_info["domain"]`` per sample.
    """
    from .synthetic import BASE_DOMAINS, _stable_seed, rl_batch

    num_batches, num_prompts, responses_per_prompt, micro_batch_size = (
        check_int(name, v, 1, error=TraceError)
        for name, v in (("num_batches", num_batches), ("num_prompts", num_prompts),
                        ("responses_per_prompt", responses_per_prompt), ("micro_batch_size", micro_batch_size)))
    n = num_prompts * responses_per_prompt
    if micro_batch_size % responses_per_prompt or n % micro_batch_size:
        raise TraceError(f"micro_batch_size={micro_batch_size} must be a multiple of responses_per_prompt="
                         f"{responses_per_prompt} and divide the {n} samples of a batch")
    if not np.isfinite(drift):
        raise TraceError(f"drift={drift!r} must be a finite number")
    M = n // micro_batch_size
    out = []
    for k in range(int(num_batches)):
        rng = np.random.default_rng(_stable_seed("relibra-steady-drift", seed, k))
        dom = rng.choice(3, size=M, p=domain_mix(k, drift))
        counts = np.zeros((n, model.num_layers, model.num_experts), np.int64)
        domains = np.empty(n, dtype=object)
        for d in np.unique(dom):
            mbs = np.flatnonzero(dom == d)
            part = rl_batch(model, BASE_DOMAINS[d], len(mbs) * micro_batch_size // responses_per_prompt,
                            responses_per_prompt, seed=_stable_seed("relibra-steady-batch", seed, k, int(d)))
            rows = (mbs[:, None] * micro_batch_size + np.arange(micro_batch_size)[None]).ravel()
            counts[rows] = part.sample_expert_counts()
            domains[rows] = BASE_DOMAINS[d]
        mix = {BASE_DOMAINS[d]: round(float(p), 3) for d, p in enumerate(domain_mix(k, drift))}
        out.append(TraceBatch.from_counts(
            counts, model.top_k, np.arange(model.num_layers, dtype=np.int32),
            micro_batch=(np.arange(n) // micro_batch_size).astype(np.int32),
            source=(f"synthetic RL batch (relibra_moe.synthetic, not real routing): model {model.name}, drifting "
                    f"domain mix {mix}, batch {k} of {num_batches}, {num_prompts} prompts x {responses_per_prompt} "
                    f"responses, seed {seed}"),
            sample_info={"domain": domains.astype(str)}))
    return out


# ------------------------------------------------------------------------------------- evaluation
def evaluate_plan(plan: BatchPlan, batch: TraceBatch, model: ModelSpec, cluster: ClusterSpec, *,
                  previous: BatchPlan | None = None, solve_s: float | None = None) -> StepResult:
    """The one evaluation of a plan: ``sim.StepResult`` of ``simulate_step(plan, batch, ...)`` with the moves
    charged against ``previous``'s placement (None: the static one), the same call as
    ``relibra simulate TRACE PLAN [--previous PREV]``. Its ``step.t_moe_s`` (sum of the forward T_MoE, moves
    free: the paper's metric) equals ``evaluate.score_plan``'s ``t_moe_s``; ``step.step_s`` charges the moves,
    replica and reorder traffic."""
    step = simulate_step(plan, batch, model, cluster, previous=None if previous is None else previous.placement)
    return StepResult.of(plan, step, solve_s)


def plan_steady(batches: Sequence[TraceBatch], model: ModelSpec, cluster: ClusterSpec, strategy: str, *,
                replica_slots: int = 2, seed: int = 0, workers: int = 1, rebalance_every: int = 1, window: int = 1,
                progress: Callable[[str, int], None] | None = None, sample_owner: str = "planner",
                sample_gpu: Sequence[Any] | None = None,
                **options: Any) -> tuple[list[BatchPlan], list[dict[str, Any]]]:
    """Plan and simulate ``batches`` one after another with one strategy; the chain of plans and evaluations.

    Batch k's plan gets ``previous`` = the plan of batch k - 1 (relibra / relibra-inter price moves against it,
    eplb-history relabels towards it), and the simulator charges the moves against that same placement
    (static before batch 0). eplb-history sees the loads of the last ``window`` batches every
    ``rebalance_every`` batches (``EplbSchedule``). ``replica_slots`` applies to the strategies that place
    replicas (``REPLICA_STRATEGIES``), 0 elsewhere. ``options`` go to ``plan_batch``; with ``move_horizon`` H > 1,
    batch k's ``previous_loads`` are batch k - 1's loads under its plan's samples (``evaluate.plan_loads``), except
    in the H - 1 batches after a plan whose move was credited (``PlanStats.move_credited``).
    ``sample_owner="trainer"``: every batch keeps the trainer's samples (``PlanOptions.sample_owner``), batch k's
    ranks ``sample_gpu[k]`` (int ``[N_k]``; None: round-robin in every batch).

    Returns:
        (plans ``[K]``, evaluations ``[K]``: the ``StepResult.to_dict`` row of ``evaluate_plan`` with ``batch`` k
        and ``num_micro_batches``; its ``experts_moved`` counts the experts whose home differs from the previous
        plan's, what the simulator charged).
    """
    check_strategy(strategy)
    if not batches:
        raise PlanError("no batches to plan: the steady state needs at least one")
    if sample_gpu is not None and len(sample_gpu) != len(batches):
        raise PlanError(f"sample_gpu holds the ranks of {len(sample_gpu)} batches, the steady state has "
                        f"{len(batches)}: give one int [N] array per batch")
    schedule = EplbSchedule(rebalance_every=rebalance_every, window=window)
    r = int(replica_slots) if strategy in REPLICA_STRATEGIES else 0
    plans: list[BatchPlan] = []
    rows: list[dict[str, Any]] = []
    prev: BatchPlan | None = None
    settled = 0  # option move_horizon: the first batch given previous_loads again after a credited move
    for k, batch in enumerate(batches):
        if progress is not None:
            progress(strategy, k)
        opts = dict(options)
        if sample_owner != "planner":
            opts["sample_owner"] = sample_owner
            if sample_gpu is not None:
                opts["sample_gpu"] = sample_gpu[k]
        if prev is not None and strategy in PRICED_STRATEGIES + HISTORY_STRATEGIES:
            opts["previous"] = prev.placement
        if prev is not None and opts.get("move_horizon", 1) != 1 and k >= settled:  # the last batch as it ran
            opts["previous_loads"] = plan_loads(prev, batches[k - 1], cluster.num_gpus)
        if strategy in HISTORY_STRATEGIES:
            opts["history"] = schedule.history_for(k)
        t0 = time.perf_counter()
        plan = plan_batch(batch, model, cluster, strategy, replica_slots=r, seed=seed, workers=workers, **opts)
        solve_s = time.perf_counter() - t0
        row = evaluate_plan(plan, batch, model, cluster, previous=prev, solve_s=solve_s).to_dict()
        schedule.observe(batch.sample_expert_counts().sum(axis=0))
        row["batch"] = k
        row["num_micro_batches"] = plan.num_micro_batches
        plans.append(plan)
        rows.append(row)
        prev = plan
        if plan.stats.move_credited:  # its homes serve the batches they were credited for (PlanStats)
            settled = k + int(options["move_horizon"])
    return plans, rows


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """First step and steady state (steps 2..K; step 1 alone when K = 1) of one strategy's evaluations.

    ``steady.step_s`` / ``t_moe_s`` / ``experts_moved`` / ``rank_skew_mean`` / ``solve_s`` are means per step;
    ``steady.tokens_per_s`` is the steady steps' tokens over their summed step seconds.
    """
    first = rows[0]
    rest = rows[1:] or rows[:1]
    mean = {k: float(np.mean([r[k] for r in rest])) for k in ("step_s", "t_moe_s", "experts_moved", "reorder_s",
                                                                "replica_exposed_s", "rank_skew_mean", "solve_s")}
    mean["tokens_per_s"] = float(sum(r["tokens"] for r in rest) / sum(r["step_s"] for r in rest))
    mean["steps"] = len(rest)
    keys = ("step_s", "t_moe_s", "experts_moved", "rank_skew_mean", "solve_s", "tokens_per_s")
    return {"first": {k: first[k] for k in keys}, "steady": mean}


def run_steady(batches: Sequence[TraceBatch], model: ModelSpec, cluster: ClusterSpec,
               strategies: Sequence[str] = DEFAULT_STRATEGIES, *, replica_slots: int = 2, seed: int = 0,
               workers: int = 1, rebalance_every: int = 1, window: int = 1, reference: str = "relibra",
               progress: Callable[[str, int], None] | None = None, sample_owner: str = "planner",
               sample_gpu: Sequence[Any] | None = None,
               placements: Sequence[str] = ("round-robin",), move_horizon: int = 1) -> dict[str, Any]:
    """The steady-state comparison (JSON-ready): every strategy through ``plan_steady`` on the same batches.

    ``sample_owner``: "planner" (the strategies place the samples), "trainer" (every strategy keeps the trainer's
    ranks ``sample_gpu``, one int ``[N_k]`` per batch, default round-robin) or "both" (every strategy in both
    modes on the same batches: the planner-owned rows, then the trainer-owned ones).

    ``placements`` (``sample_placements.SAMPLE_PLACEMENTS``, the first one plain, the others as rows
    ``"name@placement"``): planner-owned, every strategy that does not place samples (not relibra*) runs once per
    placement (option ``sample_placement``), relibra* once from its own start; trainer-owned without
    ``sample_gpu``, every strategy runs once per placement as the trainer's.

    ``move_horizon``: ``PlanOptions.move_horizon`` of ``PRICED_STRATEGIES`` (``plan_steady``); every move is
    still charged in full to its step.

    Returns:
        ``{"num_batches", "tokens_per_batch", "replica_slots", "rebalance_every", "window", "sample_owner",
        "strategies": {name: {"per_step": [...StepResult rows], "first": {...}, "steady": {...}}}, "speedup":
        {name: steady tokens/s of ``reference`` over that of name}, "speedup_first": the same on the first step}``;
        with "both", ``strategies`` holds the planner-owned runs and ``trainer`` the trainer-owned ones (same
        layout), ``speedup`` / ``trainer_speedup`` are both against the planner-owned ``reference``, and
        ``trainer_gap`` gives, per strategy, the trainer-owned steady ``step_s`` and ``t_moe_s`` over the
        planner-owned ones (> 1: what the trainer's placement costs).
    """
    check_choice("sample_owner", sample_owner, ("planner", "trainer", "both"))
    move_horizon = check_int("move_horizon", move_horizon, 1)
    if not placements:
        raise PlanError(f"placements names no sample placement; give at least one of {SAMPLE_PLACEMENTS}")
    for p in placements:
        check_choice("placements", p, SAMPLE_PLACEMENTS)
    out: dict[str, Any] = {
        "num_batches": len(batches), "tokens_per_batch": [int(b.num_tokens) for b in batches],
        "samples_per_batch": [int(b.num_sequences) for b in batches],
        "model": model.name, "layers": model.num_layers,
        "cluster": {"name": cluster.name, "nodes": cluster.nodes, "gpus_per_node": cluster.gpus_per_node},
        "replica_slots": int(replica_slots), "rebalance_every": int(rebalance_every), "window": int(window),
        "move_horizon": move_horizon, "seed": int(seed), "sample_owner": sample_owner, "placements": list(placements),
        "strategies": {},
        "metrics": {"t_moe_s": "sum of the forward T_MoE over micro-batches and layers, moves free (the paper's "
                               "metric)",
                    "step_s": "simulated training step: attention + MoE forward/backward, replica traffic and the "
                              "re-layout from the strategy's previous placement charged to every strategy"},
    }
    modes = {"planner": ("planner",), "trainer": ("trainer",), "both": ("planner", "trainer")}[sample_owner]
    runs: dict[str, dict[str, Any]] = {m: {} for m in modes}
    for mode in modes:
        for s in strategies:
            for i, p in enumerate(placements):
                ranks = sample_gpu if mode == "trainer" else None
                own = mode == "planner" and s in RELIBRA_STRATEGIES  # places the samples itself
                if i and (ranks is not None or own):
                    continue
                opts = {"sample_placement": p} if ranks is None and not own and p != "round-robin" else {}
                if move_horizon != 1 and s in PRICED_STRATEGIES:
                    opts["move_horizon"] = move_horizon
                _, rows = plan_steady(batches, model, cluster, s, replica_slots=replica_slots, seed=seed,
                                      workers=workers, rebalance_every=rebalance_every, window=window,
                                      progress=progress, sample_owner=mode, sample_gpu=ranks, **opts)
                runs[mode][s if i == 0 else f"{s}@{p}"] = {"per_step": rows, **summarize(rows)}
    out["strategies"] = runs[modes[0]]
    st = out["strategies"]
    if reference in st:
        ref = st[reference]
        out["reference"] = reference
        out["speedup"] = {s: ref["steady"]["tokens_per_s"] / v["steady"]["tokens_per_s"] for s, v in st.items()}
        out["speedup_first"] = {s: v["first"]["step_s"] / ref["first"]["step_s"] for s, v in st.items()}
    if sample_owner == "both":
        tr = out["trainer"] = runs["trainer"]
        if reference in st:
            ref = st[reference]
            out["trainer_speedup"] = {s: ref["steady"]["tokens_per_s"] / v["steady"]["tokens_per_s"]
                                      for s, v in tr.items()}
        out["trainer_gap"] = {s: {k: tr[s]["steady"][k] / st[s]["steady"][k] for k in ("step_s", "t_moe_s")}
                              for s in tr if s in st}
    return out


# ----------------------------------------------------------------------------------------- report
def row_label(name: str) -> str:
    """A table row's label: ``"static@length-balanced"`` -> ``"static, length-balanced"`` (the caption says what
    each placement is: ``sample_placements.PLACEMENT_USERS``)."""
    return name.replace("@", ", ", 1)


def _seconds(v: float) -> str:
    """Seconds for the table: 4 decimals, or 4 significant digits below 0.01 s (a tiny model's step would print
    0.0000)."""
    return f"{v:.4f}" if abs(v) >= 0.01 or v == 0 else f"{v:.3e}"


def steady_table(res: dict[str, Any], title: str | None = None) -> Any:
    """A rich Table of a ``run_steady`` result: per strategy the first step, the steady-state sum of T_MoE
    (moves free) and step (moves charged), experts moved, rank skew, solve seconds, and the reference's
    throughput over the row's."""
    from rich.table import Table

    c = res["cluster"]
    ref = res.get("reference", "?")
    steady = res["num_batches"] > 1
    owner = res.get("sample_owner", "planner")
    both = owner == "both"
    if title is None:
        title = (f"{res['model']} on {c['nodes']} x {c['gpus_per_node']} GPUs, r = {res['replica_slots']}, "
                 f"{res['layers']} MoE layers"
                 + (f" of {res['layers_total']}" if res.get("layers_total", res["layers"]) > res["layers"] else "")
                 + (f", steady state of {res['num_batches']} consecutive batches (first step apart)" if steady
                    else ", one batch from the static placement")
                 + {"planner": "", "trainer": ", samples placed by the trainer",
                    "both": ", samples placed by the planner / by the trainer"}[owner])
    t = Table(title=title, caption="sum T_MoE: forward T_MoE summed over micro-batches and layers, moves free (the "
                                   "paper's metric). step: simulated training step, moves from the previous "
                                   "placement, replica and reorder traffic charged to every strategy. "
                                   f"x {ref}: {ref}'s throughput over the row's" + (" (steady state)." if steady
                                                                                     else ".")
                      + (f" samples: who placed them (planner: the strategy chose every sample's rank; trainer: "
                         f"the trainer's ranks kept, only homes, replicas and splits planned; x {ref} of both "
                         f"blocks is against the planner-placed {ref}); trainer/planner: the trainer-placed "
                         f"step over the planner-placed one." if both else "")
                      + (" Rows 'strategy, placement': the strategy on that sample placement ("
                         + "; ".join(f"{p}: {PLACEMENT_USERS[p]}" for p in res["placements"][1:])
                         + "; length-balanced is on by default in verl: what a verl user already has); the plain "
                         f"rows run on {res['placements'][0]}; relibra places its own samples (from "
                         "length-balanced)." if len(res.get("placements", ())) > 1 else ""))
    t.add_column("strategy")
    if both:
        t.add_column("samples")
    if steady:
        t.add_column("first step s", justify="right")
    suffix = " (steady)" if steady else ""
    for name in ("sum T_MoE s", "step s", "experts moved", "rank skew", "solve s"):
        t.add_column(name + (suffix if name in ("sum T_MoE s", "step s", "experts moved") else ""), justify="right")
    t.add_column(f"x {ref}", justify="right")
    if both:
        t.add_column("trainer/planner step", justify="right")
    blocks = [("planner" if both else None, res["strategies"], res.get("speedup"))]
    if both:
        blocks.append(("trainer", res["trainer"], res.get("trainer_speedup")))
    for mode, runs, speedup in blocks:
        for name, v in runs.items():
            s = v["steady"]
            row = [row_label(name)] + ([mode] if both else []) + ([_seconds(v['first']['step_s'])] if steady else [])
            row += [_seconds(s['t_moe_s']), _seconds(s['step_s']), f"{s['experts_moved']:.0f}",
                    f"{s['rank_skew_mean']:.3f}", f"{s['solve_s']:.2f}",
                    f"{speedup[name]:.3f}" if speedup else "-"]
            if both:
                gap = res["trainer_gap"].get(name)
                row.append(f"{gap['step_s']:.3f}" if mode == "trainer" and gap else "")
            t.add_row(*row, end_section=both and mode == "planner" and name == list(runs)[-1])
    return t
