"""``examples/rl_step_fsdp.py`` at tiny size: the RL loop on a dp 2 x ep 2 mesh of 4 gloo processes.

Two steps of: rollout with the recorder -> TraceBatch -> Planner.submit (relibra, r = 1 slot; at this size
it places no replica) while the reward is computed -> MeshMoE.relayout (experts move with their AdamW state,
the FSDP-sharded dense state stays) -> the plan's 4 micro-batches dealt over the 2 dp ranks (2 each,
gradients accumulated), replayed -> expert gradients all-reduced over dp -> AdamW. Every step must equal a
plain HF step (loss, gathered gradients, gathered parameters) and the loads every layer saw must be the plan's.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _load_example():
    # importable by name: the spawned workers unpickle ``rl_step_fsdp._worker``
    if str(EXAMPLES) not in sys.path:
        sys.path.insert(0, str(EXAMPLES))
    return importlib.import_module("rl_step_fsdp")


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_rl_step_fsdp_end_to_end():
    ex = _load_example()
    out = ex.run(ex.Config())
    assert out["checks"] == {k: True for k in out["checks"]}, out["checks"]
    steps = out["steps"]
    assert len(steps) == 2 and len(out["checks"]) == 12
    # at this size (one node of 2 ranks per EP group) the planner finds no replica worth its transfer; the
    # replica path on the mesh is tested with hand-made plans in tests/test_fsdp.py
    assert all(s["replicas"] >= 0 for s in steps)
    assert steps[0]["optimizer_state_params_at_relayout"] == 0
    assert steps[1]["optimizer_state_params_at_relayout"] > 0 and steps[1]["experts_moved"] > 0
    for s in steps:
        assert s["micro_batches"] == 4
        # ranks (d, j): dp rank d runs micro-batches d and d + 2, both of its EP ranks alike
        assert s["rounds_per_rank"] == [[0, 2], [0, 2], [1, 3], [1, 3]]
        assert abs(s["loss"] - s["ref_loss"]) <= 1e-6
        seen = np.array(s["loads_seen"])
        assert seen.shape == (4, 2, 2) and (seen.sum(axis=(1, 2)) > 0).all()
    assert steps[0]["max_grad_rel_err"] <= 1e-4
    assert steps[1]["max_grad_rel_err"] <= 1e-3
