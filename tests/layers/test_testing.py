"""The multi-process harness's test target: gloo and the torch reference on CPU by default; on the
CUDA target (RELIBRA_TEST_DEVICE=cuda) NCCL with one GPU per rank, a world larger than the visible GPUs
skipped with its reason, and bad values of the switch named."""

from __future__ import annotations

import unittest

import pytest
import torch
import torch.distributed as dist

from relibra_moe.layers import testing
from relibra_moe.layers.testing import GroupSkipped, gpu_target, kernel_backend, rank_device, run_group


def test_default_target_is_cpu_and_gloo(monkeypatch):
    monkeypatch.delenv(testing.TEST_DEVICE_ENV, raising=False)
    assert not gpu_target()
    assert rank_device() == torch.device("cpu") and kernel_backend() == "torch"
    assert testing._group_backend(None, 4) == "gloo"
    monkeypatch.setenv(testing.TEST_DEVICE_ENV, " CPU ")
    assert not gpu_target()


def test_bad_target_is_named(monkeypatch):
    monkeypatch.setenv(testing.TEST_DEVICE_ENV, "nccl")
    with pytest.raises(ValueError, match="RELIBRA_TEST_DEVICE='nccl': expected 'cpu' or 'cuda'"):
        gpu_target()


def test_cuda_target_needs_one_gpu_per_rank(monkeypatch):
    monkeypatch.setenv(testing.TEST_DEVICE_ENV, "cuda")
    assert gpu_target()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert testing._group_backend(None, 1) == "nccl"  # one GPU: the world-size-1 cases run
    with pytest.raises(GroupSkipped, match="NCCL group of world size 2 needs one GPU per rank; 1 visible"):
        testing._group_backend(None, 2)
    assert issubclass(GroupSkipped, unittest.SkipTest)  # pytest reports it as a skip
    assert testing._group_backend("gloo", 2) == "gloo"  # an explicit backend is kept
    testing.require_ranks(1)
    with pytest.raises(GroupSkipped, match="world size 8 needs one GPU per rank"):
        testing.require_ranks(8)


def test_cuda_target_without_a_gpu_skips_the_group(monkeypatch):
    monkeypatch.setenv(testing.TEST_DEVICE_ENV, "cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert rank_device() == torch.device("cpu") and kernel_backend() == "torch"
    with pytest.raises(GroupSkipped, match="0 visible"):
        run_group(_worker, 1)


def _worker(rank: int, world: int, out: str) -> None:
    t = torch.ones(1)
    dist.all_reduce(t)
    with open(f"{out}/rank{rank}", "w") as f:
        f.write(f"{dist.get_backend()} {t.device} {float(t)} {kernel_backend()}")


@pytest.mark.timeout(120)
def test_cpu_group_runs_on_gloo(tmp_path, monkeypatch):
    monkeypatch.delenv(testing.TEST_DEVICE_ENV, raising=False)
    run_group(_worker, 2, str(tmp_path), timeout_s=60)
    assert [(tmp_path / f"rank{r}").read_text() for r in range(2)] == ["gloo cpu 2.0 torch"] * 2


def test_sync_counter_counts_host_reads_and_data_dependent_ops():
    """Each way of waiting for the device is counted by name; integer gathers, static-shape ops and the inside
    of a kernel op of this library are not."""
    from relibra_moe.layers.testing import SyncCounter
    from relibra_moe.triton_kernels.permute import permute
    from relibra_moe.triton_kernels.routing import routing_metadata

    t = torch.tensor([[0, 1], [1, 2]])
    meta = routing_metadata(t, 3)
    x = torch.randn(2, 4)
    with SyncCounter() as syncs:
        y = t * 2 + 1
        y = y[torch.tensor([1, 0])]  # integer gather: static shape
        permute(x, meta)  # a relibra kernel op: its CPU reference may read offsets, the kernel does not
    assert syncs.counts == {}, syncs.counts
    with SyncCounter() as syncs:
        t.sum().item()
        bool(t.any())
        int(t[0, 0])
        t.tolist()
        t.numpy()
        t.cpu()
        t.nonzero()
        t[t > 0]
        torch.bincount(t.view(-1))
    c = syncs.counts
    for name in ("Tensor.item", "Tensor.__bool__", "Tensor.__int__", "Tensor.tolist", "Tensor.numpy", "Tensor.cpu",
                 "aten.nonzero.default", "aten.index.Tensor", "aten.bincount.default",
                 "aten._local_scalar_dense.default"):
        assert c.get(name, 0) >= 1, (name, c)
    assert syncs.total == sum(c.values())
    assert torch.Tensor.item is not None and "wrapped" not in torch.Tensor.item.__name__  # restored on exit
