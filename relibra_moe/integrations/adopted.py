"""What the swapped Hugging Face and torchtitan blocks share: a :class:`~relibra_moe.layers.moe.ReplayBalancedMoE`
made of a framework block's own submodules, under the framework's names.

:class:`AdoptedBlockMoE` is the base of :class:`~relibra_moe.integrations.hf_layer.HFReplayMoE` and
:class:`~relibra_moe.integrations.torchtitan.TorchtitanReplayMoE`; :class:`RouterTuple` is the output of their
routers (the framework's tuple that also reads as a ``RouterOutput``).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from ..layers.moe import ReplayBalancedMoE

__all__ = ["AdoptedBlockMoE", "RouterTuple", "deprecated_names", "keep_home_rows"]


class RouterTuple(tuple):
    """A framework router's output ``(logits or scores [T, E], gates [T, k], ids [T, k])`` that also reads as a
    ``RouterOutput`` (``.logits``, ``.gates``, ``.ids``)."""

    @property
    def logits(self) -> torch.Tensor:
        return self[0]

    @property
    def gates(self) -> torch.Tensor:
        return self[1]

    @property
    def ids(self) -> torch.Tensor:
        return self[2]


def keep_home_rows(experts: nn.Module, names: Sequence[str], rank: int, num_experts: int, world: int) -> None:
    """With ``world`` > 1 ranks, replace each per-expert parameter ``names`` of ``experts`` (expert dim first,
    ``[E, ...]``) by the rows of this rank's home experts ``rank*E/G .. (rank+1)*E/G - 1`` (the static placement
    ``e // (E/G)``): new, smaller parameters, ``requires_grad`` kept. Nothing with one rank."""
    if world <= 1:
        return
    E_loc = num_experts // world
    for name in names:
        p = getattr(experts, name)
        home = torch.arange(rank * E_loc, (rank + 1) * E_loc, device=p.device)
        setattr(experts, name, nn.Parameter(p.detach().index_select(0, home).clone(), requires_grad=p.requires_grad))


class AdoptedBlockMoE(ReplayBalancedMoE):
    """A ``ReplayBalancedMoE`` whose submodules are a framework block's own (see the module docstring).

    Subclasses build the layer (``ReplayBalancedMoE.__init__``), then call :meth:`adopt` with the block.
    ``framework`` names the framework in errors and ``repr``. ``shared_expert`` is ``None`` (the subclass applies
    the framework's shared experts itself) and refuses any other value.
    """

    swapped_moe_block = True  # marks the blocks swap_moe_blocks makes
    framework: str = ""

    def adopt(self, block: nn.Module, *, buffers: bool = False) -> None:
        """Make ``block``'s children this layer's submodules, under their names and in their order (and, with
        ``buffers``, its own buffers, persistent as they were); ``expert_gpu`` stays, non-persistent, last (it is
        relibra's, not the framework's state)."""
        expert_gpu = self._buffers.pop("expert_gpu")
        self._modules.clear()
        for name, child in block.named_children():
            self._modules[name] = child
        for name, buf in block.named_buffers(recurse=False) if buffers else ():
            self.register_buffer(name, buf, persistent=name not in block._non_persistent_buffers_set)
        self.register_buffer("expert_gpu", expert_gpu, persistent=False)

    @property
    def shared_expert(self) -> nn.Module | None:
        """``None`` inside the inherited forward: the subclass adds the framework's shared experts itself."""
        return None

    @shared_expert.setter
    def shared_expert(self, value: Any) -> None:
        if value is not None:
            raise ValueError(f"{type(self).__name__} applies the {self.framework} block's own shared experts")

    def repr_head(self) -> str:
        """The first fields of :meth:`extra_repr` (the framework, or the family)."""
        return self.framework

    def extra_repr(self) -> str:
        return (f"{self.repr_head()}, layer_id={self.layer_id}, E={self.num_experts}, k={self.top_k}, "
                f"rank={self.rank}/{self.world_size}")


def deprecated_names(module: str, names: dict[str, str], namespace: dict[str, Any]) -> Callable[[str], Any]:
    """A module ``__getattr__`` (PEP 562) for ``module``: each old name in ``names`` gives the object ``namespace``
    (the module's ``globals()``) holds under its new name, with a ``DeprecationWarning``; any other name raises
    ``AttributeError``."""
    def __getattr__(name: str) -> Any:
        if name in names:
            warnings.warn(f"{module}.{name} is deprecated: use {names[name]}", DeprecationWarning, stacklevel=2)
            return namespace[names[name]]
        raise AttributeError(f"module {module!r} has no attribute {name!r}")

    return __getattr__
