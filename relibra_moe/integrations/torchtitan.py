"""torchtitan 0.3 MoE models (Qwen3 MoE, DeepSeek-V3, any model built on ``torchtitan.models.common.moe.MoE``)
with relibra's replay-balanced layer.

:func:`relibra_moe.swap_moe_blocks`, :class:`relibra_moe.RoutingRecorder` and :func:`relibra_moe.replay` find
torchtitan's ``MoE`` blocks (``layers.<i>.moe``) beside the Hugging Face ones; this module holds what differs.
:class:`TorchtitanReplayMoE` is a :class:`~relibra_moe.layers.moe.ReplayBalancedMoE` made of torchtitan's own
submodules, under torchtitan's names, so ``model.state_dict()`` keys are unchanged by the swap:

- ``router`` is torchtitan's ``TokenChoiceTopKRouter`` *instance* (class switched to a subclass): live routing
  is torchtitan's own (softmax / sigmoid scores, the ``expert_bias_E`` load-balancing bias in the selection,
  node-limited groups, ``route_norm``, ``route_scale``); with replayed ids the gates are torchtitan's gate
  values of those ids from the live scores: ``scores[id]`` (no bias), ``/ (sum + 1e-20)`` when
  ``route_norm``, ``* route_scale``; a ``-1`` id gets 0;
- ``routed_experts.inner_experts`` is torchtitan's ``GroupedExperts`` instance: its parameters ``w1_EFD [E, F, D]``,
  ``w3_EFD [E, F, D]``, ``w2_EDF [E, D, F]`` are the layer's per-expert tensors as they are (the same
  ``Parameter`` objects, no copy on one rank; the grouped GEMMs read transposed views). Like torchtitan it
  computes the GEMMs in bf16 (``compute_dtype``; ``None``: the weights' dtype) and returns the input's dtype.
  With an EP group of G ranks each rank keeps the rows of its E/G home experts (new, smaller parameters;
  ``relibra_moe.integrations.hf.full_state_dict`` gathers them back in expert order);
- ``shared_experts`` (DeepSeek-V3) is applied to every token and added, as torchtitan does;
- the buffers ``expert_bias_E`` (persistent) and ``tokens_per_expert_E`` stay on the block under their names;
  in training mode every forward adds the routed ids' per-expert token counts (the replayed ids under
  replay: the routing the step used) to ``tokens_per_expert_E``, which torchtitan's load-balancing hook reads
  and zeroes in its optimizer pre-step (``register_moe_load_balancing_hook``).

The routed output is the gate-weighted sum of the k expert outputs in fp32 (torchtitan also weights in
fp32), cast to the input's dtype.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..layers.dispatch import ep_process_group, get_dispatcher
from ..layers.experts import GroupedExperts, slot_view
from ..layers.moe import ReplayBalancedMoE
from ..layers.replica_buffer import LayerSharedReplicaBuffer
from ..layers.router import check_replay_ids
from ..triton_kernels.grouped_gemm import grouped_mm
from ..triton_kernels.routing import RoutingMeta
from .hf_families import Family
from .hf_layer import _RouterTuple, _subclass

__all__ = ["TorchtitanReplayMoE", "TITAN_FAMILY", "is_titan_moe", "titan_gates", "titan_replica_buffer"]

TITAN_EXPERT_TENSORS = ("w1_EFD", "w3_EFD", "w2_EDF")


def is_titan_moe(module: nn.Module) -> bool:
    """Whether ``module`` is torchtitan's ``MoE`` block (checked by class, without importing torchtitan)."""
    cls = type(module)
    return cls.__name__ == "MoE" and cls.__module__.startswith("torchtitan.")


def titan_gates(router: nn.Module, scores: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """torchtitan's gate values of given ids: ``scores [T, E]`` (after softmax / sigmoid, fp32), ``ids [T, k]``
    (``-1``: none, gate 0) -> ``[T, k]``: ``scores[id]``, renormalized (``+ 1e-20``) when ``route_norm``, times
    ``route_scale``."""
    valid = ids >= 0
    g = scores.gather(1, ids.clamp_min(0)) * valid
    if router.route_norm:
        g = g / (g.sum(dim=-1, keepdim=True) + 1e-20)
    return g * router.route_scale


def _titan_expert(experts: nn.Module, e: int, x: torch.Tensor) -> torch.Tensor:
    """One torchtitan expert in the weights' dtype: ``w2 (silu(w1 x) * w3 x)``, ``x [R, D] -> [R, D]``."""
    return F.linear(F.silu(F.linear(x, experts.w1_EFD[e])) * F.linear(x, experts.w3_EFD[e]), experts.w2_EDF[e])


#: The recorder's view of an unswapped torchtitan block: its router returns ``(topk_scores [B, L, K],
#: topk_expert_ids [B, L, K], scores [B, L, E])``, so the ids are item 1.
TITAN_FAMILY = Family("torchtitan", "MoE", "router", titan_gates, _titan_expert, router_ids_at=1)
#: A swapped block's: its router returns ``(scores, gates, ids)`` like the HF layer's, ids at item 2.
SWAPPED_TITAN_FAMILY = Family("torchtitan", "MoE", "router", titan_gates, _titan_expert)


class _TitanRouterMixin:
    """Adds ``replay_ids`` to torchtitan's router; ``x [T, D]`` in, ``(scores [T, E], gates [T, k], ids [T, k])``
    out (a ``RouterOutput``-like tuple). The block sets ``_expert_bias`` (its ``expert_bias_E``) before a forward."""

    name: str = "moe"

    def forward(self, x: torch.Tensor, replay_ids: torch.Tensor | None = None, **_: Any) -> _RouterTuple:
        bias = self.__dict__.get("_expert_bias")
        topk_scores, topk_ids, scores = super().forward(x.unsqueeze(0), bias)
        scores, gates, ids = scores[0], topk_scores[0], topk_ids[0]
        if replay_ids is not None:
            ids = check_replay_ids(replay_ids.to(scores.device), scores.shape[0], self.top_k, self.num_experts,
                                   self.name)
            gates = titan_gates(self, scores, ids)
        return _RouterTuple((scores, gates, ids.long()))


class _TitanExpertsMixin(GroupedExperts):
    """torchtitan's ``GroupedExperts`` as the layer's experts: ``w1_EFD``, ``w3_EFD``, ``w2_EDF`` (each applied as
    ``x @ W.T``: transposed views, no copy), GEMMs in ``compute_dtype`` as torchtitan computes them."""

    tensor_names = TITAN_EXPERT_TENSORS
    block_m: int | None = None
    #: dtype of the GEMM inputs (torchtitan's GroupedExperts casts rows and weights to bf16); None: the weights'.
    compute_dtype: torch.dtype | None = torch.bfloat16

    @property
    def num_local(self) -> int:
        return int(self.w1_EFD.shape[0])

    def _dtype(self, like: torch.Tensor) -> torch.dtype:
        return self.compute_dtype if self.compute_dtype is not None else like.dtype

    def slot_tensors(self, home: Sequence[torch.Tensor], slots: Sequence[torch.Tensor] | None) -> list:
        dt = self._dtype(home[0])
        home = [h.to(dt) for h in home]
        slots = None if slots is None else [s.to(dt) for s in slots]
        return [slot_view(h, None if slots is None else s, transpose=True)
                for h, s in zip(home, slots or [None] * len(home), strict=True)]

    def mlp(self, xs: torch.Tensor, meta: RoutingMeta, tensors: Sequence) -> torch.Tensor:
        w1, w3, w2 = tensors
        xs = xs.to(self._dtype(self.w1_EFD))
        h = F.silu(grouped_mm(xs, w1, meta)) * grouped_mm(xs, w3, meta)
        return grouped_mm(h, w2, meta)


def titan_replica_buffer(block: nn.Module, slots: int) -> LayerSharedReplicaBuffer:
    """A layer-shared replica buffer of ``slots`` slots for torchtitan experts (members ``w1_EFD [F, D]``,
    ``w3_EFD [F, D]``, ``w2_EDF [D, F]``), in the experts' dtype and device."""
    experts = block.routed_experts.inner_experts
    w1 = experts.w1_EFD
    shapes = {n: tuple(getattr(experts, n).shape[1:]) for n in TITAN_EXPERT_TENSORS}
    return LayerSharedReplicaBuffer(int(w1.shape[2]), int(w1.shape[1]), slots, dtype=w1.dtype, device=w1.device,
                                    shapes=shapes)


class TorchtitanReplayMoE(ReplayBalancedMoE):
    """torchtitan's ``MoE`` block running as a :class:`ReplayBalancedMoE` (see the module docstring).

    Args:
        block: torchtitan's ``MoE`` (its submodules and buffers are adopted, not copied).
        layer_id: decoder layer index (for traces). layer_index: index among the model's MoE layers.
        ep_group, gpus_per_node, replica_buffer, dispatcher: as for ``ReplayBalancedMoE``.

    ``forward(x [B, L, D]) -> [B, L, D]``.
    """

    swapped_moe_block = True  # marks the blocks swap_moe_blocks makes
    family = SWAPPED_TITAN_FAMILY
    experts_path = "routed_experts.inner_experts"  # where full_state_dict finds the expert parameters

    def __init__(self, block: nn.Module, layer_id: int, layer_index: int, *, ep_group: Any = None,
                 gpus_per_node: int | None = None, replica_buffer: LayerSharedReplicaBuffer | None = None,
                 dispatcher: Any = "auto") -> None:
        if not is_titan_moe(block):
            raise ValueError(f"{type(block).__module__}.{type(block).__name__} is not torchtitan's MoE block")
        router, experts = block.router, block.routed_experts.inner_experts
        if getattr(router, "_debug_force_load_balance", False):
            raise ValueError("torchtitan's _debug_force_load_balance routing is not supported by the swapped block")
        E, k = int(router.num_experts), int(router.top_k)
        hidden, ffn = int(experts.w1_EFD.shape[2]), int(experts.w1_EFD.shape[1])
        ep_group = ep_process_group(ep_group)  # a DeviceMesh (1-D, or its "ep" dimension) -> its process group
        if isinstance(dispatcher, str):
            dispatcher = get_dispatcher(ep_group, gpus_per_node, dispatcher)
        G, rank = dispatcher.world_size, dispatcher.rank
        if E % G:
            raise ValueError(f"num_experts={E} is not divisible by the EP group size {G}")
        router.__class__ = _subclass(_TitanRouterMixin, type(router))
        experts.__class__ = _subclass(_TitanExpertsMixin, type(experts))
        if G > 1:  # keep the rows of this rank's home experts (the static placement e // (E/G))
            home = torch.arange(rank * (E // G), (rank + 1) * (E // G), device=experts.w1_EFD.device)
            for pname in TITAN_EXPERT_TENSORS:
                p = getattr(experts, pname)
                setattr(experts, pname, nn.Parameter(p.detach().index_select(0, home).clone(),
                                                     requires_grad=p.requires_grad))
        super().__init__(hidden, ffn, E, k, ep_group=ep_group, gpus_per_node=gpus_per_node,
                         replica_buffer=replica_buffer, router=router, shared_expert=None, layer_index=layer_index,
                         dispatcher=dispatcher, experts=experts, router_attr="router")
        self.layer_id = int(layer_id)
        self.load_balance_coeff = block.load_balance_coeff
        # torchtitan's submodules under their names and in their order; expert_gpu is not torchtitan state
        expert_gpu = self._buffers.pop("expert_gpu")
        self._modules.clear()
        for name, child in block.named_children():
            self._modules[name] = child
        for name, buf in block.named_buffers(recurse=False):
            persistent = name not in block._non_persistent_buffers_set
            self.register_buffer(name, buf, persistent=persistent)
        if "expert_bias_E" not in self._buffers:
            self.expert_bias_E = None
        self.register_buffer("expert_gpu", expert_gpu, persistent=False)
        self.train(block.training)

    @property
    def experts(self) -> nn.Module:
        """torchtitan's ``GroupedExperts`` (``routed_experts.inner_experts``), the layer's experts."""
        mods = self.__dict__["_modules"]
        return mods["routed_experts"].inner_experts if "routed_experts" in mods else mods["experts"]

    @property
    def shared_expert(self) -> None:
        """None: this block adds torchtitan's ``shared_experts`` itself, after the routed experts."""
        return None

    @shared_expert.setter
    def shared_expert(self, value: Any) -> None:
        if value is not None:
            raise ValueError("TorchtitanReplayMoE applies torchtitan's own shared_experts")

    def extra_repr(self) -> str:
        return (f"torchtitan, layer_id={self.layer_id}, E={self.num_experts}, k={self.top_k}, "
                f"rank={self.rank}/{self.world_size}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.router.__dict__["_expert_bias"] = self._buffers.get("expert_bias_E")
        out = super().forward(x)
        ids = self.last_routing
        if self.training:
            with torch.no_grad():
                flat = ids[ids >= 0].reshape(-1)
                self.tokens_per_expert_E.add_(torch.bincount(flat, minlength=self.num_experts).to(
                    self.tokens_per_expert_E.dtype))
        shared = self._modules.get("shared_experts")
        if shared is not None:
            out = out + shared(x)
        return out
