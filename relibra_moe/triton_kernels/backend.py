"""Backend selection for the kernel ops: Triton (CUDA, or the CPU interpreter) or the torch reference.

Every op in this package is a device-agnostic function. It asks :func:`use_triton` whether to launch
its Triton kernel or to run the torch reference next to it:

* CUDA tensors run the compiled Triton kernels;
* CPU tensors run the torch reference, unless ``TRITON_INTERPRET=1`` was set in the environment
  before Triton (and this package) was imported, in which case the Triton kernels run in Triton's
  CPU interpreter (the CPU test suite does this, see ``tests/conftest.py``);
* :func:`force_backend` overrides the choice for the current thread (benchmarks and tests compare the
  two paths with it).

``INTERPRET`` is read once at import, as Triton itself decides at ``@triton.jit`` decoration time
whether a kernel is interpreted: one process runs either interpreted or compiled kernels. The
interpreter is a CPU mode (it copies device tensors to the host and turns on the interpreter-only
numeric flags below), so an op on a CUDA tensor in an interpreter process raises instead of testing
the interpreter in place of the compiled code (:func:`kernel_mode` says what runs for a device).
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch
import triton
import triton.language as tl

__all__ = [
    "INTERPRET",
    "bf16_rne",
    "cast_out",
    "dot_upcast",
    "force_backend",
    "forced_backend",
    "keep_backend",
    "kernel_mode",
    "remember_backend",
    "use_triton",
]

#: True when Triton kernels run in the CPU interpreter (``TRITON_INTERPRET=1`` at import time).
INTERPRET: bool = os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "yes", "on")

_BACKENDS = ("torch", "triton")
_local = threading.local()


def forced_backend() -> str | None:
    """The backend forced for this thread by :func:`force_backend` (``None``: automatic)."""
    return getattr(_local, "backend", None)


@contextlib.contextmanager
def force_backend(backend: str | None) -> Iterator[None]:
    """Force ``"torch"`` (reference) or ``"triton"`` for the ops run by this thread inside the block.

    ``None`` restores the automatic choice. Nested blocks restore the outer choice on exit.
    Forcing ``"triton"`` on CPU tensors without ``TRITON_INTERPRET=1`` makes the ops raise.
    """
    if backend is not None and backend not in _BACKENDS:
        raise ValueError(f"backend must be one of {_BACKENDS} or None, got {backend!r}")
    previous = forced_backend()
    _local.backend = backend
    try:
        yield
    finally:
        _local.backend = previous


def remember_backend(ctx: Any) -> None:
    """Record this thread's forced backend on an autograd ``ctx`` (call it in forward / setup_context)."""
    ctx.relibra_backend = forced_backend()


def keep_backend(backward: Callable) -> Callable:
    """Run an autograd ``backward(ctx, *grads)`` under the backend that was forced when its forward ran.

    The autograd engine runs CUDA backward passes on its own device threads, where the thread-local
    choice of :func:`force_backend` would otherwise be lost.
    """

    @functools.wraps(backward)
    def wrapped(ctx: Any, *grads: Any) -> Any:
        if torch.compiler.is_compiling():  # traced with its forward, on this thread: the backend is this one
            return backward(ctx, *grads)
        with force_backend(getattr(ctx, "relibra_backend", None)):
            return backward(ctx, *grads)

    return wrapped


def kernel_mode(device: torch.device | str) -> str:
    """What an op on a tensor of ``device`` runs in this process when no backend is forced:

    ``"compiled"`` (CUDA, compiled Triton kernels), ``"interpreter"`` (CPU under ``TRITON_INTERPRET=1``)
    or ``"reference"`` (CPU, the torch reference). A CUDA device in an interpreter process raises
    ``RuntimeError``: the interpreter is a CPU mode, and CUDA tensors only ever run compiled kernels.
    """
    dev = torch.device(device)
    if dev.type == "cuda":
        if INTERPRET:
            raise RuntimeError(
                f"a {dev} tensor reached a Triton kernel in a process with TRITON_INTERPRET=1: the interpreter "
                "is a CPU mode and CUDA tensors run compiled kernels only; unset TRITON_INTERPRET before "
                "importing triton (the test suite: RELIBRA_TEST_DEVICE=cuda, see README 'GPU tests')"
            )
        return "compiled"
    return "interpreter" if INTERPRET else "reference"


def use_triton(t: torch.Tensor) -> bool:
    """Whether an op on tensor ``t`` runs its Triton kernel (True) or its torch reference (False).

    Raises ``RuntimeError`` for a CUDA tensor in an interpreter process (see :func:`kernel_mode`), and
    for ``force_backend("triton")`` on a CPU tensor without the interpreter.
    """
    backend = forced_backend()
    if backend == "torch":
        return False
    mode = kernel_mode(t.device)
    if backend == "triton":
        if mode == "reference":
            raise RuntimeError(
                f"force_backend('triton') on a {t.device} tensor needs CUDA or TRITON_INTERPRET=1 "
                "set before importing triton"
            )
        return True
    return mode != "reference"


def dot_upcast(dtype: torch.dtype) -> bool:
    """The constexpr flag that makes kernels upcast ``tl.dot`` operands to fp32.

    Only set in the interpreter, and only for bf16: the interpreter's ``tl.dot`` on bf16 operands is
    wrong (measured), while fp16 and fp32 are exact. Compiled kernels keep bf16 tensor-core dots.
    """
    return INTERPRET and dtype == torch.bfloat16


def bf16_rne(dtype: torch.dtype) -> bool:
    """The constexpr flag of :func:`cast_out`: round fp32 -> bf16 to nearest-even by hand.

    Only set in the interpreter, whose fp32 -> bf16 cast truncates (measured: about half of random
    values differ from ``torch``'s round-to-nearest by one ulp); compiled kernels round correctly.
    """
    return INTERPRET and dtype == torch.bfloat16


@triton.jit
def cast_out(v, dtype: tl.constexpr, RNE: tl.constexpr):
    """Cast fp32 ``v`` to the output ``dtype``; with ``RNE`` (interpreter, bf16) round to nearest-even
    first (ties to even: add 0x7FFF plus the lowest kept bit, clear the 16 dropped bits), so the
    interpreter's truncating cast lands on the correctly rounded value. NaNs are not preserved."""
    if RNE:
        bits = v.to(tl.float32).to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        v = bits.to(tl.float32, bitcast=True)
    return v.to(dtype)
