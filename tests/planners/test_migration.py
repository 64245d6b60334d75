"""Migration-aware placement: fabric symmetries (cost invariance, brute-force best relabelling) and the
per-layer keep decision against a brute-force reference of the step-time objective."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from relibra_moe.cost import moe_cost
from relibra_moe.errors import PlanError
from relibra_moe.planners.migration import (
    carry_over,
    homes_savings,
    horizon_gains,
    is_symmetry,
    keep_previous_layers,
    migrate,
    relabel_to_previous,
    step_moe_seconds,
    symmetry_perm,
)
from relibra_moe.planners.strategies import plan_batch
from relibra_moe.specs import ClusterSpec, ModelSpec
from relibra_moe.timing import move_bytes, transfer_seconds

CLUSTER = ClusterSpec(nodes=2, gpus_per_node=3)
MODEL = ModelSpec("t", hidden=64, ffn=32, num_experts=12, top_k=2, num_layers=3)


def _all_symmetries(cluster):
    for sn in itertools.permutations(range(cluster.nodes)):
        for sp in itertools.permutations(range(cluster.gpus_per_node)):
            yield symmetry_perm(np.array(sn), np.array(sp), cluster.gpus_per_node)


def test_symmetries_preserve_cost_and_others_do_not():
    rng = np.random.default_rng(0)
    x = rng.integers(0, 30, size=(CLUSTER.num_gpus, MODEL.num_experts)).astype(float)
    eg = rng.permutation(np.repeat(np.arange(CLUSTER.num_gpus), 2))
    base = moe_cost(x, eg, MODEL, CLUSTER)
    for perm in _all_symmetries(CLUSTER):
        assert is_symmetry(perm, CLUSTER)
        xp = np.zeros_like(x)
        xp[perm] = x  # sources relabelled with the experts
        c = moe_cost(xp, perm[eg], MODEL, CLUSTER)
        assert float(c.t_moe) == pytest.approx(float(base.t_moe), rel=1e-12)
    assert not is_symmetry(np.array([0, 1, 3, 2, 4, 5]), CLUSTER)  # a GPU swapped across nodes alone


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_relabel_matches_brute_force(seed):
    rng = np.random.default_rng(seed)
    L, E, G = 4, MODEL.num_experts, CLUSTER.num_gpus
    prev = np.stack([rng.permutation(np.repeat(np.arange(G), E // G)) for _ in range(L)])
    new = prev.copy()
    new[:, :3] = np.stack([rng.permutation(np.repeat(np.arange(G), E // G))[:3] for _ in range(L)])
    hidden = list(_all_symmetries(CLUSTER))[rng.integers(1, 12)]
    new = hidden[new]  # the plan came out relabelled
    best = max(int((perm[new] == prev).sum()) for perm in _all_symmetries(CLUSTER))
    perm = relabel_to_previous(new, prev, CLUSTER, starts=6)
    assert is_symmetry(perm, CLUSTER)
    assert int((perm[new] == prev).sum()) == best


def _objective(x, eg, prev, keep_mask):
    """Independent reference: step MoE seconds of the chosen homes + the joint re-layout time."""
    homes = np.where(keep_mask[:, None], prev, eg)
    moe = 0.0
    for l in range(eg.shape[0]):
        c = moe_cost(x[:, l], homes[l], MODEL, CLUSTER)
        moe += float((3 * c.comp.max(-1) + 2 * c.comm.max(-1)).sum())
    moved = homes != prev
    t = transfer_seconds(prev[moved], homes[moved], move_bytes(MODEL), None, 1, CLUSTER)[0] if moved.any() else 0.0
    return moe + float(t)


@pytest.mark.parametrize("seed", [0, 3])
def test_keep_previous_layers_never_worse_than_all_or_nothing(seed):
    rng = np.random.default_rng(seed)
    M, L, G, E = 2, MODEL.num_layers, CLUSTER.num_gpus, MODEL.num_experts
    # heavy loads so that some layers' gains pay their move, others not
    x = rng.gamma(0.5, 2e5 * (1 + 10 * (np.arange(L) == 0))[None, :, None, None], size=(M, L, G, E))
    prev = np.stack([np.repeat(np.arange(G), E // G)] * L)
    eg = np.stack([rng.permutation(prev[0]) for _ in range(L)])
    out, info = keep_previous_layers(x, eg, prev, MODEL, CLUSTER)
    kept = np.zeros(L, bool)
    kept[info["layers_kept"]] = True
    np.testing.assert_array_equal(out, np.where(kept[:, None], prev, eg))
    got = _objective(x, eg, prev, kept)
    assert got <= _objective(x, eg, prev, np.zeros(L, bool)) + 1e-12
    assert got <= _objective(x, eg, prev, np.ones(L, bool)) + 1e-12
    best = min(_objective(x, eg, prev, np.array(k, bool)) for k in itertools.product([0, 1], repeat=L))
    assert got <= best * 1.05  # greedy on the joint re-layout, near the brute-force optimum
    for l in range(L):
        want = step_moe_seconds(x[:, l], prev[l], MODEL, CLUSTER) - step_moe_seconds(x[:, l], eg[l], MODEL, CLUSTER)
        assert info["gain_s"][l] == pytest.approx(want, rel=1e-9, abs=1e-15)


def test_plan_batch_migration_option_and_previous_validation():
    from relibra_moe.trace import RoutingTrace, TraceBatch

    rng = np.random.default_rng(0)
    def rows(s):  # k distinct experts per token, skewed popularity
        p = np.linspace(3, 1, MODEL.num_experts) ** 2
        return np.array([[rng.choice(MODEL.num_experts, MODEL.top_k, replace=False, p=p / p.sum())
                          for _ in range(MODEL.num_layers)] for _ in range(s)], np.int32)

    traces = [RoutingTrace(rows(int(rng.integers(20, 60))), np.arange(MODEL.num_layers, dtype=np.int32),
                           MODEL.num_experts, MODEL.top_k) for _ in range(12)]
    batch = TraceBatch(traces).with_micro_batch_size(6)
    off = plan_batch(batch, MODEL, CLUSTER, "relibra-inter", migration=False, iters=300, locality_iters=200)
    on = plan_batch(batch, MODEL, CLUSTER, "relibra-inter", iters=300, locality_iters=200)
    assert off.stats.migration.to_dict() == {"enabled": False}
    mig = on.stats.migration
    assert mig.enabled and mig.moved <= mig.moved_after_relabel
    static = np.repeat(np.arange(CLUSTER.num_gpus), MODEL.num_experts // CLUSTER.num_gpus)
    assert int((on.placement.expert_gpu != static).sum()) == mig.moved
    # previous = the plan's own homes: nothing moves
    again = plan_batch(batch, MODEL, CLUSTER, "relibra-inter", previous=on.placement, iters=300, locality_iters=200)
    assert again.stats.migration.moved <= int((again.placement.expert_gpu != on.placement.expert_gpu).sum())
    with pytest.raises(PlanError, match=r"previous placement must be \[L=3, E=12\] GPUs in \[0, 6\), got shape "
                                        r"\(2, 2\)"):
        plan_batch(batch, MODEL, CLUSTER, "relibra-inter", previous=np.zeros((2, 2), np.int64))
    with pytest.raises(PlanError, match=r"previous placement: expert_gpu\[0, 0\] = 6 is outside \[0, 6\)"):
        plan_batch(batch, MODEL, CLUSTER, "relibra-inter", previous=np.full((3, 12), 6))
    with pytest.raises(PlanError, match="previous placement: expert_gpu: GPU 0 homes 12 experts in layer 0; "
                                        "every GPU must home exactly E/G = 2"):
        plan_batch(batch, MODEL, CLUSTER, "relibra-inter", previous=np.zeros((3, 12), np.int64))


def test_migrate_relabels_samples_with_homes_unless_the_trainer_owns_them():
    from relibra_moe.evaluate import placement_loads
    from relibra_moe.plan_stats import MigrationStats
    from relibra_moe.planners.options import PlanOptions
    from relibra_moe.synthetic import rl_batch

    batch = rl_batch(MODEL, "mixed", 3, responses_per_prompt=4, seed=1, micro_batch_size=6, max_len=48)
    mb = batch.resolve_micro_batch().astype(np.int64)
    sg = np.arange(batch.num_sequences) % CLUSTER.num_gpus
    static = np.repeat(np.arange(CLUSTER.num_gpus), MODEL.num_experts // CLUSTER.num_gpus)[None].repeat(3, axis=0)
    perm = symmetry_perm(np.array([1, 0]), np.array([2, 0, 1]), CLUSTER.gpus_per_node)
    eg = perm[static]  # the static homes under a symmetry: relabelling back moves nothing
    args = (eg, mb, sg, batch, 2, MODEL, CLUSTER)
    off = migrate(*args, PlanOptions(migration=False), False)
    assert off[0] is eg and off[1] is sg and off[2] == MigrationStats(enabled=False)
    got_eg, got_sg, info = migrate(*args, PlanOptions(), False)
    relabel = np.asarray(info.relabel)
    assert np.array_equal(got_eg, static) and info.moved == info.moved_after_relabel == 0
    assert np.array_equal(got_sg, relabel[sg]) and np.array_equal(relabel[perm], np.arange(CLUSTER.num_gpus))
    fixed_eg, fixed_sg, fixed = migrate(*args, PlanOptions(), False, samples_fixed=True)
    assert fixed.samples_fixed and np.array_equal(fixed_sg, sg)
    # the identity or the relabelling, whichever prices lower with these samples (hand sum of the two terms)
    x = placement_loads(batch, mb, sg, 2, CLUSTER.num_gpus)
    totals = []
    for p in (np.arange(CLUSTER.num_gpus), perm.argsort()):
        kept, inf = keep_previous_layers(x, p[eg], static, MODEL, CLUSTER)
        totals.append(sum(step_moe_seconds(x[:, l], kept[l], MODEL, CLUSTER) for l in range(3)) + inf["relayout_s"])
    want = perm.argsort() if totals[1] < totals[0] * (1 - 1e-12) else np.arange(CLUSTER.num_gpus)  # ties: identity
    assert np.array_equal(np.asarray(fixed.relabel), want)


# ------------------------------------------------------------------ option move_horizon (the credit)
def _step_seconds(x_layer, homes):
    """Independent reference: sum over micro-batches of 3 max comp + 2 max comm of one layer (moe_cost)."""
    c = moe_cost(x_layer, homes, MODEL, CLUSTER)
    return float((3 * c.comp.max(-1) + 2 * c.comm.max(-1)).sum())


def _homes(rng, L):
    G, E = CLUSTER.num_gpus, MODEL.num_experts
    return np.stack([rng.permutation(np.repeat(np.arange(G), E // G)) for _ in range(L)])


def test_horizon_gains_take_the_lesser_saving_and_nothing_where_the_homes_stay():
    rng = np.random.default_rng(0)
    L, G, E = MODEL.num_layers, CLUSTER.num_gpus, MODEL.num_experts
    x = rng.gamma(0.5, 2e4, size=(2, L, G, E))
    before = rng.gamma(0.5, 2e4, size=(3, L, G, E))
    prev, eg = _homes(rng, L), _homes(rng, L)
    eg[1] = prev[1]  # layer 1 keeps its homes
    now_ref = np.array([_step_seconds(x[:, l], prev[l]) - _step_seconds(x[:, l], eg[l]) for l in range(L)])
    before_ref = np.array([_step_seconds(before[:, l], prev[l]) - _step_seconds(before[:, l], eg[l])
                           for l in range(L)])
    now_ref[1] = before_ref[1] = 0.0
    np.testing.assert_allclose(homes_savings(x, eg, prev, MODEL, CLUSTER), now_ref, rtol=1e-9, atol=1e-15)
    want = np.maximum(0.0, np.minimum(now_ref, before_ref))
    now = homes_savings(x, eg, prev, MODEL, CLUSTER)
    np.testing.assert_allclose(horizon_gains(now, before, eg, prev, MODEL, CLUSTER), want, rtol=1e-9,
                               atol=1e-15)
    share = carry_over(x, before, eg, prev, MODEL, CLUSTER)
    assert share == pytest.approx(min(1.0, want.sum() / now_ref.sum()) if now_ref.sum() > 0 else 0.0, rel=1e-9)
    assert 0.0 <= share <= 1.0
    # the same batch twice carries everything over; homes that save nothing here carry nothing
    assert carry_over(x, x, eg, prev, MODEL, CLUSTER) == pytest.approx(1.0) or now_ref.sum() <= 0
    assert carry_over(x, before, prev, prev, MODEL, CLUSTER) == 0.0
    with pytest.raises(PlanError, match=r"loads of shape \(3, 3, 4, 12\): expected \[M, L=3, G=6, E=12\]"):
        horizon_gains(now, before[:, :, :4], eg, prev, MODEL, CLUSTER)


def test_the_credit_buys_moves_whose_saving_carries_over_and_none_that_do_not():
    rng = np.random.default_rng(2)
    M, L, G, E = 2, MODEL.num_layers, CLUSTER.num_gpus, MODEL.num_experts
    x = rng.gamma(0.5, 20.0, size=(M, L, G, E))  # light loads: each layer saves 12-25% of its move
    prev = np.stack([np.repeat(np.arange(G), E // G)] * L)
    eg = np.stack([rng.permutation(prev[0]) for _ in range(L)])
    alone, info = keep_previous_layers(x, eg, prev, MODEL, CLUSTER)
    gains, moves = np.array(info["gain_s"]), np.array(info["move_s"])
    assert "credit_s" not in info
    unpaid = [l for l in range(L) if 0 < gains[l] < moves[l]]
    assert unpaid == [0, 1, 2] and info["layers_kept"] == [0, 1, 2]  # no move pays on this batch alone
    # the previous batch was this one: every saving carries over, so a long enough horizon pays every move
    h = int(np.ceil(max(moves[l] / gains[l] for l in unpaid))) + 1
    out, inf = keep_previous_layers(x, eg, prev, MODEL, CLUSTER, move_horizon=h, previous_loads=x)
    for l in range(L):
        if gains[l] > 0:
            np.testing.assert_array_equal(out[l], eg[l])
            assert inf["credit_s"][l] == pytest.approx((h - 1) * gains[l], rel=1e-9)
        else:
            np.testing.assert_array_equal(out[l], prev[l])
    # a previous batch on which the new homes save nothing (no tokens) earns no credit at any horizon
    none, inf0 = keep_previous_layers(x, eg, prev, MODEL, CLUSTER, move_horizon=10**6,
                                      previous_loads=np.zeros_like(x))
    np.testing.assert_array_equal(none, alone)
    assert "credit_s" not in inf0
