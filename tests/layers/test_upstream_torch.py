"""The torch adapter (relibra_moe/layers/upstream_torch.py) against the installed torch: the version it was written
for, and each reach on torch's real classes (a torch release that moves one fails the test named for it)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from relibra_moe.layers import upstream_torch as ut


def test_installed_torch_is_a_tested_version():
    assert ut.version_in_range(torch.__version__, ut.TESTED), (
        f"torch {torch.__version__} is outside the range relibra_moe/layers/upstream_torch.py was tested against "
        f"{ut.TESTED}: check each reach there against it, then widen TESTED")


@pytest.mark.parametrize("version, ok", [("2.13.0+cpu", True), ("2.13.1", True), ("2.14.0", False),
                                         ("2.12.9", False), ("2.13.0a0+git1234", True), ("garbage", False)])
def test_version_in_range(version, ok):
    assert ut.version_in_range(version, ((2, 13), (2, 14))) is ok


class _Twice:
    def forward(self, x):
        return 2 * super().forward(x)


def test_add_mixin_keeps_parameters_hooks_and_isinstance():
    torch.manual_seed(0)
    lin = nn.Linear(3, 2)
    ref = nn.Linear(3, 2)
    ref.load_state_dict(lin.state_dict())
    seen = []
    lin.register_forward_hook(lambda m, a, out: seen.append(out))
    weight, keys = lin.weight, list(lin.state_dict())
    assert ut.add_mixin(lin, _Twice) is lin
    x = torch.randn(4, 3)
    out = lin(x)
    torch.testing.assert_close(out, 2 * ref(x))
    assert isinstance(lin, nn.Linear) and isinstance(lin, _Twice)
    assert lin.weight is weight and list(lin.state_dict()) == keys
    assert len(seen) == 1 and seen[0] is out  # hooks registered before the swap still run
    assert type(lin).__name__ == "ReplayLinear" and type(lin).__mro__[1] is _Twice
    ut.add_mixin(lin, _Twice)  # a no-op the second time
    assert type(lin).__mro__.count(_Twice) == 1
    other = ut.add_mixin(nn.Linear(3, 2), _Twice)
    assert type(other) is type(lin)  # one class per (base, mixin)


def test_add_mixin_after_puts_the_module_class_first():
    class Protocol:
        def extra(self) -> str:
            return "protocol"

        def forward(self, x):  # never reached: the module's own forward comes first in the MRO
            raise AssertionError

    lin = ut.add_mixin(nn.Linear(2, 2), Protocol, after=True)
    assert type(lin).__mro__[1] is nn.Linear and type(lin).__name__ == "Linear" and lin.extra() == "protocol"
    lin(torch.zeros(1, 2))


def test_snapshot_and_restore_undo_an_in_place_swap():
    seq = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
    seq[0].register_buffer("b", torch.zeros(1), persistent=False)
    before = {k: v.clone() for k, v in seq.state_dict().items()}
    cls0 = type(seq[0])
    saved = ut.snapshot_modules(list(seq.modules()))
    ut.add_mixin(seq[0], _Twice)
    seq[0].weight = nn.Parameter(torch.ones(2, 2))
    seq[0].register_buffer("b", torch.ones(1), persistent=True)
    seq[1] = nn.Tanh()
    ut.restore_modules(saved)
    assert type(seq[0]) is cls0 and isinstance(seq[1], nn.ReLU)
    assert seq[0]._non_persistent_buffers_set == {"b"} and float(seq[0].b) == 0.0
    assert seq.state_dict().keys() == before.keys()
    for k, v in seq.state_dict().items():
        torch.testing.assert_close(v, before[k])


def _ddp_reaches(rank: int, world: int) -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    setattr(model, ut.DDP_IGNORE_ATTR, ["1.weight"])
    assert ut.active_ddp_module() is None
    ddp = nn.parallel.DistributedDataParallel(model)
    assert ut.ddp_ignored_names(ddp) == {"1.weight"}
    seen = []
    model[0].register_forward_hook(lambda m, a, out: seen.append(ut.active_ddp_module()))
    ddp(torch.zeros(1, 2))
    assert seen == [ddp]  # the wrapper whose forward runs
    assert ut.active_ddp_module() is None
    _sharded_tensor_reaches()
    _fsdp_and_mesh_reaches()
    store = ut.default_store()
    store.set("relibra/test", "here")
    assert store.get("relibra/test") == b"here"


def _fsdp_and_mesh_reaches() -> None:
    """FSDP2's managed parameters by module name (the sharded ones too, not the ignored ones); a 2-D mesh
    flattened to one dimension over all its ranks."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp", "ep"))
    flat = ut.flatten_mesh(mesh, "dp_ep")
    assert flat.ndim == 1 and flat.size() == 1 and flat.mesh_dim_names == ("dp_ep",)
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    kept = model[1].weight
    fully_shard(model[0], mesh=flat)
    fully_shard(model, mesh=flat, ignored_params={kept})
    managed = ut.fsdp_managed_params(model)
    assert managed[id(model[0].weight)] == "0" and managed[id(model[1].bias)] == "<root>"
    assert id(kept) not in managed


def _sharded_tensor_reaches() -> None:
    """A ShardedTensor built from this rank's shards without a collective, of a given subclass, its local shards
    views of the data (a load writes it in place); refreshed in place with another's shards."""
    from torch.distributed._shard.metadata import ShardMetadata
    from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor
    from torch.distributed._shard.sharded_tensor.metadata import ShardedTensorMetadata, TensorProperties

    def build(data: torch.Tensor, cls=None):
        metas = [ShardMetadata([i, 0], [1, 3], "rank:0/cpu") for i in range(2)]
        props = TensorProperties(dtype=data.dtype, layout=data.layout, requires_grad=False,
                                 memory_format=torch.contiguous_format, pin_memory=False)
        md = ShardedTensorMetadata(shards_metadata=metas, size=torch.Size([2, 3]), tensor_properties=props)
        return ut.sharded_tensor([Shard(data[i:i + 1], metas[i]) for i in range(2)], md, None, cls)

    class Sub(ShardedTensor):
        pass

    data = torch.arange(6.0).view(2, 3)
    st = build(data, Sub)
    assert type(st) is Sub and tuple(st.size()) == (2, 3)
    st.local_shards()[1].tensor.fill_(7.0)
    assert data[1].tolist() == [7.0, 7.0, 7.0]  # the shards are views of the data
    other = torch.zeros(2, 3)
    assert ut.refresh_sharded_tensor(st, build(other)) is st
    assert st.local_shards()[0].tensor.data_ptr() == other.data_ptr()


def test_ddp_sharded_tensor_fsdp_mesh_and_store_reaches():
    from relibra_moe.layers.testing import run_group

    run_group(_ddp_reaches, 1, backend="gloo", timeout_s=120)
