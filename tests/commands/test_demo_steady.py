"""The demo's steady-state section (``relibra demo``): the quick synthetic case and the per-step targets."""

from __future__ import annotations

import json

from relibra_moe.commands.demo_steady import (
    DEMO_STRATEGIES,
    case_batches,
    demo_steady_cases,
    demo_steady_state,
    steady_targets,
)
from relibra_moe.plan import json_default


def test_demo_section_quick_synthetic_only():
    rep = demo_steady_state(["qwen3-30b-a3b/mixed"], quick=True)
    assert list(rep["cases"]) == ["qwen3-30b-a3b/drift/steady"] and rep["targets"] == []
    res = rep["cases"]["qwen3-30b-a3b/drift/steady"]
    assert tuple(res["strategies"]) == DEMO_STRATEGIES and res["num_batches"] == 2 and res["layers"] == 2
    assert res["layers_total"] == 48 and "synthetic" in res["data"]
    json.dumps(rep, default=json_default)  # the demo writes it into report.json
    assert demo_steady_state([], quick=True) == {"cases": {}, "targets": []}


def test_case_batches_carry_the_trainers_overlap():
    """``relibra demo --overlap megatron,...`` runs the steady state under the first overlap: the case's cluster is
    the same preset with that overlap, the batches are the same. The synthetic case: it needs no traces, and the
    cluster is built the same way for the real one."""
    case = next(c for c in demo_steady_cases(quick=True) if c["data"] == "synthetic")
    b0, m0, c0 = case_batches(case)
    b1, m1, c1 = case_batches(case, overlap="megatron")
    assert c0.overlap == "none" and c1 == c0.with_(overlap="megatron") and m1 == m0
    assert [b.sample_expert_counts().tolist() for b in b1] == [b.sample_expert_counts().tolist() for b in b0]


def test_steady_targets_thresholds():
    res = {"qwen3-235b-a22b/drift/steady": {"reference": "relibra", "speedup": {
               "relibra": 1.0, "eplb-history": 1.12, "online": 1.04, "static": 1.3}},
           "gpt-oss-ep8/steady": {"reference": "relibra", "speedup": {"relibra": 1.0, "online": 1.05, "eplb": 0.9}}}
    got = {t["target"]: (t["threshold"], t["met"]) for t in steady_targets(res)}
    assert got == {
        "qwen3-235b-a22b/drift/steady: relibra vs eplb-history per step": (1.10, True),
        "qwen3-235b-a22b/drift/steady: relibra vs online per step": (1.05, False),
        "gpt-oss-ep8/steady: relibra vs online per step": (1.05, True),
        "gpt-oss-ep8/steady: relibra vs eplb per step": (1.05, False),
    }
