"""Routing dumps as the RL frameworks and engines write them to disk, read into a TraceBatch.

One reader per format (``relibra trace import FORMAT FILE ...``; the on-disk layouts are documented in
docs/rl-frameworks.md, "Your own dump on the command line"). Each reader opens the file(s), finds the
framework's fields and hands them to the matching adapter of :mod:`relibra_moe.adapters`, so the padding
rules and checks are the adapters' own. Every error is a TraceError that names the file and the field.

==========  ======================================================================================
format      file (one or more; a batch of several files is their samples in file order)
==========  ======================================================================================
verl        ``DataProto.save_to_disk`` (a pickle whose batch holds ``routed_experts [B, S, L, k]`` and
            ``attention_mask [B, S]``), or ``torch.save`` of that batch as a dict of tensors
slime       ``--save-debug-rollout-data``: ``torch.save(dict(rollout_id, samples=[Sample.to_dict()]))``;
            each sample's ``rollout_routed_experts [len(tokens) - 1, num_layers, k]`` (every decoder layer)
nemo-rl     ``torch.save`` of the policy data dict: ``routed_experts [B, S, L, k]``, ``input_lengths [B]``
vllm        ``torch.save`` / ``.npz`` of a rollout (SkyRL or your own): ``routed_experts [B, R, L, k]``, optional
            ``prompt_routed_experts [B, P, L, k]``, ``response_mask``, ``prompt_mask``, ``prompt_lengths``;
            or a list of per-request dicts with ``routed_experts [R, L, k]`` (+ ``prompt_routed_experts``)
sglang      JSON or JSONL of ``/generate`` responses (each with ``meta_info``, or a bare meta_info)
megatron    ``torch.save(RouterReplay.get_recorded_data())``: a list of L per-layer ``[T, k]`` tensors,
            one sequence (or packed micro-batch) per file; or one ``[T, L, k]`` tensor
npz         ``np.savez(file, ids=[N, L, k], offsets=[B + 1])``: sequence b is rows
            ``offsets[b]:offsets[b+1]``; optional ``num_experts``, ``layer_ids [L]``, ``micro_batch [B]``
==========  ======================================================================================

Pickle-based files (``torch.save`` zips, verl's DataProto pickle) are read without running code from them
(:mod:`relibra_moe.safe_pickle`: tensors, numpy arrays, containers and the named framework records only, every
declared size bounded before it is allocated); ``trust_pickle=True`` (``--trust-pickle``) reads a file whose
pickle names other classes with their own code: only for dumps you wrote yourself. ``.npz`` / ``.npy`` files
go through the checked reader of :mod:`relibra_moe.npzio`; JSON nested deeper than Python follows is refused.
"""

from __future__ import annotations

import io
import json
import math
import zipfile
import zlib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from numpy.lib import format as npformat

from .adapters import from_megatron, from_nemo_rl, from_sglang, from_verl, from_vllm, from_vllm_rollout
from .errors import TraceError
from .npzio import MAX_MEMBER_BYTES, read_member
from .safe_pickle import PickledObject, load_torch, stub_class
from .trace import RoutingTrace, TraceBatch, as_int_array
from .trace_files import scalar_int
from .validate import check_count, check_int, is_int

__all__ = ["FORMATS", "read_dump"]

FORMATS = ("verl", "slime", "nemo-rl", "vllm", "sglang", "megatron", "npz")


#: Framework classes a dump may pickle, read as records (:class:`~relibra_moe.safe_pickle.PickledObject`)
#: without importing the framework: verl's DataProto, the TensorDict of its batch, NeMo-RL's BatchedDataDict.
STUBS: dict[str, type[PickledObject]] = {name: stub_class(name) for name in (
    "verl.protocol.DataProto", "tensordict._td.TensorDict", "tensordict.tensordict.TensorDict",
    "nemo_rl.distributed.batched_data_dict.BatchedDataDict")}

#: Largest JSON / JSONL dump read, bytes (the npz member limit).
MAX_JSON_BYTES = MAX_MEMBER_BYTES


def _torch_load(path: Path, trust: bool, data: bytes | None = None) -> Any:
    return load_torch(path if data is None else data, str(path), stubs=STUBS, trust=trust)


def _unwrap(obj: Any) -> Any:
    """A TensorDict record as the dict of its tensors, a BatchedDataDict (a UserDict) as its dict."""
    if isinstance(obj, PickledObject) and isinstance(obj.state, Mapping):
        for key in ("_tensordict", "data"):
            if isinstance(obj.state.get(key), Mapping):
                return obj.state[key]
    return obj


def _mapping(path: Path, obj: Any, what: str) -> Mapping[str, Any]:
    obj = _unwrap(obj)
    if hasattr(obj, "to_dict") and not isinstance(obj, Mapping):  # TensorDict (trusted load)
        obj = obj.to_dict()
    if not isinstance(obj, Mapping):
        raise TraceError(f"{path}: expected {what} (a dict of arrays), got {type(obj).__name__}")
    return obj


def _field(path: Path, data: Mapping[str, Any], key: str, where: str = "") -> Any:
    if key not in data or data[key] is None:
        have = sorted(str(k) for k in data)
        raise TraceError(f"{path}: field {where}{key!r} is missing (fields: {have})")
    return data[key]


def _relabel(path: Path, fn: Any, *args: Any, where: str = "", **kwargs: Any) -> Any:
    """Call an adapter; its TraceError gets the file name (and ``where`` in it) in front."""
    try:
        return fn(*args, **kwargs)
    except TraceError as exc:
        raise TraceError(f"{path}: {where}{exc}") from None


def _need_experts(num_experts: int | None, fmt: str) -> int:
    if num_experts is None:
        raise TraceError(f"format {fmt!r} needs the expert count: pass --num-experts E (or --model / --model-config)")
    return num_experts


# ------------------------------------------------------------------------------------------ readers
_TORCH_DTYPES = ("int64", "int32", "int16", "int8", "uint8", "uint16", "uint32", "uint64", "bool")


def _verl_numpy_tensor(path: Path, key: str, enc: Any) -> np.ndarray:
    """One field of a batch serialized with ``VERL_DATAPROTO_SERIALIZATION_METHOD=numpy``: verl's
    ``serialize_single_tensor`` triple ``(dtype name, shape, uint8 bytes)``, checked and viewed (no copy)."""
    at = f"{path}: field {key!r} (VERL_DATAPROTO_SERIALIZATION_METHOD=numpy)"
    if isinstance(enc, tuple) and len(enc) == 2:
        raise TraceError(f"{at} is a nested tensor (layout {enc[0]!r}); routing fields must be dense [B, S, ...]")
    if not (isinstance(enc, tuple) and len(enc) == 3):
        raise TraceError(f"{at} must be verl's (dtype, shape, bytes) triple, got {type(enc).__name__}")
    dtype, shape, data = enc
    if dtype not in _TORCH_DTYPES:
        raise TraceError(f"{at} has dtype {dtype!r}; routing fields hold integers or bools "
                         f"({', '.join(_TORCH_DTYPES)})")
    dt = np.dtype(dtype)
    shape = tuple(shape) if isinstance(shape, (tuple, list)) else shape
    if not isinstance(shape, tuple) or not all(is_int(d) and d >= 0 for d in shape):
        raise TraceError(f"{at} has shape {shape!r}, not a tuple of ints >= 0")
    want = math.prod(shape) * dt.itemsize
    if not isinstance(data, np.ndarray) or data.dtype != np.uint8 or data.ndim != 1 or data.size != want:
        got = f"{data.dtype} {list(data.shape)}" if isinstance(data, np.ndarray) else type(data).__name__
        raise TraceError(f"{at} declares shape {list(shape)} of {dtype} = {want} bytes, its data is {got}")
    return data.view(dt).reshape(shape)


def _verl_batch(path: Path, state: Any, trust: bool) -> Mapping[str, Any]:
    """The batch of a DataProto pickle's state ``(batch, non_tensor_batch, meta_info)``: the ``torch.save``
    bytes of its TensorDict (verl's default; an ``io.BytesIO`` in older verl) or the numpy-method triple."""
    if not (isinstance(state, tuple) and len(state) == 3):
        raise TraceError(f"{path}: a verl DataProto pickle with an unknown state layout ({type(state).__name__})")
    buf = state[0]
    if isinstance(buf, io.BytesIO):
        buf = buf.getvalue()
    if isinstance(buf, (bytes, bytearray)):
        return _mapping(path, _torch_load(path, trust, bytes(buf)), "the DataProto's batch")
    if isinstance(buf, tuple) and len(buf) == 3 and isinstance(buf[2], Mapping):  # the numpy method
        items = buf[2]
        return {k: _verl_numpy_tensor(path, k, items[k]) for k in ("routed_experts", "attention_mask") if k in items}
    raise TraceError(f"{path}: the DataProto's batch is a {type(buf).__name__}: neither torch.save bytes (verl's "
                     "default) nor VERL_DATAPROTO_SERIALIZATION_METHOD=numpy's (batch_size, device, items)")


def _verl(path: Path, num_experts: int | None, layer_ids: Any, trust: bool) -> TraceBatch:
    obj = _torch_load(path, trust)
    if isinstance(obj, PickledObject) and obj.pickled_name == "verl.protocol.DataProto":
        data = _verl_batch(path, obj.state, trust)
    else:
        data = _mapping(path, obj, "verl's batch")
    return _relabel(path, from_verl, _field(path, data, "routed_experts"), _field(path, data, "attention_mask"),
                    num_experts=_need_experts(num_experts, "verl"), layer_ids=layer_ids, source=f"verl {path.name}")


def _slime_start(path: Path, i: int, s: Mapping[str, Any], rows: int, fed: int) -> int:
    """Rows of sample ``i`` missing at the front: SGLang's ``routed_experts_start_len`` (slime decodes
    ``len(tokens) - 1 - start_len`` rows when a request sets it), read from the sample if it carries it, else
    ``len(tokens) - 1 - rows``."""
    where = f"{path}: samples[{i}]['rollout_routed_experts']"
    if rows > fed:
        raise TraceError(f"{where} has {rows} rows, more than len(tokens) - 1 = {fed}")
    start = fed - rows
    if s.get("routed_experts_start_len") is not None:
        given = check_int(f"{path}: samples[{i}]['routed_experts_start_len']", s["routed_experts_start_len"],
                          0, fed, error=TraceError)
        if given != start:
            raise TraceError(f"{where} has {rows} rows; len(tokens) - 1 - routed_experts_start_len = {fed} - "
                             f"{given} = {fed - given}")
    return start


def _slime(path: Path, num_experts: int | None, dense_layers: Sequence[int], layer_ids: Any,
           trust: bool) -> list[RoutingTrace]:
    data = _mapping(path, _torch_load(path, trust), "slime's rollout dump")
    samples = _field(path, data, "samples")
    if not isinstance(samples, (list, tuple)) or not samples:
        raise TraceError(f"{path}: field 'samples' must be a non-empty list of Sample.to_dict(), got "
                         f"{type(samples).__name__}")
    out = []
    for i, s in enumerate(samples):
        s = _mapping(path, s, f"samples[{i}] (a Sample.to_dict())")
        ids = as_int_array(f"samples[{i}]['rollout_routed_experts']",
                           _field(path, s, "rollout_routed_experts", f"samples[{i}]"))
        tokens = _field(path, s, "tokens", f"samples[{i}]")
        if not hasattr(tokens, "__len__"):
            raise TraceError(f"{path}: samples[{i}]['tokens'] must be a list of token ids, got {type(tokens).__name__}")
        if ids.ndim != 3:
            raise TraceError(f"{path}: samples[{i}]['rollout_routed_experts'] must have rank 3 "
                             f"[len(tokens) - 1, num_layers, k], got shape {ids.shape}")
        start = _slime_start(path, i, s, ids.shape[0], len(tokens) - 1)
        dense = sorted({int(d) for d in dense_layers})
        if dense and (dense[0] < 0 or dense[-1] >= ids.shape[1]):
            raise TraceError(f"{path}: --dense-layers {dense} out of range for the {ids.shape[1]} decoder layers of "
                             f"samples[{i}]['rollout_routed_experts']")
        keep = np.array([j for j in range(ids.shape[1]) if j not in set(dense)], dtype=np.int32)
        E = _need_experts(num_experts, "slime")
        out.append(_relabel(path, RoutingTrace, ids[:, keep], keep if layer_ids is None else layer_ids, E,
                            ids.shape[2], start, f"slime {path.name}",
                            where=f"samples[{i}]['rollout_routed_experts']: "))
    return out


def _nemo_rl(path: Path, num_experts: int | None, layer_ids: Any, trust: bool) -> TraceBatch:
    data = _mapping(path, _torch_load(path, trust), "NeMo-RL's data dict")
    return _relabel(path, from_nemo_rl, _field(path, data, "routed_experts"), _field(path, data, "input_lengths"),
                    num_experts=_need_experts(num_experts, "nemo-rl"), layer_ids=layer_ids,
                    source=f"nemo-rl {path.name}")


def _read_npy(path: Path) -> np.ndarray:
    """A single ``.npy`` file, its header checked as :mod:`relibra_moe.npzio` checks a member's."""
    try:
        with open(path, "rb") as fp:
            version = npformat.read_magic(fp)
            read = npformat.read_array_header_1_0 if version == (1, 0) else npformat.read_array_header_2_0
            shape, _, dtype = read(fp)
            offset = fp.tell()
    except (ValueError, OSError, EOFError) as exc:
        raise TraceError(f"{path}: not a readable .npy file ({type(exc).__name__}: {exc})") from None
    declared = math.prod(shape) * dtype.itemsize
    if dtype.hasobject or declared > MAX_MEMBER_BYTES or declared != path.stat().st_size - offset:
        raise TraceError(f"{path}: the .npy header declares shape {list(shape)} of {dtype} = {declared} bytes; the "
                         f"file stores {path.stat().st_size - offset} bytes after it (object arrays and arrays over "
                         f"{MAX_MEMBER_BYTES} bytes are not read)")
    return np.load(path, allow_pickle=False)


def _read_npz(path: Path) -> dict[str, np.ndarray]:
    """Every member of an ``.npz`` file through :func:`relibra_moe.npzio.read_member` (pickled, oversized,
    truncated or short members are TraceErrors naming the file and the member)."""
    try:
        data = np.load(path, allow_pickle=False)
    except (OSError, ValueError, EOFError, zipfile.BadZipFile, zlib.error) as exc:
        raise TraceError(f"{path}: not a readable .npz file ({type(exc).__name__}: {exc})") from None
    if not isinstance(data, np.lib.npyio.NpzFile):
        raise TraceError(f"{path}: not an .npz archive (a single .npy array)")
    with data:
        return {k: read_member(data, k, path, TraceError) for k in data.files}


def _load_any(path: Path, trust: bool) -> Any:
    """``.npz`` / ``.npy`` through the checked numpy readers (no pickle), anything else as a ``torch.save`` file."""
    if path.suffix == ".npz":
        return _read_npz(path)
    if path.suffix == ".npy":
        return _read_npy(path)
    return _torch_load(path, trust)


def _vllm(path: Path, num_experts: int | None, layer_ids: Any, trust: bool) -> TraceBatch | list[RoutingTrace]:
    obj = _load_any(path, trust)
    E = _need_experts(num_experts, "vllm")
    if isinstance(obj, (list, tuple)):  # per-request outputs: each trace is its prompt rows, then its response rows
        if not obj:
            raise TraceError(f"{path}: an empty list of requests")
        traces = []
        for i, r in enumerate(obj):
            r = _mapping(path, r, f"request {i}")
            parts = [as_int_array(f"[{i}]['{k}']", r[k]) for k in ("prompt_routed_experts", "routed_experts")
                     if r.get(k) is not None]
            _field(path, r, "routed_experts", f"[{i}]")
            if len(parts) == 2 and (parts[0].ndim != 3 or parts[0].shape[1:] != parts[1].shape[1:]):
                raise TraceError(f"{path}: field [{i}]['prompt_routed_experts'] has shape {parts[0].shape}, "
                                 f"[{i}]['routed_experts'] {parts[1].shape}: layers and k must agree")
            ids = parts[-1] if len(parts) == 1 else np.concatenate(parts)
            traces.append(_relabel(path, from_vllm, ids, num_experts=E, layer_ids=layer_ids,
                                   source=f"vllm {path.name}", where=f"request {i}: "))
        return traces
    data = _mapping(path, obj, "a vLLM rollout")
    opt = {k: data[k] for k in ("response_mask", "prompt_mask", "prompt_lengths") if data.get(k) is not None}
    return _relabel(path, from_vllm_rollout, _field(path, data, "routed_experts"), data.get("prompt_routed_experts"),
                    num_experts=E, layer_ids=layer_ids, source=f"vllm {path.name}", **opt)


def _json_items(path: Path) -> list[Any]:
    """The responses of a JSON (one object or a list) or JSONL file; TraceError for an oversized, undecodable or
    too deeply nested file."""
    size = path.stat().st_size
    if size > MAX_JSON_BYTES:
        raise TraceError(f"{path}: {size} bytes, over the limit of {MAX_JSON_BYTES} bytes; not read")
    try:
        text = path.read_text()
    except (UnicodeDecodeError, OSError) as exc:
        raise TraceError(f"{path}: not a UTF-8 text file ({exc})") from None
    try:
        items = json.loads(text)
        return items if isinstance(items, list) else [items]
    except json.JSONDecodeError:
        pass
    except RecursionError:
        raise TraceError(f"{path}: the JSON nests deeper than Python follows (a hostile file)") from None
    items = []
    for n, line in enumerate(text.splitlines(), start=1):
        if line.strip():
            try:
                items.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise TraceError(f"{path}: line {n} is not JSON ({exc.msg})") from None
            except RecursionError:
                raise TraceError(f"{path}: line {n} nests deeper than Python follows (a hostile file)") from None
    return items


def _sglang(path: Path, num_experts: int | None, top_k: int | None, num_layers: int | None,
            dense_layers: Sequence[int]) -> list[RoutingTrace]:
    items = _json_items(path)
    if not items:
        raise TraceError(f"{path}: no SGLang response in the file")
    out = []
    moe_layers = None if num_layers is None else num_layers - len(set(dense_layers))
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise TraceError(f"{path}: response {i} is a JSON {type(item).__name__}, not an object")
        meta = item.get("meta_info", item)
        if not isinstance(meta, dict):
            raise TraceError(f"{path}: response {i}: field 'meta_info' is a {type(meta).__name__}, not an object")
        try:
            out.append(from_sglang(meta, moe_layers, dense_layers, top_k=top_k, num_experts=num_experts,
                                   source=f"sglang {path.name}"))
        except TraceError as exc:
            raise TraceError(f"{path}: response {i}: {exc}") from None
    return out


def _megatron(path: Path, num_experts: int | None, layer_ids: Any, trust: bool) -> RoutingTrace:
    obj = _load_any(path, trust)
    if isinstance(obj, Mapping):
        raise TraceError(f"{path}: expected RouterReplay.get_recorded_data() (a list of per-layer [T, k] tensors) or "
                         f"one [T, L, k] tensor, got a dict with fields {sorted(map(str, obj))}")
    return _relabel(path, from_megatron, list(obj) if isinstance(obj, tuple) else obj,
                    num_experts=_need_experts(num_experts, "megatron"), layer_ids=layer_ids,
                    source=f"megatron {path.name}")


def _npz_num_experts(path: Path, data: Mapping[str, np.ndarray], num_experts: int | None) -> int | None:
    """The file's ``num_experts`` (an integer scalar >= 1) agreeing with ``num_experts``, or ``num_experts``."""
    if "num_experts" not in data:
        return num_experts
    file_e = check_count(f"{path}: field 'num_experts'", scalar_int(data["num_experts"], "num_experts", path),
                         error=TraceError)
    if num_experts is not None and num_experts != file_e:
        raise TraceError(f"{path}: field 'num_experts' = {file_e}, the model has num_experts={num_experts}")
    return file_e


def _npz(path: Path, num_experts: int | None, layer_ids: Any) -> TraceBatch:
    if path.suffix == ".npy":
        raise TraceError(f"{path}: format 'npz' reads an .npz archive (ids + offsets), not a single .npy array")
    data = _read_npz(path)
    ids = as_int_array("ids", _field(path, data, "ids"))
    offsets = as_int_array("offsets", _field(path, data, "offsets")).astype(np.int64)
    if ids.ndim != 3:
        raise TraceError(f"{path}: field 'ids' must have rank 3 [rows, L, k], got shape {ids.shape}")
    if offsets.ndim != 1 or offsets.size < 2 or offsets[0] != 0 or offsets[-1] != ids.shape[0] \
            or (np.diff(offsets) < 0).any():
        raise TraceError(f"{path}: field 'offsets' must be [B + 1] non-decreasing from 0 to the {ids.shape[0]} rows "
                         f"of 'ids', got {offsets.tolist()[:8]}{' ...' if offsets.size > 8 else ''}")
    E = _need_experts(_npz_num_experts(path, data, num_experts), "npz")
    if layer_ids is None and "layer_ids" in data:
        layer_ids = as_int_array("layer_ids", data["layer_ids"])
    if layer_ids is None:
        layer_ids = np.arange(ids.shape[1], dtype=np.int32)
    traces = [_relabel(path, RoutingTrace, ids[a:b], layer_ids, E, ids.shape[2], 0, f"npz {path.name}")
              for a, b in zip(offsets[:-1], offsets[1:], strict=True)]
    mb = data.get("micro_batch")
    return _relabel(path, TraceBatch, traces, None if mb is None else as_int_array("micro_batch", mb),
                    source=f"npz {path.name}")


def _read_one(fmt: str, p: Path, num_experts: int | None, top_k: int | None, num_layers: int | None,
              dense_layers: Sequence[int], layer_ids: Any,
              trust: bool) -> TraceBatch | list[RoutingTrace] | RoutingTrace:
    """The routing of one dump file ``p`` in format ``fmt``."""
    if fmt == "verl":
        return _verl(p, num_experts, layer_ids, trust)
    if fmt == "slime":
        return _slime(p, num_experts, dense_layers, layer_ids, trust)
    if fmt == "nemo-rl":
        return _nemo_rl(p, num_experts, layer_ids, trust)
    if fmt == "vllm":
        return _vllm(p, num_experts, layer_ids, trust)
    if fmt == "sglang":
        return _sglang(p, num_experts, top_k, num_layers, dense_layers)
    if fmt == "megatron":
        return _megatron(p, num_experts, layer_ids, trust)
    return _npz(p, num_experts, layer_ids)


def read_dump(fmt: str, paths: Sequence[str | Path], *, num_experts: int | None = None, top_k: int | None = None,
              num_layers: int | None = None, dense_layers: Sequence[int] = (), layer_ids: Any = None,
              trust_pickle: bool = False) -> TraceBatch:
    """The routing of the dump file(s) ``paths`` in format ``fmt`` (one of :data:`FORMATS`) as one TraceBatch.

    Args:
        num_experts: E (required by the padded formats; the npz file may carry it).
        top_k: k (SGLang without ``num_layers``).
        num_layers: decoder layers the SGLang payload covers (dense ones included).
        dense_layers: decoder indices of dense layers in an SGLang / slime dump (dropped).
        layer_ids: ``[L]`` decoder indices of the MoE layers (default: from the dump, else ``0..L-1``).
        trust_pickle: read pickles that name classes outside the allow-list with their own code (the CLI's
            ``--trust-pickle``; only for dumps you wrote yourself).

    Several files: their samples, in file order, form one batch (micro-batch assignments of the files are
    not kept). Raises TraceError naming the file and the field.
    """
    if fmt not in FORMATS:
        raise TraceError(f"unknown dump format {fmt!r}; known: {', '.join(FORMATS)}")
    if not paths:
        raise TraceError(f"format {fmt!r} needs at least one dump file")
    traces: list[RoutingTrace] = []
    batches: list[TraceBatch] = []
    for p in map(Path, paths):
        if not p.is_file():
            raise TraceError(f"{p}: no such file")
        try:
            got = _read_one(fmt, p, num_experts, top_k, num_layers, dense_layers, layer_ids, trust_pickle)
        except TraceError as exc:  # every message starts with the file
            msg = str(exc)
            raise TraceError(msg if msg.startswith(f"{p}:") else f"{p}: {msg}") from None
        except (ValueError, TypeError, KeyError, IndexError, AttributeError, OverflowError, OSError) as exc:
            # a field of an unexpected type or shape the readers did not foresee: still named, never raw
            raise TraceError(f"{p}: not a readable {fmt} dump ({type(exc).__name__}: {str(exc)[:300]})") from None
        except (MemoryError, RecursionError) as exc:
            raise TraceError(f"{p}: reading it as a {fmt} dump failed ({type(exc).__name__}): a damaged or "
                             "hostile file") from None
        if isinstance(got, TraceBatch):
            batches.append(got)
        else:
            traces += got if isinstance(got, list) else [got]
    if len(batches) == 1 and not traces:
        return batches[0]
    traces += [t for b in batches for t in b.traces]
    if fmt == "sglang" and num_experts is None:  # E inferred per response: batch them at the largest
        e = max(t.num_experts for t in traces)
        traces = [t if t.num_experts == e else RoutingTrace(t.experts, t.layer_ids, e, t.top_k, t.start, t.source)
                  for t in traces]
    return TraceBatch(traces, source=f"{fmt} import of {len(paths)} file(s)")
