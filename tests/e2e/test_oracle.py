"""Behaviour oracle: plans, scores and simulated steps of a fixed matrix equal the recorded ones.

The matrix and how to re-record it are in ``bench/oracle.py``: plan files must stay byte-identical and
every figure equal through refactors; a change on purpose re-records ``tests/data/oracle.json`` and says so.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _oracle():
    spec = importlib.util.spec_from_file_location("relibra_oracle", ROOT / "bench" / "oracle.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.slow
def test_plans_scores_and_steps_equal_the_recorded_oracle():
    oracle = _oracle()
    expected = json.loads((ROOT / "tests" / "data" / "oracle.json").read_text())
    got = oracle.compute()
    assert len(got["cases"]) + 18 * len(got["skipped"]) == len(expected["cases"])
    assert oracle.compare(expected, got) == []


def test_oracle_compare_detects_a_changed_plan_and_a_changed_figure():
    oracle = _oracle()
    case = {"plan_sha256": "a", "score": {"t_moe_total_s": 1.0}, "step": {"step_s": 2.0}}
    expected = {"cases": {"x/relibra/plan_batch/seed0": case}, "skipped": []}
    same = {"cases": {"x/relibra/plan_batch/seed0": json.loads(json.dumps(case))}, "skipped": []}
    assert oracle.compare(expected, same) == []
    other_plan = json.loads(json.dumps(same))
    other_plan["cases"]["x/relibra/plan_batch/seed0"]["plan_sha256"] = "b"
    assert oracle.compare(expected, other_plan) == ["x/relibra/plan_batch/seed0: plan file differs"]
    other_step = json.loads(json.dumps(same))
    other_step["cases"]["x/relibra/plan_batch/seed0"]["step"]["step_s"] = 2.0 + 1e-9
    assert len(oracle.compare(expected, other_step)) == 1
    assert oracle.compare(expected, {"cases": {}, "skipped": []}) == ["x/relibra/plan_batch/seed0: missing"]
