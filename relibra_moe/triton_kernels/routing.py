"""Routing metadata: sort (token, k) pairs by slot and build the tile schedule of the grouped GEMM.

A *slot* is a column of the local expert-weight table: a home expert, or a replica slot of the
layer-shared buffer. ``slot_ids[t, j]`` is the slot serving token ``t``'s ``j``-th routed expert, or
``-1`` when that pair is not served here (not routed, or served on another rank). Flat pair index:
``p = t * k + j``.

The metadata is built with torch ops only: no ``.item()``, no host sync, so it is CUDA-graph safe and
traceable by ``torch.compile``. Every size is host-computable from the input shape: the number of
sorted rows ``R`` is an upper bound (``T * k`` unless the caller passes a smaller ``num_rows``), rows
beyond the routed pairs are padding (``gather_idx == -1``, zero in every op's output).

Too small a ``num_rows`` (fewer rows than routed pairs). On CPU this raises :class:`ReplayError` naming
both numbers (``overflow="raise"``, the default). Where checking would need a host sync (CUDA tensors,
``torch.compile`` tracing) or with ``overflow="report"``, the metadata is built for the first ``R``
sorted pairs only: ``offsets`` are clipped to ``R`` (so every kernel reads and writes rows ``< R``
only), the pairs that do not fit get ``scatter_idx == -1`` (they contribute nothing to ``combine``),
and ``RoutingMeta.num_dropped`` (an int32 [1] device tensor, 0 when everything fits) reports how many
routed pairs were left out. Which pairs are left out is defined: the last ones in slot order (the
highest slots, and inside a slot the highest flat pair indices).

Tile schedule (one program of the grouped GEMM per tile and N-block): tile ``b`` covers sorted rows
``[tile_row[b], min(tile_row[b] + block_m, end))`` of slot ``tile_slot[b]``, with
``end = offsets[slot + 1]``. Tiles never straddle two slots. After the real tiles come *zero tiles*
(``tile_slot == -1``, ``tile_row >= 0``) that cover the padding rows ``[offsets[S], R)`` so kernels
can write them as zeros, then unused tiles (``tile_slot == tile_row == -1``). The bound on the
number of tiles is ``cdiv(R, block_m) + min(S, R)``: each slot adds at most one partial tile.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from relibra_moe.errors import ReplayError

__all__ = ["RoutingMeta", "indices_trusted", "num_tiles_bound", "routing_metadata", "tile_schedule",
           "trusted_indices"]

_trust = threading.local()


@contextlib.contextmanager
def trusted_indices() -> Iterator[None]:
    """Inside the block (this thread), the range checks of CPU index tensors in this package's ops
    (:func:`routing_metadata`, ``ExpertWeights``, the replica copies) are skipped: the caller built the
    indices itself from values checked on the host, and a check would read the device (a host sync on a
    GPU, counted as one on the CPU too). Used by the MoE layer's hot path."""
    prev = getattr(_trust, "on", False)
    _trust.on = True
    try:
        yield
    finally:
        _trust.on = prev


def indices_trusted() -> bool:
    """Whether this thread runs inside :func:`trusted_indices` (or ``torch.compile`` is tracing)."""
    return getattr(_trust, "on", False) or torch.compiler.is_compiling()


def num_tiles_bound(num_rows: int, num_slots: int, block_m: int) -> int:
    """Host-computable upper bound on the tiles of ``num_rows`` sorted rows over ``num_slots`` slots."""
    return -(-num_rows // block_m) + min(num_slots, num_rows)


@dataclass(frozen=True, eq=False)
class RoutingMeta:
    """Routing metadata of one MoE layer call (all tensors on the device of ``slot_ids``).

    Attributes:
        num_slots: S, slots (local expert columns) the pairs are sorted into.
        block_m: rows per tile of the grouped GEMM schedule.
        top_k: k, routed experts per token.
        num_tokens: T.
        num_rows: R, sorted rows (host upper bound on the routed pairs; see the module docstring when
            it is smaller).
        counts: int32 [S], routed pairs per slot that have a row (all routed pairs unless
            ``num_dropped > 0``).
        offsets: int32 [S + 1], exclusive prefix sum of ``counts``; ``offsets[S] <= R`` rows are used.
        gather_idx: int32 [R], sorted row -> flat pair ``t * k + j`` (-1 for padding rows).
            Stable: inside a slot, rows follow increasing flat pair index.
        scatter_idx: int32 [T * k], flat pair -> sorted row (-1 for pairs not routed).
        tile_slot: int32 [B], slot of each tile (-1 for zero tiles and unused tiles).
        tile_row: int32 [B], first sorted row of each tile (-1 for unused tiles).
        num_dropped: int32 [1], routed pairs that did not fit into ``R`` rows (0 unless ``num_rows``
            was too small and the check was skipped).
    """

    num_slots: int
    block_m: int
    top_k: int
    num_tokens: int
    num_rows: int
    counts: torch.Tensor
    offsets: torch.Tensor
    gather_idx: torch.Tensor
    scatter_idx: torch.Tensor
    tile_slot: torch.Tensor
    tile_row: torch.Tensor
    num_dropped: torch.Tensor

    @property
    def num_tiles(self) -> int:
        """B, the padded length of the tile schedule."""
        return int(self.tile_slot.shape[0])

    @property
    def device(self) -> torch.device:
        """The device of the metadata tensors."""
        return self.counts.device

    def token_idx(self) -> torch.Tensor:
        """int64 [R]: the token of each sorted row (0 for padding rows; mask with ``gather_idx >= 0``)."""
        return self.gather_idx.clamp(min=0).long() // self.top_k

    def slot_of_row(self) -> torch.Tensor:
        """int64 [R]: the slot of each sorted row (S for padding rows)."""
        rows = torch.arange(self.num_rows, device=self.device, dtype=torch.int64)
        return torch.searchsorted(self.offsets[1:].long(), rows, right=True)


def _check_routing_args(slot_ids: torch.Tensor, num_slots: int, block_m: int, num_rows: int | None,
                        overflow: str) -> int:
    """``routing_metadata``'s argument checks (ReplayError naming the argument); returns R, the sorted rows."""
    if overflow not in ("raise", "report"):
        raise ReplayError(f"overflow must be 'raise' or 'report', got {overflow!r}")
    if slot_ids.dim() != 2:
        raise ReplayError(f"slot_ids must be [T, k], got shape {tuple(slot_ids.shape)}")
    if slot_ids.dtype.is_floating_point or slot_ids.dtype == torch.bool or slot_ids.is_complex():
        raise ReplayError(f"slot_ids must be an integer tensor, got dtype {slot_ids.dtype}")
    if num_slots < 1:
        raise ReplayError(f"num_slots must be >= 1, got {num_slots}")
    if block_m < 1 or block_m & (block_m - 1):
        raise ReplayError(f"block_m must be a power of two, got {block_m}")
    T, k = (int(s) for s in slot_ids.shape)
    n_pairs = T * k
    R = n_pairs if num_rows is None else int(num_rows)
    if R < 0 or R > n_pairs:
        raise ReplayError(f"num_rows must lie in [0, T*k={n_pairs}], got {num_rows}")
    flat = slot_ids.reshape(-1)
    if not flat.is_cuda and n_pairs and not indices_trusted():
        lo, hi = int(flat.min()), int(flat.max())
        if lo < -1 or hi >= num_slots:
            raise ReplayError(f"slot_ids must lie in [-1, num_slots={num_slots}), got range [{lo}, {hi}]")
        if num_rows is not None and overflow == "raise":
            routed = int((flat >= 0).sum())
            if routed > R:
                raise ReplayError(
                    f"num_rows={R} is smaller than the {routed} routed pairs of slot_ids (pass num_rows >= {routed})"
                )
    return R


def routing_metadata(
    slot_ids: torch.Tensor,
    num_slots: int,
    block_m: int = 64,
    num_rows: int | None = None,
    overflow: str = "raise",
) -> RoutingMeta:
    """Sort the (token, k) pairs of ``slot_ids`` by slot and build the GEMM tile schedule.

    Args:
        slot_ids: integer [T, k], the slot of every (token, k) pair, -1 = not served here.
        num_slots: S, the number of slots (ids must lie in ``[-1, S)``).
        block_m: rows per tile (a power of two; the kernels' BLOCK_M).
        num_rows: R, the length of the sorted-row axis; default ``T * k``. A smaller bound saves
            memory when many pairs are -1; it should be at least the number of routed pairs.
        overflow: what a ``num_rows`` below the routed pairs does: ``"raise"`` (default) raises
            :class:`ReplayError` naming both numbers where the count is host-visible (CPU, eager);
            on CUDA or while tracing (no host sync) it falls back to ``"report"``: only the first
            ``R`` sorted pairs get rows, no row ``>= R`` is ever read or written, and
            ``meta.num_dropped`` holds the number of pairs left out (check it when it matters).

    Returns:
        The :class:`RoutingMeta`. Raises :class:`ReplayError` on a malformed ``slot_ids``.
    """
    R = _check_routing_args(slot_ids, num_slots, block_m, num_rows, overflow)
    T, k = (int(s) for s in slot_ids.shape)
    n_pairs = T * k
    device = slot_ids.device
    flat = slot_ids.reshape(-1)
    S = num_slots
    # Unrouted pairs get key S: they sort last (stable), and their bucket is dropped from the counts.
    key = torch.where(flat >= 0, flat.to(torch.int64), torch.full_like(flat, S, dtype=torch.int64))
    counts_ext = torch.zeros(S + 1, dtype=torch.int64, device=device)
    counts_ext.scatter_add_(0, key, torch.ones_like(key))
    full_offsets = torch.zeros(S + 1, dtype=torch.int64, device=device)
    torch.cumsum(counts_ext[:S], 0, out=full_offsets[1:])
    # Clip to the R rows that exist: pairs sorted past row R - 1 get no row (reported in num_dropped).
    offsets64 = full_offsets.clamp(max=R)
    counts64 = offsets64[1:] - offsets64[:-1]
    num_dropped = (full_offsets[S:] - offsets64[S:]).to(torch.int32)

    sorted_key, order = torch.sort(key, stable=True)
    routed_sorted = sorted_key < S
    gather_full = torch.where(routed_sorted, order, torch.full_like(order, -1))
    gather_idx = gather_full[:R].to(torch.int32)
    rank = torch.empty_like(order)
    rank[order] = torch.arange(n_pairs, device=device, dtype=torch.int64)
    scatter_idx = torch.where((key < S) & (rank < R), rank, torch.full_like(rank, -1)).to(torch.int32)
    tile_slot, tile_row = tile_schedule(offsets64, R, block_m)

    return RoutingMeta(
        num_slots=S,
        block_m=block_m,
        top_k=k,
        num_tokens=T,
        num_rows=R,
        counts=counts64.to(torch.int32),
        offsets=offsets64.to(torch.int32),
        gather_idx=gather_idx,
        scatter_idx=scatter_idx,
        tile_slot=tile_slot,
        tile_row=tile_row,
        num_dropped=num_dropped,
    )


def tile_schedule(offsets: torch.Tensor, num_rows: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The tile schedule of ``block_m``-row tiles over slot row ranges (see the module docstring).

    Args:
        offsets: integer [S + 1] slot row offsets (``offsets[S] <= num_rows``).
        num_rows: R, the sorted rows (padding rows ``[offsets[S], R)`` get zero tiles).
        block_m: rows per tile (>= 1).

    Returns:
        ``(tile_slot, tile_row)``, int32 [B] with ``B = num_tiles_bound(R, S, block_m)``; torch ops
        only (no host sync), so a GEMM can build the schedule of its own row tile from a
        :class:`RoutingMeta` made with another ``block_m``.
    """
    if block_m < 1:
        raise ReplayError(f"block_m must be >= 1, got {block_m}")
    device = offsets.device
    off = offsets.to(torch.int64)
    S, R = int(off.shape[0]) - 1, int(num_rows)
    counts = off[1:] - off[:-1]
    B = num_tiles_bound(R, S, block_m)
    tiles = (counts + block_m - 1) // block_m
    tile_end = torch.cumsum(tiles, 0)  # [S], exclusive end of each slot's tiles
    tile_first = tile_end - tiles
    n_real = tile_end[-1]
    b = torch.arange(B, device=device, dtype=torch.int64)
    slot = torch.searchsorted(tile_end, b, right=True)  # S for b >= n_real
    slot_c = slot.clamp(max=S - 1)
    real_row = off[slot_c] + (b - tile_first[slot_c]) * block_m
    zero_row = off[S] + (b - n_real) * block_m
    is_real = slot < S
    row = torch.where(is_real, real_row, zero_row)
    row = torch.where(is_real | (zero_row < R), row, torch.full_like(row, -1))
    tile_slot = torch.where(is_real, slot, torch.full_like(slot, -1)).to(torch.int32)
    return tile_slot, row.to(torch.int32)
