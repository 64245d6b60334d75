"""HF MoE blocks as :class:`~relibra_moe.layers.moe.ReplayBalancedMoE` layers (expert parallelism, plans).

:class:`HFReplayMoE` is a ``ReplayBalancedMoE`` whose submodules are the HF block's own, under
the HF names, so ``state_dict()`` keys and values are the HF block's (on one rank; with an EP group of
G ranks each rank holds the rows of its E/G home experts under the same names):

- the router is HF's router *instance* with a mixin (:func:`~relibra_moe.integrations.upstream_hf.replay_router`:
  parameters, buffers and the ``output_router_logits`` hooks stay; ``isinstance`` still holds). Its
  ``forward(x, replay_ids=None)`` returns HF's ``(logits, gates, ids)`` tuple (what the aux-loss hooks
  record) that also reads as the layer's ``RouterOutput`` (``.logits``, ``.gates``, ``.ids``); with
  replayed ids the gates are recomputed from the live logits with the family's gate function (rows of
  ``LIVE``, tokens the rollout never routed, take HF's live top-k first);
- the experts are HF's fused parameters (``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``), again
  the same instance with a mixin that makes it a :class:`~relibra_moe.layers.experts.GroupedExperts`
  whose per-expert tensors are those parameters (expert dim first, so relayout moves rows of them and
  of their grads and optimizer state; also readable as ``w_gate_up`` / ``w_down``) and computes the
  grouped SwiGLU on transposed views (no copy);
- GPT-OSS experts carry four per-expert tensors, ``gate_up_proj [E, H, 2I]`` (interleaved gate/up),
  ``gate_up_proj_bias [E, 2I]``, ``down_proj [E, I, H]``, ``down_proj_bias [E, H]``, computed as
  HF does (biases added per row by its slot, clamped activation with HF's ``alpha`` / ``limit``); the
  replica buffer, relayout and the replica gradient add-back carry all four;
- shared experts (and Qwen's sigmoid shared-expert gate) are applied by this block, as HF does.

The replica buffer is :class:`HFReplicaBuffer`: the layer-shared buffer with slots in HF's layout
(:func:`hf_replica_buffer` sizes one for a family's block).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from ..layers.dispatch import get_dispatcher
from ..layers.experts import GroupedExperts, biased_gated_mlp, gpt_oss_activation, slot_view
from ..layers.moe import padded_counts
from ..layers.replica_buffer import LayerSharedReplicaBuffer
from ..layers.router import check_replay_ids, merge_live
from ..triton_kernels.grouped_gemm import swiglu_experts
from ..triton_kernels.routing import RoutingMeta
from .adopted import AdoptedBlockMoE, RouterTuple, deprecated_names, keep_home_rows
from .hf_families import Family, family_of
from .upstream_hf import as_grouped_experts, replay_router, router_logits

__all__ = ["HFReplayMoE", "HFReplicaBuffer", "LAYER_FAMILIES", "hf_replica_buffer"]

LAYER_FAMILIES = ("qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "deepseek_v3", "gpt_oss", "qwen3_next")


class _ReplayRouterMixin:
    """Adds ``replay_ids`` to an HF router's forward (see the module docstring)."""

    _family: Family
    name: str = "moe"
    last_gates: torch.Tensor | None = None  # GPT-OSS: the gates of the last forward, which its block returns

    def forward(self, hidden_states: torch.Tensor, replay_ids: torch.Tensor | None = None) -> RouterTuple:
        if replay_ids is None:
            logits, gates, ids = super().forward(hidden_states)
        else:  # the logits alone (HF's first op): the replayed ids need no top-k, and the gates come from them
            logits = router_logits(self, hidden_states, self._family.router_fp32)
            ids = check_replay_ids(replay_ids.to(logits.device), logits.shape[0], self.top_k, self.num_experts,
                                   self.name, allow_live=True)
            # tokens the rollout never routed: HF's own top-k (its whole forward runs only when such a row exists)
            ids = merge_live(ids, lambda: super(_ReplayRouterMixin, self).forward(hidden_states)[2])
            gates = self._family.gates(self, logits, ids)
        if self._family.returns_scores:  # the block returns them (GPT-OSS); it clears them after its forward
            self.__dict__["last_gates"] = gates  # a plain attribute: no nn.Module.__setattr__ checks per forward
        return RouterTuple((logits, gates, ids.long()))


class _HFExpertsMixin(GroupedExperts):
    """HF fused experts seen as the layer's ``GroupedSwiGLUExperts`` (HF layout, no copy)."""

    tensor_names = ("gate_up_proj", "down_proj")
    block_m: int | None = None  # None: the grouped GEMM's row tile (triton_kernels.heuristics)

    @property
    def w_gate_up(self) -> nn.Parameter:  # [E_loc, 2I, H]
        return self.gate_up_proj

    @property
    def w_down(self) -> nn.Parameter:  # [E_loc, H, I]
        return self.down_proj

    @staticmethod
    def dims(experts: nn.Module) -> tuple[int, int]:
        """``(hidden, ffn)`` of HF fused experts (``gate_up_proj [E, 2I, H]``)."""
        return int(experts.gate_up_proj.shape[2]), int(experts.gate_up_proj.shape[1]) // 2

    def slot_tensors(self, home: Sequence[torch.Tensor], slots: Sequence[torch.Tensor] | None) -> list:
        # HF stores [E, N, K] matrices applied as x @ W.T: transposed views, no copy
        return [slot_view(h, None if slots is None else s, transpose=True)
                for h, s in zip(home, slots or [None] * len(home))]

    def mlp(self, xs: torch.Tensor, meta: RoutingMeta, tensors: Sequence) -> torch.Tensor:
        act = self.act_fn

        def activation(h: torch.Tensor) -> torch.Tensor:
            gate, up = h.chunk(2, dim=-1)
            return act(gate) * up

        return swiglu_experts(xs, meta, tensors[0], tensors[1], activation)

    def gated_form(self):
        # the activation reads act_fn when called: the layer caches the form (moe.ReplayBalancedMoE._reference_form)
        return self.gate_up_proj.transpose(1, 2), self.down_proj.transpose(1, 2), self._gated_activation

    def _gated_activation(self, h: torch.Tensor) -> torch.Tensor:
        """HF's ``act_fn(gate) * up`` of ``h [R, 2I]`` (gate columns first) -> ``[R, I]``."""
        half = h.shape[-1] // 2
        return self.act_fn(h[..., :half]) * h[..., half:]

    def compute(self, x: torch.Tensor, slot_ids: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor,
                slots: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        """Expert MLP of rows ``x [R, H]`` at local slots ``slot_ids [R]``; HF-layout weights
        ``w_gate_up [E_loc, 2I, H]``, ``w_down [E_loc, H, I]`` and replica ``slots`` of the same layout."""
        return self.compute_tensors(x, slot_ids, (w_gate_up, w_down), slots)


class _HFGptOssExpertsMixin(GroupedExperts):
    """HF ``GptOssExperts`` as the layer's experts: four per-expert tensors in HF's layout
    (``gate_up_proj [E, H, 2I]`` applied as ``x @ W`` with interleaved gate/up columns,
    ``gate_up_proj_bias [E, 2I]``, ``down_proj [E, I, H]``, ``down_proj_bias [E, H]``) and HF's clamped
    activation with its ``alpha`` and ``limit``."""

    tensor_names = ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")
    block_m: int | None = None  # None: the grouped GEMM's row tile (triton_kernels.heuristics)

    @staticmethod
    def dims(experts: nn.Module) -> tuple[int, int]:
        """``(hidden, ffn)`` of GPT-OSS experts (``gate_up_proj [E, H, 2I]``)."""
        return int(experts.gate_up_proj.shape[1]), int(experts.gate_up_proj.shape[2]) // 2

    def mlp(self, xs: torch.Tensor, meta: RoutingMeta, tensors: Sequence) -> torch.Tensor:
        w1, b1, w2, b2 = tensors
        return biased_gated_mlp(xs, meta, w1, b1, w2, b2, gpt_oss_activation(float(self.alpha), float(self.limit)))


def _experts_mixin(fam: Family) -> type:
    return _HFGptOssExpertsMixin if fam.name == "gpt_oss" else _HFExpertsMixin


class HFReplicaBuffer(LayerSharedReplicaBuffer):
    """The layer-shared replica buffer with slots in HF's fused layout.

    Attributes:
        w_gate_up: ``[r, 2F, H]`` (gate rows first, then up). w_down: ``[r, H, F]`` (the default
        members; ``shapes`` gives other sets, e.g. GPT-OSS's four tensors, see :func:`hf_replica_buffer`).
    """

    def __init__(self, hidden: int, ffn: int, slots: int, *, dtype: torch.dtype = torch.float32,
                 device: torch.device | str | None = None,
                 shapes: dict[str, tuple[int, ...]] | None = None) -> None:
        if shapes is None:
            shapes = {"w_gate_up": (2 * ffn, hidden), "w_down": (hidden, ffn)}
        super().__init__(hidden, ffn, slots, dtype=dtype, device=device, shapes=shapes)


def hf_replica_buffer(block: nn.Module, slots: int) -> HFReplicaBuffer:
    """An :class:`HFReplicaBuffer` of ``slots`` slots for the experts of the HF MoE ``block`` (any layer
    family; GPT-OSS: its four per-expert tensors), in the experts' dtype and device."""
    fam = family_of(block)
    if fam is None or fam.name not in LAYER_FAMILIES:
        raise ValueError(f"{type(block).__name__} is not a layer family block; supported: {', '.join(LAYER_FAMILIES)}")
    experts = block.experts
    mixin = _experts_mixin(fam)
    hidden, ffn = mixin.dims(experts)
    w = experts.gate_up_proj
    shapes = None
    if mixin is _HFGptOssExpertsMixin:
        shapes = {n: tuple(getattr(experts, n).shape[1:]) for n in mixin.tensor_names}
    return HFReplicaBuffer(hidden, ffn, slots, dtype=w.dtype, device=w.device, shapes=shapes)


class HFReplayMoE(AdoptedBlockMoE):
    """An HF MoE block running as a :class:`~relibra_moe.layers.moe.ReplayBalancedMoE` (see the module docstring).

    Args:
        block: the HF block (its submodules are adopted, not copied).
        layer_id: decoder layer index (for traces).
        layer_index: index among the model's MoE layers (the plan's ``l``).
        ep_group, gpus_per_node: as for ``ReplayBalancedMoE``; with G ranks, rank j keeps the rows of
            experts ``j*E/G .. (j+1)*E/G - 1`` (the static placement) and drops the rest.
        replica_buffer: the model's :class:`HFReplicaBuffer` (or ``None`` without replica slots).

    ``forward(hidden [B, S, H]) -> [B, S, H]``; routed experts through the layer, then the shared
    experts as HF adds them. GPT-OSS blocks return ``(hidden, router_scores [T, k])`` as HF's does.
    """

    framework = "HF"

    def __init__(self, block: nn.Module, layer_id: int, layer_index: int, *, ep_group: Any = None,
                 gpus_per_node: int | None = None, replica_buffer: HFReplicaBuffer | None = None,
                 dispatcher: Any = "auto") -> None:
        fam = family_of(block)
        if fam is None or fam.name not in LAYER_FAMILIES:
            raise ValueError(f"{type(block).__name__} cannot run as a ReplayBalancedMoE; supported families: "
                             f"{', '.join(LAYER_FAMILIES)}")
        router = getattr(block, fam.router_attr)
        experts = block.experts
        mixin = _experts_mixin(fam)
        hidden, ffn = mixin.dims(experts)
        E, k = int(router.num_experts), int(router.top_k)
        if isinstance(dispatcher, str):
            dispatcher = get_dispatcher(ep_group, gpus_per_node, dispatcher)
        G, rank = dispatcher.world_size, dispatcher.rank
        if E % G:
            raise ValueError(f"num_experts={E} is not divisible by the EP group size {G}")
        replay_router(router, _ReplayRouterMixin, fam)
        as_grouped_experts(experts, mixin)
        keep_home_rows(experts, experts.tensor_names, rank, E, G)
        super().__init__(hidden, ffn, E, k, ep_group=ep_group, gpus_per_node=gpus_per_node,
                         replica_buffer=replica_buffer, router=router, shared_expert=None, layer_index=layer_index,
                         dispatcher=dispatcher, experts=experts, router_attr=fam.router_attr)
        self.family = fam
        self.layer_id = int(layer_id)
        self.hf_class = type(block).__name__
        if fam.jitter:
            self.jitter_noise = float(getattr(block, "jitter_noise", 0.0))
        self.adopt(block)
        self._in_layer_forward = False

    @property
    def last_expert_counts(self) -> torch.Tensor | None:
        """int64 ``[E]`` on the layer's device: the routed (token, k) pairs per expert of the last forward (``-1``
        ids not counted); ``None`` before the first forward. Counted from ``last_routing`` when first read after a
        forward (device ops, no host sync), so the forward itself spends nothing on it."""
        ids = self.__dict__.get("last_routing")
        if ids is None:
            return None
        cache = self.__dict__.get("_counts_cache")
        if cache is None or cache[0] is not ids or cache[1] != ids._version:
            cache = (ids, ids._version, padded_counts(ids, self.num_experts))  # -1: unrouted pairs, not counted
            self.__dict__["_counts_cache"] = cache
        return cache[2]

    @AdoptedBlockMoE.shared_expert.getter
    def shared_expert(self) -> nn.Module | None:
        """HF's shared expert (Qwen families) outside the layer's forward; ``None`` while the inherited
        forward runs, since this block applies shared experts itself (gated, HF style)."""
        if getattr(self, "_in_layer_forward", True):
            return None
        return self._modules.get("shared_expert")

    def repr_head(self) -> str:
        return f"family={self.family.name}"

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        fam = self.family
        if fam.jitter and self.training and self.jitter_noise > 0:
            hidden_states = hidden_states * torch.empty_like(hidden_states).uniform_(
                1.0 - self.jitter_noise, 1.0 + self.jitter_noise)
        state = self.__dict__  # plain attributes, set without nn.Module.__setattr__'s checks (every forward)
        state["_in_layer_forward"] = True
        try:
            out = super().forward(hidden_states)
        finally:
            state["_in_layer_forward"] = False
            scores = self.router.__dict__.pop("last_gates", None)  # the class default (None) reads again
        if fam.shared is not None:
            x = hidden_states.reshape(-1, hidden_states.shape[-1])
            shared_name, gate_name = fam.shared
            sh = self._modules[shared_name](x)
            if gate_name is not None:
                sh = torch.sigmoid(self._modules[gate_name](x)) * sh
            out = out + sh.reshape(out.shape)
        return (out, scores) if fam.returns_scores else out


#: Deprecated names (the swapped blocks are named ``<Framework>ReplayMoE``): still importable, with a warning.
DEPRECATED_NAMES = {"HFReplayBalancedMoE": "HFReplayMoE"}
__getattr__ = deprecated_names(__name__, DEPRECATED_NAMES, globals())
