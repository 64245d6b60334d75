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
