"""Expert-parallel layers under data parallelism (``DistributedDataParallel``, accelerate, HF ``Trainer``).

With expert parallelism over G ranks each rank holds only its E/G home experts; with data parallelism over
the same ranks every rank also holds a full copy of the dense parameters. Three things must then hold, and
this module provides them:

1. **No data-parallel reducer touches the expert parameters.** DDP would average (and at construction
   broadcast from rank 0) rows that are *different experts* on every rank. :func:`mark_experts_for_ddp`
   (called by ``swap_moe_blocks``) lists every expert parameter, and the layers' ``expert_gpu`` buffers,
   in ``_ddp_params_and_buffers_to_ignore`` of the model and of every module between the model and the
   layers (torch's DDP reads that attribute of the module it wraps), so wrapping the model, or its base
   model, just works. A DDP wrapper that still manages an expert parameter (it wraps a new container,
   or the ignore list was replaced) is refused by name at the first forward, on every rank
   (:func:`check_data_parallel`).
2. **Expert gradients equal the single-process reference.** Each rank's loss is the mean over its own
   samples and DDP divides the sum of the dense gradients by the data-parallel world size D. The expert
   gradients reach the home rank from every rank through the all-to-all's backward, summed, so they
   are D times too large unless divided the same way: under an active DDP forward each layer installs a
   gradient hook on its expert parameters that multiplies by ``1 / D`` (``layer.dp_grad_scale``; 1.0
   outside DDP, where the caller reduces dense gradients itself). D must equal the EP group size (the
   expert shards have no data-parallel replicas to average with); otherwise the forward raises.
3. **Gradient-norm clipping sees the global norm.** :func:`clip_grad_norm_` adds the sharded expert
   gradients' norms over the EP group to the (already all-reduced) dense norm, then scales every
   gradient as ``torch.nn.utils.clip_grad_norm_`` would on one process holding the whole model.
   :func:`use_global_clip` makes an ``accelerate.Accelerator`` (the HF ``Trainer``'s clip path) call it.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..errors import ReplayError
from .upstream_torch import DDP_IGNORE_ATTR, active_ddp_module, ddp_ignored_names

__all__ = ["check_data_parallel", "clip_grad_norm_", "expert_parameters", "mark_experts_for_ddp", "use_global_clip"]

def _ep_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(name, layer)`` of every expert-parallel layer of ``model`` with more than one rank (module order):
    a ``ReplayBalancedMoE`` (read by what it has: ``world_size``, ``ep_group`` and ``experts.expert_tensors()``)."""
    return [(n, m) for n, m in model.named_modules()
            if getattr(m, "world_size", 1) > 1 and hasattr(m, "ep_group")
            and callable(getattr(getattr(m, "experts", None), "expert_tensors", None))]


def expert_parameters(model: nn.Module) -> list[tuple[torch.Tensor, Any]]:
    """``(parameter, EP process group)`` of every expert tensor sharded by expert parallelism (layers with
    more than one rank), in module order."""
    return [(p, layer.ep_group) for _, layer in _ep_layers(model) for p in layer.experts.expert_tensors()]


def mark_experts_for_ddp(model: nn.Module) -> list[str]:
    """List every sharded expert parameter (and each EP layer's ``expert_gpu`` buffer) in
    ``_ddp_params_and_buffers_to_ignore`` of ``model`` and of every module on the path from ``model`` to
    an EP layer, under names relative to that module (names already there are kept). Returns the names
    added to ``model``'s list. No-op without EP layers of more than one rank."""
    added: list[str] = []
    for lname, layer in _ep_layers(model):
        local = [f"experts.{n}" for n, p in layer.experts.named_parameters()
                 if any(p is t for t in layer.experts.expert_tensors())] + ["expert_gpu"]
        parts = lname.split(".") if lname else []
        for depth in range(len(parts) + 1):
            owner = model.get_submodule(".".join(parts[:depth])) if depth else model
            prefix = ".".join(parts[depth:])
            names = [f"{prefix}.{n}" if prefix else n for n in local]
            have = list(getattr(owner, DDP_IGNORE_ATTR, []))
            new = [n for n in names if n not in have]
            setattr(owner, DDP_IGNORE_ATTR, have + new)
            if depth == 0:
                added += new
    return added


def _ddp_class() -> type | None:
    try:
        from torch.nn.parallel import DistributedDataParallel
    except ImportError:  # pragma: no cover - torch without distributed
        return None
    return DistributedDataParallel


def check_data_parallel(layer: nn.Module) -> None:
    """Called by an EP layer's forward: under an active DDP forward, refuse a wrapper that manages this
    layer's expert parameters (``ReplayError``, every rank) and scale its expert gradients by ``1 / D``
    (see the module docstring). Cheap after the first call per DDP wrapper."""
    if layer.world_size <= 1:
        return
    ddp = active_ddp_module()
    if ddp is None:
        return
    seen = getattr(layer, "_ddp_seen", None)  # weakref to the DDP wrapper already checked
    if seen is None or seen() is not ddp:
        mine = {id(p) for p in layer.experts.expert_tensors()}
        ignored = ddp_ignored_names(ddp)
        managed = [n for n, p in ddp.module.named_parameters() if id(p) in mine and n not in ignored]
        if managed:
            raise ReplayError(
                f"layer {layer.name}: DistributedDataParallel manages the expert parameters {managed} that expert "
                f"parallelism shards over {layer.world_size} ranks (every rank holds different experts), so it would "
                "broadcast and average different experts. Wrap the model swap_moe_blocks was given (or its base "
                "model): swap_moe_blocks lists the expert parameters in _ddp_params_and_buffers_to_ignore; for "
                "another wrapper call relibra_moe.layers.data_parallel.mark_experts_for_ddp(wrapper) before "
                "wrapping it in DistributedDataParallel")
        D = dist.get_world_size(ddp.process_group)
        if D != layer.world_size:
            raise ReplayError(f"layer {layer.name}: the data-parallel group has {D} ranks, the expert-parallel group "
                              f"{layer.world_size}; expert shards replicated over data-parallel ranks are not "
                              "supported (use one group for both)")
        layer.dp_grad_scale = 1.0 / D
        layer._ddp_seen = weakref.ref(ddp)
    _hook_expert_grads(layer)


def _hook_expert_grads(layer: nn.Module) -> None:
    """Install (once per parameter object) the hook multiplying expert gradients by ``layer.dp_grad_scale``."""
    hooked = getattr(layer, "_dp_hooked", None)
    if hooked is None:
        hooked = layer._dp_hooked = {}
    ref = weakref.ref(layer)

    def scale(grad: torch.Tensor) -> torch.Tensor:
        owner = ref()
        s = 1.0 if owner is None else float(getattr(owner, "dp_grad_scale", 1.0))
        return grad if s == 1.0 else grad * s

    for p in layer.experts.expert_tensors():
        if id(p) not in hooked and p.requires_grad:
            hooked[id(p)] = (weakref.ref(p), p.register_hook(scale))


def clip_grad_norm_(model: nn.Module, max_norm: float, norm_type: float = 2.0,
                    parameters: Iterable[torch.Tensor] | None = None, error_if_nonfinite: bool = False
                    ) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` over the whole model when expert parallelism shards its experts.

    Args:
        model: the (unwrapped or DDP-wrapped) model; its EP layers say which parameters are sharded and
            over which group.
        max_norm: the largest allowed total norm.
        norm_type: p of the p-norm (``inf`` for the largest absolute value).
        parameters: the parameters to clip (default: all of ``model``'s); sharded expert parameters among
            them contribute their norm summed over the EP group, the others (replicated, already reduced
            by data parallelism) their local norm.
        error_if_nonfinite: raise ``RuntimeError`` when the total norm is nan or inf.

    Returns:
        The total norm (fp32 scalar tensor), the same on every rank. A collective over each EP group
        (one all-reduce per group); every rank must call it.
    """
    p_norm = float(norm_type)
    ddp_cls = _ddp_class()
    module = model.module if ddp_cls is not None and isinstance(model, ddp_cls) else model
    experts = expert_parameters(module)
    sharded = {id(p) for p, _ in experts}
    params = list(module.parameters() if parameters is None else parameters)
    chosen = {id(p) for p in params}
    if not params:
        return torch.tensor(0.0)
    device = params[0].device

    def part(grads: list[torch.Tensor]) -> torch.Tensor:
        if not grads:
            return torch.zeros((), dtype=torch.float32, device=device)
        norms = torch.stack([torch.linalg.vector_norm(g.detach().float(), p_norm).to(device) for g in grads])
        return norms.max() if math.isinf(p_norm) else norms.pow(p_norm).sum()

    total = part([p.grad for p in params if p.grad is not None and id(p) not in sharded])
    groups: dict[int, tuple[Any, list[torch.Tensor]]] = {}
    for p, group in experts:  # module order: the same groups in the same order on every rank
        grads = groups.setdefault(id(group), (group, []))[1]
        if id(p) in chosen and p.grad is not None:
            grads.append(p.grad)
    for group, grads in groups.values():
        s = part(grads)
        dist.all_reduce(s, op=dist.ReduceOp.MAX if math.isinf(p_norm) else dist.ReduceOp.SUM, group=group)
        total = torch.maximum(total, s) if math.isinf(p_norm) else total + s
    total = total if math.isinf(p_norm) else total.pow(1.0 / p_norm)
    if error_if_nonfinite and not bool(torch.isfinite(total)):
        raise RuntimeError(f"the total norm of order {p_norm} of the gradients is non-finite ({float(total)})")
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    with torch.no_grad():
        for p in params:
            if p.grad is not None:
                p.grad.mul_(coef.to(p.grad.device, p.grad.dtype))
    return total


def use_global_clip(accelerator: Any, model: nn.Module) -> None:
    """Make ``accelerator.clip_grad_norm_`` (what the HF ``Trainer`` calls with ``max_grad_norm``) clip by the
    global norm of :func:`clip_grad_norm_` for ``model``; only this accelerator instance changes. Gradients
    are unscaled first (fp16), as accelerate's own clip does."""
    def clip(parameters: Iterable[torch.Tensor], max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        accelerator.unscale_gradients()
        return clip_grad_norm_(model, max_norm, norm_type, parameters=parameters)

    accelerator.clip_grad_norm_ = clip
