"""The Megatron-core adapter (relibra_moe/integrations/upstream_megatron.py) against the installed megatron-core:
the version it was written for, and the attributes a built ``MoELayer`` holds, which the swapped layer adopts."""

from __future__ import annotations

import pytest

from tests import megatron_cpu as mc

pytestmark = pytest.mark.skipif(not mc.HAVE_MEGATRON, reason=mc.MEGATRON_REASON)


def test_installed_megatron_core_is_a_tested_version():
    import megatron.core

    from relibra_moe.integrations.upstream_megatron import TESTED
    from relibra_moe.layers.upstream_torch import version_in_range

    assert version_in_range(megatron.core.__version__, TESTED), (
        f"megatron-core {megatron.core.__version__} is outside the range upstream_megatron.py was tested against "
        f"{TESTED}: check adopt_layer_attributes against its MoELayer.__init__, then widen TESTED")


def _attributes(rank: int, world: int) -> None:
    from torch import nn

    from relibra_moe.integrations.megatron import MegatronReplayMoE
    from relibra_moe.integrations.upstream_megatron import MOE_LAYER_ATTRIBUTES, adopt_layer_attributes

    mc.init_megatron(world)
    try:
        moe = mc.moe_layer(mc.moe_config(), layer_number=3)
        public = {k for k, v in vars(moe).items() if not k.startswith("_") and not isinstance(v, nn.Module)}
        assert public == MOE_LAYER_ATTRIBUTES, (  # an attribute MoELayer.__init__ added or dropped upstream
            f"added {sorted(public - MOE_LAYER_ATTRIBUTES)}, dropped {sorted(MOE_LAYER_ATTRIBUTES - public)}")
        target = MegatronReplayMoE.__new__(MegatronReplayMoE)
        nn.Module.__init__(target)
        assert adopt_layer_attributes(target, moe) == sorted(MOE_LAYER_ATTRIBUTES)
        for name in MOE_LAYER_ATTRIBUTES:
            assert getattr(target, name) is getattr(moe, name), name
        assert target.layer_number == 3 and target.local_expert_indices == list(range(8))
        layer = MegatronReplayMoE(moe)  # the real swap adopts the same attributes, and drops Megatron's dispatcher
        assert all(getattr(layer, n) is getattr(moe, n) for n in MOE_LAYER_ATTRIBUTES - {"token_dispatcher"})
        assert layer.token_dispatcher is None and moe.token_dispatcher is not None
    finally:
        mc.destroy_megatron()


def test_adopted_attributes_are_those_of_a_built_moe_layer():
    from relibra_moe.layers.testing import run_group

    run_group(_attributes, 1, timeout_s=180)


def _spec_built(rank: int, world: int) -> None:
    import torch
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel import random as mrandom

    from relibra_moe.integrations import megatron as rm

    mc.init_megatron(world)
    try:
        cfg = mc.moe_config(8, 2, 32, 16, num_layers=2)
        spec = get_gpt_layer_local_spec(num_experts=8, moe_grouped_gemm=False)

        def build(layer_spec):
            torch.manual_seed(0)
            mrandom.model_parallel_cuda_manual_seed(0)
            return GPTModel(cfg, layer_spec, vocab_size=64, max_sequence_length=6,
                            position_embedding_type="learned_absolute")

        ref = build(spec)
        model = build(rm.replay_layer_spec(spec))
        assert spec.submodules.mlp.module is not rm.MegatronReplayMoE  # the spec given is not changed
        built = [m for m in model.modules() if isinstance(m, rm.MegatronReplayMoE)]
        assert len(built) == 2 and all(m.relibra.layer_index is None for m in built)
        layers = rm.swap_moe_layers(model)  # the plan's layer index (and replica slots, none at EP 1)
        assert layers == built and [m.relibra.layer_index for m in layers] == [0, 1]
        with pytest.raises(ValueError, match="no megatron.core MoELayer"):
            rm.swap_moe_layers(model)  # every layer is relibra's and indexed: nothing to do twice
        tokens = torch.randint(0, 64, (1, 6), generator=torch.Generator().manual_seed(1))
        pos = torch.arange(6)[None]
        causal = torch.triu(torch.ones(1, 1, 6, 6), diagonal=1).bool()
        with torch.no_grad():  # the same weights as the plain spec's from the same seed, every layer after too
            torch.testing.assert_close(model(tokens, pos, causal), ref(tokens, pos, causal), rtol=1e-5, atol=1e-6)
        with pytest.raises(ValueError, match="not a megatron.core MoELayer"):
            rm.replay_layer_spec(get_gpt_layer_local_spec())
    finally:
        mc.destroy_megatron()


def test_a_model_built_from_the_replay_spec_is_the_plain_model():
    """Megatron's spec-based construction: ``replay_layer_spec`` builds relibra's layers inside Megatron's model
    build, with the plain spec's weights."""
    from relibra_moe.layers.testing import run_group

    run_group(_spec_built, 1, timeout_s=240)
