"""``experts_implementation="relibra"``: relibra's grouped Triton expert kernels inside unmodified HF models.

transformers 5.x picks the forward of every fused experts module (the classes decorated with
``@use_experts_implementation``) by name, from ``transformers.integrations.moe.ExpertsInterface``.
Importing this module registers ``"relibra"`` there, so one argument selects our kernels, with no
module swap and no expert parallelism (one GPU, inference, kernel benchmarks)::

    import relibra_moe.integrations.hf_experts  # noqa: F401  (registers "relibra")
    model = AutoModelForCausalLM.from_pretrained(path, experts_implementation="relibra")
    # or, on a loaded model: model.set_experts_implementation("relibra")

The forward sorts the ``(token, k)`` pairs by expert (:func:`~relibra_moe.triton_kernels.routing.routing_metadata`),
gathers the rows (:func:`~relibra_moe.triton_kernels.permute.permute`), runs the expert MLP as grouped
GEMMs over HF's own fused weights (transposed views, no copy) and sums each token's k outputs weighted
by the router's ``top_k_weights`` in fp32 (:func:`~relibra_moe.triton_kernels.permute.combine`). Layouts:

- concatenated gate/up (Qwen3-MoE, Qwen2-MoE, Mixtral, OLMoE, DeepSeek-V3, Qwen3-Next):
  ``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]`` applied as ``x @ W.T``; the activation is the
  module's ``_apply_gate`` (SiLU-gated: our closed-form SwiGLU backward);
- transposed, interleaved, biased (GPT-OSS): ``gate_up_proj [E, H, 2I]``, ``gate_up_proj_bias [E, 2I]``,
  ``down_proj [E, I, H]``, ``down_proj_bias [E, H]``; the activation is GPT-OSS's own ``_apply_gate``.

Pairs whose id is HF's expert-parallel sentinel (``>= num_experts`` when the module runs under HF's own
EP) are served by no expert. Rows are cast to the weights' dtype; the output has the input's dtype.
Experts without a gate (``has_gate=False``) or with a post-expert norm raise ``ValueError``.
"""

from __future__ import annotations

import torch
from torch import nn

from ..triton_kernels.grouped_gemm import swiglu, swiglu_experts
from ..triton_kernels.permute import combine, permute
from ..triton_kernels.routing import routing_metadata
from .upstream_hf import gate_activation, hf_expert_parallel

__all__ = ["NAME", "register", "relibra_experts_forward"]

#: The name registered in ``transformers.integrations.moe.ExpertsInterface``.
NAME = "relibra"

BLOCK_M = 64  # rows per grouped-GEMM tile


def _activation(experts: nn.Module):
    """The module's gate activation ``[R, 2I] -> [R, I]``: our closed-form SwiGLU when it is HF's default
    ``act_fn(gate) * up`` with SiLU, else the module's own ``_apply_gate``."""
    from transformers.activations import SiLUActivation

    act = getattr(experts, "act_fn", None)
    apply_gate, default = gate_activation(experts)
    return swiglu if default and isinstance(act, (nn.SiLU, SiLUActivation)) else apply_gate


def relibra_experts_forward(self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                            top_k_weights: torch.Tensor) -> torch.Tensor:
    """The experts forward HF calls: ``hidden_states [T, H]``, ``top_k_index [T, k]`` expert ids,
    ``top_k_weights [T, k]`` -> ``[T, H]`` (``sum_j w[t, j] * expert_{id[t, j]}(x[t])``)."""
    name = type(self).__name__
    if not getattr(self, "has_gate", True):
        raise ValueError(f"experts_implementation={NAME!r}: {name} has has_gate=False (no gate/up projection); "
                         "supported: gated experts")
    if getattr(self, "has_post_expert_norm", False):
        raise ValueError(f"experts_implementation={NAME!r}: {name} has has_post_expert_norm=True; not supported")
    E = int(self.num_experts)
    ids = top_k_index
    if hf_expert_parallel(self):  # HF's EP marks pairs of other ranks' experts with ids >= E
        ids = torch.where(ids < E, ids, torch.full_like(ids, -1))
    w1, w2 = self.gate_up_proj, self.down_proj
    if not getattr(self, "is_transposed", False):  # stored [E, N, K], applied as x @ W.T: transposed views
        w1, w2 = w1.transpose(1, 2), w2.transpose(1, 2)
    meta = routing_metadata(ids, E, block_m=BLOCK_M)
    xs = permute(hidden_states.to(w1.dtype), meta)
    act = _activation(self)
    if getattr(self, "has_bias", False):
        from ..layers.experts import biased_gated_mlp

        ys = biased_gated_mlp(xs, meta, w1, self.gate_up_proj_bias, w2, self.down_proj_bias, act)
    else:
        ys = swiglu_experts(xs, meta, w1, w2, act)
    return combine(ys, meta, top_k_weights).to(hidden_states.dtype)


def register() -> None:
    """Register :func:`relibra_experts_forward` as ``"relibra"`` in transformers' ``ExpertsInterface``
    (idempotent; done when this module is imported)."""
    from transformers.integrations.moe import ExpertsInterface

    ExpertsInterface.register(NAME, relibra_experts_forward)


register()
