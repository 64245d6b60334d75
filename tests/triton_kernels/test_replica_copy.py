"""Replica copy and slot-gradient add-back against plain loops (reference and Triton interpreter)."""

from __future__ import annotations

import pytest
import torch

from relibra_moe.triton_kernels.backend import force_backend
from relibra_moe.triton_kernels.replica_copy import add_slot_grads, copy_into_slots

BACKENDS = ["torch", "triton"]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("transposed", [False, True])
def test_copy_into_slots(backend, dtype, transposed):
    g = torch.Generator().manual_seed(0)
    E, S, A, B = 6, 4, 7, 33  # odd row sizes
    src = torch.randn(E, B, A, generator=g).to(dtype)
    buf = torch.full((S, B, A), 7.0).to(dtype)
    if transposed:  # HF [E, N, K] parameter viewed as [E, K, N]: rows stay dense, order differs
        src, buf = src.transpose(1, 2), buf.transpose(1, 2)
    src_index = torch.tensor([5, 0, 3, -1, 2])
    slot_index = torch.tensor([2, 0, 3, 1, -1])
    expected = buf.clone()
    for i in range(5):
        if src_index[i] >= 0 and slot_index[i] >= 0:
            expected[int(slot_index[i])] = src[int(src_index[i])]
    with force_backend(backend):
        copy_into_slots(src, src_index, buf, slot_index, num_programs=3)
    assert torch.equal(buf, expected)
    assert torch.equal(buf[1], torch.full_like(buf[1], 7.0))  # skipped pair left untouched


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_slot_grads_repeats_deterministic(backend, dtype):
    """Repeated home rows sum in fp32 against a float64 loop; two runs give the same bits."""
    g = torch.Generator().manual_seed(1)
    S, E, D = 5, 3, 50
    slot_grads = torch.randn(S, D, generator=g).to(dtype)
    home0 = torch.randn(E, D, generator=g).to(dtype)
    slot_index = torch.tensor([0, 1, 2, 3, 4, 2, -1])
    home_index = torch.tensor([2, 0, 2, -1, 2, 1, 0])  # home 2 receives three slots; two pairs skipped
    expected = home0.double().clone()
    for i in range(7):
        if home_index[i] >= 0 and slot_index[i] >= 0:
            expected[int(home_index[i])] += slot_grads[int(slot_index[i])].double()
    runs = []
    for _ in range(2):
        home = home0.clone()
        with force_backend(backend):
            add_slot_grads(slot_grads, slot_index, home, home_index, num_programs=2)
        runs.append(home)
    tol = 1e-6 if dtype == torch.float32 else 8e-3  # bf16: one rounding of the fp32 sum
    torch.testing.assert_close(runs[0].double(), expected, rtol=tol, atol=tol * float(expected.abs().max()))
    assert torch.equal(runs[0], runs[1])
    assert torch.equal(runs[0][1], home0[1] + slot_grads[2])  # one add: the fp32 sum rounded once


def test_empty_index_is_a_no_op():
    for backend in BACKENDS:
        buf, home = torch.ones(2, 3), torch.ones(2, 3)
        empty = torch.zeros(0, dtype=torch.long)
        with force_backend(backend):
            copy_into_slots(torch.zeros(2, 3), empty, buf, empty)
            add_slot_grads(torch.zeros(2, 3), empty, home, empty)
        assert torch.equal(buf, torch.ones(2, 3)) and torch.equal(home, torch.ones(2, 3))


def test_errors():
    with pytest.raises(ValueError, match="trailing"):
        copy_into_slots(torch.zeros(2, 3), torch.tensor([0]), torch.zeros(2, 4), torch.tensor([0]))
    with pytest.raises(ValueError, match="dtype"):
        copy_into_slots(torch.zeros(2, 3), torch.tensor([0]), torch.zeros(2, 3, dtype=torch.float16), torch.tensor([0]))
    with pytest.raises(ValueError, match="equal length"):
        add_slot_grads(torch.zeros(2, 3), torch.tensor([0, 1]), torch.zeros(2, 3), torch.tensor([0]))
    with pytest.raises(ValueError, match=r"home_index must lie in \[-1, 2\)"):
        add_slot_grads(torch.zeros(2, 3), torch.tensor([0]), torch.zeros(2, 3), torch.tensor([2]))
    with pytest.raises(ValueError, match=r"src_index must lie in \[-1, 2\), got range \[-3, 0\]"):
        copy_into_slots(torch.zeros(2, 3), torch.tensor([0, -3]), torch.zeros(2, 3), torch.tensor([0, 1]))
    with pytest.raises(ValueError, match=r"slot_index must be an integer tensor, got torch.float32"):
        copy_into_slots(torch.zeros(2, 3), torch.tensor([0]), torch.zeros(2, 3), torch.tensor([0.0]))
    with pytest.raises(ValueError, match=r"num_programs must be a positive int, got 0"):
        copy_into_slots(torch.zeros(2, 3), torch.tensor([0]), torch.zeros(2, 3), torch.tensor([0]), num_programs=0)
    with pytest.raises(ValueError, match=r"num_programs must be a positive int, got 0"):
        add_slot_grads(torch.zeros(2, 3), torch.tensor([0]), torch.zeros(2, 3), torch.tensor([0]), num_programs=0)


def test_rows_longer_than_one_chunk():
    """Rows of 2 chunks (interpreter chunks hold 16384 elements): every (pair, chunk) item is served."""
    g = torch.Generator().manual_seed(2)
    D = 16384 + 5
    src = torch.randn(4, D, generator=g)
    buf = torch.zeros(3, D)
    with force_backend("triton"):
        copy_into_slots(src, torch.tensor([3, 1, 0]), buf, torch.tensor([0, 2, 1]), num_programs=2)
        assert torch.equal(buf, src[[3, 0, 1]])
        home = torch.zeros(2, D)
        add_slot_grads(buf, torch.tensor([0, 1, 2]), home, torch.tensor([1, 1, 0]), num_programs=2)
    expected = torch.stack([buf[2].double(), buf[0].double() + buf[1].double()])
    torch.testing.assert_close(home.double(), expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("backend", BACKENDS)
def test_add_slot_grads_runs_of_every_length(backend):
    """Home rows receiving 1, 2 (the pipelined kernel's unrolled run), 3 and 5 slots (the long-run
    kernel), interleaved and with skipped pairs, against a float64 loop; 16 programs."""
    from relibra_moe.triton_kernels.replica_copy import ADD_RUN

    assert ADD_RUN == 2
    g = torch.Generator().manual_seed(4)
    S, E, D = 11, 5, 37
    slot_grads = torch.randn(S, D, generator=g)
    home0 = torch.randn(E, D, generator=g)
    home_index = torch.tensor([3, 1, 4, 1, 4, 4, 0, 4, -1, 4, 0, 0, 2])  # 4: five slots, 0: three, 1: two
    slot_index = torch.tensor([0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, -1, 0])
    expected = home0.double().clone()
    for i in range(len(home_index)):
        if home_index[i] >= 0 and slot_index[i] >= 0:
            expected[int(home_index[i])] += slot_grads[int(slot_index[i])].double()
    home = home0.clone()
    with force_backend(backend):
        add_slot_grads(slot_grads, slot_index, home, home_index)
    torch.testing.assert_close(home.double(), expected, rtol=1e-6, atol=1e-6)
