"""Test-only helpers to run megatron-core 0.16 on CPU processes over gloo (no CUDA, no Transformer Engine).

Megatron-core assumes CUDA in a few places that a CPU MoE layer reaches; :func:`apply_cpu_patches`
replaces exactly those, in the test processes only (the library never patches Megatron):

- ``torch.cuda.current_device()`` (router weights moved "to the GPU", buffers allocated there) -> ``"cpu"``;
- ``torch.cuda.Stream`` / ``current_stream`` / ``stream`` / events used by the all-to-all dispatcher's
  device-to-host copies -> no-ops;
- split sizes the all-to-all dispatcher leaves as CPU tensors (it converts only CUDA tensors to lists) ->
  lists before ``all_to_all_single`` (gloo wants lists);
- ``te_general_gemm`` (undefined without Transformer Engine on 0.16) -> ``None``;
- the CUDA RNG state used by the RNG tracker and activation recompute -> the CPU generator's.

Also here: :func:`init_megatron` (model-parallel state on the current gloo world) and :func:`moe_config`
(a tiny fp32 MoE ``TransformerConfig`` with every fusion off).
"""

from __future__ import annotations

import contextlib
import warnings

import torch

# megatron-core warns at import about every missing optional accelerator library (Apex, TE)
warnings.filterwarnings("ignore", message=".*(Apex|Transformer Engine).*")

try:
    import megatron.core  # noqa: F401

    HAVE_MEGATRON = True
    MEGATRON_REASON = ""
except Exception as exc:  # noqa: BLE001 - any import failure means "not installed here"
    HAVE_MEGATRON = False
    MEGATRON_REASON = (f"megatron-core is not installed ({type(exc).__name__}: {exc}); "
                       "pip install 'relibra-moe[megatron]'")

_PATCHED = False


class _NoStream:
    """A stand-in for a CUDA stream or event on CPU: every method is a no-op."""

    def wait_stream(self, other) -> None:
        pass

    def record_event(self, event=None) -> _NoStream:
        return self

    def synchronize(self) -> None:
        pass

    def __eq__(self, other) -> bool:
        return isinstance(other, _NoStream)

    def __hash__(self) -> int:
        return 0


def apply_cpu_patches() -> None:
    """Make the CUDA-only calls of megatron-core's MoE path, attention and recompute work on CPU (idempotent)."""
    global _PATCHED
    if _PATCHED:
        return
    from megatron.core.tensor_parallel import random as mrandom
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.Stream = lambda *a, **k: _NoStream()
    torch.cuda.current_stream = lambda *a, **k: _NoStream()
    torch.cuda.stream = lambda *a, **k: contextlib.nullcontext()
    torch.cuda.synchronize = lambda *a, **k: None
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None

    original_all_to_all = token_dispatcher.all_to_all

    def all_to_all(group, input_, output_split_sizes_=None, input_split_sizes=None):
        def as_list(s):
            return s if s is None or isinstance(s, list) else [int(v) for v in s.tolist()]

        return original_all_to_all(group, input_, as_list(output_split_sizes_), as_list(input_split_sizes))

    token_dispatcher.all_to_all = all_to_all

    # the RNG tracker and CheckpointFunction save/restore "CUDA" states: use the CPU generator's
    mrandom._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
    mrandom._set_cuda_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
    torch.cuda.get_rng_state = lambda *a, **k: torch.get_rng_state()
    torch.cuda.set_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
    torch.cuda.manual_seed = lambda seed: None
    _PATCHED = True


def init_megatron(expert_parallel: int, seed: int = 0) -> None:
    """Model-parallel state on the current (gloo) world: TP = PP = 1, EP = ``expert_parallel``."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import random as mrandom

    apply_cpu_patches()
    parallel_state.initialize_model_parallel(expert_model_parallel_size=expert_parallel)
    mrandom.model_parallel_cuda_manual_seed(seed)
    torch.manual_seed(seed)


def destroy_megatron() -> None:
    """Tear down the model-parallel state and forget every RouterReplay instance."""
    from megatron.core import parallel_state
    from megatron.core.transformer.moe.router_replay import RouterReplay

    RouterReplay.clear_global_router_replay_instances()
    parallel_state.destroy_model_parallel()


def moe_config(num_experts: int = 8, top_k: int = 2, hidden: int = 32, ffn: int = 16, *, num_layers: int = 1,
               shared: int | None = None, **overrides):
    """A tiny fp32 MoE ``TransformerConfig`` for CPU: SwiGLU experts, softmax top-k, alltoall dispatcher,
    aux loss on, routing replay enabled, fusions off."""
    from megatron.core.transformer import TransformerConfig

    kw = dict(num_layers=num_layers, hidden_size=hidden, num_attention_heads=2, ffn_hidden_size=ffn,
              moe_ffn_hidden_size=ffn, num_moe_experts=num_experts, moe_router_topk=top_k,
              moe_token_dispatcher_type="alltoall", moe_router_load_balancing_type="aux_loss",
              moe_aux_loss_coeff=1e-2, gated_linear_unit=True, activation_func=torch.nn.functional.silu,
              add_bias_linear=False, bias_activation_fusion=False, moe_permute_fusion=False,
              moe_router_fusion=False, moe_grouped_gemm=False, use_cpu_initialization=True,
              params_dtype=torch.float32, bf16=False, fp16=False, moe_enable_routing_replay=True,
              expert_model_parallel_size=torch.distributed.get_world_size(), hidden_dropout=0.0,
              attention_dropout=0.0, moe_shared_expert_intermediate_size=shared, masked_softmax_fusion=False,
              bias_dropout_fusion=False, apply_rope_fusion=False, gradient_accumulation_fusion=False,
              persist_layer_norm=False)
    kw.update(overrides)
    return TransformerConfig(**kw)


def moe_layer(config, layer_number: int = 1):
    """Megatron's own ``MoELayer`` (``TopKRouter``, ``SequentialMLP`` experts, local spec) for ``config``."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.spec_utils import build_module

    spec = get_gpt_layer_local_spec(num_experts=config.num_moe_experts, moe_grouped_gemm=False)
    return build_module(spec.submodules.mlp, config=config, layer_number=layer_number)


def fp32_optimizer(optimizer: torch.optim.Optimizer):
    """Megatron's ``FP32Optimizer`` around ``optimizer`` (Adam), on CPU: its constructor's only CUDA use, the
    constant loss-scale tensor, is made on the CPU; everything else (``sharded_state_dict``,
    ``load_state_dict``, ``step``) is Megatron's own."""
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.optimizer.optimizer import FP32Optimizer, MegatronOptimizer

    def init_state_fn(opt, config=None):  # Megatron's Adam state initializer (get_megatron_optimizer's)
        for group in opt.param_groups:
            for p in group["params"]:
                if len(opt.state[p]) == 0:
                    opt.state[p]["exp_avg"] = torch.zeros_like(p.data)
                    opt.state[p]["exp_avg_sq"] = torch.zeros_like(p.data)

    out = FP32Optimizer.__new__(FP32Optimizer)
    MegatronOptimizer.__init__(out, optimizer, OptimizerConfig(optimizer="adam", lr=0.0, bf16=False, fp16=False),
                               init_state_fn)
    out._scale = torch.tensor([1.0])
    out.is_stub_optimizer = False
    return out
