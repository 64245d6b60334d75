"""Apply a new expert placement across the EP group (the inter-batch reordering of docs/method.md,
"Reorder").

``relayout(model, placement, optimizer=None)`` moves, for every ``ReplayBalancedMoE`` layer ``l`` of
the model (module order = the plan's layer order) whose homes change, each expert's rows of

- every per-expert tensor of the layer's experts (``experts.expert_tensors()``: ``w_gate_up``, ``w_down``,
  and biases for biased experts),
- their gradients, when present,
- the optimizer state of those parameters that is per expert: every state tensor shaped like the
  parameter (Adam/AdamW ``exp_avg``, ``exp_avg_sq``, ``max_exp_avg_sq``; SGD momentum),

from the old home rank to the new one, and writes them in place (``copy_``), so the optimizer's
references to the parameters stay valid. Scalar state such as Adam's ``step`` belongs to the whole
stacked parameter, is the same on every rank and every expert, and stays where it is.

Only data moves: relayout followed by the inverse relayout is a bitwise identity, and the layer
computes the same function before and after. Every call is a collective over each layer's EP group;
before any expert moves the ranks exchange whether they accepted the placement and a checksum of it,
so a placement that breaks a rule on any rank, or placements that differ between ranks, raise
``PlanError`` on every rank (no rank is left waiting, nothing has moved).
"""

from __future__ import annotations

import zlib

import numpy as np
import torch
from torch import nn

from ..errors import PlanError
from ..plan import BatchPlan, Placement
from .moe import ReplayBalancedMoE, moe_layers

__all__ = ["relayout", "moe_layers"]


def _state_tensors(p: torch.Tensor, optimizer: torch.optim.Optimizer | None) -> list[torch.Tensor]:
    out = [p.data]
    if p.grad is not None:
        out.append(p.grad)
    # a container of optimizers (torchtitan's OptimizersContainer) keeps the state in its inner optimizers
    for opt in ([] if optimizer is None else getattr(optimizer, "optimizers", [optimizer])):
        for name in sorted(opt.state.get(p, {})):
            v = opt.state[p][name]
            if isinstance(v, torch.Tensor) and v.shape == p.shape and v.dim() > 0:
                out.append(v)
    return out


@torch.no_grad()
def _move_layer(layer: ReplayBalancedMoE, new: np.ndarray, optimizer: torch.optim.Optimizer | None) -> int:
    """Move one layer's expert rows from its current homes to ``new [E]``; returns experts moved."""
    old = layer.expert_gpu_host
    rank, G = layer.rank, layer.world_size
    mine_old = np.flatnonzero(old == rank)  # row i of the stacked tensors = expert mine_old[i]
    mine_new = np.flatnonzero(new == rank)
    send_e = sorted(mine_old, key=lambda e: (new[e], e))  # destinations ascending, experts ascending
    send_rows = torch.as_tensor([int(np.searchsorted(mine_old, e)) for e in send_e], dtype=torch.int64)
    send_splits = np.bincount(new[send_e], minlength=G) if send_e else np.zeros(G, np.int64)
    recv_e = sorted(mine_new, key=lambda e: (old[e], e))  # sources ascending, experts ascending
    recv_rows = torch.as_tensor([int(np.searchsorted(mine_new, e)) for e in recv_e], dtype=torch.int64)
    recv_splits = np.bincount(old[recv_e], minlength=G) if recv_e else np.zeros(G, np.int64)
    for p in layer.experts.expert_tensors():
        for t in _state_tensors(p, optimizer):
            rows = send_rows.to(t.device)
            send = t.index_select(0, rows).reshape(len(rows), t[0].numel())
            recv = layer.dispatcher.replica_exchange(send, send_splits.tolist(), recv_splits.tolist(), False)
            t.index_copy_(0, recv_rows.to(t.device), recv.reshape((len(recv_rows),) + tuple(t.shape[1:])))
    layer.set_placement_row(new)
    return int((old != new).sum())


def _checked_rows(layers: list[ReplayBalancedMoE], placement: Placement | np.ndarray
                  ) -> list[tuple[ReplayBalancedMoE, np.ndarray]]:
    """Validate ``placement`` against the layers (``PlanError``); returns (layer, new homes [E]) pairs."""
    grid = placement.expert_gpu if isinstance(placement, Placement) else np.asarray(placement)
    grid = np.asarray(grid)
    if grid.dtype == bool or not np.issubdtype(grid.dtype, np.number):
        raise PlanError(f"placement expert_gpu must hold integer GPU ids, got dtype {grid.dtype}")
    if not np.issubdtype(grid.dtype, np.integer):
        frac = np.flatnonzero(grid.ravel() != np.round(grid.ravel()))
        if len(frac):
            at = np.unravel_index(frac[0], grid.shape)
            raise PlanError(f"placement expert_gpu must hold integer GPU ids: expert_gpu{list(map(int, at))} = "
                            f"{grid[at].item()!r} (dtype {grid.dtype})")
    grid = grid.astype(np.int64)
    if grid.ndim != 2 or grid.shape[0] != len(layers):
        raise PlanError(f"placement expert_gpu has shape {grid.shape}, the model has {len(layers)} MoE layers")
    order = []
    for i, layer in enumerate(layers):
        l = i if layer.layer_index is None else layer.layer_index
        if not 0 <= l < grid.shape[0]:
            raise PlanError(f"layer {layer.name}: layer_index {l} is outside the placement's {grid.shape[0]} rows")
        row = grid[l]
        G, E = layer.world_size, layer.num_experts
        if row.shape != (E,):
            raise PlanError(f"placement row {l} has {row.shape[0]} experts, layer {layer.name} has {E}")
        bad = np.flatnonzero((row < 0) | (row >= G))
        if len(bad):
            raise PlanError(f"expert_gpu[{l}, {bad[0]}] = {row[bad[0]]} is outside [0, {G})")
        counts = np.bincount(row, minlength=G)
        if (counts != E // G).any():
            g = int(np.flatnonzero(counts != E // G)[0])
            raise PlanError(f"expert_gpu: GPU {g} homes {counts[g]} experts in layer {l}; every GPU must home "
                            f"exactly E/G = {E // G}")
        order.append((layer, row))
    return order


def _digest(order: list[tuple[ReplayBalancedMoE, np.ndarray]]) -> int:
    """A 31-bit checksum of the validated new homes, to compare the placement across ranks."""
    rows = np.ascontiguousarray(np.concatenate([row for _, row in order]) if order else np.zeros(0), np.int64)
    return zlib.crc32(rows.tobytes()) & 0x7FFFFFFF


def _agree(layers: list[ReplayBalancedMoE], order: list[tuple[ReplayBalancedMoE, np.ndarray]],
           error: PlanError | None) -> None:
    """Before any expert moves, the ranks of the (first multi-rank) EP group exchange a checksum of
    their placement and whether they accepted it; every rank raises ``PlanError`` when one rejected it
    or when the placements differ, so no rank is left waiting in the moves."""
    layer = next((lay for lay in layers if lay.world_size > 1), None)
    if layer is None:
        if error is not None:
            raise error
        return
    G = layer.world_size
    row = torch.tensor([[_digest(order), 0 if error is None else 1]], dtype=torch.int64)
    exchange = getattr(layer.dispatcher, "agree_exchange", layer.dispatcher.exchange)
    recv = exchange(row.repeat(G, 1).to(layer.expert_gpu.device)).cpu()
    if error is not None:
        raise error
    bad = np.flatnonzero(recv[:, 1].numpy())
    if len(bad):
        raise PlanError(f"relayout: rank {int(bad[0])} of the EP group rejected the placement (see that rank's error)")
    digests = recv[:, 0].tolist()
    if len(set(digests)) > 1:
        other = next(g for g, d in enumerate(digests) if d != digests[layer.rank])
        raise PlanError(f"relayout: the ranks of the EP group were given different placements (rank {other}'s "
                        f"differs from rank {layer.rank}'s); every rank must apply the same placement")


def relayout(model: nn.Module, placement: Placement | BatchPlan | np.ndarray,
             optimizer: torch.optim.Optimizer | None = None) -> dict[str, int]:
    """Move every MoE layer's experts (and grads, optimizer state) to ``placement.expert_gpu [L, E]``
    (a ``Placement``, a ``BatchPlan``'s placement, or the int array itself).

    ``model``: any module containing ``ReplayBalancedMoE`` layers (or one such layer); row ``l`` of the
    placement belongs to the ``l``-th of them in module order (their ``layer_index`` when set).
    Returns ``{"layers_changed": ..., "experts_moved": ...}``. A collective: every rank of the EP
    group calls it with the same placement.
    """
    layers = moe_layers(model)
    if isinstance(placement, BatchPlan):
        placement = placement.placement
    error, order = None, []
    try:
        order = _checked_rows(layers, placement)
    except PlanError as exc:
        error = exc
    except Exception as exc:  # noqa: BLE001 - e.g. a ragged list: refused on every rank through the agreement
        error = PlanError(f"placement could not be read as expert_gpu [L, E] GPU ids: {type(exc).__name__}: {exc}")
    try:
        _agree(layers, order, error)
    finally:
        error = None  # no frame -> error -> traceback -> frame cycle once it is raised
    changed = moved = 0
    for layer, row in order:
        if np.array_equal(layer.expert_gpu_host, row):
            continue
        moved += _move_layer(layer, row, optimizer)
        changed += 1
    return {"layers_changed": changed, "experts_moved": moved}
