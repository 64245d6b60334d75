"""``examples/megatron_step.py`` runs and its step equals Megatron's plain step (2 gloo processes)."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

from tests.megatron_cpu import HAVE_MEGATRON, MEGATRON_REASON

pytestmark = pytest.mark.skipif(not HAVE_MEGATRON, reason=MEGATRON_REASON)

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "megatron_step.py"


@pytest.mark.slow
def test_megatron_step_example_matches_plain_megatron(capsys):
    # importable by name: the spawned workers unpickle ``megatron_step.step`` (spawn passes sys.path on)
    if str(EXAMPLE.parent) not in sys.path:
        sys.path.insert(0, str(EXAMPLE.parent))
    ex = importlib.import_module("megatron_step")
    assert ex.main(["--check"]) == 0
    out = capsys.readouterr().out
    assert "(ok)" in out
