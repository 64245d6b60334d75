"""Routing traces: the recorded top-k expert ids of every token, and the loads planners consume.

``RoutingTrace`` is one sequence: ``experts`` ``[S, L, k]`` (``-1`` = no route) for its S tokens at
its L MoE layers. ``TraceBatch`` is a global batch of sequences with an optional micro-batch
assignment; it turns the ids into the load tensors of docs/method.md, "Cost model" (``x[j, e]`` per
micro-batch and layer) without any Python loop over tokens.

Routing recorded by inference engines and RL frameworks (SGLang, vLLM, Megatron, verl, slime, NeMo-RL,
SkyRL) becomes a RoutingTrace / TraceBatch through :mod:`relibra_moe.adapters` (docs/rl-frameworks.md).

A batch may also be built from per-sample expert counts alone (``TraceBatch.from_counts``), with the
per-token ids produced on demand by a callback: synthetic batches at the paper's scale plan from the
counts and never hold billions of ids in memory.

The file format (``.npz``, versions 1 and 2) and its reading and writing: :mod:`relibra_moe.trace_files`;
``TraceBatch.save`` / ``TraceBatch.load`` delegate there.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from numba import njit

from .errors import TraceError
from .trace_files import (
    FORMAT_VERSION,
    NO_ROUTE,
    READ_VERSIONS,
    REQUIRED_KEYS,
    as_int_array,
    check_layer_ids,
    counts_dtype,
    file_ids_dtype,
    read_offsets,
    read_starts_source_info,
    read_trace_file,
    read_v2_fields,
    scalar_int,
    write_trace_file,
)
from .validate import check_bool, check_count, check_int

_CHECK_CHUNK = 1 << 23  # ids validated per chunk (keeps the duplicate check's temporaries small)

__all__ = ["FORMAT_VERSION", "READ_VERSIONS", "NO_ROUTE", "REQUIRED_KEYS", "RoutingTrace", "TraceBatch", "ids_dtype",
           "file_ids_dtype",
           "counts_dtype"]


def ids_dtype(num_experts: int) -> np.dtype:
    """The in-memory dtype of expert ids: int16, or int32 when ``num_experts`` > 32767."""
    return np.dtype(np.int16) if num_experts <= np.iinfo(np.int16).max else np.dtype(np.int32)


def positive_int(name: str, value: Any) -> int:
    """``value`` as an int > 0 (bool is not an int); else TraceError naming ``name`` and the value."""
    return check_count(name, value, 1, error=TraceError)


def nonnegative_int(name: str, value: Any) -> int:
    """``value`` as an int >= 0 (bool is not an int); else TraceError naming ``name`` and the value."""
    return check_count(name, value, 0, error=TraceError)


@njit(cache=True)
def _scan_ids(experts: np.ndarray, num_experts: int, counts: np.ndarray) -> bool:
    """One pass over ids ``[T, L, k]``: True when every id is in ``[-1, E)`` and no row repeats an id >= 0;
    adds each id >= 0 to ``counts`` int64 ``[L, E]`` (pass a ``[0, 0]`` array to skip counting)."""
    do_count = counts.shape[0] > 0
    seen = np.zeros(num_experts, np.int64)  # row stamp of each expert's last sighting
    stamp = 0
    for t in range(experts.shape[0]):
        for layer in range(experts.shape[1]):
            stamp += 1
            for j in range(experts.shape[2]):
                v = experts[t, layer, j]
                if v < -1 or v >= num_experts:
                    return False
                if v >= 0:
                    if seen[v] == stamp:
                        return False
                    seen[v] = stamp
                    if do_count:
                        counts[layer, v] += 1
    return True


def check_ids(experts: np.ndarray, num_experts: int, where: Callable[[int], str],
              counts: np.ndarray | None = None) -> None:
    """Raise TraceError at the first out-of-range or duplicated id of ``experts`` ``[T, L, k]``.

    ``where(t)`` describes row ``t`` (e.g. ``"sample 3, row 17"``). ``-1`` entries are padding: any
    number of them may appear in a row, and they are not duplicates of each other. ``counts``, a zeroed
    int64 ``[L, E]``, receives the expert counts in the same pass.
    """
    if experts.size == 0 or _scan_ids(experts, int(num_experts), np.zeros((0, 0), np.int64) if counts is None
                                      else counts):
        return  # valid (one compiled pass); else find and name the first bad entry below
    lo, hi = int(experts.min()), int(experts.max())
    if lo < -1 or hi >= num_experts:
        bad = (experts < -1) | (experts >= num_experts)
        t, l, s = np.unravel_index(int(np.flatnonzero(bad.ravel())[0]), experts.shape)
        v = int(experts[t, l, s])
        raise TraceError(f"{where(int(t))}, layer {int(l)}, slot {int(s)}: expert id {v} out of range "
                         f"(valid: 0..{num_experts - 1}, or -1 for no route)")
    if experts.shape[2] > 1:
        step = max(1, _CHECK_CHUNK // max(1, experts.shape[1] * experts.shape[2]))  # bounded temporaries
        for lo in range(0, experts.shape[0], step):
            part = experts[lo:lo + step]
            srt = np.sort(part, axis=2)
            dup = (srt[:, :, 1:] == srt[:, :, :-1]) & (srt[:, :, 1:] >= 0)
            if dup.any():
                t, l, j = np.unravel_index(int(np.flatnonzero(dup.ravel())[0]), dup.shape)
                v = int(srt[t, l, j + 1])
                raise TraceError(f"{where(lo + int(t))}, layer {int(l)}: duplicate expert id {v} in row "
                                 f"{part[t, l].tolist()} (a row holds k distinct ids)")


def _normalize(experts: Any, layer_ids: Any, num_experts: Any, top_k: Any, where: Callable[[int], str],
               counts: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, int, int]:
    """Validate one sequence's fields; returns (experts in ``ids_dtype``, layer_ids int32, E, k). ``counts``:
    see :func:`check_ids`."""
    num_experts = positive_int("num_experts", num_experts)
    top_k = positive_int("top_k", top_k)
    if top_k > num_experts:
        raise TraceError(f"top_k={top_k} exceeds num_experts={num_experts}")
    experts = as_int_array("experts", experts)
    if experts.ndim != 3:
        raise TraceError(f"experts must have rank 3 [S, L, k], got rank {experts.ndim} with shape {experts.shape}")
    if experts.shape[2] != top_k:
        raise TraceError(f"experts has k={experts.shape[2]} ids per row (shape {experts.shape}), top_k={top_k}")
    if experts.shape[1] == 0:
        raise TraceError(f"experts has no MoE layers (shape {experts.shape})")
    layer_ids = as_int_array("layer_ids", layer_ids)
    if layer_ids.ndim != 1 or layer_ids.shape[0] != experts.shape[1]:
        raise TraceError(f"layer count mismatch: layer_ids has shape {layer_ids.shape}, experts has "
                         f"{experts.shape[1]} layers (shape {experts.shape})")
    check_layer_ids(layer_ids)
    check_ids(experts, num_experts, where, counts)
    experts = experts.astype(ids_dtype(num_experts), copy=False)
    return experts, layer_ids.astype(np.int32, copy=False), num_experts, top_k


@dataclass(frozen=True, eq=False)
class RoutingTrace:
    """The routing of one sequence.

    Attributes:
        experts: int16 (int32 when E > 32767) ``[S, L, k]``: the k expert ids of each of the S tokens
            at each of the L MoE layers, in the engine's order; ``-1`` = no route (padding; a row may
            be partly padded). Any integer input dtype is accepted and converted.
        layer_ids: int32 ``[L]``: global decoder-layer index of each MoE layer.
        num_experts: routed experts per layer E.
        top_k: ids per row k.
        start: absolute token position of row 0 (e.g. the prompt length when only the response is
            recorded).
        source: free text saying where the routing came from.

    Raises:
        TraceError: wrong dtype or rank, layer count mismatch, out-of-range or duplicate id (naming
            the row, layer and value).
    """

    experts: np.ndarray
    layer_ids: np.ndarray
    num_experts: int
    top_k: int
    start: int = 0
    source: str = ""

    def __post_init__(self) -> None:
        experts, layer_ids, e, k = _normalize(self.experts, self.layer_ids, self.num_experts, self.top_k,
                                              lambda t: f"row {t}")
        nonnegative_int("start", self.start)
        object.__setattr__(self, "experts", experts)
        object.__setattr__(self, "layer_ids", layer_ids)
        object.__setattr__(self, "num_experts", e)
        object.__setattr__(self, "top_k", k)
        object.__setattr__(self, "start", int(self.start))
        object.__setattr__(self, "source", str(self.source))

    @classmethod
    def _trusted(cls, experts: np.ndarray, layer_ids: np.ndarray, num_experts: int, top_k: int, start: int,
                 source: str) -> RoutingTrace:
        """Build without validation (the caller validated the arrays already)."""
        obj = object.__new__(cls)
        for name, value in (("experts", experts), ("layer_ids", layer_ids), ("num_experts", int(num_experts)),
                            ("top_k", int(top_k)), ("start", int(start)), ("source", str(source))):
            object.__setattr__(obj, name, value)
        return obj

    @property
    def num_tokens(self) -> int:
        """Rows S."""
        return int(self.experts.shape[0])

    @property
    def num_layers(self) -> int:
        """MoE layers L."""
        return int(self.experts.shape[1])

    def expert_counts(self) -> np.ndarray:
        """int64 ``[L, E]``: tokens routed to expert e at MoE layer l (``-1`` entries not counted)."""
        return _counts_of(self.experts, self.num_experts)


def _counts_of(experts: np.ndarray, num_experts: int) -> np.ndarray:
    """int64 ``[L, E]`` expert counts of ids ``[S, L, k]`` (-1 skipped): one compiled pass for valid integer ids,
    else a vectorized bincount."""
    s, num_layers, k = experts.shape
    if experts.dtype.kind in "iu":
        counts = np.zeros((num_layers, num_experts), np.int64)
        if _scan_ids(experts, int(num_experts), counts):
            return counts
    it = np.int32 if num_layers * num_experts < 2**31 else np.int64
    flat = experts.astype(it) + (np.arange(num_layers, dtype=it) * it(num_experts))[None, :, None]
    if s and int(experts.min()) < 0:
        flat = flat[experts >= 0]
    return np.bincount(flat.ravel(), minlength=num_layers * num_experts).reshape(num_layers, num_experts)


def _check_micro_batch(micro_batch: Any, n: int, name: str = "micro_batch") -> np.ndarray | None:
    if micro_batch is None:
        return None
    mb = as_int_array(name, micro_batch)
    if mb.shape != (n,):
        raise TraceError(f"{name} must have shape [{n}] (one entry per sequence), got {mb.shape}")
    if mb.size and int(mb.min()) < -1:
        i = int(np.argmin(mb))
        raise TraceError(f"{name}[{i}] = {int(mb[i])}: micro-batch ids are >= 0, or -1 for not assigned")
    if mb.size and int(mb.max()) > np.iinfo(np.int32).max:
        i = int(np.argmax(mb))
        raise TraceError(f"{name}[{i}] = {int(mb[i])}: micro-batch ids must fit int32")
    out = mb.astype(np.int32)
    out.setflags(write=False)
    return out


def _check_info(info: dict[str, Any] | None, n: int) -> dict[str, np.ndarray]:
    out: dict[str, np.ndarray] = {}
    for key, value in (info or {}).items():
        arr = np.asarray(value)
        if arr.ndim < 1 or arr.shape[0] != n:
            raise TraceError(f"sample_info[{key!r}] must have one entry per sequence ({n}), got shape {arr.shape}")
        if arr.dtype.kind == "O":
            raise TraceError(f"sample_info[{key!r}] has dtype object; use numbers or strings")
        out[str(key)] = arr
    return out


class TraceBatch:
    """A global batch of N sequences with the same MoE layers, E and k.

    Args:
        traces: the sequences (at least one), in sample order.
        micro_batch: optional int32 ``[N]``: micro-batch of each sequence, ``-1`` = not assigned.
        source: free text; defaults to the traces' distinct sources joined by ``"; "``.
        sample_info: optional per-sample metadata, each value ``[N]`` (e.g. ``{"domain": [...]}``).

    Raises:
        TraceError: empty batch, a sequence whose E, k, layer count or layer ids differ from sample 0
            (naming the sample), a bad micro-batch array.
    """

    def __init__(self, traces: Sequence[RoutingTrace], micro_batch: Any = None, *, source: str | None = None,
                 sample_info: dict[str, Any] | None = None) -> None:
        traces = list(traces)
        if not traces:
            raise TraceError("empty batch: a TraceBatch needs at least one sequence")
        for i, tr in enumerate(traces):
            if not isinstance(tr, RoutingTrace):
                raise TraceError(f"sample {i}: expected a RoutingTrace, got {type(tr).__name__}")
        t0 = traces[0]
        for i, tr in enumerate(traces[1:], start=1):
            if tr.num_layers != t0.num_layers:
                raise TraceError(f"layer count mismatch: sample {i} has {tr.num_layers} MoE layers, sample 0 has "
                                 f"{t0.num_layers}")
            if not np.array_equal(tr.layer_ids, t0.layer_ids):
                raise TraceError(f"sample {i}: layer_ids {tr.layer_ids.tolist()} differ from sample 0's "
                                 f"{t0.layer_ids.tolist()}")
            if tr.num_experts != t0.num_experts:
                raise TraceError(f"sample {i}: num_experts={tr.num_experts}, sample 0 has {t0.num_experts} (adapters "
                                 "infer E from the largest id unless num_experts= is passed)")
            if tr.top_k != t0.top_k:
                raise TraceError(f"sample {i}: top_k={tr.top_k}, sample 0 has {t0.top_k}")
        if source is None:
            source = "; ".join(dict.fromkeys(tr.source for tr in traces if tr.source))
        self._setup(
            n=len(traces), layer_ids=t0.layer_ids, num_experts=t0.num_experts, top_k=t0.top_k,
            lengths=np.array([tr.num_tokens for tr in traces], dtype=np.int64),
            starts=np.array([tr.start for tr in traces], dtype=np.int64),
            source=source, traces=traces, factory=None, counts=None,
            micro_batch=micro_batch, sample_info=sample_info)

    # ----------------------------------------------------------------------------------- building
    def _setup(self, *, n: int, layer_ids: np.ndarray, num_experts: int, top_k: int, lengths: np.ndarray,
               starts: np.ndarray, source: str, traces: list[RoutingTrace] | None,
               factory: Callable[[int], np.ndarray] | None, counts: np.ndarray | None, micro_batch: Any,
               sample_info: dict[str, Any] | None, origin: str | None = None) -> None:
        self._n = int(n)
        self._layer_ids = np.asarray(layer_ids, dtype=np.int32)
        self._layer_ids.setflags(write=False)
        self._num_experts = int(num_experts)
        self._top_k = int(top_k)
        self._lengths = lengths
        self._lengths.setflags(write=False)
        self._starts = starts
        self._starts.setflags(write=False)
        self.source = str(source)
        self._traces = traces
        self._factory = factory
        self._counts = counts
        self._origin = origin  # the trace file this batch was read from (named in its errors), else None
        self.micro_batch = _check_micro_batch(micro_batch, self._n)
        self.sample_info = _check_info(sample_info, self._n)

    def _derive(self, *, micro_batch: Any, index: np.ndarray | None = None) -> TraceBatch:
        """A batch sharing this one's data (all samples, or the samples ``index`` in that order)."""
        new = object.__new__(TraceBatch)
        if index is None:
            new._setup(n=self._n, layer_ids=self._layer_ids, num_experts=self._num_experts, top_k=self._top_k,
                       lengths=self._lengths, starts=self._starts, source=self.source, traces=self._traces,
                       factory=self._factory, counts=self._counts, micro_batch=micro_batch,
                       sample_info=self.sample_info, origin=self._origin)
            return new
        traces = [self._traces[i] for i in index] if self._traces is not None else None
        factory = None
        if self._factory is not None:
            parent, idx = self._factory, index.copy()

            def factory(i: int) -> np.ndarray:
                return parent(int(idx[i]))
        counts = self._counts[index] if self._counts is not None else None
        if counts is not None:
            counts.setflags(write=False)
        new._setup(n=index.size, layer_ids=self._layer_ids, num_experts=self._num_experts, top_k=self._top_k,
                   lengths=self._lengths[index].copy(), starts=self._starts[index].copy(), source=self.source,
                   traces=traces, factory=factory, counts=counts, micro_batch=micro_batch,
                   sample_info={k: v[index] for k, v in self.sample_info.items()}, origin=self._origin)
        return new

    @classmethod
    def from_counts(cls, counts: Any, top_k: int, layer_ids: Any = None, *,
                    materialize: Callable[[int], np.ndarray] | None = None, starts: Any = None,
                    micro_batch: Any = None, source: str = "", sample_info: dict[str, Any] | None = None) -> TraceBatch:
        """A batch known by its per-sample expert counts; per-token ids come from ``materialize``.

        Args:
            counts: int ``[N, L, E]``: tokens of sample n routed to expert e at layer l. Every token
                is routed to exactly k experts, so ``counts[n, l].sum() == k * S_n`` for every layer,
                and ``counts[n, l, e] <= S_n``.
            top_k: k.
            layer_ids: ``[L]`` global layer indices (default ``0..L-1``).
            materialize: ``i -> experts [S_i, L, k]`` consistent with ``counts[i]`` (checked when
                called). Without it the batch plans and scores, and saves counts-only, but cannot be iterated.
            starts, micro_batch, source, sample_info: as for the constructor.
        """
        c = as_int_array("counts", counts)
        if c.ndim != 3:
            raise TraceError(f"counts must have rank 3 [N, L, E], got shape {c.shape}")
        n, num_layers, num_experts = c.shape
        if n == 0:
            raise TraceError("empty batch: counts has no samples")
        top_k = positive_int("top_k", top_k)
        if top_k > num_experts:
            raise TraceError(f"top_k={top_k} exceeds num_experts={num_experts}")
        if c.size and int(c.min()) < 0:
            i, l, e = np.unravel_index(int(np.argmin(c)), c.shape)
            raise TraceError(f"sample {i}, layer {l}: negative count {int(c[i, l, e])} for expert {e}")
        sums = c.sum(axis=2, dtype=np.int64)
        if np.any(sums % top_k) or np.any(sums != sums[:, :1]):
            bad = np.argwhere((sums % top_k != 0) | (sums != sums[:, :1]))[0]
            i, l = int(bad[0]), int(bad[1])
            raise TraceError(f"sample {i}, layer {l}: counts sum to {int(sums[i, l])}; every layer of a sample "
                             f"must sum to k x tokens (k={top_k}, layer 0 sums to {int(sums[i, 0])})")
        lengths = (sums[:, 0] // top_k).astype(np.int64)
        over = c > lengths[:, None, None]
        if over.any():
            i, l, e = np.argwhere(over)[0]
            raise TraceError(f"sample {i}, layer {l}: expert {e} has count {int(c[i, l, e])} > the sample's "
                             f"{int(lengths[i])} tokens (a token picks an expert at most once)")
        if layer_ids is None:
            layer_ids = np.arange(num_layers, dtype=np.int32)
        layer_ids = as_int_array("layer_ids", layer_ids)
        if layer_ids.shape != (num_layers,):
            raise TraceError(f"layer count mismatch: layer_ids has shape {layer_ids.shape}, counts has "
                             f"{num_layers} layers")
        starts = np.zeros(n, np.int64) if starts is None else as_int_array("starts", starts).astype(np.int64)
        if starts.shape != (n,):
            raise TraceError(f"starts must have shape [{n}], got {starts.shape}")
        if int(starts.min()) < 0:
            i = int(np.argmin(starts))
            raise TraceError(f"starts[{i}] = {int(starts[i])}: token positions are >= 0")
        counts64 = np.ascontiguousarray(c, dtype=np.int64)
        counts64.setflags(write=False)
        new = object.__new__(cls)
        new._setup(n=n, layer_ids=layer_ids, num_experts=num_experts, top_k=top_k, lengths=lengths, starts=starts,
                   source=source, traces=None, factory=materialize, counts=counts64, micro_batch=micro_batch,
                   sample_info=sample_info)
        return new

    # --------------------------------------------------------------------------------- properties
    @property
    def num_sequences(self) -> int:
        """N."""
        return self._n

    def __len__(self) -> int:
        return self._n

    @property
    def num_layers(self) -> int:
        """MoE layers L."""
        return int(self._layer_ids.size)

    @property
    def num_experts(self) -> int:
        """E."""
        return self._num_experts

    @property
    def top_k(self) -> int:
        """k."""
        return self._top_k

    @property
    def layer_ids(self) -> np.ndarray:
        """int32 ``[L]``: global decoder-layer index of each MoE layer."""
        return self._layer_ids

    @property
    def lengths(self) -> np.ndarray:
        """int64 ``[N]``: tokens (rows) per sequence."""
        return self._lengths

    @property
    def starts(self) -> np.ndarray:
        """int64 ``[N]``: absolute token position of each sequence's row 0."""
        return self._starts

    @property
    def num_tokens(self) -> int:
        """Total rows over all sequences."""
        return int(self._lengths.sum())

    @property
    def has_ids(self) -> bool:
        """Whether per-token ids are available (held, read on demand from the file, or made by a callback)."""
        return self._traces is not None or self._factory is not None

    @property
    def origin(self) -> str | None:
        """The trace file this batch was read from (None for a batch built in memory)."""
        return self._origin

    # ------------------------------------------------------------------------------------ traces
    def trace(self, i: int) -> RoutingTrace:
        """Sequence ``i`` (materialized on demand for count-built batches; not cached)."""
        if not -self._n <= i < self._n:
            raise IndexError(f"sample {i} out of range for a batch of {self._n}")
        i %= self._n
        if self._traces is not None:
            return self._traces[i]
        if self._factory is None:
            if self._origin is not None:
                raise TraceError(f"{self._origin}: a counts-only trace file (counts_only=True): field 'experts' "
                                 "(per-token ids) is absent; replay and per-token export need a file written with "
                                 "ids (relibra trace synth without --counts-only)")
            raise TraceError("this batch holds expert counts only (no per-token ids): it can be planned and "
                             "scored, but not saved with ids, iterated or replayed")
        at = f"{self._origin}: " if self._origin is not None else ""
        experts = self._factory(i)
        counts = np.zeros((self.num_layers, self._num_experts), np.int64)
        try:
            experts, layer_ids, _, _ = _normalize(experts, self._layer_ids, self._num_experts, self._top_k,
                                                  lambda t: f"sample {i}, row {t}", counts)
        except TraceError as exc:
            raise TraceError(f"{at}{exc}") from None
        if experts.shape[0] != self._lengths[i]:
            raise TraceError(f"{at}sample {i}: materialized {experts.shape[0]} rows, counts say "
                             f"{int(self._lengths[i])}")
        if self._counts is not None and not np.array_equal(counts, self._counts[i]):
            field = "field 'experts' disagrees with field 'counts'" if at else \
                "materialized ids disagree with the batch's expert counts"
            raise TraceError(f"{at}sample {i}: {field}")
        return RoutingTrace._trusted(experts, layer_ids, self._num_experts, self._top_k, int(self._starts[i]),
                                     self.source)

    def iter_traces(self) -> Iterator[RoutingTrace]:
        """The sequences in order, materializing one at a time for count-built batches."""
        for i in range(self._n):
            yield self.trace(i)

    @property
    def traces(self) -> list[RoutingTrace]:
        """All sequences as a list (count-built batches materialize every one and keep them)."""
        if self._traces is None:
            self._traces = [self.trace(i) for i in range(self._n)]
        return self._traces

    # ------------------------------------------------------------------------------- micro-batches
    def with_micro_batch(self, micro_batch: Any) -> TraceBatch:
        """The same batch with micro-batch assignment ``micro_batch`` int ``[N]`` (or None); shares data."""
        return self._derive(micro_batch=micro_batch)

    def with_micro_batch_size(self, size: int) -> TraceBatch:
        """The same batch with sample i in micro-batch ``i // size`` (the last one may be smaller)."""
        size = positive_int("micro_batch_size", size)
        return self._derive(micro_batch=np.arange(self._n, dtype=np.int32) // size)

    def subset(self, index: Any, micro_batch: Any = None) -> TraceBatch:
        """The samples ``index`` (int ``[n]``, in that order; or a bool mask ``[N]``) as a new batch.

        The micro-batch assignment is not carried over (pass ``micro_batch`` for the new batch).
        """
        idx = np.asarray(index)
        if idx.size == 0:
            raise TraceError("empty batch: subset selects no samples")
        if idx.dtype == bool:
            if idx.shape != (self._n,):
                raise TraceError(f"subset mask must have shape [{self._n}], got {idx.shape}")
            idx = np.flatnonzero(idx)
        idx = as_int_array("subset index", idx).astype(np.int64).ravel()
        if idx.size == 0:
            raise TraceError("empty batch: subset selects no samples")
        if int(idx.min()) < 0 or int(idx.max()) >= self._n:
            raise TraceError(f"subset index out of range [0, {self._n}): {idx[(idx < 0) | (idx >= self._n)][:5]}")
        return self._derive(micro_batch=micro_batch, index=idx)

    def restrict_layers(self, layers: int | None) -> TraceBatch:
        """The batch with only its first ``layers`` MoE layers (count-built: it plans and simulates, it cannot be
        saved with token ids); the batch itself when ``layers`` is None or covers them all.

        Raises:
            TraceError: ``layers`` not an int >= 1 (nor None).
        """
        if layers is None:
            return self
        layers = check_int("layers", layers, 1, error=TraceError)
        if layers >= self.num_layers:
            return self
        counts = self.sample_expert_counts()[:, :layers]
        return TraceBatch.from_counts(counts, self.top_k, self.layer_ids[:layers], starts=self.starts,
                                      micro_batch=self.micro_batch, source=self.source,
                                      sample_info=dict(self.sample_info))

    def resolve_micro_batch(self, micro_batch: Any = None) -> np.ndarray:
        """int64 ``[N]``: ``micro_batch`` if given, else the batch's assignment; every entry must be >= 0."""
        if micro_batch is None:
            if self.micro_batch is None:
                raise TraceError("no micro-batch assignment: pass micro_batch=... or use with_micro_batch_size(B)")
            mb, name = self.micro_batch, "TraceBatch.micro_batch"
        else:
            mb, name = _check_micro_batch(micro_batch, self._n), "micro_batch"
        if int(mb.min()) < 0:
            i = int(np.flatnonzero(mb < 0)[0])
            raise TraceError(f"{name}[{i}] = -1: sample {i} is not assigned to a micro-batch "
                             "(pass an explicit micro_batch)")
        return mb.astype(np.int64)

    # --------------------------------------------------------------------------------------- loads
    def sample_expert_counts(self) -> np.ndarray:
        """int64 ``[N, L, E]`` (read-only, cached): tokens of sample n routed to expert e at layer l."""
        if self._counts is None:
            counts = np.empty((self._n, self.num_layers, self._num_experts), dtype=np.int64)
            for i in range(self._n):
                tr = self.trace(i)
                counts[i] = _counts_of(tr.experts, self._num_experts)
            counts.setflags(write=False)
            self._counts = counts
        return self._counts

    def micro_batch_expert_counts(self, micro_batch: Any = None) -> np.ndarray:
        """int64 ``[M, L, E]``: tokens of micro-batch m routed to expert e at layer l."""
        mb = self.resolve_micro_batch(micro_batch)
        counts = self.sample_expert_counts()
        m = int(mb.max()) + 1
        return _segment_sum(counts.reshape(self._n, -1), mb, m).reshape(m, self.num_layers, self._num_experts)

    def loads(self, sample_gpu: Any, num_gpus: int, micro_batch: Any = None) -> np.ndarray:
        """Token loads ``x`` of docs/method.md ("Cost model") for every micro-batch and layer.

        Args:
            sample_gpu: int ``[N]``: GPU in ``[0, num_gpus)`` running sample n's attention.
            num_gpus: G.
            micro_batch: int ``[N]`` micro-batch of each sample (>= 0); default the batch's own
                assignment, which must then have no ``-1``.

        Returns:
            int64 ``[M, L, G, E]``: tokens whose attention runs on GPU j and that are routed to expert
            e, per micro-batch m (M = max micro-batch id + 1) and MoE layer l.
        """
        num_gpus = positive_int("num_gpus", num_gpus)
        mb = self.resolve_micro_batch(micro_batch)
        gpu = as_int_array("sample_gpu", sample_gpu)
        if gpu.shape != (self._n,):
            raise TraceError(f"sample_gpu must have shape [{self._n}] (one GPU per sequence), got {gpu.shape}")
        if int(gpu.min()) < 0 or int(gpu.max()) >= num_gpus:
            i = int(np.flatnonzero((gpu < 0) | (gpu >= num_gpus))[0])
            raise TraceError(f"sample_gpu[{i}] = {int(gpu[i])} out of range [0, {num_gpus})")
        num_layers, e = self.num_layers, self._num_experts
        m = int(mb.max()) + 1
        # sum whole samples [L * E] by (micro-batch, GPU): a sort of N keys, not of N * L rows
        counts = self.sample_expert_counts().reshape(self._n, num_layers * e)
        seg = mb.astype(np.int64) * num_gpus + gpu.astype(np.int64)
        x = _segment_sum(counts, seg, m * num_gpus).reshape(m, num_gpus, num_layers, e)
        return np.ascontiguousarray(x.transpose(0, 2, 1, 3))

    # ------------------------------------------------------------------------------------------- io
    def save(self, path: str | Path, compress: bool = False, *, counts_only: bool = False) -> None:
        """Write the batch to ``path`` in the version-2 ``.npz`` format (:mod:`relibra_moe.trace_files`).

        Args:
            path: output file.
            compress: zip-compress the arrays (smaller, slower to write and read).
            counts_only: write the per-sample expert counts without the per-token ids (the file says
                so in its ``counts_only`` field); enough for planning, scoring and simulating, not for
                replay.

        Count-built batches materialize their ids one sequence at a time into the output array.

        Raises:
            TraceError: ids asked for (``counts_only=False``) from a batch that has none.
        """
        check_bool("counts_only", counts_only, error=TraceError)
        if not counts_only and not self.has_ids:
            self.trace(0)  # raises the counts-only TraceError
        experts = None if counts_only else (tr.experts for tr in self.iter_traces())
        write_trace_file(path, num_experts=self._num_experts, top_k=self._top_k, layer_ids=self._layer_ids,
                         lengths=self._lengths, starts=self._starts, micro_batch=self.micro_batch, source=self.source,
                         counts=self.sample_expert_counts(), experts=experts, info=self.sample_info, compress=compress)

    @classmethod
    def load(cls, path: str | Path) -> TraceBatch:
        """Read a batch written by :meth:`save` (format version 2, or version 1 of older releases).

        A version-2 file is read without its per-token ids: they are read on first use (see
        :mod:`relibra_moe.trace_files`), so planning a batch from a file reads its counts only.

        Raises:
            TraceError: missing file, not an ``.npz`` archive, truncated file, missing key, unknown
                version, or any validation failure; the message names the path and the reason.
        """
        path = Path(path)
        version, arrays, experts_header = read_trace_file(path)
        try:
            if version == 1:
                batch = cls._from_arrays(arrays)
                batch._origin = str(path)
                return batch
            f = read_v2_fields(arrays, path, experts_header)
        except TraceError as exc:
            raise TraceError(f"{path}: {exc}") from None
        new = object.__new__(cls)
        new._setup(n=f.lengths.size, layer_ids=f.layer_ids, num_experts=f.num_experts, top_k=f.top_k,
                   lengths=f.lengths, starts=f.starts, source=f.source, traces=None, factory=f.ids, counts=f.counts,
                   micro_batch=f.micro_batch, sample_info=f.info, origin=str(path))
        return new

    @classmethod
    def _from_arrays(cls, a: dict[str, np.ndarray]) -> TraceBatch:
        """A batch from the arrays of a version-1 file (ids decoded and checked here)."""
        num_experts, top_k = scalar_int(a["num_experts"], "num_experts"), scalar_int(a["topk"], "topk")
        experts = a["experts"]
        offsets = read_offsets(a)
        n = offsets.size - 1
        if experts.ndim != 3:
            raise TraceError(f"experts must have rank 3 [T, L, k], got shape {experts.shape}")
        if offsets[0] != 0 or np.any(np.diff(offsets) < 0) or offsets[-1] != experts.shape[0]:
            raise TraceError(f"offsets must rise from 0 to the {experts.shape[0]} rows of experts, got "
                             f"first {int(offsets[0])}, last {int(offsets[-1])}")

        def where(t: int) -> str:
            i = int(np.searchsorted(offsets, t, side="right")) - 1
            return f"sample {i}, row {t - int(offsets[i])}"

        experts, layer_ids, num_experts, top_k = _normalize(experts, a["layer_ids"], num_experts, top_k, where)
        starts, source, info = read_starts_source_info(a, n)
        traces = [RoutingTrace._trusted(experts[offsets[i]:offsets[i + 1]], layer_ids, num_experts, top_k,
                                        int(starts[i]), source) for i in range(n)]
        return cls(traces, micro_batch=a["micro_batch"], source=source, sample_info=info)

    def __repr__(self) -> str:
        mb = "none" if self.micro_batch is None else f"{int(self.micro_batch.max()) + 1} micro-batches"
        return (f"TraceBatch(N={self._n}, tokens={self.num_tokens}, L={self.num_layers}, E={self._num_experts}, "
                f"k={self._top_k}, {mb}, source={self.source!r})")


def _segment_sum(rows: np.ndarray, seg: np.ndarray, num_segments: int) -> np.ndarray:
    """Sum the rows ``[R, C]`` by segment id ``seg`` ``[R]`` into int64 ``[num_segments, C]``.

    One vector add per row (R is a batch's sample count, C = L E or so): cheaper than a sort and a gathered copy
    of the rows, and exact (integer sums).
    """
    out = np.zeros((num_segments, rows.shape[1]), dtype=np.int64)
    for i, s in enumerate(seg.tolist()):
        out[s] += rows[i]
    return out
