"""The bound (``evaluate.bound_terms`` / ``bound_t_moe``, ``sim.bound_step``): hand-computed terms, a brute force over
every placement of a tiny batch, and a property test over random batches, strategies and options that no plan beats
it (sum of T_MoE and simulated step)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from relibra_moe.cost import cost_from_flow, flow_matrix
from relibra_moe.errors import PlanError
from relibra_moe.evaluate import bound_micro_batch, bound_t_moe, bound_terms, plan_loads, score_plan
from relibra_moe.plan import BatchPlan, ReplicaPlan
from relibra_moe.planners.options import REPLICA_STRATEGIES
from relibra_moe.planners.strategies import STRATEGIES, plan_batch
from relibra_moe.sample_placements import SAMPLE_PLACEMENTS, place_samples
from relibra_moe.sim import bound_step, simulate_step
from relibra_moe.specs import OVERLAPS, ClusterSpec, ModelSpec
from relibra_moe.trace import TraceBatch

# One (token, expert) pair: 6 x 4 x 8 = 192 FLOPs = 1 s at 192 FLOP/s; a token 4 x 2 = 8 B = 1 s on NVLink
# (8 B/s), 2 s on RDMA (4 B/s).
MODEL = ModelSpec("tiny", hidden=4, ffn=8, num_experts=4, top_k=2, num_layers=1, dtype_bytes=2,
                  num_heads=2, num_kv_heads=1, head_dim=2)
ONE_NODE = ClusterSpec(nodes=1, gpus_per_node=2, nvlink_bw=8.0, rdma_bw=4.0, flops=192.0, attn_flops=384.0)


def _batch(counts, micro_batch=None) -> TraceBatch:
    c = np.asarray(counts, dtype=np.int64)
    return TraceBatch.from_counts(c, 2, micro_batch=np.zeros(len(c), np.int64) if micro_batch is None
                                  else np.asarray(micro_batch))


def test_bound_terms_hand_computed():
    # sample 0: 4 tokens, counts [3, 3, 1, 1]; sample 1: 2 tokens, [0, 2, 2, 0]. G = 2, r = 0: S = E/G = 2 slots.
    batch = _batch([[[3, 3, 1, 1]], [[0, 2, 2, 0]]])
    b = bound_terms(batch, MODEL, ONE_NODE, 0, micro_batch=np.zeros(2, np.int64))
    # 12 pairs over 2 GPUs at 1 s each: 6 s
    np.testing.assert_allclose(b.comp, [6.0])
    # sample 0 keeps at most 6 pairs on its GPU: 2 leave over NVLink (1 s each) from that GPU, so the dispatch
    # takes >= max(2 / 2 GPUs, 2) = 2 s and dispatch + combine >= 4 s; sample 1 fits its 2 slots.
    np.testing.assert_allclose(b.off_gpu, [2.0])
    np.testing.assert_allclose(b.comm, [4.0])
    assert b.t_moe_s == pytest.approx(10.0)
    # one more replica slot (S = 3): sample 0 keeps 7, one pair leaves -> comm 2 s
    assert bound_t_moe(batch, MODEL, ONE_NODE, 1, micro_batch=np.zeros(2, np.int64)) == pytest.approx(8.0)
    # two nodes of one GPU: every crossing pair is on RDMA (2 s): comm 2 x 2 pairs x 2 s = 8 s
    two = ONE_NODE.with_(nodes=2, gpus_per_node=1)
    assert bound_t_moe(batch, MODEL, two, 0) == pytest.approx(6.0 + 8.0)
    with pytest.raises(PlanError, match="replica_slots=-1 must be an int >= 0"):
        bound_terms(batch, MODEL, ONE_NODE, -1)
    with pytest.raises(PlanError, match=r"micro_batch has shape \(3,\), the batch has 2 samples"):
        bound_terms(batch, MODEL, ONE_NODE, micro_batch=np.zeros(3, np.int64))


def test_bound_two_level_links():
    # 2 nodes x 2 GPUs, E = 8 (2 per GPU), r = 0: S = 2 per GPU, 4 per node. One sample of 4 tokens spread over 8
    # experts (one pair each): 6 pairs leave its GPU and 4 its node. NVLink 1 s, RDMA 2 s a pair: with a + b >= 6,
    # b >= 4 the least max(a x 1, b x 2) is 8 (b = 4 on RDMA, a = 2 on NVLink), above 6 x 1 x 2 / 3 = 4.
    model = MODEL.with_(num_experts=8)
    cluster = ONE_NODE.with_(nodes=2)
    batch = TraceBatch.from_counts(np.ones((1, 1, 8), np.int64), 2, micro_batch=np.zeros(1, np.int64))
    b = bound_terms(batch, model, cluster, 0)
    assert (b.off_gpu[0], b.off_node[0]) == (6.0, 4.0)
    assert b.comm[0] == pytest.approx(2 * 8.0)  # one sample: all of it leaves from one GPU


def test_bound_below_brute_force_optimum():
    # Every home layout (2 experts per GPU) and every sample placement of a 3-sample micro-batch on 2 GPUs: the
    # exact cost model's best sum of T_MoE is >= the bound.
    counts = np.array([[[3, 1, 0, 2]], [[0, 2, 2, 2]], [[1, 0, 2, 1]]])
    batch = _batch(counts)
    best = np.inf
    for homes in itertools.permutations([0, 0, 1, 1]):
        for sg in itertools.product(range(2), repeat=3):
            x = np.zeros((2, 4))
            for n, g in enumerate(sg):
                x[g] += counts[n, 0]
            best = min(best, float(cost_from_flow(flow_matrix(x, np.array(homes)), MODEL, ONE_NODE).t_moe))
    bound = bound_t_moe(batch, MODEL, ONE_NODE, 0, micro_batch=np.zeros(3, np.int64))
    assert bound <= best + 1e-12
    assert bound >= 0.5 * best  # and not vacuous here


def _random_batch(rng: np.random.Generator, model: ModelSpec, n: int, mbs: int) -> TraceBatch:
    """``n`` samples of 1..40 tokens with skewed routing (per-sample preferred experts), ``mbs`` per micro-batch."""
    E, k, L = model.num_experts, model.top_k, model.num_layers
    counts = np.zeros((n, L, E), np.int64)
    for i in range(n):
        s = int(rng.integers(1, 81))
        for l in range(L):
            p = rng.dirichlet(np.full(E, 2.0))
            for _ in range(s):
                counts[i, l, rng.choice(E, k, replace=False, p=p)] += 1
    return TraceBatch.from_counts(counts, k, micro_batch=np.arange(n) // mbs)


PROP_MODEL = ModelSpec("prop", hidden=64, ffn=32, num_experts=8, top_k=2, num_layers=2, dtype_bytes=2,
                       num_heads=4, num_kv_heads=2, head_dim=16)


@given(seed=st.integers(0, 10_000), strategy=st.sampled_from(sorted(STRATEGIES)), r=st.integers(0, 2),
       shape=st.sampled_from([(1, 4), (2, 2), (4, 1), (2, 4)]), dispatcher=st.sampled_from(["alltoall", "deepep"]),
       overlap=st.sampled_from(OVERLAPS), free=st.booleans(), repack=st.booleans(), trainer=st.booleans(),
       curve=st.booleans(), latency=st.booleans(), links=st.sampled_from([1.0, 30.0, 1000.0]),
       placement=st.sampled_from((None,) + SAMPLE_PLACEMENTS))
def test_no_strategy_beats_the_bound(seed, strategy, r, shape, dispatcher, overlap, free, repack, trainer, curve,
                                     latency, links, placement):
    rng = np.random.default_rng(seed)
    nodes, gpn = shape
    cluster = ClusterSpec(nodes=nodes, gpus_per_node=gpn, nvlink_bw=4e9 * links, rdma_bw=1e9 * links, flops=2e12,
                          attn_flops=1e12, dispatcher=dispatcher, overlap=overlap,
                          gemm_curve=((4.0, 1e12), (64.0, 3e12)) if curve else (),
                          nvlink_latency=2e-6 if latency else 0.0, rdma_latency=5e-6 if latency else 0.0)
    G = cluster.num_gpus
    batch = _random_batch(rng, PROP_MODEL, 2 * G, G)
    r = min(r, PROP_MODEL.num_experts - PROP_MODEL.num_experts // G)
    kw: dict = {"seed": seed % 7}
    if strategy in ("relibra", "relibra-inter"):
        kw.update(iters=60, locality_iters=40, num_seeds=1, rounds=1)
        kw.update(migration=not free, price_replicas=not free)
    if strategy == "eplb-history":
        kw["history"] = rng.integers(0, 20, size=(PROP_MODEL.num_layers, PROP_MODEL.num_experts))
    if trainer and placement is None:
        kw.update(sample_owner="trainer", sample_gpu=rng.integers(0, G, size=batch.num_sequences))
    elif trainer:  # the trainer's own placement is one of the named ones (length-balanced regroups micro-batches)
        kw.update(sample_owner="trainer", sample_placement=placement)
    elif repack and strategy not in ("balanced",):
        kw["repack"] = True
    if placement is not None and not trainer:
        kw["sample_placement"] = placement
    slots = r if strategy in REPLICA_STRATEGIES else 0
    plan = plan_batch(batch, PROP_MODEL, cluster, strategy, replica_slots=slots, **kw)
    repacked = bool(kw.get("repack"))
    bal = plan_batch(batch, PROP_MODEL, cluster, "balanced", replica_slots=r, repack=repacked)
    bound_moe = score_plan(bal, batch, PROP_MODEL, cluster).t_moe_s
    bound = simulate_step(bal, batch, PROP_MODEL, cluster)
    packs = None if repacked else bound_micro_batch(bal, batch)
    assert bound_moe == pytest.approx(bound_t_moe(batch, PROP_MODEL, cluster, r, packs))
    assert bound.step_s == pytest.approx(bound_step(batch, PROP_MODEL, cluster, r, packs).step_s)
    if strategy == "balanced":
        return
    assert score_plan(plan, batch, PROP_MODEL, cluster).t_moe_s >= bound_moe * (1 - 1e-9)
    step = simulate_step(plan, batch, PROP_MODEL, cluster)
    assert step.step_s >= bound.step_s * (1 - 1e-9), (step.breakdown, bound.breakdown)


def test_bound_is_attained_where_a_plan_can_reach_it():
    # Two samples of 6 tokens, one on experts {0, 1}, the other on {2, 3}: the static homes with each sample on the
    # GPU of its experts move nothing and balance compute and attention, so the bound is that plan's cost exactly.
    batch = _batch([[[6, 6, 0, 0]], [[0, 0, 6, 6]]])
    for overlap in OVERLAPS:
        cluster = ONE_NODE.with_(overlap=overlap)
        plan = plan_batch(batch, MODEL, cluster, "static", sample_owner="trainer", sample_gpu=np.array([0, 1]))
        assert score_plan(plan, batch, MODEL, cluster).t_moe_s == pytest.approx(
            bound_t_moe(batch, MODEL, cluster, 0, micro_batch=np.zeros(2, np.int64)), rel=1e-12)
        assert simulate_step(plan, batch, MODEL, cluster).step_s == pytest.approx(
            bound_step(batch, MODEL, cluster, 0, np.zeros(2, np.int64)).step_s, rel=1e-12)


def test_bound_step_figures_and_overlap():
    batch = _random_batch(np.random.default_rng(1), PROP_MODEL, 8, 4)
    base = ClusterSpec(nodes=2, gpus_per_node=2, nvlink_bw=4e9, rdma_bw=1e9, flops=2e12, attn_flops=1e12)
    steps = {o: bound_step(batch, PROP_MODEL, base.with_(overlap=o), 1) for o in OVERLAPS}
    none = steps["none"]
    assert sum(none.breakdown.values()) == pytest.approx(none.step_s) and none.overlap_hidden_s == 0.0
    assert none.step_s == pytest.approx(none.attention_fwd_s + none.attention_bwd_s + 3 * none.moe_fwd_comp_s
                                        + 2 * none.moe_fwd_comm_s)
    assert none.step_s >= steps["megatron"].step_s >= steps["dualpipe"].step_s
    for s in steps.values():
        assert sum(s.breakdown.values()) == pytest.approx(s.step_s)
        assert s.t_moe.shape == (2, PROP_MODEL.num_layers) and s.micro_batch_s.sum() == pytest.approx(s.step_s)
    # the attention term: per micro-batch at least the longest sample's local stage
    fixed = bound_step(batch, PROP_MODEL, base, 1, batch.resolve_micro_batch())
    assert fixed.attention_fwd_s >= none.attention_fwd_s


def test_bound_holds_for_plans_that_regroup_micro_batches():
    # Two micro-batches, each with one long and one short sample; verl's length-balanced placement regroups them
    # (the two short ones in one micro-batch, the two long ones in the other), so its attention pays the long
    # sample once instead of twice. Attention dominates here: a bound that kept the batch's micro-batches charged
    # 0.182 s, above this plan's 0.0919 s. The bound takes the least over the packings the plans can have.
    model = PROP_MODEL.with_(num_experts=4, top_k=1, num_layers=1)
    cluster = ClusterSpec(nodes=1, gpus_per_node=2, nvlink_bw=4e12, rdma_bw=1e12, flops=2e15, attn_flops=1e9)
    counts = np.zeros((4, 1, 4), np.int64)
    for n, (tokens, e) in enumerate([(400, 0), (10, 1), (400, 2), (10, 3)]):
        counts[n, 0, e] = tokens
    batch = TraceBatch.from_counts(counts, 1, micro_batch=np.array([0, 0, 1, 1]))
    bal = plan_batch(batch, model, cluster, "balanced")
    packs = bound_micro_batch(bal, batch)
    lb, _ = place_samples("length-balanced", batch.lengths, batch.resolve_micro_batch(), 2)
    assert {tuple(p) for p in packs} == {(0, 0, 1, 1), tuple(lb)} and tuple(lb) == (1, 0, 1, 0)
    plan = plan_batch(batch, model, cluster, "static", sample_placement="length-balanced")
    assert tuple(plan.samples.micro_batch) == tuple(lb)
    step, bound = simulate_step(plan, batch, model, cluster), simulate_step(bal, batch, model, cluster)
    assert step.step_s >= bound.step_s * (1 - 1e-9)
    # the batch's own packing alone would be beaten by 2x; the bound is tight on this plan (one layer: L x attention
    # of the long sample once + the short one once, MoE at the peak with each sample on the GPU of its expert)
    assert bound_step(batch, model, cluster, 0, batch.resolve_micro_batch()).step_s > 1.9 * step.step_s
    assert bound.step_s == pytest.approx(step.step_s, rel=1e-5)
    assert bound_micro_batch(plan_batch(batch, model, cluster, "balanced", repack=True), batch) is None
    # a Balanced plan made on the length-balanced placement still covers the batch's own micro-batches
    bal_lb = plan_batch(batch, model, cluster, "balanced", sample_placement="length-balanced")
    assert {tuple(p) for p in bound_micro_batch(bal_lb, batch)} == {(0, 0, 1, 1), tuple(lb)}
    with pytest.raises(PlanError, match=r"micro_batch has shape \(2, 3\), the batch has 4 samples"):
        bound_terms(batch, model, cluster, micro_batch=np.zeros((2, 3), np.int64))


def _node_locality_replicas(plan: BatchPlan, batch: TraceBatch, cluster: ClusterSpec, r: int) -> BatchPlan:
    """``plan`` with global-scope replicas chosen per micro-batch for locality: each node's ``P x r`` slots hold the
    experts homed on other nodes that its samples route most to, and its GPUs send those pairs to the copy in
    their node. No strategy builds it; it is a valid plan (``BatchPlan.validate``) that keeps far more pairs on
    their node than the homes alone, the kind of plan the bound's per-sample relaxation must stay below."""
    G, P = cluster.num_gpus, cluster.gpus_per_node
    x = plan_loads(plan, batch, G)
    M, L, _, E = x.shape
    home, node = plan.placement.expert_gpu, np.arange(G) // P
    rep = np.full((M, L, G, r), -1, np.int32)
    rows = []
    for m, l, nu in itertools.product(range(M), range(L), range(cluster.nodes)):
        gs = np.flatnonzero(node == nu)
        want = x[m, l, gs].sum(0).astype(np.float64)
        remote = np.flatnonzero(node[home[l]] != nu)
        for i, e in enumerate(remote[np.argsort(-want[remote], kind="stable")][: P * r]):
            g = gs[i % P]
            rep[m, l, g, i // P] = e
            rows += [(m, l, j, e, g) for j in gs if x[m, l, j, e] > 0]
    idx = np.array(rows, np.int32).reshape(-1, 5)
    reps = ReplicaPlan(rep, idx, np.ones(len(idx), np.float32), scope="global")
    return BatchPlan(plan.placement, plan.samples, reps, G, P, {**plan.stats.to_dict(), "strategy": "node-locality"})


@given(seed=st.integers(0, 10_000), shape=st.sampled_from([(2, 2), (4, 1), (2, 4)]), r=st.integers(1, 2),
       dispatcher=st.sampled_from(["alltoall", "deepep"]), placement=st.sampled_from(SAMPLE_PLACEMENTS))
def test_bound_below_hand_built_locality_plans(seed, shape, r, dispatcher, placement):
    # Global-scope replicas picked per micro-batch for each node's own samples: the valid plans closest to the
    # bound's communication relaxation (each sample keeps its best experts near it). None beats the bound.
    rng = np.random.default_rng(seed)
    cluster = ClusterSpec(nodes=shape[0], gpus_per_node=shape[1], nvlink_bw=4e9, rdma_bw=1e9, flops=2e12,
                          attn_flops=1e12, dispatcher=dispatcher)
    G = cluster.num_gpus
    batch = _random_batch(rng, PROP_MODEL, 2 * G, G)
    base = plan_batch(batch, PROP_MODEL, cluster, "static", sample_placement=placement)
    plan = _node_locality_replicas(base, batch, cluster, r)
    plan.validate(PROP_MODEL, cluster, batch.num_sequences)
    bal = plan_batch(batch, PROP_MODEL, cluster, "balanced", replica_slots=r)
    local = score_plan(plan, batch, PROP_MODEL, cluster)
    assert local.t_moe_s >= score_plan(bal, batch, PROP_MODEL, cluster).t_moe_s * (1 - 1e-9)
    assert simulate_step(plan, batch, PROP_MODEL, cluster).step_s >= \
        simulate_step(bal, batch, PROP_MODEL, cluster).step_s * (1 - 1e-9)
