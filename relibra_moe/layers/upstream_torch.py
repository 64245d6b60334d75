"""Every place the package relies on torch beyond its documented API, in one adapter.

Written against torch 2.13 (:data:`TESTED`); ``tests/layers/test_upstream_torch.py`` asserts the installed
version is in that range and exercises each reach below against the real torch classes, so a torch release
that moves one fails a test named for it instead of a training step.

- **DDP's ignore list** (:data:`DDP_IGNORE_ATTR`): ``DistributedDataParallel`` reads
  ``module._ddp_params_and_buffers_to_ignore`` of the module it wraps at construction and keeps the names in
  ``ddp.parameters_to_ignore`` (:func:`ddp_ignored_names`). The attribute is the door torch itself sets
  (``DistributedDataParallel._set_params_and_buffers_to_ignore_for_model``); no public setter exists.
- **The DDP wrapper running a forward** (:func:`active_ddp_module`): ``DistributedDataParallel`` sets the
  class attribute ``_active_ddp_module`` around its forward (read through ``_get_active_ddp_module``, which
  exists for TorchDynamo). An expert-parallel layer has no other way to learn, inside its forward, which
  data-parallel wrapper (and group) averages its gradients.
- **A live module gains a mixin** (:func:`add_mixin`): ``module.__class__`` becomes a cached subclass of its
  class and the mixin, so the instance keeps its parameters, buffers, hooks and ``isinstance`` (what the
  frameworks' hooks key on) while the mixin adds methods. Used where a framework has no door to extend the
  forward of a module it built (the Hugging Face router's ``replay_ids``, torchtitan's ``Module`` protocol).
- **DCP's sharded tensors** (:func:`sharded_tensor`, :func:`refresh_sharded_tensor`): ``ShardedTensor`` lives in
  the private ``torch.distributed._shard`` package (DCP and Megatron read it); a rank builds one from its own
  shards and the global metadata without a collective only through the private
  ``ShardedTensor._init_from_local_shards_and_global_metadata`` (the public ``init_from_local_shards``
  all-gathers the metadata), always as a plain ``ShardedTensor``, so a subclass is given by class assignment.
- **FSDP2's managed parameters** (:func:`fsdp_managed_params`): ``fully_shard`` keeps the parameters it
  manages in its private state (``_get_fsdp_state()._fsdp_param_groups``, each ``FSDPParam`` with its
  ``_module_info``); there is no public listing, and a swapped model must refuse an FSDP that shards experts.
- **Flattening a device mesh** (:func:`flatten_mesh`): ``DeviceMesh._flatten`` (private in 2.13, what
  torchtitan uses too) gives the one-dimensional mesh over all its ranks that FSDP shards dense parameters on.
- **The default group's store** (:func:`default_store`): ``distributed_c10d._get_default_store()``, the
  key-value store every rank reaches without a collective (a rendezvous that a missing rank cannot hang).
- **Undo of an in-place swap** (:func:`snapshot_modules`, :func:`restore_modules`): each module's class and
  its parameter, buffer and child tables (``_parameters``, ``_buffers``, ``_modules``,
  ``_non_persistent_buffers_set``), so a swap that fails part way leaves the model as it was.
"""

from __future__ import annotations

from functools import cache
from typing import Any

from torch import nn

__all__ = ["DDP_IGNORE_ATTR", "TESTED", "active_ddp_module", "add_mixin", "ddp_ignored_names", "default_store",
           "flatten_mesh", "fsdp_managed_params", "mixin_class", "refresh_sharded_tensor", "restore_modules",
           "sharded_tensor", "snapshot_modules", "version_in_range"]

#: torch versions this adapter was written and tested against: ``(lowest, first untested)`` major.minor.
TESTED: tuple[tuple[int, int], tuple[int, int]] = ((2, 13), (2, 14))

#: The attribute of a wrapped module that DDP reads at construction: names of parameters and buffers to leave alone.
DDP_IGNORE_ATTR = "_ddp_params_and_buffers_to_ignore"

_TABLES = ("_parameters", "_buffers", "_modules", "_non_persistent_buffers_set")


def version_in_range(version: str, tested: tuple[tuple[int, int], tuple[int, int]]) -> bool:
    """Whether ``version`` (``"2.13.0+cpu"``, ``"5.24.0"``, ``"0.16.1rc1"``) is in ``[lowest, first untested)``
    by major.minor."""
    parts = version.split("+")[0].split(".")
    try:
        mm = (int(parts[0]), int("".join(c for c in parts[1] if c.isdigit()) or 0))
    except (IndexError, ValueError):
        return False
    return tested[0] <= mm < tested[1]


def active_ddp_module() -> nn.Module | None:
    """The ``DistributedDataParallel`` wrapper whose forward is running (``None`` outside one, or without
    ``torch.distributed``)."""
    try:
        from torch.nn.parallel import DistributedDataParallel
    except ImportError:  # pragma: no cover - torch without distributed
        return None
    return DistributedDataParallel._get_active_ddp_module()


def ddp_ignored_names(ddp: nn.Module) -> set[str]:
    """Names of the parameters and buffers ``ddp`` (a ``DistributedDataParallel``) leaves alone."""
    return set(getattr(ddp, "parameters_to_ignore", ()))


@cache
def mixin_class(base: type, mixin: type, *, after: bool = False) -> type:
    """The subclass of ``base`` and ``mixin`` (``mixin`` first in the MRO; ``after=True``: ``base`` first), one per
    pair. Named ``Replay<base>`` (mixin first) or ``<base>`` (after), in the module of the mixin (resp. base)."""
    if after:
        return type(base.__name__, (base, mixin), {"__module__": base.__module__, "__qualname__": base.__qualname__})
    return type(f"Replay{base.__name__}", (mixin, base), {"__module__": mixin.__module__})


def add_mixin(module: nn.Module, mixin: type, *, after: bool = False) -> nn.Module:
    """Give the live ``module`` the methods of ``mixin`` (see the module docstring); returns ``module``. A no-op
    when its class already is one."""
    if not isinstance(module, mixin):
        module.__class__ = mixin_class(type(module), mixin, after=after)
    return module


def snapshot_modules(modules: list[nn.Module]) -> list[tuple[nn.Module, type, dict[str, Any]]]:
    """Each module's class and attributes, its parameter, buffer and child tables copied (shallow: the tensors and
    children themselves are referenced, nothing is cloned)."""
    out = []
    for m in modules:
        d = {k: (type(v)(v) if k in _TABLES else v) for k, v in vars(m).items()}
        out.append((m, type(m), d))
    return out


def restore_modules(state: list[tuple[nn.Module, type, dict[str, Any]]]) -> None:
    """Put every module of a :func:`snapshot_modules` back as it was (class and attributes)."""
    for m, cls, d in state:
        m.__class__ = cls
        vars(m).clear()
        vars(m).update(d)


def sharded_tensor(local_shards: list[Any], metadata: Any, group: Any, cls: type | None = None) -> Any:
    """A ``ShardedTensor`` of this rank's ``local_shards`` (``Shard`` objects) and the global ``metadata``
    (``ShardedTensorMetadata``) over ``group``, without a collective; of class ``cls`` (a ``ShardedTensor``
    subclass adding no state) when given."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    out = ShardedTensor._init_from_local_shards_and_global_metadata(local_shards, metadata, process_group=group)
    if cls is not None:
        out.__class__ = cls
    return out


def refresh_sharded_tensor(old: Any, new: Any) -> Any:
    """``old`` (a ``ShardedTensor``) made to hold ``new``'s shards and metadata, the same object (a caller that
    cached ``old`` sees the new placement); returns ``old``."""
    vars(old).update(vars(new))
    return old


def fsdp_managed_params(model: nn.Module) -> dict[int, str]:
    """``id(param) -> name of the fully_shard module`` for every parameter an FSDP2 module of ``model`` manages
    (its original and its sharded parameter object)."""
    from torch.distributed.fsdp import FSDPModule

    out: dict[int, str] = {}
    for mname, mod in model.named_modules():
        if not isinstance(mod, FSDPModule):
            continue
        state = mod._get_fsdp_state()
        for group in getattr(state, "_fsdp_param_groups", ()) or ():
            for fp in group.fsdp_params:
                info = fp._module_info
                for p in (getattr(info.module, info.param_name, None), getattr(fp, "sharded_param", None)):
                    if p is not None:
                        out[id(p)] = mname or "<root>"
    return out


def flatten_mesh(mesh: Any, name: str) -> Any:
    """The one-dimensional ``DeviceMesh`` named ``name`` over all the ranks of ``mesh``."""
    return mesh._flatten(name)


def default_store() -> Any:
    """The ``torch.distributed`` store of the default process group (``set`` / ``get`` / ``wait`` by key)."""
    import torch.distributed as dist

    return dist.distributed_c10d._get_default_store()
