"""Grouped experts: this rank's home experts as stacked per-expert tensors, plus the replica slots.

An expert is an ordered set of named per-expert tensors (``tensor_names``; each stacked ``[E_loc, ...]``
with the expert dim first) and an expert-MLP function over slot-sorted rows (:meth:`GroupedExperts.mlp`).
:class:`GroupedSwiGLUExperts` is ``(w_gate_up [E, H, 2F], w_down [E, F, H])`` with SwiGLU;
:class:`BiasedGatedExperts` adds per-expert biases ``(w_gate_up, b_gate_up [E, 2F], w_down, b_down [E, H])``
and takes a row activation (SwiGLU, or GPT-OSS's interleaved clamped one). The replica buffer, relayout
and the replica gradient add-back carry every tensor of the set, in ``tensor_names`` order.

The local slot table of one layer call has ``S = E_loc + r`` columns: slots ``0 .. E_loc - 1`` are the
home experts (ascending logical id), slots ``E_loc .. E_loc + r - 1`` the replica slots of the
:class:`~relibra_moe.layers.replica_buffer.LayerSharedReplicaBuffer`. Weight matrices are read through
:class:`~relibra_moe.triton_kernels.grouped_gemm.ExpertWeights` (no concatenating copy); per-expert
vectors (biases, ``[S, D]``, small) are concatenated.

Autograd with a shared buffer. The buffer holds layer ``l``'s replicas only until layer ``l + 1``
refills it, but layer ``l``'s backward needs them again. :class:`_ExpertsWithReplicas` therefore
(1) fills the slots (a collective), (2) runs the expert MLP on detached leaves under
``enable_grad`` and keeps that small graph, (3) in backward refills the slots with layer ``l``'s
replicas when another layer used them meanwhile (the refill writes through ``.data``, so the saved
graph, which references the buffer, stays valid), runs the saved graph backward, and (4) sends the
slot gradients back to the home ranks, where they are added to the home experts' gradients.

Autograd with resident slots (a plan with ``ReplicaPlan.resident``, :func:`resident_experts_forward`). Each
layer holds its own slots (:class:`~relibra_moe.layers.replica_buffer.ResidentReplicas`), filled once per batch,
so :class:`_ExpertsWithResidentReplicas` never refills in backward: it runs the saved graph, adds the slot
gradients to the layer's accumulator, and in the backward that completes the batch's ``M`` micro-batches
(micro-batch ``M - 1``'s in the usual order) sends the sum home, added to that backward's home gradients (so
hooks after it, DDP's or FSDP's, see complete home gradients). A backward of micro-batch ``M - 1`` that leaves
the batch incomplete raises ``ReplayError`` when its backward pass ends (every rank alike: the same facts).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from ..errors import ReplayError
from ..triton_kernels.grouped_gemm import ExpertWeights, grouped_mm, swiglu, swiglu_experts
from ..triton_kernels.heuristics import row_tile
from ..triton_kernels.permute import combine, permute
from ..triton_kernels.routing import RoutingMeta, routing_metadata, trusted_indices
from .dispatch import Dispatcher
from .replica_buffer import LayerSharedReplicaBuffer, ReplicaTransfer, ResidentKey, ResidentReplicas

__all__ = ["BiasedGatedExperts", "GroupedExperts", "GroupedSwiGLUExperts", "LocalRows", "biased_gated_mlp",
           "experts_forward", "gpt_oss_activation", "grouped_mm_fits", "local_rows", "reference_local_experts",
           "resident_experts_forward", "row_slots", "slot_view"]

SlotTensor = torch.Tensor | ExpertWeights


def slot_view(home: torch.Tensor, slot: torch.Tensor | None, transpose: bool = False) -> SlotTensor:
    """One per-expert tensor over the ``S = E_loc + r`` local slots.

    ``home [E_loc, ...]``, ``slot [r, ...]`` (or ``None``). 3-D tensors (weight matrices) become an
    :class:`ExpertWeights` (no copy; ``transpose`` views each matrix as ``[.., N, K] -> [.., K, N]``
    first); other tensors (per-expert vectors) are concatenated ``[S, ...]``.
    """
    if home.dim() == 3 and transpose:
        home = home.transpose(1, 2)
        slot = None if slot is None else slot.transpose(1, 2)
    if slot is None or slot.shape[0] == 0:
        return home
    if home.dim() != 3:
        return torch.cat([home, slot.to(home.dtype)])
    E_loc, r, dev = home.shape[0], slot.shape[0], home.device
    src = torch.cat([torch.zeros(E_loc, dtype=torch.int64, device=dev), torch.ones(r, dtype=torch.int64, device=dev)])
    idx = torch.cat([torch.arange(E_loc, device=dev), torch.arange(r, device=dev)])
    return ExpertWeights((home, slot), src, idx)


def row_slots(meta: RoutingMeta) -> torch.Tensor:
    """int64 ``[R]``: the slot of every sorted row (padding rows get the last slot; their outputs are
    never read by ``combine``)."""
    rows = torch.arange(meta.num_rows, device=meta.offsets.device, dtype=meta.offsets.dtype)
    s = torch.searchsorted(meta.offsets[1:].contiguous(), rows, right=True)
    return s.clamp_max(max(meta.num_slots - 1, 0)).long()


def gpt_oss_activation(alpha: float, limit: float) -> Callable[[torch.Tensor], torch.Tensor]:
    """GPT-OSS's gated activation on interleaved ``h [R, 2F]`` (gate = even columns, up = odd):
    ``(clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g)`` with ``g = clamp(gate, max=limit)``."""

    def act(h: torch.Tensor) -> torch.Tensor:
        gate, up = h[..., ::2], h[..., 1::2]
        gate = gate.clamp(min=None, max=limit)
        up = up.clamp(min=-limit, max=limit)
        return (up + 1) * (gate * torch.sigmoid(gate * alpha))

    return act


def biased_gated_mlp(xs: torch.Tensor, meta: RoutingMeta, w_gate_up: SlotTensor, b_gate_up: torch.Tensor,
                     w_down: SlotTensor, b_down: torch.Tensor,
                     activation: Callable[[torch.Tensor], torch.Tensor] = swiglu) -> torch.Tensor:
    """``y = act(x W1[s] + b1[s]) W2[s] + b2[s]`` on slot-sorted rows, ``s`` the row's slot.

    ``xs [R, H]``; ``w_gate_up [S, H, 2F]``, ``w_down [S, F, H]`` (tensors or ExpertWeights);
    ``b_gate_up [S, 2F]``, ``b_down [S, H]``; ``activation: [R, 2F] -> [R, F]``. Returns ``[R, H]``
    (padding rows hold garbage that ``combine`` never reads). Differentiable in every input; bias
    gradients are the per-slot sums of the rows' gradients.
    """
    s = row_slots(meta)
    h = grouped_mm(xs, w_gate_up, meta) + b_gate_up.index_select(0, s)
    return grouped_mm(activation(h), w_down, meta) + b_down.index_select(0, s)


class GroupedExperts(nn.Module):
    """Base of the layer's expert containers: ``num_local`` experts, each the per-expert slice of the
    stacked tensors named ``tensor_names`` (expert dim first), computed by :meth:`mlp`.

    Subclasses set ``tensor_names`` (parameters of this module) and implement :meth:`mlp`. The layer
    reads ``expert_tensors()`` (home experts), sizes the replica buffer from their per-expert shapes
    (:meth:`LayerSharedReplicaBuffer.for_experts`) and calls :meth:`compute_tensors`.
    """

    tensor_names: tuple[str, ...] = ()
    #: Rows per tile of the routing metadata; ``None``: the grouped GEMM's own row tile for the call's
    #: shapes (:func:`~relibra_moe.triton_kernels.heuristics.row_tile`), so the GEMMs reuse the
    #: metadata's schedule. The GEMMs always pick their row tile from the shapes and build their own
    #: schedule when it differs from this block.
    block_m: int | None = None

    def expert_tensors(self) -> tuple[torch.Tensor, ...]:
        """This rank's stacked per-expert parameters ``[E_loc, ...]``, in ``tensor_names`` order."""
        return tuple(getattr(self, n) for n in self.tensor_names)

    @property
    def num_local(self) -> int:
        return int(self.expert_tensors()[0].shape[0])

    def mlp(self, xs: torch.Tensor, meta: RoutingMeta, tensors: Sequence[SlotTensor]) -> torch.Tensor:
        """Expert MLP of slot-sorted rows ``xs [R, H]``; ``tensors``: one :func:`slot_view` per name."""
        raise NotImplementedError

    def gated_form(self) -> tuple[torch.Tensor, torch.Tensor, Callable[[torch.Tensor], torch.Tensor]] | None:
        """The home experts as one gated MLP ``act(x W1[e]) W2[e]`` over plain tensors, for
        :func:`reference_local_experts`: ``(W1 [E_loc, H, 2F], W2 [E_loc, F, H], act)`` (views of the
        parameters, any strides), or ``None`` when the experts are not of that form (biases, ...)."""
        return None

    def slot_tensors(self, home: Sequence[torch.Tensor], slots: Sequence[torch.Tensor] | None) -> list[SlotTensor]:
        """Home ``[E_loc, ...]`` and replica slot ``[r, ...]`` tensors as per-slot views (see :func:`slot_view`)."""
        return [slot_view(h, None if slots is None else s) for h, s in zip(home, slots or [None] * len(home))]

    def compute_tensors(self, x: torch.Tensor, slot_ids: torch.Tensor, home: Sequence[torch.Tensor],
                        slots: Sequence[torch.Tensor] | None) -> torch.Tensor:
        """Expert MLP of rows ``x [R, H]`` at local slots ``slot_ids [R]`` (int64, all valid).

        ``home``: the per-expert tensors of the home experts (``expert_tensors()`` or detached leaves of
        them); ``slots``: the replica slot tensors ``[r, ...]`` in the same order, or ``None``. Returns
        ``[R, H]`` in the received row order.
        """
        E_loc = home[0].shape[0]
        r = 0 if slots is None else slots[0].shape[0]
        S = max(E_loc + r, 1)
        block_m = self.block_m if self.block_m is not None else row_tile(x.shape[0] / S, home[0].dtype)
        meta = routing_metadata(slot_ids.view(-1, 1), S, block_m=block_m)
        ys = self.mlp(permute(x, meta), meta, self.slot_tensors(home, slots if r else None))
        return combine(ys, meta, torch.ones(x.shape[0], 1, dtype=torch.float32, device=x.device))


class GroupedSwiGLUExperts(GroupedExperts):
    """``num_local`` SwiGLU experts ``y = (silu(x W_g) * (x W_u)) W_d`` as stacked parameters.

    Attributes:
        w_gate_up: ``[E_loc, H, 2F]`` (gate columns first, then up).
        w_down: ``[E_loc, F, H]``.
    """

    tensor_names = ("w_gate_up", "w_down")

    def __init__(self, hidden: int, ffn: int, num_local: int, *, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None, block_m: int | None = None) -> None:
        super().__init__()
        self.hidden, self.ffn, self.block_m = hidden, ffn, block_m
        self.w_gate_up = nn.Parameter(torch.empty(num_local, hidden, 2 * ffn, dtype=dtype, device=device))
        self.w_down = nn.Parameter(torch.empty(num_local, ffn, hidden, dtype=dtype, device=device))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.w_gate_up, std=1.0 / math.sqrt(self.hidden))
        nn.init.normal_(self.w_down, std=1.0 / math.sqrt(self.ffn))

    def extra_repr(self) -> str:
        return f"hidden={self.hidden}, ffn={self.ffn}, num_local={self.num_local}"

    def mlp(self, xs: torch.Tensor, meta: RoutingMeta, tensors: Sequence[SlotTensor]) -> torch.Tensor:
        return swiglu_experts(xs, meta, tensors[0], tensors[1])

    def gated_form(self) -> tuple[torch.Tensor, torch.Tensor, Callable[[torch.Tensor], torch.Tensor]]:
        return self.w_gate_up, self.w_down, swiglu

    def compute(self, x: torch.Tensor, slot_ids: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor,
                slots: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        """The two-tensor form of :meth:`compute_tensors` (``slots``: ``([r, H, 2F], [r, F, H])`` or ``None``)."""
        return self.compute_tensors(x, slot_ids, (w_gate_up, w_down), slots)


class BiasedGatedExperts(GroupedExperts):
    """``num_local`` gated experts with per-expert biases: ``y = act(x W1 + b1) W2 + b2``.

    Args:
        hidden: H. ffn: F. num_local: E_loc.
        activation: ``"swiglu"`` (``silu(gate) * up``, gate half first), ``"gpt_oss"`` (interleaved
            gate/up, clamped, see :func:`gpt_oss_activation`), or a callable ``[R, 2F] -> [R, F]``.
        alpha, limit: GPT-OSS's ``swiglu_alpha`` and ``swiglu_limit``.

    Attributes:
        w_gate_up: ``[E_loc, H, 2F]``. b_gate_up: ``[E_loc, 2F]``. w_down: ``[E_loc, F, H]``.
        b_down: ``[E_loc, H]``.
    """

    tensor_names = ("w_gate_up", "b_gate_up", "w_down", "b_down")

    def __init__(self, hidden: int, ffn: int, num_local: int, *,
                 activation: str | Callable[[torch.Tensor], torch.Tensor] = "swiglu", alpha: float = 1.702,
                 limit: float = 7.0, dtype: torch.dtype | None = None, device: torch.device | str | None = None,
                 block_m: int | None = None) -> None:
        super().__init__()
        self.hidden, self.ffn, self.block_m = hidden, ffn, block_m
        if activation == "swiglu":
            self.activation = swiglu
        elif activation == "gpt_oss":
            self.activation = gpt_oss_activation(alpha, limit)
        elif callable(activation):
            self.activation = activation
        else:
            raise ValueError(f"activation must be 'swiglu', 'gpt_oss' or a callable, got {activation!r}")
        kw = dict(dtype=dtype, device=device)
        self.w_gate_up = nn.Parameter(torch.empty(num_local, hidden, 2 * ffn, **kw))
        self.b_gate_up = nn.Parameter(torch.empty(num_local, 2 * ffn, **kw))
        self.w_down = nn.Parameter(torch.empty(num_local, ffn, hidden, **kw))
        self.b_down = nn.Parameter(torch.empty(num_local, hidden, **kw))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.w_gate_up, std=1.0 / math.sqrt(self.hidden))
        nn.init.normal_(self.w_down, std=1.0 / math.sqrt(self.ffn))
        nn.init.normal_(self.b_gate_up, std=0.1)
        nn.init.normal_(self.b_down, std=0.1)

    def extra_repr(self) -> str:
        return f"hidden={self.hidden}, ffn={self.ffn}, num_local={self.num_local}"

    def mlp(self, xs: torch.Tensor, meta: RoutingMeta, tensors: Sequence[SlotTensor]) -> torch.Tensor:
        w1, b1, w2, b2 = tensors
        return biased_gated_mlp(xs, meta, w1, b1, w2, b2, self.activation)


@dataclass(frozen=True, eq=False)
class LocalRows:
    """The index tensors of :func:`reference_local_experts` for one layer call, derived from its
    :class:`RoutingMeta` on the host (:func:`local_rows`; the replay schedule builds them ahead).

    Attributes:
        row_token: int64 ``[R]``, the token of each slot-sorted row (0 for padding rows).
        row_valid: bool ``[R, 1]``, the row holds a routed pair.
        pair_row: int64 ``[T, k]``, the sorted row of each (token, k) pair (0 for unrouted pairs).
        pair_valid: bool ``[T, k, 1]``, the pair is routed.
        ends: int32 ``[S]``, the end row of each slot (``meta.offsets[1:]``, the ``offs`` of ``torch._grouped_mm``).
        all_routed: a host fact: every pair is routed (no padding row, no unrouted pair), so no mask is
            needed; ``False`` when unknown.
    """

    row_token: torch.Tensor
    row_valid: torch.Tensor
    pair_row: torch.Tensor
    pair_valid: torch.Tensor
    ends: torch.Tensor
    all_routed: bool = False

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.row_token, self.row_valid, self.pair_row, self.pair_valid, self.ends)


def local_rows(meta: RoutingMeta, all_routed: bool = False) -> LocalRows:
    """:class:`LocalRows` of ``meta`` (torch ops on ``meta``'s device, no host read); ``all_routed``: the
    caller knows that every pair is routed."""
    gather, scatter = meta.gather_idx.long(), meta.scatter_idx.long().view(meta.num_tokens, meta.top_k)
    return LocalRows(gather.clamp(min=0) // meta.top_k, (gather >= 0).unsqueeze(1), scatter.clamp(min=0),
                     (scatter >= 0).unsqueeze(2), meta.offsets[1:].contiguous(), bool(all_routed))


_GROUPED_MM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def grouped_mm_fits(*ws: torch.Tensor) -> bool:
    """Whether ``torch._grouped_mm`` runs on CPU weights ``ws [S, K, N]`` and contiguous rows ``[R, K]``: one of
    its dtypes (fp32, bf16, fp16; not float64), 16-byte aligned data, every stride but the unit one and
    every K and N a multiple of 16 bytes."""
    if not hasattr(torch, "_grouped_mm") or not ws:
        return False
    dtype, size = ws[0].dtype, ws[0].element_size()
    for w in ws:
        if w.device.type != "cpu" or w.dtype != dtype or dtype not in _GROUPED_MM_DTYPES or w.dim() != 3 \
                or w.data_ptr() % 16 or any((d * size) % 16 for d in w.shape[1:]) \
                or any(n > 1 and st != 1 and (st * size) % 16 for n, st in zip(w.shape, w.stride())):
            return False
    return True


def reference_local_experts(x: torch.Tensor, rows: LocalRows, w1: torch.Tensor, w2: torch.Tensor,
                            act: Callable[[torch.Tensor], torch.Tensor], gates: torch.Tensor) -> torch.Tensor:
    """The whole one-rank expert stage on CPU as plain differentiable torch ops (no custom op, no loop over
    slots): gather the rows of ``x [T, H]`` in slot order, ``act(rows W1[s]) W2[s]`` with ``torch._grouped_mm``
    (its CPU kernel, what HF's ``grouped_mm`` experts run), and each token's sum of its k outputs weighted by
    ``gates [T, k]`` in fp32, in the order j = 0..k-1 (as :func:`~relibra_moe.triton_kernels.permute.combine`).
    ``w1 [S, H, 2F]``, ``w2 [S, F, H]`` (:func:`grouped_mm_fits` must hold). Returns ``[T, H]`` in the weights'
    dtype; autograd differentiates ``x``, the weights and ``gates``. ``torch._grouped_mm`` leaves rows past
    the last slot (padding) undefined: the gather masks padding rows to 0 (so their gradient is 0) and the
    combine masks unrouted pairs, so nothing undefined is read (``rows.all_routed``: there is neither, and no
    mask runs)."""
    xs = x.to(w1.dtype)[rows.row_token]
    if not rows.all_routed:
        xs = torch.where(rows.row_valid, xs, 0.0)
    y = torch._grouped_mm(act(torch._grouped_mm(xs, w1, offs=rows.ends)), w2, offs=rows.ends)
    picked = y[rows.pair_row]
    if not rows.all_routed:  # before the product: no undefined value reaches the gates' gradient either
        picked = torch.where(rows.pair_valid, picked, 0.0)
    return (picked.float() * gates.float().unsqueeze(2)).sum(1).to(y.dtype)


class _ExpertsWithReplicas(torch.autograd.Function):
    """Autograd glue for the layer-shared buffer (see the module docstring)."""

    @staticmethod
    def forward(ctx, x, slot_ids, experts, buffer, transfer, dispatcher, key, *home):
        active = buffer is not None and transfer is not None and transfer.active
        if active:
            buffer.fill(key, transfer, home, dispatcher)
        ctx.graph = _saved_graph(experts, x, slot_ids, home, buffer.tensors if active else None)
        ctx.state = (active, buffer, transfer, dispatcher, key, tuple(home))
        return ctx.graph[0].detach()

    @staticmethod
    def backward(ctx, grad_y):
        with trusted_indices():  # the forward's indices, built by the layer
            return _ExpertsWithReplicas._backward(ctx, grad_y)

    @staticmethod
    def _backward(ctx, grad_y):
        graph, (active, buffer, transfer, dispatcher, key, home) = ctx.graph, ctx.state
        ctx.graph = ctx.state = None
        if active and buffer.filled_for != key:  # a later layer reused the slots: refill (collective)
            buffer.fill(key, transfer, home, dispatcher)
        gx, gw, gs = _graph_grads(graph, grad_y)
        if active and any(g is not None for g in gw):
            gw = _with_slot_grads(graph[2], gw, lambda gh: buffer.return_grads(transfer, tuple(gs), gh, dispatcher))
        return (gx, None, None, None, None, None, None, *gw)


def experts_forward(experts: GroupedExperts, x: torch.Tensor, slot_ids: torch.Tensor,
                    buffer: LayerSharedReplicaBuffer | None, transfer: ReplicaTransfer | None,
                    dispatcher: Dispatcher, key: object) -> torch.Tensor:
    """Run this rank's experts (home + replica slots) on received rows ``x [R, H]``.

    ``slot_ids [R]`` int64 local slots (``< E_loc`` home, ``>= E_loc`` replica slot). A collective
    when ``transfer.active`` (every rank of the group must call it for this layer, even with R = 0).
    """
    home = experts.expert_tensors()
    if not torch.is_grad_enabled():  # inference / rollout: no graph to keep, no backward refill
        active = buffer is not None and transfer is not None and transfer.active
        if active:
            buffer.fill(key, transfer, home, dispatcher)
        return experts.compute_tensors(x, slot_ids, home, buffer.tensors if active else None)
    return _ExpertsWithReplicas.apply(x, slot_ids, experts, buffer, transfer, dispatcher, key, *home)


def _saved_graph(experts: GroupedExperts, x: torch.Tensor, slot_ids: torch.Tensor, home: tuple[torch.Tensor, ...],
                 slot_tensors: tuple[torch.Tensor, ...] | None) -> tuple:
    """The experts' forward on detached leaves, kept for :func:`_graph_grads`: ``(y [R, H], x leaf, home leaves,
    slot leaves (empty without slots))``; a slot leaf wants a gradient where its member's home tensor does."""
    with torch.enable_grad():
        xl = x.detach().requires_grad_(x.requires_grad)
        ws = tuple(w.detach().requires_grad_(w.requires_grad) for w in home)
        slots = () if slot_tensors is None else tuple(t.detach().requires_grad_(w.requires_grad)
                                                      for t, w in zip(slot_tensors, ws))
        y = experts.compute_tensors(xl, slot_ids, ws, slots if slot_tensors is not None else None)
    return y, xl, ws, slots


def _graph_grads(graph: tuple, grad_y: torch.Tensor) -> tuple[torch.Tensor | None, list, list]:
    """Run a saved ``(y, xl, ws, slots)`` graph (:func:`_saved_graph`) backward: ``(grad x or None, home grads
    (None: frozen), slot grads (zeros for the slots of frozen members))``; a leaf the graph does not reach gets
    zeros."""
    y, xl, ws, slots = graph
    leaves = [t for t in (xl, *ws, *slots) if t.requires_grad]
    grads = list(torch.autograd.grad(y, leaves, grad_y, allow_unused=True)) if leaves and y.requires_grad \
        else [None] * len(leaves)
    it = iter(torch.zeros_like(t) if g is None else g for t, g in zip(leaves, grads))
    gx = next(it) if xl.requires_grad else None
    gw = [next(it) if w.requires_grad else None for w in ws]
    gs = [next(it) if s.requires_grad else torch.zeros_like(s) for s in slots]
    return gx, gw, gs


def _with_slot_grads(ws: tuple[torch.Tensor, ...], gw: list, add: Callable[[tuple[torch.Tensor, ...]], None]) -> list:
    """The home gradients ``gw`` (None: a frozen member) after ``add`` sent the slot gradients home into them in
    place (a collective): it receives every member's gradient, zeros for the frozen ones (their slot gradients are
    dropped, the others still travel home); returns the gradients for autograd, None again where frozen."""
    gh = tuple(torch.zeros_like(w) if g is None else g for w, g in zip(ws, gw))
    add(gh)
    return [g if w.requires_grad else None for w, g in zip(ws, gh)]


_END_CHECKS: dict[int, list[tuple[ResidentReplicas, str, int]]] = {}


def _check_when_backward_ends(resident: ResidentReplicas, name: str, generation: int) -> None:
    """Run ``resident.check_complete(name, generation)`` when the current backward pass ends; one callback per
    pass checks every layer queued in it (each incomplete batch is dropped) and raises the first error."""
    task = torch._C._current_graph_task_id()
    checks = _END_CHECKS.get(task)
    if checks is None:
        checks = _END_CHECKS[task] = []

        def run() -> None:
            errors = []
            for res, layer, gen in _END_CHECKS.pop(task, []):
                try:
                    res.check_complete(layer, gen)
                except ReplayError as exc:
                    errors.append(exc)
            if errors:
                raise errors[0]

        torch.autograd.Variable._execution_engine.queue_callback(run)
    checks.append((resident, name, generation))


class _ExpertsWithResidentReplicas(torch.autograd.Function):
    """Autograd glue for resident slots (see the module docstring)."""

    @staticmethod
    def forward(ctx, x, slot_ids, experts, resident, transfer, dispatcher, info, *home):
        ctx.graph = _saved_graph(experts, x, slot_ids, home, resident.buffer.tensors)
        ctx.state = (resident, transfer, dispatcher, info)
        return ctx.graph[0].detach()

    @staticmethod
    def backward(ctx, grad_y):
        with trusted_indices():  # the forward's indices, built by the layer
            graph, (resident, transfer, dispatcher, (name, generation, m, M)) = ctx.graph, ctx.state
            if graph is None:  # a second backward through this node (retain_graph)
                raise resident.twice_error(name, m)
            ctx.graph = None
            gx, gw, gs = _graph_grads(graph, grad_y)
            if not any(g is not None for g in gw):  # every expert tensor frozen: nothing goes home
                return (gx, None, None, None, None, None, None, *gw)
            if resident.accumulate(name, generation, m, gs):
                gw = _with_slot_grads(graph[2], gw, lambda gh: resident.send_home(transfer, gh, dispatcher))
            elif m == M - 1:  # checked when this backward pass ends: a summed loss runs m = M - 1 first
                _check_when_backward_ends(resident, name, generation)
            return (gx, None, None, None, None, None, None, *gw)


def resident_experts_forward(experts: GroupedExperts, x: torch.Tensor, slot_ids: torch.Tensor,
                             resident: ResidentReplicas, transfer: ReplicaTransfer, dispatcher: Dispatcher,
                             key: ResidentKey, name: str) -> torch.Tensor:
    """:func:`experts_forward` with the layer's resident slots ``resident`` (its buffer allocated): filled when
    ``key`` begins a batch (:meth:`ResidentReplicas.prepare`, a collective), their gradients returned once per
    batch (a collective in the backward that completes it). ``name``: the layer, for errors."""
    home = experts.expert_tensors()
    keeps_graph = torch.is_grad_enabled() and any(w.requires_grad for w in home)
    generation = resident.prepare(name, key, transfer, home, dispatcher, keeps_graph)
    if not keeps_graph:  # inference, or every expert tensor frozen: no slot gradient
        return experts.compute_tensors(x, slot_ids, home, resident.buffer.tensors)
    info = (name, generation, key.micro_batch, key.num_micro_batches)
    return _ExpertsWithResidentReplicas.apply(x, slot_ids, experts, resident, transfer, dispatcher, info, *home)
