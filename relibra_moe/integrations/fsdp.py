"""FSDP2 with expert parallelism on a 2-D ``DeviceMesh`` (``dp`` x ``ep``) for Hugging Face MoE models.

The torchtitan layout, with relibra's replay-balanced MoE layers (see ``docs/fsdp.md``)::

    mesh = init_device_mesh("cuda", (dp, ep), mesh_dim_names=("dp", "ep"))
    par = parallelize(model, mesh, replica_slots=2, gpus_per_node=8,
                      mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
    opt = torch.optim.AdamW(par.param_groups(), lr=1e-5)  # dense (DTensor) and expert groups
    par.relayout(plan, opt)                               # once per global batch (same plan on every rank)
    for m in par.micro_batches(plan):                     # this dp rank's share of the micro-batches
        with par.replay(batch, plan, m, attention_mask=mask):
            loss = loss_fn(model(ids, attention_mask=mask))
            loss.backward()                               # dense grads: FSDP reduce-scatter
    par.reduce_expert_grads()                             # expert grads: all-reduce over dp
    opt.step()

What goes where, on rank ``(d, j)`` of a ``dp x ep`` mesh:

- **experts** (every ``experts.<name>`` tensor of the swapped MoE layers) are sharded by expert
  parallelism over the ``ep`` dimension: the ``ep`` ranks of one ``dp`` index form an EP group of
  ``ep`` ranks that homes each expert on one rank (``E / ep`` experts each, placement moved by
  ``relayout``). They are *not* FSDP parameters (``fully_shard(..., ignored_params=...)``): the ``dp``
  ranks with the same ``j`` hold the same experts, and :meth:`MeshMoE.reduce_expert_grads` all-reduces
  their gradients over ``dp``. FSDP applied to an expert parameter (double sharding) is an error.
- **dense parameters** (embeddings, attention, norms, routers, shared experts, the LM head) are
  ``fully_shard``-ed, by default over all ``dp * ep`` ranks (every rank runs its own tokens, so a
  dense gradient is a sum over the whole mesh); ``dense_mesh=mesh`` gives HSDP instead (replicated
  over ``dp``, sharded over ``ep``).
- **plans**: one ``BatchPlan`` per global batch for a cluster of ``ep`` GPUs (``plan.num_gpus == ep``).
  Its placement is the experts' homes in every EP group; its micro-batches are dealt over the ``dp``
  ranks (``m % dp == d``); inside a micro-batch the plan's sample placement picks the ``ep`` rank that
  runs each sample and its replica plan the replicas. All ranks run the same number of forwards
  (FSDP's collectives span the mesh): a ``dp`` rank with fewer micro-batches runs placeholder
  forwards (:meth:`MeshMoE.micro_batches` yields ``None`` for them, :meth:`MeshMoE.replay` serves them
  with no expert).

Gradient reduction: ``reduction="mean"`` (FSDP's default: every gradient is divided by the mesh size,
dense and expert alike, so each rank's loss is its own mean) or ``"sum"`` (each rank's loss is its share
of the global loss, e.g. divided by the global token count). Mixed precision (``mp_policy``) applies to
the dense parameters; the experts keep their own dtype, and the layer runs them on rows cast to it.
Activation checkpointing recomputes each decoder layer in backward; run the backward inside the
``replay`` block so the recomputed forward replays the same routing.
"""

from __future__ import annotations

import contextlib
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from ..errors import PlanError
from ..layers.dispatch import ep_process_group, is_device_mesh
from ..layers.expert_sharding import install_sharded_checkpoints
from ..layers.upstream_torch import flatten_mesh, fsdp_managed_params
from .hf import full_state_dict, moe_blocks, num_experts_top_k, replay, swap_moe_blocks

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from ..layers.moe import ReplayBalancedMoE
    from ..plan import BatchPlan, Placement

__all__ = ["MeshMoE", "check_experts_not_sharded", "check_mesh", "ep_process_group", "expert_parameters",
           "parallelize"]

REDUCTIONS = ("mean", "sum")


# ------------------------------------------------------------------------------------------- mesh
def check_mesh(mesh: DeviceMesh, num_experts: int, *, dp_dim: str = "dp", ep_dim: str = "ep") -> tuple[int, int]:
    """Check a 2-D ``(dp, ep)`` mesh for a model of ``num_experts`` routed experts; returns ``(dp, ep)`` sizes.

    Raises ``ValueError`` naming the dimension and value: not a ``DeviceMesh``, not 2-D, dimension
    names missing, or an ``ep`` size that does not divide ``num_experts``.
    """
    if not is_device_mesh(mesh):
        raise ValueError(f"mesh must be a torch.distributed DeviceMesh, got {type(mesh).__name__}")
    names = tuple(mesh.mesh_dim_names or ())
    if mesh.ndim != 2 or set(names) != {dp_dim, ep_dim}:
        raise ValueError(f"mesh must be 2-D with dimensions ({dp_dim!r}, {ep_dim!r}); got {mesh.ndim}-D mesh of "
                         f"shape {tuple(mesh.shape)} with dimensions {names}")
    dp, ep = mesh[dp_dim].size(), mesh[ep_dim].size()
    if num_experts % ep:
        raise ValueError(f"mesh dimension {ep_dim!r} has size {ep}, which does not divide num_experts={num_experts}: "
                         f"every EP rank homes num_experts / {ep_dim} experts")
    return int(dp), int(ep)


# ---------------------------------------------------------------------------------------- experts
def _moe_layers(model: nn.Module) -> list[ReplayBalancedMoE]:
    from ..layers.moe import moe_layers

    return moe_layers(model)


def expert_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    """Every expert tensor of the model's ``ReplayBalancedMoE`` layers, by parameter name (module order)."""
    ids = {id(p) for layer in _moe_layers(model) for p in layer.experts.expert_tensors()}
    return {n: p for n, p in model.named_parameters(remove_duplicate=False) if id(p) in ids}


def check_experts_not_sharded(model: nn.Module) -> None:
    """Raise ``ValueError`` naming the parameter when an expert tensor is FSDP-managed or a ``DTensor``.

    Experts are sharded by expert parallelism; FSDP on top (``fully_shard`` without
    ``ignored_params``) would shard them a second time over the data-parallel ranks, and relayout,
    the replica buffer and the expert gradient reduction would read shards of the wrong rows.
    """
    from torch.distributed.tensor import DTensor

    managed = fsdp_managed_params(model)
    for name, p in expert_parameters(model).items():
        if isinstance(p, DTensor):
            raise ValueError(f"expert parameter {name!r} is a DTensor (placements {tuple(p.placements)} on mesh "
                             f"dimensions {p.device_mesh.mesh_dim_names}): FSDP was applied to expert parameters, "
                             "which expert parallelism already shards; fully_shard the model with "
                             "ignored_params=set(expert_parameters(model).values()) (parallelize does)")
        if id(p) in managed:
            raise ValueError(f"expert parameter {name!r} is managed by fully_shard on module {managed[id(p)]!r}: "
                             "FSDP was applied to expert parameters, which expert parallelism already shards; pass "
                             "them as ignored_params (parallelize does)")


def _decoder_layers(model: nn.Module) -> list[nn.Module]:
    base = getattr(model, "model", model)
    layers = getattr(base, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise ValueError(f"{type(model).__name__} has no decoder layer list (model.model.layers or model.layers)")
    return list(layers)


def _digest(rows: np.ndarray) -> int:
    return zlib.crc32(np.ascontiguousarray(rows, np.int64).tobytes()) & 0x7FFFFFFF


# ------------------------------------------------------------------------------------------ handle
@dataclass
class MeshMoE:
    """A model prepared by :func:`parallelize`: the step helpers of a ``dp x ep`` mesh.

    Attributes:
        model: the model (swapped MoE blocks, ``fully_shard`` applied).
        mesh: the 2-D mesh. dense_mesh: the mesh the dense parameters are sharded over.
        dp_dim, ep_dim: the dimension names. dp_size, ep_size: their sizes. dp_rank, ep_rank: this rank's.
        dp_group, ep_group: this rank's process groups along each dimension.
        reduction: ``"mean"`` or ``"sum"`` (see the module docstring).
    """

    model: nn.Module
    mesh: Any
    dense_mesh: Any
    dp_dim: str
    ep_dim: str
    reduction: str

    def __post_init__(self) -> None:
        self.dp_size, self.ep_size = self.mesh[self.dp_dim].size(), self.mesh[self.ep_dim].size()
        self.dp_rank = self.mesh[self.dp_dim].get_local_rank()
        self.ep_rank = self.mesh[self.ep_dim].get_local_rank()
        self.dp_group = self.mesh[self.dp_dim].get_group()
        self.ep_group = self.mesh[self.ep_dim].get_group()

    # -- optimizer
    def param_groups(self, **options: Any) -> list[dict[str, Any]]:
        """The trainable parameters as two optimizer param groups, each with ``options`` (``lr``, ...): the
        dense ones (FSDP ``DTensor`` shards) first, then the experts (plain tensors). torch's ``foreach``
        and ``fused`` optimizer paths cannot mix ``DTensor`` and ``Tensor`` in one group (the default on
        CUDA), so build the optimizer from these: ``AdamW(par.param_groups(weight_decay=0.01), lr=...)``."""
        experts = {id(p) for p in expert_parameters(self.model).values()}
        params = [p for p in self.model.parameters() if p.requires_grad]
        dense = [p for p in params if id(p) not in experts]
        expert = [p for p in params if id(p) in experts]
        return [dict(options, params=group) for group in (dense, expert) if group]

    # -- plans
    def check_plan(self, plan: BatchPlan) -> None:
        """``PlanError`` naming the value when ``plan`` is not for this mesh's EP groups (``num_gpus`` must be
        the ``ep`` size, ``gpus_per_node`` the layers')."""
        from ..plan import BatchPlan

        if not isinstance(plan, BatchPlan):
            raise PlanError(f"expected a BatchPlan, got {type(plan).__name__}")
        layers = _moe_layers(self.model)
        gpn = layers[0].gpus_per_node
        if plan.num_gpus != self.ep_size:
            raise PlanError(f"the plan is for num_gpus={plan.num_gpus}, the mesh's EP dimension {self.ep_dim!r} has "
                            f"size {self.ep_size}: plan every global batch for a cluster of {self.ep_size} GPUs")
        if plan.gpus_per_node != gpn:
            raise PlanError(f"the plan has gpus_per_node={plan.gpus_per_node}, the MoE layers gpus_per_node={gpn}")
        if plan.num_layers != len(layers):
            raise PlanError(f"the plan covers {plan.num_layers} MoE layers, the model has {len(layers)}")

    def micro_batches(self, plan: BatchPlan) -> list[int | None]:
        """This rank's micro-batches of ``plan``: ``m`` with ``m % dp == dp_rank``, ascending, then ``None``
        (a placeholder forward) until every ``dp`` rank has ``ceil(M / dp)`` entries."""
        self.check_plan(plan)
        M, dp, d = plan.num_micro_batches, self.dp_size, self.dp_rank
        rounds = -(-M // dp)
        return [m if m < M else None for m in (d + i * dp for i in range(rounds))]

    @contextlib.contextmanager
    def replay(self, routing: Any, plan: BatchPlan | None, micro_batch: int | None, *,
               attention_mask: torch.Tensor | None = None) -> Iterator[list[int]]:
        """:func:`relibra_moe.integrations.hf.replay` for micro-batch ``micro_batch`` of ``plan`` on this
        rank's EP group; ``micro_batch=None`` (a placeholder round of :meth:`micro_batches`): every token
        of the forward is served by no expert and it yields ``[]``. Forward ``attention_mask``'s shape (or
        one token) in a placeholder round."""
        if micro_batch is None:
            n = 1 if attention_mask is None else int(attention_mask.numel())
            ids = [torch.full((n, layer.top_k), -1, dtype=torch.int64) for layer in _moe_layers(self.model)]
            with replay(self.model, ids):
                yield []
            return

        if plan is not None:
            self.check_plan(plan)
        with replay(self.model, routing, plan, micro_batch=micro_batch, attention_mask=attention_mask) as rows:
            yield rows

    # -- placement
    def relayout(self, placement: Placement | BatchPlan | np.ndarray,
                 optimizer: torch.optim.Optimizer | None = None) -> dict[str, int]:
        """:func:`relibra_moe.relayout` on this rank's EP group, after checking that every ``dp`` rank applies
        the same placement (``PlanError`` otherwise: the experts a ``dp`` all-reduce sums must be the same
        rows everywhere). Moves the experts with their gradients and optimizer state; dense (FSDP) state
        stays where it is. A collective over the whole mesh."""
        from ..layers.relayout import relayout
        from ..plan import BatchPlan, Placement

        check_experts_not_sharded(self.model)
        if isinstance(placement, BatchPlan):
            self.check_plan(placement)
            placement = placement.placement
        grid = placement.expert_gpu if isinstance(placement, Placement) else np.asarray(placement)
        mine = torch.tensor([_digest(np.asarray(grid))], dtype=torch.int64)
        if self.dp_size > 1:
            every = [torch.zeros_like(mine) for _ in range(self.dp_size)]
            dist.all_gather(every, mine, group=self.dp_group)
            digests = [int(t) for t in every]
            if len(set(digests)) > 1:
                other = next(d for d, v in enumerate(digests) if v != digests[self.dp_rank])
                raise PlanError(f"relayout: dp rank {other} was given a different placement than dp rank "
                                f"{self.dp_rank}; every rank of the mesh must apply the same placement")
        return relayout(self.model, placement, optimizer)

    # -- gradients
    def reduce_expert_grads(self) -> None:
        """All-reduce every expert gradient over the ``dp`` dimension (sum), then, with ``reduction="mean"``,
        divide it by the mesh size (as FSDP divides the dense gradients). Call once per optimizer step,
        after the last backward. A collective over ``dp`` (nothing moves when ``dp == 1``)."""
        check_experts_not_sharded(self.model)
        for p in expert_parameters(self.model).values():
            if p.grad is None:
                continue
            if self.dp_size > 1:
                dist.all_reduce(p.grad, group=self.dp_group)
            if self.reduction == "mean":
                p.grad.div_(self.mesh.size())

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, eps: float = 1e-6) -> torch.Tensor:
        """Scale every gradient by ``min(1, max_norm / (norm + eps))``, ``norm`` the 2-norm of the whole
        model's gradient (every dense element and every expert counted once, not once per replica);
        returns ``norm`` (fp32 scalar, the same on every rank). Call after :meth:`reduce_expert_grads`.
        ``torch.nn.utils.clip_grad_norm_`` cannot be used: it would count each expert on one EP rank
        only, or ``dp`` times. A collective over the mesh."""
        from torch.distributed.tensor import DTensor, Replicate

        experts = {id(p) for p in expert_parameters(self.model).values()}
        sq = torch.zeros(2, dtype=torch.float32)  # [dense, experts], this rank's share
        grads = []
        for p in self.model.parameters():
            g = p.grad
            if g is None:
                continue
            grads.append(g)
            if id(p) in experts:
                sq[1] += g.detach().float().pow(2).sum().cpu()
            elif isinstance(g, DTensor):
                copies = 1  # a shard replicated over some mesh dimensions is held that many times
                for dim, placement in enumerate(g.placements):
                    if isinstance(placement, Replicate):
                        copies *= g.device_mesh.size(dim)
                sq[0] += g.to_local().float().pow(2).sum().cpu() / copies  # its mesh spans the whole mesh
            else:  # a plain dense parameter: the same on every rank
                sq[0] += g.detach().float().pow(2).sum().cpu() / self.mesh.size()
        dist.all_reduce(sq, group=self.ep_group)  # experts: each once in an EP group
        dense = sq[:1].clone()
        dist.all_reduce(dense, group=self.dp_group)
        norm = torch.sqrt(dense[0] + sq[1])
        coef = min(1.0, float(max_norm) / (float(norm) + eps))
        if coef < 1.0:
            for g in grads:
                g.mul_(coef)
        return norm

    # -- distributed checkpoints
    def shard_checkpoints(self, *optimizers: torch.optim.Optimizer) -> None:
        """Make ``optimizer.state_dict()`` (and ``get_optimizer_state_dict``) describe the experts' state to DCP as
        :func:`parallelize` made ``model.state_dict()`` describe the experts: each EP-sharded tensor a
        ShardedTensor of the whole ``[E, ...]`` tensor at the experts' logical offsets, so ``dcp.save`` writes every
        expert and ``dcp.load`` restores them into any placement or EP size, or into the plain model
        (:func:`relibra_moe.layers.expert_sharding.install_sharded_checkpoints`). Idempotent."""
        install_sharded_checkpoints(self.model, *optimizers)

    # -- gathering (checks, checkpoints)
    def _gather_expert(self, layer: ReplayBalancedMoE, local: torch.Tensor) -> torch.Tensor:
        """This EP group's rows of one expert tensor ``[E_loc, ...]`` -> ``[E, ...]`` in logical order."""
        parts = [torch.empty_like(local) for _ in range(layer.world_size)]
        dist.all_gather(parts, local.contiguous(), group=layer.ep_group)
        full = torch.empty((layer.num_experts,) + tuple(local.shape[1:]), dtype=local.dtype, device=local.device)
        home = torch.from_numpy(layer.expert_gpu_host.copy())
        for g, part in enumerate(parts):
            full[torch.nonzero(home == g).view(-1).to(local.device)] = part
        return full

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The plain HF state dict on every rank: dense DTensors gathered (``full_tensor``), expert rows
        gathered over the EP group in logical order (:func:`relibra_moe.integrations.hf.full_state_dict`).
        A collective over the mesh."""
        from torch.distributed.tensor import DTensor


        sd = full_state_dict(self.model)
        return {k: (v.full_tensor() if isinstance(v, DTensor) else v) for k, v in sd.items()}

    def full_grads(self) -> dict[str, torch.Tensor]:
        """Every parameter's whole gradient by name (dense: gathered DTensor; experts: gathered over the EP
        group in logical order), after :meth:`reduce_expert_grads`. A collective over the mesh."""
        from torch.distributed.tensor import DTensor

        owner = {id(p): layer for layer in _moe_layers(self.model) for p in layer.experts.expert_tensors()}
        out = {}
        for n, p in self.model.named_parameters():
            if p.grad is None:
                continue
            if isinstance(p.grad, DTensor):
                out[n] = p.grad.full_tensor()
            elif id(p) in owner:
                out[n] = self._gather_expert(owner[id(p)], p.grad)
            else:
                out[n] = p.grad.detach().clone()
        return out


# --------------------------------------------------------------------------------------- parallelize
def parallelize(model: nn.Module, mesh: DeviceMesh, *, replica_slots: int = 0, gpus_per_node: int | None = None,
                mp_policy: Any = None, activation_checkpointing: bool = False, reshard_after_forward: bool = True,
                reduction: str = "mean", dense_mesh: DeviceMesh | None = None, dp_dim: str = "dp",
                ep_dim: str = "ep", dispatcher: Any = "auto") -> MeshMoE:
    """Expert parallelism over ``mesh[ep_dim]`` and FSDP2 over the dense parameters, in place.

    1. checks the mesh (:func:`check_mesh`: 2-D, named dimensions, ``ep`` divides every layer's experts);
    2. swaps the MoE blocks (``swap_moe_blocks`` on this rank's EP group, ``replica_slots`` replica
       slots, ``gpus_per_node`` ranks of the EP group per node);
    3. with ``activation_checkpointing``, HF's gradient checkpointing of every decoder layer
       (non-reentrant);
    4. ``fully_shard`` of every decoder layer and of the root over ``dense_mesh`` (default: ``mesh``
       flattened, all ``dp * ep`` ranks; ``mesh`` itself: HSDP) with ``mp_policy`` and
       ``reshard_after_forward``, the expert tensors passed as ``ignored_params``; with
       ``reduction="sum"`` FSDP's gradient divide factor is 1;
    5. the layers' state-dict hooks for DCP (:meth:`MeshMoE.shard_checkpoints` adds the optimizers').

    Call it on the unsharded model, on its final device and dtype, on every rank of the mesh.

    Returns:
        The :class:`MeshMoE` of the step helpers.

    Raises:
        ValueError: a bad mesh or ``ep`` size (naming the dimension and value), a ``dense_mesh`` that does
            not span the mesh, ``reduction`` not in ``("mean", "sum")``, or a model that already has
            ``fully_shard`` applied.
    """
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard


    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction={reduction!r} is not one of {REDUCTIONS}")
    sharded = [n or "<root>" for n, m in model.named_modules() if isinstance(m, FSDPModule)]
    if sharded:
        raise ValueError(f"parallelize needs the unsharded model; fully_shard was already applied to {sharded[0]!r}")
    for _, _, block in moe_blocks(model):
        check_mesh(mesh, num_experts_top_k(block)[0], dp_dim=dp_dim, ep_dim=ep_dim)
    if dense_mesh is None:
        dense_mesh = flatten_mesh(mesh, f"{dp_dim}_{ep_dim}")
    elif not is_device_mesh(dense_mesh) or dense_mesh.size() != mesh.size():
        raise ValueError(f"dense_mesh must be a DeviceMesh over all {mesh.size()} ranks of the mesh, got "
                         f"{type(dense_mesh).__name__} of size {getattr(dense_mesh, 'size', lambda: '?')()}")
    swap_moe_blocks(model, ep_group=mesh[ep_dim].get_group(), replica_slots=replica_slots,
                    gpus_per_node=gpus_per_node, backend="layer", dispatcher=dispatcher)
    if activation_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ignored = set(expert_parameters(model).values())
    kw = dict(mesh=dense_mesh, reshard_after_forward=reshard_after_forward,
              mp_policy=mp_policy if mp_policy is not None else MixedPrecisionPolicy(), ignored_params=ignored)
    for layer in _decoder_layers(model):
        fully_shard(layer, **kw)
    fully_shard(model, **kw)
    if reduction == "sum":
        for m in model.modules():
            if isinstance(m, FSDPModule):
                m.set_gradient_divide_factor(1.0)
                m.set_force_sum_reduction_for_comms(True)  # a plain sum (no PreMulSum, which gloo lacks)
    check_experts_not_sharded(model)
    install_sharded_checkpoints(model)  # state_dict(): the EP-sharded experts as DCP ShardedTensors
    return MeshMoE(model, mesh, dense_mesh, dp_dim, ep_dim, reduction)

