"""Routing metadata: a hand-computed case, invariants under hypothesis, errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from relibra_moe.errors import ReplayError
from relibra_moe.triton_kernels.routing import num_tiles_bound, routing_metadata


def loop_reference(slot_ids: np.ndarray, num_slots: int, block_m: int):
    """Plain-loop sort of the pairs by slot and the tile list (independent of the torch code)."""
    T, k = slot_ids.shape
    gather = []
    counts = [0] * num_slots
    for s in range(num_slots):
        for p in range(T * k):
            if slot_ids[p // k, p % k] == s:
                gather.append(p)
                counts[s] += 1
    tiles = []
    row = 0
    for s in range(num_slots):
        for start in range(0, counts[s], block_m):
            tiles.append((s, row + start))
        row += counts[s]
    return gather, counts, tiles


def test_hand_case():
    slot_ids = torch.tensor([[1, 0], [1, -1], [2, 1]])
    m = routing_metadata(slot_ids, 4, block_m=2)
    assert m.counts.tolist() == [1, 3, 1, 0]
    assert m.offsets.tolist() == [0, 1, 4, 5, 5]
    assert m.gather_idx.tolist() == [1, 0, 2, 5, 4, -1]
    assert m.scatter_idx.tolist() == [1, 0, 2, -1, 4, 3]
    # slot 0: one tile at row 0; slot 1: rows 1-2 and 3; slot 2: row 4; a zero tile for padding row 5
    assert m.tile_slot.tolist()[:5] == [0, 1, 1, 2, -1]
    assert m.tile_row.tolist()[:5] == [0, 1, 3, 4, 5]
    assert m.num_tiles == num_tiles_bound(6, 4, 2) == 7
    assert m.tile_row.tolist()[5:] == [-1, -1]
    assert (m.num_rows, m.topk, m.num_tokens) == (6, 2, 3)
    assert m.token_idx().tolist() == [0, 0, 1, 2, 2, 0]
    assert m.slot_of_row().tolist() == [0, 1, 1, 1, 2, 4]


@st.composite
def routing_case(draw):
    T = draw(st.integers(0, 40))
    k = draw(st.integers(1, 4))
    S = draw(st.integers(1, 9))
    drop = draw(st.sampled_from([0.0, 0.3]))
    block_m = draw(st.sampled_from([1, 2, 4, 16]))
    rng = np.random.default_rng(draw(st.integers(0, 2**31 - 1)))
    ids = rng.integers(0, S, size=(T, k))
    if draw(st.booleans()):
        ids[:] = rng.integers(0, S)  # one slot takes every pair
    ids[rng.random((T, k)) < drop] = -1
    return ids, S, block_m


@given(routing_case())
def test_invariants_against_loops(case):
    ids, S, block_m = case
    T, k = ids.shape
    m = routing_metadata(torch.from_numpy(ids), S, block_m=block_m)
    gather, counts, tiles = loop_reference(ids, S, block_m)
    routed = int((ids >= 0).sum())
    assert m.num_rows == T * k
    assert m.counts.tolist() == counts and int(m.counts.sum()) == routed
    assert m.offsets.tolist() == [0, *np.cumsum(counts).tolist()]
    g = m.gather_idx.tolist()
    assert g[:routed] == gather and all(v == -1 for v in g[routed:])
    sc = m.scatter_idx.tolist()
    # gather and scatter are inverse permutations on the routed pairs; unrouted pairs map to -1
    for r in range(routed):
        assert sc[g[r]] == r
    for p in range(T * k):
        assert (sc[p] == -1) == (ids[p // k, p % k] < 0)
    ts, tr = m.tile_slot.tolist(), m.tile_row.tolist()
    n_real = len(tiles)
    assert list(zip(ts[:n_real], tr[:n_real], strict=True)) == tiles
    assert m.num_tiles == num_tiles_bound(T * k, S, block_m) >= n_real
    # zero tiles cover the padding rows exactly, then -1
    zero_rows = [r for s, r in zip(ts[n_real:], tr[n_real:], strict=True) if r >= 0]
    assert all(s == -1 for s in ts[n_real:])
    assert zero_rows == list(range(routed, T * k, block_m))


def test_num_rows_bound_and_errors():
    ids = torch.tensor([[0, -1], [-1, 1], [1, -1]])
    m = routing_metadata(ids, 2, block_m=4, num_rows=3)
    assert m.num_rows == 3 and m.gather_idx.tolist() == [0, 3, 4]
    with pytest.raises(ReplayError, match="num_rows"):
        routing_metadata(ids, 2, num_rows=2)
    with pytest.raises(ReplayError, match=r"got range \[0, 2\]"):
        routing_metadata(torch.tensor([[0, 2]]), 2)
    with pytest.raises(ReplayError, match="-2"):
        routing_metadata(torch.tensor([[0, -2]]), 2)
    with pytest.raises(ReplayError, match="integer"):
        routing_metadata(torch.zeros(2, 2), 2)
    with pytest.raises(ReplayError, match="shape"):
        routing_metadata(torch.zeros(4, dtype=torch.long), 2)
    with pytest.raises(ReplayError, match="power of two"):
        routing_metadata(ids, 2, block_m=48)


def test_empty_and_k_equals_e():
    m = routing_metadata(torch.zeros(0, 3, dtype=torch.long), 5)
    assert m.num_rows == 0 and m.num_tiles == 0 and m.counts.tolist() == [0] * 5
    ids = torch.tensor([[2, 0, 1], [1, 2, 0]])  # k = E = 3
    m = routing_metadata(ids, 3, block_m=64)
    assert m.counts.tolist() == [2, 2, 2]
    assert m.gather_idx.tolist() == [1, 5, 2, 3, 0, 4]
