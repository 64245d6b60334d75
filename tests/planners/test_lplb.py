"""LPLB+ baseline: ring topology copies, one copy per expert, per-cell exact LP split."""

from __future__ import annotations

import numpy as np
import pytest

from relibra_moe.cost import moe_cost
from relibra_moe.errors import PlanError
from relibra_moe.plan import Placement, SamplePlacement
from relibra_moe.planners.exact import split_lp_reference
from relibra_moe.planners.lplb import lplb_copies, lplb_replicas
from relibra_moe.specs import ClusterSpec, ModelSpec
from relibra_moe.trace import RoutingTrace, TraceBatch

MODEL = ModelSpec("tiny", hidden=1024, ffn=512, num_experts=8, top_k=2, num_layers=2)
CLUSTER = ClusterSpec(nodes=2, gpus_per_node=2)


def test_ring_copies_heaviest_of_predecessor():
    eg = np.array([0, 0, 1, 1, 2, 2, 3, 3])
    load = np.array([5, 9, 1, 0, 3, 4, 7, 2], float)
    rep = lplb_copies(eg, load, 4, 2, 1)
    # GPU 1's predecessor in node 0 is GPU 0 (heaviest: expert 1); GPU 0's is GPU 1 (expert 2)
    assert rep[:, 0].tolist() == [2, 1, 6, 5]
    rep2 = lplb_copies(eg, load, 4, 2, 2)
    assert rep2[0].tolist() == [2, -1]  # expert 3 has no tokens: no copy
    flat = rep2[rep2 >= 0]
    assert len(set(flat.tolist())) == len(flat)  # at most one copy per expert
    assert (lplb_copies(eg, load, 4, 1, 2) == -1).all()  # one GPU per node: nowhere to copy
    with pytest.raises(PlanError, match=r"expert_load has shape \(3,\), expected \(8,\)"):
        lplb_copies(eg, load[:3], 4, 2, 1)


@pytest.mark.timeout(120)
def test_lplb_plan_is_valid_and_optimal_per_cell():
    rng = np.random.default_rng(0)
    traces = []
    for _ in range(8):
        S = int(rng.integers(5, 30))
        ids = np.argsort(rng.random((S, 2, 8)) * np.array([0.1, 0.2] + [1] * 6), axis=2)[:, :, :2]
        traces.append(RoutingTrace(ids.astype(np.int16), np.arange(2, dtype=np.int32), 8, 2))
    batch = TraceBatch(traces)
    placement = Placement(np.tile(np.repeat(np.arange(4), 2), (2, 1)))
    samples = SamplePlacement(np.arange(8) // 4, np.arange(8) % 4)
    plan = lplb_replicas(placement, samples, batch, MODEL, CLUSTER, replica_slots=1)
    plan.validate(placement, MODEL, CLUSTER, 2)
    x = batch.loads(samples.gpu, 4, samples.micro_batch).astype(float)
    for m in range(2):
        t = moe_cost(x[m], placement.expert_gpu, MODEL, CLUSTER, shares=plan.shares(placement, m)).t_moe
        for l in range(2):
            # optimal for its copies: the independent cvxpy LP of the same split
            ref, _ = split_lp_reference(x[m, l], placement.expert_gpu[l], plan.replica_expert[m, l], MODEL, CLUSTER)
            assert t[l] == pytest.approx(ref, rel=1e-5)
            assert t[l] <= moe_cost(x[m, l], placement.expert_gpu[l], MODEL, CLUSTER).t_moe * (1 + 1e-9)
    # copies are the same in every micro-batch (fixed for the batch)
    np.testing.assert_array_equal(plan.replica_expert[0], plan.replica_expert[1])
    par = lplb_replicas(placement, samples, batch, MODEL, CLUSTER, replica_slots=1, workers=2)
    np.testing.assert_array_equal(par.split_index, plan.split_index)
    np.testing.assert_array_equal(par.split_share, plan.split_share)
    fast = lplb_replicas(placement, samples, batch, MODEL, CLUSTER, replica_slots=1, split="fast")
    fast.validate(placement, MODEL, CLUSTER, 2)
    with pytest.raises(PlanError, match="split='bogus' is not 'lp' or 'fast'"):
        lplb_replicas(placement, samples, batch, MODEL, CLUSTER, split="bogus")
