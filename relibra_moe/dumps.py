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

Pickle-based files (``torch.load(..., weights_only=False)``, the DataProto pickle) run Python code while
loading: import only dumps you wrote.
"""

from __future__ import annotations

import io
import json
import pickle
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from .adapters import from_megatron, from_nemo_rl, from_sglang, from_verl, from_vllm, from_vllm_rollout
from .errors import TraceError
from .trace import RoutingTrace, TraceBatch, as_int_array

__all__ = ["FORMATS", "read_dump"]

FORMATS = ("verl", "slime", "nemo-rl", "vllm", "sglang", "megatron", "npz")


class _PickledDataProto:
    """What a verl ``DataProto`` pickle unpickles to without verl: its state ``(batch bytes, non_tensor_batch,
    meta_info)``, the batch being the ``torch.save`` bytes of its TensorDict."""

    def __setstate__(self, state: Any) -> None:
        self.state = state


class _DataProtoUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if module.startswith("verl.") and name == "DataProto":
            return _PickledDataProto
        return super().find_class(module, name)


def _torch_load(path: Path, data: bytes | None = None) -> Any:
    import torch

    try:
        return torch.load(io.BytesIO(data) if data is not None else path, map_location="cpu", weights_only=False)
    except ModuleNotFoundError as exc:
        raise TraceError(f"{path}: reading it needs the module {exc.name!r} (the file pickles one of its classes); "
                         "install it, or save the fields as plain tensors / dicts") from None
    except (pickle.UnpicklingError, RuntimeError, EOFError, OSError, ValueError) as exc:
        raise TraceError(f"{path}: not a torch.save file ({type(exc).__name__}: {exc})") from None


def _mapping(path: Path, obj: Any, what: str) -> Mapping[str, Any]:
    if hasattr(obj, "to_dict") and not isinstance(obj, Mapping):  # TensorDict
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
def _verl(path: Path, num_experts: int | None, layer_ids: Any) -> TraceBatch:
    raw = path.read_bytes()
    obj: Any
    try:
        obj = _DataProtoUnpickler(io.BytesIO(raw)).load()
    except Exception:  # noqa: BLE001 - not a plain pickle: a torch.save zip file
        obj = None
    if isinstance(obj, _PickledDataProto):
        state = obj.state
        if not (isinstance(state, tuple) and len(state) == 3):
            raise TraceError(f"{path}: a verl DataProto pickle with an unknown state layout ({type(state).__name__})")
        buf = state[0]
        batch = _torch_load(path, buf.getvalue() if hasattr(buf, "getvalue") else bytes(buf))
        data = _mapping(path, batch, "the DataProto's batch")
    else:
        data = _mapping(path, _torch_load(path) if obj is None else obj, "verl's batch")
    return _relabel(path, from_verl, _field(path, data, "routed_experts"), _field(path, data, "attention_mask"),
                    num_experts=_need_experts(num_experts, "verl"), layer_ids=layer_ids, source=f"verl {path.name}")


def _slime(path: Path, num_experts: int | None, dense_layers: Sequence[int], layer_ids: Any) -> list[RoutingTrace]:
    data = _mapping(path, _torch_load(path), "slime's rollout dump")
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
        if ids.ndim != 3:
            raise TraceError(f"{path}: samples[{i}]['rollout_routed_experts'] must have rank 3 "
                             f"[len(tokens) - 1, num_layers, k], got shape {ids.shape}")
        if ids.shape[0] != len(tokens) - 1:
            raise TraceError(f"{path}: samples[{i}]['rollout_routed_experts'] has {ids.shape[0]} rows, "
                             f"len(tokens) - 1 = {len(tokens) - 1}")
        dense = sorted({int(d) for d in dense_layers})
        if dense and (dense[0] < 0 or dense[-1] >= ids.shape[1]):
            raise TraceError(f"{path}: --dense-layers {dense} out of range for the {ids.shape[1]} decoder layers of "
                             f"samples[{i}]['rollout_routed_experts']")
        keep = np.array([j for j in range(ids.shape[1]) if j not in set(dense)], dtype=np.int32)
        E = _need_experts(num_experts, "slime")
        out.append(_relabel(path, RoutingTrace, ids[:, keep], keep if layer_ids is None else layer_ids, E,
                            ids.shape[2], 0, f"slime {path.name}",
                            where=f"samples[{i}]['rollout_routed_experts']: "))
    return out


def _nemo_rl(path: Path, num_experts: int | None, layer_ids: Any) -> TraceBatch:
    data = _mapping(path, _torch_load(path), "NeMo-RL's data dict")
    return _relabel(path, from_nemo_rl, _field(path, data, "routed_experts"), _field(path, data, "input_lengths"),
                    num_experts=_need_experts(num_experts, "nemo-rl"), layer_ids=layer_ids,
                    source=f"nemo-rl {path.name}")


def _load_any(path: Path) -> Any:
    """``.npz`` / ``.npy`` with numpy (no pickle), anything else with ``torch.load``."""
    if path.suffix in (".npz", ".npy"):
        try:
            data = np.load(path, allow_pickle=False)
        except (OSError, ValueError) as exc:
            raise TraceError(f"{path}: not a readable {path.suffix} file ({exc})") from None
        return dict(data) if isinstance(data, np.lib.npyio.NpzFile) else data
    return _torch_load(path)


def _vllm(path: Path, num_experts: int | None, layer_ids: Any) -> TraceBatch | list[RoutingTrace]:
    obj = _load_any(path)
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


def _sglang(path: Path, num_experts: int | None, top_k: int | None, num_layers: int | None,
            dense_layers: Sequence[int]) -> list[RoutingTrace]:
    text = path.read_text()
    try:
        items = json.loads(text)
        items = items if isinstance(items, list) else [items]
    except json.JSONDecodeError:
        items = []
        for n, line in enumerate(text.splitlines(), start=1):
            if line.strip():
                try:
                    items.append(json.loads(line))
                except json.JSONDecodeError as exc:
                    raise TraceError(f"{path}: line {n} is not JSON ({exc.msg})") from None
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


def _megatron(path: Path, num_experts: int | None, layer_ids: Any) -> RoutingTrace:
    obj = _load_any(path)
    if isinstance(obj, Mapping):
        raise TraceError(f"{path}: expected RouterReplay.get_recorded_data() (a list of per-layer [T, k] tensors) or "
                         f"one [T, L, k] tensor, got a dict with fields {sorted(map(str, obj))}")
    return _relabel(path, from_megatron, list(obj) if isinstance(obj, tuple) else obj,
                    num_experts=_need_experts(num_experts, "megatron"), layer_ids=layer_ids,
                    source=f"megatron {path.name}")


def _npz(path: Path, num_experts: int | None, layer_ids: Any) -> TraceBatch:
    data = _load_any(path)
    if not isinstance(data, dict):
        raise TraceError(f"{path}: expected an .npz with fields 'ids' and 'offsets'")
    ids = as_int_array("ids", _field(path, data, "ids"))
    offsets = as_int_array("offsets", _field(path, data, "offsets")).astype(np.int64)
    if ids.ndim != 3:
        raise TraceError(f"{path}: field 'ids' must have rank 3 [rows, L, k], got shape {ids.shape}")
    if offsets.ndim != 1 or offsets.size < 2 or offsets[0] != 0 or offsets[-1] != ids.shape[0] \
            or (np.diff(offsets) < 0).any():
        raise TraceError(f"{path}: field 'offsets' must be [B + 1] non-decreasing from 0 to the {ids.shape[0]} rows "
                         f"of 'ids', got {offsets.tolist()[:8]}{' ...' if offsets.size > 8 else ''}")
    if "num_experts" in data:
        file_e = int(np.asarray(data["num_experts"]))
        if num_experts is not None and num_experts != file_e:
            raise TraceError(f"{path}: field 'num_experts' = {file_e}, the model has num_experts={num_experts}")
        num_experts = file_e
    E = _need_experts(num_experts, "npz")
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
              dense_layers: Sequence[int], layer_ids: Any) -> TraceBatch | list[RoutingTrace] | RoutingTrace:
    """The routing of one dump file ``p`` in format ``fmt``."""
    if fmt == "verl":
        return _verl(p, num_experts, layer_ids)
    if fmt == "slime":
        return _slime(p, num_experts, dense_layers, layer_ids)
    if fmt == "nemo-rl":
        return _nemo_rl(p, num_experts, layer_ids)
    if fmt == "vllm":
        return _vllm(p, num_experts, layer_ids)
    if fmt == "sglang":
        return _sglang(p, num_experts, top_k, num_layers, dense_layers)
    if fmt == "megatron":
        return _megatron(p, num_experts, layer_ids)
    return _npz(p, num_experts, layer_ids)


def read_dump(fmt: str, paths: Sequence[str | Path], *, num_experts: int | None = None, top_k: int | None = None,
              num_layers: int | None = None, dense_layers: Sequence[int] = (), layer_ids: Any = None) -> TraceBatch:
    """The routing of the dump file(s) ``paths`` in format ``fmt`` (one of :data:`FORMATS`) as one TraceBatch.

    Args:
        num_experts: E (required by the padded formats; the npz file may carry it).
        top_k: k (SGLang without ``num_layers``).
        num_layers: decoder layers the SGLang payload covers (dense ones included).
        dense_layers: decoder indices of dense layers in an SGLang / slime dump (dropped).
        layer_ids: ``[L]`` decoder indices of the MoE layers (default: from the dump, else ``0..L-1``).

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
            got = _read_one(fmt, p, num_experts, top_k, num_layers, dense_layers, layer_ids)
        except TraceError as exc:  # every message starts with the file
            msg = str(exc)
            raise TraceError(msg if msg.startswith(f"{p}:") else f"{p}: {msg}") from None
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
