"""Adapters from SGLang, vLLM and Megatron routing outputs into RoutingTrace.

RL-framework routing formats (verl, slime, NeMo-RL, SkyRL) into TraceBatch, on hand-built inputs.
"""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest
import torch

from relibra_moe.adapters import (
    from_megatron,
    from_nemo_rl,
    from_padded,
    from_sglang,
    from_verl,
    from_vllm,
    from_vllm_rollout,
)
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


E, L, K = 8, 3, 2


def distinct_rows(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    """int32 ``[..., K]`` ids, each row K distinct experts of E."""
    flat = np.stack([rng.permutation(E)[:K] for _ in range(int(np.prod(shape)))])
    return flat.reshape(*shape, K).astype(np.int32)


def loop_counts(rows: list[list[list[int]]]) -> np.ndarray:
    """int64 ``[L, E]`` counts of one sample's rows ``[S][L][K]`` by a plain loop (-1 skipped)."""
    out = np.zeros((L, E), dtype=np.int64)
    for row in rows:
        for l in range(L):
            for e in row[l]:
                if e >= 0:
                    out[l, e] += 1
    return out


def test_verl_mask_selects_real_tokens_and_pads_are_never_expert_0():
    rng = np.random.default_rng(0)
    ids = distinct_rows(rng, (2, 6, L))
    # verl: left-padded prompt, right-padded response, in one row
    mask = np.array([[0, 0, 1, 1, 1, 0],
                     [1, 1, 1, 1, 1, 1]], dtype=np.int64)
    ids[0, [0, 1, 5]] = 0  # what a framework leaves at padding: zeros, i.e. "expert 0" twice per row
    batch = from_verl(torch.from_numpy(ids), torch.from_numpy(mask), num_experts=E, num_moe_layers=L)
    assert batch.lengths.tolist() == [3, 6]
    np.testing.assert_array_equal(batch.trace(0).experts, ids[0, 2:5])
    np.testing.assert_array_equal(batch.trace(1).experts, ids[1])
    counts = batch.sample_expert_counts()
    np.testing.assert_array_equal(counts[0], loop_counts(ids[0, 2:5].tolist()))
    np.testing.assert_array_equal(counts[1], loop_counts(ids[1].tolist()))
    assert batch.source == "verl router replay"


def test_missing_route_of_a_real_token_becomes_no_route():
    rng = np.random.default_rng(1)
    ids = distinct_rows(rng, (1, 4, L))
    ids[0, 3] = 0  # the last token's route was never recorded; the array holds zeros there
    mask = np.ones((1, 4), dtype=bool)
    route = np.array([[1, 1, 1, 0]])
    batch = from_padded(ids, mask, route_mask=route, num_experts=E)
    tr = batch.trace(0)
    assert tr.num_tokens == 4  # the token is kept (no token lost) ...
    assert (tr.experts[3] == -1).all()  # ... with no route, never expert 0
    np.testing.assert_array_equal(tr.experts[:3], ids[0, :3])
    np.testing.assert_array_equal(batch.sample_expert_counts()[0], loop_counts(ids[0, :3].tolist()))


def test_nemo_rl_right_padding_from_input_lengths():
    # the layout of NeMo-RL's routed_experts: [B, S, L, k] right-padded with zeros to the longest input
    ids = np.zeros((2, 4, 2, 2), dtype=np.int32)
    ids[0, :2] = [[[0, 1], [2, 3]], [[4, 5], [6, 7]]]
    ids[1, :3] = [[[12, 13], [14, 15]], [[16, 17], [18, 19]], [[20, 21], [22, 23]]]
    batch = from_nemo_rl(ids, torch.tensor([2, 3]), num_experts=24, num_moe_layers=2)
    assert batch.lengths.tolist() == [2, 3]
    np.testing.assert_array_equal(batch.trace(0).experts, ids[0, :2])
    np.testing.assert_array_equal(batch.trace(1).experts, ids[1, :3])
    counts = batch.sample_expert_counts()
    assert int(counts[:, :, 0].sum()) == 1  # only the real (sample 0, token 0) route of expert 0
    assert int(counts.sum()) == (2 + 3) * 2 * 2


def test_vllm_rollout_prompt_and_response_rows_in_order():
    rng = np.random.default_rng(2)
    prompt = distinct_rows(rng, (2, 3, L)).astype(np.int16)   # vLLM returns int16
    resp = distinct_rows(rng, (2, 4, L)).astype(np.int16)
    p_mask = np.array([[0, 1, 1], [1, 1, 1]])                  # left-padded prompts
    r_mask = np.array([[1, 1, 1, 1], [1, 1, 0, 0]])            # right-padded responses
    prompt[0, 0] = 0
    resp[1, 2:] = -1
    batch = from_vllm_rollout(resp, prompt, num_experts=E, prompt_mask=p_mask, response_mask=r_mask,
                              num_moe_layers=L)
    np.testing.assert_array_equal(batch.trace(0).experts, np.concatenate([prompt[0, 1:], resp[0]]))
    np.testing.assert_array_equal(batch.trace(1).experts, np.concatenate([prompt[1], resp[1, :2]]))
    assert batch.starts.tolist() == [0, 0]
    only = from_vllm_rollout(resp, num_experts=E, response_mask=r_mask, prompt_lengths=[2, 3])
    assert only.starts.tolist() == [2, 3] and only.lengths.tolist() == [4, 2]
    np.testing.assert_array_equal(only.trace(1).experts, resp[1, :2])


def test_vllm_rollout_minus_one_at_a_real_token_stays_no_route():
    rng = np.random.default_rng(3)
    resp = distinct_rows(rng, (1, 3, L)).astype(np.int16)
    resp[0, 2] = -1
    batch = from_vllm_rollout(resp, num_experts=E)
    assert (batch.trace(0).experts[2] == -1).all()
    np.testing.assert_array_equal(batch.sample_expert_counts()[0], loop_counts(resp[0, :2].tolist()))


def _slime_reader(payload: str, num_tokens: int, num_layers: int, top_k: int) -> np.ndarray:
    """What slime does with SGLang's payload: int32, reshaped to (len(sample.tokens) - 1, num_layers, top_k)."""
    return np.frombuffer(base64.b64decode(payload.encode("ascii")), dtype=np.int32).reshape(
        num_tokens - 1, num_layers, top_k)


def test_from_sglang_reads_slimes_payload_like_slime():
    rng = np.random.default_rng(4)
    prompt, completion, num_layers = 5, 4, 3
    ids = distinct_rows(rng, (prompt + completion - 1, num_layers))  # rows = tokens - 1
    payload = base64.b64encode(ids.tobytes()).decode("ascii")
    meta = {"routed_experts": payload, "prompt_tokens": prompt, "completion_tokens": completion}
    tr = from_sglang(meta, num_moe_layers=num_layers, num_experts=E)
    np.testing.assert_array_equal(tr.experts, _slime_reader(payload, prompt + completion, num_layers, K))
    assert tr.top_k == K and tr.start == 0
    # slime's num_layers counts every decoder layer; dense ones are dropped by index
    tr2 = from_sglang(meta, num_moe_layers=num_layers - 1, dense_layers=(0,), num_experts=E)
    np.testing.assert_array_equal(tr2.experts, _slime_reader(payload, prompt + completion, num_layers, K)[:, 1:])
    assert tr2.layer_ids.tolist() == [1, 2]


@pytest.mark.parametrize("call, match", [
    (lambda: from_verl(np.zeros((2, 3, L), np.int32), np.ones((2, 3)), num_experts=E),
     r"routed_experts must have rank 4 .*shape \(2, 3, 3\)"),
    (lambda: from_verl(np.zeros((1, 2, L, K), np.int32), np.ones((1, 2)), num_experts=E, num_moe_layers=4),
     r"layer count mismatch: routed_experts has 3 layers .*num_moe_layers=4"),
    (lambda: from_verl(np.tile(np.array([0, 9], np.int32), (1, 2, L, 1)), np.ones((1, 2)), num_experts=E),
     r"routed_experts\[0, 0\], layer 0, slot 1: expert id 9 out of range"),
    (lambda: from_verl(np.zeros((1, 2, L, K), np.int32), np.ones((1, 3)), num_experts=E),
     r"token_mask must have shape \[B=1, S=2\].*\(1, 3\)"),
    (lambda: from_verl(np.zeros((1, 2, L, K), np.int32), np.array([[1, 2]]), num_experts=E),
     r"token_mask\[0, 1\] = 2"),
    (lambda: from_verl(np.zeros((1, 2, L, K), np.int32), np.array([[1.0, 0.5]]), num_experts=E),
     r"token_mask\[0, 1\] = 0.5: a mask holds 0 or 1"),
    (lambda: from_verl(np.zeros((1, 2, L, K), np.float32), np.ones((1, 2)), num_experts=E),
     r"routed_experts must hold integers, got dtype float32"),
    (lambda: from_padded(np.tile(np.array([0, 1], np.int32), (1, 2, L, 1)), np.array([[1, 0]]), num_experts=E,
                         route_mask=np.array([[1, 1]])),
     r"route_mask\[0, 1\] = 1 at a padded position"),
    (lambda: from_nemo_rl(np.zeros((2, 3, L, K), np.int32), [3, 4], num_experts=E),
     r"input_lengths\[1\] = 4 out of range \[0, 3\]"),
    (lambda: from_nemo_rl(np.zeros((2, 3, L, K), np.int32), [3], num_experts=E),
     r"input_lengths must have shape \[B=2\]"),
    (lambda: from_vllm_rollout(np.zeros((1, 2, L, K), np.int16), np.zeros((1, 2, L + 1, K), np.int16), num_experts=E),
     r"prompt_routed_experts has shape \(1, 2, 4, 2\), routed_experts \(1, 2, 3, 2\)"),
    (lambda: from_vllm_rollout(np.tile(np.array([0, 1], np.int16), (1, 2, L, 1)),
                               np.tile(np.array([3, 3], np.int16), (1, 1, L, 1)), num_experts=E),
     r"prompt_routed_experts\[0, 0\], layer 0: duplicate expert id 3"),
    (lambda: from_verl(np.zeros((1, 2, L, 3), np.int32), np.ones((1, 2)), num_experts=2),
     r"top_k=3 ids per row .*more than num_experts=2"),
])
def test_bad_input_names_the_argument_and_value(call, match):
    with pytest.raises(TraceError, match=match):
        call()


def test_ids_at_padding_are_not_read():
    ids = np.full((1, 3, L, K), 99, dtype=np.int32)  # garbage everywhere ...
    ids[0, 1] = [[0, 1], [2, 3], [4, 5]]              # ... but at the one real token
    batch = from_verl(ids, np.array([[0, 1, 0]]), num_experts=E)
    np.testing.assert_array_equal(batch.trace(0).experts, ids[0, 1:2])


def test_replay_feeds_no_route_at_padding_never_expert_0():
    """The ids a replayed forward gets for verl's padded batch: real rows as recorded, pad rows -1."""
    from relibra_moe.integrations.hf import layout_ids

    rng = np.random.default_rng(5)
    ids = distinct_rows(rng, (2, 5, L))
    mask = torch.tensor([[0, 1, 1, 1, 0], [1, 1, 1, 1, 1]])
    ids[0, [0, 4]] = 0
    batch = from_verl(ids, mask, num_experts=E)
    for layer in range(L):
        fed = layout_ids(batch.traces, layer, attention_mask=mask).numpy().reshape(2, 5, K)
        np.testing.assert_array_equal(fed[0, [0, 4]], -1)
        np.testing.assert_array_equal(fed[0, 1:4], ids[0, 1:4, layer])
        np.testing.assert_array_equal(fed[1], ids[1, :, layer])
