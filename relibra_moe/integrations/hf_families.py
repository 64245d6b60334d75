"""What differs between the Hugging Face MoE families (transformers 5.x), in one table.

Facts checked against transformers 5.24 (``models/*/modeling_*.py``):

- Every MoE block is ``model.model.layers[i].mlp``; its router is a module (``mlp.gate``, or
  ``mlp.router`` for GPT-OSS) whose ``forward(hidden [T, H])`` returns
  ``(router_logits [T, E], top_k_weights [T, k], top_k_index [T, k])``.
- ``output_router_logits`` / the aux loss are collected by forward hooks that ``capture_outputs``
  installs lazily on every module that ``isinstance``-matches the family's router class
  (``OutputRecorder(<Router>, index=0)``); so a replacement block keeps HF's router *instance*.
- Experts are fused 3-D parameters: ``gate_up_proj [E, 2I, H]`` (gate rows first, then up) and
  ``down_proj [E, H, I]``, applied as ``x @ W.T``. GPT-OSS differs: ``gate_up_proj [E, H, 2I]`` applied
  as ``x @ W`` with interleaved columns (gate = even, up = odd), ``gate_up_proj_bias [E, 2I]``,
  ``down_proj [E, I, H]`` + ``down_proj_bias [E, H]``, and the activation
  ``(clamp(up, -l, l) + 1) * g * sigmoid(alpha * g)`` with ``g = clamp(gate, max=l)``.
- Gates: softmax families take the top-k of ``softmax(logits)`` (renormalized when
  ``norm_topk_prob``; Mixtral always, and keeps them in fp32); DeepSeek-V3 takes ``sigmoid(logits)``
  (fp32 router), selects with ``+ e_score_correction_bias`` among the best ``topk_group`` of ``n_group``
  groups, renormalizes (``+1e-20``) and multiplies by ``routed_scaling_factor``; GPT-OSS takes the top-k
  of the *logits* (router with bias) and softmaxes over those k values.
- Shared experts: Qwen2-MoE / Qwen3-Next add ``sigmoid(shared_expert_gate(x)) * shared_expert(x)``;
  DeepSeek-V3 adds ``shared_experts(x)``. GPT-OSS's block returns ``(hidden, router_scores)``.
- ``generate()`` returns no router logits, so routing is recorded by hooks.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


def _softmax_gates(renorm: Callable[[nn.Module], bool], keep_fp32: bool):
    def gates(router: nn.Module, logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        probs = torch.softmax(logits.float(), dim=-1)
        valid = ids >= 0
        g = probs.gather(1, ids.clamp_min(0)) * valid
        if renorm(router):
            denom = g.sum(dim=-1, keepdim=True)
            g = g / torch.where(denom > 0, denom, torch.ones_like(denom))
        return g if keep_fp32 else g.to(logits.dtype)

    return gates


def _deepseek_gates(router: nn.Module, logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    scores = logits.float().sigmoid()
    valid = ids >= 0
    g = scores.gather(1, ids.clamp_min(0)) * valid
    if router.norm_topk_prob:
        g = g / (g.sum(dim=-1, keepdim=True) + 1e-20)
    return g * router.routed_scaling_factor


def _gpt_oss_gates(router: nn.Module, logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    valid = ids >= 0
    top = logits.gather(1, ids.clamp_min(0)).masked_fill(~valid, float("-inf"))
    g = torch.softmax(top, dim=1, dtype=top.dtype)
    return torch.where(valid, g, torch.zeros_like(g))  # a fully padded row would be nan


def swiglu_expert(experts: nn.Module, e: int, x: torch.Tensor) -> torch.Tensor:
    """One concatenated-layout expert: ``down[e] @ (act(gate) * up)``, ``x [R, H] -> [R, H]``."""
    gate, up = F.linear(x, experts.gate_up_proj[e]).chunk(2, dim=-1)
    return F.linear(experts.act_fn(gate) * up, experts.down_proj[e])


def gpt_oss_expert(experts: nn.Module, e: int, x: torch.Tensor) -> torch.Tensor:
    """One GPT-OSS expert (transposed, interleaved, biased, clamped SwiGLU), ``x [R, H] -> [R, H]``."""
    gate_up = x @ experts.gate_up_proj[e] + experts.gate_up_proj_bias[e]
    gate, up = gate_up[..., ::2], gate_up[..., 1::2]
    gate = gate.clamp(min=None, max=experts.limit)
    up = up.clamp(min=-experts.limit, max=experts.limit)
    glu = gate * torch.sigmoid(gate * experts.alpha)
    return ((up + 1) * glu) @ experts.down_proj[e] + experts.down_proj_bias[e]


@dataclass(frozen=True)
class Family:
    """How one HF MoE block family is laid out and computes.

    Attributes:
        name: family key (``qwen3_moe``, ...).
        block: class name of the HF MoE block.
        router_attr: attribute of the block holding the router module.
        gates: ``(router, logits [T, E], ids [T, k]) -> gates [T, k]``: the HF gate values of given ids
            from live logits (``-1`` ids get 0); used for replay.
        expert: ``(experts, e, x [R, H]) -> [R, H]``: expert ``e`` applied to its tokens.
        shared: attribute names of the always-on shared expert and its sigmoid gate (``None`` if absent).
        router_input_3d: the block passes the unflattened ``[B, S, H]`` hidden states to the router.
        returns_scores: the block returns ``(hidden, router_scores)`` (GPT-OSS).
        jitter: the block multiplies its input by uniform jitter noise in training (Mixtral).
        router_ids_at: index of the top-k ids in the router's output tuple (what the recorder reads).
        router_fp32: the router computes its logits in fp32 whatever the model's dtype (DeepSeek-V3; read by
            :func:`~relibra_moe.integrations.upstream_hf.router_logits`).
    """

    name: str
    block: str
    router_attr: str
    gates: Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]
    expert: Callable[[nn.Module, int, torch.Tensor], torch.Tensor]
    shared: tuple[str, str | None] | None = None
    router_input_3d: bool = False
    returns_scores: bool = False
    jitter: bool = False
    router_ids_at: int = 2
    router_fp32: bool = False


_NORM = lambda r: bool(r.norm_topk_prob)

FAMILIES: dict[str, Family] = {f.block: f for f in (
    Family("qwen3_moe", "Qwen3MoeSparseMoeBlock", "gate", _softmax_gates(_NORM, False), swiglu_expert),
    Family("qwen2_moe", "Qwen2MoeSparseMoeBlock", "gate", _softmax_gates(_NORM, False), swiglu_expert,
           shared=("shared_expert", "shared_expert_gate")),
    Family("mixtral", "MixtralSparseMoeBlock", "gate", _softmax_gates(lambda r: True, True), swiglu_expert,
           jitter=True),
    Family("olmoe", "OlmoeSparseMoeBlock", "gate", _softmax_gates(_NORM, False), swiglu_expert),
    Family("deepseek_v3", "DeepseekV3MoE", "gate", _deepseek_gates, swiglu_expert,
           shared=("shared_experts", None), router_input_3d=True, router_fp32=True),
    Family("gpt_oss", "GptOssMLP", "router", _gpt_oss_gates, gpt_oss_expert, returns_scores=True),
    Family("qwen3_next", "Qwen3NextSparseMoeBlock", "gate", _softmax_gates(_NORM, False), swiglu_expert,
           shared=("shared_expert", "shared_expert_gate")),
)}

SUPPORTED_BLOCKS: tuple[str, ...] = tuple(FAMILIES)


def family_of(module: nn.Module) -> Family | None:
    """The family of an HF MoE block (by class name), or ``None`` when ``module`` is not one."""
    return FAMILIES.get(type(module).__name__)
