"""Copy expert weights into replica slots, and add replica-slot gradients back into the home experts.

``copy_into_slots(src_weights [E, *D], src_index [n], slot_buffer [S, *D], slot_index [n])`` sets
``slot_buffer[slot_index[i]] = src_weights[src_index[i]]`` for every i with both indices >= 0.

``add_slot_grads(slot_grads [S, *D], slot_index [n], home_grads [E, *D], home_index [n])`` adds
``slot_grads[slot_index[i]]`` into ``home_grads[home_index[i]]`` for every i with both indices >= 0.
Several i may share a home row (an expert replicated into several slots, or a home slot plus its
replicas): the sum is deterministic, taken in increasing i after the existing home value.

On CUDA both run one *persistent* Triton kernel: ``num_programs`` programs (16 by default, so the
copy leaves the other SMs to the GEMMs it overlaps with) loop over the work items
(pair, chunk of ``BLOCK`` elements). Only a few programs are resident, so the loop keeps several
wide loads in flight per program.

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

from relibra_moe.triton_kernels.backend import use_triton

_TRITON_READY = False  # flipped when the Triton kernels land

__all__ = ["add_slot_grads", "add_slot_grads_torch", "copy_into_slots", "copy_into_slots_torch"]


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
    if index.is_cuda or index.numel() == 0:
        return
    lo, hi = int(index.min()), int(index.max())
    if lo < -1 or hi >= size:
        raise ValueError(f"{name} must lie in [-1, {size}), got range [{lo}, {hi}]")


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
    """Reference of :func:`add_slot_grads` (in place on ``home_grads``; sums in increasing i)."""
    keep = ((slot_index >= 0) & (home_index >= 0)).tolist()
    si, hi = slot_index.tolist(), home_index.tolist()
    for i, k in enumerate(keep):
        if k:
            home_grads[hi[i]] += slot_grads[si[i]]


@torch.library.custom_op("relibra::copy_into_slots", mutates_args=("slot_buffer",))
def _copy_op(
    src_weights: torch.Tensor,
    src_index: torch.Tensor,
    slot_buffer: torch.Tensor,
    slot_index: torch.Tensor,
    num_programs: int,
) -> None:
    if _TRITON_READY and use_triton(slot_buffer):
        from relibra_moe.triton_kernels import _replica_kernels as kern

        kern.copy_into_slots_triton(src_weights, src_index, slot_buffer, slot_index, num_programs)
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
    if _TRITON_READY and use_triton(home_grads):
        from relibra_moe.triton_kernels import _replica_kernels as kern

        kern.add_slot_grads_triton(slot_grads, slot_index, home_grads, home_index, num_programs)
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
    _check_rows(src_weights, slot_buffer, "src_weights", "slot_buffer")
    _check_index(src_index, slot_index, "src_index", "slot_index")
    _check_range(src_index, src_weights.shape[0], "src_index")
    _check_range(slot_index, slot_buffer.shape[0], "slot_index")
    if num_programs < 1:
        raise ValueError(f"num_programs must be >= 1, got {num_programs}")
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
    _check_rows(slot_grads, home_grads, "slot_grads", "home_grads")
    _check_index(slot_index, home_index, "slot_index", "home_index")
    _check_range(slot_index, slot_grads.shape[0], "slot_index")
    _check_range(home_index, home_grads.shape[0], "home_index")
    if num_programs < 1:
        raise ValueError(f"num_programs must be >= 1, got {num_programs}")
    _add_op(slot_grads, slot_index, home_grads, home_index, num_programs)
