"""Tiny random Hugging Face MoE models of every supported family, for tests and examples.

Nothing is downloaded: each model is built from a config with a handful of layers, a small hidden
size and few experts, initialized from a seed, in float32 on the CPU. Construction takes well under a
second per model.

Families and what each tiny config exercises:

============ ====================================================================================
family       specifics
============ ====================================================================================
qwen3_moe    softmax top-k with renormalization; one dense layer (``mlp_only_layers``)
qwen2_moe    softmax top-k without renormalization; shared expert with a sigmoid gate
mixtral      softmax top-k, always renormalized, float32 gate values
olmoe        softmax top-k without renormalization
deepseek_v3  sigmoid scores, correction bias, group-limited top-k, routed scaling, shared experts,
             a first dense layer
gpt_oss      router with bias, softmax over the top-k logits, transposed interleaved experts with
             biases and a clamped SwiGLU; returns ``(hidden, router_scores)``
qwen3_next   hybrid linear / full attention; shared expert with a sigmoid gate
============ ====================================================================================
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel

FAMILIES: tuple[str, ...] = ("qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "deepseek_v3", "gpt_oss", "qwen3_next")

_COMMON: dict[str, Any] = dict(vocab_size=97, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                               max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                               tie_word_embeddings=False)


def tiny_config(family: str, *, num_layers: int = 3, num_experts: int = 8, top_k: int = 2,
                **overrides: Any) -> PretrainedConfig:
    """A ``transformers`` config of ``family`` with hidden 32, expert FFN 16 and ``num_layers`` layers.

    ``overrides`` are passed to the config constructor last (e.g. ``router_aux_loss_coef=0.1``).
    """
    import transformers as tr

    c = dict(_COMMON, num_hidden_layers=num_layers, num_experts_per_tok=top_k)
    if family == "qwen3_moe":
        cfg = dict(c, intermediate_size=48, moe_intermediate_size=16, num_experts=num_experts, norm_topk_prob=True,
                   mlp_only_layers=[1] if num_layers > 2 else [], head_dim=8)
        cls = tr.Qwen3MoeConfig
    elif family == "qwen2_moe":
        cfg = dict(c, intermediate_size=48, moe_intermediate_size=16, shared_expert_intermediate_size=24,
                   num_experts=num_experts, norm_topk_prob=False)
        cls = tr.Qwen2MoeConfig
    elif family == "mixtral":
        cfg = dict(c, intermediate_size=16, num_local_experts=num_experts, head_dim=8)
        cls = tr.MixtralConfig
    elif family == "olmoe":
        cfg = dict(c, intermediate_size=16, num_experts=num_experts, norm_topk_prob=False)
        cls = tr.OlmoeConfig
    elif family == "deepseek_v3":
        cfg = dict(c, intermediate_size=48, moe_intermediate_size=16, n_routed_experts=num_experts,
                   n_shared_experts=1, n_group=2, topk_group=1, routed_scaling_factor=2.5, norm_topk_prob=True,
                   first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=4,
                   qk_nope_head_dim=8, v_head_dim=8, num_key_value_heads=4)
        cls = tr.DeepseekV3Config
    elif family == "gpt_oss":
        cfg = dict(c, intermediate_size=16, num_local_experts=num_experts, head_dim=8, sliding_window=8,
                   rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                   layer_types=[("sliding_attention" if i % 2 == 0 else "full_attention")
                                for i in range(num_layers)])
        cls = tr.GptOssConfig
    elif family == "qwen3_next":
        cfg = dict(c, intermediate_size=48, moe_intermediate_size=16, shared_expert_intermediate_size=24,
                   num_experts=num_experts, norm_topk_prob=True, head_dim=8, linear_conv_kernel_dim=2,
                   linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4,
                   layer_types=[("linear_attention" if i % 2 == 0 else "full_attention") for i in range(num_layers)])
        cls = tr.Qwen3NextConfig
    else:
        raise ValueError(f"family {family!r} is not one of {FAMILIES}")
    cfg.update(overrides)
    return cls(**cfg)


def tiny_model(family: str, *, seed: int = 0, num_layers: int = 3, num_experts: int = 8, top_k: int = 2,
               **overrides: Any) -> PreTrainedModel:
    """A float32 ``*ForCausalLM`` of ``family`` with random weights drawn from ``seed``, in eval mode.

    Zero-initialized router parts (DeepSeek-V3's correction bias, GPT-OSS's expert biases) are filled with
    random values too, so every term of the routing and expert math is exercised.
    """
    import torch
    import transformers as tr

    cfg = tiny_config(family, num_layers=num_layers, num_experts=num_experts, top_k=top_k, **overrides)
    torch.manual_seed(seed)
    model = tr.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("gate_up_proj_bias", "down_proj_bias")) or name.endswith("router.bias"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
            elif name.endswith("mlp.gate.weight") or name.endswith("mlp.router.weight"):
                # larger router weights: well separated top-k choices and non-uniform routing
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape, generator=g) * 0.1)
    model.generation_config.pad_token_id = cfg.pad_token_id
    return model.eval()
