"""The Planner service: inline / process / Ray paths agree, deadlines and dead workers fall back per cell."""

from __future__ import annotations

import functools
import logging
import os
from pathlib import Path

import numpy as np
import pytest

from relibra_moe.errors import PlanError
from relibra_moe.planners.service import Planner
from relibra_moe.specs import ClusterSpec, ModelSpec
from relibra_moe.trace import RoutingTrace, TraceBatch

MODEL = ModelSpec("tiny", hidden=1024, ffn=512, num_experts=8, top_k=2, num_layers=3)
CLUSTER = ClusterSpec(nodes=2, gpus_per_node=2)
# tiny cells: priced replicas would never pay for their transfers, so price_replicas=False keeps the replica path
# (and portfolio=False keeps relibra's own plan, which the portfolio would swap for one without replicas)
FAST = dict(iters=300, locality_iters=200, num_seeds=2, rounds=1, price_replicas=False, portfolio=False)


def make_batch(seed=0, n=16, M=2):
    rng = np.random.default_rng(seed)
    traces = []
    for i in range(n):
        S = int(rng.integers(5, 40))
        pr = np.ones(8)
        pr[[i % 3, 4 + i % 2]] = 10.0
        keys = rng.random((S, 3, 8)) ** (1.0 / pr)
        ids = np.argsort(-keys, axis=2)[:, :, :2]
        traces.append(RoutingTrace(ids.astype(np.int16), np.arange(3, dtype=np.int32), 8, 2))
    return TraceBatch(traces, micro_batch=np.arange(n) * M // n)


def same_plan(a, b):
    np.testing.assert_array_equal(a.placement.expert_gpu, b.placement.expert_gpu)
    np.testing.assert_array_equal(a.samples.gpu, b.samples.gpu)
    np.testing.assert_array_equal(a.samples.micro_batch, b.samples.micro_batch)
    np.testing.assert_array_equal(a.replicas.replica_expert, b.replicas.replica_expert)
    np.testing.assert_array_equal(a.replicas.split_index, b.replicas.split_index)
    np.testing.assert_array_equal(a.replicas.split_share, b.replicas.split_share)


def kill_once(kind, key, marker):
    """Task hook: the first replication task to run kills its worker process."""
    if kind == "replicate" and not os.path.exists(marker):
        Path(marker).write_text("killed")
        os._exit(3)


def sleepy(kind, key):
    """Task hook: every task outlives the deadline."""
    import time

    time.sleep(20)


@pytest.fixture(scope="module")
def inline_plan():
    with Planner(MODEL, CLUSTER, replica_slots=1, executor="inline", **FAST) as p:
        return p.plan(make_batch())


def test_inline_plan_is_valid_and_uses_replicas(inline_plan):
    inline_plan.validate(MODEL, CLUSTER, 16)
    assert inline_plan.stats["fallbacks"] == 0
    assert (inline_plan.replicas.replica_expert >= 0).any()
    from relibra_moe.evaluate import batch_sha1, score_plan

    assert inline_plan.stats["batch_sha1"] == batch_sha1(make_batch())
    with pytest.raises(PlanError, match="plan was made for another batch"):
        score_plan(inline_plan, make_batch(seed=1), MODEL, CLUSTER)


@pytest.mark.timeout(240)
def test_process_pool_and_submit_match_inline(inline_plan):
    with Planner(MODEL, CLUSTER, replica_slots=1, workers=2, executor="process", **FAST) as p:
        plan = p.plan(make_batch())
        fut = p.submit(make_batch())
        again = fut.result(timeout=200)
    assert plan.stats["fallbacks"] == 0
    same_plan(plan, inline_plan)
    same_plan(again, inline_plan)


def test_tiny_deadline_falls_back_everywhere(caplog):
    batch = make_batch()
    with caplog.at_level(logging.WARNING, logger="relibra_moe.planners.service"):
        with Planner(MODEL, CLUSTER, replica_slots=1, executor="inline", deadline_s=1e-9, **FAST) as p:
            plan = p.plan(batch)
    plan.validate(MODEL, CLUSTER, 16)
    M, L = 2, 3
    assert plan.stats["fallbacks"] == L + 1 + M * L  # every reorder layer, locality, every cell
    assert (plan.replicas.replica_expert == -1).all() and len(plan.replicas.split_index) == 0
    # reorder fell back to the LPT start (no previous placement), samples stayed round-robin
    from relibra_moe.plan import round_robin_gpus
    np.testing.assert_array_equal(plan.samples.gpu, round_robin_gpus(batch.resolve_micro_batch(), 4))
    assert any("falling back" in r.message for r in caplog.records)


@pytest.mark.timeout(240)
def test_deadline_keeps_previous_placement_process():
    batch = make_batch()
    with Planner(MODEL, CLUSTER, replica_slots=1, workers=2, executor="process", **FAST) as p:
        first = p.plan(batch)
        p.deadline_s = 1e-9
        second = p.plan(make_batch(seed=1))
    assert first.stats["fallbacks"] == 0
    assert second.stats["fallbacks"] >= 1
    second.validate(MODEL, CLUSTER, 16)
    for l in second.stats["fallback_cells"]["reorder"]:
        np.testing.assert_array_equal(second.placement.expert_gpu[l], first.placement.expert_gpu[l])


@pytest.mark.timeout(120)
def test_deadline_kills_running_tasks():
    import time

    with Planner(MODEL, CLUSTER, replica_slots=1, workers=2, executor="process", deadline_s=1.0, task_hook=sleepy,
                 **FAST) as p:
        t0 = time.monotonic()
        plan = p.plan(make_batch())
        elapsed = time.monotonic() - t0
    plan.validate(MODEL, CLUSTER, 16)
    assert plan.stats["fallbacks"] == 3 + 1 + 2 * 3  # every layer, locality, every cell
    assert elapsed < 15  # the sleeping workers were stopped, not waited for


@pytest.mark.timeout(240)
def test_dead_worker_falls_back_and_pool_recovers(tmp_path, caplog):
    hook = functools.partial(kill_once, marker=str(tmp_path / "killed"))
    with caplog.at_level(logging.WARNING, logger="relibra_moe.planners.service"):
        with Planner(MODEL, CLUSTER, replica_slots=1, workers=2, executor="process", task_hook=hook,
                     cell_chunk=1, **FAST) as p:
            plan = p.plan(make_batch())
            again = p.plan(make_batch())
    assert (tmp_path / "killed").exists()
    plan.validate(MODEL, CLUSTER, 16)
    cells = plan.stats["fallback_cells"]["replicate"]
    assert plan.stats["fallbacks"] == len(cells) >= 1
    for m, l in cells:
        assert (plan.replicas.replica_expert[m, l] == -1).all()
    assert any("lost its worker" in r.message for r in caplog.records)
    assert again.stats["fallbacks"] == 0  # a fresh pool after the broken one


@pytest.mark.timeout(300)
def test_ray_matches_inline(inline_plan):
    ray = pytest.importorskip("ray")
    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        with Planner(MODEL, CLUSTER, replica_slots=1, workers=2, executor="ray", **FAST) as p:
            plan = p.plan(make_batch())
        assert plan.stats["fallbacks"] == 0, plan.stats["fallback_cells"]
        same_plan(plan, inline_plan)
    finally:
        if started:
            ray.shutdown()


def test_other_strategies_delegate():
    with Planner(MODEL, CLUSTER, strategy="lpt", replica_slots=0, executor="inline") as p:
        plan = p.plan(make_batch())
    plan.validate(MODEL, CLUSTER, 16)
    assert plan.stats["strategy"] == "lpt"


def test_invalid_inputs():
    with pytest.raises(PlanError, match="unknown strategy 'nope'"):
        Planner(MODEL, CLUSTER, strategy="nope")
    with pytest.raises(PlanError, match="executor='threads' is not one of"):
        Planner(MODEL, CLUSTER, executor="threads")
    with pytest.raises(PlanError, match="replica_slots=-1 must be an int >= 0"):
        Planner(MODEL, CLUSTER, replica_slots=-1)
    with pytest.raises(PlanError, match="deadline_s=0 must be a finite number > 0"):
        Planner(MODEL, CLUSTER, deadline_s=0)
    with pytest.raises(PlanError, match="replica_slots=True must be an int >= 0"):
        Planner(MODEL, CLUSTER, replica_slots=True)
    with pytest.raises(PlanError, match="workers=True must be an int >= 1"):
        Planner(MODEL, CLUSTER, workers=True)
    with pytest.raises(PlanError, match="workers=0 must be an int >= 1"):
        Planner(MODEL, CLUSTER, workers=0)
    with pytest.raises(PlanError, match="num_experts=8 is not divisible by num_gpus=3"):
        Planner(MODEL, ClusterSpec(nodes=1, gpus_per_node=3))
    with pytest.raises(PlanError, match="model tiny"):
        Planner(MODEL.with_(num_layers=2), CLUSTER, executor="inline").plan(make_batch())
    with pytest.raises(PlanError, match="seed=-1 must be an int >= 0"):
        Planner(MODEL, CLUSTER, seed=-1)
    with pytest.raises(PlanError, match="replica_slots=1.5 must be an int >= 0"):
        Planner(MODEL, CLUSTER, replica_slots=1.5)
    with pytest.raises(PlanError, match="unknown plan option itres=3"):
        Planner(MODEL, CLUSTER, itres=3)
    with pytest.raises(PlanError, match="iters=-1 must be an int >= 0"):
        Planner(MODEL, CLUSTER, iters=-1)
    with pytest.raises(PlanError, match="cell_chunk=0 must be an int >= 1"):
        Planner(MODEL, CLUSTER, cell_chunk=0)
    with pytest.raises(PlanError, match="replicate=3 must be a dict"):
        Planner(MODEL, CLUSTER, replicate=3)
    with pytest.raises(PlanError, match="token_cap=100 only applies with repack=True"):
        Planner(MODEL, CLUSTER, token_cap=100)




class _FailingExecutor:
    """A TaskExecutor whose tasks of the given kinds (and, for reorder, layers) never finish."""

    workers = 1
    expired = False

    def __init__(self, kinds, layers=()):
        self.kinds, self.layers, self.seen = set(kinds), set(layers), []

    def map(self, fn, args, keys):
        from relibra_moe.planners.executor import TaskFailed

        self.seen += [k for k, _ in keys]
        return [TaskFailed("test") if kind in self.kinds and (kind != "reorder" or key[0] in self.layers)
                else fn(*a) for a, (kind, key) in zip(args, keys)]


def test_plan_batch_loop_falls_back_per_task_on_any_executor():
    """The one planning loop behind plan_batch and Planner: a failed reorder layer keeps its start (LPT), a
    failed locality pass keeps the samples, failed replication cells get no replicas; each is counted."""
    from relibra_moe.planners.options import PlanOptions
    from relibra_moe.planners.reorder import lpt_placement
    from relibra_moe.planners.strategies import plan_with_options

    batch = make_batch()
    opts = PlanOptions(replica_slots=1, migration=False, **FAST)
    ex = _FailingExecutor({"reorder", "locality", "replicate"}, layers={1})
    plan = plan_with_options(batch, MODEL, CLUSTER, "relibra", opts, executor=ex)
    assert set(ex.seen) == {"reorder", "locality", "replicate"}
    x = batch.loads(plan.samples.gpu, CLUSTER.num_gpus, plan.samples.micro_batch)
    np.testing.assert_array_equal(plan.placement.expert_gpu[1], lpt_placement(x[:, 1].sum(axis=(0, 1)), 4))
    from relibra_moe.plan import round_robin_gpus

    np.testing.assert_array_equal(plan.samples.gpu, round_robin_gpus(batch.resolve_micro_batch(), 4))
    assert not (plan.replicas.replica_expert >= 0).any()
    cells = plan.num_micro_batches * MODEL.num_layers
    assert plan.stats["fallbacks"] == 1 + 1 + cells  # one reorder layer, one locality round, every cell
    ok = plan_with_options(batch, MODEL, CLUSTER, "relibra", opts, executor=_FailingExecutor(set()))
    assert ok.stats["fallbacks"] == 0 and (ok.replicas.replica_expert >= 0).any()


def test_planner_stats_are_plan_batchs_plus_the_executor(inline_plan):
    """One loop: a Planner plan records what plan_batch records (rounds, options, repack), plus its executor,
    workers and fallback cells (the oracle's Planner plan files changed by exactly these keys)."""
    from relibra_moe.planners.strategies import plan_batch

    ref = plan_batch(make_batch(), MODEL, CLUSTER, "relibra", replica_slots=1, workers=1, **FAST)
    assert set(inline_plan.stats) == set(ref.stats) | {"executor", "workers", "fallback_cells"}
    assert inline_plan.stats["options"] == ref.stats["options"] == dict(sorted(FAST.items()))  # none at its default
    assert inline_plan.stats["fallback_cells"] == {"reorder": [], "locality": 0, "replicate": []}


def test_lplb_runs_on_the_executor_and_falls_back_per_task():
    """LPLB+ splits are "replicate" tasks on the given executor (no private pool): the same plan as inline
    when they finish; a failed task leaves its cells without replicas (every token home) and counts them."""
    from relibra_moe.planners.options import PlanOptions
    from relibra_moe.planners.strategies import plan_with_options

    batch = make_batch()
    opts = PlanOptions(replica_slots=1)
    ref = plan_with_options(batch, MODEL, CLUSTER, "lplb", opts)
    ok_ex = _FailingExecutor(set())
    ok = plan_with_options(batch, MODEL, CLUSTER, "lplb", opts, executor=ok_ex)
    assert ok_ex.seen == ["replicate"]  # one chunk of every cell for one worker
    same_plan(ok, ref)
    assert ok.stats["fallbacks"] == 0 and (ok.replicas.replica_expert >= 0).any() and len(ok.replicas.split_share)
    ex = _FailingExecutor({"replicate"})
    plan = plan_with_options(batch, MODEL, CLUSTER, "lplb", opts, executor=ex)
    plan.validate(MODEL, CLUSTER, 16)
    cells = plan.num_micro_batches * MODEL.num_layers
    assert plan.stats["fallbacks"] == cells
    np.testing.assert_array_equal(plan.placement.expert_gpu, ref.placement.expert_gpu)
    assert not (plan.replicas.replica_expert >= 0).any() and len(plan.replicas.split_share) == 0


def test_planner_lplb_deadline_falls_back_every_cell(caplog):
    """Planner(strategy="lplb") gets the service's deadline: tasks past it fall back, cell by cell, logged."""
    with caplog.at_level(logging.WARNING, logger="relibra_moe.planners.service"):
        with Planner(MODEL, CLUSTER, strategy="lplb", replica_slots=1, executor="inline", deadline_s=1e-9) as p:
            plan = p.plan(make_batch())
    plan.validate(MODEL, CLUSTER, 16)
    M, L = plan.num_micro_batches, MODEL.num_layers
    assert plan.stats["strategy"] == "lplb" and plan.stats["fallbacks"] == M * L
    assert sorted(map(tuple, plan.stats["fallback_cells"]["replicate"])) == [(m, l) for m in range(M) for l in range(L)]
    assert not (plan.replicas.replica_expert >= 0).any() and len(plan.replicas.split_index) == 0
    assert any("falling back" in r.message for r in caplog.records)
