"""RL-framework routing formats (verl, slime, NeMo-RL, SkyRL) into TraceBatch, on hand-built inputs."""

from __future__ import annotations

import base64

import numpy as np
import pytest
import torch

from relibra_moe.adapters import from_nemo_rl, from_padded, from_sglang, from_verl, from_vllm_rollout
from relibra_moe.errors import TraceError

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
