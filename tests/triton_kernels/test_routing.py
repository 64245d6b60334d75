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
    assert (m.num_rows, m.top_k, m.num_tokens) == (6, 2, 3)
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


def test_num_rows_too_small_raises_naming_both_numbers():
    ids = torch.tensor([[0, 1], [1, 2], [2, -1]])  # 5 routed pairs
    with pytest.raises(ReplayError, match=r"num_rows=3 is smaller than the 5 routed pairs"):
        routing_metadata(ids, 3, num_rows=3)
    with pytest.raises(ReplayError, match="overflow"):
        routing_metadata(ids, 3, overflow="drop")


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_num_rows_too_small_reported_and_never_past_r(backend):
    """overflow='report' (what CUDA does, where checking would sync): the first R sorted pairs get rows,
    the rest are reported, and no op reads or writes a row >= R (the sorted tensors have exactly R rows)."""
    from relibra_moe.triton_kernels.backend import force_backend
    from relibra_moe.triton_kernels.grouped_gemm import grouped_mm, swiglu_experts
    from relibra_moe.triton_kernels.permute import combine, permute

    g = np.random.default_rng(3)
    T, k, S, R = 50, 4, 3, 100  # 200 routed pairs, 100 rows (the reproduction)
    ids = torch.from_numpy(g.integers(0, S, size=(T, k)))
    m = routing_metadata(ids, S, block_m=16, num_rows=R, overflow="report")
    gather, counts, _ = loop_reference(ids.numpy(), S, 16)
    assert int(m.num_dropped) == T * k - R == 100
    assert m.offsets.tolist()[-1] == R and all(0 <= o <= R for o in m.offsets.tolist())
    kept = np.minimum(np.cumsum(counts), R)
    assert m.counts.tolist() == np.diff(np.concatenate([[0], kept])).tolist()
    assert m.gather_idx.tolist() == gather[:R]
    sc = m.scatter_idx.tolist()
    assert max(sc) == R - 1
    fitted = set(gather[:R])
    for p in range(T * k):
        assert (sc[p] >= 0) == (p in fitted)
        if sc[p] >= 0:
            assert gather[sc[p]] == p
    rows = [(s, r) for s, r in zip(m.tile_slot.tolist(), m.tile_row.tolist(), strict=True) if r >= 0]
    assert all(r < R for _, r in rows)
    # the whole chain runs on the R rows; tokens whose pairs were all dropped get zero
    H, F = 16, 16
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(T, H, generator=gen)
    wg = torch.randn(S, H, 2 * F, generator=gen) / 4
    wd = torch.randn(S, F, H, generator=gen) / 4
    gates = torch.rand(T, k, generator=gen)
    with force_backend(backend):
        xs = permute(x, m)
        ys = swiglu_experts(xs, m, wg, wd)
        out = combine(ys, m, gates)
        h = grouped_mm(xs, wg, m)
    assert xs.shape == (R, H) and ys.shape == (R, H) and h.shape == (R, 2 * F)
    ref = torch.zeros(T, H, dtype=torch.float64)
    for p in fitted:
        t, j = divmod(p, k)
        s = int(ids[t, j])
        hh = x[t].double() @ wg[s].double()
        a = torch.nn.functional.silu(hh[:F]) * hh[F:]
        ref[t] += float(gates[t, j]) * (a @ wd[s].double())
    torch.testing.assert_close(out.double(), ref, rtol=1e-4, atol=1e-4)


def test_num_rows_fits_reports_zero():
    m = routing_metadata(torch.tensor([[0, -1], [1, 0]]), 2, num_rows=3)
    assert int(m.num_dropped) == 0 and m.offsets.tolist() == [0, 2, 3]
