"""context: the start of every sample, the previous homes, the loads a context sees, the whole-strategy fallback,
checked against hand-computed cases."""

from __future__ import annotations

import numpy as np
import pytest

from relibra_moe.errors import PlanError
from relibra_moe.planners.context import (
    PlanContext,
    eplb_task,
    fallback_homes,
    make_plan,
    previous_expert_gpu,
    start_samples,
)
from relibra_moe.planners.executor import InlineExecutor, TaskFailed
from relibra_moe.planners.options import PlanOptions
from relibra_moe.specs import ClusterSpec, ModelSpec
from relibra_moe.trace import RoutingTrace, TraceBatch

MODEL = ModelSpec("tiny", hidden=1024, ffn=512, num_experts=4, top_k=1, num_layers=2)
CLUSTER = ClusterSpec(nodes=1, gpus_per_node=2)


def test_round_robin_start_keeps_the_micro_batches():
    mb = np.array([0, 0, 0, 0, 1, 1, 1, 1])
    got_mb, got_gpu = start_samples(PlanOptions(), "static", np.full(8, 10), mb, 2)
    np.testing.assert_array_equal(got_mb, mb)
    np.testing.assert_array_equal(got_gpu, [0, 1, 0, 1, 0, 1, 0, 1])  # k-th sample of a micro-batch on k mod G
    _, few = start_samples(PlanOptions(), "static", np.full(2, 10), np.array([0, 0]), 4)
    np.testing.assert_array_equal(few, [0, 2])  # B < G: spread as floor(k G / B)


def test_trainer_ranks_are_kept_or_named_when_wrong():
    opts = PlanOptions(sample_owner="trainer", sample_gpu=np.array([1, 1, 0, 0]))
    mb, gpu = start_samples(opts, "relibra", np.ones(4), np.array([0, 0, 1, 1]), 2)
    np.testing.assert_array_equal(gpu, [1, 1, 0, 0])
    np.testing.assert_array_equal(mb, [0, 0, 1, 1])
    with pytest.raises(PlanError, match=r"sample_gpu has 3 entries, the batch has N=4 samples"):
        start_samples(PlanOptions(sample_owner="trainer", sample_gpu=np.array([0, 1, 0])), "static", np.ones(4),
                      np.zeros(4), 2)
    with pytest.raises(PlanError, match=r"sample_gpu\[2\] = 5 is outside \[0, 2\)"):
        start_samples(PlanOptions(sample_owner="trainer", sample_gpu=np.array([0, 1, 5, 0])), "static",
                      np.ones(4), np.zeros(4), 2)


def test_previous_homes_default_static_and_checked():
    np.testing.assert_array_equal(previous_expert_gpu(PlanOptions(), MODEL, CLUSTER), [[0, 0, 1, 1], [0, 0, 1, 1]])
    prev = np.array([[1, 0, 1, 0], [0, 1, 1, 0]])
    np.testing.assert_array_equal(previous_expert_gpu(PlanOptions(previous=prev), MODEL, CLUSTER), prev)
    with pytest.raises(PlanError, match=r"previous placement must be \[L=2, E=4\] .* got shape \(1, 4\)"):
        previous_expert_gpu(PlanOptions(previous=prev[:1]), MODEL, CLUSTER)
    with pytest.raises(PlanError, match=r"^previous placement: "):  # GPU 0 homes 3 experts, GPU 1 one
        previous_expert_gpu(PlanOptions(previous=np.array([[0, 0, 0, 1], [0, 0, 1, 1]])), MODEL, CLUSTER)


def _ctx(executor=None, **options) -> PlanContext:
    # sample 0: 3 tokens, layer 0 -> expert 0, layer 1 -> expert 3; sample 1: 2 tokens -> experts 2 / 1
    ids = [np.array([[[0], [3]]] * 3, np.int16), np.array([[[2], [1]]] * 2, np.int16)]
    batch = TraceBatch([RoutingTrace(i, np.arange(2, dtype=np.int32), 4, 1) for i in ids])
    batch = batch.with_micro_batch(np.array([0, 0], np.int32))
    return PlanContext(batch=batch, model=MODEL, cluster=CLUSTER, counts=batch.sample_expert_counts(),
                       lengths=np.array([3, 2]), micro_batch=np.array([0, 0]), num_micro_batches=1,
                       sample_gpu=np.array([0, 1]), options=PlanOptions(**options),
                       executor=executor or InlineExecutor())


def test_loads_of_a_placement_by_hand():
    ctx = _ctx()
    x = ctx.loads(np.array([0, 0]), np.array([1, 0]))  # [M=1, L=2, G=2, E=4]
    want = np.zeros((1, 2, 2, 4), np.int64)
    want[0, 0, 1, 0] = 3  # sample 0 on GPU 1: 3 tokens to expert 0 in layer 0 ...
    want[0, 1, 1, 3] = 3  # ... and to expert 3 in layer 1
    want[0, 0, 0, 2] = 2  # sample 1 on GPU 0
    want[0, 1, 0, 1] = 2
    np.testing.assert_array_equal(x, want)
    assert ctx.replica_slots == 0 and ctx.seed == 0 and not ctx.repack and not ctx.trainer_owned


def test_make_plan_carries_the_context():
    ctx = _ctx(replica_slots=1)
    plan = make_plan(ctx, np.array([[0, 0, 1, 1], [1, 1, 0, 0]]), ctx.micro_batch, ctx.sample_gpu)
    assert (plan.num_gpus, plan.gpus_per_node) == (2, 2)
    assert plan.replicas.replica_expert.shape == (1, 2, 2, 0)  # no replicas given: an empty plan
    assert plan.stats is ctx.stats


class _Failing(InlineExecutor):
    def map(self, fn, args, keys):
        return [TaskFailed("deadline") for _ in args]


def test_eplb_task_and_the_whole_strategy_fallback():
    ctx = _ctx()
    homes, _ = eplb_task(ctx, np.array([[3.0, 0.0, 2.0, 0.0], [0.0, 2.0, 0.0, 3.0]]), "eplb")
    assert all(sorted(np.bincount(h, minlength=2)) == [2, 2] for h in homes)  # E / G experts per GPU
    assert homes[0, 0] != homes[0, 2]  # the two loaded experts of layer 0 on different GPUs
    failing = _ctx(_Failing())
    assert eplb_task(failing, np.ones((2, 4)), "eplb") is None
    assert failing.fallbacks.strategy == 1
    np.testing.assert_array_equal(fallback_homes(failing), [[0, 0, 1, 1], [0, 0, 1, 1]])
    failing.fallback_expert_gpu = np.array([[1, 1, 0, 0], [1, 0, 1, 0]])
    np.testing.assert_array_equal(fallback_homes(failing), [[1, 1, 0, 0], [1, 0, 1, 0]])
