"""plan_stats.py: ``PlanStats`` reads the JSON object a plan file holds (old files included: unknown keys kept) and
writes back exactly that object; the timing fields stay out of saved files; key reads still work, with a
DeprecationWarning naming the attribute."""

from __future__ import annotations

import json
import warnings

import numpy as np
import pytest

from relibra_moe.errors import PlanError
from relibra_moe.plan import BatchPlan, Placement, ReplicaPlan, SamplePlacement
from relibra_moe.plan_stats import MigrationStats, PlanStats, PortfolioStats, RelocateStats
from relibra_moe.planners.strategies import plan_batch
from relibra_moe.specs import ClusterSpec, ModelSpec
from relibra_moe.synthetic import rl_batch

#: A plan file's stats_json as relibra wrote it before the stats were typed (keys of a relibra plan), plus a key
#: no version knows at the top and inside a nested record.
OLD = {
    "strategy": "relibra", "seed": 3, "replica_slots": 1, "repack": False, "fallbacks": 0,
    "options": {"iters": 100}, "objective": 1.25e-5, "batch_sha1": "ab" * 20,
    "rounds": [{"reorder": {"iters": 100, "objective": 2.0}, "locality": {"objective": 1.25e-5}}],
    "migration": {"enabled": True, "relabel": [1, 0, 3, 2], "moved_after_relabel": 4, "moved": 2,
                  "layers_kept": [1], "gain_s": [1e-6, 0.0], "move_s": [2e-6, 3e-6], "relayout_s": 2e-6,
                  "from_the_future": 7},
    "relocate": {"annealed": 1.0, "start": {"fallback": "deadline"}, "chosen": "annealed"},
    "portfolio": {"chosen": "previous@length-balanced", "step_s": {"relibra": 2.0, "static": 3.0},
                  "pruned": {"online": 2.5}},
    "eplb_replicas_dropped": 2, "newer_key": {"x": [1, 2]},
}


def test_the_json_form_round_trips_and_reads_as_attributes():
    st = PlanStats.from_dict(json.loads(json.dumps(OLD)))
    assert st.to_dict() == OLD
    assert isinstance(st.migration, MigrationStats) and st.migration.layers_kept == [1]
    assert st.migration.extra == {"from_the_future": 7} and st.extra == {"newer_key": {"x": [1, 2]}}
    assert isinstance(st.portfolio, PortfolioStats) and st.portfolio.pruned == {"online": 2.5}
    assert isinstance(st.relocate, RelocateStats) and st.relocate.start == {"fallback": "deadline"}
    assert st.sample_owner is None and "sample_owner" not in st.to_dict()  # absent stays absent


def test_a_loaded_plan_file_writes_back_the_same_bytes(tmp_path):
    model = ModelSpec("t", hidden=64, ffn=32, num_experts=8, top_k=2, num_layers=2)
    cluster = ClusterSpec(nodes=2, gpus_per_node=2)
    batch = rl_batch(model, "mixed", 2, responses_per_prompt=4, seed=1, micro_batch_size=4, max_len=48)
    plan = plan_batch(batch, model, cluster, "relibra", replica_slots=1, iters=50, locality_iters=30, num_seeds=1)
    a, b, c = tmp_path / "a.npz", tmp_path / "b.npz", tmp_path / "c.npz"
    plan.save(a)
    BatchPlan.load(a).save(b)
    assert a.read_bytes() == b.read_bytes()
    with np.load(a) as data:
        saved = json.loads(str(data["stats_json"]))
    assert saved == json.loads(json.dumps(plan.stats.saved(), default=float))
    assert "timing" not in saved and "solve_seconds" not in saved and saved["portfolio"]["chosen"]
    # an old file: its stats object, whatever keys it holds, loads typed and is written back unchanged
    old = BatchPlan(placement=plan.placement, samples=plan.samples, replicas=plan.replicas, num_gpus=4,
                    gpus_per_node=2, stats=OLD)
    old.save(c)
    got = BatchPlan.load(c)
    assert got.stats.migration.moved == 2 and got.stats.to_dict() == OLD


def test_timing_fields_are_saved_only_when_asked():
    st = PlanStats(strategy="static", solve_seconds=1.5)
    st.timings()["x_s"] = 0.25
    assert st.saved() == {"strategy": "static"}
    assert st.saved(include_timing=True) == {"strategy": "static", "solve_seconds": 1.5, "timing": {"x_s": 0.25}}
    assert PlanStats().timing is None and PlanStats().saved() == {}


def test_key_reads_warn_and_read_the_json_form():
    st = PlanStats.from_dict(OLD)
    with pytest.warns(DeprecationWarning, match=r"stats\['migration'\] is deprecated; read the attribute "
                                                r"\(stats.migration\)"):
        assert st["migration"]["layers_kept"] == [1]
    with pytest.warns(DeprecationWarning, match=r"\(stats.extra\['newer_key'\]\)"):
        assert st["newer_key"] == {"x": [1, 2]}
    with pytest.warns(DeprecationWarning, match="stats.overlap"):
        assert st.get("overlap", "none") == "none"
    with pytest.warns(DeprecationWarning):
        assert "portfolio" in st and "deadline" not in st
    with pytest.warns(DeprecationWarning, match=r"reading stats as a Mapping is deprecated; read stats.to_dict\(\)"):
        assert set(st) == set(OLD) and dict(st.items()) == OLD and set(st.keys()) == set(OLD)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert st.portfolio.chosen == "previous@length-balanced"  # attributes never warn


def test_a_record_missing_a_field_is_named():
    with pytest.raises(PlanError, match=r"stats record PortfolioStats needs \['step_s'\], got keys \['chosen'\]"):
        PlanStats.from_dict({"portfolio": {"chosen": "relibra"}})
    with pytest.raises(PlanError, match="stats must be a PlanStats"):
        BatchPlan(placement=Placement.static(1, 2, 2), samples=SamplePlacement(np.zeros(2), np.arange(2), 1),
                  replicas=ReplicaPlan.empty(1, 1, 2, 0), num_gpus=2, gpus_per_node=2, stats=[1])
