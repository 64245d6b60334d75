"""Test-suite setup: the run's target device, chosen before triton is imported anywhere.

``RELIBRA_TEST_DEVICE`` (README "GPU tests") selects it:

* unset or ``cpu`` (the default): Triton kernels run in the CPU interpreter (``TRITON_INTERPRET=1``
  unless the environment sets it), the multi-process suites run on gloo with CPU tensors.
  ``tests/e2e/test_kernels_cuda.py`` on a machine with a GPU runs itself in a child process of the CUDA
  target, so CUDA tensors never meet the interpreter.
* ``cuda``: ``TRITON_INTERPRET=0`` whatever the environment says (compiled kernels); the modules in
  ``GPU_MODULES`` run, the multi-process suites on NCCL with one GPU per rank and CUDA tensors
  (``relibra_moe.layers.testing.run_group``); every other module is a CPU-target test and is skipped.
"""

from __future__ import annotations

import os

TEST_DEVICE_ENV = "RELIBRA_TEST_DEVICE"
TARGET = os.environ.get(TEST_DEVICE_ENV, "cpu").strip().lower() or "cpu"
if TARGET not in ("cpu", "cuda"):
    raise ValueError(f"{TEST_DEVICE_ENV}={os.environ[TEST_DEVICE_ENV]!r}: expected 'cpu' or 'cuda'")
if TARGET == "cuda":
    os.environ["TRITON_INTERPRET"] = "0"  # the interpreter is a CPU mode: CUDA tests run compiled kernels
else:
    os.environ.setdefault("TRITON_INTERPRET", "1")

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
from hypothesis import settings  # noqa: E402

settings.register_profile("ci", max_examples=30, deadline=None, derandomize=True)
settings.load_profile("ci")

TESTS = Path(__file__).resolve().parent

#: Test modules of the CUDA target (paths under tests/): the compiled-kernel checks and the multi-process
#: suites (run_group).
GPU_MODULES = frozenset({
    "layers/test_testing.py",
    "e2e/test_kernels_cuda.py",
    "layers/test_dispatch.py",
    "layers/test_moe.py",
    "layers/test_relayout.py",
    "layers/test_replica_buffer.py",
    "integrations/test_hf_families.py",
})


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if TARGET != "cuda":
        return
    skip = pytest.mark.skip(reason=f"CPU-target test: run it without {TEST_DEVICE_ENV}=cuda")
    for item in items:
        if item.path.resolve().relative_to(TESTS).as_posix() not in GPU_MODULES:
            item.add_marker(skip)


def pytest_report_header(config: pytest.Config) -> str:
    return f"relibra test target: {TARGET} (TRITON_INTERPRET={os.environ['TRITON_INTERPRET']})"


def _traces_dir() -> Path:
    env = os.environ.get("RELIBRA_TRACES")
    if env:
        return Path(env)
    return Path(__file__).resolve().parents[2] / "shared" / "traces"


@pytest.fixture(scope="session")
def traces_dir() -> Path:
    """The real routing traces; tests using it skip when the folder is absent."""
    d = _traces_dir()
    if not (d / "gpt-oss-20b" / "topk_ids.npz").exists():
        pytest.skip(f"real routing traces not found at {d} (set RELIBRA_TRACES)")
    return d


def two_hot_batch(seed: int, lengths: tuple[int, int], n: int = 16, micro_batch_size: int = 4):
    """gpt-oss-20b routing (32 experts, top-4, all layers) of ``n`` samples, each with two hot experts
    (10x the others' weight, Gumbel top-k), ``lengths`` = [low, high) tokens per sample; micro-batches of
    ``micro_batch_size`` in order."""
    import numpy as np

    from relibra_moe.specs import model_preset
    from relibra_moe.trace import RoutingTrace, TraceBatch

    layers = model_preset("gpt-oss-20b").num_layers
    rng = np.random.default_rng(seed)
    traces = []
    for _ in range(n):
        s = int(rng.integers(*lengths))
        p = np.ones(32)
        p[rng.integers(0, 32, size=2)] = 10.0
        g = np.log(p) + rng.gumbel(size=(s, layers, 32))
        ids = np.argpartition(-g, 3, axis=2)[:, :, :4]
        traces.append(RoutingTrace(ids, np.arange(layers), 32, 4, source="test"))
    return TraceBatch(traces, micro_batch=np.arange(n) // micro_batch_size)
