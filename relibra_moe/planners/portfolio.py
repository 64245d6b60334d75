"""relibra's portfolio: the best of its own plan and the cheap alternatives, each judged by the step evaluator
the context carries (``evaluation.StepEvaluator``; docs/method.md, "The portfolio").

Every candidate is judged by ``ctx.evaluator`` (default ``evaluation.SimulatedStep``: the way ``relibra compare``
/ ``relibra simulate`` charge a plan, ``sim.simulate_loads`` on the plan's loads, as ``sim.simulate_step`` and
``steady.evaluate_plan`` run it, moves charged against ``previous``, replica traffic by the one fetch rule of
``timing.replica_push_overlap``; replicas known from the replay, fetched per layer, or once per batch when the
same in every micro-batch)
and scored under the caller's options (``portfolio_score``: moves and replicas free when the options say so; with
``move_horizon`` > 1 and ``previous_loads``, a candidate that moves experts less its expected savings on later
batches, ``_Candidates.credit``, in ``stats.portfolio.credit_s``).

Candidates, in order: relibra's own plan; ``relibra-inter`` (the annealed homes finished without the
replication-aware migration pricing, no replicas); with option ``move_horizon`` > 1 and ``previous_loads``,
``relibra-horizon`` (``_add_horizon``: the annealed homes priced with the horizon's credit); then, on every
placement of ``portfolio_placements`` (round-robin, verl's length-balanced, longest-first; the trainer's only when
it owns the samples; the name suffix says which), the baselines' plans on the same batch and options: eplb-history
(with option ``history``), static; then ``previous`` (the previous homes, relibra's priced replicas) and online
(with replica slots, unless ``previous`` provably dominates it: ``_previous_dominates_online``); then (option
``portfolio_balancers``, ``_add_balancers``) EPLB+ (``eplb``) and, with replica slots, LPLB+ (``lplb``), exactly as
those strategies plan them; each of these built only when its lower bound (``bounds.replicated_step_lower_bound``;
EPLB+'s and LPLB+'s with their own copies) is below the best score so far (else ``stats.portfolio.pruned`` holds the
bound). LPLB+ comes after EPLB+: its exact LP split per cell is the costly candidate (its water-filling split is
cheap but measurably slower, so it would not keep the guarantee; docs/method.md, "The portfolio"). Last, on two
nodes or more, relibra's homes and samples with cross-node locality replicas (``locality_replicas``):
``locality-resident`` (resident for the whole batch, charged ``persistent``; option ``resident_replicas``, which
also drops every other resident candidate when off) and ``locality-per-micro-batch`` (charged ``per-layer``), each
pruned by ``bounds.global_replica_step_lower_bound``; and resident locality replicas on the previous homes
(``previous-locality``) and on relibra's homes with every placement's samples, all resident ones in the order of the
same bounds, before the per-micro-batch one (``_add_locality``). The replay shows relibra the routing these
baselines see, so each is a plan relibra may choose; relibra's and online's replicas are charged as relibra's (per
layer), never more than the baseline's own after-router fetch; those that are the same in every micro-batch
(EPLB+'s, LPLB+'s, eplb-history's, ``locality-resident``) once per batch (``ReplicaPlan.resident``: the layer runs
them resident).

The chosen candidate (``least_moving_best``): the lowest score; among those within ``1e-9`` of it, the one that
moves the fewest experts, then samples: a move must buy step time (on one node, where locality saves no RDMA
traffic, a plan that only reshuffles does not win).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping

import numpy as np

from ..plan import BatchPlan, Placement, ReplicaPlan, SamplePlacement, round_robin_gpus
from ..plan_stats import PlanStats, PortfolioStats
from ..sample_placements import SAMPLE_PLACEMENTS, place_samples
from . import baselines
from .annealing import finish_inter
from .bounds import global_replica_step_lower_bound, replicated_step_lower_bound
from .colocation import COLOCATE_MAX_WORK, colocate, colocation_work
from .context import PlanContext, eplb_layout, eplb_parts, make_plan, previous_expert_gpu
from .evaluation import CandidateStep
from .locality_replicas import (
    MAX_LOADS_ENTRIES,
    RELOCATE_MAX_GPUS,
    RESIDENT_MAX_LOADS_ENTRIES,
    locality_replicas,
    relocate_cells,
)
from .lplb import lplb_batch_copies, lplb_homes, lplb_parts
from .migration import carry_over
from .options import PlanOptions, ReplicateOptions

__all__ = ["Candidate", "portfolio", "portfolio_placements", "portfolio_score", "least_moving_best", "padded"]


Candidate = tuple[np.ndarray, np.ndarray, np.ndarray, ReplicaPlan | None]
"""A portfolio candidate: (homes [L, E], micro_batch [N], gpu [N], replicas or None)."""


def portfolio_placements(ctx: PlanContext) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """The sample placements the portfolio's baseline candidates run on, by candidate-name suffix: the trainer's
    (``""``) when it owns the samples; else round-robin (``""``) and every other placement of
    ``sample_placements.SAMPLE_PLACEMENTS`` (``"@" + name``; with ``keep_cell_sizes`` only those whose (micro-batch,
    GPU) cells hold equal counts, besides the call's start). Each ``(micro_batch [N], gpu [N])``, int64."""
    if ctx.trainer_owned:
        return {"": (ctx.micro_batch, ctx.sample_gpu)}
    mb0 = ctx.batch.resolve_micro_batch()
    G = ctx.cluster.num_gpus
    out = {"": (mb0, round_robin_gpus(mb0, G))}
    for name in SAMPLE_PLACEMENTS[1:]:
        mb, sg = place_samples(name, ctx.lengths, mb0, G)
        cells = np.bincount(mb * G + sg, minlength=ctx.num_micro_batches * G)
        if ctx.options.keep_cell_sizes and cells.min() != cells.max() and name != ctx.options.placement_for("relibra"):
            continue  # a trainer with a fixed per-rank micro-batch size could not follow it (sample_order)
        out["@" + name] = (mb, sg)
    return out


def portfolio_score(step: CandidateStep, options: PlanOptions) -> float:
    """A portfolio candidate's figure under the caller's options (seconds; ``step`` an
    ``evaluation.CandidateStep``, e.g. a ``sim.StepTime``): the
    simulated step, less the re-layout with ``migration=False`` (moves free) and less the exposed replica traffic
    with ``price_replicas=False`` (replicas free); with ``step_objective=False`` the sum of the forward T_MoE, the
    objective the planner was asked for."""
    if not options.step_objective:
        return float(step.t_moe_s)
    score = float(step.step_s)
    if not options.migration:
        score -= float(step.reorder_s)
    if not options.price_replicas:
        score -= float(step.replica_exposed_s)
    return score


def portfolio(ctx: PlanContext, own: dict[str, Candidate],
              annealed: tuple[np.ndarray, np.ndarray, np.ndarray, bool],
              strategies: Mapping[str, Callable[[PlanContext], BatchPlan]],
              replicas: Callable[[PlanContext, np.ndarray, np.ndarray, np.ndarray], ReplicaPlan]) -> BatchPlan:
    """The end of ``relibra``: the best of ``own`` (relibra's plan) and the cheap alternatives (this module's
    docstring), judged by ``ctx.evaluator`` and scored by ``portfolio_score``, chosen by ``least_moving_best``.

    ``annealed`` is ``anneal_inter``'s (homes, micro_batch, gpu) and the option ``node_comp``; ``strategies`` the
    baselines by name (``static``, ``online``, ``eplb-history``: the registry's); ``replicas`` relibra's
    replication pass ``(ctx, homes [L, E], micro_batch [N], gpu [N]) -> ReplicaPlan``
    (``strategies.relibra_replicas``). Writes ``stats.portfolio`` (``PortfolioStats``: ``chosen``, every judged
    candidate's ``step_s``, its score, and ``pruned``); wall seconds per candidate go to ``stats.timing``.
    """
    L, G, M = ctx.model.num_layers, ctx.cluster.num_gpus, ctx.num_micro_batches
    pf = _Candidates(ctx, own, portfolio_placements(ctx), strategies)
    pf.add("relibra-inter", lambda: (*finish_inter(ctx, *annealed, PlanStats()), None))
    if pf.crediting:
        _add_horizon(pf, annealed, replicas)
    for suffix in pf.places:
        if ctx.options.history is not None:
            pf.add("eplb-history" + suffix, lambda s=suffix: pf.baseline("eplb-history", s))
        pf.add("static" + suffix, lambda s=suffix: pf.baseline("static", s))
    for name in list(pf.cands):
        pf.judge(name)
    _add_replicated(pf, replicas)
    _add_balancers(pf)
    _add_locality(pf)
    pf.credit()
    chosen = least_moving_best(ctx, pf.cands, pf.steps, pf.previous_homes)
    ctx.stats.portfolio = PortfolioStats(chosen=chosen, step_s=pf.steps, pruned=pf.pruned or None,
                                         credit_s=pf.credits or None)
    eg, mb, sg, reps = pf.cands[chosen]
    return make_plan(ctx, eg, mb, sg, padded(reps, M, L, G, ctx.replica_slots))


class _Candidates:
    """The candidates of one ``portfolio`` call (by name, in order), their scores (``steps``) and replica modes, the
    pruned ones' bounds, and the loads ``[M, L, G, E]`` of each sample placement (computed once)."""

    def __init__(self, ctx: PlanContext, own: dict[str, Candidate], places: dict[str, tuple[np.ndarray, np.ndarray]],
                 strategies: Mapping[str, Callable[[PlanContext], BatchPlan]]) -> None:
        self.ctx, self.places, self.strategies = ctx, places, strategies
        self.previous_homes = previous_expert_gpu(ctx.options, ctx.model, ctx.cluster)
        self.previous = Placement(self.previous_homes)
        self.opb = float(ctx.options.optimizer_bytes_per_param)
        self.cands: dict[str, Candidate] = dict(own)
        self.own: Candidate = next(iter(own.values()))  # relibra's own plan (kept even if judging drops it)
        self.steps: dict[str, float] = {}
        self.modes: dict[str, str] = {}
        self.pruned: dict[str, float] = {}
        self.relayout: dict[str, float] = {}  # the re-layout seconds each judged candidate's step charges
        self.credits: dict[str, float] = {}  # option move_horizon: seconds taken off a moving candidate's score
        o = ctx.options
        self.crediting = o.move_horizon > 1 and o.previous_loads is not None  # (options: with migration, step)
        self.timing = ctx.stats.timings()
        self._loads: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []  # (micro_batch, gpu, x)

    def stays(self, name: str) -> bool:
        """Whether candidate ``name`` keeps the previous homes (it moves no expert)."""
        return bool(np.array_equal(self.cands[name][0], self.previous_homes))

    def stay_score(self) -> float | None:
        """The least score of the judged candidates that keep the previous homes (None before one is judged, or
        when every one was pruned: then no credit is given)."""
        judged = [v for k, v in self.steps.items() if self.stays(k)]
        if judged:
            return min(judged)
        return None

    def credited_bound(self, bound: float, homes: np.ndarray) -> float:
        """A lower bound of the credited score (``credit``) of any candidate with homes ``homes [L, E]`` whose
        score is at least ``bound``: the credit is at most ``(H - 1) max(0, U - step + R)`` (U the least score that
        keeps the homes so far, R the homes' re-layout), and ``step - that`` is non-decreasing in the step; -inf
        while no candidate that keeps the homes has been judged."""
        if np.array_equal(homes, self.previous_homes):
            return bound
        u = self.stay_score()
        if u is None:
            return -np.inf
        ctx = self.ctx
        r = ctx.evaluator.relayout_seconds(self.previous, Placement(homes), ctx.model, ctx.cluster, self.opb)
        h = ctx.options.move_horizon
        return bound if bound >= u + r else h * bound - (h - 1) * (u + r)

    def credit(self) -> None:
        """Option ``move_horizon`` H > 1 with ``previous_loads``: take off the score of every judged candidate that
        moves experts ``(H - 1) x carry_over x max(0, S - (step - R))``, its expected saving on each later batch:
        S the least score that keeps the previous homes, ``step - R`` the candidate's score without its re-layout
        (what it would cost on a batch that moves nothing), ``migration.carry_over`` the share of its homes'
        saving that they keep on the previous batch, which they were not planned for. ``credits`` records them."""
        if not self.crediting:
            return
        ctx, s = self.ctx, self.stay_score()
        if s is None:
            return
        for name in list(self.steps):
            gain = s - (self.steps[name] - self.relayout[name])
            if self.stays(name) or gain <= 0.0:
                continue
            eg, mb, sg, _ = self.cands[name]
            share = carry_over(self.loads_of(mb, sg), ctx.options.previous_loads, eg, self.previous_homes, ctx.model,
                               ctx.cluster, ctx.migration_node_comp)
            credit = (ctx.options.move_horizon - 1) * share * gain
            if credit > 0.0:
                self.steps[name] -= credit
                self.credits[name] = credit

    def add(self, name: str, make: Callable[[], Candidate]) -> None:
        """Build candidate ``name`` (its wall seconds to ``timing["portfolio_<name>_s"]``)."""
        t0 = time.perf_counter()
        self.cands[name] = make()
        self.timing[f"portfolio_{name}_s"] = time.perf_counter() - t0

    def on(self, suffix: str) -> PlanContext:
        """The context of a baseline on the placement ``suffix`` of ``places`` (its own stats, dropped)."""
        mb, sg = self.places[suffix]
        return dataclasses.replace(self.ctx, stats=PlanStats(), micro_batch=mb, sample_gpu=sg)

    def baseline(self, name: str, suffix: str) -> Candidate:
        """Strategy ``name``'s plan on the placement ``suffix`` of ``places`` (its own stats dropped)."""
        bp = self.strategies[name](self.on(suffix))
        return bp.placement.expert_gpu, bp.samples.micro_batch, bp.samples.gpu, bp.replicas

    def loads_of(self, mb: np.ndarray, sg: np.ndarray) -> np.ndarray:
        """``ctx.loads(mb, sg)``, computed once per placement."""
        x = next((x for m, g, x in self._loads if np.array_equal(m, mb) and np.array_equal(g, sg)), None)
        if x is None:
            x = self.ctx.loads(mb, sg)
            self._loads.append((mb, sg, x))
        return x

    def judge(self, name: str) -> None:
        """Score candidate ``name`` with ``ctx.evaluator`` (``portfolio_score``; wall seconds to
        ``timing["portfolio_simulate_s"]``); with option ``resident_replicas`` off a resident candidate
        (``ReplicaPlan.resident``) is dropped instead, before its score could prune another."""
        ctx, t0 = self.ctx, time.perf_counter()
        L, G, M = ctx.model.num_layers, ctx.cluster.num_gpus, ctx.num_micro_batches
        eg, mb, sg, reps = self.cands[name]
        replicas = padded(reps, M, L, G, ctx.replica_slots)
        if not ctx.options.resident_replicas and replicas.resident:
            del self.cands[name]
            return
        plan = BatchPlan(placement=Placement(eg), samples=SamplePlacement(mb, sg, M), replicas=replicas,
                         num_gpus=G, gpus_per_node=ctx.cluster.gpus_per_node)
        st = ctx.evaluator.step(plan, ctx.lengths, self.loads_of(mb, sg), ctx.model, ctx.cluster, self.previous,
                                self.opb)
        self.steps[name], self.modes[name] = portfolio_score(st, ctx.options), st.replica_mode
        self.relayout[name] = float(st.reorder_s)
        self.timing["portfolio_simulate_s"] = self.timing.get("portfolio_simulate_s", 0.0) + time.perf_counter() - t0


def _add_horizon(pf: _Candidates, annealed: tuple[np.ndarray, np.ndarray, np.ndarray, bool],
                 replicas: Callable[[PlanContext, np.ndarray, np.ndarray, np.ndarray], ReplicaPlan]) -> None:
    """``relibra-horizon`` (option ``move_horizon`` > 1 with ``previous_loads``): the annealed homes finished by the
    migration pricing with the horizon's credit (``finish_inter(credit=True)``: a layer moves where its saving on
    this batch and the ones after pays for it), with relibra's replicas; not built where it equals relibra's own
    plan. relibra's own plan prices its moves against this batch alone, so the candidates that keep the homes, the
    reference of every credit (``_Candidates.credit``), are the ones relibra would choose without a horizon."""
    ctx = pf.ctx
    eg, mb, sg = finish_inter(ctx, *annealed[:3], ctx.migration_node_comp, PlanStats(), credit=True)
    if all(np.array_equal(a, b) for a, b in zip((eg, mb, sg), pf.own[:3])):
        return
    pf.add("relibra-horizon", lambda: (eg, mb, sg, replicas(ctx, eg, mb, sg)))


def _add_replicated(pf: _Candidates, replicas: Callable[[PlanContext, np.ndarray, np.ndarray, np.ndarray],
                                                         ReplicaPlan]) -> None:
    """The candidates with replicas on fixed homes, ``previous`` and ``online`` on every placement: each costs a
    replication pass, so one whose lower bound already reaches the best score cannot win and is not built
    (``pf.pruned``: its bound)."""
    ctx, prev = pf.ctx, pf.previous_homes
    static = baselines.static_placement(ctx.model.num_layers, ctx.model.num_experts, ctx.cluster.num_gpus)
    for suffix, (mb, sg) in pf.places.items():
        for base, homes in (("previous", prev), ("online", static)):
            name = base + suffix
            if base == "online" and (not ctx.replica_slots or (_previous_dominates_online(ctx, prev, static) and (
                    "previous" + suffix in pf.pruned or pf.modes.get("previous" + suffix) == "per-layer"))):
                # without slots online is the static plan; where "previous" has online's homes and samples and
                # dominates it cell by cell, online cannot win (its bound is "previous"'s: pruned with it)
                continue
            bound = replicated_step_lower_bound(ctx, homes, mb, sg, pf.loads_of(mb, sg), pf.previous, pf.opb)
            _add_unless_pruned(pf, name, None if base == "online" and ctx.repack else bound,  # repack: its samples
                               (lambda m=mb, g=sg: (prev, m, g, replicas(ctx, prev, m, g) if ctx.replica_slots
                                                    else None))
                               if base == "previous" else (lambda s=suffix: pf.baseline("online", s)), homes)


def _previous_dominates_online(ctx: PlanContext, previous_homes: np.ndarray, static_homes: np.ndarray) -> bool:
    """Whether the ``previous`` candidate is never charged more than online's plan on the same placement, so that
    online need not be built: with the static homes as previous, "previous" is online's homes and samples with
    relibra's replicas, whose per-cell choice (``replicate.replicate_cell``: the same greedy per slot count as
    ``online.online_cell``, chosen by the simulator's charge of the cell with a window never shorter) is never
    charged more than online's. That holds where the judge charges what ``replicate_cell`` minimises: replicas
    priced (``price_replicas``), the step scored (``step_objective``), the cost model's single GEMM rate (no
    ``gemm_curve``), the default ``ReplicateOptions`` (online's greedy), and no repacking (online keeps the
    placement's micro-batches)."""
    return (np.array_equal(previous_homes, static_homes) and not ctx.repack and ctx.options.price_replicas
            and ctx.options.step_objective and not ctx.cluster.gemm_curve
            and ctx.options.replicate == ReplicateOptions())


def _add_locality(pf: _Candidates) -> None:
    """The locality-replica candidates (``locality_replicas``), on two nodes or more with replica slots, each built
    only while its bound (``bounds.global_replica_step_lower_bound``) is below the best score so far (else
    ``pf.pruned``):

    1. resident ones (one set of slots per layer for the whole batch, charged ``persistent``; with several
       micro-batches and option ``resident_replicas``), in the order of their bounds: ``locality-resident`` on
       relibra's homes and samples, ``previous-locality`` + suffix on the previous homes (no expert moves) and
       ``locality-resident`` + suffix on relibra's homes, each with the samples of a placement of ``pf.places``
       (the round-robin one suffixed ``@round-robin``; the trainer's alone when it owns the samples), skipping
       one whose homes and samples another already has. A length-aware trainer's samples attend faster than
       relibra's and the previous homes move nothing, so where the moves or the attention outweigh what
       relibra's homes save in the all-to-all those win (BENCHMARKS.md, "The paper side by side, bounded");
       for loads of at most ``RESIDENT_MAX_LOADS_ENTRIES`` entries;
    2. ``locality-per-micro-batch`` on relibra's homes (charged ``per-layer``; its cells relocated by
       ``relocate_cells`` unless the trainer owns the samples or there are more than ``RELOCATE_MAX_GPUS``), for
       loads of at most ``MAX_LOADS_ENTRIES`` entries.

    With ``resident_replicas=False`` every resident candidate (``ReplicaPlan.resident``: eplb-history's, EPLB+'s
    and LPLB+'s redundant experts too) is dropped when judged (``_Candidates.judge``); relibra-inter and static,
    with no replicas, never are. Past the executor's deadline nothing more is built."""
    ctx = pf.ctx
    M, L, G, r = ctx.num_micro_batches, ctx.model.num_layers, ctx.cluster.num_gpus, ctx.replica_slots
    entries = M * L * G * ctx.model.num_experts
    if ctx.cluster.nodes < 2 or not r or ctx.executor.expired or entries > RESIDENT_MAX_LOADS_ENTRIES:
        return
    eg, mb, sg, _ = pf.own
    if M >= 2 and ctx.options.resident_replicas:
        todo: list[tuple[float, int, str, np.ndarray, np.ndarray, np.ndarray]] = []
        seen: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
        for name, homes, (pmb, psg) in [("locality-resident", eg, (mb, sg))] + [
                (base + (suffix or ("" if ctx.trainer_owned else "@round-robin")), homes, place)
                for suffix, place in pf.places.items()
                for base, homes in (("previous-locality", pf.previous_homes), ("locality-resident", eg))]:
            if any(np.array_equal(homes, h) and np.array_equal(pmb, m) and np.array_equal(psg, g) for h, m, g in seen):
                continue
            seen.append((homes, pmb, psg))
            bound = global_replica_step_lower_bound(ctx, homes, pmb, psg, pf.loads_of(pmb, psg), pf.previous, pf.opb)
            todo.append((bound, len(todo), name, homes, pmb, psg))
        for bound, _, name, homes, pmb, psg in sorted(todo, key=lambda t: t[:2]):
            if ctx.executor.expired:
                return
            _add_unless_pruned(pf, name, bound, lambda h=homes, m=pmb, g=psg: (h, m, g, locality_replicas(
                pf.loads_of(m, g), h, ctx.model, ctx.cluster, r, True, ctx.executor)), homes)
    if entries > MAX_LOADS_ENTRIES or ctx.executor.expired:
        return
    sg_c = sg if ctx.trainer_owned or G > RELOCATE_MAX_GPUS else _relocated(pf, eg, mb, sg)
    x = pf.loads_of(mb, sg_c)
    bound = global_replica_step_lower_bound(ctx, eg, mb, sg_c, x, pf.previous, pf.opb)
    _add_unless_pruned(pf, "locality-per-micro-batch", bound, lambda: (eg, mb, sg_c, locality_replicas(
        x, eg, ctx.model, ctx.cluster, r, False, ctx.executor)), eg)
    _add_colocated(pf)


def _add_colocated(pf: _Candidates) -> None:
    """The locality candidates on co-located homes and cells (``colocation.colocate`` from relibra's own plan):
    ``colocated-resident`` (with several micro-batches and option ``resident_replicas``) and
    ``colocated-per-micro-batch`` (both on the same homes and samples, so under one bound), each pruned like the
    others; only where
    ``colocation_work`` is at most ``COLOCATE_MAX_WORK`` (the caller checked the loads' size and the deadline).
    With trainer-owned samples only the homes change; with ``keep_cell_sizes`` only cells of equal counts swap."""
    ctx = pf.ctx
    M, L, G, r = ctx.num_micro_batches, ctx.model.num_layers, ctx.cluster.num_gpus, ctx.replica_slots
    if colocation_work(M, L, G, ctx.model.num_experts, ctx.cluster.gpus_per_node * r) > COLOCATE_MAX_WORK:
        return
    eg, mb, sg, _ = pf.own
    t0 = time.perf_counter()
    homes, where = colocate(pf.loads_of(mb, sg), eg, ctx.model, ctx.cluster, r,
                            cell_counts=_kept_cell_counts(ctx, mb, sg), move_cells=not ctx.trainer_owned)
    pf.timing["portfolio_colocate_s"] = time.perf_counter() - t0
    sg_c = where[mb, sg].astype(np.int64)
    x = pf.loads_of(mb, sg_c)
    bound = global_replica_step_lower_bound(ctx, homes, mb, sg_c, x, pf.previous, pf.opb)
    for resident in ([True] if M >= 2 and ctx.options.resident_replicas else []) + [False]:
        if ctx.executor.expired:
            return
        name = "colocated-" + ("resident" if resident else "per-micro-batch")
        _add_unless_pruned(pf, name, bound, lambda res=resident: (homes, mb, sg_c, locality_replicas(
            x, homes, ctx.model, ctx.cluster, r, res, ctx.executor)), homes)


def _relocated(pf: _Candidates, expert_gpu: np.ndarray, micro_batch: np.ndarray, sample_gpu: np.ndarray
               ) -> np.ndarray:
    """int64 ``[N]``: the samples' GPUs after ``locality_replicas.relocate_cells`` (whole cells swap GPUs within
    their micro-batch; with ``keep_cell_sizes`` only cells of equal counts)."""
    ctx = pf.ctx
    gmap = relocate_cells(pf.loads_of(micro_batch, sample_gpu), expert_gpu, ctx.cluster, ctx.replica_slots,
                          _kept_cell_counts(ctx, micro_batch, sample_gpu))
    return gmap[micro_batch, sample_gpu].astype(np.int64)


def _kept_cell_counts(ctx: PlanContext, micro_batch: np.ndarray, sample_gpu: np.ndarray) -> np.ndarray | None:
    """int64 ``[M, G]`` samples per (micro-batch, GPU) cell when option ``keep_cell_sizes`` allows only swaps of
    cells of equal counts (``relocate_cells``, ``colocate``); None without it (any two cells may swap)."""
    if not ctx.options.keep_cell_sizes:
        return None
    M, G = ctx.num_micro_batches, ctx.cluster.num_gpus
    return np.bincount(micro_batch * G + sample_gpu, minlength=M * G).reshape(M, G)


def _add_balancers(pf: _Candidates) -> None:
    """EPLB+ (``eplb``) and LPLB+ (``lplb``) on every placement, exactly as those strategies plan them (option
    ``portfolio_balancers``): each built only when its lower bound (``replicated_step_lower_bound`` on its homes
    with its own copies, EPLB+'s may leave the node: ``bounds.fixed_copy_terms``) is below the best score so far,
    else ``pf.pruned``
    holds the bound; with repacking (the baselines then move the samples) always built. LPLB+ is left out with
    r = 0 (its plan is then EPLB+'s) and runs last: its LP split is the costly candidate. A failed EPLB+ layout
    (the executor's deadline) leaves EPLB+ out."""
    ctx = pf.ctx
    if not ctx.options.portfolio_balancers:
        return
    # both layouts read only the per-expert sums of the loads (int64), the same on every placement: computed once
    suffix0 = next(iter(pf.places))
    sub0, x0 = pf.on(suffix0), pf.loads_of(*pf.places[suffix0])
    layout = eplb_layout(sub0, x0)
    if layout is not None:
        for suffix, (mb, sg) in pf.places.items():
            _add_bounded(pf, "eplb" + suffix, layout[0], mb, sg, lambda s=suffix: eplb_parts(pf.on(s), layout),
                         layout[1] if ctx.replica_slots else None)
    if not ctx.replica_slots:
        return
    homes = lplb_homes(sub0, x0)
    copies = lplb_batch_copies(homes, x0.sum(axis=(0, 2)), ctx.cluster.num_gpus, ctx.cluster.gpus_per_node,
                               ctx.replica_slots)
    for suffix, (mb, sg) in pf.places.items():
        _add_bounded(pf, "lplb" + suffix, homes, mb, sg, lambda s=suffix: lplb_parts(pf.on(s), homes), copies)


def _add_bounded(pf: _Candidates, name: str, homes: np.ndarray, mb: np.ndarray, sg: np.ndarray,
                 make: Callable[[], Candidate], replica_expert: np.ndarray | None = None) -> None:
    """Build and judge candidate ``name`` (homes ``[L, E]`` on samples ``mb`` / ``sg [N]``; ``replica_expert
    [L, G, r]`` its fixed copies, None: any intra-node ones) unless its lower bound reaches the best score so far
    (then ``pf.pruned[name]`` is the bound); with ``repack`` always (the candidate moves its samples)."""
    ctx = pf.ctx
    bound = None if ctx.repack else replicated_step_lower_bound(ctx, homes, mb, sg, pf.loads_of(mb, sg), pf.previous,
                                                                 pf.opb, replica_expert)
    _add_unless_pruned(pf, name, bound, make, homes)


def _add_unless_pruned(pf: _Candidates, name: str, bound: float | None, make: Callable[[], Candidate],
                       homes: np.ndarray) -> None:
    """Build (``make``) and judge candidate ``name`` (homes ``[L, E]``) unless its lower bound ``bound`` (seconds;
    None: no bound) already reaches the best score so far: then it cannot win, and ``pf.pruned[name]`` keeps the
    bound. With option ``move_horizon``'s credit the bound is ``pf.credited_bound`` of it, against the best score
    before credits (no candidate's credited score is above it)."""
    if bound is not None and pf.crediting:
        bound = pf.credited_bound(bound, homes)
    if bound is not None and bound >= min(pf.steps.values()):
        pf.pruned[name] = bound
        return
    pf.add(name, make)
    pf.judge(name)


def least_moving_best(ctx: PlanContext, cands: dict[str, Candidate], scores: dict[str, float],
                      previous: np.ndarray) -> str:
    """The portfolio's choice among the scored candidates: the lowest score; among those within ``1e-9`` of it
    (relative), the one that moves the fewest experts off ``previous [L, E]``, then the fewest samples off the
    call's start (``ctx.micro_batch`` / ``ctx.sample_gpu``), then the earlier in ``scores``."""
    best = min(scores.values())
    close = [k for k in scores if scores[k] <= best + 1e-9 * abs(best)]
    order = list(scores)
    return min(close, key=lambda k: (int((cands[k][0] != previous).sum()),
                                     int(((cands[k][1] != ctx.micro_batch) | (cands[k][2] != ctx.sample_gpu)).sum()),
                                     order.index(k)))



def padded(replicas: ReplicaPlan | None, num_micro_batches: int, num_layers: int, num_gpus: int,
           replica_slots: int) -> ReplicaPlan:
    """``replicas`` with ``replica_slots`` slots per GPU (empty ones appended; None: no replicas), so that every
    portfolio candidate has the ``[M, L, G, r]`` shape of relibra's plans."""
    if replicas is None:
        return ReplicaPlan.empty(num_micro_batches, num_layers, num_gpus, replica_slots)
    rep = replicas.replica_expert
    if rep.shape[-1] >= replica_slots:
        return replicas
    pad = np.full(rep.shape[:-1] + (replica_slots - rep.shape[-1],), -1, np.int32)
    return dataclasses.replace(replicas, replica_expert=np.concatenate([rep, pad], axis=-1))

