"""The sample placements trainers use: round-robin, verl's length-balanced balance_batch, longest-first."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from relibra_moe.errors import PlanError
from relibra_moe.plan import round_robin_gpus
from relibra_moe.sample_placements import (
    SAMPLE_PLACEMENTS,
    karmarkar_karp,
    length_balanced,
    longest_first,
    place_samples,
    round_robin,
    verl_workload,
)


def test_verl_workload_is_24576_s_plus_s_squared():
    np.testing.assert_array_equal(verl_workload(np.array([0, 1, 100])), [0, 24577, 2457600 + 10000])


def test_karmarkar_karp_by_hand():
    """Weights 1..6 into 2 parts: tuples (1, 2), (3, 4), (5, 6), spread 1 each; ties pop the state with the larger
    first set, so (5, 6) and (3, 4) merge first, largest with smallest: {6, 3} and {5, 4}, spread 0; then (1, 2)
    (spread 1) pops before it: {2} + {5, 4} = 11 and {1} + {6, 3} = 10."""
    parts = karmarkar_karp(np.array([1, 2, 3, 4, 5, 6]), 2)
    assert [p.tolist() for p in parts] == [[1, 3, 4], [0, 2, 5]]
    # (1, 2) and (9, 10) tie at spread 1; (9, 10) pops first: {10} + {1} = 11, {9} + {2} = 11; equal sums and
    # sizes order by the (index, weight) items, as verl's Set does: [(1, 9), (2, 2)] > [(0, 10), (3, 1)]
    parts = karmarkar_karp(np.array([10, 9, 2, 1]), 2)
    assert [p.tolist() for p in parts] == [[1, 2], [0, 3]]


@settings(max_examples=40, deadline=None)
@given(k=st.sampled_from([2, 3, 4]), per=st.integers(1, 3), seed=st.integers(0, 10_000))
def test_karmarkar_karp_equal_sizes_and_near_the_best_partition(k, per, seed):
    """Equal counts, every index once; the spread is at most the largest weight (KK's guarantee for sorted
    k-tuples), and against brute force over every equal-size partition of small cases it is within that too."""
    rng = np.random.default_rng(seed)
    w = rng.integers(1, 50, k * per)
    parts = karmarkar_karp(w, k)
    assert sorted(np.concatenate(parts).tolist()) == list(range(len(w)))
    assert {len(p) for p in parts} == {per}
    sums = [int(w[p].sum()) for p in parts]
    assert sums == sorted(sums, reverse=True)
    if k == 2 and per <= 3:
        best = min(abs(2 * int(w[list(c)].sum()) - int(w.sum())) for c in itertools.combinations(range(2 * per), per))
        assert max(sums) - min(sums) <= best + int(w.max())


def test_karmarkar_karp_pads_when_k_does_not_divide_n():
    parts = karmarkar_karp(np.array([5, 4, 3, 2, 1]), 2)
    assert sorted(len(p) for p in parts) == [2, 3]
    assert sorted(np.concatenate(parts).tolist()) == [0, 1, 2, 3, 4]


def test_length_balanced_follows_verls_layout():
    """8 samples, 2 ranks, 2 micro-batches: equal counts per rank (4), each rank's samples sorted by workload and
    laid out small-at-both-ends, cut into runs of 2: micro-batch 0 holds the ranks' 1st and 3rd smallest."""
    lengths = np.array([100, 800, 300, 500, 200, 700, 400, 600])
    mb, gpu = length_balanced(lengths, np.arange(8) // 4, 2)
    for g in range(2):
        mine = np.flatnonzero(gpu == g)
        assert len(mine) == 4
        order = mine[np.argsort(lengths[mine], kind="stable")]
        assert mb[order[0]] == 0 and mb[order[2]] == 0 and mb[order[3]] == 1 and mb[order[1]] == 1
    work = verl_workload(lengths)
    totals = [int(work[gpu == g].sum()) for g in range(2)]
    assert abs(totals[0] - totals[1]) <= int(work.max())
    assert np.bincount(mb, minlength=2).tolist() == [4, 4]


def test_length_balanced_uneven_counts_differ_by_at_most_one():
    rng = np.random.default_rng(0)
    lengths = rng.integers(10, 3000, 45)
    mb, gpu = length_balanced(lengths, np.arange(45) // 9, 4)
    assert set(np.bincount(gpu, minlength=4).tolist()) <= {11, 12}
    assert int(mb.max()) == 4 and int(mb.min()) == 0  # the batch's M = 5 micro-batches kept
    cells = np.zeros((5, 4), int)
    np.add.at(cells, (mb, gpu), 1)
    assert cells.max() - cells.min() <= 1


def test_longest_first_by_hand():
    # one micro-batch, lengths 5, 9, 2, 7 on 2 GPUs: 9 -> 0, 7 -> 1, 5 -> 1 (7 < 9), 2 -> 0 (9 < 12)
    mb, gpu = longest_first(np.array([5, 9, 2, 7]), np.zeros(4, np.int64), 2)
    assert gpu.tolist() == [1, 0, 0, 1] and mb.tolist() == [0, 0, 0, 0]


def test_round_robin_is_megatrons_order():
    mb0 = np.array([0, 0, 0, 1, 1, 1])
    mb, gpu = round_robin(np.ones(6), mb0, 2)
    np.testing.assert_array_equal(mb, mb0)
    np.testing.assert_array_equal(gpu, round_robin_gpus(mb0, 2))


@pytest.mark.parametrize("name", SAMPLE_PLACEMENTS)
def test_every_placement_places_every_sample_on_a_gpu(name):
    rng = np.random.default_rng(1)
    lengths = rng.integers(1, 500, 32)
    mb, gpu = place_samples(name, lengths, np.arange(32) // 8, 4)
    assert mb.shape == gpu.shape == (32,) and mb.dtype == gpu.dtype == np.int64
    assert gpu.min() >= 0 and gpu.max() < 4 and set(mb.tolist()) == {0, 1, 2, 3}
    again = place_samples(name, lengths, np.arange(32) // 8, 4)
    np.testing.assert_array_equal(mb, again[0])
    np.testing.assert_array_equal(gpu, again[1])


def test_bad_inputs_name_the_field():
    with pytest.raises(PlanError, match="sample_placement='packed' is not one of"):
        place_samples("packed", np.ones(4), np.zeros(4), 2)
    with pytest.raises(PlanError, match="lengths"):
        place_samples("longest-first", np.ones(3), np.zeros(4), 2)
    with pytest.raises(PlanError, match=r"lengths\[1\] = -2"):
        place_samples("length-balanced", np.array([1, -2]), np.zeros(2), 2)
    with pytest.raises(PlanError, match="num_gpus"):
        place_samples("round-robin", np.ones(2), np.zeros(2), 0)


def test_length_balanced_leaves_no_micro_batch_empty_when_ranks_hold_fewer_samples_than_micro_batches():
    # 12 samples, 4 micro-batches of 3, 4 GPUs: 3 samples per rank < M = 4 (b < 1)
    mb, gpu = length_balanced(np.arange(1, 13) * 10, np.arange(12) // 3, 4)
    assert np.bincount(gpu, minlength=4).tolist() == [3, 3, 3, 3]
    assert np.bincount(mb, minlength=4).tolist() == [3, 3, 3, 3]
