"""Backend choice (force_backend, use_triton) and the interpreter-only numeric helpers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import types
from pathlib import Path

import pytest
import torch
import triton
import triton.language as tl

from relibra_moe.triton_kernels import backend
from relibra_moe.triton_kernels.backend import (
    bf16_rne,
    cast_out,
    dot_upcast,
    force_backend,
    forced_backend,
    kernel_mode,
    use_triton,
)

ROOT = Path(__file__).resolve().parents[2]


def test_force_backend_nests_and_is_thread_local():
    t = torch.zeros(1)
    assert backend.INTERPRET  # tests/conftest.py sets TRITON_INTERPRET=1
    assert use_triton(t)
    with force_backend("torch"):
        assert not use_triton(t)
        seen = []
        th = threading.Thread(target=lambda: seen.append(forced_backend()))
        th.start()
        th.join()
        assert seen == [None]  # another thread keeps the automatic choice
        with force_backend("triton"):
            assert use_triton(t)
        assert forced_backend() == "torch"
    assert forced_backend() is None
    with pytest.raises(ValueError, match="cuda"):
        with force_backend("cuda"):
            pass


def test_cpu_without_interpreter_uses_reference(monkeypatch):
    monkeypatch.setattr(backend, "INTERPRET", False)
    t = torch.zeros(1)
    assert not use_triton(t)
    with force_backend("triton"), pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        use_triton(t)
    assert not dot_upcast(torch.bfloat16) and not bf16_rne(torch.bfloat16)


def test_interpreter_flags():
    assert dot_upcast(torch.bfloat16) and not dot_upcast(torch.float16) and not dot_upcast(torch.float32)
    assert bf16_rne(torch.bfloat16) and not bf16_rne(torch.float32)


@triton.jit
def _cast_kernel(x_ptr, y_ptr, N: tl.constexpr, RNE: tl.constexpr):
    offs = tl.arange(0, N)
    tl.store(y_ptr + offs, cast_out(tl.load(x_ptr + offs), y_ptr.dtype.element_ty, RNE))


def test_cast_out_rounds_to_nearest_even_like_torch():
    g = torch.Generator().manual_seed(0)
    x = torch.cat([torch.randn(1000, generator=g) * 100, torch.tensor([0.0, -0.0, 1.0, 1 + 2**-8, 1 + 3 * 2**-8])])
    x = torch.cat([x, torch.zeros(1024 - x.numel())])
    y = torch.empty(1024, dtype=torch.bfloat16)
    _cast_kernel[(1,)](x, y, 1024, True)
    assert torch.equal(y, x.to(torch.bfloat16))  # ties (1 + 2^-8, 1 + 3*2^-8) go to even
    _cast_kernel[(1,)](x, y, 1024, False)
    # the interpreter's own cast truncates: this is why RNE exists (skip if a future Triton fixes it)
    if torch.equal(y, x.to(torch.bfloat16)):
        pytest.skip("this Triton's interpreter rounds fp32 -> bf16 correctly; RNE is no longer needed")
    assert bool((y.float().abs() <= x.abs()).all())


def test_backward_keeps_the_forward_backend_on_other_threads(monkeypatch):
    """CUDA autograd runs backward on device threads: the forced backend must follow the graph."""
    from relibra_moe.triton_kernels import grouped_gemm, permute
    from relibra_moe.triton_kernels.routing import routing_metadata

    calls = []
    for mod, name in ((permute, "combine_triton"), (permute, "permute_triton"), (grouped_gemm, "grouped_mm_triton")):
        orig = getattr(mod, name)

        def spy(*a, _orig=orig, _name=name, **k):
            calls.append(_name)
            return _orig(*a, **k)

        monkeypatch.setattr(mod, name, spy)
    meta = routing_metadata(torch.tensor([[0, 1], [1, 2]]), 3, block_m=16)
    x = torch.randn(2, 16, requires_grad=True)
    w = torch.randn(3, 16, 16, requires_grad=True)
    with force_backend("torch"):
        y = permute.combine(grouped_gemm.grouped_mm(permute.permute(x, meta), w, meta), meta, torch.ones(2, 2))
    th = threading.Thread(target=lambda: y.sum().backward())
    th.start()
    th.join()
    assert x.grad is not None and w.grad is not None
    assert calls == []  # neither forward nor backward touched a Triton kernel


def test_cuda_tensors_never_meet_the_interpreter(monkeypatch):
    """In this interpreter process a CUDA tensor at a kernel raises (no silent interpreted CUDA run);
    in a compiled process CUDA is compiled and CPU the reference."""
    cuda_t = types.SimpleNamespace(device=torch.device("cuda", 0))  # use_triton reads only the device
    assert kernel_mode("cpu") == "interpreter"
    for call in (lambda: kernel_mode("cuda"), lambda: use_triton(cuda_t)):
        with pytest.raises(RuntimeError, match="interpreter is a CPU mode"):
            call()
    with force_backend("triton"), pytest.raises(RuntimeError, match="CPU mode"):
        use_triton(cuda_t)
    with force_backend("torch"):
        assert not use_triton(cuda_t)  # the reference never launches a kernel
    monkeypatch.setattr(backend, "INTERPRET", False)
    assert kernel_mode("cuda:0") == "compiled" and use_triton(cuda_t)
    assert kernel_mode("cpu") == "reference"


_PROBE = """
import json, runpy, sys
runpy.run_path(sys.argv[1])  # the test harness, as pytest imports it first
import torch
from relibra_moe.triton_kernels import backend, routing
from relibra_moe.triton_kernels._details import grouped_gemm, permute, replica_copy  # the @triton.jit kernels
try:
    mode = backend.kernel_mode(torch.device("cuda"))
except RuntimeError as exc:
    mode = "refused: " + str(exc)
kinds = sorted({type(v).__name__ for m in (grouped_gemm, permute, replica_copy, routing)
                for v in vars(m).values() if type(v).__name__ in ("JITFunction", "InterpretedFunction")})
print(json.dumps({"interpret": backend.INTERPRET, "cuda": mode, "kernels": kinds}))
"""


@pytest.mark.timeout(300)
def test_harness_selects_compiled_kernels_for_the_cuda_target():
    """tests/conftest.py with RELIBRA_TEST_DEVICE=cuda turns the interpreter off even when the environment
    sets TRITON_INTERPRET=1: the kernels are compiled JITFunctions and CUDA tensors run them. The default
    target keeps the interpreter and refuses CUDA tensors."""
    seen = {}
    for target in ("cuda", None):
        env = {**os.environ, "TRITON_INTERPRET": "1"}
        env.pop("RELIBRA_TEST_DEVICE", None)
        if target:
            env["RELIBRA_TEST_DEVICE"] = target
        res = subprocess.run([sys.executable, "-c", _PROBE, str(ROOT / "tests" / "conftest.py")], env=env,
                             capture_output=True, text=True, timeout=240)
        assert res.returncode == 0, res.stderr[-3000:]
        seen[target] = json.loads(res.stdout.strip().splitlines()[-1])
    assert seen["cuda"] == {"interpret": False, "cuda": "compiled", "kernels": ["JITFunction"]}
    assert seen[None]["interpret"] is True and seen[None]["kernels"] == ["InterpretedFunction"]
    assert seen[None]["cuda"].startswith("refused:") and "CPU mode" in seen[None]["cuda"]
