"""Sample placement (locality) and repacking: loads, incremental state, caps, brute force."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from relibra_moe.cost import moe_cost
from relibra_moe.errors import PlanError
from relibra_moe.plan import round_robin_gpus
from relibra_moe.planners import _kernels
from relibra_moe.planners.locality import (
    anneal_locality,
    attention_caps,
    sample_flows,
)
from relibra_moe.planners.reorder import cluster_constants
from relibra_moe.specs import ClusterSpec, ModelSpec


def _case(seed: int, N: int = 12, L: int = 2, E: int = 8, nodes: int = 2, P: int = 2, M: int = 3):
    rng = np.random.default_rng(seed)
    model = ModelSpec("t", hidden=256, ffn=128, num_experts=E, top_k=2, num_layers=L)
    cluster = ClusterSpec(nodes=nodes, gpus_per_node=P)
    lengths = rng.integers(5, 60, N)
    pop = rng.dirichlet(np.full(E, 0.4), size=(N, L))
    counts = np.stack([[rng.multinomial(2 * lengths[n], pop[n, l]) for l in range(L)] for n in range(N)])
    mb = np.arange(N) % M
    eg = np.stack([rng.permutation(np.repeat(np.arange(nodes * P), E // (nodes * P))) for _ in range(L)])
    return model, cluster, counts, lengths, mb, eg


def loads_from_counts(counts, micro_batch, sample_gpu, num_micro_batches, num_gpus):
    """Reference loads ``[M, L, G, E]``: a plain loop over samples."""
    N, L, E = counts.shape
    out = np.zeros((num_micro_batches, L, num_gpus, E), np.int64)
    for n in range(N):
        out[micro_batch[n], :, sample_gpu[n], :] += counts[n]
    return out


def test_trace_batch_loads_match_the_reference_loop():
    from relibra_moe.evaluate import placement_loads
    from relibra_moe.trace import RoutingTrace, TraceBatch

    rng = np.random.default_rng(0)
    traces = [RoutingTrace(np.stack([rng.permutation(8)[:2] for _ in range(3 * 5)]).reshape(5, 3, 2).astype(np.int16),
                           np.arange(3, dtype=np.int32), 8, 2) for _ in range(6)]
    batch = TraceBatch(traces)
    mb, sg = np.array([0, 0, 1, 1, 2, 0]), np.array([1, 0, 3, 3, 2, 1])
    x = placement_loads(batch, mb, sg, 4, 4)  # one trailing empty micro-batch
    np.testing.assert_array_equal(x, loads_from_counts(batch.sample_expert_counts(), mb, sg, 4, 4))
    assert x.shape == (4, 3, 4, 8) and not x[3].any()


def test_round_robin_spreads_small_micro_batches():
    np.testing.assert_array_equal(round_robin_gpus(np.zeros(6, np.int64), 4), [0, 1, 2, 3, 0, 1])
    np.testing.assert_array_equal(round_robin_gpus(np.zeros(2, np.int64), 4), [0, 2])  # both nodes of 2 x 2


@given(seed=st.integers(0, 10**6), moves=st.integers(1, 10))
def test_incremental_sample_moves_match_recomputation(seed, moves):
    """Moving samples with _add_sample keeps the state equal to a from-scratch build; objective = cost.py."""
    model, cluster, counts, lengths, mb, eg = _case(seed % 1000)
    G, M = cluster.num_gpus, 3
    rng = np.random.default_rng(seed)
    sg = rng.integers(0, G, len(mb))
    mb = mb.copy()
    cf = sample_flows(counts, eg, G)
    nvm, rdm, cc, tnv, trd = cluster_constants(model, cluster)
    stt = _kernels.sample_states(cf, mb, sg, M, nvm, rdm)
    for _ in range(moves):
        n = rng.integers(len(mb))
        m2, j2 = rng.integers(M), rng.integers(G)
        _kernels._add_sample(cf, n, sg[n], nvm, rdm, stt[mb[n]], -1.0)
        _kernels._add_sample(cf, n, j2, nvm, rdm, stt[m2], 1.0)
        mb[n], sg[n] = m2, j2
    np.testing.assert_allclose(stt, _kernels.sample_states(cf, mb, sg, M, nvm, rdm), atol=1e-9)
    ref = moe_cost(loads_from_counts(counts, mb, sg, M, G), eg, model, cluster)
    buf = np.zeros(G)
    for m in range(M):
        for smooth, key in ((True, "t_moe_smooth"), (False, "t_moe")):
            got = _kernels.mb_objective(stt[m], cc, tnv, trd, 20.0, smooth, buf)
            assert got == pytest.approx(float(getattr(ref, key)[m].sum()), rel=1e-9)


def test_within_micro_batch_brute_force():
    """One micro-batch, 5 samples, 2 GPUs, caps off: annealing reaches the best of the 32 assignments."""
    model, cluster, counts, lengths, mb, eg = _case(4, N=5, nodes=2, P=1, M=1, E=4)
    mb = np.zeros(5, np.int64)
    best = np.inf
    for sg in itertools.product(range(2), repeat=5):
        x = loads_from_counts(counts, mb, np.array(sg), 1, 2)
        best = min(best, float(moe_cost(x, eg, model, cluster).t_moe.sum()))
    mb2, sg2, info = anneal_locality(counts, lengths, mb, round_robin_gpus(mb, 2), eg, model, cluster, tol=100.0,
                                     iters=3000, seed=1, t0_frac=0.05)
    assert info["objective"] == pytest.approx(best, rel=1e-12)
    np.testing.assert_array_equal(mb2, mb)


@pytest.mark.parametrize("repack", [False, True])
def test_locality_improves_and_keeps_rules(repack):
    model, cluster, counts, lengths, mb, eg = _case(7, N=24, M=4)
    G = cluster.num_gpus
    sg = round_robin_gpus(mb, G)
    mb2, sg2, info = anneal_locality(counts, lengths, mb, sg, eg, model, cluster, repack=repack, seed=3, iters=3000)
    x0 = loads_from_counts(counts, mb, sg, 4, G)
    x1 = loads_from_counts(counts, mb2, sg2, 4, G)
    assert info["objective_start"] == pytest.approx(float(moe_cost(x0, eg, model, cluster).t_moe.sum()))
    assert info["objective"] == pytest.approx(float(moe_cost(x1, eg, model, cluster).t_moe.sum()))
    assert info["objective"] < info["objective_start"]
    np.testing.assert_array_equal(np.bincount(mb2, minlength=4), np.bincount(mb, minlength=4))
    if not repack:
        np.testing.assert_array_equal(mb2, mb)
    # attention caps: every (micro-batch, GPU) cell ends within the cap or at most its starting work
    cap1, cap2 = attention_caps(lengths, 4 * G, 0.05)
    for w, cap in ((lengths, cap1), (lengths.astype(float) ** 2, cap2)):
        start = np.zeros((4, G))
        end = np.zeros((4, G))
        np.add.at(start, (mb, sg), w)
        np.add.at(end, (mb2, sg2), w)
        assert (end <= np.maximum(cap, start) + 1e-9).all()


def test_token_cap_lets_counts_change_within_cap():
    model, cluster, counts, lengths, mb, eg = _case(9, N=24, M=4)
    G = cluster.num_gpus
    sg = round_robin_gpus(mb, G)
    cap = int(np.bincount(mb, weights=lengths).max() * 1.3)
    mb2, sg2, info = anneal_locality(counts, lengths, mb, sg, eg, model, cluster, repack=True, token_cap=cap,
                                     seed=1, iters=4000)
    assert np.bincount(mb2, weights=lengths, minlength=4).max() <= cap
    assert info["objective"] <= info["objective_start"]
    with pytest.raises(PlanError, match=r"token_cap=1 is below the longest sample \(\d+ tokens\)"):
        anneal_locality(counts, lengths, mb, sg, eg, model, cluster, repack=True, token_cap=1)


def test_locality_errors_and_determinism():
    model, cluster, counts, lengths, mb, eg = _case(11)
    sg = round_robin_gpus(mb, cluster.num_gpus)
    a = anneal_locality(counts, lengths, mb, sg, eg, model, cluster, repack=True, seed=4, iters=500)
    b = anneal_locality(counts, lengths, mb, sg, eg, model, cluster, repack=True, seed=4, iters=500)
    np.testing.assert_array_equal(a[0], b[0])
    np.testing.assert_array_equal(a[1], b[1])
    with pytest.raises(PlanError, match=r"counts has shape \(12, 1, 8\), expected \[N, L=2, E=8\]"):
        anneal_locality(counts[:, :1], lengths, mb, sg, eg, model, cluster)
    with pytest.raises(PlanError, match=r"lengths has shape \(3,\), expected \[N=12\]"):
        anneal_locality(counts, lengths[:3], mb, sg, eg, model, cluster)
    with pytest.raises(PlanError, match="tol=-1 must be a finite number >= 0"):
        anneal_locality(counts, lengths, mb, sg, eg, model, cluster, tol=-1)


@given(seed=st.integers(0, 10**6), same=st.booleans(), relocate=st.booleans())
def test_copy_free_row_objective_matches_rebuilt_state(seed, same, relocate):
    """rows_objective_exact (the fast path of the annealer) equals cost.py on the moved placement."""
    model, cluster, counts, lengths, mb, eg = _case(seed % 500)
    G, M = cluster.num_gpus, 3
    rng = np.random.default_rng(seed)
    sg = rng.integers(0, G, len(mb))
    cf = sample_flows(counts, eg, G)
    nvm, rdm, cc, tnv, trd = cluster_constants(model, cluster)
    stt = _kernels.sample_states(cf, mb, sg, M, nvm, rdm)
    n1 = int(rng.integers(len(mb)))
    m1, j1 = mb[n1], sg[n1]
    cand = [n for n in range(len(mb)) if (mb[n] == m1) == same and n != n1 and (not same or sg[n] != j1)]
    if not cand:
        return
    n2 = -1 if relocate else int(rng.choice(cand))
    m2 = m1 if same else (mb[n2] if n2 >= 0 else (m1 + 1) % M)
    j2 = sg[n2] if n2 >= 0 else (j1 + 1) % G
    mb2, sg2 = mb.copy(), sg.copy()
    mb2[n1], sg2[n1] = m2, j2
    if n2 >= 0:
        mb2[n2], sg2[n2] = m1, j1
    ref = moe_cost(loads_from_counts(counts, mb2, sg2, M, G), eg, model, cluster).t_moe.sum(axis=1)
    buf = np.zeros(G)
    if same:
        got = _kernels.rows_objective_exact(stt[m1], cf, n2, n1, j1, j2, nvm, rdm, cc, tnv, trd, buf)
        assert got == pytest.approx(ref[m1], rel=1e-12)
    else:
        o1 = _kernels.rows_objective_exact(stt[m1], cf, n2, n1, j1, -1, nvm, rdm, cc, tnv, trd, buf)
        o2 = _kernels.rows_objective_exact(stt[m2], cf, n1, n2, j2, -1, nvm, rdm, cc, tnv, trd, buf)
        assert o1 == pytest.approx(ref[m1], rel=1e-12)
        assert o2 == pytest.approx(ref[m2], rel=1e-12)


def test_sample_flows_fast_path_matches_loop():
    model, cluster, counts, lengths, mb, eg = _case(5)
    G = cluster.num_gpus
    ref = np.zeros((len(mb), 2, G))
    for n in range(len(mb)):
        for l in range(2):
            for e in range(8):
                ref[n, l, eg[l, e]] += counts[n, l, e]
    np.testing.assert_array_equal(sample_flows(counts, eg, G), ref)
    uneven = eg.copy()
    uneven[0, :2] = 0  # not E/G per GPU: the generic path
    ref2 = np.zeros_like(ref)
    for n in range(len(mb)):
        for l in range(2):
            for e in range(8):
                ref2[n, l, uneven[l, e]] += counts[n, l, e]
    np.testing.assert_array_equal(sample_flows(counts, uneven, G), ref2)


def _charged_reference(counts, lengths, mb, sg, eg, model, cluster, M, comp_weight):
    """Float64 loops: per cell comp_weight max_g comp + max_g comm (moe_cost), plus per micro-batch
    L comp_weight max_g of the attention FLOPs of its samples on g over the attention rate (no shared experts)."""
    G = cluster.num_gpus
    x = loads_from_counts(counts, mb, sg, M, G)
    h, d, nq, nkv = model.hidden, model.head_dim, model.num_heads, model.num_kv_heads
    f_attn = cluster.rates(model).attention_flops
    total = 0.0
    for m in range(M):
        for l in range(model.num_layers):
            c = moe_cost(x[m, l].astype(np.float64), eg[l], model, cluster)
            total += comp_weight * c.comp.max() + c.comm.max()
        per_gpu = [0.0] * G
        for n in range(len(lengths)):
            if mb[n] == m:
                s = float(lengths[n])
                per_gpu[sg[n]] += (2 * s * h * d * (2 * nq + 2 * nkv) + 2 * nq * d * s * (s + 1)) / f_attn
        total += model.num_layers * comp_weight * max(per_gpu)
    return total


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_charged_attention_objective_equals_the_float64_reference(seed):
    """With ``charge_attention`` the locality objective (start and end) is the step's MoE weighting plus every
    micro-batch's slowest GPU's attention over the L layers at the compute weight; the kernel's running value
    agrees with the exact one it is checked against (the end is kept only when lower)."""
    model, cluster, counts, lengths, mb, eg = _case(seed)
    assert model.shared_experts == 0
    sg = round_robin_gpus(mb, cluster.num_gpus)
    mb2, sg2, info = anneal_locality(counts, lengths, mb, sg, eg, model, cluster, iters=400, seed=seed,
                                     comp_weight=1.5, charge_attention=True)
    ref0 = _charged_reference(counts, lengths, mb, sg, eg, model, cluster, 3, 1.5)
    ref1 = _charged_reference(counts, lengths, mb2, sg2, eg, model, cluster, 3, 1.5)
    assert info["objective_start"] == pytest.approx(ref0, rel=1e-9)
    assert info["objective"] == pytest.approx(ref1, rel=1e-9)
    assert ref1 <= ref0 * (1 + 1e-12)
    # without the charge the objective leaves the attention out
    _, _, plain = anneal_locality(counts, lengths, mb, sg, eg, model, cluster, iters=0, comp_weight=1.5)
    assert plain["objective_start"] < ref0


def test_charged_attention_balances_long_samples_when_routing_is_even():
    """Every sample routes the same share to every expert, so the MoE terms hardly depend on where samples run;
    two long samples start on the same GPU. Charged, the annealing splits them; uncharged it has no reason to."""
    model = ModelSpec("t", hidden=256, ffn=128, num_experts=4, top_k=2, num_layers=2)
    cluster = ClusterSpec(nodes=1, gpus_per_node=2)
    lengths = np.array([400, 400, 4, 4, 4, 4])
    counts = np.repeat((lengths[:, None] // 2)[:, None, :].repeat(4, axis=2), 2, axis=1)  # [N, L, E]
    mb = np.zeros(6, np.int64)
    sg = np.array([0, 0, 1, 1, 1, 1])
    eg = np.array([[0, 0, 1, 1], [0, 0, 1, 1]])
    _, sg2, _ = anneal_locality(counts, lengths, mb, sg, eg, model, cluster, iters=2000, tol=10.0, comp_weight=1.5,
                                charge_attention=True)
    assert sg2[0] != sg2[1]
