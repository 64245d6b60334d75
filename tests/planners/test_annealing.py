"""planners/annealing.py: one locality task is ``anneal_locality`` with the context's parameters, the rounds
record what they did, relocate keeps the lower objective, and relibra_inter is relibra-inter's plan."""

from __future__ import annotations

import numpy as np

from relibra_moe.plan_stats import PlanStats
from relibra_moe.planners.annealing import (
    anneal_inter,
    finish_inter,
    locality_args,
    locality_task,
    relibra_inter,
    relocate,
)
from relibra_moe.planners.baselines import static_placement
from relibra_moe.planners.executor import default_executor
from relibra_moe.planners.locality import anneal_locality
from relibra_moe.planners.options import PlanOptions
from relibra_moe.planners.strategies import make_context, plan_batch
from relibra_moe.specs import ClusterSpec, ModelSpec
from relibra_moe.synthetic import rl_batch

MODEL = ModelSpec("t", hidden=256, ffn=128, num_experts=8, top_k=2, num_layers=2)
CLUSTER = ClusterSpec(nodes=2, gpus_per_node=2)
FAST = dict(iters=100, locality_iters=60, num_seeds=1)


def _ctx(**kw):
    batch = rl_batch(MODEL, "mixed", 3, responses_per_prompt=4, seed=2, micro_batch_size=6, max_len=64)
    return make_context(batch, MODEL, CLUSTER, "relibra-inter", PlanOptions(**FAST, **kw), default_executor(1))


def test_a_locality_task_is_anneal_locality_with_the_contexts_parameters():
    ctx = _ctx()
    eg = static_placement(MODEL.num_layers, MODEL.num_experts, CLUSTER.num_gpus)
    mb, sg, info = locality_task(*locality_args(ctx, ctx.micro_batch, ctx.sample_gpu, eg, 5))
    wmb, wsg, winfo = anneal_locality(ctx.counts, ctx.lengths, ctx.micro_batch, ctx.sample_gpu, eg, MODEL, CLUSTER,
                                      ctx.locality_params, num_micro_batches=ctx.num_micro_batches, seed=5)
    assert np.array_equal(mb, wmb) and np.array_equal(sg, wsg) and info["objective"] == winfo["objective"]


def test_anneal_inter_runs_the_rounds_and_keeps_a_trainers_samples():
    ctx = _ctx(rounds=3)
    eg, mb, sg = anneal_inter(ctx)
    assert eg.shape == (MODEL.num_layers, MODEL.num_experts) and mb.dtype == sg.dtype == np.int64
    assert len(ctx.stats.rounds) == 3 and set(ctx.stats.timing) >= {"reorder_s_2", "locality_s_2"}
    assert ctx.stats.objective == ctx.stats.rounds[-1]["locality"]["objective"]
    ranks = np.arange(len(ctx.lengths)) % CLUSTER.num_gpus
    own = _ctx(rounds=2, sample_owner="trainer", sample_gpu=ranks)
    _, mb, sg = anneal_inter(own)
    assert np.array_equal(sg, ranks) and np.array_equal(mb, own.micro_batch)
    assert [r["locality"] for r in own.stats.rounds] == [{"skipped": "sample_owner=trainer"}] * 2


def test_relocate_keeps_the_lower_objective_of_its_two_passes():
    ctx = _ctx(rounds=1)
    eg = np.roll(static_placement(MODEL.num_layers, MODEL.num_experts, CLUSTER.num_gpus), 3, axis=1)
    start = (np.zeros_like(ctx.micro_batch), ctx.sample_gpu[::-1].copy())  # another start than the call's
    mb, sg, info = relocate(ctx, eg, *start)
    objectives = {k: getattr(info, k) for k in ("annealed", "start")}
    assert info.chosen == min(objectives, key=lambda k: (objectives[k], k != "annealed"))
    want = locality_task(*locality_args(ctx, *(start if info.chosen == "annealed" else
                                               (ctx.micro_batch, ctx.sample_gpu)), eg, ctx.seed + 2))
    assert np.array_equal(mb, want[0]) and np.array_equal(sg, want[1])


def test_finish_inter_without_migration_returns_the_annealed_plan():
    ctx = _ctx(rounds=1, migration=False)
    eg, mb, sg = anneal_inter(ctx)
    stats = PlanStats()
    got = finish_inter(ctx, eg, mb, sg, False, stats)
    assert stats.to_dict() == {"migration": {"enabled": False}}
    assert all(np.array_equal(a, b) for a, b in zip(got, (eg, mb, sg)))


def test_relibra_inter_is_the_strategys_plan():
    ctx = _ctx(rounds=2)
    eg, mb, sg = relibra_inter(ctx)
    plan = plan_batch(ctx.batch, MODEL, CLUSTER, "relibra-inter", rounds=2, **FAST)
    assert np.array_equal(plan.placement.expert_gpu, eg)
    assert np.array_equal(plan.samples.micro_batch, mb) and np.array_equal(plan.samples.gpu, sg)
