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
