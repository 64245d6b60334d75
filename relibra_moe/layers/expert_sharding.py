"""Which logical experts each rank's stacked expert tensors hold: the one description every checkpoint path uses.

Under expert parallelism (EP group of ``G`` ranks) a :class:`~relibra_moe.layers.moe.ReplayBalancedMoE` keeps
only its home experts: each stacked expert tensor is ``[E_loc, ...]`` with row ``i`` holding the logical
expert ``home_experts[i]`` (ascending), and after a :func:`~relibra_moe.layers.relayout.relayout` those ids
are any ``E_loc`` of the ``E`` experts, not a contiguous range. A checkpoint that treats the tensor as
replicated (the same key and shape on every rank) keeps one rank's experts and silently drops the rest.

:class:`ExpertShard` states, for one state-dict key of one rank, the global shape ``[E, ...]`` and the
logical expert of every local row. Each framework turns it into its own sharding format:

* PyTorch DCP (torchtitan, FSDP2): :func:`to_sharded_tensor` / :func:`sharded_state_dict` give a
  ``ShardedTensor`` with one ``[1, ...]`` shard per home expert at offset ``(expert, 0, ...)``, built from
  the placement alone (no collective), so ``dcp.save`` writes every expert once and ``dcp.load`` reads any
  layout (another EP size, another placement, the plain model's whole ``[E, ...]`` tensor). The shards are
  views of the parameters: ``dcp.load`` writes the experts in place. :func:`install_sharded_checkpoints` puts
  the same conversion into the layers' ``state_dict()`` / ``load_state_dict`` (hooks) and the optimizers'
  ``state_dict()`` / ``load_state_dict``, so checkpoint code that knows nothing of relibra (torchtitan's
  ``CheckpointManager``, ``dcp.save(model.state_dict())``) writes and reads every expert.
* Megatron ``dist_checkpointing``: one ``ShardedTensor`` per local row at the same global offset.
* Whole tensors (Trainer / ``save_pretrained`` / ``torch.save``): :func:`gather_experts` (a collective)
  builds ``[E, ...]`` in logical order and :func:`local_experts` picks a rank's rows back out of it;
  :func:`gather_optimizer_state` / :func:`local_optimizer_state` do the same for a ``torch.optim``
  ``state_dict()`` (the Trainer's ``optimizer.pt``).

Optimizer state of an expert parameter has the parameter's shape and the same description
(:func:`sharded_optimizer_state`). Replica slots (:class:`~relibra_moe.layers.replica_buffer.LayerSharedReplicaBuffer`)
are scratch buffers, never part of a checkpoint.

The placement itself is the layers' ``expert_gpu`` buffer (``[E]`` int64, identical on every rank of the
group): :func:`placement_keys` names those entries. A loader that restores the placement must apply it
(:meth:`~relibra_moe.layers.moe.ReplayBalancedMoE.set_placement_row`) *before* it reads the experts, since
the rows a rank reads are those of the placement current at load time.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from ..errors import PlanError
from .moe import ReplayBalancedMoE, moe_layers
from .upstream_torch import refresh_sharded_tensor, sharded_tensor

__all__ = ["ExpertShard", "expert_shards", "gather_experts", "gather_optimizer_state", "install_sharded_checkpoints",
           "install_sharded_optimizer_state", "install_sharded_state_dict", "local_experts", "local_optimizer_state",
           "local_rows", "optimizer_shards", "placement_keys", "sharded_optimizer_state", "sharded_state_dict",
           "to_sharded_tensor"]


@dataclass(frozen=True)
class ExpertShard:
    """One rank's share of one stacked expert tensor.

    Attributes:
        key: the tensor's ``state_dict()`` key (e.g. ``model.layers.0.mlp.experts.gate_up_proj``).
        layer: the owning layer's module name in the model (``""`` for the model itself).
        name: the tensor's name in the layer's experts (one of ``GroupedExperts.tensor_names``).
        num_experts: ``E``, the size of dim 0 of the whole tensor.
        expert_ids: int64 ``[E_loc]``: the logical expert held by each local row, ascending.
        expert_gpu: int64 ``[E]``: the rank (in the EP group) homing each expert (the layer's placement row).
        rank, world_size: this rank and the EP group's size.
        group: the EP process group (``None``: the default group, or no group when ``world_size == 1``).
    """

    key: str
    layer: str
    name: str
    num_experts: int
    expert_ids: np.ndarray
    expert_gpu: np.ndarray
    rank: int
    world_size: int
    group: Any = None

    def global_shape(self, local_shape: tuple[int, ...] | torch.Size) -> tuple[int, ...]:
        """``(E, *local_shape[1:])``: the whole tensor's shape for a local tensor of ``local_shape``."""
        return (self.num_experts,) + tuple(local_shape[1:])

    def check_local(self, local: torch.Tensor) -> None:
        """``PlanError`` unless ``local`` is ``[E_loc, ...]`` with ``E_loc = len(expert_ids)``."""
        if local.dim() < 1 or local.shape[0] != len(self.expert_ids):
            raise PlanError(f"{self.key}: local expert tensor of shape {tuple(local.shape)} does not hold the "
                            f"{len(self.expert_ids)} home experts {self.expert_ids.tolist()} of rank {self.rank}")


def _layer_shards(layer: ReplayBalancedMoE, layer_name: str, keys_of: Mapping[int, list[str]]) -> list[ExpertShard]:
    home = np.asarray(layer.expert_gpu_host, np.int64).copy()
    home.setflags(write=False)
    ids = np.flatnonzero(home == layer.rank).astype(np.int64)
    ids.setflags(write=False)
    out = []
    for name, tensor in zip(layer.experts.tensor_names, layer.experts.expert_tensors()):
        for key in keys_of.get(id(tensor), []):
            out.append(ExpertShard(key=key, layer=layer_name, name=name, num_experts=layer.num_experts,
                                   expert_ids=ids, expert_gpu=home, rank=layer.rank,
                                   world_size=layer.world_size, group=layer.ep_group))
    return out


def expert_shards(model: nn.Module) -> dict[str, ExpertShard]:
    """Every stacked expert tensor of the model's ReplayBalancedMoE layers, by ``state_dict()`` key.

    Keys are found by identity of the tensors in ``model.state_dict(keep_vars=True)``, so they are exactly the
    keys the model's state dict uses, whatever the wrapper (HF, torchtitan, Megatron) names its experts; a
    tensor registered under two names (shared with an upstream module) gets both keys. Raises ``PlanError``
    when a layer's expert tensor is not in the state dict (its checkpoint would silently lose it).
    """
    keys_of: dict[int, list[str]] = {}
    for key, value in model.state_dict(keep_vars=True).items():
        keys_of.setdefault(id(value), []).append(key)
    names = {id(m): n for n, m in model.named_modules()}
    out: dict[str, ExpertShard] = {}
    for layer in moe_layers(model):
        shards = _layer_shards(layer, names.get(id(layer), ""), keys_of)
        found = {s.name for s in shards}
        missing = [n for n in layer.experts.tensor_names if n not in found]
        if missing:
            raise PlanError(f"layer {layer.name}: expert tensors {missing} are not in the model's state_dict(); "
                            "a checkpoint would not hold them")
        out.update((s.key, s) for s in shards)
    return out


def placement_keys(model: nn.Module) -> dict[str, str]:
    """``{state_dict key of a layer's expert_gpu buffer: the layer's module name}`` in module order."""
    names = {id(m): n for n, m in model.named_modules()}
    keys_of = {id(v): k for k, v in model.state_dict(keep_vars=True).items()}
    out = {}
    for layer in moe_layers(model):
        key = keys_of.get(id(layer.expert_gpu))
        if key is not None:
            out[key] = names.get(id(layer), "")
    return out


def to_sharded_tensor(local: torch.Tensor, shard: ExpertShard, cls: type | None = None) -> Any:
    """``local [E_loc, ...]`` as a ``torch.distributed`` ``ShardedTensor`` of global shape ``[E, ...]``.

    One ``[1, ...]`` shard per local row at offset ``(expert_ids[i], 0, ...)``; the global metadata lists
    every expert's shard on its home rank, built from ``expert_gpu`` (no collective). The local shards are
    views of ``local`` (detached), so loading into the ShardedTensor (``dcp.load``) writes ``local`` in place.
    Needs an initialized process group when ``world_size > 1``. ``cls``: a ShardedTensor subclass to build.
    """
    from torch.distributed._shard.metadata import ShardMetadata
    from torch.distributed._shard.sharded_tensor import Shard
    from torch.distributed._shard.sharded_tensor.metadata import ShardedTensorMetadata, TensorProperties

    shard.check_local(local)
    data = local.detach()
    rest = list(data.shape[1:])
    zeros = [0] * len(rest)
    dev = str(data.device)
    group_ranks = _group_ranks(shard)

    def meta(expert: int) -> ShardMetadata:
        return ShardMetadata(shard_offsets=[int(expert)] + zeros, shard_sizes=[1] + rest,
                             placement=f"rank:{group_ranks[int(shard.expert_gpu[expert])]}/{dev}")

    local_shards = [Shard(data[i:i + 1], meta(int(e))) for i, e in enumerate(shard.expert_ids)]
    props = TensorProperties(dtype=data.dtype, layout=data.layout, requires_grad=False,
                             memory_format=torch.contiguous_format, pin_memory=False)
    global_md = ShardedTensorMetadata(shards_metadata=[meta(e) for e in range(shard.num_experts)],
                                      size=torch.Size(shard.global_shape(data.shape)), tensor_properties=props)
    return sharded_tensor(local_shards, global_md, shard.group, cls)


def _group_ranks(shard: ExpertShard) -> list[int]:
    """Global rank of each EP-group rank (ShardMetadata placements name global ranks)."""
    if shard.world_size <= 1:
        return [0]
    import torch.distributed as dist

    return [dist.get_global_rank(shard.group, g) if shard.group is not None else g for g in range(shard.world_size)]


def sharded_state_dict(model: nn.Module, state_dict: dict[str, Any] | None = None) -> dict[str, Any]:
    """``state_dict`` (default ``model.state_dict()``) with every EP-sharded expert tensor as a ShardedTensor.

    Entries of layers with a one-rank group stay plain tensors (they are already whole, in logical order).
    Pass the result to ``torch.distributed.checkpoint.save``; for ``dcp.load``, build it the same way from the
    model to load into (its current placement decides which rows each rank reads) and load into it: the
    experts are written in place, the other entries need ``model.load_state_dict`` as usual.
    """
    sd = dict(model.state_dict() if state_dict is None else state_dict)
    for key, shard in expert_shards(model).items():
        if shard.world_size > 1 and key in sd and not _is_sharded(sd[key]):  # (hooks may have converted it)
            sd[key] = to_sharded_tensor(sd[key], shard)
    return sd


def sharded_optimizer_state(model: nn.Module, state: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Optimizer state keyed by parameter FQN (``state`` of ``get_optimizer_state_dict``'s result) with every
    tensor of an EP-sharded expert parameter that has the parameter's shape as a ShardedTensor (scalars such as
    Adam's ``step`` stay as they are)."""
    shards = expert_shards(model)
    out = {}
    for fqn, entry in state.items():
        shard = shards.get(fqn)
        if shard is None or shard.world_size <= 1:
            out[fqn] = entry
            continue
        out[fqn] = {k: (to_sharded_tensor(v, shard) if isinstance(v, torch.Tensor) and v.dim() >= 1
                        and v.shape[0] == len(shard.expert_ids) else v) for k, v in entry.items()}
    return out


def gather_experts(local: torch.Tensor, shard: ExpertShard) -> torch.Tensor:
    """The whole ``[E, ...]`` tensor in logical expert order from every rank's ``local [E_loc, ...]``.

    A collective over the shard's EP group when ``world_size > 1`` (every rank must call it, with tensors of
    one shape and dtype); a copy otherwise.
    """
    shard.check_local(local)
    if shard.world_size <= 1:
        return local.detach().clone()
    import torch.distributed as dist

    data = local.detach().contiguous()
    parts = [torch.empty_like(data) for _ in range(shard.world_size)]
    dist.all_gather(parts, data, group=shard.group)
    full = torch.empty(shard.global_shape(data.shape), dtype=data.dtype, device=data.device)
    for g, part in enumerate(parts):
        full[torch.from_numpy(np.flatnonzero(shard.expert_gpu == g)).to(data.device)] = part
    return full


def local_experts(full: torch.Tensor, shard: ExpertShard) -> torch.Tensor:
    """This rank's rows ``[E_loc, ...]`` (its home experts, ascending) of a whole ``full [E, ...]`` tensor."""
    if full.dim() < 1 or full.shape[0] != shard.num_experts:
        raise PlanError(f"{shard.key}: expected the whole expert tensor with {shard.num_experts} rows, got shape "
                        f"{tuple(full.shape)}")
    return full[torch.from_numpy(shard.expert_ids.copy()).to(full.device)]


# ------------------------------------------------------------------ state-dict hooks (DCP without extra calls)
def local_rows(value: Any, shard: ExpertShard) -> torch.Tensor:
    """This rank's rows ``[E_loc, ...]`` of ``value``: a ShardedTensor of the whole ``[E, ...]`` tensor (its
    local shards must cover this rank's home experts), a whole ``[E, ...]`` tensor, or the local rows already.

    Raises ``PlanError`` naming the key when a ShardedTensor lacks one of this rank's experts or a tensor has
    neither ``E`` nor ``E_loc`` rows.
    """
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    if isinstance(value, ShardedTensor):
        rows: dict[int, torch.Tensor] = {}
        for s in value.local_shards():
            off, size = s.metadata.shard_offsets[0], s.metadata.shard_sizes[0]
            for i in range(size):
                rows[off + i] = s.tensor[i]
        missing = [int(e) for e in shard.expert_ids if int(e) not in rows]
        if missing:
            raise PlanError(f"{shard.key}: the sharded tensor holds no rows for experts {missing} of rank "
                            f"{shard.rank} (its local shards start at {sorted(rows)})")
        return torch.stack([rows[int(e)] for e in shard.expert_ids])
    if not isinstance(value, torch.Tensor) or value.dim() < 1:
        raise PlanError(f"{shard.key}: expected an expert tensor, got {type(value).__name__}")
    if value.shape[0] == len(shard.expert_ids):
        return value
    return local_experts(value, shard)


def _tensor_names(layer: ReplayBalancedMoE) -> dict[int, str]:
    """``id(expert tensor) -> its name relative to the layer`` (the layer's state-dict key suffix)."""
    ids = {id(t) for t in layer.experts.expert_tensors()}
    named = list(layer.named_parameters(remove_duplicate=False)) + list(layer.named_buffers(remove_duplicate=False))
    return {id(t): n for n, t in named if id(t) in ids}


def install_sharded_state_dict(layer: ReplayBalancedMoE) -> None:
    """Make ``layer``'s ``state_dict()`` describe its EP-sharded experts to DCP; idempotent.

    * state-dict post-hook: when the EP group has more than one rank, every stacked expert tensor becomes a
      ShardedTensor of the whole ``[E, ...]`` tensor (:func:`to_sharded_tensor`, views of the parameter, no
      collective), so ``torch.distributed.checkpoint.save(model.state_dict())`` writes every expert once and
      ``dcp.load`` into ``model.state_dict()`` reads this rank's experts in place (the placement current at load
      time decides which rows; it is not part of the checkpoint). ``state_dict(keep_vars=True)`` is left as is.
    * load pre-hook: ``load_state_dict`` accepts for an expert key a ShardedTensor, the whole ``[E, ...]`` tensor
      (the plain model's) or the local ``[E_loc, ...]`` rows (:func:`local_rows`).
    """
    if getattr(layer, "_sharded_state_dict_hooks", None):
        return
    views: dict[str, Any] = {}  # key -> the ShardedTensor handed out last (refreshed in place, see below)

    def shard_of(key: str, tensor: torch.Tensor) -> ExpertShard:
        return _layer_shards(layer, "", {id(tensor): [key]})[0]

    def view(key: str, value: torch.Tensor, tensor: torch.Tensor) -> Any:
        """One ShardedTensor object per key, its shards and metadata refreshed at every call: a caller that caches
        the state dict and keeps entries whose storage did not change (torchtitan's ``ModelWrapper``) then holds
        the current placement, never a stale one."""
        new = to_sharded_tensor(value, shard_of(key, tensor), cls=_expert_sharded_tensor_class())
        old = views.get(key)
        if old is None or tuple(old.size()) != tuple(new.size()) or old.dtype != new.dtype:
            views[key] = new
            return new
        return refresh_sharded_tensor(old, new)

    def post_hook(module: nn.Module, state_dict: dict, prefix: str, local_metadata: Any) -> None:
        if layer.world_size <= 1:
            return
        names = _tensor_names(layer)
        for t in layer.experts.expert_tensors():
            key = prefix + names.get(id(t), "")
            value = state_dict.get(key)
            if value is None or value is t or not isinstance(value, torch.Tensor) or _is_sharded(value):
                continue  # absent, keep_vars=True (the Parameter itself), or already converted
            state_dict[key] = view(key, value, t)

    def pre_hook(module: nn.Module, state_dict: dict, prefix: str, *args: Any) -> None:
        names = _tensor_names(layer)
        for t in layer.experts.expert_tensors():
            key = prefix + names.get(id(t), "")
            if key in state_dict:
                state_dict[key] = local_rows(state_dict[key], shard_of(key, t))

    layer._sharded_state_dict_hooks = [layer.register_state_dict_post_hook(post_hook),
                                       layer.register_load_state_dict_pre_hook(pre_hook)]


_EXPERT_ST: list[type] = []


def _expert_sharded_tensor_class() -> type:
    """A ShardedTensor whose ``untyped_storage()`` is its local rows' (the parameter's): torchtitan's
    ``ModelWrapper`` compares storages to keep its cached state dict, which a plain ShardedTensor refuses."""
    if not _EXPERT_ST:
        from torch.distributed._shard.sharded_tensor import ShardedTensor

        class ExpertShardedTensor(ShardedTensor):
            def untyped_storage(self) -> torch.UntypedStorage:
                shards = self.local_shards()
                return shards[0].tensor.untyped_storage() if shards else torch.UntypedStorage(0)

        _EXPERT_ST.append(ExpertShardedTensor)
    return _EXPERT_ST[0]


def _is_sharded(value: Any) -> bool:
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    return isinstance(value, ShardedTensor)


def _shards_by_param(models: list[nn.Module]) -> dict[int, ExpertShard]:
    """``{id(expert parameter): its ExpertShard}`` over ``models`` (how optimizer state finds its experts)."""
    out: dict[int, ExpertShard] = {}
    for model in models:
        params = model.state_dict(keep_vars=True)
        out.update((id(params[key]), shard) for key, shard in expert_shards(model).items())
    return out


def install_sharded_optimizer_state(optimizer: torch.optim.Optimizer, models: nn.Module | list[nn.Module]) -> None:
    """Make ``optimizer.state_dict()`` describe the EP-sharded experts' state to DCP; idempotent.

    State-dict post-hook: every state tensor of an expert parameter with the parameter's rows (Adam's
    ``exp_avg``, ``exp_avg_sq``) becomes a ShardedTensor of the whole ``[E, ...]`` tensor (the same description
    as the parameter; views of the state, so ``dcp.load`` writes it in place). Load pre-hook: such entries are
    turned back into this rank's rows (:func:`local_rows`: a ShardedTensor, a whole tensor or the rows). The
    placement is read from ``models`` (the model, or its pipeline parts) at each call. Works for torchtitan's
    ``OptimizersContainer`` when installed on each of its ``optimizers``.
    """
    if getattr(optimizer, "_sharded_state_hooks", None):
        return
    models = [models] if isinstance(models, nn.Module) else list(models)

    def shard_by_key(opt: torch.optim.Optimizer, state_dict: dict) -> dict[Any, ExpertShard]:
        """The state dict's parameter keys (ints, or FQNs from ``torch.distributed.checkpoint.state_dict``) of the
        EP-sharded experts, matched to the optimizer's parameters in order as ``Optimizer.load_state_dict`` does."""
        by_param = {i: shard for i, shard in _shards_by_param(models).items() if shard.world_size > 1}
        keys = [k for g in state_dict["param_groups"] for k in g["params"]]
        params = [p for g in opt.param_groups for p in g["params"]]
        return {k: by_param[id(p)] for k, p in zip(keys, params) if id(p) in by_param}

    def convert(state: dict, shards: dict[Any, ExpertShard], rows: Any, fn: Any) -> None:
        for index, shard in shards.items():
            for name, v in list(state.get(index, {}).items()):
                if _is_sharded(v) or (isinstance(v, torch.Tensor) and v.dim() >= 1 and v.shape[0] in rows(shard)):
                    state[index][name] = fn(v, shard)

    def post_hook(opt: torch.optim.Optimizer, state_dict: dict) -> dict:
        convert(state_dict["state"], shard_by_key(opt, state_dict), lambda s: (len(s.expert_ids),),
                lambda v, s: v if _is_sharded(v) else to_sharded_tensor(v, s))
        return state_dict

    def pre_hook(opt: torch.optim.Optimizer, state_dict: dict) -> dict:
        state_dict = dict(state_dict, state={k: dict(v) for k, v in state_dict["state"].items()})
        convert(state_dict["state"], shard_by_key(opt, state_dict), lambda s: (len(s.expert_ids), s.num_experts),
                local_rows)
        return state_dict

    optimizer._sharded_state_hooks = [optimizer.register_state_dict_post_hook(post_hook),
                                      optimizer.register_load_state_dict_pre_hook(pre_hook)]


def install_sharded_checkpoints(models: nn.Module | list[nn.Module], *optimizers: Any) -> None:
    """:func:`install_sharded_state_dict` on every ReplayBalancedMoE layer of ``models`` and
    :func:`install_sharded_optimizer_state` on every optimizer (a torch optimizer, or a container with an
    ``optimizers`` list such as torchtitan's ``OptimizersContainer``), so ``dcp.save`` / ``dcp.load`` of
    ``model.state_dict()`` and ``optimizer.state_dict()`` hold every expert."""
    models = [models] if isinstance(models, nn.Module) else list(models)
    for model in models:
        for layer in moe_layers(model):
            install_sharded_state_dict(layer)
    for opt in optimizers:
        for inner in getattr(opt, "optimizers", [opt]):
            install_sharded_optimizer_state(inner, models)


def optimizer_shards(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[int, tuple[ExpertShard, torch.Size]]:
    """``{index of an expert parameter in optimizer.state_dict(): (its ExpertShard, the parameter's local shape)}``.

    Indices are ``torch.optim``'s: parameters numbered in ``param_groups`` order. ``optimizer`` may be a wrapper
    with the torch optimizer in ``.optimizer`` (accelerate's ``AcceleratedOptimizer``).
    """
    opt = getattr(optimizer, "optimizer", optimizer)
    by_id = _shards_by_param([model])
    params = [p for group in opt.param_groups for p in group["params"]]
    return {i: (by_id[id(p)], p.shape) for i, p in enumerate(params) if id(p) in by_id}


def _per_expert(value: Any, shape: torch.Size) -> bool:
    """State shaped like its parameter (Adam's ``exp_avg``, ``exp_avg_sq``; SGD momentum): one row per expert."""
    return isinstance(value, torch.Tensor) and value.dim() >= 1 and value.shape == shape


def gather_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer,
                           state_dict: dict[str, Any] | None = None) -> dict[str, Any]:
    """``optimizer.state_dict()`` (or ``state_dict``) with every per-expert state tensor of an expert parameter
    whole ``[E, ...]`` in logical expert order (:func:`gather_experts`); scalars (Adam's ``step``) and the other
    parameters' state unchanged. The result is the optimizer state of the plain (unsharded) model.

    A collective over the EP group when ``world_size > 1``: the ranks first exchange which (parameter, state)
    tensors they will gather, and raise ``PlanError`` on every rank when those lists differ (a rank without
    state for a parameter), so none waits in a mismatched gather.
    """
    sd = optimizer.state_dict() if state_dict is None else state_dict
    shards = optimizer_shards(model, optimizer)
    todo = [(i, name) for i in sorted(shards) for name, v in sorted(sd["state"].get(i, {}).items())
            if _per_expert(v, shards[i][1])]
    multi = next((s for s, _ in shards.values() if s.world_size > 1), None)
    if multi is not None:
        import torch.distributed as dist

        seen: list[Any] = [None] * multi.world_size
        dist.all_gather_object(seen, todo, group=multi.group)
        if any(other != todo for other in seen):
            bad = next(g for g, other in enumerate(seen) if other != todo)
            raise PlanError(f"gather_optimizer_state: rank {bad} of the EP group holds other expert optimizer state "
                            f"than rank {multi.rank} ({len(seen[bad])} vs {len(todo)} tensors); every rank must have "
                            "stepped the same parameters")
    state = {i: dict(entry) for i, entry in sd["state"].items()}
    for i, name in todo:
        state[i][name] = gather_experts(state[i][name], shards[i][0])
    return {**sd, "state": state}


def local_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer,
                          state_dict: dict[str, Any]) -> dict[str, Any]:
    """The inverse of :func:`gather_optimizer_state`: a whole optimizer ``state_dict`` (expert state ``[E, ...]``)
    with each expert parameter's state cut to this rank's current home rows (:func:`local_experts`), ready for
    ``optimizer.load_state_dict``. Any EP size that divides E; no collective. ``PlanError`` names a per-expert
    state tensor whose shape is neither whole nor local."""
    shards = optimizer_shards(model, optimizer)
    state = {}
    for i, entry in state_dict["state"].items():
        i = int(i)
        if i not in shards:
            state[i] = entry
            continue
        shard, shape = shards[i]
        whole = torch.Size(shard.global_shape(shape))
        out = {}
        for name, v in entry.items():
            if isinstance(v, torch.Tensor) and v.dim() >= 1 and v.shape[1:] == shape[1:] and v.shape != shape:
                if v.shape != whole:
                    raise PlanError(f"{shard.key}: optimizer state {name!r} has shape {tuple(v.shape)}, neither the "
                                    f"whole {tuple(whole)} nor the local {tuple(shape)}")
                v = local_experts(v, shard)
            out[name] = v
        state[i] = out
    return {**state_dict, "state": state}
