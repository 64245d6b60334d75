"""What the benchmarks under bench/ share: the result file, the environment record, the timers, the routing
generator and the error measure. A kernel benchmark calls :func:`select_kernel_mode` before anything imports
Triton; the others (CPU measurements of the torch paths) leave ``TRITON_INTERPRET`` as they find it.

Timers: :func:`bench_ms` (Triton's ``do_bench``, CUDA only: warm-up and repetitions by time, median) for
kernels; :func:`time_ms` (CUDA events on GPU, ``perf_counter`` on CPU, a fixed number of calls, median) for
whole layers and anything that also runs on CPU.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from relibra_moe.atomic import write_text

if TYPE_CHECKING:
    from relibra_moe.triton_kernels.grouped_gemm import ExpertWeights

ROUTINGS = ("uniform", "skewed", "zipf")


def select_kernel_mode() -> None:
    """Compiled Triton kernels on CUDA whatever the environment, the CPU interpreter without a GPU (sets
    ``TRITON_INTERPRET``, which Triton and :mod:`relibra_moe.triton_kernels.backend` read at import)."""
    os.environ["TRITON_INTERPRET"] = "0" if torch.cuda.is_available() else "1"


class JsonReport:
    """A JSON document rewritten (atomically) at ``path`` after every change."""

    def __init__(self, path: Path, **header) -> None:
        self.path = Path(path)
        self.data: dict = {"date": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"), **header}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.save()

    def set(self, *keys_and_value) -> None:
        """``set("a", "b", v)``: ``data["a"]["b"] = v`` (creating the dicts), then write the file."""
        *keys, value = keys_and_value
        d = self.data
        for k in keys[:-1]:
            d = d.setdefault(k, {})
        d[keys[-1]] = value
        self.save()

    def get(self, *keys):
        """``data[k0][k1]...``."""
        d = self.data
        for k in keys:
            d = d[k]
        return d

    def save(self) -> None:
        write_text(self.path, json.dumps(self.data, indent=2, default=str))


def environment() -> dict:
    """Device and package versions of this run."""
    import triton

    env = {"python": platform.python_version(), "torch": torch.__version__, "triton": triton.__version__,
           "cuda_runtime": torch.version.cuda, "triton_interpret": os.environ.get("TRITON_INTERPRET")}
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        env.update(device=torch.cuda.get_device_name(0), capability=f"{p.major}.{p.minor}",
                   sms=p.multi_processor_count, memory_gib=round(p.total_memory / 2**30, 1))
    else:
        env["device"] = "cpu (Triton interpreter)"
    return env


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b| (float64)."""
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-12)) if b.numel() else 0.0


def routing_ids(T: int, k: int, E: int, device, routing: str = "uniform", hot_share: float = 0.3,
                seed: int = 0, skew: float = 1.0) -> torch.Tensor:
    """int64 ``[T, k]`` expert ids, ``routing`` one of

    * ``uniform``: k distinct experts per token, balanced load;
    * ``skewed``: the uniform ids with a random ``hot_share`` of all pairs moved to expert 0 (a token may
      then repeat an expert: the kernels do not need distinct ids);
    * ``zipf``: k distinct experts per token drawn with popularity ~ rank^-``skew`` (ranks shuffled).
    """
    if routing == "zipf":
        rng = np.random.default_rng(seed)
        pop = 1.0 / np.arange(1, E + 1) ** skew
        pop = rng.permutation(pop / pop.sum())
        ids = np.stack([rng.choice(E, size=k, replace=False, p=pop) for _ in range(T)])
        return torch.from_numpy(ids).to(device)
    g = torch.Generator(device=device).manual_seed(seed)
    ids = torch.rand(T, E, generator=g, device=device).topk(k, dim=1).indices
    if routing == "skewed":
        n = T * k
        hot = torch.randperm(n, generator=g, device=device)[: round(hot_share * n)]
        ids.view(-1)[hot] = 0
    elif routing != "uniform":
        raise ValueError(f"routing must be one of {ROUTINGS}, got {routing!r}")
    return ids


def replica_slot_ids(ids: torch.Tensor, E: int, replicated: torch.Tensor) -> torch.Tensor:
    """Slot ids over ``E + r`` slots: every second pair of expert ``replicated[j]`` goes to slot ``E + j``."""
    flat = ids.reshape(-1)
    out = flat.clone()
    pos = torch.arange(flat.numel(), device=ids.device)
    for j, e in enumerate(replicated.tolist()):
        out = torch.where((flat == e) & (pos % 2 == 1), torch.full_like(out, E + j), out)
    return out.view(ids.shape)


def expert_weights(home: torch.Tensor, replica: torch.Tensor) -> ExpertWeights:
    """``ExpertWeights`` over ``E + r`` slots: slots ``< E`` the home rows, slot ``E + j`` replica row j."""
    from relibra_moe.triton_kernels.grouped_gemm import ExpertWeights

    E, r, dev = home.shape[0], replica.shape[0], home.device
    src = torch.cat([torch.zeros(E, dtype=torch.long, device=dev), torch.ones(r, dtype=torch.long, device=dev)])
    idx = torch.cat([torch.arange(E, device=dev), torch.arange(r, device=dev)])
    return ExpertWeights((home, replica), src, idx)


def bench_ms(fn: Callable[[], object]) -> float:
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median"))


def time_ms(fn: Callable[[], object], iters: int, warmup: int, *, cuda: bool | None = None) -> float:
    """Median wall time of ``fn`` in ms over ``iters`` calls after ``warmup``: CUDA events when ``cuda`` (default:
    a GPU is present), ``perf_counter`` otherwise (host-side work such as a gloo collective)."""
    cuda = torch.cuda.is_available() if cuda is None else cuda
    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(iters):
        if cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            torch.cuda.synchronize()
            ts.append(a.elapsed_time(b))
        else:
            t0 = time.perf_counter()
            fn()
            ts.append(1e3 * (time.perf_counter() - t0))
    return sorted(ts)[len(ts) // 2]
