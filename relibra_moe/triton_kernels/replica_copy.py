"""Copy expert weights into replica slots, and add replica-slot gradients back into the home experts.

``copy_into_slots(src_weights [E, *D], src_index [n], slot_buffer [S, *D], slot_index [n])`` sets
``slot_buffer[slot_index[i]] = src_weights[src_index[i]]`` for every i with both indices >= 0.

``add_slot_grads(slot_grads [S, *D], slot_index [n], home_grads [E, *D], home_index [n])`` adds
``slot_grads[slot_index[i]]`` into ``home_grads[home_index[i]]`` for every i with both indices >= 0.
Several i may share a home row (an expert replicated into several slots, or a home slot plus its
replicas): the sum is deterministic, taken in increasing i after the existing home value.

On CUDA both run one *persistent* Triton kernel: ``num_programs`` programs (16 by default, so the
copy leaves the other SMs to the GEMMs it overlaps with) loop over the work items
(pair, chunk of ``BLOCK`` elements). Only a few programs are resident, so both loops are
software-pipelined (straight-line bodies, a 3-stage cp.async pipeline) to keep several wide loads in
flight per program. The add-back sums runs of up to ``ADD_RUN`` slots sharing a home row in the
pipelined kernel; longer runs (an expert replicated into more slots than that) go to a second,
loop-based kernel, launched only when more than ``ADD_RUN`` pairs are given.

Peer memory. The kernels only dereference the pointers of the tensors they are given, so any of
them may live on another GPU of the node, provided the pointer is valid on the current device:

* torch symmetric memory: allocate the replica buffer with
  ``torch.distributed._symmetric_memory.empty(...)``, ``handle = rendezvous(buf, group)``, and pass
  ``handle.get_buffer(peer_rank, shape, dtype)`` (a tensor on the local device that maps the peer's
  buffer) as ``slot_buffer`` (push) or ``src_weights`` (pull);
* CUDA IPC: a tensor received through ``torch.multiprocessing`` (``cudaIpcOpenMemHandle`` under the
  hood) on a device with peer access to its owner.

In both cases launch on the local device (``torch.cuda.current_device()`` must be the device the
peer tensor reports) and order the copy with the peer's use of the memory (a barrier or the
symmetric-memory signal pad) yourself: the kernel does no cross-GPU synchronisation. CPU tensors
run the torch reference (or the kernel in the interpreter with ``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import torch
import triton

from relibra_moe.triton_kernels._details import replica_copy as _k
from relibra_moe.triton_kernels.backend import INTERPRET, bf16_rne, use_triton
from relibra_moe.triton_kernels.routing import indices_trusted
from relibra_moe.validate import check_count

__all__ = [
    "ADD_BLOCK",
    "ADD_RUN",
    "COMPILED_STAGES",
    "COMPILED_WARPS",
    "COPY_BLOCK",
    "add_slot_grads",
    "add_slot_grads_torch",
    "copy_into_slots",
    "copy_into_slots_torch",
]


def _check_rows(a: torch.Tensor, b: torch.Tensor, name_a: str, name_b: str) -> None:
    if a.dim() < 1 or b.dim() < 1 or tuple(a.shape[1:]) != tuple(b.shape[1:]):
        raise ValueError(
            f"{name_a} {tuple(a.shape)} and {name_b} {tuple(b.shape)} must share their trailing (row) shape"
        )
    if a.dtype != b.dtype:
        raise ValueError(f"{name_a} dtype {a.dtype} differs from {name_b} dtype {b.dtype}")


def _check_index(i: torch.Tensor, j: torch.Tensor, name_i: str, name_j: str) -> None:
    if i.dim() != 1 or j.dim() != 1 or i.shape[0] != j.shape[0]:
        raise ValueError(f"{name_i} {tuple(i.shape)} and {name_j} {tuple(j.shape)} must be 1-D of equal length")
    for t, n in ((i, name_i), (j, name_j)):
        if t.dtype.is_floating_point or t.dtype == torch.bool:
            raise ValueError(f"{n} must be an integer tensor, got {t.dtype}")


def _check_range(index: torch.Tensor, size: int, name: str) -> None:
    """Range check on CPU indices (on CUDA it would need a host sync; out-of-range rows are skipped)."""
    if index.is_cuda or index.numel() == 0 or indices_trusted():
        return
    lo, hi = int(index.min()), int(index.max())
    if lo < -1 or hi >= size:
        raise ValueError(f"{name} must lie in [-1, {size}), got range [{lo}, {hi}]")


def _check_pairs(a: torch.Tensor, a_index: torch.Tensor, b: torch.Tensor, b_index: torch.Tensor, num_programs: int,
                 names: tuple[str, str, str, str]) -> None:
    """Validate a row-to-row op reading ``a[a_index[i]]`` and writing ``b[b_index[i]]`` (ValueError naming the field)."""
    na, nai, nb, nbi = names
    _check_rows(a, b, na, nb)
    _check_index(a_index, b_index, nai, nbi)
    _check_range(a_index, a.shape[0], nai)
    _check_range(b_index, b.shape[0], nbi)
    check_count("num_programs", num_programs, error=ValueError)


def copy_into_slots_torch(
    src_weights: torch.Tensor, src_index: torch.Tensor, slot_buffer: torch.Tensor, slot_index: torch.Tensor
) -> None:
    """Reference of :func:`copy_into_slots` (in place on ``slot_buffer``)."""
    keep = (src_index >= 0) & (slot_index >= 0)
    si, di = src_index.long()[keep], slot_index.long()[keep]
    slot_buffer[di] = src_weights[si]


def add_slot_grads_torch(
    slot_grads: torch.Tensor, slot_index: torch.Tensor, home_grads: torch.Tensor, home_index: torch.Tensor
) -> None:
    """Reference of :func:`add_slot_grads` (in place on ``home_grads``; fp32 sums in increasing i)."""
    keep = ((slot_index >= 0) & (home_index >= 0)).tolist()
    si, hi = slot_index.tolist(), home_index.tolist()
    acc: dict[int, torch.Tensor] = {}
    for i, k in enumerate(keep):
        if k:
            h = hi[i]
            if h not in acc:
                acc[h] = home_grads[h].to(torch.float64 if home_grads.dtype == torch.float64 else torch.float32)
            acc[h] = acc[h] + slot_grads[si[i]]
    for h, v in acc.items():
        home_grads[h] = v.to(home_grads.dtype)



def _dense_rows(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the rows of a and b are dense blocks with the same in-row memory order."""
    if a.stride()[1:] != b.stride()[1:]:
        return False
    dims = sorted((st, sz) for st, sz in zip(a.stride()[1:], a.shape[1:], strict=True) if sz != 1)
    expect = 1
    for st, sz in dims:
        if st != expect:
            return False
        expect *= sz
    return True


#: Compiled-kernel chunking: 16 programs must keep ~100 KB in flight each to approach the copy
#: bandwidth: 32 KB (bf16) copy chunks, 16 warps (64 B per thread, 16-byte vector loads), and a
#: 3-stage cp.async pipeline. The add-back moves 1 + ADD_RUN rows per item, so its chunks are half
#: as long (3 stages x 3 rows x 16 KB fit in shared memory).
COPY_BLOCK, ADD_BLOCK, COMPILED_WARPS, COMPILED_STAGES = 16384, 8192, 16, 3
#: Longest run of pairs sharing a home row that the pipelined add-back sums (longer: a loop kernel).
ADD_RUN = 2


def _blocks(D: int, block: int) -> tuple[int, int]:
    """(BLOCK elements per work item, num_warps): wide chunks keep many loads in flight per program."""
    if INTERPRET:
        return min(triton.next_power_of_2(max(D, 1)), 1 << 14), 4
    return min(triton.next_power_of_2(max(D, 1)), block), COMPILED_WARPS


def copy_into_slots_triton(
    src_weights: torch.Tensor,
    src_index: torch.Tensor,
    slot_buffer: torch.Tensor,
    slot_index: torch.Tensor,
    num_programs: int,
) -> None:
    """Triton :func:`copy_into_slots` (rows of other layouts use the reference)."""
    n = src_index.shape[0]
    D = slot_buffer[0].numel() if slot_buffer.shape[0] else 0
    if n == 0 or D == 0:
        return
    if not _dense_rows(src_weights, slot_buffer):
        copy_into_slots_torch(src_weights, src_index, slot_buffer, slot_index)
        return
    block, warps = _blocks(D, COPY_BLOCK)
    chunks = triton.cdiv(D, block)
    _k.copy_rows_kernel[(num_programs,)](
        src_weights, src_index, slot_buffer, slot_index, D, src_weights.stride(0), slot_buffer.stride(0),
        n * chunks, chunks, NUM_PROGRAMS=num_programs, NUM_STAGES=1 if INTERPRET else COMPILED_STAGES, BLOCK=block,
        num_warps=warps,
    )  # fmt: skip


def add_slot_grads_triton(
    slot_grads: torch.Tensor,
    slot_index: torch.Tensor,
    home_grads: torch.Tensor,
    home_index: torch.Tensor,
    num_programs: int,
) -> None:
    """Triton :func:`add_slot_grads` (rows of other layouts use the reference)."""
    n = home_index.shape[0]
    D = home_grads[0].numel() if home_grads.shape[0] else 0
    if n == 0 or D == 0:
        return
    if not _dense_rows(slot_grads, home_grads):
        add_slot_grads_torch(slot_grads, slot_index, home_grads, home_index)
        return
    # Stable sort of the pairs by home row (skipped pairs last), then the length of each run of equal
    # home rows at its head (0 elsewhere). Torch ops only: no host sync.
    h = home_index.to(torch.int64)
    skip = (h < 0) | (slot_index < 0)
    key = torch.where(skip, torch.full_like(h, home_grads.shape[0]), h)
    key_sorted, order = torch.sort(key, stable=True)
    home_sorted = torch.where(key_sorted < home_grads.shape[0], key_sorted, torch.full_like(key_sorted, -1))
    slot_sorted = slot_index.to(torch.int64)[order]
    pos = torch.arange(n, device=h.device, dtype=torch.int64)
    head = torch.ones(n, dtype=torch.bool, device=h.device)
    head[1:] = key_sorted[1:] != key_sorted[:-1]
    run_end = torch.searchsorted(key_sorted, key_sorted, right=True)
    run = torch.where(head, run_end - pos, torch.zeros_like(pos)).to(torch.int32)
    block, warps = _blocks(D, ADD_BLOCK)
    chunks = triton.cdiv(D, block)
    rne = bf16_rne(home_grads.dtype)
    args = (slot_grads, slot_sorted.to(torch.int32), home_grads, home_sorted.to(torch.int32), run, D,
            slot_grads.stride(0), home_grads.stride(0), n * chunks, chunks)  # fmt: skip
    _k.add_rows_kernel[(num_programs,)](
        *args, n, NUM_PROGRAMS=num_programs, NUM_STAGES=1 if INTERPRET else COMPILED_STAGES, RUN=ADD_RUN, RNE=rne,
        BLOCK=block, num_warps=warps,
    )  # fmt: skip
    if n > ADD_RUN:  # a run longer than ADD_RUN can exist
        _k.add_long_runs_kernel[(num_programs,)](
            *args, NUM_PROGRAMS=num_programs, RUN=ADD_RUN, RNE=rne, BLOCK=block, num_warps=warps,
        )  # fmt: skip


@torch.library.custom_op("relibra::copy_into_slots", mutates_args=("slot_buffer",))
def _copy_op(
    src_weights: torch.Tensor,
    src_index: torch.Tensor,
    slot_buffer: torch.Tensor,
    slot_index: torch.Tensor,
    num_programs: int,
) -> None:
    if use_triton(slot_buffer):
        copy_into_slots_triton(src_weights, src_index, slot_buffer, slot_index, num_programs)
    else:
        copy_into_slots_torch(src_weights, src_index, slot_buffer, slot_index)


@torch.library.custom_op("relibra::add_slot_grads", mutates_args=("home_grads",))
def _add_op(
    slot_grads: torch.Tensor,
    slot_index: torch.Tensor,
    home_grads: torch.Tensor,
    home_index: torch.Tensor,
    num_programs: int,
) -> None:
    if use_triton(home_grads):
        add_slot_grads_triton(slot_grads, slot_index, home_grads, home_index, num_programs)
    else:
        add_slot_grads_torch(slot_grads, slot_index, home_grads, home_index)


def copy_into_slots(
    src_weights: torch.Tensor,
    src_index: torch.Tensor,
    slot_buffer: torch.Tensor,
    slot_index: torch.Tensor,
    num_programs: int = 16,
) -> None:
    """``slot_buffer[slot_index[i]] = src_weights[src_index[i]]`` (in place; -1 in either index skips i).

    Args:
        src_weights: [E, *D] expert weights (e.g. a home parameter [E, N, K], or a peer's view of it).
        src_index: int [n], source rows.
        slot_buffer: [S, *D] replica slots (local, or a peer's symmetric-memory / IPC view).
        slot_index: int [n], destination slots (distinct, else the last writer is unspecified).
        num_programs: programs of the persistent kernel (CUDA / interpreter path).

    Rows must be dense blocks with the same memory order in both tensors (any stride along dim 0).
    """
    _check_pairs(src_weights, src_index, slot_buffer, slot_index, num_programs,
                 ("src_weights", "src_index", "slot_buffer", "slot_index"))
    _copy_op(src_weights, src_index, slot_buffer, slot_index, num_programs)


def add_slot_grads(
    slot_grads: torch.Tensor,
    slot_index: torch.Tensor,
    home_grads: torch.Tensor,
    home_index: torch.Tensor,
    num_programs: int = 16,
) -> None:
    """``home_grads[home_index[i]] += slot_grads[slot_index[i]]`` (in place, deterministic; -1 skips i).

    Args:
        slot_grads: [S, *D] gradients of the replica (or any) slots.
        slot_index: int [n], slot rows to read.
        home_grads: [E, *D] gradients of the home experts, accumulated into.
        home_index: int [n], home rows to add into (repeats allowed: summed in increasing i).
        num_programs: programs of the persistent kernel (CUDA / interpreter path).
    """
    _check_pairs(slot_grads, slot_index, home_grads, home_index, num_programs,
                 ("slot_grads", "slot_index", "home_grads", "home_index"))
    _add_op(slot_grads, slot_index, home_grads, home_index, num_programs)
