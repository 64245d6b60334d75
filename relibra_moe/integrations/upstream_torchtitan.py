"""Every place the torchtitan integration relies on torchtitan beyond its public doors, in one adapter.

Written against torchtitan 0.3 (:data:`TESTED`); ``tests/integrations/test_upstream_torchtitan.py`` asserts the
installed version is in that range and checks each contract below on torchtitan's real ``MoE``, so a release that
changes one fails a test named for it.

The doors torchtitan has are used as they are: the train spec's ``parallelize_fn`` swaps the blocks
(:func:`relibra_moe.integrations.torchtitan_train.with_replay`), and the swapped block implements torchtitan's
``Module`` protocol (``parallelize``, ``init_states`` / ``_init_self_buffers``). What has no door:

- **router** (:func:`replay_router`): ``TokenChoiceTopKRouter.forward(x [B, L, D], expert_bias_E [E] | None) ->
  (topk_scores [B, L, K], topk_ids [B, L, K], scores [B, L, E])`` with ``top_k``, ``num_experts``, ``route_norm``,
  ``route_scale``; replay needs its forward to take the rollout's ids, so the instance gets a mixin;
- **experts** (:func:`as_grouped_experts`): ``GroupedExperts`` with ``w1_EFD [E, F, D]``, ``w3_EFD [E, F, D]``,
  ``w2_EDF [E, D, F]``, seen as relibra's ``GroupedExperts`` through a mixin (same parameters);
- **the swapped block is a torchtitan Module** (:func:`as_titan_module`): ``init_states`` and ``parallelize``
  recurse into ``Module`` children only, so the block's class gains ``torchtitan.protocols.module.Module`` as a
  further base; done at the swap, since importing torchtitan's protocols takes seconds and HF users never need it;
- **debug routing** (:func:`forces_load_balance`): the router's private ``_debug_force_load_balance`` flag (set
  from its config), which the swapped block cannot follow.
"""

from __future__ import annotations

from torch import nn

from ..layers.upstream_torch import add_mixin

__all__ = ["TESTED", "as_grouped_experts", "as_titan_module", "forces_load_balance", "replay_router"]

#: torchtitan versions this adapter was written and tested against: ``(lowest, first untested)`` major.minor.
TESTED: tuple[tuple[int, int], tuple[int, int]] = ((0, 3), (0, 4))


def replay_router(router: nn.Module, mixin: type) -> nn.Module:
    """torchtitan's router instance with ``mixin`` (a forward taking ``replay_ids``); returns it (same parameters,
    ``isinstance`` of torchtitan's class kept)."""
    return add_mixin(router, mixin)


def as_grouped_experts(experts: nn.Module, mixin: type) -> nn.Module:
    """torchtitan's ``GroupedExperts`` instance seen as relibra's ``GroupedExperts`` through ``mixin``; returns it."""
    return add_mixin(experts, mixin)


def as_titan_module(block: nn.Module) -> nn.Module:
    """``block`` with torchtitan's ``Module`` as a further base (after its own classes in the MRO); returns it."""
    from torchtitan.protocols.module import Module

    return add_mixin(block, Module, after=True)


def forces_load_balance(router: nn.Module) -> bool:
    """Whether torchtitan's router runs its debug routing (``_debug_force_load_balance``: every expert the same
    tokens), which the swapped block does not support."""
    return bool(getattr(router, "_debug_force_load_balance", False))
