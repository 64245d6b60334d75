"""planners/bounds.py: the portfolio's pruning bound is at most the judged score of the plans it bounds (static
homes with and without replicas), its re-layout term is the judge's, and it drops it with ``migration=False``."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import numpy as np
import pytest

from relibra_moe.plan import Placement
from relibra_moe.planners.baselines import static_placement
from relibra_moe.planners.bounds import replicated_step_lower_bound
from relibra_moe.planners.evaluation import SIMULATED_STEP
from relibra_moe.planners.executor import default_executor
from relibra_moe.planners.options import PlanOptions
from relibra_moe.planners.portfolio import portfolio_score
from relibra_moe.planners.strategies import make_context, plan_batch
from relibra_moe.specs import ClusterSpec, ModelSpec
from relibra_moe.synthetic import rl_batch

MODEL = ModelSpec("t", hidden=256, ffn=128, num_experts=8, top_k=2, num_layers=2)
CLUSTER = ClusterSpec(nodes=2, gpus_per_node=2)


def _batch():
    return rl_batch(MODEL, "mixed", 3, responses_per_prompt=4, seed=11, micro_batch_size=6, max_len=64)


@pytest.mark.parametrize("r", [0, 1, 2])
@pytest.mark.parametrize("free", [{}, {"migration": False}, {"step_objective": False}])
def test_the_bound_is_below_the_judged_score_of_static_and_online(r, free):
    batch = _batch()
    options = PlanOptions(replica_slots=r, **free)
    ctx = make_context(batch, MODEL, CLUSTER, "relibra", options, default_executor(1))
    static = static_placement(MODEL.num_layers, MODEL.num_experts, CLUSTER.num_gpus)
    previous = Placement(np.roll(static, 1, axis=1))  # a previous layout other than static: moves cost
    for strategy in ("static", "online"):
        plan = plan_batch(batch, MODEL, CLUSTER, strategy, replica_slots=r if strategy == "online" else 0)
        mb, sg = plan.samples.micro_batch.astype(np.int64), plan.samples.gpu.astype(np.int64)
        bound = replicated_step_lower_bound(ctx, static, mb, sg, ctx.loads(mb, sg), previous, 12.0)
        step = SIMULATED_STEP.step(plan, ctx.lengths, ctx.loads(mb, sg), MODEL, CLUSTER, previous, 12.0)
        assert 0.0 < bound <= portfolio_score(step, options) * (1 + 1e-12)


def test_the_relayout_term_is_the_judges_and_free_without_migration():
    batch = _batch()
    static = static_placement(MODEL.num_layers, MODEL.num_experts, CLUSTER.num_gpus)
    moved, same = Placement(np.roll(static, 1, axis=1)), Placement(static)
    calls = []

    def relayout(previous, placement, model, cluster, opb):
        calls.append(opb)
        return 7.0 if previous is moved else 0.0

    for migration, extra in ((True, 7.0), (False, 0.0)):
        ctx = make_context(batch, MODEL, CLUSTER, "relibra", PlanOptions(migration=migration), default_executor(1))
        ctx.evaluator = SimpleNamespace(relayout_seconds=relayout)
        mb, sg = ctx.micro_batch, ctx.sample_gpu
        x = ctx.loads(mb, sg)
        diff = (replicated_step_lower_bound(ctx, static, mb, sg, x, moved, 3.0)
                - replicated_step_lower_bound(ctx, static, mb, sg, x, same, 3.0))
        assert diff == pytest.approx(extra, rel=1e-12)
    assert calls == [3.0, 3.0]  # asked only with migration on, with the caller's optimizer bytes


@pytest.mark.parametrize("r", [1, 2])
@pytest.mark.parametrize("free", [{}, {"migration": False, "price_replicas": False}, {"step_objective": False}])
def test_the_global_bound_is_below_the_judged_score_of_global_replica_plans(r, free):
    """``global_replica_step_lower_bound`` on relibra's homes and samples is at most the judged score of both
    locality-replica plans on them (scope "global") and of the plan without replicas."""
    from relibra_moe.plan import BatchPlan, ReplicaPlan, SamplePlacement
    from relibra_moe.planners.bounds import global_replica_step_lower_bound
    from relibra_moe.planners.locality_replicas import locality_replicas

    batch = _batch()
    options = PlanOptions(replica_slots=r, **free)
    ctx = make_context(batch, MODEL, CLUSTER, "relibra", options, default_executor(1))
    rel = plan_batch(batch, MODEL, CLUSTER, "relibra", replica_slots=r, iters=50, locality_iters=20, num_seeds=1,
                     rounds=1)
    eg = rel.placement.expert_gpu.astype(np.int64)
    mb, sg = rel.samples.micro_batch.astype(np.int64), rel.samples.gpu.astype(np.int64)
    x = ctx.loads(mb, sg)
    previous = Placement(static_placement(MODEL.num_layers, MODEL.num_experts, CLUSTER.num_gpus))
    bound = global_replica_step_lower_bound(ctx, eg, mb, sg, x, previous, 12.0)
    samples = SamplePlacement(mb, sg, ctx.num_micro_batches)
    plans = [locality_replicas(x, eg, MODEL, CLUSTER, r, res) for res in (True, False)]
    plans.append(ReplicaPlan.empty(ctx.num_micro_batches, MODEL.num_layers, CLUSTER.num_gpus, r))
    for reps in plans:
        plan = BatchPlan(Placement(eg), samples, reps, CLUSTER.num_gpus, CLUSTER.gpus_per_node)
        step = SIMULATED_STEP.step(plan, ctx.lengths, x, MODEL, CLUSTER, previous, 12.0)
        assert 0.0 < bound <= portfolio_score(step, options) * (1 + 1e-12)


def test_the_global_bound_counts_what_must_leave_each_source_by_hand():
    """One cell, E = 4 on 4 GPUs (expert e on GPU e), r = 1, step_objective off (the bound is the sum of the
    cell's comp + comm bounds): source 0 sends 6, 3, 2, 1 tokens to experts 0..3; it homes expert 0 and holds at
    most one more (the 3), so 2 + 1 = 3 leave it, at NVLink or RDMA rates: comm >= 3 w_nv w_rdma / (w_nv + w_rdma)
    token units; comp >= 12 / 4 = 3."""
    from relibra_moe.planners.bounds import global_replica_step_lower_bound
    from relibra_moe.planners.split import cell_weights

    model = MODEL.with_(num_experts=4, num_layers=1)
    batch = rl_batch(model, "mixed", 1, responses_per_prompt=1, seed=1, micro_batch_size=1, max_len=16)
    ctx = make_context(batch, model, CLUSTER, "relibra", PlanOptions(replica_slots=1, step_objective=False),
                       default_executor(1))
    x = np.zeros((1, 1, 4, 4))
    x[0, 0, 0] = [6, 3, 2, 1]
    w = cell_weights(model, CLUSTER)
    want = (3.0 + 3.0 * w.w_nv * w.w_rdma / (w.w_nv + w.w_rdma)) * w.sec_per_token
    got = global_replica_step_lower_bound(ctx, np.arange(4)[None], np.zeros(1, np.int64), np.zeros(1, np.int64), x,
                                          Placement(np.arange(4)[None]), 12.0)
    assert got == pytest.approx(want, rel=1e-12)


@pytest.mark.parametrize("sources, rdma", [
    # source 0 routes 5, 4, 3, 2 tokens to experts 4..7 (node 1's), source 1 routes 1, 1, 6, 0: node 0 may hold 2
    # of them (2 GPUs x r = 1), so source 0 alone sends at least 2 + 3 over RDMA whichever 2 its node copies
    ([[5, 4, 3, 2], [1, 1, 6, 0]], 5.0),
    # complementary sources: each keeps its two experts in its node's 2 copies, but the node cannot keep all 4:
    # 8 of the node's 16 remote tokens cross, 4 per GPU at best
    ([[4, 0, 4, 0], [0, 4, 0, 4]], 4.0),
])
def test_the_global_bound_counts_what_must_cross_nodes_by_hand(sources, rdma):
    """2 nodes x 2 GPUs, 8 experts (two per GPU: 4..7 on node 1), r = 1, step_objective off. Besides its homes a node
    holds at most P r = 2 other experts, so its sources' other remote tokens leave over RDMA: comm is at least
    ``rdma`` (the worse of the worst source's and the node's over its P GPUs) times ``w_rdma``, above what must
    leave each source at NVLink-or-RDMA rates (source 0's tokens beyond its r largest)."""
    from relibra_moe.planners.bounds import global_replica_step_lower_bound
    from relibra_moe.planners.split import cell_weights

    model = MODEL.with_(num_layers=1)
    batch = rl_batch(model, "mixed", 1, responses_per_prompt=1, seed=1, micro_batch_size=1, max_len=16)
    ctx = make_context(batch, model, CLUSTER, "relibra", PlanOptions(replica_slots=1, step_objective=False),
                       default_executor(1))
    x = np.zeros((1, 1, 4, 8))
    x[0, 0, :2, 4:] = sources
    homes = static_placement(1, 8, 4)
    assert homes.tolist() == [[0, 0, 1, 1, 2, 2, 3, 3]]
    w = cell_weights(model, CLUSTER)
    leave = max(sum(sorted(s)[:-1]) for s in sources) * w.w_nv * w.w_rdma / (w.w_nv + w.w_rdma)
    assert rdma * w.w_rdma > leave  # the RDMA term (worst source's or node's) is the one that binds
    want = (x.sum() / 4 + rdma * w.w_rdma) * w.sec_per_token
    got = global_replica_step_lower_bound(ctx, homes, np.zeros(1, np.int64), np.zeros(1, np.int64), x,
                                          Placement(homes), 12.0)
    assert got == pytest.approx(want, rel=1e-12)


@pytest.mark.parametrize("seed", range(8))
def test_the_global_bound_is_below_the_exact_split_of_random_copies(seed):
    """One random cell on 2 x 2 GPUs (8 experts, r = 1, any homes, E / G a GPU): the best exact LP split
    (``locality_split``) over every choice of each GPU's copy, anywhere, is at least the bound's comp + comm
    (step_objective off: the bound is the sum of T_MoE)."""
    from relibra_moe.planners.bounds import global_replica_step_lower_bound
    from relibra_moe.planners.locality_replicas import locality_split

    rng = np.random.default_rng(seed)
    r = 1
    model = MODEL.with_(num_layers=1)
    batch = rl_batch(model, "mixed", 1, responses_per_prompt=1, seed=1, micro_batch_size=1, max_len=16)
    ctx = make_context(batch, model, CLUSTER, "relibra", PlanOptions(replica_slots=r, step_objective=False),
                       default_executor(1))
    x = rng.integers(0, 12, size=(1, 1, 4, 8)).astype(float) * (rng.random((1, 1, 4, 8)) < 0.7)
    if seed % 2:
        x[0, 0, 2:] = 0  # only node 0's sources route: what crosses nodes binds
    homes = rng.permutation(np.repeat(np.arange(4), 2))[None]
    bound = global_replica_step_lower_bound(ctx, homes, np.zeros(1, np.int64), np.zeros(1, np.int64), x,
                                            Placement(homes), 12.0)
    best = np.inf
    for g0, g1, g2, g3 in itertools.product(*[itertools.combinations(np.flatnonzero(homes[0] != g), r)
                                               for g in range(4)]):
        copies = np.array([g0, g1, g2, g3])
        best = min(best, locality_split(x[0, 0], homes[0], copies, model, CLUSTER).t_moe)
    assert bound <= best * (1 + 1e-9)


def test_fixed_copy_terms_by_hand():
    """2 nodes x 2 GPUs, expert e homed on GPU e; tokens (source, expert): (0, 0) 4, (0, 3) 2, (1, 2) 3, (2, 3) 6,
    (2, 0) 1 (16 in all; expert loads 5, 0, 3, 8). Compute: the heaviest arc's experts over its GPUs, at least
    16 / 4. Without copies GPU 3 alone holds expert 3: 8. A copy of it on GPU 2 (its node): the arc {2, 3} holds
    experts 2 and 3, 11 / 2; GPU 0 alone expert 0, 5. A copy on GPU 0 (the other node): expert 3 lies in no arc,
    GPU 0 computes expert 0, 5. Sends: GPU 1's 3 tokens to expert 2 (and GPU 0's 2 to expert 3, unless node 0 holds
    a copy); receives: GPU 2 gets those 3 from node 0. The node-level ``split.lower_bound_terms`` (any intra-node
    copies) are at most these."""
    from relibra_moe.planners.bounds import fixed_copy_terms, ring_arcs
    from relibra_moe.planners.split import cell_weights, lower_bound_terms

    x = np.zeros((1, 1, 4, 4))
    for (j, e), n in {(0, 0): 4, (0, 3): 2, (1, 2): 3, (2, 3): 6, (2, 0): 1}.items():
        x[0, 0, j, e] = n
    homes = np.arange(4)[None]
    w = cell_weights(MODEL, CLUSTER)
    assert sorted(map(tuple, ring_arcs(CLUSTER).astype(int))) == sorted(
        [(1, 0, 0, 0), (0, 1, 0, 0), (0, 0, 1, 0), (0, 0, 0, 1), (1, 1, 0, 0), (0, 0, 1, 1)])
    node = lower_bound_terms(x, homes[None], MODEL, CLUSTER)
    for gpu, comp in ((-1, 8.0), (2, 5.5), (0, 5.0)):
        copies = np.full((1, 4, 1), -1)
        if gpu >= 0:
            copies[0, gpu, 0] = 3
        got = fixed_copy_terms(x, homes, copies, MODEL, CLUSTER)
        assert got[0][0, 0] == pytest.approx(comp * w.sec_per_token, rel=1e-12)
        assert got[1][0, 0] == pytest.approx(w.w_rdma * 3.0 * w.sec_per_token, rel=1e-12)
        if gpu != 0:
            assert got[0][0, 0] >= node[0][0, 0] and got[1][0, 0] >= node[1][0, 0] - 1e-18


@pytest.mark.parametrize("r", [1, 2])
@pytest.mark.parametrize("placement", ["round-robin", "length-balanced"])
def test_the_bound_is_below_the_judged_score_of_eplb_and_lplb(r, placement):
    """EPLB+'s and LPLB+'s bounds with their own copies (EPLB+'s may leave the node: 2 x 2 GPUs, the global policy)
    are at most the plans' judged scores, and LPLB+'s at least its node-level bound (any intra-node copies)."""
    batch = _batch()
    options = PlanOptions(replica_slots=r)
    ctx = make_context(batch, MODEL, CLUSTER, "relibra", options, default_executor(1))
    previous = Placement(static_placement(MODEL.num_layers, MODEL.num_experts, CLUSTER.num_gpus))
    crossed = False
    for strategy in ("eplb", "lplb"):
        plan = plan_batch(batch, MODEL, CLUSTER, strategy, replica_slots=r, sample_placement=placement)
        mb, sg = plan.samples.micro_batch.astype(np.int64), plan.samples.gpu.astype(np.int64)
        homes, rep = plan.placement.expert_gpu, plan.replicas.replica_expert
        copies = rep[0]
        assert (rep == copies).all() and (copies >= 0).any()
        l, g, s = np.nonzero(copies >= 0)
        crossed |= bool((homes[l, copies[l, g, s]] // 2 != g // 2).any())
        bound = replicated_step_lower_bound(ctx, homes, mb, sg, ctx.loads(mb, sg), previous, 12.0, copies)
        if strategy == "lplb":
            assert bound >= replicated_step_lower_bound(ctx, homes, mb, sg, ctx.loads(mb, sg), previous, 12.0)
        step = SIMULATED_STEP.step(plan, ctx.lengths, ctx.loads(mb, sg), MODEL, CLUSTER, previous, 12.0)
        assert 0.0 < bound <= portfolio_score(step, options) * (1 + 1e-12), strategy
    assert crossed  # the case the intra-node terms do not cover
