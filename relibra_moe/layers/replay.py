"""Routing replay: the one context manager that hands every MoE layer its recorded routing and plan slice.

::

    relayout(model, plan.placement, optimizer)                  # once per global batch
    for m in range(plan.num_micro_batches):
        with replay(model, batch, plan, micro_batch=m) as rows:  # rows: the samples this forward runs
            loss = loss_fn(model(tokens_of(rows)))
        loss.backward()                                         # may run after the block

``replay`` is ``relibra_moe.replay`` (and ``relibra_moe.integrations.hf.replay``). Its MoE layers are the
model's *replay targets* in module order: :class:`~relibra_moe.layers.moe.ReplayBalancedMoE` modules
(Hugging Face blocks swapped by ``swap_moe_blocks`` included) and the single-process HF blocks of
``swap_moe_blocks(backend="local")``; a target is any module with a ``prepare_replay(ids, plan,
micro_batch)`` method returning a :class:`LayerReplay` and a ``replay_state``
attribute that its forward follows. Layers without a ``layer_index`` get their position in that order
(the plan's ``l``).

``routing`` is either

- recorded traces: a ``TraceBatch``, a ``RoutingTrace`` or a list of them (the whole global batch, or
  just the sequences of this forward). Trace layer ``l`` feeds MoE layer ``l``; with a plan the
  samples of ``micro_batch`` (on this rank) are selected, and their ids laid out as the forward's batch
  rows (:func:`layout_ids`); or
- recorded ids as the caller lays them out: one tensor ``[T, L, k]`` (the layout of
  ``RoutingTrace.experts``: tokens x MoE layers x k), a sequence of one ``[T, k]`` int tensor (or
  ``None`` for live routing) per MoE layer, or ``None`` (live routing everywhere, e.g. to follow a plan
  only).

Every forward of a layer inside the block uses the same ids (so run one forward per layer per block).
Blocks nest; the previous state of every layer is restored on exit.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch
from torch import nn

from ..errors import PlanError, ReplayError
from ..plan import BatchPlan, ReplicaPlan
from ..trace import RoutingTrace, TraceBatch
from ..validate import is_int
from .router import LIVE

__all__ = ["LIVE", "UNROUTED", "LayerReplay", "ReplayTarget", "build_ahead", "layout_ids", "replay", "replay_targets",
           "scheduled_states", "take_ahead"]


@dataclass(frozen=True)
class LayerReplay:
    """What one layer follows in its forward calls inside :func:`relibra_moe.replay` (its ``replay_state``),
    built by its ``prepare_replay``.

    Attributes:
        ids: int ``[T, k]`` replayed expert ids (``-1``: no expert), ``None`` for live routing.
        replicas: the replica plan (``None``: every expert at its home).
        expert_gpu: int ``[E]``, the plan's homes of this layer (``None``: the plan is read against the
            layer's current homes).
        micro_batch: the plan's micro-batch ``m``.
        error: a ``ReplayError`` / ``PlanError`` found before the forward; the forward raises it on every
            rank of the EP group (so no rank is left waiting in a collective).
        desc: what ``ids`` cover (e.g. the sequences and their lengths), for error messages.
        schedule: the layer's :class:`~relibra_moe.layers.moe.LayerSchedule` for this block (built, checked,
            agreed and uploaded by :func:`replay`); ``None`` for targets without one.
    """

    ids: torch.Tensor | None = None
    replicas: ReplicaPlan | None = None
    expert_gpu: np.ndarray | None = None
    micro_batch: int = 0
    error: ReplayError | PlanError | None = None
    desc: str = ""
    schedule: Any = None


@runtime_checkable
class ReplayTarget(Protocol):
    """A module :func:`replay` drives: it builds its replay state and follows ``replay_state``."""

    replay_state: LayerReplay | None

    def prepare_replay(self, ids: torch.Tensor | None = None, plan: Any = None,
                       micro_batch: int | None = None) -> LayerReplay:
        """Check the arguments and return what the layer's next forwards follow (``ReplayError``/``PlanError``)."""
        ...


def replay_targets(model: nn.Module) -> list[ReplayTarget]:
    """The replay targets of ``model`` in module order; gives every one without a ``layer_index`` (set to
    ``None``) its position in that order."""
    targets = [m for m in model.modules() if isinstance(m, ReplayTarget)]
    for i, layer in enumerate(targets):
        if getattr(layer, "layer_index", -1) is None:
            layer.layer_index = i
    return targets


UNROUTED = ("live", "none", "error")


def layout_ids(traces: Sequence[RoutingTrace], layer_index: int,
               attention_mask: torch.Tensor | None = None, *, unrouted: str = "live") -> torch.Tensor:
    """The ``[B*S, k]`` int64 ids of one MoE layer for a batch of sequences (row b = ``traces[b]``).

    With ``attention_mask [B, S]`` the rows of sequence b fill its positions where the mask is 1, in
    order (left or right padding); without it sequences are right-padded to the longest. Padding rows
    are ``-1`` (served by no expert).

    A trace's rows start at its ``start`` token (``RoutingTrace.start``: a dump that routed only the response, or
    slime's ``routed_experts_start_len``): sequence b's row i lands on its ``start + i``-th token, and its first
    ``start`` tokens are tokens the rollout never routed. So are the tokens past the trace's last row when the mask
    row has more ones than ``start`` + rows (a trainer that feeds prompt + completion: ``generate()`` returns the
    last completion token but never feeds it). ``unrouted`` says what unrouted tokens get: ``"live"`` (default):
    :data:`~relibra_moe.layers.router.LIVE` rows, the layer routes them live as the plain model does; ``"none"``:
    ``-1``, served by no expert; ``"error"``: a ``ReplayError``. A mask row with fewer ones than ``start`` + rows is
    always an error. Without a mask, sequence b's positions ``[0, start)`` are unrouted tokens and its positions
    past ``start`` + rows are padding.
    """
    if unrouted not in UNROUTED:
        raise ReplayError(f"replay: unrouted={unrouted!r} is not one of {UNROUTED}")
    k = traces[0].top_k
    lengths = [t.num_tokens for t in traces]
    starts = [int(t.start) for t in traces]
    fill = LIVE if unrouted == "live" else -1
    if unrouted == "error" and any(starts):
        b = next(i for i, s0 in enumerate(starts) if s0)
        raise ReplayError(f"replay: sequence {b} of the micro-batch starts routing at token {starts[b]}: its first "
                          f"{starts[b]} tokens were never routed (unrouted='error')")
    if attention_mask is None:
        S = max(s0 + n for s0, n in zip(starts, lengths))
        out = np.full((len(traces), S, k), -1, dtype=np.int64)
        for b, t in enumerate(traces):
            out[b, :starts[b]] = fill
            out[b, starts[b]:starts[b] + lengths[b]] = t.experts[:, layer_index]
    else:
        if not isinstance(attention_mask, torch.Tensor):
            raise ReplayError(f"replay: attention_mask must be a torch.Tensor [B, S], got "
                              f"{type(attention_mask).__name__}")
        mask = attention_mask.detach().cpu().bool().numpy()
        if mask.ndim != 2 or mask.shape[0] != len(traces):
            raise ReplayError(f"replay: attention_mask has shape {mask.shape}, expected [B={len(traces)}, S]")
        out = np.full(mask.shape + (k,), -1, dtype=np.int64)
        for b, t in enumerate(traces):
            ones, need = int(mask[b].sum()), starts[b] + lengths[b]
            if ones < need or (ones > need and unrouted == "error"):
                routed = f"{lengths[b]} routed tokens" + (f" from token {starts[b]}" if starts[b] else "")
                raise ReplayError(f"replay: sequence {b} of the micro-batch has {routed}, its attention_mask row "
                                  f"has {ones} ones" + (" (unrouted='error')" if ones > need else ""))
            pos = np.flatnonzero(mask[b])
            out[b, pos[:starts[b]]] = fill
            out[b, pos[starts[b]:need]] = t.experts[:, layer_index]
            out[b, pos[need:]] = fill
    return torch.from_numpy(out.reshape(-1, k))


def _as_traces(routing: Any) -> tuple[list[RoutingTrace], np.ndarray | None] | None:
    """``(traces, the batch's micro-batch of each)`` for trace input, ``None`` for recorded ids."""
    if isinstance(routing, TraceBatch):
        return list(routing.traces), routing.micro_batch
    if isinstance(routing, RoutingTrace):
        return [routing], None
    if isinstance(routing, Sequence) and routing and all(isinstance(t, RoutingTrace) for t in routing):
        return list(routing), None
    return None


def _select(n: int, batch_mb: np.ndarray | None, plan: BatchPlan | None, micro_batch: int | None,
            rank: int | None) -> np.ndarray:
    """Sample indices (in batch order) that this forward processes."""
    idx = np.arange(n)
    if plan is not None:
        if plan.samples.num_samples != n:
            raise ReplayError(f"replay: the plan covers {plan.samples.num_samples} samples, the routing has {n}")
        if micro_batch is None:
            raise ReplayError("replay: a plan needs micro_batch=<m>")
        sel = plan.samples.micro_batch == micro_batch
        if rank is not None:
            sel &= plan.samples.gpu == rank
        return idx[sel]
    if micro_batch is None:
        return idx
    if batch_mb is None:
        raise ReplayError(f"replay: micro_batch={micro_batch} given, but the routing has no micro-batch "
                          "assignment (use TraceBatch.with_micro_batch_size or pass a plan)")
    return idx[np.asarray(batch_mb) == micro_batch]


def _ids_of_traces(targets: list[ReplayTarget], traces: list[RoutingTrace], batch_mb: np.ndarray | None,
                   plan: Any, micro_batch: int | None, attention_mask: torch.Tensor | None,
                   rank: int | None, unrouted: str = "live"
                   ) -> tuple[np.ndarray, list[torch.Tensor | ReplayError], str]:
    """Trace input -> (selected sample indices, per-layer ids or the ``ReplayError`` of laying them out,
    a description of the selection)."""
    t0 = traces[0]
    for i, t in enumerate(traces[1:], 1):
        if (t.num_experts, t.top_k) != (t0.num_experts, t0.top_k) or not np.array_equal(t.layer_ids, t0.layer_ids):
            raise ReplayError(f"replay: trace {i} has E={t.num_experts}, k={t.top_k}, "
                              f"layer_ids {t.layer_ids.tolist()}; trace 0 has E={t0.num_experts}, k={t0.top_k}, "
                              f"layer_ids {t0.layer_ids.tolist()}")
    if all(hasattr(b, "layer_id") for b in targets):
        layer_ids = np.array([b.layer_id for b in targets], dtype=np.int32)
        if not np.array_equal(t0.layer_ids, layer_ids):
            raise ReplayError(f"replay: routing has layer_ids {t0.layer_ids.tolist()}, the model's MoE layers are "
                              f"{layer_ids.tolist()}")
    elif t0.num_layers != len(targets):
        raise ReplayError(f"replay: routing covers {t0.num_layers} MoE layers, the model has {len(targets)}")
    E, k = targets[0].num_experts, targets[0].top_k
    if (t0.num_experts, t0.top_k) != (E, k):
        raise ReplayError(f"replay: routing has E={t0.num_experts}, k={t0.top_k}; the model has E={E}, k={k}")
    if plan is not None and not isinstance(plan, BatchPlan):
        raise ReplayError(f"replay: plan must be a BatchPlan (it selects each rank's samples), got "
                          f"{type(plan).__name__}")
    if plan is not None and rank is None and all(hasattr(b, "rank") for b in targets):
        rank = int(targets[0].rank)
    if plan is not None and rank is not None and not 0 <= rank < plan.num_gpus:
        raise ReplayError(f"replay: rank={rank} is outside the plan's [0, num_gpus={plan.num_gpus})")
    sel = _select(len(traces), batch_mb, plan, micro_batch, rank)
    chosen = [traces[i] for i in sel]
    desc = f"{len(chosen)} sequences, lengths {[t.num_tokens for t in chosen]}"
    per_layer: list[torch.Tensor | ReplayError] = []
    for li in range(len(targets)):
        if not chosen:  # nothing to run here, but the layers are collectives: a placeholder forward, no expert
            n = 1 if attention_mask is None else int(attention_mask.numel())
            per_layer.append(torch.full((n, k), -1, dtype=torch.int64))
            continue
        try:
            per_layer.append(layout_ids(chosen, li, attention_mask, unrouted=unrouted))
        except ReplayError as exc:
            per_layer.append(exc.with_traceback(None))
    return sel, per_layer, desc


def _ids_per_layer(routing: Any, num_layers: int) -> list[torch.Tensor | None]:
    """Recorded-ids input -> one ``[T, k]`` tensor (or ``None``) per MoE layer."""
    if isinstance(routing, np.ndarray):
        routing = torch.as_tensor(routing)
    if routing is None:
        return [None] * num_layers
    if isinstance(routing, torch.Tensor):
        if routing.dim() != 3:
            raise ReplayError(f"replayed ids as one tensor must be [T, L, k], got shape {tuple(routing.shape)}")
        if routing.shape[1] != num_layers:
            raise ReplayError(f"replayed ids cover {routing.shape[1]} MoE layers, the model has {num_layers}")
        return [routing[:, l] for l in range(num_layers)]
    if not isinstance(routing, Sequence) or isinstance(routing, str):
        raise ReplayError(f"routing must be a TraceBatch, a RoutingTrace or a list of them, a [T, L, k] tensor of "
                          f"ids or a sequence of [T, k] per MoE layer, got {type(routing).__name__}")
    ids = list(routing)
    if len(ids) != num_layers:
        raise ReplayError(f"replayed ids cover {len(ids)} MoE layers, the model has {num_layers}")
    return ids


def _entry_ids(targets: list[ReplayTarget], routing: Any, plan: Any, micro_batch: int | None,
               attention_mask: torch.Tensor | None, rank: int | None, unrouted: str
               ) -> tuple[np.ndarray | None, list[torch.Tensor | ReplayError | None], str]:
    """The checks of :func:`replay` before any layer: ``(selected samples or None, per-layer ids, description)``;
    raises ``ReplayError`` / ``PlanError`` (the caller defers them into the forward on an EP group)."""
    L = len(targets)
    traces = _as_traces(routing)
    sel, desc = None, ""
    if traces is not None:
        if unrouted not in UNROUTED:
            raise ReplayError(f"replay: unrouted={unrouted!r} is not one of {UNROUTED}")
        sel, per_layer, desc = _ids_of_traces(targets, *traces, plan, micro_batch, attention_mask, rank, unrouted)
    else:
        if isinstance(routing, Sequence) and not isinstance(routing, str) and len(routing) == 0:
            raise ReplayError("replay: no traces given")
        per_layer = _ids_per_layer(routing, L)
    # a single layer reads its own slice (its layer_index), checked by the layer; another type: prepare_replay
    if isinstance(plan, (BatchPlan, ReplicaPlan)) and L > 1:
        n = plan.num_layers if isinstance(plan, BatchPlan) else plan.replica_expert.shape[1]
        if n != L:
            raise PlanError(f"the plan covers {n} MoE layers, the model has {L}")
    return sel, per_layer, desc


def _prepare(target: ReplayTarget, ids: torch.Tensor | ReplayError | PlanError | None, plan: Any,
             micro_batch: int | None, desc: str) -> LayerReplay:
    """The target's replay state; on an EP group of several ranks a bad argument becomes the state's
    ``error`` (it may be bad on this rank only: the forward raises it on every rank, no rank waits)."""
    try:
        if isinstance(ids, (ReplayError, PlanError)):
            raise ids
        state = target.prepare_replay(ids, plan=plan, micro_batch=micro_batch)
    except (ReplayError, PlanError) as exc:
        if getattr(target, "world_size", 1) <= 1:
            raise
        # stored without its traceback (its frames would keep the caller alive); forwards raise copies
        return LayerReplay(error=exc.with_traceback(None))
    return replace(state, desc=desc)


def _build(targets: list[ReplayTarget], routing: Any, plan: Any, micro_batch: int | None, attention_mask: Any,
           rank: int | None, unrouted: str) -> tuple[np.ndarray | None, list[LayerReplay]]:
    """The host part of :func:`replay` (any thread): the entry checks, every target's replay state and, for
    layers with one, its schedule (``LayerReplay.schedule``). On an EP group of several ranks an error is kept
    in the states (the agreement makes it every rank's); on one rank it is raised."""
    sel, desc = None, ""
    try:
        if attention_mask is not None and not isinstance(attention_mask, torch.Tensor):
            raise ReplayError(f"replay: attention_mask must be a torch.Tensor [B, S], got "
                              f"{type(attention_mask).__name__}")
        try:
            sel, per_layer, desc = _entry_ids(targets, routing, plan, micro_batch, attention_mask, rank, unrouted)
        except (ReplayError, PlanError):
            raise
        except Exception as exc:  # noqa: BLE001 - any unreadable argument is a named error on every rank
            raise ReplayError(f"replay: the routing could not be read: {type(exc).__name__}: {exc}") from None
    except (ReplayError, PlanError) as exc:
        if all(getattr(t, "world_size", 1) <= 1 for t in targets):
            raise
        # on an EP group the argument may be bad on this rank only: every layer carries the error, and the
        # agreement makes it every rank's (the first forward raises it; no rank waits in a collective)
        exc = exc.with_traceback(None)
        per_layer = [exc] * len(targets)
        if _as_traces(routing) is not None:  # the caller runs a placeholder forward, which raises
            sel = np.zeros(0, np.int64)
    states = [_prepare(t, ids, plan, micro_batch, desc) for t, ids in zip(targets, per_layer)]
    out = []
    for t, state in zip(targets, states):
        if hasattr(t, "build_schedule"):
            state = replace(state, schedule=t.build_schedule(state))
        out.append(state)
    return sel, out


def _agree_and_upload(targets: list[ReplayTarget], states: list[LayerReplay]) -> list[LayerReplay]:
    """The one agreement of the micro-batch across the EP group (all its layers at once) and the upload of every
    schedule to its layer's device."""
    idx = [i for i, t in enumerate(targets) if states[i].schedule is not None]
    if not idx:
        return states
    layers = [targets[i] for i in idx]
    scheds = [states[i].schedule for i in idx]
    if any(getattr(t, "world_size", 1) > 1 for t in layers):
        scheds = type(next(t for t in layers if t.world_size > 1)).agree_schedules(layers, scheds)
    out = list(states)
    for i, t, sc in zip(idx, layers, scheds):
        out[i] = replace(states[i], schedule=t.upload_schedule(sc))
    return out


def scheduled_states(targets: list[ReplayTarget], routing: Any, plan: Any = None, micro_batch: int | None = None,
                     error: ReplayError | PlanError | None = None, built: list[LayerReplay] | None = None
                     ) -> list[LayerReplay]:
    """What :func:`replay` hands ``targets`` at entry, for an integration that sets ``replay_state`` itself around
    each layer's forward (Megatron-core): every target's state with its schedule built, checked, agreed across
    the EP group (the micro-batch's one agreement, a collective: every rank calls it) and uploaded.

    ``routing``: recorded ids (as for :func:`replay`); ``error``: an error this rank found in its arguments
    instead (every state carries it, and the agreement makes it every rank's: the first forward raises it).
    On one rank an error is raised here. ``built``: the states :func:`take_ahead` returned for this micro-batch
    (built ahead from the same ids), agreed and uploaded as they are."""
    if built is not None and error is None:
        return _agree_and_upload(targets, built)
    if error is not None:
        if all(getattr(t, "world_size", 1) <= 1 for t in targets):
            raise error
        states = [LayerReplay(error=error.with_traceback(None)) for _ in targets]
        states = [replace(s, schedule=t.build_schedule(s)) if hasattr(t, "build_schedule") else s
                  for t, s in zip(targets, states)]
    else:
        states = _build(targets, routing, plan, micro_batch, None, None, "live")[1]
    return _agree_and_upload(targets, states)


_PREFETCH = "_relibra_prefetch"


def _prefetch_key(routing: Any, plan: Any, micro_batch: int | None, attention_mask: Any, rank: int | None,
                  unrouted: str) -> tuple | None:
    """What identifies a micro-batch whose host part can be built ahead: traces with a ``BatchPlan``, no mask."""
    if not isinstance(plan, BatchPlan) or attention_mask is not None or _as_traces(routing) is None:
        return None
    if not is_int(micro_batch):
        return None
    return (id(routing), id(plan), int(micro_batch), rank, unrouted)


def _homes(targets: list[ReplayTarget]) -> list[bytes]:
    return [np.asarray(t.expert_gpu_host).tobytes() if hasattr(t, "expert_gpu_host") else b"" for t in targets]


def take_ahead(model: nn.Module, targets: list[ReplayTarget], key: tuple | None):
    """What :func:`build_ahead` built for ``key`` (``(selected samples, states)``) when it was built against the
    layers' current homes and did not fail, else ``None`` (the caller builds it then: a relayout in between, or
    another micro-batch, drops it). Waits for the background build."""
    pending = model.__dict__.pop(_PREFETCH, None)
    if pending is None or key is None or pending[0] != key:
        return None
    try:
        homes, built = pending[1].result()
    except Exception:  # noqa: BLE001 - rebuilt on this thread, where its error is raised as usual
        return None
    return built if homes == _homes(targets) else None


def build_ahead(model: nn.Module, targets: list[ReplayTarget], key: tuple, routing: Any, plan: Any,
                micro_batch: int, rank: int | None = None, unrouted: str = "live") -> None:
    """Start building the host part of ``micro_batch`` (entry checks, states, schedules: what :func:`replay` and
    :func:`scheduled_states` build before the agreement) in the background thread, kept on ``model`` under
    ``key`` for :func:`take_ahead` (one pending build per model). ``routing``: as for :func:`replay`, or a
    callable returning it (called in the thread, e.g. to read the micro-batch's ids out of traces)."""
    homes = _homes(targets)

    def work():
        ids = routing() if callable(routing) else routing
        return homes, _build(targets, ids, plan, micro_batch, None, rank, unrouted)

    model.__dict__[_PREFETCH] = (key, _executor().submit(work))


def _prefetch_next(model: nn.Module, targets: list[ReplayTarget], routing: Any, plan: Any, micro_batch: int | None,
                   attention_mask: Any, rank: int | None, unrouted: str) -> None:
    """Start building the host part of micro-batch ``micro_batch + 1`` of the same traces and plan in the
    background thread (taken by the next :func:`replay` call that asks for it)."""
    key = _prefetch_key(routing, plan, micro_batch, attention_mask, rank, unrouted)
    if key is None or micro_batch + 1 >= plan.replicas.num_micro_batches:
        return
    build_ahead(model, targets, (*key[:2], micro_batch + 1, *key[3:]), routing, plan, micro_batch + 1, rank, unrouted)


def _executor():
    from concurrent.futures import ThreadPoolExecutor

    global _POOL
    if _POOL is None:
        _POOL = ThreadPoolExecutor(max_workers=1, thread_name_prefix="relibra-schedule")
    return _POOL


_POOL = None


@contextlib.contextmanager
def replay(model: nn.Module, routing: Any, plan: BatchPlan | ReplicaPlan | None = None,
           micro_batch: int | None = None, *, attention_mask: torch.Tensor | None = None,
           rank: int | None = None, unrouted: str = "live") -> Iterator[list[int] | None]:
    """Replay recorded routing (and follow ``plan`` for ``micro_batch``) in every MoE layer of ``model``.

    Args:
        model: a model with replay targets (``ReplayBalancedMoE`` layers, or a Hugging Face model after
            ``swap_moe_blocks``); a single layer works too.
        routing: recorded traces or recorded ids (see the module docstring).
        plan: optional ``BatchPlan`` (with traces it also selects the samples of ``micro_batch`` and, with
            ``rank``, those whose attention runs on that rank; it must be a ``BatchPlan`` then) or
            ``ReplicaPlan`` (recorded ids only); every layer follows its slice.
        micro_batch: the micro-batch to run (needed with a plan of several micro-batches; with traces and
            no plan it selects by the batch's own micro-batch assignment; ``None`` = every given sequence).
        attention_mask: traces only: ``[B, S]`` of the forward's input when its padding is not right
            padding to the longest sequence.
        rank: traces with a plan: the rank whose samples this process runs; default: the EP group rank of
            the layers when they have one, else every sample of the micro-batch.
        unrouted: traces with ``attention_mask``: what tokens past a trace's end get (the forward feeds
            more tokens than the rollout routed, e.g. prompt + completion): ``"live"`` (default, routed
            live as the plain model does), ``"none"`` (served by no expert) or ``"error"`` (see
            :func:`layout_ids`).

    Yields:
        With traces, the sample indices (into ``routing``) in the order the forward's batch rows must
        follow. When it is empty (a rank with no sample in this micro-batch) the rank must still run the
        forward, since the layers are collectives: feed a placeholder (one token, or
        ``attention_mask``'s shape); every placeholder token is served by no expert. With recorded ids,
        ``None`` (the rows are the caller's).

    Raises:
        ReplayError: the model has no replay target; the routing's layers / E / k differ from the model's;
            the plan does not cover the routing; (at forward time, on every rank) a layer sees a
            different token count or bad ids.
        PlanError: the plan covers a different number of layers, or (at forward time, on every rank) a
            layer's slice breaks a rule or differs from the layer's homes, or the ranks follow different
            slices (``ReplayBalancedMoE.agree_schedules``).

    Entering the block builds and checks every layer's schedule on the host (the ids, the plan slice, each
    pair's destination, the sorts: ``ReplayBalancedMoE.build_schedule``; with traces and a ``BatchPlan`` and no
    ``attention_mask`` the next micro-batch's is built in a background thread meanwhile) and, on an EP group,
    runs the micro-batch's one agreement for all layers (``ReplayBalancedMoE.agree_schedules``, a collective:
    every rank enters ``replay`` for the same micro-batches). The forwards inside then make no host sync.

    On an EP group of several ranks every error but "no replay target" is deferred: the block is entered
    (with traces it yields ``[]``, so the rank runs a placeholder forward) and the first layer forward
    raises it on every rank of the group, naming this rank, as agreed at entry; an argument
    bad on one rank only never leaves the others waiting in a collective.
    """
    targets = replay_targets(model)
    if not targets:
        raise ReplayError(f"replay: {type(model).__name__} has no MoE layer that replays (ReplayBalancedMoE, or a "
                          "block of swap_moe_blocks): for a Hugging Face model call swap_moe_blocks(model) first")
    key = _prefetch_key(routing, plan, micro_batch, attention_mask, rank, unrouted)
    built = take_ahead(model, targets, key)
    if built is None:
        built = _build(targets, routing, plan, micro_batch, attention_mask, rank, unrouted)
    sel, states = built
    states = _agree_and_upload(targets, states)
    _prefetch_next(model, targets, routing, plan, micro_batch, attention_mask, rank, unrouted)
    previous = [t.replay_state for t in targets]
    for t, state in zip(targets, states):
        t.replay_state = state
    try:
        yield None if sel is None else sel.tolist()
    finally:
        for t, state in zip(targets, previous):
            t.replay_state = state
