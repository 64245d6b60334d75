"""Helpers to run a function on a local multi-process ``torch.distributed`` group (tests, benchmarks).

``run_group(fn, world_size, *args)`` spawns ``world_size`` processes, initializes a process group
(through a file store in a temporary folder) with a finite timeout, calls ``fn(rank, world_size, *args)``
in each, and tears the group down. An exception in any process is re-raised in the caller
(``torch.multiprocessing.ProcessRaisedException``) and the other processes are terminated, so a failing
rank never leaves its peers waiting in a collective.

The test target (``RELIBRA_TEST_DEVICE``, see README "GPU tests") picks the group's backend and the
ranks' device:

* ``cpu`` (default): gloo, CPU tensors; workers force the torch reference (:func:`kernel_backend`).
* ``cuda``: NCCL with one GPU per rank (rank i on ``cuda:i``, also the rank's default device, so the
  tensors a worker creates without a device are CUDA tensors) and the compiled Triton kernels. A world
  larger than the visible GPUs is skipped (:class:`GroupSkipped`, a ``unittest.SkipTest`` that pytest
  reports as a skip with its reason).
"""

from __future__ import annotations

import gc
import os
import sys
import tempfile
import unittest
from collections.abc import Callable
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.utils._python_dispatch import TorchDispatchMode

from .dispatch import clear_dispatcher_cache

__all__ = ["HOST_READS", "TEST_DEVICE_ENV", "GroupSkipped", "SyncCounter", "gpu_target", "hot_replica_plan",
           "kernel_backend", "rank_device", "require_ranks", "run_group"]

#: The environment variable of the test target: ``cpu`` (default) or ``cuda``.
TEST_DEVICE_ENV = "RELIBRA_TEST_DEVICE"


class GroupSkipped(unittest.SkipTest):
    """The requested group cannot run here (more ranks than GPUs on the CUDA target, or no GPU)."""


def gpu_target() -> bool:
    """Whether this run targets CUDA (``RELIBRA_TEST_DEVICE=cuda``); ``ValueError`` names a bad value."""
    raw = os.environ.get(TEST_DEVICE_ENV, "cpu")
    value = raw.strip().lower() or "cpu"
    if value not in ("cpu", "cuda"):
        raise ValueError(f"{TEST_DEVICE_ENV}={raw!r}: expected 'cpu' or 'cuda'")
    return value == "cuda"


def rank_device() -> torch.device:
    """The device of this process's test tensors: its current CUDA device on the CUDA target (set by
    :func:`run_group` per rank), else the CPU."""
    if gpu_target() and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def kernel_backend() -> str | None:
    """The ``force_backend`` argument of test workers: ``None`` (automatic: compiled Triton kernels on
    the rank's GPU) on the CUDA target, ``"torch"`` (the reference; the interpreter is slow) on CPU."""
    return None if rank_device().type == "cuda" else "torch"


def require_ranks(world_size: int) -> None:
    """Raise :class:`GroupSkipped` now when :func:`run_group` would (call it before costly test setup)."""
    _group_backend(None, world_size)


def _group_backend(backend: str | None, world_size: int) -> str:
    """``backend`` or the target's (nccl on CUDA, else gloo); raises :class:`GroupSkipped` when NCCL's one
    GPU per rank is not there."""
    if backend is None:
        backend = "nccl" if gpu_target() else "gloo"
    if backend == "nccl":
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if n < world_size:
            raise GroupSkipped(f"an NCCL group of world size {world_size} needs one GPU per rank; {n} visible")
    return backend


def _entry(rank: int, fn: Callable, world_size: int, init: str, backend: str, timeout_s: float, threads: int,
           args: tuple) -> None:
    torch.set_num_threads(threads)
    if backend == "nccl":
        torch.cuda.set_device(rank)  # _group_backend checked one GPU per rank
        torch.set_default_device(f"cuda:{rank}")
    dist.init_process_group(backend, init_method=init, rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=timeout_s))
    try:
        fn(rank, world_size, *args)
    finally:
        clear_dispatcher_cache()
        gc.collect()  # tensors held by reference cycles go while the process group is still alive
        dist.destroy_process_group()
    # Success: leave without interpreter finalization. Gloo can abort (SIGABRT, "terminate called without an
    # active exception") in C++ destructors run at exit after a forward that raised on every rank, about one
    # run in 15 here; the work is done and torn down by now, so nothing is lost by skipping it. A failing fn
    # raises above instead, and torch.multiprocessing reports its traceback.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_group(fn: Callable, world_size: int, *args, backend: str | None = None, timeout_s: float = 60.0,
              threads: int = 1) -> None:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` spawned processes of one process group.

    ``fn`` must be importable by name (a module-level function). ``backend``: ``"gloo"`` or ``"nccl"``;
    ``None`` follows the test target (module docstring). NCCL puts rank i on ``cuda:i`` (its default
    device too) and raises :class:`GroupSkipped` with fewer than ``world_size`` GPUs. ``timeout_s``
    bounds every collective (a hang becomes an error). ``threads``: torch intra-op threads per process.
    """
    backend = _group_backend(backend, world_size)
    with tempfile.TemporaryDirectory(prefix="relibra_pg_") as d:
        init = "file://" + os.path.join(d, "store")
        mp.spawn(_entry, args=(fn, world_size, init, backend, timeout_s, threads, args), nprocs=world_size,
                 join=True)


def hot_replica_plan(num_layers: int, num_experts: int, num_gpus: int, gpus_per_node: int, hot: np.ndarray,
                     seed: int):
    """A one-micro-batch test plan: a random balanced placement per layer, and the hot expert of each
    layer (``hot [L]`` expert ids) replicated on its partner GPU ``home ^ 1`` (the node partner when
    ``gpus_per_node > 1``, else the other node, with a global replica scope); every source GPU sends
    60% of that expert's tokens home and 40% to the replica. Sample g runs on GPU g."""
    from ..plan import BatchPlan, Placement, ReplicaPlan, SamplePlacement

    G, E = num_gpus, num_experts
    rng = np.random.default_rng(seed)
    eg = np.stack([rng.permutation(np.arange(E) // (E // G)) for _ in range(num_layers)])
    rep = np.full((1, num_layers, G, 1), -1, np.int32)
    idx, share = [], []
    for l in range(num_layers):
        e = int(hot[l])
        home = int(eg[l, e])
        other = home ^ 1
        rep[0, l, other, 0] = e
        for j in range(G):
            idx += [(0, l, j, e, home), (0, l, j, e, other)]
            share += [0.6, 0.4]
    scope = "node" if gpus_per_node > 1 else "global"
    return BatchPlan(Placement(eg), SamplePlacement(np.zeros(G), np.arange(G), 1),
                     ReplicaPlan(rep, np.array(idx), np.array(share), scope), num_gpus=G,
                     gpus_per_node=gpus_per_node)


#: Tensor methods that hand a device value to the host (each one a device-to-host synchronization on a GPU),
#: counted by :class:`SyncCounter` at the Python level.
HOST_READS = ("item", "tolist", "numpy", "cpu", "__bool__", "__int__", "__float__", "__index__")


class SyncCounter(TorchDispatchMode):
    """Count what would stop the host until the device drained, while the block runs (forward and backward).

    Counted, by name:

    * aten ops that read a device value on the host or whose output shape depends on the data: those tagged
      ``data_dependent_output`` (``aten._local_scalar_dense``, ``aten.item``, ``aten.equal``) or
      ``dynamic_output_shape`` (``aten.nonzero``, ``aten.bincount``, ``aten.masked_select``,
      ``aten.repeat_interleave`` without ``output_size``, ...); ``aten.index.Tensor`` only with a boolean
      index (integer gathers have a static shape);
    * the Python-level host reads of :data:`HOST_READS` (``Tensor.item``, ``tolist``, ``numpy``, ``cpu``,
      ``__bool__``, ``__int__``, ...), on tensors of any device (the CPU run counts what a GPU run would pay).

    Work inside a kernel op of this library (namespace ``relibra``: permute, combine, grouped GEMM, replica
    copies) is one device launch: its CPU reference implementation may read offsets on the host, which
    the compiled kernel does not, so nothing inside it is counted.

    Use::

        with SyncCounter() as syncs:
            loss = model(x).sum()
            loss.backward()
        assert syncs.total == 0, syncs.counts

    Attributes:
        counts: ``{name: calls}`` (aten ops as ``aten.<op>.<overload>``, host reads as ``Tensor.<method>``).
        total: the sum of ``counts``.
    """

    def __init__(self) -> None:
        super().__init__()
        self.counts: dict[str, int] = {}
        self._kernel_depth = 0
        self._saved: dict[str, object] = {}

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def _count(self, name: str) -> None:
        if self._kernel_depth == 0:
            self.counts[name] = self.counts.get(name, 0) + 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace == "relibra":
            self._kernel_depth += 1
            try:
                return func(*args, **kwargs)
            finally:
                self._kernel_depth -= 1
        tags = func.tags
        if torch.Tag.data_dependent_output in tags or torch.Tag.dynamic_output_shape in tags:
            if func is not torch.ops.aten.index.Tensor or any(
                    isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (args[1] if len(args) > 1 else ())):
                self._count(str(func).replace("aten::", "aten."))
        return func(*args, **kwargs)

    def __enter__(self) -> SyncCounter:
        for name in HOST_READS:
            orig = getattr(torch.Tensor, name)
            self._saved[name] = orig

            def wrapped(t, *a, __orig=orig, __name=name, **kw):
                self._count(f"Tensor.{__name}")
                return __orig(t, *a, **kw)

            setattr(torch.Tensor, name, wrapped)
        return super().__enter__()

    def __exit__(self, *exc) -> None:
        try:
            for name, orig in self._saved.items():
                setattr(torch.Tensor, name, orig)
            self._saved.clear()
        finally:
            super().__exit__(*exc)
