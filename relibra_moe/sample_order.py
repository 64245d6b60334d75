"""The sample-order hook: a plan's sample placement as the order in which a trainer's dispatch must see the batch.

Trainers that reorder their global batch before dispatching it to the data-parallel ranks (verl, slime) can follow
a plan's sample placement exactly: reorder the batch by ``sample_order(plan, framework)`` where the framework
would otherwise reorder it, and its own split hands rank r, micro-step by micro-step, exactly the samples the plan
runs on GPU r in micro-batch m. Where to call it in each framework: docs/rl-frameworks.md, "Following the plan's
sample placement".

How the frameworks split a reordered batch (fixed micro-batch size b, no dynamic batching):

- **verl** (``DataProto.chunk`` in the ``DP_COMPUTE_PROTO`` dispatch, then ``dp_actor.update_policy``): the batch
  is cut into G equal contiguous chunks, chunk r to data-parallel rank r; each rank splits its chunk into
  mini-batches (``ppo_mini_batch_size`` per rank) and each mini-batch into micro-batches of
  ``ppo_micro_batch_size_per_gpu`` = b. Rank r's j-th micro-batch (counted over its mini-batches) is positions
  ``r N/G + j b .. r N/G + (j + 1) b``. The order is therefore rank-major: rank 0's micro-batches 0..M-1, then
  rank 1's, and so on.
- **slime** (``slime.utils.dp_schedule.build_dp_schedule``, static batch): a step's samples are cut into K
  contiguous micro-batches of ``micro_batch_size`` = b, and micro-batch k goes to rank ``k mod G`` as that
  rank's micro-batch ``k // G`` (the strided round-robin of ``balance_data=False``). The order is micro-batch
  major: micro-step 0 of ranks 0..G-1, then micro-step 1, and so on.

Both need every (micro-batch, GPU) cell of the plan to hold the same number b of samples: plan with
``keep_cell_sizes=True`` (the locality then only swaps samples; the round-robin start has B / G per cell when G
divides B) or with ``sample_owner="trainer"`` and an equal assignment. Within a cell the samples keep their
order in the batch (ascending index).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .errors import PlanError
from .plan import BatchPlan, SamplePlacement
from .validate import check_int

__all__ = ["FRAMEWORKS", "sample_order", "cell_samples"]

FRAMEWORKS = ("verl", "slime")
"""The dispatch orders ``sample_order`` knows: "verl" (rank-major) and "slime" (micro-batch major)."""


def cell_samples(samples: SamplePlacement | BatchPlan, num_gpus: int | None = None) -> list[list[np.ndarray]]:
    """``out[m][g]``: int64 indices of the samples of micro-batch m on GPU g, ascending.

    Args:
        samples: a ``SamplePlacement`` or a ``BatchPlan`` (its ``samples``).
        num_gpus: G (default: the plan's ``num_gpus``; required for a bare ``SamplePlacement``).
    """
    samples, G = _placement(samples, num_gpus)
    mb = samples.micro_batch.astype(np.int64)
    gpu = samples.gpu.astype(np.int64)
    M = int(samples.num_micro_batches)
    return [[np.flatnonzero((mb == m) & (gpu == g)) for g in range(G)] for m in range(M)]


def sample_order(samples: SamplePlacement | BatchPlan, framework: str, num_gpus: int | None = None) -> np.ndarray:
    """int64 ``[N]`` permutation of the batch for ``framework``'s dispatch to follow the plan's sample placement.

    Position i of the reordered batch holds sample ``order[i]`` of the batch the plan was made for (verl:
    ``data.reorder(torch.as_tensor(order))``; slime: ``samples = [samples[i] for i in order]``). After the
    framework's own split (module docstring), data-parallel rank g runs, as its micro-batch m, exactly the plan's
    samples of micro-batch m on GPU g, in ascending index order.

    Args:
        samples: the plan (``BatchPlan``) or its ``SamplePlacement``.
        framework: one of ``FRAMEWORKS``.
        num_gpus: G = the data-parallel ranks of the EP group (default: the plan's ``num_gpus``).

    Raises:
        PlanError: an unknown framework, or a cell whose sample count differs from the others' (the
            frameworks' fixed micro-batch size b needs every (micro-batch, GPU) cell to hold b samples; plan
            with ``keep_cell_sizes=True``); the message names the cell, its count and b.
    """
    if framework not in FRAMEWORKS:
        raise PlanError(f"framework={framework!r} is not one of {FRAMEWORKS}")
    cells = cell_samples(samples, num_gpus)
    M, G = len(cells), len(cells[0]) if cells else 0
    b = len(cells[0][0]) if M and G else 0
    for m in range(M):
        for g in range(G):
            if len(cells[m][g]) != b:
                raise PlanError(
                    f"micro-batch {m} on GPU {g} holds {len(cells[m][g])} samples, micro-batch 0 on GPU 0 holds "
                    f"{b}: {framework}'s fixed micro-batch size needs the same count in every (micro-batch, GPU) "
                    "cell; plan with keep_cell_sizes=True (or give the trainer's equal assignment with "
                    "sample_owner='trainer')")
    if b == 0 and M:
        raise PlanError(f"micro-batch 0 on GPU 0 holds no sample: {framework} gives every rank at least one")
    if framework == "verl":
        parts = [cells[m][g] for g in range(G) for m in range(M)]
    else:
        parts = [cells[m][g] for m in range(M) for g in range(G)]
    return np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, np.int64)


def _placement(samples: Any, num_gpus: int | None) -> tuple[SamplePlacement, int]:
    if isinstance(samples, BatchPlan):
        G = samples.num_gpus if num_gpus is None else num_gpus
        samples = samples.samples
    elif isinstance(samples, SamplePlacement):
        if num_gpus is None:
            raise PlanError("num_gpus is required with a SamplePlacement (a BatchPlan carries its own)")
        G = num_gpus
    else:
        raise PlanError(f"samples must be a BatchPlan or a SamplePlacement, got {type(samples).__name__}")
    check_int("num_gpus", G, 1)
    gpu = samples.gpu
    if gpu.size and (int(gpu.min()) < 0 or int(gpu.max()) >= G):
        i = int(np.flatnonzero((gpu < 0) | (gpu >= G))[0])
        raise PlanError(f"sample_gpu[{i}] = {int(gpu[i])} is outside [0, {int(G)})")
    return samples, int(G)
