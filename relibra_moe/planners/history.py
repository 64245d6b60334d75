"""``eplb-history``: DeepSeek EPLB planned from *past* loads, the way inference engines run it.

SGLang (``--enable-eplb``, re-balance every N iterations) and vLLM (``EPLBConfig``: a window of recorded
steps, a step interval, redundant experts) record how many tokens each logical expert received over a
sliding window of past forward passes, and every ``n`` steps re-run DeepSeek's EPLB on those counts:
replicate the heaviest experts into the redundant slots, pack the physical experts onto the GPUs, then keep
that layout until the next re-balance. Before the first re-balance the layout is the trivial one (expert
e on GPU e // (E / G), no redundant copies). Applied to RL training, one "step" is one global batch.

The model here (docs/baselines.md, "eplb-history"):

- the loads EPLB sees are the sum over a window of the ``W`` previous batches' per-layer expert token
  counts (``[L, E]`` each; option ``history``: ``[W, L, E]`` or ``[L, E]``); ``history=None`` (no batch
  seen yet) gives the trivial layout;
- placement and redundant experts: ``baselines.eplb`` (the same packing as the EPLB+ baseline ``eplb``, which
  sees the current batch's true loads instead); the tokens of a replicated expert are split evenly over its
  copies in every micro-batch, as for EPLB+; the redundant copies stay resident for the whole batch
  (``sim``'s persistent replica mode charges their weight push and gradient pull once per step);
- GPUs are relabelled by the fabric's symmetries towards the previous placement (option ``previous``,
  default static; ``migration.relabel_to_previous``): the cost is unchanged and fewer experts move, which an
  engine is free to do, so the baseline is never worse for it;
- samples run round-robin (no routing replay, so nothing to plan them from); ``repack=True`` repacks them
  as for the other baselines; with ``sample_owner="trainer"`` they stay on the trainer's ranks and only the
  experts are relabelled (the relabelling is then not cost-free, but EPLB never saw this batch's samples,
  so no labelling of its layout is better informed than another).

Re-balancing every ``n`` batches is the caller's schedule (``EplbSchedule``): between re-balances it hands
the same history, so the plan, and therefore the placement, is unchanged and nothing moves.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..errors import PlanError
from ..plan import BatchPlan
from ..plan_stats import EplbHistoryStats
from ..validate import check_int, check_token_counts
from . import baselines
from .context import PlanContext, baseline_samples, eplb_task, fallback_homes, make_plan, previous_expert_gpu
from .migration import relabel_to_previous


def history_weights(history: Any, num_layers: int, num_experts: int) -> np.ndarray | None:
    """float64 ``[L, E]``: the window's summed expert loads, or None without history.

    Args:
        history: None, ``[L, E]`` loads of one batch, or ``[W, L, E]`` loads of a window of W batches
            (tokens per layer and expert; finite, >= 0).

    Raises:
        PlanError: naming the shape or the first bad entry.
    """
    if history is None:
        return None
    h = np.asarray(history, dtype=np.float64)
    if h.ndim == 2:
        h = h[None]
    if h.ndim != 3 or h.shape[1:] != (num_layers, num_experts) or h.shape[0] == 0:
        raise PlanError(f"history must be [L={num_layers}, E={num_experts}] or [W, L, E] expert loads with W >= 1, "
                        f"got shape {np.shape(history)}")
    check_token_counts("history", h)
    return h.sum(axis=0)


def strategy_eplb_history(ctx: PlanContext) -> BatchPlan:
    """EPLB on the window's loads (option ``history``), r redundant experts per GPU; module docstring."""
    L, E, G = ctx.model.num_layers, ctx.model.num_experts, ctx.cluster.num_gpus
    history = ctx.options.history
    w = history_weights(history, L, E)
    r = ctx.replica_slots
    if w is None:
        eg = baselines.static_placement(L, E, G)
        slots = np.full((L, G, r), -1, np.int32)
        ctx.stats.eplb_history = EplbHistoryStats(window=0, layout="trivial (no history yet)")
    else:
        res = eplb_task(ctx, w, "eplb-history")
        if res is None:  # past the deadline (or lost its worker): the fallback homes, no replicas
            eg = fallback_homes(ctx)
            ctx.stats.eplb_history = EplbHistoryStats(window=0, layout="fallback (the eplb task failed)")
            return make_plan(ctx, eg, *baseline_samples(ctx, eg))
        eg, slots = res
        window = 1 if np.ndim(history) == 2 else int(np.shape(history)[0])
        ctx.stats.eplb_history = EplbHistoryStats(window=window, layout="eplb")
    prev = previous_expert_gpu(ctx.options, ctx.model, ctx.cluster)
    perm = relabel_to_previous(eg, prev, ctx.cluster)
    eg = perm[eg]
    moved_slots = np.full_like(slots, -1)
    moved_slots[:, perm] = slots
    slots = moved_slots
    mb, sg = baseline_samples(ctx, eg)
    if not ctx.repack and not ctx.trainer_owned:  # the trainer's samples stay on its ranks
        sg = perm[np.asarray(sg, dtype=np.int64)]
    ctx.stats.eplb_history.relabel = perm.tolist()
    replicas = None
    if r > 0:
        replicas = baselines.even_split_replicas(eg, slots, ctx.loads(mb, sg))
        ctx.stats.eplb_replicas_dropped = int(r * G * L - (slots >= 0).sum()) if w is not None else 0
    return make_plan(ctx, eg, mb, sg, replicas)


@dataclass
class EplbSchedule:
    """When ``eplb-history`` re-balances and on which loads: a window of the last ``window`` batches, every
    ``rebalance_every`` batches (SGLang's rebalance interval, vLLM's step interval / window size).

    Call ``history_for(step)`` before planning batch ``step`` (0-based) and ``observe(loads)`` after it ran.
    The first re-balance happens at step ``rebalance_every`` (before it, no re-balance has run: trivial
    layout); between re-balances the history of the last one is returned again, so the layout is unchanged.
    """

    rebalance_every: int = 1
    window: int = 1
    seen: list[np.ndarray] = field(default_factory=list)
    current: np.ndarray | None = None

    def __post_init__(self) -> None:
        check_int("rebalance_every", self.rebalance_every, 1)
        check_int("window", self.window, 1)

    def history_for(self, step: int) -> np.ndarray | None:
        """``[W, L, E]`` loads for the plan of batch ``step`` (None before the first re-balance)."""
        check_int("step", step, 0)
        if step > 0 and step % self.rebalance_every == 0 and self.seen:
            self.current = np.stack(self.seen[-self.window:])
        return self.current

    def observe(self, loads: np.ndarray) -> None:
        """Record a batch's ``[L, E]`` expert loads (tokens, e.g. ``TraceBatch.sample_expert_counts().sum(0)``)."""
        a = np.asarray(loads, dtype=np.float64)
        if a.ndim != 2:
            raise PlanError(f"observed loads must be [L, E], got shape {a.shape}")
        check_token_counts("observed loads", a)
        self.seen.append(a)
        del self.seen[:-self.window]
