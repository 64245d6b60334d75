"""Adapters from SGLang, vLLM and Megatron routing outputs into RoutingTrace."""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest
import torch

from relibra_moe.adapters import from_megatron, from_sglang, from_vllm
from relibra_moe.errors import TraceError
from relibra_moe.trace import TraceBatch


def _ids(rng: np.random.Generator, s: int, layers: int, e: int, k: int) -> np.ndarray:
    return np.argsort(rng.random((s, layers, e)), axis=2)[:, :, :k].astype(np.int32)


def _b64(arr: np.ndarray) -> str:
    return base64.b64encode(np.ascontiguousarray(arr).tobytes()).decode()


# ------------------------------------------------------------------------------------------- SGLang
def test_sglang_int32_with_token_counts_and_start():
    rng = np.random.default_rng(0)
    prompt, completion, start = 5, 4, 2
    ids = _ids(rng, prompt + completion - 1 - start, 3, 16, 4)
    meta = {"routed_experts": _b64(ids), "prompt_tokens": prompt, "completion_tokens": completion,
            "routed_experts_start": start}
    tr = from_sglang(meta, num_moe_layers=3, num_experts=16)
    np.testing.assert_array_equal(tr.experts, ids)
    assert (tr.start, tr.top_k, tr.num_experts, tr.source) == (start, 4, 16, "sglang")
    np.testing.assert_array_equal(tr.layer_ids, [0, 1, 2])
    # k inferred from rows and layers; E inferred from the largest id
    assert from_sglang(meta, 3).num_experts == int(ids.max()) + 1


def test_sglang_drops_dense_layers_and_reads_narrow_dtypes():
    rng = np.random.default_rng(1)
    ids = _ids(rng, 6, 4, 32, 2)
    ids[:, 0] = -1  # dense layer 0: placeholder
    for dtype in ("uint8", "uint16"):
        raw = ids.astype(np.int64)
        raw[raw < 0] = np.iinfo(dtype).max
        meta = {"routed_experts": _b64(raw.astype(dtype)), "routed_experts_dtype": dtype}
        tr = from_sglang(meta, num_moe_layers=3, dense_layers=(0,), top_k=2, num_experts=32)
        np.testing.assert_array_equal(tr.experts, ids[:, 1:])
        np.testing.assert_array_equal(tr.layer_ids, [1, 2, 3])


@pytest.mark.parametrize("meta, kwargs, match", [
    ({}, {}, r"meta_info has no 'routed_experts'"),
    ({"routed_experts": "@@not base64@@"}, dict(num_moe_layers=1, top_k=1), r"not valid base64"),
    ({"routed_experts": _b64(np.zeros(3, np.int32)), "routed_experts_dtype": "float16"}, dict(num_moe_layers=1),
     r"routed_experts_dtype 'float16' not supported"),
    ({"routed_experts": _b64(np.zeros(7, np.int32))}, dict(num_moe_layers=2, top_k=2),
     r"holds 7 ids, which does not fit"),
    ({"routed_experts": _b64(np.zeros(4, np.int32))}, dict(num_moe_layers=2), r"needs two of"),
    ({"routed_experts": _b64(np.array([0, 1, 2, 2], np.int32))}, dict(num_moe_layers=1, top_k=2),
     r"row 1, layer 0: duplicate expert id 2"),
    ({"routed_experts": _b64(np.array([0, 1, 2, 9], np.int32))}, dict(num_moe_layers=1, top_k=2, num_experts=4),
     r"row 1, layer 0, slot 1: expert id 9 out of range"),
    ({"routed_experts": base64.b64encode(b"abc").decode()}, dict(num_moe_layers=1, top_k=1),
     r"holds 3 bytes, not a multiple of int32"),
    ({"routed_experts": _b64(np.zeros(4, np.int32))}, dict(num_moe_layers=1, top_k=2, dense_layers=(5,)),
     r"dense_layers \[5\] out of range"),
    ({"routed_experts": _b64(np.zeros(4, np.int32))}, dict(num_moe_layers=1, top_k=2, dense_layers=(0.5,)),
     r"dense_layers must hold decoder layer indices \(ints\), got 0.5"),
    ({"routed_experts": _b64(np.array([0, 1, -3, 2], np.int32))}, dict(num_moe_layers=1, top_k=2, num_experts=4),
     r"row 1, layer 0, slot 0: expert id -3 out of range"),
    ({"routed_experts": _b64(np.zeros(4, np.int32)), "prompt_tokens": "3", "completion_tokens": 2},
     dict(num_moe_layers=1), r"meta_info\['prompt_tokens'\] must be an int >= 0, got '3'"),
    ({"routed_experts": _b64(np.zeros(4, np.int32)), "prompt_tokens": 1, "completion_tokens": 1,
      "routed_experts_start": 2}, dict(num_moe_layers=1),
     r"prompt_tokens \+ completion_tokens - 1 - routed_experts_start = 1 \+ 1 - 1 - 2 = -1 < 0"),
    ({"routed_experts": _b64(np.zeros(2, np.int32)), "routed_experts_start": True}, dict(num_moe_layers=1, top_k=1),
     r"meta_info\['routed_experts_start'\] must be an int >= 0, got True"),
    ({"routed_experts": _b64(np.arange(8, dtype=np.int32)), "prompt_tokens": 2, "completion_tokens": 2},
     dict(num_moe_layers=1, top_k=2), r"holds 8 ids, which does not fit rows=3, layers=1, k=2"),
])
def test_sglang_errors(meta, kwargs, match):
    with pytest.raises(TraceError, match=match):
        from_sglang(meta, **kwargs)


# --------------------------------------------------------------------------------------------- vLLM
def test_vllm_formats_agree():
    rng = np.random.default_rng(2)
    ids = _ids(rng, 7, 2, 8, 2)
    buf = io.BytesIO()
    np.save(buf, ids)
    b64 = base64.b64encode(buf.getvalue())
    for form in (ids, ids.tolist(), b64, b64.decode(), torch.from_numpy(ids)):
        tr = from_vllm(form, prompt_start=11, num_experts=8)
        np.testing.assert_array_equal(tr.experts, ids)
        assert (tr.start, tr.num_experts, tr.top_k) == (11, 8, 2)
    batch = TraceBatch([from_vllm(ids, num_experts=8), from_vllm(ids[:3], 2, num_experts=8)])
    assert batch.num_tokens == 10


@pytest.mark.parametrize("value, match", [
    ([[[0, 1]], [[2]]], r"ragged"),
    (np.zeros((3, 2), np.int32), r"rank 3"),
    (np.zeros((3, 1, 2), np.float64), r"must hold integers, got dtype float64"),
    (base64.b64encode(b"not npy"), r"not a .npy array"),
    (np.array([[[1, 1]]]), r"row 0, layer 0: duplicate expert id 1"),
    (np.array([[[0, 1]], [[-5, 1]]]), r"row 1, layer 0, slot 0: expert id -5 out of range"),
])
def test_vllm_errors(value, match):
    with pytest.raises(TraceError, match=match):
        from_vllm(value)


# ----------------------------------------------------------------------------------------- Megatron
def test_megatron_array_and_per_layer_list():
    rng = np.random.default_rng(3)
    ids = _ids(rng, 9, 3, 16, 4)
    a = from_megatron(torch.from_numpy(ids), num_experts=16)
    b = from_megatron([torch.from_numpy(ids[:, l]) for l in range(3)], num_experts=16)
    np.testing.assert_array_equal(a.experts, ids)
    np.testing.assert_array_equal(b.experts, ids)
    assert a.source == "megatron"


def test_megatron_errors():
    with pytest.raises(TraceError, match=r"per-layer arrays differ in shape"):
        from_megatron([np.zeros((3, 2), np.int64), np.zeros((4, 2), np.int64)])
    with pytest.raises(TraceError, match=r"expert id 16 out of range"):
        from_megatron(np.full((2, 1, 1), 16), num_experts=16)
    with pytest.raises(TraceError, match=r"row 1, layer 0, slot 0: expert id -2 out of range"):
        from_megatron(np.array([[[0]], [[-2]]]), num_experts=4)
    with pytest.raises(TraceError, match=r"routing_indices is an empty list"):
        from_megatron([])
    with pytest.raises(TraceError, match=r"routing_indices must have rank 3 \[T, L, k\], got shape \(1, 3\)"):
        from_megatron([np.zeros(3, np.int64)])


def test_sglang_narrow_dtype_and_large_ids():
    """uint16 ids above int16's range stay exact (no wrap), and only the all-ones value means no route."""
    ids = np.array([[[40000, 65534]], [[65535, 1]]], np.int64)  # 65535 = no route
    meta = {"routed_experts": _b64(ids.astype(np.uint16)), "routed_experts_dtype": "uint16"}
    tr = from_sglang(meta, num_moe_layers=1, top_k=2, num_experts=65535)
    assert tr.experts.dtype == np.int32
    np.testing.assert_array_equal(tr.experts, [[[40000, 65534]], [[-1, 1]]])


def test_inferred_num_experts_must_agree_across_sequences():
    a, b = from_vllm(np.array([[[0, 5]]])), from_vllm(np.array([[[0, 7]]]))
    assert (a.num_experts, b.num_experts) == (6, 8)
    with pytest.raises(TraceError, match=r"sample 1: num_experts=8, sample 0 has 6 .*unless num_experts= is passed"):
        TraceBatch([a, b])
    assert TraceBatch([from_vllm(np.array([[[0, 5]]]), num_experts=8), b]).num_experts == 8
