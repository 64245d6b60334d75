"""Plan data (relibra_moe.plan): every validation rule raises PlanError, .npz round trip, load errors,
byte-deterministic files."""

from __future__ import annotations

import json
import zipfile

import numpy as np
import pytest

from relibra_moe.errors import PlanError
from relibra_moe.plan import BatchPlan, Placement, ReplicaPlan, SamplePlacement, json_default
from relibra_moe.specs import ClusterSpec, ModelSpec

MODEL = ModelSpec("t", hidden=64, ffn=32, num_experts=8, top_k=2, num_layers=2)
CLUSTER = ClusterSpec(nodes=2, gpus_per_node=2)  # G = 4, 2 experts per GPU


def _replicas(**over) -> ReplicaPlan:
    """M = 2, L = 2, G = 4, r = 1: expert 0 (home GPU 0) replicated on GPU 1 in (m=0, l=0)."""
    rep = np.full((2, 2, 4, 1), -1, np.int32)
    rep[0, 0, 1, 0] = 0
    idx = np.array([[0, 0, 2, 0, 0], [0, 0, 2, 0, 1]], np.int32)
    share = np.array([0.25, 0.75], np.float32)
    args = dict(replica_expert=rep, split_index=idx, split_share=share, scope="node")
    args.update(over)
    return ReplicaPlan(**args)


def _plan(**over) -> BatchPlan:
    args = dict(placement=Placement.static(2, 8, 4),
                samples=SamplePlacement(np.array([0, 0, 1, 1, 1]), np.array([0, 3, 1, 2, 0]), 2),
                replicas=_replicas(), num_gpus=4, gpus_per_node=2, stats={"strategy": "t", "seed": 1})
    args.update(over)
    return BatchPlan(**args)


def test_valid_plan_passes():
    _plan().validate(MODEL, CLUSTER, num_samples=5)


def _placement_with(l, e, g):
    eg = Placement.static(2, 8, 4).expert_gpu.copy()
    eg[l, e] = g
    return Placement(eg)


@pytest.mark.parametrize("placement, match", [
    (Placement(np.zeros((2, 4), np.int32)), r"expert_gpu has shape \(2, 4\), expected \[L=2, E=8\]"),
    (_placement_with(1, 3, 4), r"expert_gpu\[1, 3\] = 4 is outside \[0, 4\)"),
    (_placement_with(0, 0, 1), r"GPU 0 homes 1 experts in layer 0; every GPU must home exactly E/G = 2"),
])
def test_placement_rules(placement, match):
    with pytest.raises(PlanError, match=match):
        _plan(placement=placement).validate(MODEL, CLUSTER)


def test_placement_shape_and_divisibility():
    with pytest.raises(PlanError, match=r"expert_gpu must be \[L, E\]"):
        Placement(np.zeros(8))
    with pytest.raises(PlanError, match="not divisible"):
        Placement.static(1, 6, 4)
    with pytest.raises(PlanError, match="num_experts=6 is not divisible by num_gpus=4"):
        Placement(np.zeros((2, 6), np.int32)).validate(MODEL.with_(num_experts=6), CLUSTER)


def test_sample_rules():
    with pytest.raises(PlanError, match="must both be"):
        SamplePlacement(np.zeros(3), np.zeros(4))
    with pytest.raises(PlanError, match=r"sample_gpu\[1\] = 7 is outside \[0, 4\)"):
        _plan(samples=SamplePlacement(np.array([0, 0]), np.array([0, 7]), 2)).validate(MODEL, CLUSTER)
    with pytest.raises(PlanError, match=r"sample_micro_batch\[0\] = -1 is outside"):
        _plan(samples=SamplePlacement(np.array([-1, 0]), np.array([0, 1]), 2)).validate(MODEL, CLUSTER)
    with pytest.raises(PlanError, match="covers 5 samples, the batch has 6"):
        _plan().validate(MODEL, CLUSTER, num_samples=6)


def test_cluster_mismatch():
    with pytest.raises(PlanError, match="plan is for 4 GPUs"):
        _plan().validate(MODEL, ClusterSpec(nodes=1, gpus_per_node=4))


def test_replica_construction_rules():
    with pytest.raises(PlanError, match=r"replica_expert must be \[M, L, G, r\]"):
        _replicas(replica_expert=np.zeros((2, 2, 4)))
    with pytest.raises(PlanError, match="split_share has 1 rows, split_index has 2"):
        _replicas(split_share=np.array([1.0]))
    with pytest.raises(PlanError, match="replica scope 'rack'"):
        _replicas(scope="rack")
    # a split_index of the wrong width is rejected, not reshaped into different rows
    with pytest.raises(PlanError, match=r"split_index must be \[Z, 5\] rows \(m, l, j, e, g\), got shape \(5, 2\)"):
        _replicas(split_index=np.zeros((5, 2), np.int32), split_share=np.zeros(2))
    with pytest.raises(PlanError, match=r"split_share must be \[Z\], got shape \(2, 1\)"):
        _replicas(split_share=np.zeros((2, 1)))
    _replicas(split_index=[], split_share=[], replica_expert=np.full((2, 2, 4, 1), -1))  # no rows: fine


@pytest.mark.parametrize("field, value, match", [
    ("expert_gpu", np.full((2, 8), 1.5), r"expert_gpu\[0, 0\] = 1.5 is not a whole number"),
    ("expert_gpu", np.full((2, 8), 2**32), r"expert_gpu values must fit int32 .* got range \[4294967296, 4294967296\]"),
    ("expert_gpu", np.full((2, 8), "a"), r"expert_gpu must hold integers, got dtype <U1"),
    ("sample_gpu", np.array([0, 1, 2, 3, 2**31]), r"sample_gpu values must fit int32"),
    ("sample_micro_batch", np.array([0, 0, np.nan, 1, 1]), r"sample_micro_batch\[2\] = nan is not a whole number"),
    ("split_index", np.array([[0, 0, 2, 0, 0], [0, 0, 2, 0, 0.5]]), r"split_index\[1, 4\] = 0.5 is not a whole number"),
])
def test_integer_fields_are_never_truncated_or_wrapped(field, value, match):
    with pytest.raises(PlanError, match=match):
        if field == "expert_gpu":
            Placement(value)
        elif field == "sample_gpu":
            SamplePlacement(np.zeros(5, np.int32), value)
        elif field == "sample_micro_batch":
            SamplePlacement(value, np.zeros(5, np.int32))
        else:
            _replicas(split_index=value)
    # whole-number floats are exact and accepted
    np.testing.assert_array_equal(Placement(np.zeros((2, 8)) + 1.0).expert_gpu, np.ones((2, 8)))


def test_json_default():
    text = json.dumps({"a": np.int16(3), "b": np.float32(0.5), "c": np.arange(3), "d": np.bool_(True)},
                      default=json_default, sort_keys=True)
    assert text == '{"a": 3, "b": 0.5, "c": [0, 1, 2], "d": true}'
    with pytest.raises(TypeError, match="value of type object is not JSON-serializable"):
        json.dumps({"x": object()}, default=json_default)


def _rep_with(m, l, g, s, e):
    rep = _replicas().replica_expert.copy()
    rep[m, l, g, s] = e
    return rep


@pytest.mark.parametrize("over, match", [
    (dict(replica_expert=np.full((2, 3, 4, 1), -1)), r"expected \[M, L=2, G=4, r\]"),
    (dict(replica_expert=_rep_with(1, 1, 3, 0, 8)), r"replica_expert\[1, 1, 3, 0\] = 8 is outside \[-1, 8\)"),
    (dict(replica_expert=_rep_with(1, 0, 0, 0, 0)), "homed on GPU 0 already"),
    (dict(replica_expert=_rep_with(1, 0, 2, 0, 0)), "replicas stay inside the home's node"),
    (dict(split_index=np.array([[0, 0, 2, 0, 0], [0, 0, 9, 0, 1]])), r"j=9 is outside \[0, 4\)"),
    (dict(split_share=np.array([0.25, 1.5])), r"split_share\[1\] = 1.5 is not a fraction"),
    (dict(split_share=np.array([0.25, np.nan])), "is not a fraction"),
    (dict(split_index=np.array([[0, 0, 2, 0, 0], [0, 0, 2, 0, 3]])), "neither its home nor holds a replica"),
    (dict(split_index=np.array([[0, 0, 2, 0, 1], [0, 0, 2, 0, 1]]), split_share=np.array([0.5, 0.5])),
     "appears more than once"),
    (dict(split_share=np.array([0.25, 0.5])), r"sums to 0.75, not 1"),
])
def test_replica_rules(over, match):
    with pytest.raises(PlanError, match=match):
        _plan(replicas=_replicas(**over)).validate(MODEL, CLUSTER)


def test_replica_twice_in_one_gpu_and_micro_batch_count():
    rep = np.full((2, 2, 4, 2), -1, np.int32)
    rep[0, 0, 1] = [0, 0]
    with pytest.raises(PlanError, match=r"replica_expert\[0, 0, 1\] holds expert 0 twice"):
        _plan(replicas=ReplicaPlan(rep, np.zeros((0, 5)), np.zeros(0))).validate(MODEL, CLUSTER)
    with pytest.raises(PlanError, match="covers 3 micro-batches, the plan has 2"):
        _plan(replicas=ReplicaPlan.empty(3, 2, 4, 1)).validate(MODEL, CLUSTER)


def test_global_scope_allows_cross_node_replicas():
    rep = _rep_with(1, 0, 2, 0, 0)
    _plan(replicas=_replicas(replica_expert=rep, scope="global")).validate(MODEL, CLUSTER)


def test_shares_dense():
    sh = _replicas().shares(Placement.static(2, 8, 4), 0)
    assert sh.shape == (2, 4, 8, 4)
    np.testing.assert_allclose(sh.sum(axis=-1), 1.0)
    np.testing.assert_allclose(sh[0, 2, 0], [0.25, 0.75, 0, 0])
    np.testing.assert_allclose(sh[0, 1, 0], [1, 0, 0, 0])


def test_round_trip(tmp_path):
    p = _plan(stats={"strategy": "t", "seed": 1, "objective": np.float64(0.5), "arr": np.arange(2)})
    path = tmp_path / "p.npz"
    p.save(path)
    q = BatchPlan.load(path)
    q.validate(MODEL, CLUSTER, num_samples=5)
    np.testing.assert_array_equal(q.placement.expert_gpu, p.placement.expert_gpu)
    np.testing.assert_array_equal(q.samples.micro_batch, p.samples.micro_batch)
    np.testing.assert_array_equal(q.samples.gpu, p.samples.gpu)
    np.testing.assert_array_equal(q.replicas.replica_expert, p.replicas.replica_expert)
    np.testing.assert_array_equal(q.replicas.split_index, p.replicas.split_index)
    np.testing.assert_array_equal(q.replicas.split_share, p.replicas.split_share)
    assert q.replicas.scope == "node" and q.num_micro_batches == 2
    assert q.stats.to_dict() == {"strategy": "t", "seed": 1, "objective": 0.5, "arr": [0, 1]}
    with np.load(path, allow_pickle=False) as f:
        assert f["expert_gpu"].dtype == np.int32 and f["split_share"].dtype == np.float32
        assert f["split_index"].shape == (2, 5) and int(f["version"]) == 1


def test_save_is_byte_deterministic_and_timing_is_optional(tmp_path):
    a, b = tmp_path / "a.npz", tmp_path / "b.npz"
    _plan(stats={"seed": 1, "solve_seconds": 1.5, "timing": {"x": 1}}).save(a)
    _plan(stats={"seed": 1, "solve_seconds": 9.0, "timing": {"x": 2}}).save(b)
    assert a.read_bytes() == b.read_bytes()
    assert BatchPlan.load(a).stats.to_dict() == {"seed": 1}
    _plan(stats={"seed": 1, "solve_seconds": 1.5}).save(b, include_timing=True)
    assert BatchPlan.load(b).stats.to_dict() == {"seed": 1, "solve_seconds": 1.5}


def test_load_errors(tmp_path):
    with pytest.raises(PlanError, match="no such file"):
        BatchPlan.load(tmp_path / "missing.npz")
    bad = tmp_path / "bad.npz"
    bad.write_bytes(b"not a zip")
    with pytest.raises(PlanError, match="not a readable .npz"):
        BatchPlan.load(bad)
    p = tmp_path / "p.npz"
    _plan().save(p)

    def rewrite(drop: str | None = None, **put):
        out = tmp_path / "x.npz"
        with np.load(p, allow_pickle=False) as f:
            data = {k: f[k] for k in f.files if k != drop}
        data.update(put)
        np.savez(out, **data)
        return out

    with pytest.raises(PlanError, match="version 2 is not supported"):
        BatchPlan.load(rewrite(version=np.array(2)))
    with pytest.raises(PlanError, match="version None"):
        BatchPlan.load(rewrite(drop="version"))
    with pytest.raises(PlanError, match="missing key 'split_share'"):
        BatchPlan.load(rewrite(drop="split_share"))
    with pytest.raises(PlanError, match=r"x.npz: key 'stats_json' is not valid JSON"):
        BatchPlan.load(rewrite(stats_json=np.array("{not json")))
    with pytest.raises(PlanError, match=r"x.npz: key 'num_gpus' must be an integer scalar, got .* shape \(2,\)"):
        BatchPlan.load(rewrite(num_gpus=np.array([4, 4])))
    with pytest.raises(PlanError, match=r"x.npz: key 'version' must be an integer scalar, got dtype float64"):
        BatchPlan.load(rewrite(version=np.array(1.0)))
    with pytest.raises(PlanError, match=r"x.npz: split_index must be \[Z, 5\] rows"):
        BatchPlan.load(rewrite(split_index=np.zeros((2, 4), np.int32)))
    with pytest.raises(PlanError, match=r"x.npz: replica scope 'rack'"):
        BatchPlan.load(rewrite(replica_scope=np.array("rack")))
    assert zipfile.is_zipfile(p)
    assert json.loads(str(np.load(p)["stats_json"])) == {"seed": 1, "strategy": "t"}


def test_check_replica_slots_is_the_ceiling_e_minus_e_over_g():
    from relibra_moe.plan import check_replica_slots

    check_replica_slots(4, 8, 2)  # E - E/G = 4: allowed
    check_replica_slots(0, 8, 1)
    with pytest.raises(PlanError, match=r"replica_slots=5 is over the ceiling E - E/G = 4 \(E=8, G=2"):
        check_replica_slots(5, 8, 2)
    with pytest.raises(PlanError, match=r"slots=1 is over the ceiling E - E/G = 0 \(E=8, G=1"):
        check_replica_slots(1, 8, 1, field="slots")  # one GPU homes every expert: nothing to replicate


def test_replica_slots_is_the_one_name_and_slots_is_deprecated():
    rp = ReplicaPlan.empty(2, 3, 4, replica_slots=2)
    assert rp.replica_expert.shape == (2, 3, 4, 2) and (rp.replica_expert == -1).all()
    assert rp.replica_slots == 2
    with pytest.deprecated_call(match="use ReplicaPlan.replica_slots"):
        assert rp.slots == 2


def test_resident_replicas_are_the_same_filled_slots_in_every_micro_batch():
    """``ReplicaPlan.resident``: the rule the simulator charges ``persistent`` by and the layer runs resident by."""
    def reps(rep):
        return ReplicaPlan(np.asarray(rep, np.int32), np.zeros((0, 5), np.int32), np.zeros(0, np.float32))

    same = [[[[3, -1], [0, 1]]], [[[3, -1], [0, 1]]]]  # [M=2, L=1, G=2, r=2]
    assert reps(same).resident
    moved = [[[[3, -1], [0, 1]]], [[[3, -1], [1, 0]]]]  # a slot holds another expert in micro-batch 1
    assert not reps(moved).resident
    assert not reps(same[:1]).resident  # one micro-batch: nothing to keep between micro-batches
    assert not reps(np.full((2, 1, 2, 2), -1)).resident  # no filled slot
