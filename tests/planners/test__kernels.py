"""_kernels: the numba cost state and objectives on hand-computed cells, the incremental swap equal to a fresh
state, the smoothed objective equal to a float64 LSE written out here, the annealer never ending worse than it
started."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from relibra_moe.planners import _kernels as K

# two GPUs joined by NVLink: a token from source j to target g != j rides NVLink, nothing rides RDMA
NVM = np.array([[0.0, 1.0], [1.0, 0.0]])
RDM = np.zeros((2, 2))
X = np.array([[3.0, 1.0], [0.0, 2.0]])  # [source GPU j, expert e]


def _state(x, homes, nvm=NVM, rdm=RDM):
    st = np.zeros((5, x.shape[0]))
    K.init_state(x, np.asarray(homes, np.int64), nvm, rdm, st)
    return st


def test_state_and_exact_objective_by_hand():
    st = _state(X, [0, 1])
    # GPU 0 computes expert 0's 3 tokens, GPU 1 expert 1's 1 + 2; source 0 sends 1 token to GPU 1 on NVLink
    np.testing.assert_array_equal(st, [[3, 3], [1, 0], [0, 1], [0, 0], [0, 0]])
    buf = np.zeros(2)
    # T_MoE = cc max load + 2 max(comm): 1 x 3 + 2 x 0.5 x 1 = 4
    assert K.layer_objective(st[0], st[1], st[2], st[3], st[4], 1.0, 0.5, 0.25, 20.0, False, buf) == 4.0


def test_swap_is_the_fresh_state_of_the_swapped_homes():
    st, out, dj = _state(X, [0, 1]), np.zeros((5, 2)), np.zeros(2)
    K.swap_state(X, 0, 0, 1, 1, NVM, RDM, st, out)
    np.testing.assert_array_equal(out, _state(X, [1, 0]))  # loads 3 / 3; source 0 sends 3, source 1 sends 2
    # after the swap: 1 x 3 + 2 x 0.5 x 3 = 6
    assert K.swap_objective_exact(X, 0, 0, 1, 1, NVM, RDM, st, 1.0, 0.5, 0.25, dj) == 6.0


@pytest.mark.parametrize("seed", range(5))
def test_swap_objective_equals_the_objective_of_the_swapped_state(seed):
    rng = np.random.default_rng(seed)
    G, E = 4, 8
    x = rng.integers(0, 50, (G, E)).astype(np.float64)
    g = np.arange(G)
    nvm = ((g[:, None] // 2 == g[None, :] // 2) & (g[:, None] != g[None, :])).astype(float)  # 2 nodes x 2
    rdm = (g[:, None] // 2 != g[None, :] // 2).astype(float)
    homes = rng.permutation(np.repeat(np.arange(G), E // G)).astype(np.int64)
    st, out, buf, dj = _state(x, homes, nvm, rdm), np.zeros((5, G)), np.zeros(G), np.zeros(G)
    for a, b in itertools.combinations(range(E), 2):
        ga, gb = homes[a], homes[b]
        if ga == gb:
            continue
        swapped = homes.copy()
        swapped[[a, b]] = gb, ga
        fresh = _state(x, swapped, nvm, rdm)
        K.swap_state(x, a, ga, b, gb, nvm, rdm, st, out)
        np.testing.assert_allclose(out, fresh, rtol=0, atol=0)  # integer tokens in float64: exact
        want = K.layer_objective(fresh[0], fresh[1], fresh[2], fresh[3], fresh[4], 1e-3, 2e-4, 5e-4, 20.0, False,
                                 buf, 2, 0.1, 0.5)
        got = K.swap_objective_exact(x, a, ga, b, gb, nvm, rdm, st, 1e-3, 2e-4, 5e-4, dj, 2, 0.1, 0.5)
        assert got == pytest.approx(want, rel=1e-12)


def test_node_compute_and_skew_penalty_by_hand():
    load = np.array([4.0, 0.0, 1.0, 1.0])
    zero = np.zeros(4)
    # per node (2 GPUs each): means 2 and 1 -> cmax 2; mean GPU compute 6 / 4 = 1.5; penalty 1 x (2 - 1.5) = 0.5
    got = K.layer_objective(load, zero, zero, zero, zero, 1.0, 1.0, 1.0, 20.0, False, np.zeros(4), 2, 0.0, 1.0)
    assert got == 2.5
    per_gpu = K.layer_objective(load, zero, zero, zero, zero, 1.0, 1.0, 1.0, 20.0, False, np.zeros(4))
    assert per_gpu == 4.0


def _lse(v, inv):
    m = max(v)
    return m + math.log(sum(math.exp((t - m) * inv) for t in v)) / inv


@pytest.mark.parametrize("beta", [1.0, 20.0, 200.0])
def test_smoothed_objective_is_the_lse_written_out(beta):
    st = _state(X, [0, 1])
    cc, tnv, trd = 1.0, 0.5, 0.25
    inv = beta / (cc * st[0].sum() / 2)  # the layer's scale: mean per-GPU compute
    comp = _lse([cc * v for v in st[0]], inv)
    comm = _lse([2 * _lse([st[1, g] * tnv, st[2, g] * tnv, st[3, g] * trd, st[4, g] * trd], inv) for g in range(2)],
                inv)
    got = K.layer_objective(st[0], st[1], st[2], st[3], st[4], cc, tnv, trd, beta, True, np.zeros(2))
    assert got == pytest.approx(comp + comm, rel=1e-12)
    assert got >= 4.0  # the LSE bounds the exact max from above


def test_sample_flows_and_batch_objective_by_hand():
    counts = np.array([[[2, 0, 1, 0]], [[0, 3, 0, 1]]], np.int64)  # [N=2, L=1, E=4]
    homes = np.array([[0, 1, 1, 0]], np.int64)
    np.testing.assert_array_equal(K.sample_flows(counts, homes, 2), [[[2, 1]], [[1, 3]]])
    x = np.stack([X, X[::-1]])  # [M=2, G, E]
    one = K.batch_objective_exact(x[:1], np.array([0, 1], np.int64), NVM, RDM, 1.0, 0.5, 0.25)
    assert one == 4.0
    # second micro-batch [[0, 2], [3, 1]]: loads 0 + 3 / 2 + 1 -> max 3; source 1 sends 3 tokens to GPU 0 (the
    # busiest link) -> comm 2 x 0.5 x 3 = 3
    assert K.batch_objective_exact(x, np.array([0, 1], np.int64), NVM, RDM, 1.0, 0.5, 0.25) == 4.0 + 3.0 + 3.0


def test_anneal_keeps_the_expert_counts_and_never_ends_worse():
    rng = np.random.default_rng(7)
    G, E = 4, 8
    x = rng.integers(0, 100, (2, G, E)).astype(np.float64)
    g = np.arange(G)
    nvm = (g[:, None] != g[None, :]).astype(float)
    start = np.repeat(np.arange(G), E // G).astype(np.int64)
    best, obj, first = K.anneal_experts(x, start, nvm, np.zeros((G, G)), 1e-3, 1e-4, 0.0, 20.0, False, 0.005, 1e-5,
                                        2000, 3)
    np.testing.assert_array_equal(np.bincount(best, minlength=G), [2, 2, 2, 2])
    assert obj <= first
    assert obj == pytest.approx(K.batch_objective_exact(x, best, nvm, np.zeros((G, G)), 1e-3, 1e-4, 0.0),
                                rel=1e-12)
    assert first == pytest.approx(K.batch_objective_exact(x, start, nvm, np.zeros((G, G)), 1e-3, 1e-4, 0.0),
                                  rel=1e-12)
