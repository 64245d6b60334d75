"""Every place the Megatron-core integration relies on megatron-core beyond its public doors, in one adapter.

Written against megatron-core 0.16 (:data:`TESTED`); ``tests/integrations/test_upstream_megatron.py`` asserts the
installed version is in that range and checks the reach below against a real ``MoELayer``, so a release that
changes it fails a test named for it.

Megatron's door for a different MoE layer is spec-based construction (``ModuleSpec(module=MoELayer,
submodules=MoESubmodules(...))`` built by ``build_module``): :func:`relibra_moe.integrations.megatron.replay_layer_spec`
uses it (``MegatronReplayMoE`` built by Megatron, with the plain spec's weights). RL frameworks (verl, slime,
NeMo-RL) build the model from Megatron's own specs and load the checkpoint into it, so relibra also swaps the
*built* layers (:func:`relibra_moe.integrations.megatron.swap_moe_layers`), keeping their router, shared experts
and loaded expert weights. Either way ``MegatronReplayMoE`` is a ``MoELayer`` (``TransformerLayer`` and Megatron's
MoE utilities treat it as one) that adopts a built ``MoELayer`` instead of running ``MoELayer.__init__`` on
itself, which would build what the built layer already has:

- :func:`adopt_layer_attributes` copies the plain attributes ``MoELayer.__init__`` set on the built layer
  (:data:`MOE_LAYER_ATTRIBUTES` in 0.16: config, layer number, process groups, recompute flags, the local expert
  indices, ...), every public attribute that is not a module, so ``MoELayer``'s inherited methods find them.
"""

from __future__ import annotations

from torch import nn

__all__ = ["MOE_LAYER_ATTRIBUTES", "TESTED", "adopt_layer_attributes"]

#: megatron-core versions this adapter was written and tested against: ``(lowest, first untested)`` major.minor.
TESTED: tuple[tuple[int, int], tuple[int, int]] = ((0, 16), (0, 17))

#: The public non-module attributes a built megatron-core 0.16 ``MoELayer`` (local spec, no latent projection, no
#: shared experts) holds, which :func:`adopt_layer_attributes` copies; the test pins it. ``token_dispatcher`` (not a
#: module) and ``shared_experts`` (``None`` here, else a module) are set again by the caller; ``training`` is
#: ``nn.Module``'s mode flag.
MOE_LAYER_ATTRIBUTES = frozenset({
    "attn_tp_group", "config", "cudagraph_tensor_store", "ep_group", "fwd_execution_map", "layer_number",
    "local_expert_indices", "moe_layer_recompute", "num_local_experts", "shared_expert_overlap", "shared_experts",
    "shared_experts_recompute", "submodules", "token_dispatcher", "tp_group", "training", "use_shared_expert",
})


def adopt_layer_attributes(layer: nn.Module, moe: nn.Module) -> list[str]:
    """Copy onto ``layer`` (a ``MoELayer`` subclass whose ``__init__`` ran ``nn.Module.__init__`` only) every
    public attribute of the built ``moe`` that is not a module (modules are adopted by the caller, as submodules).
    Returns the names copied, sorted."""
    names = sorted(k for k, v in vars(moe).items() if not k.startswith("_") and not isinstance(v, nn.Module))
    for name in names:
        setattr(layer, name, getattr(moe, name))
    return names
