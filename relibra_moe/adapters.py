"""Adapters: routing recorded by inference engines and RL frameworks, as RoutingTrace / TraceBatch.

Engines (one sequence each, :class:`~relibra_moe.trace.RoutingTrace`):

- :func:`from_sglang`: SGLang ``meta_info["routed_experts"]`` (base64, ``--enable-return-routed-experts``);
  slime reads the same payload (see docs/rl-frameworks.md, "slime").
- :func:`from_vllm`: vLLM ``routed_experts`` of one request ``[S, L, k]``.
- :func:`from_megatron`: Megatron-core router-replay indices ``[T, L, k]`` or per-layer ``[T, k]``.

RL frameworks (a padded batch each, :class:`~relibra_moe.trace.TraceBatch`):

- :func:`from_verl`: verl router replay (R2 / R3) ``[batch, max_seq_len, num_layers, topk]`` with its
  ``attention_mask [batch, max_seq_len]``.
- :func:`from_nemo_rl`: NeMo-RL ``routed_experts [B, S, L, k]`` right-padded to ``input_lengths [B]``.
- :func:`from_vllm_rollout`: the batched vLLM pair ``prompt_routed_experts [B, P, L, k]`` (int16) and
  ``routed_experts [B, R, L, k]`` that NeMo-RL and SkyRL rollouts carry, with their padding masks.
- :func:`from_padded`: the common core: any ``[B, S, L, k]`` array with a token mask.

Padding is never an expert: rows at padded positions are dropped without being read (whatever
value the framework filled them with, 0 included), and a real token whose route was not recorded
(``route_mask`` 0, or ``-1`` in the array) becomes a "no route" row (``-1``), served by no expert.
Bad input (wrong rank, a layer count that does not match the model, an id out of range, a mask of
the wrong shape) raises TraceError naming the argument and the value.
"""

from __future__ import annotations

import base64
import binascii
import io
from collections.abc import Sequence
from typing import Any

import numpy as np

from .errors import TraceError
from .trace import RoutingTrace, TraceBatch, as_int_array, check_ids, ids_dtype, nonnegative_int, positive_int
from .validate import is_int

__all__ = ["from_sglang", "from_vllm", "from_megatron", "from_padded", "from_verl", "from_nemo_rl",
           "from_vllm_rollout"]


_SGLANG_DTYPES = {"int32": np.int32, "int16": np.int16, "uint8": np.uint8, "uint16": np.uint16}


def _b64(payload: str | bytes, what: str) -> bytes:
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError, TypeError) as exc:
        raise TraceError(f"{what} is not valid base64 ({exc})") from None


def _infer_num_experts(experts: np.ndarray, top_k: int, num_experts: int | None) -> int:
    if num_experts is not None:
        return positive_int("num_experts", num_experts)
    hi = int(experts.max()) + 1 if experts.size else 0
    return max(hi, top_k)


def _sglang_ids(meta_info: dict) -> np.ndarray:
    """int64 flat ids of ``meta_info["routed_experts"]`` (base64 of ``routed_experts_dtype``, or an array), the
    unsigned all-ones value as -1 (``from_sglang``)."""
    payload = meta_info["routed_experts"]
    dtype_name = str(meta_info.get("routed_experts_dtype", "int32"))
    if dtype_name not in _SGLANG_DTYPES:
        raise TraceError(f"routed_experts_dtype {dtype_name!r} not supported (known: {sorted(_SGLANG_DTYPES)})")
    dtype = np.dtype(_SGLANG_DTYPES[dtype_name])
    if isinstance(payload, (str, bytes)):
        raw = _b64(payload, "meta_info['routed_experts']")
        if len(raw) % dtype.itemsize:
            raise TraceError(f"routed_experts holds {len(raw)} bytes, not a multiple of {dtype_name}'s "
                             f"{dtype.itemsize}")
        flat = np.frombuffer(raw, dtype=dtype)
    else:
        flat = as_int_array("routed_experts", payload).ravel()
        dtype = flat.dtype
    ids = flat.astype(np.int64)
    if dtype.kind == "u":
        ids[flat == np.iinfo(dtype).max] = -1
    return ids


def from_sglang(meta_info: dict, num_moe_layers: int | None = None, dense_layers: Sequence[int] = (), *,
                top_k: int | None = None, num_experts: int | None = None, source: str = "sglang") -> RoutingTrace:
    """A RoutingTrace from an SGLang response's ``meta_info`` (``--enable-return-routed-experts``).

    ``meta_info["routed_experts"]`` is the base64 of a flat array (int32, or the dtype named by
    ``meta_info["routed_experts_dtype"]``: uint8 / uint16 / int16) ordered by token, decoder layer and
    top-k slot, logical shape ``[S - 1 - start, layers, k]`` where ``layers`` counts every decoder
    layer (dense ones hold placeholders) and ``start = meta_info.get("routed_experts_start", 0)``.
    S is ``prompt_tokens + completion_tokens`` when meta_info has them. For unsigned dtypes the
    all-ones value (255 / 65535) means no route (-1). An already-decoded array is accepted too.

    Args:
        meta_info: the response's meta_info dict.
        num_moe_layers: MoE layers; with ``dense_layers`` it gives the decoder layer count.
        dense_layers: global indices of dense decoder layers: dropped from the trace.
        top_k: k (needed when the token count or the layer count is not known).
        num_experts: E (default: largest id + 1; pass it when batching traces).
        source: free text for the trace.

    The two unknowns among rows, layers and k are solved from the array length; a length that fits no
    solution raises TraceError.
    """
    if not isinstance(meta_info, dict):
        raise TraceError(f"meta_info must be a dict, got {type(meta_info).__name__}")
    if "routed_experts" not in meta_info or meta_info["routed_experts"] is None:
        raise TraceError("meta_info has no 'routed_experts' (launch SGLang with --enable-return-routed-experts "
                         "and send return_routed_experts=True)")
    ids = _sglang_ids(meta_info)
    start = nonnegative_int("meta_info['routed_experts_start']", meta_info.get("routed_experts_start", 0))
    for d in dense_layers:
        if not is_int(d):
            raise TraceError(f"dense_layers must hold decoder layer indices (ints), got {d!r}")
    dense = sorted({int(d) for d in dense_layers})
    rows = None
    if "prompt_tokens" in meta_info and "completion_tokens" in meta_info:
        prompt = nonnegative_int("meta_info['prompt_tokens']", meta_info["prompt_tokens"])
        completion = nonnegative_int("meta_info['completion_tokens']", meta_info["completion_tokens"])
        rows = prompt + completion - 1 - start
        if rows < 0:
            raise TraceError(f"prompt_tokens + completion_tokens - 1 - routed_experts_start = {prompt} + {completion} "
                             f"- 1 - {start} = {rows} < 0")
    layers = None if num_moe_layers is None else positive_int("num_moe_layers", num_moe_layers) + len(dense)
    k = None if top_k is None else positive_int("top_k", top_k)
    size = ids.size
    known = [v for v in (rows, layers, k) if v is not None]
    if len(known) < 2:
        raise TraceError("from_sglang needs two of: the token count (meta_info prompt_tokens + completion_tokens), "
                         "num_moe_layers, top_k")
    prod = int(np.prod(known))
    if prod == 0 or size % prod:
        raise TraceError(f"routed_experts holds {size} ids, which does not fit rows={rows}, layers={layers}, k={k}")
    missing = size // prod
    rows = missing if rows is None else rows
    layers = missing if layers is None else layers
    k = missing if k is None else k
    if rows * layers * k != size:
        raise TraceError(f"routed_experts holds {size} ids, expected rows x layers x k = {rows} x {layers} x {k}")
    if dense and (dense[0] < 0 or dense[-1] >= layers):
        raise TraceError(f"dense_layers {dense} out of range for {layers} decoder layers")
    keep = np.array([i for i in range(layers) if i not in set(dense)], dtype=np.int32)
    if keep.size == 0:
        raise TraceError(f"dense_layers {dense} leaves no MoE layer of {layers}")
    experts = ids.reshape(rows, layers, k)[:, keep]
    return RoutingTrace(experts, keep, _infer_num_experts(experts, k, num_experts), k, start=int(start),
                        source=source)


def from_vllm(routed_experts: Any, prompt_start: int = 0, *, num_experts: int | None = None,
              layer_ids: Any = None, source: str = "vllm") -> RoutingTrace:
    """A RoutingTrace from vLLM's ``routed_experts`` output.

    Args:
        routed_experts: ``[S, L, k]`` ids as an ndarray / tensor, nested lists, or the base64 text of a
            ``.npy`` file (str or bytes).
        prompt_start: absolute token position of row 0.
        num_experts: E (default: largest id + 1; pass it when batching traces).
        layer_ids: ``[L]`` global layer indices (default ``0..L-1``).
        source: free text for the trace.
    """
    arr = routed_experts
    if isinstance(arr, (str, bytes)):
        raw = _b64(arr, "routed_experts")
        try:
            arr = np.load(io.BytesIO(raw), allow_pickle=False)
        except (ValueError, OSError, EOFError) as exc:
            raise TraceError(f"routed_experts base64 payload is not a .npy array ({exc})") from None
    elif isinstance(arr, (list, tuple)):
        try:
            arr = np.array(arr)
        except ValueError as exc:
            raise TraceError(f"routed_experts nested lists are ragged ({exc})") from None
    return _trace_from_ids(arr, "routed_experts", "[S, L, k]", num_experts, layer_ids, prompt_start, source)


def _trace_from_ids(value: Any, name: str, layout: str, num_experts: int | None, layer_ids: Any, start: int,
                    source: str) -> RoutingTrace:
    """A RoutingTrace from ids ``[S, L, k]`` (``name``/``layout`` for the error messages); E inferred if None."""
    arr = as_int_array(name, value)
    if arr.ndim != 3:
        raise TraceError(f"{name} must have rank 3 {layout}, got shape {arr.shape}")
    if layer_ids is None:
        layer_ids = np.arange(arr.shape[1], dtype=np.int32)
    return RoutingTrace(arr, layer_ids, _infer_num_experts(arr, arr.shape[2], num_experts), arr.shape[2],
                        start=start, source=source)


def from_megatron(routing_indices: Any, *, num_experts: int | None = None, layer_ids: Any = None, start: int = 0,
                  source: str = "megatron") -> RoutingTrace:
    """A RoutingTrace from Megatron-core router-replay indices.

    Args:
        routing_indices: ``[T, L, k]`` ndarray / tensor / nested lists, or a list of L per-layer
            ``[T, k]`` arrays or tensors (what ``RouterReplay`` records per layer). A list is read as
            per-layer when its first element is an array or tensor of rank 2; plain nested lists are
            always read as ``[T, L, k]``.
        num_experts, layer_ids, start, source: as for :func:`from_vllm`.
    """
    arr = routing_indices
    if isinstance(arr, (list, tuple)) and not arr:
        raise TraceError("routing_indices is an empty list (expected [T, L, k] ids or L per-layer [T, k] arrays)")
    if isinstance(arr, (list, tuple)) and hasattr(arr[0], "shape") and len(arr[0].shape) == 2:
        parts = [as_int_array(f"routing_indices[{i}]", p) for i, p in enumerate(arr)]
        shapes = {p.shape for p in parts}
        if len(shapes) != 1:
            raise TraceError(f"routing_indices: per-layer arrays differ in shape: {sorted(shapes)}")
        arr = np.stack(parts, axis=1)
    return _trace_from_ids(arr, "routing_indices", "[T, L, k]", num_experts, layer_ids, start, source)


# ---------------------------------------------------------------------------------- RL frameworks
def _to_numpy(name: str, value: Any) -> np.ndarray:
    if hasattr(value, "detach") and hasattr(value, "cpu"):  # torch tensor, without importing torch
        value = value.detach().cpu().numpy()
    return np.asarray(value)


def _mask(name: str, value: Any, shape: tuple[int, int]) -> np.ndarray:
    """A mask ``[B, S]`` of 0/1 (bool, integer or float) as bool; anything else raises TraceError naming ``name``."""
    m = _to_numpy(name, value)
    if m.shape != shape:
        raise TraceError(f"{name} must have shape [B={shape[0]}, S={shape[1]}] (that of the routing's first two "
                         f"dimensions), got {m.shape}")
    if m.dtype != bool:
        if m.dtype.kind not in "iuf":
            raise TraceError(f"{name} must hold 0/1 or bool, got dtype {m.dtype}")
        bad = (m != 0) & (m != 1)
        if bad.any():
            b, s = np.argwhere(bad)[0]
            raise TraceError(f"{name}[{b}, {s}] = {m[b, s].item()}: a mask holds 0 or 1")
        m = m.astype(bool)
    return m


def _lengths_mask(name: str, lengths: Any, batch: int, seq: int) -> np.ndarray:
    """Right-padding mask ``[B, S]`` from ``lengths [B]`` (each in ``[0, S]``)."""
    n = as_int_array(name, _to_numpy(name, lengths))
    if n.shape != (batch,):
        raise TraceError(f"{name} must have shape [B={batch}], got {n.shape}")
    bad = (n < 0) | (n > seq)
    if bad.any():
        b = int(np.flatnonzero(bad)[0])
        raise TraceError(f"{name}[{b}] = {int(n[b])} out of range [0, {seq}] (the routing's padded length)")
    return np.arange(seq)[None, :] < n[:, None]


def _padded_ids(name: str, value: Any, num_moe_layers: int | None) -> np.ndarray:
    arr = as_int_array(name, _to_numpy(name, value))
    if arr.ndim != 4:
        raise TraceError(f"{name} must have rank 4 [batch, seq, layers, top_k], got rank {arr.ndim} with shape "
                         f"{arr.shape}")
    if num_moe_layers is not None and arr.shape[2] != positive_int("num_moe_layers", num_moe_layers):
        raise TraceError(f"layer count mismatch: {name} has {arr.shape[2]} layers (shape {arr.shape}), the model has "
                         f"num_moe_layers={num_moe_layers}")
    if arr.shape[0] == 0:
        raise TraceError(f"empty batch: {name} has shape {arr.shape}")
    return arr


def _batch_of(rows: list[np.ndarray], layer_ids: Any, num_experts: int, top_k: int, starts: np.ndarray,
              micro_batch: Any, source: str, sample_info: dict[str, Any] | None) -> TraceBatch:
    num_layers = rows[0].shape[1]
    if layer_ids is None:
        layer_ids = np.arange(num_layers, dtype=np.int32)
    traces = [RoutingTrace(r, layer_ids, num_experts, top_k, start=int(s), source=source)
              for r, s in zip(rows, starts, strict=True)]
    return TraceBatch(traces, micro_batch, source=source, sample_info=sample_info)


def from_padded(routed_experts: Any, token_mask: Any, *, num_experts: int, route_mask: Any = None,
                num_moe_layers: int | None = None, layer_ids: Any = None, starts: Any = None,
                micro_batch: Any = None, source: str = "", sample_info: dict[str, Any] | None = None,
                name: str = "routed_experts") -> TraceBatch:
    """A TraceBatch from a padded routing array and a mask of its real tokens.

    Args:
        routed_experts: int ``[B, S, L, top_k]`` (ndarray or tensor): expert ids of token position s
            of sample b at MoE layer l. Values at padded positions are never read.
        token_mask: 0/1 or bool ``[B, S]``: 1 at the real tokens of each sample (left, right or mixed
            padding). Sample b's trace holds the rows where the mask is 1, in order.
        num_experts: E (required: a padded array's largest id says nothing reliable about E).
        route_mask: optional 0/1 ``[B, S]``, 1 where a real token's route was recorded (default: every
            real token). A real token with 0 here becomes a no-route row (``-1``); a 1 at a padded
            position raises.
        num_moe_layers: the model's MoE layer count, checked against L when given.
        layer_ids: ``[L]`` global decoder-layer indices (default ``0..L-1``).
        starts: int ``[B]``: absolute token position of each sample's row 0 (default 0).
        micro_batch, source, sample_info: as for :class:`~relibra_moe.trace.TraceBatch`.
        name: the array's name in error messages.

    Raises:
        TraceError: wrong rank or shapes, L != num_moe_layers, an id out of ``[0, E)`` (or ``< -1``) at a
            real token, a duplicate id in a row, a route at a padded position.
    """
    arr = _padded_ids(name, routed_experts, num_moe_layers)
    batch, seq, _, top_k = arr.shape
    num_experts = positive_int("num_experts", num_experts)
    if top_k > num_experts:
        raise TraceError(f"{name} has top_k={top_k} ids per row (shape {arr.shape}), more than num_experts="
                         f"{num_experts}")
    tokens = _mask("token_mask", token_mask, (batch, seq))
    routed = tokens if route_mask is None else _mask("route_mask", route_mask, (batch, seq))
    stray = routed & ~tokens
    if stray.any():
        b, s = np.argwhere(stray)[0]
        raise TraceError(f"route_mask[{b}, {s}] = 1 at a padded position (token_mask[{b}, {s}] = 0)")
    if starts is None:
        starts = np.zeros(batch, dtype=np.int64)
    starts = as_int_array("starts", _to_numpy("starts", starts)).astype(np.int64)
    if starts.shape != (batch,):
        raise TraceError(f"starts must have shape [B={batch}], got {starts.shape}")
    dtype = ids_dtype(num_experts)
    rows = []
    for b in range(batch):
        real = np.flatnonzero(tokens[b])
        ids = arr[b, real].astype(np.int64)  # a copy, wide enough that no value wraps before the check
        ids[~routed[b, real]] = -1  # recorded nowhere: no route, never expert 0
        check_ids(ids, num_experts, lambda t, b=b, real=real: f"{name}[{b}, {int(real[t])}]")
        rows.append(ids.astype(dtype))
    return _batch_of(rows, layer_ids, num_experts, top_k, starts, micro_batch, source, sample_info)


def from_verl(routed_experts: Any, attention_mask: Any, *, num_experts: int, num_moe_layers: int | None = None,
              route_mask: Any = None, layer_ids: Any = None, micro_batch: Any = None,
              source: str = "verl router replay") -> TraceBatch:
    """A TraceBatch from verl's router-replay tensor (R2: recorded by the training forward; R3: by the rollout).

    Args:
        routed_experts: int ``[batch, max_seq_len, num_layers, topk]``: ``batch.batch["routed_experts"]``
            of verl's DataProto, one row per (sample, position) of ``input_ids``.
        attention_mask: ``[batch, max_seq_len]``: verl's attention mask (left-padded prompt then
            right-padded response); only its 1 positions become trace rows.
        num_experts, num_moe_layers, route_mask, layer_ids, micro_batch, source: as for :func:`from_padded`.
    """
    return from_padded(routed_experts, attention_mask, num_experts=num_experts, route_mask=route_mask,
                       num_moe_layers=num_moe_layers, layer_ids=layer_ids, micro_batch=micro_batch, source=source)


def from_nemo_rl(routed_experts: Any, input_lengths: Any, *, num_experts: int, num_moe_layers: int | None = None,
                 layer_ids: Any = None, micro_batch: Any = None, source: str = "nemo-rl router replay") -> TraceBatch:
    """A TraceBatch from NeMo-RL's ``routed_experts [B, S, L, k]`` right-padded to ``input_lengths [B]``.

    NeMo-RL carries vLLM's routes through its data path padded to the longest sequence; the padded
    tail (zeros there) is dropped here, whatever it holds. Other arguments as for :func:`from_padded`.
    """
    arr = _padded_ids("routed_experts", routed_experts, num_moe_layers)
    mask = _lengths_mask("input_lengths", input_lengths, arr.shape[0], arr.shape[1])
    return from_padded(arr, mask, num_experts=num_experts, num_moe_layers=num_moe_layers, layer_ids=layer_ids,
                       micro_batch=micro_batch, source=source)


def from_vllm_rollout(routed_experts: Any, prompt_routed_experts: Any = None, *, num_experts: int,
                      response_mask: Any = None, prompt_mask: Any = None, prompt_lengths: Any = None,
                      num_moe_layers: int | None = None, layer_ids: Any = None, micro_batch: Any = None,
                      source: str = "vllm rollout") -> TraceBatch:
    """A TraceBatch from the batched vLLM routing of a rollout (NeMo-RL, SkyRL).

    vLLM (``--enable-return-routed-experts``) returns ``prompt_routed_experts`` ``[prompt_len, L, k]``
    (int16) per request and ``routed_experts`` ``[gen_len, L, k]`` per completion; a rollout batch
    stacks them padded to ``[B, P, L, k]`` and ``[B, R, L, k]``. Sample b's trace is its prompt rows
    followed by its response rows (``start`` 0), or the response rows alone (``start`` =
    ``prompt_lengths[b]``, default 0) when ``prompt_routed_experts`` is None.

    Args:
        routed_experts: int ``[B, R, L, k]``: routes of the generated tokens.
        prompt_routed_experts: optional int ``[B, P, L, k]``: routes of the prompt tokens.
        num_experts: E.
        response_mask: 0/1 ``[B, R]`` of the real generated tokens (default: all real).
        prompt_mask: 0/1 ``[B, P]`` of the real prompt tokens (left or right padding; default: all real).
        prompt_lengths: int ``[B]``, only without ``prompt_routed_experts``: each trace's start.
        num_moe_layers, layer_ids, micro_batch, source: as for :func:`from_padded`.

    A ``-1`` at a real token (a route vLLM did not record) stays "no route".
    """
    resp = _padded_ids("routed_experts", routed_experts, num_moe_layers)
    batch, r_len, num_layers, top_k = resp.shape
    r_mask = np.ones((batch, r_len), bool) if response_mask is None else _mask("response_mask", response_mask,
                                                                               (batch, r_len))
    if prompt_routed_experts is None:
        if prompt_mask is not None:
            raise TraceError("prompt_mask given without prompt_routed_experts")
        starts = None if prompt_lengths is None else as_int_array("prompt_lengths", _to_numpy("prompt_lengths",
                                                                                              prompt_lengths))
        if starts is not None and starts.size and int(starts.min()) < 0:
            raise TraceError(f"prompt_lengths must be >= 0, got {starts.tolist()}")
        return from_padded(resp, r_mask, num_experts=num_experts, num_moe_layers=num_moe_layers, layer_ids=layer_ids,
                           starts=starts, micro_batch=micro_batch, source=source)
    if prompt_lengths is not None:
        raise TraceError("prompt_lengths is for response-only routing; with prompt_routed_experts the prompt rows "
                         "are in the trace (use prompt_mask for their padding)")
    prompt = _padded_ids("prompt_routed_experts", prompt_routed_experts, num_moe_layers)
    if prompt.shape[0] != batch or prompt.shape[2:] != (num_layers, top_k):
        raise TraceError(f"prompt_routed_experts has shape {prompt.shape}, routed_experts {resp.shape}: batch, layers "
                         "and top_k must agree")
    p_mask = np.ones(prompt.shape[:2], bool) if prompt_mask is None else _mask("prompt_mask", prompt_mask,
                                                                               prompt.shape[:2])
    # one [B, P + R] array: check each part under its own name first, then join without a second check
    num_experts = positive_int("num_experts", num_experts)
    for nm, part, m in (("prompt_routed_experts", prompt, p_mask), ("routed_experts", resp, r_mask)):
        for b in range(batch):
            real = np.flatnonzero(m[b])
            check_ids(part[b, real], num_experts, lambda t, nm=nm, b=b, real=real: f"{nm}[{b}, {int(real[t])}]")
    dt = np.promote_types(prompt.dtype, resp.dtype)
    joined = np.concatenate([prompt.astype(dt, copy=False), resp.astype(dt, copy=False)], axis=1)
    return from_padded(joined, np.concatenate([p_mask, r_mask], axis=1), num_experts=num_experts,
                       num_moe_layers=num_moe_layers, layer_ids=layer_ids, micro_batch=micro_batch, source=source)
