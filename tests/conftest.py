"""Test-suite setup: Triton runs in its CPU interpreter (set before triton is imported anywhere)."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
from hypothesis import settings  # noqa: E402

settings.register_profile("ci", max_examples=30, deadline=None, derandomize=True)
settings.load_profile("ci")


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
