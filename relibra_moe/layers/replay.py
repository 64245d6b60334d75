"""Model-level routing replay: hand every MoE layer its recorded ids and its slice of the plan.

::

    relayout(model, plan.placement, optimizer)                  # once per global batch
    for m in range(plan.num_micro_batches):
        with replay_model(model, ids_of_micro_batch[m], plan=plan, micro_batch=m):
            loss = loss_fn(model(tokens[m]))
        loss.backward()                                         # may run after the block

``per_layer_ids`` are this rank's tokens' recorded expert ids, either a sequence with one entry per
MoE layer (``[T, k]`` int tensor, or ``None`` for live routing in that layer), or a single tensor
``[T, L, k]`` (the layout of ``RoutingTrace.experts``: tokens x MoE layers x k). MoE layers are the
model's :class:`~relibra_moe.layers.moe.ReplayBalancedMoE` modules in module order; layers without a
``layer_index`` get their position in that order (the plan's ``l``). Every forward of a layer inside
the block uses the same ids (so run one forward per layer per block).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import numpy as np
import torch
from torch import nn

from ..errors import PlanError, ReplayError
from ..plan import BatchPlan, ReplicaPlan
from .moe import ReplayBalancedMoE, moe_layers

__all__ = ["assign_layer_indices", "moe_layers", "replay_model"]


def assign_layer_indices(model: nn.Module) -> list[ReplayBalancedMoE]:
    """Give every MoE layer without a ``layer_index`` its position in module order; returns the layers."""
    layers = moe_layers(model)
    for i, layer in enumerate(layers):
        if layer.layer_index is None:
            layer.layer_index = i
    return layers


@contextlib.contextmanager
def replay_model(model: nn.Module, per_layer_ids: Sequence[torch.Tensor | None] | torch.Tensor | None,
                 plan: BatchPlan | ReplicaPlan | None = None, micro_batch: int | None = None) -> Iterator[nn.Module]:
    """Replay recorded routing (and follow ``plan`` for ``micro_batch``) in every MoE layer of ``model``.

    Raises ``ReplayError`` when the number of layers of ``per_layer_ids`` differs from the model's
    MoE layers, and ``PlanError`` when the plan covers a different number of layers. Per-layer
    mismatches (token count, k, id range, duplicates; plan rules) are raised by the layer's forward,
    on every rank of the EP group.
    """
    layers = assign_layer_indices(model)
    L = len(layers)
    if isinstance(per_layer_ids, np.ndarray):
        per_layer_ids = torch.as_tensor(per_layer_ids)
    if per_layer_ids is not None and not isinstance(per_layer_ids, (torch.Tensor, Sequence)):
        raise ReplayError(f"replayed ids must be a [T, L, k] tensor or a sequence of [T, k] per MoE layer, got "
                          f"{type(per_layer_ids).__name__}")
    if per_layer_ids is None:
        ids: list[torch.Tensor | None] = [None] * L
    elif isinstance(per_layer_ids, torch.Tensor):
        if per_layer_ids.dim() != 3:
            raise ReplayError(f"replayed ids as one tensor must be [T, L, k], got shape {tuple(per_layer_ids.shape)}")
        if per_layer_ids.shape[1] != L:
            raise ReplayError(f"replayed ids cover {per_layer_ids.shape[1]} MoE layers, the model has {L}")
        ids = [per_layer_ids[:, l] for l in range(L)]
    else:
        ids = list(per_layer_ids)
        if len(ids) != L:
            raise ReplayError(f"replayed ids cover {len(ids)} MoE layers, the model has {L}")
    if plan is not None:
        n = plan.num_layers if isinstance(plan, BatchPlan) else plan.replica_expert.shape[1]
        if n != L:
            raise PlanError(f"the plan covers {n} MoE layers, the model has {L}")
    with contextlib.ExitStack() as stack:
        for layer, layer_ids in zip(layers, ids):
            stack.enter_context(layer.replay(layer_ids, plan=plan, micro_batch=micro_batch))
        yield model
