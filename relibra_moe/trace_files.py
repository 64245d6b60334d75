"""Trace files: the ``.npz`` format of a :class:`~relibra_moe.trace.TraceBatch`, its writing and reading.

This module knows the file (keys, dtypes, versions, limits) and returns checked fields;
:mod:`relibra_moe.trace` builds the batch from them (it imports this module, never the reverse).

File format (``.npz``, ``allow_pickle=False``), version 2 (written), versions 1 and 2 (read):

================ ============ ============ =====================================================
key              dtype        shape        meaning
================ ============ ============ =====================================================
``version``      int64        ``[]``       2
``num_experts``  int64        ``[]``       E
``topk``         int64        ``[]``       k (read into ``top_k``; the key keeps its spelling)
``layer_ids``    int32        ``[L]``      global decoder layer index of each MoE layer
``offsets``      int64        ``[N+1]``    sequence i is rows ``offsets[i]:offsets[i+1]``
``starts``       int64        ``[N]``      absolute token position of each sequence's row 0
``micro_batch``  int32        ``[N]``      micro-batch of each sequence, -1 = not assigned
``source``       str          ``[]``       free text (where the routing came from)
``counts``       uint8..64    ``[N, L, E]`` tokens of sequence n routed to expert e at layer l
                                           (the smallest unsigned dtype that holds the largest)
``counts_only``  bool         ``[]``       True: the file holds no per-token ids (no ``experts``)
``no_route``     int64        ``[]``       the id meaning "no route" in ``experts``: -1
``experts``      int8/16/32   ``[T, L, k]`` all sequences' ids concatenated, absent when
                                           ``counts_only``: int8 when E <= 128, int16 when
                                           E <= 32768, else int32 (:func:`file_ids_dtype`)
``info_<name>``  any          ``[N]``      optional per-sample metadata (e.g. ``info_domain``)
================ ============ ============ =====================================================

Reading a version-2 file reads the counts, lengths and metadata only: planning, scoring and
simulating (everything that calls :meth:`TraceBatch.sample_expert_counts`, ``micro_batch_expert_counts``
or ``loads``) never decodes the per-token ids. The ids are read from the file the first time a
sequence is asked for (:meth:`TraceBatch.trace`, replay, saving again) and checked then against the
stored counts. A counts-only file (``relibra trace synth --counts-only``) raises TraceError naming
the file and the ``experts`` field when ids are asked for.

Version 1 (still read) has no ``counts``, ``counts_only`` or ``no_route`` and always holds
``experts`` (int16, int32 when E > 32767); its ids are decoded and checked on load.
"""

from __future__ import annotations

import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .atomic import atomic_write
from .errors import TraceError
from .npzio import member_header, read_member
from .validate import check_count

FORMAT_VERSION = 2
READ_VERSIONS = (1, 2)
NO_ROUTE = -1  # the id of a row slot that no expert serves (padding, an unrecorded route)
REQUIRED_KEYS = ("version", "num_experts", "topk", "layer_ids", "offsets", "starts", "micro_batch", "source")
REQUIRED_KEYS_V1 = REQUIRED_KEYS + ("experts",)
REQUIRED_KEYS_V2 = REQUIRED_KEYS + ("counts", "counts_only", "no_route")
INFO_PREFIX = "info_"
#: Most tokens of one sequence in a file (int32 token positions, as every tokenizer and model uses).
MAX_SEQUENCE_TOKENS = (1 << 31) - 1
#: Most tokens of one batch in a file: 2^40 (10^12) keeps every derived count (k x T x L pairs, offsets,
#: byte sizes) far inside int64, and is over a thousand times any RL global batch.
MAX_BATCH_TOKENS = 1 << 40

__all__ = ["FORMAT_VERSION", "READ_VERSIONS", "NO_ROUTE", "REQUIRED_KEYS", "MAX_SEQUENCE_TOKENS", "MAX_BATCH_TOKENS",
           "file_ids_dtype", "counts_dtype", "as_int_array", "check_layer_ids", "check_offsets", "V2Fields",
           "read_trace_file", "read_v2_fields", "read_starts_source_info", "read_offsets", "scalar_int",
           "write_trace_file", "StoredIds"]


def file_ids_dtype(num_experts: int) -> np.dtype:
    """The smallest signed dtype holding ids ``0..num_experts-1`` and ``NO_ROUTE`` (-1): the trace file's."""
    for dt in (np.int8, np.int16, np.int32):
        if num_experts - 1 <= np.iinfo(dt).max:
            return np.dtype(dt)
    return np.dtype(np.int64)


def counts_dtype(max_count: int) -> np.dtype:
    """The smallest unsigned dtype holding ``max_count`` (the trace file's ``counts``)."""
    for dt in (np.uint8, np.uint16, np.uint32):
        if max_count <= np.iinfo(dt).max:
            return np.dtype(dt)
    return np.dtype(np.uint64)


def as_int_array(name: str, value: Any) -> np.ndarray:
    """``value`` (ndarray, tensor, nested lists) as an integer ndarray; else TraceError naming ``name``."""
    if hasattr(value, "detach") and hasattr(value, "cpu"):  # torch tensor, without importing torch
        value = value.detach().cpu().numpy()
    try:
        arr = np.asarray(value)
    except (ValueError, TypeError) as exc:  # ragged nested lists
        raise TraceError(f"{name} is not a rectangular integer array ({exc})") from None
    if arr.dtype.kind not in "iu":
        raise TraceError(f"{name} must hold integers, got dtype {arr.dtype}")
    return arr


def check_layer_ids(layer_ids: np.ndarray) -> None:
    """Raise TraceError unless the int ``[L]`` layer ids are distinct and fit int32 (>= 0)."""
    if layer_ids.size and (int(layer_ids.min()) < 0 or int(layer_ids.max()) > np.iinfo(np.int32).max):
        raise TraceError(f"layer_ids must lie in [0, {np.iinfo(np.int32).max}], got {layer_ids.tolist()}")
    if np.unique(layer_ids).size != layer_ids.size:
        raise TraceError(f"layer_ids must be distinct, got {layer_ids.tolist()}")


def check_offsets(offsets: np.ndarray) -> None:
    """TraceError unless ``offsets [N+1]`` (int64) rise from 0 with every sequence at most
    ``MAX_SEQUENCE_TOKENS`` and the batch at most ``MAX_BATCH_TOKENS`` tokens (checked before any
    difference is taken, so nothing overflows)."""
    big = np.flatnonzero((offsets < 0) | (offsets > MAX_BATCH_TOKENS))
    if len(big):
        i = int(big[0])
        raise TraceError(f"key 'offsets'[{i}] = {int(offsets[i])} is outside [0, {MAX_BATCH_TOKENS}] (a batch "
                         f"holds at most MAX_BATCH_TOKENS = 2^40 tokens)")
    if offsets[0] != 0:
        raise TraceError(f"key 'offsets'[0] = {int(offsets[0])}: offsets must rise from 0")
    steps = np.diff(offsets)
    bad = np.flatnonzero((steps < 0) | (steps > MAX_SEQUENCE_TOKENS))
    if len(bad):
        i = int(bad[0])
        raise TraceError(f"key 'offsets'[{i}:{i + 2}] = {offsets[i:i + 2].tolist()}: sample {i} has "
                         f"{int(steps[i])} tokens, outside [0, MAX_SEQUENCE_TOKENS = {MAX_SEQUENCE_TOKENS}]")


def _open_trace_file(path: Path) -> np.lib.npyio.NpzFile:
    try:
        data = np.load(path, allow_pickle=False)
    except FileNotFoundError:
        raise TraceError(f"{path}: no such trace file") from None
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as exc:
        raise TraceError(f"{path}: not a readable .npz trace file ({type(exc).__name__}: {exc})") from None
    if not isinstance(data, np.lib.npyio.NpzFile):
        raise TraceError(f"{path}: not an .npz archive (found a single .npy array)")
    return data


def _read_member(data: np.lib.npyio.NpzFile, key: str, path: Path) -> np.ndarray:
    """One array of an open trace file, read only after its header's dtype, shape and size are checked
    (:func:`relibra_moe.npzio.read_member`); a pickled, oversized, truncated or corrupt member raises
    TraceError naming the file and the member."""
    return read_member(data, key, path, TraceError)


def scalar_int(v: np.ndarray, key: str, path: Path | None = None) -> int:
    if v.ndim != 0 or v.dtype.kind not in "iu":
        at = f"{path}: " if path is not None else ""
        raise TraceError(f"{at}key {key!r} must be an integer scalar, got dtype {v.dtype} shape {v.shape}")
    return int(v)


def _string_scalar(v: np.ndarray, key: str) -> str:
    if v.dtype.kind not in "US" or v.ndim != 0:
        raise TraceError(f"key {key!r} must be a string scalar, got dtype {v.dtype}")
    return str(v)


class StoredIds:
    """The per-token ids of a version-2 trace file, read from it when a sequence is first asked for.

    Calling it with sample ``i`` returns the rows ``offsets[i]:offsets[i+1]`` of the file's
    ``experts`` ``[T, L, k]`` (read once, then kept); :meth:`TraceBatch.trace` checks them.
    """

    def __init__(self, path: Path, offsets: np.ndarray, num_layers: int, top_k: int) -> None:
        self._path, self._offsets, self._shape = path, offsets, (int(offsets[-1]), num_layers, top_k)
        self._ids: np.ndarray | None = None

    def __call__(self, i: int) -> np.ndarray:
        if self._ids is None:
            with _open_trace_file(self._path) as data:
                if "experts" not in data.files:
                    raise TraceError(f"{self._path}: field 'experts' is gone (the file changed after it was loaded)")
                ids = _read_member(data, "experts", self._path)
            if ids.dtype.kind not in "iu":
                raise TraceError(f"{self._path}: field 'experts' must hold integers, got dtype {ids.dtype}")
            if ids.shape != self._shape:
                raise TraceError(f"{self._path}: field 'experts' has shape {ids.shape}, the file's offsets, layers "
                                 f"and topk say [T, L, k] = {list(self._shape)}")
            self._ids = ids
        return self._ids[self._offsets[i]:self._offsets[i + 1]]


def read_starts_source_info(a: Any, n: int) -> tuple[np.ndarray, str, dict[str, np.ndarray]]:
    """The per-sample ``starts`` (int64 ``[n]``, token offsets >= 0), the ``source`` string and the ``info_*``
    arrays of a trace file (either version); TraceError naming the field when they are malformed."""
    starts = as_int_array("starts", a["starts"]).astype(np.int64)
    if starts.shape != (n,):
        raise TraceError(f"starts must have shape [{n}], got {starts.shape}")
    if n and int(starts.min()) < 0:
        raise TraceError(f"starts must be >= 0, got {int(starts.min())}")
    source = _string_scalar(a["source"], "source")
    info = {k[len(INFO_PREFIX):]: v for k, v in a.items() if k.startswith(INFO_PREFIX)}
    return starts, source, info




def write_trace_file(path: str | Path, *, num_experts: int, top_k: int, layer_ids: np.ndarray, lengths: np.ndarray,
                     starts: np.ndarray, micro_batch: np.ndarray | None, source: str, counts: np.ndarray,
                     experts: Iterator[np.ndarray] | None, info: dict[str, np.ndarray], compress: bool = False) -> None:
    """Write one batch's fields to ``path`` in the version-2 format (module docstring).

    Args:
        lengths: int ``[N]`` tokens per sequence; ``starts`` int ``[N]``; ``micro_batch`` int ``[N]`` or None.
        counts: int ``[N, L, E]`` per-sample expert counts (stored in the smallest unsigned dtype).
        experts: the sequences' ids ``[S_i, L, k]`` in order, or None for a counts-only file.
        info: per-sample metadata, each ``[N]`` (stored as ``info_<name>``).
    """
    n = int(lengths.shape[0])
    offsets = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    mb = micro_batch if micro_batch is not None else np.full(n, -1, np.int32)
    arrays: dict[str, np.ndarray] = dict(
        version=np.int64(FORMAT_VERSION), num_experts=np.int64(num_experts), topk=np.int64(top_k),
        layer_ids=np.asarray(layer_ids).astype(np.int32), offsets=offsets, starts=np.asarray(starts).astype(np.int64),
        micro_batch=mb.astype(np.int32), source=np.str_(source),
        counts=counts.astype(counts_dtype(int(counts.max()) if counts.size else 0)),
        counts_only=np.bool_(experts is None), no_route=np.int64(NO_ROUTE))
    for key, value in info.items():
        arrays[INFO_PREFIX + key] = value
    mode = zipfile.ZIP_DEFLATED if compress else zipfile.ZIP_STORED
    with atomic_write(path, "wb", error=TraceError) as f, \
            zipfile.ZipFile(f, mode="w", compression=mode, allowZip64=True) as zf:
        for key, value in arrays.items():  # what np.savez / np.savez_compressed write, member by member
            with zf.open(key + ".npy", "w", force_zip64=True) as member:
                np.lib.format.write_array(member, np.asanyarray(value), allow_pickle=True)
        if experts is not None:
            with zf.open("experts.npy", "w", force_zip64=True) as member:
                _stream_ids(member, experts, lengths, (len(layer_ids), top_k), file_ids_dtype(num_experts))


def _stream_ids(member: Any, experts: Iterator[np.ndarray], lengths: np.ndarray, row: tuple[int, int],
                dtype: np.dtype) -> None:
    """Write the ``experts`` member ``[T, L, k]`` (``.npy`` header, then each sequence's rows in turn, converted
    to ``dtype`` one sequence at a time: no ``[T, L, k]`` array is built). TraceError unless sequence i has shape
    ``[lengths[i], L, k]`` and there are exactly ``len(lengths)`` of them."""
    shape = (int(lengths.sum()), *row)
    np.lib.format.write_array_header_1_0(member, {"descr": np.lib.format.dtype_to_descr(np.dtype(dtype)),
                                                  "fortran_order": False, "shape": shape})
    n = 0
    for i, seq in enumerate(experts):
        if i >= lengths.shape[0] or tuple(seq.shape) != (int(lengths[i]), *row):
            want = f"[{int(lengths[i])}, {row[0]}, {row[1]}]" if i < lengths.shape[0] else "none (no such sequence)"
            raise TraceError(f"sequence {i}: ids of shape {list(seq.shape)}, the lengths say {want}")
        member.write(np.ascontiguousarray(seq, dtype=dtype).data)
        n = i + 1
    if n != lengths.shape[0]:
        raise TraceError(f"{n} sequences of ids for {int(lengths.shape[0])} lengths")


def read_trace_file(path: Path) -> tuple[int, dict[str, np.ndarray], tuple[tuple[int, ...], np.dtype] | None]:
    """``(version, arrays, experts_header)`` of a trace file: every member but a version-2 file's ``experts``
    (read later, by :class:`StoredIds`), whose declared ``(shape, dtype)`` is ``experts_header`` (None when
    absent or version 1).

    Raises:
        TraceError: missing file, not an ``.npz`` archive, truncated file, missing key, unknown version;
            the message names the path.
    """
    with _open_trace_file(path) as data:
        files = set(data.files)
        if "version" not in files:
            raise TraceError(f"{path}: missing key(s) ['version'] (not a relibra trace file, or a damaged one)")
        version = scalar_int(_read_member(data, "version", path), "version", path)
        if version not in READ_VERSIONS:
            raise TraceError(f"{path}: unknown trace format version {version} (this library reads versions "
                             f"{', '.join(str(v) for v in READ_VERSIONS)})")
        required = REQUIRED_KEYS_V1 if version == 1 else REQUIRED_KEYS_V2
        missing = [k for k in required if k not in files]
        if missing:
            raise TraceError(f"{path}: missing key(s) {missing} (not a relibra trace file, or a damaged one)")
        lazy = {"experts"} if version == 2 else set()
        arrays = {k: _read_member(data, k, path) for k in data.files if k not in lazy}
        experts_header = member_header(data, "experts", str(path), TraceError) if lazy & files else None
    return version, arrays, experts_header


@dataclass(frozen=True)
class V2Fields:
    """The checked fields of a version-2 file (N sequences, L layers, E experts)."""

    num_experts: int
    top_k: int
    layer_ids: np.ndarray  # int32 [L]
    lengths: np.ndarray  # int64 [N] tokens per sequence
    starts: np.ndarray  # int64 [N]
    counts: np.ndarray  # int64 [N, L, E], read-only
    micro_batch: np.ndarray  # int [N], checked by the batch
    source: str
    info: dict[str, np.ndarray]
    ids: StoredIds | None  # None for a counts-only file


def read_offsets(a: dict[str, np.ndarray]) -> np.ndarray:
    """The checked ``offsets`` ``[N+1]`` (int64) of a file of either version."""
    offsets = as_int_array("offsets", a["offsets"]).astype(np.int64)
    if offsets.ndim != 1 or offsets.size < 2:
        raise TraceError(f"empty batch: offsets must be [N+1] with N >= 1, got shape {offsets.shape}")
    check_offsets(offsets)
    return offsets


def _check_counts(counts: np.ndarray, lengths: np.ndarray, top_k: int) -> None:
    """TraceError at the first negative count, count above its sample's tokens, or layer summing above k x tokens."""
    if counts.size and int(counts.min()) < 0:
        i, l, e = (int(v) for v in np.unravel_index(int(np.argmin(counts)), counts.shape))
        raise TraceError(f"key 'counts'[{i}, {l}, {e}] = {int(counts[i, l, e])} is negative (sample {i}, "
                         f"layer {l}, expert {e})")
    over = counts > lengths[:, None, None]
    if over.any():
        i, l, e = np.argwhere(over)[0]
        raise TraceError(f"counts[{i}, {l}, {e}] = {int(counts[i, l, e])} > the {int(lengths[i])} tokens of "
                         f"sample {i} (a token picks an expert at most once)")
    sums = counts.sum(axis=2)
    high = sums > top_k * lengths[:, None]
    if high.any():
        i, l = np.argwhere(high)[0]
        raise TraceError(f"counts[{i}, {l}] sums to {int(sums[i, l])} > k x tokens = {top_k} x {int(lengths[i])}")


def _counts_only_flag(a: dict[str, np.ndarray], has_experts: bool) -> bool:
    flag = a["counts_only"]
    if flag.ndim != 0 or flag.dtype != bool:
        raise TraceError(f"key 'counts_only' must be a bool scalar, got dtype {flag.dtype} shape {flag.shape}")
    counts_only = bool(flag)
    if counts_only and has_experts:
        raise TraceError("counts_only=True, but the file holds field 'experts' (a file is one or the other)")
    if not counts_only and not has_experts:
        raise TraceError("field 'experts' is missing, and counts_only=False says the file holds ids")
    return counts_only


def read_v2_fields(a: dict[str, np.ndarray], path: Path,
                   experts_header: tuple[tuple[int, ...], np.dtype] | None) -> V2Fields:
    """The checked fields of a version-2 file from its arrays (all but ``experts``, whose declared
    ``(shape, dtype)`` is ``experts_header``, ``None`` when the file has no ids); TraceError naming the field."""
    num_experts = check_count("num_experts", scalar_int(a["num_experts"], "num_experts"), error=TraceError)
    top_k = check_count("topk", scalar_int(a["topk"], "topk"), error=TraceError)
    if top_k > num_experts:
        raise TraceError(f"top_k={top_k} exceeds num_experts={num_experts}")
    counts_only = _counts_only_flag(a, experts_header is not None)
    no_route = scalar_int(a["no_route"], "no_route")
    if no_route != NO_ROUTE:
        raise TraceError(f"no_route={no_route}: this library's 'no route' id is {NO_ROUTE}")
    offsets = read_offsets(a)
    n = offsets.size - 1
    lengths = np.diff(offsets)
    counts = as_int_array("counts", a["counts"])
    layer_ids = as_int_array("layer_ids", a["layer_ids"])
    if layer_ids.ndim != 1 or layer_ids.size == 0:
        raise TraceError(f"layer_ids must be [L] with L >= 1, got shape {layer_ids.shape}")
    check_layer_ids(layer_ids)
    if counts.shape != (n, layer_ids.size, num_experts):
        raise TraceError(f"counts must have shape [N={n}, L={layer_ids.size}, E={num_experts}], got "
                         f"{counts.shape}")
    counts = counts.astype(np.int64)
    _check_counts(counts, lengths, top_k)
    counts.setflags(write=False)
    if experts_header is not None:
        shape, dtype = experts_header
        want = (int(offsets[-1]), int(layer_ids.size), top_k)
        if dtype.kind not in "iu" or shape != want:
            raise TraceError(f"key 'experts' declares shape {list(shape)} of {dtype}; offsets, layer_ids and "
                             f"topk say integers of shape [T, L, k] = {list(want)}")
    starts, source, info = read_starts_source_info(a, n)
    ids = None if counts_only else StoredIds(path, offsets, layer_ids.size, top_k)
    return V2Fields(num_experts=num_experts, top_k=top_k, layer_ids=layer_ids.astype(np.int32), lengths=lengths,
                    starts=starts, counts=counts, micro_batch=a["micro_batch"], source=source, info=info, ids=ids)

