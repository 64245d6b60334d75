"""Skewness, rank skew and hot-set intersection against hand-computed values and plain loops."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from relibra_moe.errors import TraceError
from relibra_moe.metrics import (
    default_hot_k,
    expert_skewness,
    gpu_loads,
    hot_set_intersection,
    hot_sets,
    load_summary,
    micro_batch_skew,
    rank_skew,
)


def test_expert_skewness_hand_computed():
    # max 6, mean (6 + 2 + 0 + 0) / 4 = 2 -> 3; uniform -> 1; all zero -> NaN
    s = expert_skewness([[6, 2, 0, 0], [3, 3, 3, 3], [0, 0, 0, 0]])
    np.testing.assert_allclose(s[:2], [3.0, 1.0])
    assert np.isnan(s[2])


def test_micro_batch_skew_averages_layers():
    counts = np.array([[[4, 0], [1, 1]], [[2, 2], [0, 0]]])  # [M=2, L=2, E=2]
    per_layer, per_mb = micro_batch_skew(counts)
    np.testing.assert_allclose(per_layer[0], [2.0, 1.0])
    np.testing.assert_allclose(per_mb, [1.5, 1.0])  # NaN layer of micro-batch 1 skipped
    with pytest.raises(TraceError, match=r"shape \[M, L, E\]"):
        micro_batch_skew(np.zeros((2, 2, 2, 2)))


def test_gpu_loads_and_rank_skew():
    load = np.array([5, 1, 2, 4])  # experts 0..3
    home = np.array([0, 0, 1, 1])
    g = gpu_loads(load, home, 2)
    np.testing.assert_array_equal(g, [6, 6])
    assert rank_skew(g) == 1.0
    g = gpu_loads(load, [0, 1, 1, 1], 2)
    np.testing.assert_array_equal(g, [5, 7])
    np.testing.assert_allclose(rank_skew(g), 7 / 6)
    # per-layer placement [L, E] broadcast over micro-batches [M, L, E]
    ml = np.arange(2 * 3 * 4).reshape(2, 3, 4)
    homes = np.array([[0, 1, 0, 1], [1, 1, 0, 0], [0, 0, 0, 1]])
    out = gpu_loads(ml, homes, 2)
    ref = np.zeros((2, 3, 2), np.int64)
    for m in range(2):
        for l in range(3):
            for e in range(4):
                ref[m, l, homes[l, e]] += ml[m, l, e]
    np.testing.assert_array_equal(out, ref)
    with pytest.raises(TraceError, match=r"home ids must lie in \[0, 2\)"):
        gpu_loads(load, [0, 0, 2, 1], 2)
    with pytest.raises(TraceError, match=r"expert_load must be >= 0"):
        gpu_loads([-1, 0, 0, 0], home, 2)


def test_hot_sets_ties_to_lower_id():
    np.testing.assert_array_equal(hot_sets([1, 5, 5, 0, 2], 3), [1, 2, 4])
    with pytest.raises(TraceError, match=r"hot-set size k=6 must lie in \[1, 5\]"):
        hot_sets([1, 2, 3, 4, 5], 6)


def test_intersection_hand_computed():
    counts = np.array([
        [[9, 8, 0, 0, 1]],   # H = {0, 1}
        [[0, 7, 9, 0, 0]],   # H = {2, 1}: overlap 1
        [[0, 0, 1, 5, 6]],   # H = {4, 3}: overlap 0
    ])
    np.testing.assert_allclose(hot_set_intersection(counts, 2)[:, 0], [0.5, 0.0])
    with pytest.raises(TraceError, match="at least 2 micro-batches"):
        hot_set_intersection(counts[:1], 2)


@given(hnp.arrays(np.int64, st.tuples(st.integers(2, 5), st.integers(1, 3), st.integers(4, 9)),
                  elements=st.integers(0, 50)),
       st.integers(1, 4))
def test_intersection_matches_set_loop(counts, k):
    out = hot_set_intersection(counts, k)
    m, num_layers, e = counts.shape
    for t in range(m - 1):
        for l in range(num_layers):
            def top(c):
                return set(sorted(range(e), key=lambda i: (-c[i], i))[:k])
            ref = len(top(counts[t, l]) & top(counts[t + 1, l])) / k
            assert out[t, l] == pytest.approx(ref)
    assert ((0 <= out) & (out <= 1)).all()


@given(hnp.arrays(np.int64, st.tuples(st.integers(1, 4), st.integers(1, 6)), elements=st.integers(0, 100)))
def test_skew_bounds(counts):
    s = expert_skewness(counts)
    nz = counts.sum(axis=1) > 0
    assert np.all(s[nz] >= 1 - 1e-12) and np.all(s[nz] <= counts.shape[1] + 1e-12)
    assert np.all(np.isnan(s[~nz]))


def test_default_hot_k_and_summary():
    assert default_hot_k(128) == 8 and default_hot_k(32) == 8 and default_hot_k(16) == 4 and default_hot_k(2) == 1
    counts = np.array([[[4, 0, 0, 0]], [[0, 0, 2, 2]]])
    s = load_summary(counts)
    assert s["hot_k"] == 1
    assert s["skew_mean"] == pytest.approx((4.0 + 2.0) / 2)
    assert s["intersection_mean"] == 0.0
    assert np.isnan(load_summary(counts[:1])["intersection_mean"])


def test_bad_inputs_name_the_problem():
    with pytest.raises(TraceError, match=r"counts\[0, 1\] = nan: loads must be finite"):
        expert_skewness([[1.0, np.nan]])
    with pytest.raises(TraceError, match=r"counts must be numeric, got dtype <U1"):
        expert_skewness(["a", "b"])
    with pytest.raises(TraceError, match=r"num_gpus must be a positive int, got 0"):
        gpu_loads([1, 2], [0, 0], 0)
    with pytest.raises(TraceError, match=r"home must hold integer GPU ids, got dtype float64"):
        gpu_loads([1, 2], [0.5, 0.0], 2)
    with pytest.raises(TraceError, match=r"home has \(3,\) experts, expert_load has 2"):
        gpu_loads([1, 2], [0, 1, 1], 2)
    with pytest.raises(TraceError, match=r"hot-set size k=2.0 must lie in \[1, 3\]"):
        hot_sets([1, 2, 3], 2.0)
    with pytest.raises(TraceError, match=r"counts must have shape \[M, L, E\], got \(2, 2, 2, 2\)"):
        hot_set_intersection(np.zeros((2, 2, 2, 2)), 1)
