"""The real traces of ../shared/traces through relibra_moe.datasets (skipped when the data are absent)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from relibra_moe import datasets
from relibra_moe.datasets import TracesNotFoundError, gpt_oss_batch, olmoe_domain_counts, traces_dir
from relibra_moe.errors import TraceError
from relibra_moe.metrics import load_summary


@pytest.fixture()
def data_env(traces_dir, monkeypatch):
    monkeypatch.setenv("RELIBRA_TRACES", str(traces_dir))
    return traces_dir


def test_missing_folder_says_where_it_looked(tmp_path, monkeypatch):
    monkeypatch.setenv("RELIBRA_TRACES", str(tmp_path / "nowhere"))
    with pytest.raises(TracesNotFoundError, match=r"not found: looked for gpt-oss-20b/topk_ids.npz under .*nowhere"):
        gpt_oss_batch()
    with pytest.raises(FileNotFoundError):
        olmoe_domain_counts()
    with pytest.raises(TraceError, match="nowhere"):
        traces_dir()


def test_default_location_is_next_to_the_checkout(monkeypatch):
    monkeypatch.delenv("RELIBRA_TRACES", raising=False)
    cands = datasets._candidates()
    assert cands[0] == datasets.Path(datasets.__file__).resolve().parents[2] / "shared" / "traces"


def test_gpt_oss_all_requests_match_the_raw_file(data_env):
    b = gpt_oss_batch()
    with np.load(data_env / "gpt-oss-20b" / "topk_ids.npz") as f:
        ids, offsets = f["topk_ids"], f["offsets"]
    requests = json.loads((data_env / "gpt-oss-20b" / "requests.json").read_text())
    assert (b.num_sequences, b.num_experts, b.top_k, b.num_layers) == (703, 32, 4, 24)
    np.testing.assert_array_equal(b.layer_ids, np.arange(24))
    assert b.num_tokens == ids.shape[0]
    assert "gpt-oss-20b" in b.source and "real" in b.source
    for i in (0, 5, 702):
        np.testing.assert_array_equal(b.trace(i).experts, ids[offsets[i]:offsets[i + 1]])
        assert b.starts[i] == requests[i]["n_prompt_tokens"]
        assert b.sample_info["domain"][i] == requests[i]["domain"]
    # counts against an independent bincount over the raw rows of one request
    i = 7
    raw = ids[offsets[i]:offsets[i + 1]].astype(np.int64)
    ref = np.stack([np.bincount(raw[:, l].ravel(), minlength=32) for l in range(24)])
    np.testing.assert_array_equal(b.sample_expert_counts()[i], ref)


def test_gpt_oss_skew_one_request_per_micro_batch(data_env):
    """The README's measured fact: mean expert skew about 4.6 (target 4-5.5), intersection about 0.6."""
    s = load_summary(gpt_oss_batch().with_micro_batch_size(1).micro_batch_expert_counts())
    assert 4.0 <= s["skew_mean"] <= 5.5
    assert 0.5 <= s["intersection_mean"] <= 0.7


def test_gpt_oss_sampling_and_filters(data_env):
    a = gpt_oss_batch(num_requests=20, seed=3)
    b = gpt_oss_batch(num_requests=20, seed=3)
    c = gpt_oss_batch(num_requests=20, seed=4)
    np.testing.assert_array_equal(a.sample_info["request"], b.sample_info["request"])
    assert not np.array_equal(a.sample_info["request"], c.sample_info["request"])
    drawn = np.random.default_rng(3).choice(703, size=20, replace=False)
    np.testing.assert_array_equal(a.sample_info["request"], drawn)  # drawn order kept
    assert "20 requests drawn with seed 3" in a.source

    m = gpt_oss_batch(domains=["math", "law"])
    assert set(m.sample_info["domain"]) == {"math", "law"}
    assert m.num_sequences == 81
    r = gpt_oss_batch(drop_repetition=True)
    assert not r.sample_info["repetition"].any() and r.num_sequences == 703 - 209
    mr = gpt_oss_batch(num_requests=5, domains="math", drop_repetition=True, seed=1)
    assert set(mr.sample_info["domain"]) == {"math"} and not mr.sample_info["repetition"].any()
    assert "math" in datasets.gpt_oss_domains()


def test_gpt_oss_errors(data_env):
    with pytest.raises(TraceError, match=r"unknown GPT-OSS domain\(s\) \['poetry'\]"):
        gpt_oss_batch(domains="poetry")
    with pytest.raises(TraceError, match=r"num_requests=704 exceeds the 703 eligible"):
        gpt_oss_batch(num_requests=704)
    with pytest.raises(TraceError, match=r"num_requests must be a positive int, got 0"):
        gpt_oss_batch(num_requests=0)


def test_olmoe_domain_counts(data_env):
    counts, names, layers = olmoe_domain_counts()
    assert counts.shape == (6, 3, 64) and counts.dtype == np.int64
    assert names == ["arxiv", "book", "c4", "github", "wikipedia", "tulu"]
    np.testing.assert_array_equal(layers, [0, 7, 15])
    # every token picks 8 experts: a domain's layers carry the same total
    totals = counts.sum(axis=2)
    np.testing.assert_array_equal(totals % 8, 0)
    np.testing.assert_array_equal(totals, totals[:, :1].repeat(3, axis=1))
    mix = olmoe_domain_counts("mistral__expert_counts")
    assert mix.counts.shape == (5, 3, 8)
    cross = olmoe_domain_counts("olmoe__crosslayer")
    assert cross.counts.shape == (5, 2, 64, 64) and cross.layers.tolist() == [[0, 7], [7, 15]]
    with pytest.raises(TraceError, match=r"no array 'nope'"):
        olmoe_domain_counts("nope")


def _fake_gpt_oss(root, ids: np.ndarray, offsets: list[int]) -> None:
    d = root / "gpt-oss-20b"
    d.mkdir(parents=True)
    np.savez(d / "topk_ids.npz", topk_ids=ids, offsets=np.array(offsets))
    req = {"n_prompt_tokens": 3, "domain": "math", "dataset": "x", "category": "y", "repetition": False,
           "finished": True}
    (d / "requests.json").write_text(json.dumps([req] * (len(offsets) - 1)))


def test_gpt_oss_file_ids_checked_before_narrowing(tmp_path, monkeypatch):
    """A stored id of 65539 would wrap to 3 in int16: it must be reported, naming the request and row."""
    rng = np.random.default_rng(0)
    ids = np.argsort(rng.random((5, 24, 32)), axis=2)[:, :, :4].astype(np.int32)
    ids[3, 2, 1] = 65536 + 3
    _fake_gpt_oss(tmp_path, ids, [0, 2, 5])
    monkeypatch.setenv("RELIBRA_TRACES", str(tmp_path))
    with pytest.raises(TraceError, match=r"request 1, row 1, layer 2, slot 1: expert id 65539 out of range"):
        gpt_oss_batch()


def test_gpt_oss_file_shape_disagreement(tmp_path, monkeypatch):
    ids = np.zeros((5, 24, 4), np.uint8)
    _fake_gpt_oss(tmp_path, ids, [0, 2, 4])  # offsets end at 4, the file has 5 rows
    monkeypatch.setenv("RELIBRA_TRACES", str(tmp_path))
    with pytest.raises(TraceError, match=r"topk_ids \(5, 24, 4\) / offsets \(3,\) / 2 requests disagree"):
        gpt_oss_batch()
