"""The sample placements trainers already use: which data-parallel rank runs each sample, in which micro-batch.

A strategy that does not place samples itself runs on one of these (``PlanOptions.sample_placement``); relibra's
locality starts from one. Each function returns ``(micro_batch [N], gpu [N])``, int64, for a batch whose samples
have ``lengths [N]`` tokens and the micro-batch assignment ``micro_batch [N]`` (M micro-batches), on G GPUs
(the EP group's data-parallel ranks):

- ``round-robin`` (``round_robin``): Megatron's order. The batch's micro-batches are kept; the k-th sample of a
  micro-batch runs on GPU ``k mod G`` (``plan.round_robin_gpus``). What a trainer that does not reorder does.
- ``length-balanced`` (``length_balanced``): verl's ``balance_batch`` (``RayPPOTrainer._balance_batch``, on by
  default, and ``verl.utils.seqlen_balancing.get_seqlen_balanced_partitions``, verl 0.9.1): the whole global batch
  is cut into G partitions of equal sample counts whose workloads ``verl_workload(S) = 24576 S + S^2`` are
  balanced by the Karmarkar-Karp largest-differencing method (``karmarkar_karp``); partition r goes to rank r;
  each partition is sorted by workload (ties by index) and laid out small-at-both-ends (the even positions
  ascending, then the odd ones descending); rank r's micro-batch j is the j-th contiguous run of that order. verl
  runs a fixed ``ppo_micro_batch_size_per_gpu`` b: here b = N / (G M) when G M divides N (exactly verl's cut);
  otherwise the runs are ``np.array_split``'s (sizes differ by at most one) and, when G does not divide N, the
  partitions differ by at most one sample (the Karmarkar-Karp tuples are padded with zero-workload
  placeholders, which are then dropped). When a rank holds fewer samples than there are micro-batches (b < 1,
  which verl cannot run), the ranks' samples, in that order, fill the micro-batches in turn, each rank continuing
  where the previous one stopped, so no micro-batch is left empty. Samples change micro-batch; the batch keeps
  its M micro-batches.
- ``longest-first`` (``longest_first``): per micro-batch of the batch, the longest sample first (ties: the lower
  index) onto the GPU with the fewest tokens so far (ties: the lower GPU id). Token balance per micro-batch, as
  token-budget packers group samples (slime's and NeMo-RL's dynamic batching); sample counts per GPU may differ.

Same inputs, same placement (no randomness). docs/baselines.md, "Sample placements", says which framework does
what.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable

import numpy as np

from .errors import PlanError
from .plan import round_robin_gpus
from .validate import check_int

__all__ = ["SAMPLE_PLACEMENTS", "PLACEMENT_USERS", "VERL_WORKLOAD_LINEAR", "verl_workload", "karmarkar_karp",
           "round_robin", "length_balanced", "longest_first", "place_samples"]

SAMPLE_PLACEMENTS = ("round-robin", "length-balanced", "longest-first")
"""The sample placements by name (``place_samples``; ``PlanOptions.sample_placement``)."""

PLACEMENT_USERS = {"round-robin": "Megatron's order", "length-balanced": "verl's balance_batch",
                   "longest-first": "token-balanced per micro-batch"}
"""What each placement is, for tables: who already has it."""

VERL_WORKLOAD_LINEAR = 24576
"""verl's workload estimate ``24576 S + S^2`` (``seqlen_balancing.calculate_workload``: 12 h^2 S + 2 h S^2 for
h = 4096, divided by 2 h): the linear coefficient, in units of S^2."""


def verl_workload(lengths: np.ndarray) -> np.ndarray:
    """int64 ``[N]``: verl's workload of sequences of ``lengths`` tokens, ``24576 S + S^2`` (relative units)."""
    s = np.asarray(lengths, dtype=np.int64)
    return VERL_WORKLOAD_LINEAR * s + s * s


class _Part:
    """One set of a Karmarkar-Karp state: its sum and its (index, weight) items; ordered by (sum, size, items)."""

    __slots__ = ("total", "items")

    def __init__(self, items: list[tuple[int, int]]) -> None:
        self.items = items
        self.total = sum(w for _, w in items)

    def key(self) -> tuple[int, int, list[tuple[int, int]]]:
        return self.total, len(self.items), self.items


class _State:
    """k sets in descending order; a heap entry that pops the largest spread first (ties: the larger first set)."""

    __slots__ = ("parts",)

    def __init__(self, parts: list[_Part]) -> None:
        self.parts = sorted(parts, key=_Part.key, reverse=True)

    @property
    def spread(self) -> int:
        return self.parts[0].total - self.parts[-1].total

    def __lt__(self, other: _State) -> bool:
        if self.spread != other.spread:
            return self.spread > other.spread
        return self.parts[0].key() > other.parts[0].key()


def karmarkar_karp(weights: np.ndarray, num_parts: int) -> list[np.ndarray]:
    """Equal-size Karmarkar-Karp (largest differencing) partition of ``weights [N]`` (ints >= 0) into k parts.

    The items, sorted ascending by (weight, index), are cut into consecutive k-tuples; each tuple is a state of k
    one-item sets. The two states with the largest spread (largest set sum minus smallest) are merged, the largest
    set of one with the smallest of the other and so on, until one state is left; its sets, largest sum first,
    are the parts. When k does not divide N, zero-weight placeholders (sorted with the lightest items) fill the
    tuples up and are dropped from the result, so the parts' sizes differ by at most one. With k dividing N this is
    verl's ``karmarkar_karp(..., equal_size=True)``, ties included.

    Returns:
        k int64 arrays of item indices, each ascending; part i has the i-th largest sum.
    """
    k = check_int("num_parts", num_parts, 1, error=PlanError)
    w = np.asarray(weights, dtype=np.int64)
    if w.ndim != 1 or (w.size and int(w.min()) < 0):
        raise PlanError(f"weights must be an [N] array of ints >= 0, got shape {w.shape}")
    n = len(w)
    pad = (-n) % k
    items = sorted([(int(w[i]), i) for i in range(n)] + [(0, n + i) for i in range(pad)])
    heap = [_State([_Part([(i, v)]) for v, i in items[o:o + k]]) for o in range(0, len(items), k)]
    heapq.heapify(heap)
    while len(heap) > 1:
        a = heapq.heappop(heap)
        b = heapq.heappop(heap)
        merged = [_Part(a.parts[i].items + b.parts[k - 1 - i].items) for i in range(k)]
        heapq.heappush(heap, _State(merged))
    parts = heap[0].parts if heap else [_Part([]) for _ in range(k)]
    return [np.array(sorted(i for i, _ in p.items if i < n), dtype=np.int64) for p in parts]


def _inputs(lengths: np.ndarray, micro_batch: np.ndarray, num_gpus: int) -> tuple[np.ndarray, np.ndarray, int]:
    s = np.asarray(lengths, dtype=np.int64)
    mb = np.asarray(micro_batch, dtype=np.int64)
    G = check_int("num_gpus", num_gpus, 1, error=PlanError)
    if s.ndim != 1 or mb.shape != s.shape:
        raise PlanError(f"lengths {s.shape} and micro_batch {mb.shape} must both be [N]")
    if s.size and int(s.min()) < 0:
        raise PlanError(f"lengths[{int(np.argmin(s))}] = {int(s.min())} is negative")
    if mb.size and int(mb.min()) < 0:
        raise PlanError(f"micro_batch[{int(np.argmin(mb))}] = {int(mb.min())} is negative: assign every sample")
    return s, mb, G


def round_robin(lengths: np.ndarray, micro_batch: np.ndarray, num_gpus: int) -> tuple[np.ndarray, np.ndarray]:
    """Megatron's order: the batch's micro-batches, GPUs ``plan.round_robin_gpus`` (``lengths`` unused)."""
    _, mb, G = _inputs(lengths, micro_batch, num_gpus)
    return mb.copy(), round_robin_gpus(mb, G)


def length_balanced(lengths: np.ndarray, micro_batch: np.ndarray, num_gpus: int) -> tuple[np.ndarray, np.ndarray]:
    """verl's ``balance_batch`` over the whole batch (module docstring): equal sample counts per rank,
    workloads balanced by ``karmarkar_karp``, each rank's samples cut into the batch's M micro-batches in verl's
    small-at-both-ends order."""
    s, mb, G = _inputs(lengths, micro_batch, num_gpus)
    N = len(s)
    M = int(mb.max()) + 1 if N else 0
    work = verl_workload(s)
    out_mb = np.zeros(N, np.int64)
    out_gpu = np.zeros(N, np.int64)
    parts = karmarkar_karp(work, G)
    short = min(len(p) for p in parts) < M  # b < 1: verl cannot run it; no micro-batch may be left empty
    turn = 0
    for g, part in enumerate(parts):
        order = part[np.lexsort((part, work[part]))]
        order = np.concatenate([order[::2], order[1::2][::-1]])
        if short:
            out_mb[order] = (turn + np.arange(len(order))) % M
            turn += len(order)
        else:
            for j, run in enumerate(np.array_split(order, M)):
                out_mb[run] = j
        out_gpu[part] = g
    return out_mb, out_gpu


def longest_first(lengths: np.ndarray, micro_batch: np.ndarray, num_gpus: int) -> tuple[np.ndarray, np.ndarray]:
    """Per micro-batch, the longest sample first onto the GPU with the fewest tokens (module docstring)."""
    s, mb, G = _inputs(lengths, micro_batch, num_gpus)
    gpu = np.zeros(len(s), np.int64)
    for m in np.unique(mb):
        idx = np.flatnonzero(mb == m)
        tokens = np.zeros(G, np.int64)
        for n in idx[np.lexsort((idx, -s[idx]))]:
            g = int(np.argmin(tokens))  # the first minimum: the lower GPU id on ties
            gpu[n] = g
            tokens[g] += s[n]
    return mb.copy(), gpu


_PLACERS: dict[str, Callable[[np.ndarray, np.ndarray, int], tuple[np.ndarray, np.ndarray]]] = {
    "round-robin": round_robin, "length-balanced": length_balanced, "longest-first": longest_first}


def place_samples(placement: str, lengths: np.ndarray, micro_batch: np.ndarray, num_gpus: int
                  ) -> tuple[np.ndarray, np.ndarray]:
    """``(micro_batch [N], gpu [N])``, int64, of the named placement (``SAMPLE_PLACEMENTS``) for samples of
    ``lengths [N]`` tokens assigned to ``micro_batch [N]`` (the batch's M micro-batches) on ``num_gpus`` GPUs.

    Raises:
        PlanError: an unknown name (with the known ones), arrays of other shapes, a negative length or an
            unassigned sample (micro-batch < 0).
    """
    if placement not in _PLACERS:
        raise PlanError(f"sample_placement={placement!r} is not one of {SAMPLE_PLACEMENTS}")
    return _PLACERS[placement](lengths, micro_batch, num_gpus)
