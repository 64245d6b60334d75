"""Every place the Hugging Face integration relies on ``transformers`` beyond its public API, in one adapter.

Written against transformers 5.24 and checked on 5.25 (:data:`TESTED`); ``tests/integrations/test_upstream_hf.py``
asserts the installed version is in that range and checks each contract below on the real classes of every
supported family, so a release that changes one fails a test named for it.

transformers' public doors and why the swapped layer does not use them alone:

- ``experts_implementation`` (``transformers.integrations.moe.ALL_EXPERTS_FUNCTIONS``) swaps the *forward* of an
  experts module, ``(hidden [T, H], top_k_index [T, k], top_k_weights [T, k]) -> [T, H]``, called by the
  block with the router's live choice. Replay needs the router to take the rollout's ids (no door: the
  router's forward takes ``hidden_states`` only), and expert parallelism needs the experts' rows as tensors
  relibra moves, dispatches to other ranks and replicates, which a forward function cannot express.
- Module replacement: the swap replaces whole blocks with ``nn.Module.set_submodule`` (public torch).

So the swapped layer keeps HF's router and experts *instances* (their parameters, state-dict names, and the
``output_router_logits`` recorder, which HF attaches by ``isinstance`` on the router class:
``_can_record_outputs = {"router_logits": OutputRecorder(<Router class>, index=0)}``) and gives each a mixin
(:func:`relibra_moe.layers.upstream_torch.add_mixin`). The contracts this relies on:

- **router** (:func:`replay_router`): ``forward(hidden [T, H]) -> (logits [T, E], gates [T, k], ids [T, k])``
  and the attributes ``top_k`` and ``num_experts``; its logits are ``F.linear(hidden, weight, bias)`` over the
  attributes ``weight [E, H]`` (and GPT-OSS's ``bias [E]``), in fp32 for DeepSeek-V3 (:func:`router_logits`, what
  the replayed router computes instead of the whole forward when every token's ids are replayed);
- **experts** (:func:`as_grouped_experts`; and the ``"relibra"`` experts forward of
  :mod:`~relibra_moe.integrations.hf_experts`): fused parameters with the expert dimension first,
  ``gate_up_proj [E, 2I, H]`` and ``down_proj [E, H, I]`` with ``act_fn`` (GPT-OSS: ``gate_up_proj [E, H, 2I]``
  interleaved, ``gate_up_proj_bias [E, 2I]``, ``down_proj [E, I, H]``, ``down_proj_bias [E, H]``, ``alpha``,
  ``limit``). The forward registered through ``experts_implementation`` also reads what the decorator leaves on
  the module: its gate activation ``_apply_gate`` and whether it is HF's default ``act_fn(gate) * up``
  (``transformers.integrations.moe._default_apply_gate``) (:func:`gate_activation`), and HF's expert-parallel
  flag ``_is_expert_parallel`` (:func:`hf_expert_parallel`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..layers.upstream_torch import add_mixin

__all__ = ["ROUTER_LOGITS_KEY", "TESTED", "as_grouped_experts", "gate_activation", "hf_expert_parallel",
           "replay_router", "router_logits"]

#: transformers versions this adapter was written and tested against: ``(lowest, first untested)`` major.minor.
TESTED: tuple[tuple[int, int], tuple[int, int]] = ((5, 24), (5, 26))

#: The output HF's ``output_router_logits`` records from every module of the router class.
ROUTER_LOGITS_KEY = "router_logits"


def replay_router(router: nn.Module, mixin: type, family: Any) -> nn.Module:
    """HF's router instance with ``mixin`` (a forward taking ``replay_ids``) and its ``family``; returns it.

    ``isinstance(router, <HF router class>)`` still holds, so HF's router-logits recorder and any hooks keep
    working, and its parameters and ``state_dict`` keys are unchanged."""
    add_mixin(router, mixin)
    router._family = family
    return router


def router_logits(router: nn.Module, hidden: torch.Tensor, fp32: bool = False) -> torch.Tensor:
    """The logits ``[T, E]`` HF's ``router`` computes first in its forward, for ``hidden [..., H]``, and nothing
    else (no scores, top-k or renormalization): ``F.linear`` of the tokens ``[T, H]`` with the router's ``weight``
    (and ``bias`` where it has one: GPT-OSS), in fp32 with ``fp32`` (DeepSeek-V3 casts both). The same op on the
    same tensors as HF's forward, so the values and the gradients are HF's, bit for bit (a contract test checks
    it for every family)."""
    w = router.weight
    x = hidden.reshape(-1, w.shape[-1])
    if fp32:
        x, w = x.float(), w.float()
    return F.linear(x, w, getattr(router, "bias", None))


def as_grouped_experts(experts: nn.Module, mixin: type) -> nn.Module:
    """HF's fused experts instance seen as a ``GroupedExperts`` through ``mixin`` (same parameters); returns it."""
    return add_mixin(experts, mixin)


def gate_activation(experts: nn.Module) -> tuple[Callable[[Any], Any], bool]:
    """The gate activation ``[R, 2I] -> [R, I]`` of HF experts decorated with ``@use_experts_implementation``
    (their ``_apply_gate``), and whether it is HF's default ``act_fn(gate) * up``."""
    from transformers.integrations.moe import _default_apply_gate

    return experts._apply_gate, getattr(type(experts), "_apply_gate", None) is _default_apply_gate


def hf_expert_parallel(experts: nn.Module) -> bool:
    """Whether HF runs ``experts`` under its own expert parallelism (then ids ``>= num_experts`` are other
    ranks' pairs)."""
    return bool(getattr(experts, "_is_expert_parallel", False))
