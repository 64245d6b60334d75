"""Grouped SwiGLU experts: this rank's home experts as stacked parameters, plus the replica slots.

The local slot table of one layer call has ``S = E_loc + r`` columns: slots ``0 .. E_loc - 1`` are the
home experts (ascending logical id), slots ``E_loc .. E_loc + r - 1`` the replica slots of the
:class:`~relibra_moe.layers.replica_buffer.LayerSharedReplicaBuffer`. The grouped GEMM reads both
through :class:`~relibra_moe.triton_kernels.grouped_gemm.ExpertWeights` (no concatenating copy).

Autograd with a shared buffer. The buffer holds layer ``l``'s replicas only until layer ``l + 1``
refills it, but layer ``l``'s backward needs them again. :class:`_ExpertsWithReplicas` therefore
(1) fills the slots (a collective), (2) runs the expert MLP on detached leaves under
``enable_grad`` and keeps that small graph, (3) in backward refills the slots with layer ``l``'s
replicas when another layer used them meanwhile (the refill writes through ``.data``, so the saved
graph, which references the buffer, stays valid), runs the saved graph backward, and (4) sends the
slot gradients back to the home ranks, where they are added to the home experts' gradients.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ..triton_kernels.grouped_gemm import ExpertWeights, swiglu_experts
from ..triton_kernels.permute import combine, permute
from ..triton_kernels.routing import routing_metadata
from .dispatch import Dispatcher
from .replica_buffer import LayerSharedReplicaBuffer, ReplicaTransfer

__all__ = ["GroupedSwiGLUExperts", "experts_forward"]


class GroupedSwiGLUExperts(nn.Module):
    """``num_local`` SwiGLU experts ``y = (silu(x W_g) * (x W_u)) W_d`` as stacked parameters.

    Attributes:
        w_gate_up: ``[E_loc, H, 2F]`` (gate columns first, then up).
        w_down: ``[E_loc, F, H]``.
    """

    def __init__(self, hidden: int, ffn: int, num_local: int, *, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None, block_m: int = 64) -> None:
        super().__init__()
        self.hidden, self.ffn, self.num_local, self.block_m = hidden, ffn, num_local, block_m
        self.w_gate_up = nn.Parameter(torch.empty(num_local, hidden, 2 * ffn, dtype=dtype, device=device))
        self.w_down = nn.Parameter(torch.empty(num_local, ffn, hidden, dtype=dtype, device=device))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.w_gate_up, std=1.0 / math.sqrt(self.hidden))
        nn.init.normal_(self.w_down, std=1.0 / math.sqrt(self.ffn))

    def extra_repr(self) -> str:
        return f"hidden={self.hidden}, ffn={self.ffn}, num_local={self.num_local}"

    def compute(self, x: torch.Tensor, slot_ids: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor,
                slots: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        """Expert MLP of rows ``x [R, H]`` with local slot ids ``slot_ids [R]`` (int64, all valid).

        ``slots``: the replica slot tensors ``([r, H, 2F], [r, F, H])`` or ``None``. Returns ``[R, H]``
        in the received row order.
        """
        E_loc = w_gate_up.shape[0]
        r = 0 if slots is None else slots[0].shape[0]
        S = max(E_loc + r, 1)
        meta = routing_metadata(slot_ids.view(-1, 1), S, block_m=self.block_m)
        if r:
            dev = slot_ids.device
            src = torch.cat([torch.zeros(E_loc, dtype=torch.int64, device=dev),
                             torch.ones(r, dtype=torch.int64, device=dev)])
            idx = torch.cat([torch.arange(E_loc, device=dev), torch.arange(r, device=dev)])
            w1 = ExpertWeights((w_gate_up, slots[0]), src, idx)
            w2 = ExpertWeights((w_down, slots[1]), src, idx)
        else:
            w1, w2 = w_gate_up, w_down
        xs = permute(x, meta)
        ys = swiglu_experts(xs, meta, w1, w2)
        return combine(ys, meta, torch.ones(x.shape[0], 1, dtype=torch.float32, device=x.device))


class _ExpertsWithReplicas(torch.autograd.Function):
    """Autograd glue for the layer-shared buffer (see the module docstring)."""

    @staticmethod
    def forward(ctx, x, w_gate_up, w_down, slot_ids, experts, buffer, transfer, dispatcher, key):
        active = buffer is not None and transfer is not None and transfer.active
        if active:
            buffer.fill(key, transfer, (w_gate_up, w_down), dispatcher)
        with torch.enable_grad():
            xl = x.detach().requires_grad_(x.requires_grad)
            w1 = w_gate_up.detach().requires_grad_(w_gate_up.requires_grad)
            w2 = w_down.detach().requires_grad_(w_down.requires_grad)
            slots = None
            if active:
                slots = (buffer.w_gate_up.detach().requires_grad_(w1.requires_grad),
                         buffer.w_down.detach().requires_grad_(w2.requires_grad))
            y = experts.compute(xl, slot_ids, w1, w2, slots)
        ctx.graph = (y, xl, w1, w2, slots)
        ctx.state = (active, buffer, transfer, dispatcher, key, (w_gate_up, w_down))
        return y.detach()

    @staticmethod
    def backward(ctx, grad_y):
        y, xl, w1, w2, slots = ctx.graph
        active, buffer, transfer, dispatcher, key, home = ctx.state
        ctx.graph = ctx.state = None
        if active and buffer.filled_for != key:  # a later layer reused the slots: refill (collective)
            buffer.fill(key, transfer, home, dispatcher)
        leaves = [t for t in (xl, w1, w2) if t.requires_grad]
        if slots is not None and w1.requires_grad:
            leaves += list(slots)
        grads = list(torch.autograd.grad(y, leaves, grad_y, allow_unused=True)) if leaves and y.requires_grad \
            else [None] * len(leaves)
        grads = [torch.zeros_like(t) if g is None else g for t, g in zip(leaves, grads)]
        it = iter(grads)
        gx = next(it) if xl.requires_grad else None
        g1 = next(it) if w1.requires_grad else None
        g2 = next(it) if w2.requires_grad else None
        if active and g1 is not None:
            buffer.return_grads(transfer, (next(it), next(it)), (g1, g2), dispatcher)
        return gx, g1, g2, None, None, None, None, None, None


def experts_forward(experts: GroupedSwiGLUExperts, x: torch.Tensor, slot_ids: torch.Tensor,
                    buffer: LayerSharedReplicaBuffer | None, transfer: ReplicaTransfer | None,
                    dispatcher: Dispatcher, key: object) -> torch.Tensor:
    """Run this rank's experts (home + replica slots) on received rows ``x [R, H]``.

    ``slot_ids [R]`` int64 local slots (``< E_loc`` home, ``>= E_loc`` replica slot). A collective
    when ``transfer.active`` (every rank of the group must call it for this layer, even with R = 0).
    """
    if not torch.is_grad_enabled():  # inference / rollout: no graph to keep, no backward refill
        active = buffer is not None and transfer is not None and transfer.active
        if active:
            buffer.fill(key, transfer, (experts.w_gate_up, experts.w_down), dispatcher)
        slots = (buffer.w_gate_up, buffer.w_down) if active else None
        return experts.compute(x, slot_ids, experts.w_gate_up, experts.w_down, slots)
    return _ExpertsWithReplicas.apply(x, experts.w_gate_up, experts.w_down, slot_ids, experts, buffer,
                                      transfer, dispatcher, key)
