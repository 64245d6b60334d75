"""Token dispatch between the ranks of an expert-parallel group.

A :class:`Dispatcher` moves rows (one per routed (token, expert) pair, already sorted by destination
rank) to their destination ranks with variable splits, and moves the expert outputs back. Received
rows are ordered by source rank, and inside one source in the sender's order; ``combine`` is the exact
inverse. Both are differentiable (the backward of a dispatch is a combine and vice versa). Every call
is a collective: all ranks of the group must make the same calls in the same order.

Implementations:

- :class:`LocalDispatcher`: one process (no group, or a group of size 1); identity.
- :class:`AllToAllDispatcher`: ``torch.distributed.all_to_all_single`` (gloo on CPU, NCCL on GPU),
  with one intra-node sub-group per node for the replica traffic of node-scoped plans.
- :class:`DeepEPDispatcher`: DeepEP's intranode/internode kernels for the token rows (GPU only;
  available when ``deep_ep`` imports). Metadata and replica traffic go through ``torch.distributed``.

Use :func:`get_dispatcher` to get one per (group, gpus_per_node): constructing an
:class:`AllToAllDispatcher` creates sub-groups, which is itself a collective.

Failing peers. Every collective of an :class:`AllToAllDispatcher` on CPU tensors (gloo) runs under the
library's own deadline (:func:`set_collective_timeout`, default :data:`DEFAULT_COLLECTIVE_TIMEOUT_S`, or the
``RELIBRA_COLLECTIVE_TIMEOUT_S`` environment variable; keep it under the process group's timeout): the host
polls the collective and the process group's store. A rank whose layer fails between two collectives posts a
notice there (:func:`post_failure`: the layer, the stage, its rank and its error) before it re-raises, and
every rank waiting in a collective of the same agreement epoch raises ``ReplayError`` naming them; a peer that
died (the connection closed) or did not answer within the deadline is a ``ReplayError`` too, naming the
layer and the stage this rank waited in. An epoch is counted by :meth:`AllToAllDispatcher.agree_exchange` (the
agreements of ``replay`` entry, live forwards and ``relayout``), so a notice of an earlier epoch is never read
again. After such an error the process group is not reusable (a collective may be left half done): destroy
and re-create it. On CUDA (NCCL) a collective does not block the host, so the process group's own timeout and
NCCL's watchdog apply there.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Protocol, runtime_checkable

import torch
import torch.distributed as dist

from ..errors import ReplayError
from ..spec_sources import ep_process_group, is_device_mesh  # noqa: F401  (re-exported: the layer's EP group)
from ..validate import check_positive
from .upstream_torch import default_store

try:  # optional: DeepEP (https://github.com/deepseek-ai/DeepEP), GPU only
    import deep_ep  # type: ignore[import-not-found]
except Exception:  # noqa: BLE001 - any import failure means "not available"
    deep_ep = None

__all__ = ["DEFAULT_COLLECTIVE_TIMEOUT_S", "AllToAllDispatcher", "DeepEPDispatcher", "Dispatcher", "LocalDispatcher",
           "all_to_all", "clear_dispatcher_cache", "collective_stage", "collective_timeout", "get_dispatcher",
           "has_deep_ep", "post_failure", "set_collective_stage", "set_collective_timeout"]

#: Default deadline (seconds) of one collective of the layer on gloo; well under torch's default process group
#: timeout (30 min on gloo).
DEFAULT_COLLECTIVE_TIMEOUT_S = 120.0
_TIMEOUT_ENV = "RELIBRA_COLLECTIVE_TIMEOUT_S"
_timeout: list[float | None] = [None]
_stage = threading.local()
_POLL_STORE_S = 0.05  # how often a waiting rank reads the store for a peer's notice


def set_collective_timeout(seconds: float | None) -> None:
    """Set the deadline of every layer collective on gloo (``None``: back to the environment / default)."""
    _timeout[0] = None if seconds is None else check_positive("collective timeout (s)", seconds, error=ValueError)


def collective_timeout() -> float:
    """The deadline in seconds (:func:`set_collective_timeout`, else ``RELIBRA_COLLECTIVE_TIMEOUT_S``, else
    :data:`DEFAULT_COLLECTIVE_TIMEOUT_S`)."""
    if _timeout[0] is not None:
        return _timeout[0]
    raw = os.environ.get(_TIMEOUT_ENV)
    if raw is None:
        return DEFAULT_COLLECTIVE_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        value = raw
    return check_positive(_TIMEOUT_ENV, value, error=ValueError)


@contextlib.contextmanager
def collective_stage(layer: str, stage: str) -> Iterator[None]:
    """Name the layer and stage of the collectives this thread runs inside the block (for error messages)."""
    prev = getattr(_stage, "where", None)
    _stage.where = (layer, stage)
    try:
        yield
    finally:
        _stage.where = prev


def set_collective_stage(layer: str, stage: str | None) -> tuple[str, str | None]:
    """Name the layer and stage of this thread's collectives from now on (``stage=None``: unnamed); returns
    the previous ``(layer, stage)`` to restore."""
    prev = getattr(_stage, "where", None) or ("moe", None)
    _stage.where = None if stage is None else (layer, stage)
    return prev


def _where() -> tuple[str, str]:
    return getattr(_stage, "where", None) or ("moe", "collective")


def _store():
    try:
        return default_store()
    except Exception:  # noqa: BLE001 - no store: notices are not posted, the deadline still applies
        return None


class _Epochs:
    """Agreement epochs per process group (see the module docstring)."""

    count: dict[str, int] = {}

    @staticmethod
    def tag(group) -> str:
        ranks = dist.get_process_group_ranks(group) if group is not None else range(dist.get_world_size())
        return "-".join(str(r) for r in ranks)

    @classmethod
    def key(cls, group) -> str:
        tag = cls.tag(group)
        return f"relibra_moe/failure/{tag}/{cls.count.get(tag, 0)}"

    @classmethod
    def next(cls, group) -> None:
        """Open the next epoch: after an agreement, and after an incident (every rank of the group raises in
        one: the failing rank, and the others through its notice), so no notice is read twice."""
        tag = cls.tag(group)
        cls.count[tag] = cls.count.get(tag, 0) + 1


def _is_control_flow(error: BaseException) -> bool:
    """Whether ``error`` is control flow, not a failure: non-reentrant activation checkpointing stops a
    recomputation early by raising ``_StopRecomputationError`` once it has the tensors the backward needs. Every
    rank of the group stops at the same point of the same recomputation (after the same collectives), so no peer
    is left waiting and nothing must be posted."""
    try:
        from torch.utils.checkpoint import _StopRecomputationError
    except ImportError:  # a torch without early stopping never raises it
        return False
    return isinstance(error, _StopRecomputationError)


def post_failure(dispatcher: Dispatcher, layer: str, stage: str, error: BaseException) -> None:
    """Tell the other ranks of ``dispatcher``'s group that this rank stopped in ``stage`` of ``layer`` (a
    notice in the process group's store for the current agreement epoch); best effort, never raises."""
    group = getattr(dispatcher, "group", None)
    if getattr(dispatcher, "world_size", 1) <= 1 or getattr(error, "peer_notice", False) or not dist.is_initialized() \
            or _is_control_flow(error):
        return
    store = _store()
    rejected = str(error)[:400] if stage == "route" and isinstance(error, ReplayError) else None
    text = json.dumps({"rank": dispatcher.rank, "layer": layer, "stage": stage, "rejected": rejected,
                       "error": f"{type(error).__name__}: {error}"[:400]})
    try:
        if store is not None:
            store.set(_Epochs.key(group), text)
    except Exception:  # noqa: BLE001 - a notice is best effort
        pass
    _Epochs.next(group)


def _notice(group) -> dict | None:
    store = _store()
    if store is None:
        return None
    key = _Epochs.key(group)
    try:
        if not store.check([key]):
            return None
        return json.loads(store.get(key).decode())
    except Exception:  # noqa: BLE001 - an unreadable store reads as no notice
        return None


def _peer_error(group, reason: str) -> ReplayError:
    layer, stage = _where()
    note = _notice(group)
    if note is not None and note.get("rejected"):  # its input, found before any token moved
        text = (f"layer {note['layer']}: rank {note['rank']} of the EP group rejected its replay data: "
                f"{note['rejected']}")
    elif note is not None:
        text = (f"layer {note['layer']}: rank {note['rank']} of the EP group stopped in stage '{note['stage']}' "
                f"({note['error']}); this rank stopped waiting in stage '{stage}' of layer {layer}")
    else:
        text = f"layer {layer}: stage '{stage}': {reason}"
    err = ReplayError(text)
    err.peer_notice = True  # not re-posted as this rank's own failure
    _Epochs.next(group)
    return err


def _wait(work, group) -> None:
    """Wait for a gloo collective under the deadline, reading the store for a peer's notice."""
    limit = collective_timeout()
    start = time.monotonic()
    next_store = start + _POLL_STORE_S
    nap = 5e-5
    try:
        while not work.is_completed():
            now = time.monotonic()
            if now >= next_store:
                if _notice(group) is not None:
                    raise _peer_error(group, "")
                next_store = now + _POLL_STORE_S
            if now - start > limit:
                raise _peer_error(group, f"the EP group did not answer within the collective timeout of {limit:g} s "
                                         "(relibra_moe.layers.dispatch.set_collective_timeout)")
            time.sleep(nap)
            nap = min(2 * nap, 2e-3)
        work.wait()
        if _notice(group) is not None:  # a peer that failed joined this collective only to let it complete
            raise _peer_error(group, "")
    except RuntimeError as exc:  # gloo: a peer died ("Connection closed by peer") or timed out
        if getattr(exc, "peer_notice", False):
            raise
        raise _peer_error(group, _backend_reason(str(exc))) from None


def _backend_reason(text: str) -> str:
    """gloo's error text in words (its source location and advice dropped)."""
    if "Connection" in text and ("closed" in text or "reset" in text):
        return "a peer of the EP group closed its connection (the process died or left the group)"
    if "Timed out" in text or "timeout" in text.lower():
        return "the process group's own timeout expired while a peer did not answer"
    first = re.sub(r"^\[[^\]]*\]\s*", "", text.strip().splitlines()[0] if text.strip() else "")
    return f"a peer of the EP group stopped answering ({first.split('. ')[0][:200] or 'no detail'})"



def has_deep_ep() -> bool:
    """Whether the optional ``deep_ep`` package imported."""
    return deep_ep is not None


@runtime_checkable
class Dispatcher(Protocol):
    """The protocol every dispatcher implements (see the module docstring)."""

    rank: int
    world_size: int
    gpus_per_node: int

    def exchange(self, send: torch.Tensor) -> torch.Tensor:
        """Small integer metadata: ``send [G, C]`` int64, row g goes to rank g; returns ``[G, C]``, row g
        received from rank g. Not differentiable."""
        ...

    def agree_exchange(self, send: torch.Tensor) -> torch.Tensor:
        """``exchange`` of an agreement (every rank of the group arrived: a new epoch of failure notices)."""
        ...

    def dispatch(self, x: torch.Tensor, send_splits: Sequence[int], recv_splits: Sequence[int]) -> torch.Tensor:
        """Rows ``x [sum(send_splits), ...]`` sorted by destination -> ``[sum(recv_splits), ...]``."""
        ...

    def dispatch_ids(self, ids: torch.Tensor, send_splits: Sequence[int], recv_splits: Sequence[int]) -> torch.Tensor:
        """Like ``dispatch`` for an integer tensor (not differentiable), e.g. the local slot of each row."""
        ...

    def combine(self, y: torch.Tensor, send_splits: Sequence[int], recv_splits: Sequence[int]) -> torch.Tensor:
        """Inverse of ``dispatch`` with the same splits: ``y [sum(recv_splits), ...]`` ->
        ``[sum(send_splits), ...]`` in the original order."""
        ...

    def replica_exchange(self, x: torch.Tensor, send_splits: Sequence[int], recv_splits: Sequence[int],
                         intra_node: bool) -> torch.Tensor:
        """Expert-weight traffic for replica slots (not differentiable). Splits are over the G ranks of
        the group; with ``intra_node`` every non-zero split must be to/from the caller's node and the
        transfer runs on the node's sub-group (NVLink on GPU clusters)."""
        ...


class LocalDispatcher:
    """A single-rank group: every row stays here."""

    rank = 0
    world_size = 1

    def __init__(self, gpus_per_node: int = 1) -> None:
        self.gpus_per_node = gpus_per_node

    def exchange(self, send: torch.Tensor) -> torch.Tensor:
        return send.clone()

    def agree_exchange(self, send: torch.Tensor) -> torch.Tensor:
        return send.clone()

    def dispatch(self, x: torch.Tensor, send_splits: Sequence[int], recv_splits: Sequence[int]) -> torch.Tensor:
        return x

    def dispatch_ids(self, ids: torch.Tensor, send_splits: Sequence[int], recv_splits: Sequence[int]) -> torch.Tensor:
        return ids

    def combine(self, y: torch.Tensor, send_splits: Sequence[int], recv_splits: Sequence[int]) -> torch.Tensor:
        return y

    def replica_exchange(self, x: torch.Tensor, send_splits: Sequence[int], recv_splits: Sequence[int],
                         intra_node: bool) -> torch.Tensor:
        return x.clone()


class _AllToAll(torch.autograd.Function):
    """Differentiable variable-split all-to-all over rows (dim 0)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, send_splits: list[int], recv_splits: list[int], group) -> torch.Tensor:
        ctx.splits = (send_splits, recv_splits)
        ctx.group = group
        ctx.where = _where()
        return _all_to_all_raw(x, send_splits, recv_splits, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        send_splits, recv_splits = ctx.splits
        layer, stage = ctx.where
        with collective_stage(layer, f"{stage} (backward)"):
            return _AllToAll.apply(grad, recv_splits, send_splits, ctx.group), None, None, None


def _all_to_all_raw(x: torch.Tensor, send_splits: list[int], recv_splits: list[int], group,
                    notice_group=None) -> torch.Tensor:
    """``all_to_all_single`` over rows; on CPU tensors under the deadline, reading the notices of
    ``notice_group`` (default ``group``: the EP group, also for a collective on one of its node sub-groups)."""
    if x.shape[0] != sum(send_splits):
        raise ValueError(f"all_to_all: {x.shape[0]} rows, send splits sum to {sum(send_splits)}")
    out = x.new_empty((sum(recv_splits),) + tuple(x.shape[1:]))
    row = 1
    for s in x.shape[1:]:
        row *= s
    if row == 0:  # nothing to move; skip the collective consistently on every rank
        return out
    # gloo and NCCL both want contiguous 1-D-able buffers; flatten rows so splits are in elements
    if out.is_cuda:  # NCCL: the host does not wait (module docstring)
        dist.all_to_all_single(out.view(-1), x.contiguous().view(-1), [s * row for s in recv_splits],
                               [s * row for s in send_splits], group=group)
        return out
    work = dist.all_to_all_single(out.view(-1), x.contiguous().view(-1), [s * row for s in recv_splits],
                                  [s * row for s in send_splits], group=group, async_op=True)
    _wait(work, group if notice_group is None else notice_group)
    return out


def all_to_all(x: torch.Tensor, send_splits: Sequence[int], recv_splits: Sequence[int],
               group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Differentiable ``all_to_all_single`` over rows: ``x [sum(send_splits), ...]`` -> ``[sum(recv_splits), ...]``."""
    return _AllToAll.apply(x, [int(s) for s in send_splits], [int(s) for s in recv_splits], group)


class AllToAllDispatcher:
    """Dispatch over ``torch.distributed.all_to_all_single`` on ``group`` (default: the world).

    Construction is a collective over each node of the group: the ranks of a node (``gpus_per_node``
    consecutive group ranks) create their sub-group together (``use_local_synchronization``, so other
    EP groups of a larger world need not take part). ``gpus_per_node`` must divide the group size.
    """

    def __init__(self, group: dist.ProcessGroup | None = None, gpus_per_node: int | None = None) -> None:
        if not dist.is_initialized():
            raise RuntimeError("AllToAllDispatcher needs torch.distributed to be initialized")
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        P = self.world_size if gpus_per_node is None else int(gpus_per_node)
        if P < 1 or self.world_size % P:
            raise ValueError(f"gpus_per_node={P} does not divide the EP group size {self.world_size}")
        self.gpus_per_node = P
        self.node = self.rank // P
        global_ranks = dist.get_process_group_ranks(group) if group is not None else list(range(self.world_size))
        self.node_group = None
        if P == self.world_size:
            self.node_group = group
        else:  # only the node's members create (and synchronize on) its sub-group
            lo = self.node * P
            self.node_group = dist.new_group(global_ranks[lo:lo + P], use_local_synchronization=True)

    def exchange(self, send: torch.Tensor) -> torch.Tensor:
        G = self.world_size
        if send.shape[0] != G:
            raise ValueError(f"exchange: send has {send.shape[0]} rows, the group has {G} ranks")
        return _all_to_all_raw(send.contiguous(), [1] * G, [1] * G, self.group)

    def agree_exchange(self, send: torch.Tensor) -> torch.Tensor:
        """:meth:`exchange` of an agreement; opens a new epoch of failure notices once every rank arrived."""
        out = self.exchange(send)
        _Epochs.next(self.group)
        return out

    def dispatch(self, x: torch.Tensor, send_splits: Sequence[int], recv_splits: Sequence[int]) -> torch.Tensor:
        return all_to_all(x, send_splits, recv_splits, self.group)

    def dispatch_ids(self, ids: torch.Tensor, send_splits: Sequence[int], recv_splits: Sequence[int]) -> torch.Tensor:
        return _all_to_all_raw(ids, [int(s) for s in send_splits], [int(s) for s in recv_splits], self.group)

    def combine(self, y: torch.Tensor, send_splits: Sequence[int], recv_splits: Sequence[int]) -> torch.Tensor:
        return all_to_all(y, recv_splits, send_splits, self.group)

    def replica_exchange(self, x: torch.Tensor, send_splits: Sequence[int], recv_splits: Sequence[int],
                         intra_node: bool) -> torch.Tensor:
        send_splits = [int(s) for s in send_splits]
        recv_splits = [int(s) for s in recv_splits]
        if not intra_node or self.node_group is self.group:
            return _all_to_all_raw(x, send_splits, recv_splits, self.group)
        P, lo = self.gpus_per_node, self.node * self.gpus_per_node
        outside = [g for g in range(self.world_size) if not lo <= g < lo + P and (send_splits[g] or recv_splits[g])]
        if outside:
            raise ValueError(f"replica_exchange(intra_node=True): rank {self.rank} (node {self.node}) has "
                             f"traffic with rank {outside[0]} on another node")
        return _all_to_all_raw(x, send_splits[lo:lo + P], recv_splits[lo:lo + P], self.node_group, self.group)


class _DeepEPRows(torch.autograd.Function):
    """Rows to ranks through DeepEP: each row is a token with one "expert" = its destination rank."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, dest: torch.Tensor, owner: DeepEPDispatcher) -> torch.Tensor:
        buf, G = owner.buffer, owner.world_size
        topk_idx = dest.view(-1, 1).long()
        n_rank, n_rdma, n_expert, in_rank, _ = buf.get_dispatch_layout(topk_idx, G)
        recv_x, _, _, _, handle, _ = buf.dispatch(
            x, num_tokens_per_rank=n_rank, num_tokens_per_rdma_rank=n_rdma, is_token_in_rank=in_rank,
            num_tokens_per_expert=n_expert, topk_idx=topk_idx,
            topk_weights=torch.ones_like(topk_idx, dtype=torch.float32))
        ctx.owner, ctx.handle = owner, handle
        owner._last_handle = handle
        return recv_x

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out, _, _ = ctx.owner.buffer.combine(grad.contiguous(), ctx.handle)
        return out, None, None


class _DeepEPCombine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y: torch.Tensor, handle, owner: DeepEPDispatcher) -> torch.Tensor:
        out, _, _ = owner.buffer.combine(y.contiguous(), handle)
        ctx.owner, ctx.handle = owner, handle
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        recv, _, _, _, _, _ = ctx.owner.buffer.dispatch(grad.contiguous(), handle=ctx.handle)
        return recv, None, None


class DeepEPDispatcher(AllToAllDispatcher):
    """Token rows through DeepEP's normal (high-throughput) kernels; GPU only, needs ``deep_ep``.

    Each row is dispatched as a DeepEP token whose single "expert" is its destination rank, so
    DeepEP's layout gives exactly our variable splits; received rows come grouped by source rank in
    the sender's order, like :class:`AllToAllDispatcher`. Metadata and replica weights use
    ``torch.distributed`` (NCCL). Not exercised in CPU CI.
    """

    def __init__(self, group: dist.ProcessGroup | None = None, gpus_per_node: int | None = None,
                 num_nvl_bytes: int = 1 << 30, num_rdma_bytes: int = 0) -> None:
        if deep_ep is None:
            raise RuntimeError("DeepEPDispatcher needs the optional 'deep_ep' package (GPU only)")
        if not torch.cuda.is_available():
            raise RuntimeError("DeepEPDispatcher needs CUDA")
        super().__init__(group, gpus_per_node)
        self.buffer = deep_ep.Buffer(group if group is not None else dist.group.WORLD, num_nvl_bytes, num_rdma_bytes)
        self._last_handle = None

    def dispatch(self, x: torch.Tensor, send_splits: Sequence[int], recv_splits: Sequence[int]) -> torch.Tensor:
        dest = torch.repeat_interleave(torch.arange(self.world_size, device=x.device),
                                       torch.as_tensor(list(send_splits), device=x.device))
        return _DeepEPRows.apply(x, dest, self)

    def combine(self, y: torch.Tensor, send_splits: Sequence[int], recv_splits: Sequence[int]) -> torch.Tensor:
        if self._last_handle is None:
            raise RuntimeError("DeepEPDispatcher.combine called before dispatch")
        handle, self._last_handle = self._last_handle, None
        return _DeepEPCombine.apply(y, handle, self)


_CACHE: dict[tuple, Dispatcher] = {}


def clear_dispatcher_cache() -> None:
    """Forget cached dispatchers (call after ``destroy_process_group`` before re-initializing)."""
    _CACHE.clear()


def get_dispatcher(group: dist.ProcessGroup | None = None, gpus_per_node: int | None = None,
                   kind: str = "auto") -> Dispatcher:
    """The dispatcher of an EP group, created once per (group, gpus_per_node, kind) and cached.

    ``kind``: ``"auto"`` (local for one rank, otherwise all-to-all), ``"alltoall"``, ``"deepep"``.
    The first call for a multi-rank group is a collective (sub-group creation).
    """
    if kind not in ("auto", "alltoall", "deepep"):
        raise ValueError(f"dispatcher kind {kind!r} is not one of ('auto', 'alltoall', 'deepep')")
    world = dist.get_world_size(group) if dist.is_initialized() else 1
    if world == 1 and kind == "auto":
        return LocalDispatcher(1 if gpus_per_node is None else gpus_per_node)
    key = (id(group) if group is not None else None, gpus_per_node, kind)
    if key not in _CACHE:
        cls = DeepEPDispatcher if kind == "deepep" else AllToAllDispatcher
        _CACHE[key] = cls(group, gpus_per_node)
    return _CACHE[key]
