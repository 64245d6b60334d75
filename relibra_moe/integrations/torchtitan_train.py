"""torchtitan's trainer with relibra's blocks: a train spec whose ``parallelize_fn`` swaps the MoE blocks inside
torchtitan's order (meta build, ``parallelize_fn``, ``to_empty``, ``init_weights``, optimizers,
``post_optimizer_build_fn``) and whose optimizers' state dicts describe the EP-sharded experts to DCP
(docs/torchtitan.md, "In torchtitan's trainer")."""

from __future__ import annotations

import functools
from typing import Any

from torch import nn

from ..layers.expert_sharding import install_sharded_checkpoints
from .hf import swap_moe_blocks
from .torchtitan import register_expert_grad_reduction

__all__ = ["replay_model_spec", "with_replay"]


def with_replay(parallelize_fn: Any, *, replica_slots: int = 0, gpus_per_node: int | None = None,
                dispatcher: Any = "auto") -> Any:
    """A torchtitan ``parallelize_fn`` that swaps the model's MoE blocks, then runs ``parallelize_fn``.

    For a train spec (``ModelSpec(parallelize_fn=with_replay(parallelize_qwen3, replica_slots=2), ...)``): torchtitan
    builds the model on the meta device, calls this (the swap runs on the meta model, EP group: ``parallel_dims``'
    ``ep`` mesh, or one rank when ``ep = 1``), then ``to_empty`` and ``init_weights``, which the swapped blocks
    follow (:meth:`TorchtitanReplayMoE._init_self_buffers`). Keyword arguments go to ``swap_moe_blocks``.
    """
    @functools.wraps(parallelize_fn)
    def parallelize(model: nn.Module, *, parallel_dims: Any, **kwargs: Any) -> Any:
        ep = parallel_dims.get_mesh("ep") if parallel_dims.ep > 1 else _one_rank_group()
        swap_moe_blocks(model, ep_group=ep, replica_slots=replica_slots, gpus_per_node=gpus_per_node,
                        dispatcher=dispatcher)
        return parallelize_fn(model, parallel_dims=parallel_dims, **kwargs)

    return parallelize


def replay_model_spec(spec: Any, *, replica_slots: int = 0, gpus_per_node: int | None = None,
                      dispatcher: Any = "auto") -> Any:
    """torchtitan's ``ModelSpec`` (e.g. ``torchtitan.models.qwen3.model_registry("debugmodel_moe")``) for training
    with relibra's blocks: its ``parallelize_fn`` swaps the MoE blocks first (:func:`with_replay`), its
    ``post_optimizer_build_fn`` runs the spec's own (torchtitan's load-balancing hook) and then makes the
    optimizers' ``state_dict`` describe the EP-sharded experts' state to DCP
    (:func:`relibra_moe.layers.expert_sharding.install_sharded_checkpoints`), so torchtitan's ``CheckpointManager``
    saves and resumes every expert with its optimizer state, and sums the expert gradients over ranks that hold the
    same experts before each step (:func:`relibra_moe.integrations.torchtitan.register_expert_grad_reduction`)."""
    import dataclasses

    post = spec.post_optimizer_build_fn

    def post_optimizer_build(optimizers: Any, model_parts: list[nn.Module], parallel_dims: Any) -> None:
        if post is not None:
            post(optimizers, model_parts, parallel_dims)
        install_sharded_checkpoints(model_parts, optimizers)
        register_expert_grad_reduction(optimizers, model_parts)

    fn = with_replay(spec.parallelize_fn, replica_slots=replica_slots, gpus_per_node=gpus_per_node,
                     dispatcher=dispatcher)
    return dataclasses.replace(spec, parallelize_fn=fn, post_optimizer_build_fn=post_optimizer_build)


def _one_rank_group() -> Any:
    """This rank alone as a process group (every rank creates every one-rank group, as ``new_group`` requires);
    ``None`` without ``torch.distributed``."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    groups = [dist.new_group([r]) for r in range(dist.get_world_size())]
    return groups[dist.get_rank()]
