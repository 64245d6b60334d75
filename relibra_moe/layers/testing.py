"""Helpers to run a function on a local multi-process ``torch.distributed`` group (tests, benchmarks).

``run_group(fn, world_size, *args)`` spawns ``world_size`` processes, initializes a process group
(gloo on CPU by default, through a file store in a temporary folder) with a finite timeout, calls
``fn(rank, world_size, *args)`` in each, and tears the group down. An exception in any process is
re-raised in the caller (``torch.multiprocessing.ProcessRaisedException``) and the other processes
are terminated, so a failing rank never leaves its peers waiting in a collective.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["run_group"]


def _entry(rank: int, fn: Callable, world_size: int, init: str, backend: str, timeout_s: float, threads: int,
           args: tuple) -> None:
    torch.set_num_threads(threads)
    if backend == "nccl":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group(backend, init_method=init, rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=timeout_s))
    try:
        fn(rank, world_size, *args)
    finally:
        from .dispatch import clear_dispatcher_cache

        clear_dispatcher_cache()
        dist.destroy_process_group()


def run_group(fn: Callable, world_size: int, *args, backend: str = "gloo", timeout_s: float = 60.0,
              threads: int = 1) -> None:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` spawned processes of one process group.

    ``fn`` must be importable by name (a module-level function). ``timeout_s`` bounds every
    collective (a hang becomes an error). ``threads``: torch intra-op threads per process.
    """
    with tempfile.TemporaryDirectory(prefix="relibra_pg_") as d:
        init = "file://" + os.path.join(d, "store")
        mp.spawn(_entry, args=(fn, world_size, init, backend, timeout_s, threads, args), nprocs=world_size,
                 join=True)
