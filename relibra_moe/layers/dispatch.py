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
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import torch
import torch.distributed as dist

from ..spec_sources import ep_process_group, is_device_mesh  # noqa: F401  (re-exported: the layer's EP group)

try:  # optional: DeepEP (https://github.com/deepseek-ai/DeepEP), GPU only
    import deep_ep  # type: ignore[import-not-found]
except Exception:  # noqa: BLE001 - any import failure means "not available"
    deep_ep = None

__all__ = ["AllToAllDispatcher", "DeepEPDispatcher", "Dispatcher", "LocalDispatcher", "all_to_all",
           "clear_dispatcher_cache", "get_dispatcher", "has_deep_ep"]


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
        return _all_to_all_raw(x, send_splits, recv_splits, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        send_splits, recv_splits = ctx.splits
        return _AllToAll.apply(grad, recv_splits, send_splits, ctx.group), None, None, None


def _all_to_all_raw(x: torch.Tensor, send_splits: list[int], recv_splits: list[int], group) -> torch.Tensor:
    if x.shape[0] != sum(send_splits):
        raise ValueError(f"all_to_all: {x.shape[0]} rows, send splits sum to {sum(send_splits)}")
    out = x.new_empty((sum(recv_splits),) + tuple(x.shape[1:]))
    row = 1
    for s in x.shape[1:]:
        row *= s
    if row == 0:  # nothing to move; skip the collective consistently on every rank
        return out
    # gloo and NCCL both want contiguous 1-D-able buffers; flatten rows so splits are in elements
    dist.all_to_all_single(out.view(-1), x.contiguous().view(-1), [s * row for s in recv_splits],
                           [s * row for s in send_splits], group=group)
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
        return _all_to_all_raw(x, send_splits[lo:lo + P], recv_splits[lo:lo + P], self.node_group)


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
