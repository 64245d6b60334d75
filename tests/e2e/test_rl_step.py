"""The end-to-end RL steps of ``examples/rl_step.py`` at tiny size: 4 gloo processes as 2 nodes x 2.

Two steps of: rollout with the recorder (weights synced from the trainer) -> TraceBatch -> Planner.submit
(relibra, r = 1) in the background while the reward is computed -> relayout (experts move with their AdamW
state) -> micro-batched forward/backward under replay with the replica plan -> optimizer step. Every planned
step must equal a plain HF reference step (loss, gradients, parameters after the step) and the loads every
layer saw must be the plan's.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "rl_step.py"


def _load_example():
    # importable by name: the spawned workers unpickle ``rl_step._worker`` (spawn passes sys.path on)
    if str(EXAMPLE.parent) not in sys.path:
        sys.path.insert(0, str(EXAMPLE.parent))
    return importlib.import_module("rl_step")


def test_training_rows_and_advantages():
    ex = _load_example()
    seqs = [torch.tensor([5, 6, 7, 8, 9]), torch.tensor([3, 4, 10])]
    ids, mask, labels = ex.training_rows(seqs, [3, 1], [0, 1])
    assert ids.tolist() == [[5, 6, 7, 8], [3, 4, 0, 0]]
    assert mask.tolist() == [[1, 1, 1, 1], [1, 1, 0, 0]]
    # labels only where the next token is generated (position t + 1 >= prompt length)
    assert labels.tolist() == [[-100, -100, 8, 9], [4, 10, -100, -100]]
    ids, mask, labels = ex.training_rows(seqs, [3, 1], [])
    assert ids.shape == (1, 1) and labels.tolist() == [[-100]]
    adv = ex.group_advantages(np.array([1.0, 0.0, 0.5, 0.5]), 2)
    np.testing.assert_allclose(adv, [1.0, -1.0, 0.0, 0.0], atol=1e-5)


@pytest.mark.timeout(600)
def test_rl_step_end_to_end():
    ex = _load_example()
    out = ex.run(ex.Config())
    assert out["checks"] == {k: True for k in out["checks"]}, out["checks"]
    steps = out["steps"]
    assert len(steps) == 2 and len(out["checks"]) == 14
    assert any(s["replicas"] > 0 for s in steps), "the plans should use replica slots at this size"
    # the second relayout moves experts that already have AdamW state (exp_avg, exp_avg_sq, step)
    assert steps[0]["optimizer_state_params_at_relayout"] == 0
    assert steps[1]["optimizer_state_params_at_relayout"] > 0 and steps[1]["experts_moved"] > 0
    for s in steps:
        assert s["micro_batches"] == 2
        assert abs(s["loss"] - s["ref_loss"]) <= 1e-6
        seen = np.array(s["loads_seen"])  # [M, L, G] (token, expert) pairs computed per rank
        assert seen.shape == (2, 2, 4) and seen.sum() > 0
    assert steps[0]["max_grad_rel_err"] <= 1e-4
    assert steps[1]["max_grad_rel_err"] <= 1e-3  # AdamW: the models differ by amplified rounding after step 0
