"""Synthetic RL batches: exact count invariants, ids consistent with counts, GRPO sharing, calibration."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from relibra_moe.errors import TraceError
from relibra_moe.metrics import load_summary
from relibra_moe.specs import ModelSpec, model_preset
from relibra_moe.synthetic import (
    BASE_DOMAINS,
    MAX_LEN,
    _ids_from_counts,
    _inclusion_rates,
    _round_counts,
    domain_sequence,
    rl_batch,
)
from relibra_moe.trace import TraceBatch

TINY = ModelSpec("tiny", 64, 32, 16, 4, 3)


@given(st.integers(0, 2**16), st.integers(1, 8), st.integers(8, 40))
def test_rounding_invariants(seed, k, e):
    k = min(k, e)
    rng = np.random.default_rng(seed)
    logits = 3.0 * rng.standard_normal((5, e))
    q = _inclusion_rates(logits, k)
    np.testing.assert_allclose(q.sum(axis=1), k)
    assert (q <= 1.0 + 1e-12).all() and (q >= 0).all()
    tokens = rng.integers(0, 300, 5)
    c = _round_counts(tokens, q, k, rng)
    assert (c >= 0).all() and (c <= tokens[:, None]).all()
    np.testing.assert_array_equal(c.sum(axis=1), k * tokens)
    assert np.abs(c - tokens[:, None] * q).max() < 1.0 + 1e-9  # at most one unit from the expectation


@given(st.integers(0, 2**16), st.integers(0, 50))
def test_ids_from_counts_exact(seed, s):
    rng = np.random.default_rng(seed)
    q = _inclusion_rates(2.0 * rng.standard_normal((3, 10)), 3)
    counts = _round_counts(np.full(3, s), q, 3, rng)
    ids = _ids_from_counts(counts, s, 3, rng, np.dtype(np.int16))
    assert ids.shape == (s, 3, 3)
    for l in range(3):
        np.testing.assert_array_equal(np.bincount(ids[:, l].ravel(), minlength=10), counts[l])
        if s:
            assert (np.diff(np.sort(ids[:, l], axis=1), axis=1) > 0).all()  # distinct ids per row


def test_batch_invariants_and_determinism():
    b = rl_batch(TINY, "math", num_prompts=6, responses_per_prompt=3, seed=1)
    assert b.num_sequences == 18 and (b.num_layers, b.num_experts, b.top_k) == (3, 16, 4)
    assert "synthetic" in b.source and "real" not in b.source.replace("not real", "")
    counts = b.sample_expert_counts()
    np.testing.assert_array_equal(counts.sum(axis=2), 4 * b.lengths[:, None].repeat(3, axis=1))
    assert (counts <= b.lengths[:, None, None]).all()
    assert (b.lengths <= MAX_LEN).all() and (b.lengths >= 2).all()
    again = rl_batch(TINY, "math", num_prompts=6, responses_per_prompt=3, seed=1)
    np.testing.assert_array_equal(again.sample_expert_counts(), counts)
    np.testing.assert_array_equal(again.trace(4).experts, b.trace(4).experts)
    other = rl_batch(TINY, "math", num_prompts=6, responses_per_prompt=3, seed=2)
    assert not np.array_equal(other.sample_expert_counts(), counts)
    assert b.micro_batch is None
    assert rl_batch(TINY, "code", 4, 2, micro_batch_size=3).micro_batch.tolist() == [0, 0, 0, 1, 1, 1, 2, 2]


def test_materialized_ids_match_counts_and_groups_share_prompts(tmp_path):
    b = rl_batch(TINY, "code", num_prompts=3, responses_per_prompt=4, seed=5, max_len=600)
    pt = b.sample_info["prompt_tokens"]
    t0, t1, t4 = b.trace(0), b.trace(1), b.trace(4)  # trace() checks ids against the counts
    np.testing.assert_array_equal(t0.experts[:pt[0]], t1.experts[:pt[1]])  # same prompt, same prompt rows
    assert pt[0] == pt[1]
    np.testing.assert_array_equal(t4.expert_counts(), b.sample_expert_counts()[4])
    path = tmp_path / "s.npz"
    b.save(path)
    back = TraceBatch.load(path)
    np.testing.assert_array_equal(back.sample_expert_counts(), b.sample_expert_counts())
    assert "synthetic" in back.source
    np.testing.assert_array_equal(back.sample_info["domain"], b.sample_info["domain"])


def _cos(a: np.ndarray, b: np.ndarray) -> float:
    a, b = a.ravel().astype(float), b.ravel().astype(float)
    return float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))


def test_responses_of_a_prompt_share_most_routing():
    b = rl_batch("qwen3-30b-a3b", "math", num_prompts=8, responses_per_prompt=4, seed=0)
    p = b.sample_expert_counts() / b.lengths[:, None, None]
    same = np.mean([_cos(p[4 * g], p[4 * g + 1]) for g in range(8)])
    diff = np.mean([_cos(p[4 * g], p[4 * (g + 1) + 1]) for g in range(7)])
    assert same > 0.95 and same > diff + 0.05


def test_lengths_long_tailed():
    lengths = rl_batch(TINY, "math", num_prompts=256, responses_per_prompt=4, seed=0).lengths
    assert lengths.max() <= MAX_LEN and lengths.max() >= 6000
    assert np.mean(lengths) > 1.2 * np.median(lengths)  # right tail


def test_mixed_interleaves_domains():
    seq = domain_sequence(30, seed=0)
    assert set(seq) == set(BASE_DOMAINS) and all(a != b for a, b in zip(seq, seq[1:]))
    b = rl_batch(TINY, "mixed", num_prompts=32, responses_per_prompt=4, seed=0, micro_batch_size=16)
    dom = b.sample_info["domain"].reshape(8, 16)
    assert all(len(set(row)) == 1 for row in dom)  # each micro-batch one domain
    assert all(dom[i, 0] != dom[i + 1, 0] for i in range(7))


def test_calibration_qwen3_30b_mixed():
    """Calibration (docs/method.md, "The problem"): qwen3-30b-a3b, 256 prompts x 4 responses, 32 micro-batches."""
    b = rl_batch("qwen3-30b-a3b", "mixed", num_prompts=256, responses_per_prompt=4, seed=0, micro_batch_size=32)
    assert b.num_sequences == 1024 and int(b.micro_batch.max()) == 31
    s = load_summary(b.micro_batch_expert_counts(), hot_k=8)
    assert 5.0 <= s["skew_mean"] <= 15.0
    assert s["intersection_mean"] < 0.5
    subset = model_preset("qwen3-30b-a3b").with_(num_layers=8)  # single domains on a layer subset (speed)
    for d in ("math", "instruction"):
        s = load_summary(rl_batch(subset, d, 256, 4, seed=1, micro_batch_size=32).micro_batch_expert_counts())
        assert 5.0 <= s["skew_mean"] <= 15.0


@pytest.mark.parametrize("args, match", [
    (("qwen3-30b-a3b", "poetry", 4), r"unknown synthetic domain 'poetry'"),
    (("no-such-model", "math", 4), r"unknown model preset 'no-such-model'"),
    (("qwen3-30b-a3b", "math", 0), r"num_prompts must be a positive int, got 0"),
    (("qwen3-30b-a3b", "math", 2.0), r"num_prompts must be a positive int, got 2.0"),
    ((TINY, "math", 2, True), r"responses_per_prompt must be a positive int, got True"),
    ((42, "math", 2), r"model must be a ModelSpec or a preset name, got int"),
])
def test_errors(args, match):
    with pytest.raises(TraceError, match=match):
        rl_batch(*args)
    with pytest.raises(TraceError, match=r"micro_batch_size must be a positive int, got -1"):
        rl_batch(TINY, "math", 2, micro_batch_size=-1)
    with pytest.raises(TraceError, match=r"max_len must be an int >= 2, got 1"):
        rl_batch(TINY, "math", 2, max_len=1)


def test_paper_scale_builds_from_counts_in_bounded_memory():
    """Qwen3-235B-A22B (94 layers, 128 experts, top-8), 1024 samples: counts only, peak well under 2 GB."""
    import tracemalloc

    tracemalloc.start()
    try:
        b = rl_batch("qwen3-235b-a22b", "mixed", num_prompts=256, responses_per_prompt=4, seed=0,
                     micro_batch_size=32)
        counts = b.sample_expert_counts()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert counts.shape == (1024, 94, 128)
    assert b._traces is None  # no per-token ids were materialized
    assert peak < 1.5 * 2**30, f"peak {peak / 2**30:.2f} GiB"
    s = load_summary(b.micro_batch_expert_counts())
    assert 5.0 <= s["skew_mean"] <= 15.0 and s["intersection_mean"] < 0.5


def test_fill_ids_refuses_inconsistent_counts():
    """A count above S, or a layer not summing to S k, is refused (TraceError), never written as ids."""
    rng = np.random.default_rng(0)
    good = np.array([[2, 2, 1, 1], [3, 1, 1, 1]])  # S = 3, k = 2
    ids = _ids_from_counts(good, 3, 2, rng, np.dtype(np.int16))
    for layer in range(2):
        np.testing.assert_array_equal(np.bincount(ids[:, layer].ravel(), minlength=4), good[layer])
    for bad in (np.array([[4, 1, 1, 0], [3, 1, 1, 1]]), np.array([[2, 2, 1, 1], [3, 1, 1, 0]])):
        with pytest.raises(TraceError, match="synthetic ids"):
            _ids_from_counts(bad, 3, 2, rng, np.dtype(np.int16))
