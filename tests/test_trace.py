"""RoutingTrace / TraceBatch: validation, counts and loads against loops, the .npz format and its errors."""

from __future__ import annotations

import io
import zipfile

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from relibra_moe.errors import TraceError
from relibra_moe.trace import FORMAT_VERSION, REQUIRED_KEYS, RoutingTrace, TraceBatch


def random_ids(rng: np.random.Generator, s: int, num_layers: int, e: int, k: int, pad: float = 0.0) -> np.ndarray:
    """[S, L, k] rows of k distinct ids; a fraction ``pad`` of the slots set to -1."""
    out = np.argsort(rng.random((s, num_layers, e)), axis=2)[:, :, :k]
    if pad:
        out[rng.random(out.shape) < pad] = -1
    return out.astype(np.int64)


def make_batch(rng: np.random.Generator, lengths: list[int], num_layers: int = 3, e: int = 8, k: int = 2,
               pad: float = 0.0) -> TraceBatch:
    return TraceBatch([RoutingTrace(random_ids(rng, s, num_layers, e, k, pad), np.arange(num_layers) + 1, e, k,
                                    start=i, source="unit") for i, s in enumerate(lengths)])


# ------------------------------------------------------------------------------------- RoutingTrace
def test_routing_trace_normalizes_dtype_and_keeps_order():
    ids = np.array([[[3, 1], [0, 2]], [[1, -1], [-1, -1]]], dtype=np.int64)
    tr = RoutingTrace(ids, [0, 5], num_experts=4, top_k=2, start=7, source="x")
    assert tr.experts.dtype == np.int16
    assert tr.layer_ids.dtype == np.int32
    np.testing.assert_array_equal(tr.experts, ids)  # row order kept, -1 padding allowed
    assert (tr.num_tokens, tr.num_layers, tr.start) == (2, 2, 7)
    np.testing.assert_array_equal(tr.expert_counts(), [[0, 2, 0, 1], [1, 0, 1, 0]])


def test_routing_trace_int32_for_large_expert_count():
    tr = RoutingTrace(np.array([[[40000]]]), [0], num_experts=40001, top_k=1)
    assert tr.experts.dtype == np.int32


@pytest.mark.parametrize("ids, match", [
    (np.array([[[0, 8]]]), r"row 0, layer 0, slot 1: expert id 8 out of range"),
    (np.array([[[0, 1]], [[-2, 1]]]), r"row 1, layer 0, slot 0: expert id -2 out of range"),
    (np.array([[[0, 1]], [[3, 3]]]), r"row 1, layer 0: duplicate expert id 3"),
    (np.array([[[0, 1], [5, -1]], [[2, 1], [-1, -1]], [[4, 6], [6, 4]], [[4, 6], [7, 7]]]),
     r"row 3, layer 1: duplicate expert id 7"),
    (np.zeros((2, 1, 2), np.float32), r"experts must hold integers, got dtype float32"),
    (np.zeros((2, 1, 2), bool), r"experts must hold integers, got dtype bool"),
    (np.zeros((2, 2), np.int64), r"experts must have rank 3 .* got rank 2"),
    (np.zeros((2, 1, 3), np.int64), r"k=3 ids per row"),
])
def test_routing_trace_rejects(ids, match):
    num_layers = ids.shape[1] if ids.ndim == 3 else 1
    with pytest.raises(TraceError, match=match):
        RoutingTrace(ids, np.arange(num_layers), num_experts=8, top_k=2)


def test_routing_trace_layer_count_mismatch():
    with pytest.raises(TraceError, match=r"layer count mismatch: layer_ids has shape \(3,\), experts has 2 layers"):
        RoutingTrace(np.zeros((1, 2, 1), np.int64), [0, 1, 2], 4, 1)


@pytest.mark.parametrize("kwargs, match", [
    (dict(num_experts=0, top_k=1), r"num_experts must be a positive int, got 0"),
    (dict(num_experts=2, top_k=3), r"top_k=3 exceeds num_experts=2"),
    (dict(num_experts=4, top_k=1, start=-1), r"start must be an int >= 0, got -1"),
])
def test_routing_trace_bad_scalars(kwargs, match):
    with pytest.raises(TraceError, match=match):
        RoutingTrace(np.zeros((1, 1, 1), np.int64), [0], **kwargs)


def test_duplicate_padding_is_not_a_duplicate():
    RoutingTrace(np.array([[[-1, -1, -1]]]), [0], 4, 3)  # an all-padding row is fine


# --------------------------------------------------------------------------------------- TraceBatch
def test_batch_rejects_empty_and_inconsistent():
    rng = np.random.default_rng(0)
    a = RoutingTrace(random_ids(rng, 4, 3, 8, 2), [0, 1, 2], 8, 2)
    with pytest.raises(TraceError, match="empty batch"):
        TraceBatch([])
    with pytest.raises(TraceError, match=r"layer count mismatch: sample 1 has 2 MoE layers, sample 0 has 3"):
        TraceBatch([a, RoutingTrace(random_ids(rng, 4, 2, 8, 2), [0, 1], 8, 2)])
    with pytest.raises(TraceError, match=r"sample 2: num_experts=9, sample 0 has 8"):
        TraceBatch([a, a, RoutingTrace(random_ids(rng, 4, 3, 8, 2), [0, 1, 2], 9, 2)])
    with pytest.raises(TraceError, match=r"sample 1: top_k=3"):
        TraceBatch([a, RoutingTrace(random_ids(rng, 4, 3, 8, 3), [0, 1, 2], 8, 3)])
    with pytest.raises(TraceError, match=r"sample 1: layer_ids \[0, 1, 3\] differ"):
        TraceBatch([a, RoutingTrace(random_ids(rng, 4, 3, 8, 2), [0, 1, 3], 8, 2)])
    with pytest.raises(TraceError, match=r"micro_batch must have shape \[2\]"):
        TraceBatch([a, a], micro_batch=[0, 0, 0])
    with pytest.raises(TraceError, match=r"micro_batch\[1\] = -3"):
        TraceBatch([a, a], micro_batch=[0, -3])
    with pytest.raises(TraceError, match=r"micro_batch must hold integers, got dtype float64"):
        TraceBatch([a, a], micro_batch=[0.0, 0.5])
    with pytest.raises(TraceError, match=r"sample 1: expected a RoutingTrace, got ndarray"):
        TraceBatch([a, np.zeros((1, 3, 2))])
    with pytest.raises(TraceError, match=r"sample_info\['x'\] must have one entry per sequence \(2\), got shape \(3"):
        TraceBatch([a, a], sample_info={"x": [1, 2, 3]})
    with pytest.raises(TraceError, match=r"sample_info\['x'\] has dtype object"):
        TraceBatch([a, a], sample_info={"x": np.array([{}, {}], dtype=object)})


def test_sample_expert_counts_match_loop():
    rng = np.random.default_rng(1)
    b = make_batch(rng, [5, 0, 7, 3], num_layers=3, e=6, k=3, pad=0.2)
    ref = np.zeros((4, 3, 6), np.int64)
    for n, tr in enumerate(b.traces):
        for t in range(tr.num_tokens):
            for l in range(3):
                for e in tr.experts[t, l]:
                    if e >= 0:
                        ref[n, l, e] += 1
    counts = b.sample_expert_counts()
    np.testing.assert_array_equal(counts, ref)
    assert counts is b.sample_expert_counts()  # cached
    assert not counts.flags.writeable
    np.testing.assert_array_equal(b.lengths, [5, 0, 7, 3])
    assert b.num_tokens == 15
    np.testing.assert_array_equal(b.layer_ids, [1, 2, 3])


def loads_reference(b: TraceBatch, gpu: np.ndarray, num_gpus: int, mb: np.ndarray) -> np.ndarray:
    x = np.zeros((int(mb.max()) + 1, b.num_layers, num_gpus, b.num_experts), np.int64)
    for n, tr in enumerate(b.traces):
        for t in range(tr.num_tokens):
            for l in range(b.num_layers):
                for e in tr.experts[t, l]:
                    if e >= 0:
                        x[mb[n], l, gpu[n], e] += 1
    return x


@given(st.data())
def test_loads_match_loop(data):
    seed = data.draw(st.integers(0, 2**16))
    rng = np.random.default_rng(seed)
    n = data.draw(st.integers(1, 6))
    lengths = data.draw(st.lists(st.integers(0, 6), min_size=n, max_size=n))
    e = data.draw(st.integers(2, 7))
    k = data.draw(st.integers(1, e))
    b = make_batch(rng, lengths, num_layers=2, e=e, k=k, pad=0.1)
    num_gpus = data.draw(st.integers(1, 4))
    gpu = rng.integers(0, num_gpus, n)
    mb = rng.integers(0, 3, n)
    x = b.loads(gpu, num_gpus, micro_batch=mb)
    np.testing.assert_array_equal(x, loads_reference(b, gpu, num_gpus, mb))
    np.testing.assert_array_equal(x.sum(axis=2), b.micro_batch_expert_counts(mb))


def test_loads_micro_batch_rules():
    rng = np.random.default_rng(2)
    b = make_batch(rng, [3, 4, 5, 2, 1])
    with pytest.raises(TraceError, match="no micro-batch assignment"):
        b.loads(np.zeros(5, int), 2)
    b3 = b.with_micro_batch_size(2)
    np.testing.assert_array_equal(b3.micro_batch, [0, 0, 1, 1, 2])
    x = b3.loads([0, 1, 1, 0, 1], 2)
    assert x.shape == (3, 3, 2, 8)
    np.testing.assert_array_equal(x, loads_reference(b, np.array([0, 1, 1, 0, 1]), 2, np.array([0, 0, 1, 1, 2])))
    partial = b.with_micro_batch([0, 0, -1, 1, 1])
    with pytest.raises(TraceError, match=r"TraceBatch.micro_batch\[2\] = -1: sample 2 is not assigned"):
        partial.loads(np.zeros(5, int), 1)
    np.testing.assert_array_equal(partial.loads(np.zeros(5, int), 1, micro_batch=[0, 0, 0, 0, 0])[0, :, 0],
                                  b.sample_expert_counts().sum(0))
    with pytest.raises(TraceError, match=r"micro_batch\[0\] = -1"):
        b.loads(np.zeros(5, int), 1, micro_batch=[-1, 0, 0, 0, 0])
    with pytest.raises(TraceError, match=r"sample_gpu\[3\] = 2 out of range \[0, 2\)"):
        b3.loads([0, 1, 1, 2, 0], 2)
    with pytest.raises(TraceError, match=r"sample_gpu must have shape \[5\]"):
        b3.loads([0, 1], 2)
    with pytest.raises(TraceError, match="micro_batch_size must be a positive int, got 0"):
        b.with_micro_batch_size(0)


def test_subset_keeps_order_and_info():
    rng = np.random.default_rng(3)
    b = make_batch(rng, [3, 4, 5, 2])
    b.sample_info["tag"] = np.array(["a", "b", "c", "d"])
    s = b.subset([2, 0])
    np.testing.assert_array_equal(s.lengths, [5, 3])
    np.testing.assert_array_equal(s.sample_info["tag"], ["c", "a"])
    np.testing.assert_array_equal(s.sample_expert_counts(), b.sample_expert_counts()[[2, 0]])
    assert s.trace(0) is b.trace(2)
    with pytest.raises(TraceError, match="empty batch"):
        b.subset([])


# ------------------------------------------------------------------------------------ from_counts
def test_from_counts_lazy_materialization():
    rng = np.random.default_rng(4)
    ref = make_batch(rng, [4, 6, 3], num_layers=2, e=5, k=2)
    calls = []

    def materialize(i: int) -> np.ndarray:
        calls.append(i)
        return ref.trace(i).experts

    b = TraceBatch.from_counts(ref.sample_expert_counts(), 2, ref.layer_ids, materialize=materialize,
                               source="synthetic test")
    np.testing.assert_array_equal(b.lengths, [4, 6, 3])
    x = b.loads([0, 1, 0], 2, micro_batch=[0, 0, 1])
    assert calls == []  # loads come from the counts alone
    np.testing.assert_array_equal(x, ref.loads([0, 1, 0], 2, micro_batch=[0, 0, 1]))
    np.testing.assert_array_equal(b.trace(1).experts, ref.trace(1).experts)
    assert calls == [1]
    s = b.subset([2, 1])
    np.testing.assert_array_equal(s.trace(0).experts, ref.trace(2).experts)


def test_from_counts_rejects_bad_counts():
    with pytest.raises(TraceError, match=r"sample 0, layer 1: counts sum to 3"):
        TraceBatch.from_counts(np.array([[[1, 1, 0], [1, 1, 1]]]), 2)
    with pytest.raises(TraceError, match=r"sample 0, layer 0: expert 0 has count 3 > the sample's 2 tokens"):
        TraceBatch.from_counts(np.array([[[3, 1, 0]]]), 2)
    with pytest.raises(TraceError, match="holds expert counts only"):
        TraceBatch.from_counts(np.array([[[1, 1, 0]]]), 2).trace(0)
    b = TraceBatch.from_counts(np.array([[[1, 1, 0]]]), 2, materialize=lambda i: np.array([[[0, 2]]]))
    with pytest.raises(TraceError, match="sample 0: materialized ids disagree with the batch's expert counts"):
        b.trace(0)
    b = TraceBatch.from_counts(np.array([[[1, 1, 0]]]), 2, materialize=lambda i: np.array([[[0, 1]], [[0, 1]]]))
    with pytest.raises(TraceError, match=r"sample 0: materialized 2 rows, counts say 1"):
        b.trace(0)
    with pytest.raises(TraceError, match=r"sample 0, layer 0: negative count -1 for expert 2"):
        TraceBatch.from_counts(np.array([[[2, 1, -1]]]), 2)
    with pytest.raises(TraceError, match=r"counts must have rank 3 \[N, L, E\], got shape \(2, 3\)"):
        TraceBatch.from_counts(np.ones((2, 3), np.int64), 1)
    with pytest.raises(TraceError, match=r"empty batch: counts has no samples"):
        TraceBatch.from_counts(np.ones((0, 1, 3), np.int64), 1)
    with pytest.raises(TraceError, match=r"top_k=4 exceeds num_experts=3"):
        TraceBatch.from_counts(np.ones((1, 1, 3), np.int64), 4)
    with pytest.raises(TraceError, match=r"layer count mismatch: layer_ids has shape \(2,\), counts has 1 layers"):
        TraceBatch.from_counts(np.ones((1, 1, 3), np.int64), 1, layer_ids=[0, 1])
    with pytest.raises(TraceError, match=r"starts\[1\] = -5: token positions are >= 0"):
        TraceBatch.from_counts(np.ones((2, 1, 3), np.int64), 1, starts=[0, -5])


# --------------------------------------------------------------------------------------------- io
def test_save_load_roundtrip(tmp_path):
    rng = np.random.default_rng(5)
    b = make_batch(rng, [3, 0, 5], num_layers=2, e=40000, k=2, pad=0.1).with_micro_batch([1, -1, 0])
    b.sample_info["domain"] = np.array(["math", "code", "chat"])
    path = tmp_path / "t.npz"
    b.save(path)
    with np.load(path, allow_pickle=False) as f:
        assert set(REQUIRED_KEYS) <= set(f.files)
        assert int(f["version"]) == FORMAT_VERSION
        # k is stored under the key "topk" (the saved format predates the top_k attribute), never "top_k"
        assert int(f["topk"]) == 2 and "top_k" not in f.files
        assert f["experts"].shape == (8, 2, 2) and f["experts"].dtype == np.int32
        np.testing.assert_array_equal(f["offsets"], [0, 3, 3, 8])
    c = TraceBatch.load(path)
    assert (c.num_sequences, c.num_experts, c.top_k, c.source) == (3, 40000, 2, "unit")
    np.testing.assert_array_equal(c.micro_batch, [1, -1, 0])
    np.testing.assert_array_equal(c.starts, [0, 1, 2])
    np.testing.assert_array_equal(c.layer_ids, [1, 2])
    np.testing.assert_array_equal(c.sample_info["domain"], ["math", "code", "chat"])
    for a, z in zip(b.traces, c.traces):
        np.testing.assert_array_equal(a.experts, z.experts)
    b.with_micro_batch(None).save(tmp_path / "c.npz", compress=True)
    assert TraceBatch.load(tmp_path / "c.npz").micro_batch.tolist() == [-1, -1, -1]


def _write(path, **arrays):
    with open(path, "wb") as f:
        np.savez(f, **arrays)


def _good_arrays() -> dict:
    return dict(version=np.int64(1), num_experts=np.int64(4), topk=np.int64(2), layer_ids=np.array([0], np.int32),
                experts=np.array([[[0, 1]], [[2, 3]]], np.int16), offsets=np.array([0, 1, 2]),
                starts=np.array([0, 0]), micro_batch=np.array([-1, -1], np.int32), source=np.str_("t"))


def test_load_errors(tmp_path):
    p = tmp_path / "x.npz"
    with pytest.raises(TraceError, match=r"x.npz: no such trace file"):
        TraceBatch.load(p)

    _write(p, **_good_arrays())
    assert TraceBatch.load(p).num_sequences == 2

    bad = _good_arrays() | {"version": np.int64(3)}
    _write(p, **bad)
    with pytest.raises(TraceError, match=r"x.npz: unknown trace format version 3 \(this library reads versions 1, 2\)"):
        TraceBatch.load(p)

    bad = _good_arrays()
    del bad["offsets"]
    _write(p, **bad)
    with pytest.raises(TraceError, match=r"x.npz: missing key\(s\) \['offsets'\]"):
        TraceBatch.load(p)

    _write(p, **_good_arrays())
    raw = p.read_bytes()
    p.write_bytes(raw[: len(raw) // 2])
    with pytest.raises(TraceError, match=r"x.npz: not a readable .npz trace file"):
        TraceBatch.load(p)

    p.write_text("hello, not an archive")
    with pytest.raises(TraceError, match=r"x.npz: not a readable .npz trace file"):
        TraceBatch.load(p)

    np.save(tmp_path / "y.npy", np.zeros(3))
    with pytest.raises(TraceError, match=r"y.npy: not an .npz archive"):
        TraceBatch.load(tmp_path / "y.npy")

    bad = _good_arrays() | {"experts": np.array([[[0, 1]], [[2, 2]]], np.int16)}
    _write(p, **bad)
    with pytest.raises(TraceError, match=r"x.npz: sample 1, row 0, layer 0: duplicate expert id 2"):
        TraceBatch.load(p)

    bad = _good_arrays() | {"experts": np.array([[[0, 1]], [[2, 9]]], np.int16)}
    _write(p, **bad)
    with pytest.raises(TraceError, match=r"x.npz: sample 1, row 0, layer 0, slot 1: expert id 9 out of range"):
        TraceBatch.load(p)

    bad = _good_arrays() | {"offsets": np.array([0, 1, 3])}
    _write(p, **bad)
    with pytest.raises(TraceError, match=r"x.npz: offsets must rise from 0 to the 2 rows"):
        TraceBatch.load(p)

    bad = _good_arrays() | {"experts": np.zeros((2, 1, 2), np.float32)}
    _write(p, **bad)
    with pytest.raises(TraceError, match=r"x.npz: experts must hold integers, got dtype float32"):
        TraceBatch.load(p)

    bad = _good_arrays() | {"offsets": np.array([0])}
    _write(p, **bad)
    with pytest.raises(TraceError, match=r"x.npz: empty batch"):
        TraceBatch.load(p)


def test_load_truncated_member(tmp_path):
    """A zip whose central directory survives but a member is cut short."""
    p = tmp_path / "z.npz"
    with zipfile.ZipFile(p, "w") as z:
        for key, value in _good_arrays().items():
            buf = io.BytesIO()
            np.save(buf, value)
            data = buf.getvalue()
            z.writestr(key + ".npy", data[:20] if key == "experts" else data)
    with pytest.raises(TraceError, match=r"z.npz: (key 'experts' is truncated or corrupt|not a readable)"):
        TraceBatch.load(p)


def test_load_rejects_pickled_objects(tmp_path):
    p = tmp_path / "o.npz"
    _write(p, **(_good_arrays() | {"source": np.array([{"a": 1}], dtype=object)}))
    with pytest.raises(TraceError, match=r"o.npz: key 'source' holds Python objects \(pickled\)"):
        TraceBatch.load(p)


def test_duplicate_found_in_a_later_chunk(monkeypatch):
    import relibra_moe.trace as trace_mod
    monkeypatch.setattr(trace_mod, "_CHECK_CHUNK", 8)  # 8 ids per chunk: rows are checked 1 at a time
    ids = random_ids(np.random.default_rng(9), 50, 2, 6, 3)
    ids[37, 1, 2] = ids[37, 1, 0]
    with pytest.raises(TraceError, match=rf"row 37, layer 1: duplicate expert id {ids[37, 1, 0]}"):
        RoutingTrace(ids, [0, 1], 6, 3)


@pytest.mark.parametrize("change, match", [
    ({"experts": np.zeros((2, 2), np.int16)}, r"x.npz: experts must have rank 3 \[T, L, k\], got shape \(2, 2\)"),
    ({"layer_ids": np.array([0, 1], np.int32)},
     r"x.npz: layer count mismatch: layer_ids has shape \(2,\), experts has 1"),
    ({"version": np.float64(1.0)}, r"x.npz: key 'version' must be an integer scalar, got dtype float64"),
    ({"topk": np.int64(3)}, r"x.npz: experts has k=2 ids per row .* top_k=3"),
    ({"num_experts": np.array([4, 4])},
     r"x.npz: key 'num_experts' must be an integer scalar, got dtype int64 shape \(2,\)"),
    ({"starts": np.array([0])}, r"x.npz: starts must have shape \[2\], got \(1,\)"),
    ({"starts": np.array([0, -4])}, r"x.npz: starts must be >= 0, got -4"),
    ({"micro_batch": np.array([0, -2], np.int32)}, r"x.npz: micro_batch\[1\] = -2"),
    ({"micro_batch": np.array([0, 2**40])}, r"x.npz: micro_batch\[1\] = 1099511627776: micro-batch ids must fit int32"),
    ({"source": np.array([1, 2])}, r"x.npz: key 'source' must be a string scalar"),
    ({"info_domain": np.array(["a"])}, r"x.npz: sample_info\['domain'\] must have one entry per sequence \(2\)"),
    # ids stored as int32 beyond E (and beyond int16): rejected with their value, never wrapped into range
    ({"experts": np.array([[[0, 1]], [[2, 65538]]], np.int32)},
     r"x.npz: sample 1, row 0, layer 0, slot 1: expert id 65538 out of range \(valid: 0..3"),
    ({"experts": np.array([[[0, 1]], [[-7, 2]]], np.int32)},
     r"x.npz: sample 1, row 0, layer 0, slot 0: expert id -7 out of range"),
])
def test_load_rejects_bad_fields(tmp_path, change, match):
    p = tmp_path / "x.npz"
    _write(p, **(_good_arrays() | change))
    with pytest.raises(TraceError, match=match):
        TraceBatch.load(p)


def test_ids_are_range_checked_before_narrowing():
    """An id that int16 would wrap into range (65536 + 3 -> 3) is an error, not expert 3."""
    with pytest.raises(TraceError, match=r"row 0, layer 0, slot 0: expert id 65539 out of range \(valid: 0..7"):
        RoutingTrace(np.array([[[65539]]], np.int64), [0], num_experts=8, top_k=1)
    with pytest.raises(TraceError, match=r"expert id 32768 out of range \(valid: 0..32766"):
        RoutingTrace(np.array([[[32768]]], np.int32), [0], num_experts=32767, top_k=1)
    tr = RoutingTrace(np.array([[[32767]]], np.int64), [0], num_experts=32768, top_k=1)
    assert tr.experts.dtype == np.int32 and int(tr.experts[0, 0, 0]) == 32767


def test_layer_ids_and_micro_batch_never_wrap():
    with pytest.raises(TraceError, match=r"layer_ids must lie in \[0, 2147483647\], got \[4294967296\]"):
        RoutingTrace(np.zeros((1, 1, 1), np.int64), [2**32], 4, 1)
    tr = RoutingTrace(np.zeros((1, 1, 1), np.int64), [0], 4, 1)
    with pytest.raises(TraceError, match=r"micro_batch\[1\] = 4294967296: micro-batch ids must fit int32"):
        TraceBatch([tr, tr], micro_batch=[0, 2**32])


# ------------------------------------------------------------------------------ version 2: counts, lazy ids
def _write_v1(batch: TraceBatch, path) -> None:
    """The version-1 layout, written by hand: ids only (int16), no counts."""
    offsets = np.r_[0, np.cumsum(batch.lengths)]
    experts = np.concatenate([t.experts for t in batch.traces]).astype(np.int16)
    mb = batch.micro_batch if batch.micro_batch is not None else np.full(batch.num_sequences, -1, np.int32)
    _write(path, version=np.int64(1), num_experts=np.int64(batch.num_experts), topk=np.int64(batch.top_k),
           layer_ids=batch.layer_ids, experts=experts, offsets=offsets, starts=batch.starts,
           micro_batch=mb.astype(np.int32), source=np.str_(batch.source),
           **{"info_" + k: v for k, v in batch.sample_info.items()})


def _loop_counts(batch: TraceBatch) -> np.ndarray:
    out = np.zeros((batch.num_sequences, batch.num_layers, batch.num_experts), dtype=np.int64)
    for n, tr in enumerate(batch.traces):
        for row in tr.experts:
            for l in range(batch.num_layers):
                for e in row[l]:
                    if e >= 0:
                        out[n, l, e] += 1
    return out


def _same_batch(a: TraceBatch, b: TraceBatch) -> None:
    np.testing.assert_array_equal(a.sample_expert_counts(), b.sample_expert_counts())
    np.testing.assert_array_equal(a.lengths, b.lengths)
    np.testing.assert_array_equal(a.starts, b.starts)
    np.testing.assert_array_equal(a.micro_batch, b.micro_batch)
    np.testing.assert_array_equal(a.layer_ids, b.layer_ids)
    assert (a.num_experts, a.top_k, a.source) == (b.num_experts, b.top_k, b.source)
    for key in a.sample_info:
        np.testing.assert_array_equal(a.sample_info[key], b.sample_info[key])


def test_v2_stores_counts_and_loads_them_without_reading_ids(tmp_path):
    rng = np.random.default_rng(11)
    b = make_batch(rng, [4, 0, 7, 2], num_layers=2, e=6, k=2, pad=0.15).with_micro_batch([0, 0, 1, 1])
    b.sample_info["domain"] = np.array(["a", "b", "c", "d"])
    path = tmp_path / "v2.npz"
    b.save(path)
    with np.load(path) as f:
        assert int(f["version"]) == 2 and not bool(f["counts_only"]) and int(f["no_route"]) == -1
        assert f["experts"].dtype == np.int8 and f["counts"].dtype == np.uint8
        np.testing.assert_array_equal(f["counts"], _loop_counts(b))
        arrays = {k: f[k] for k in f.files}
    # loading reads the counts, and of the ids only their .npy header: a header of the wrong shape is
    # rejected at load (naming the key and both shapes), before any id is read or allocated
    _write(path, **(arrays | {"experts": np.zeros((3, 3), np.int8)}))
    with pytest.raises(TraceError, match=r"v2.npz: key 'experts' declares shape \[3, 3\] of int8; offsets, "
                                         r"layer_ids and topk say integers of shape \[T, L, k\] = \[13, 2, 2\]"):
        TraceBatch.load(path)


def test_v2_roundtrip_ids_read_on_demand_and_checked(tmp_path):
    rng = np.random.default_rng(12)
    b = make_batch(rng, [5, 3, 6], num_layers=3, e=128, k=4, pad=0.1)
    path = tmp_path / "t.npz"
    b.save(path)
    c = TraceBatch.load(path)
    _same_batch(b.with_micro_batch(np.full(3, -1)), c)
    for x, y in zip(b.traces, c.traces):
        np.testing.assert_array_equal(x.experts, y.experts)  # -1 survives int8 storage as "no route"
    assert (c.trace(0).experts == -1).any()
    sub = c.subset([2, 0])
    np.testing.assert_array_equal(sub.trace(0).experts, b.trace(2).experts)
    # ids that disagree with the stored counts are caught when read, naming the file and both fields
    with np.load(path) as f:
        arrays = {k: f[k] for k in f.files}
    ids = arrays["experts"].copy()
    ids[0, 0, 0] = next(e for e in range(128) if e not in ids[0, 0])
    _write(path, **(arrays | {"experts": ids}))
    d = TraceBatch.load(path)
    with pytest.raises(TraceError, match=r"t.npz: sample 0: field 'experts' disagrees with field 'counts'"):
        d.trace(0)


def test_v1_files_still_load_with_the_same_batch(tmp_path):
    rng = np.random.default_rng(13)
    b = make_batch(rng, [3, 6, 1], num_layers=2, e=9, k=3, pad=0.2).with_micro_batch([1, 0, 1])
    b.sample_info["x"] = np.array([1.5, 2.5, 3.5])
    _write_v1(b, tmp_path / "v1.npz")
    b.save(tmp_path / "v2.npz")
    one, two = TraceBatch.load(tmp_path / "v1.npz"), TraceBatch.load(tmp_path / "v2.npz")
    _same_batch(b, one)
    _same_batch(b, two)
    np.testing.assert_array_equal(one.micro_batch_expert_counts(), two.micro_batch_expert_counts())


def test_counts_only_file(tmp_path):
    rng = np.random.default_rng(14)
    b = make_batch(rng, [4, 2], num_layers=2, e=5, k=2).with_micro_batch([0, 1])
    path = tmp_path / "c.npz"
    b.save(path, counts_only=True)
    with np.load(path) as f:
        assert bool(f["counts_only"]) and "experts" not in f.files
    c = TraceBatch.load(path)
    _same_batch(b, c)
    assert not c.has_ids
    for needs_ids in (lambda: c.trace(0), lambda: c.traces, lambda: c.save(tmp_path / "again.npz"),
                      lambda: c.subset([1]).trace(0)):
        with pytest.raises(TraceError, match=r"c.npz: a counts-only trace file \(counts_only=True\): field "
                                             r"'experts' \(per-token ids\) is absent"):
            needs_ids()
    c.save(tmp_path / "again.npz", counts_only=True)
    _same_batch(b, TraceBatch.load(tmp_path / "again.npz"))
    with pytest.raises(TraceError, match=r"counts_only must be a bool, got 1"):
        b.save(path, counts_only=1)


def test_storage_dtypes_are_the_smallest():
    from relibra_moe.trace import counts_dtype, file_ids_dtype
    assert [file_ids_dtype(e) for e in (2, 128, 129, 32768, 32769)] == [np.int8, np.int8, np.int16, np.int16, np.int32]
    assert [counts_dtype(c) for c in (0, 255, 256, 65535, 65536)] == [np.uint8, np.uint8, np.uint16, np.uint16,
                                                                      np.uint32]


def _v2_arrays(tmp_path) -> dict:
    b = make_batch(np.random.default_rng(15), [2, 3], num_layers=1, e=4, k=2)
    b.save(tmp_path / "ok.npz")
    with np.load(tmp_path / "ok.npz") as f:
        return {k: f[k] for k in f.files}


@pytest.mark.parametrize("change, match", [
    (lambda a: a | {"counts": a["counts"][:1]}, r"x.npz: counts must have shape \[N=2, L=1, E=4\], got \(1, 1, 4\)"),
    (lambda a: a | {"counts": a["counts"].astype(np.float32)}, r"x.npz: counts must hold integers, got dtype float32"),
    (lambda a: a | {"counts": np.array([[[3, 1, 0, 0]], [[1, 1, 2, 2]]], np.uint8)},
     r"x.npz: counts\[0, 0, 0\] = 3 > the 2 tokens of sample 0"),
    (lambda a: a | {"counts": np.array([[[2, 2, 1, 0]], [[1, 1, 2, 2]]], np.uint8)},
     r"x.npz: counts\[0, 0\] sums to 5 > k x tokens = 2 x 2"),
    (lambda a: a | {"counts_only": np.int64(1)}, r"x.npz: key 'counts_only' must be a bool scalar"),
    (lambda a: a | {"no_route": np.int64(255)}, r"x.npz: no_route=255: this library's 'no route' id is -1"),
    (lambda a: a | {"counts_only": np.bool_(True)}, r"x.npz: counts_only=True, but the file holds field 'experts'"),
    (lambda a: {k: v for k, v in a.items() if k != "experts"},
     r"x.npz: field 'experts' is missing, and counts_only=False"),
    (lambda a: {k: v for k, v in a.items() if k != "counts"}, r"x.npz: missing key\(s\) \['counts'\]"),
    (lambda a: a | {"version": np.int64(7)}, r"x.npz: unknown trace format version 7"),
    (lambda a: a | {"offsets": np.array([0, 3, 2])},
     r"x.npz: key 'offsets'\[1:3\] = \[3, 2\]: sample 1 has -1 tokens, outside \[0, "),
])
def test_v2_rejects_bad_fields(tmp_path, change, match):
    p = tmp_path / "x.npz"
    _write(p, **change(_v2_arrays(tmp_path)))
    with pytest.raises(TraceError, match=match):
        TraceBatch.load(p)


def test_planning_from_a_file_gives_the_plan_of_the_batch_in_memory(tmp_path):
    """Counts-only and with-ids files plan byte-identically to the in-memory synthetic batch."""
    from relibra_moe import cluster_preset, model_preset
    from relibra_moe.planners.strategies import plan_batch
    from relibra_moe.synthetic import rl_batch

    model = model_preset("qwen3-30b-a3b")
    cluster = cluster_preset("hopper-rail", nodes=2, gpus_per_node=8)
    batch = rl_batch(model, "mixed", 4, seed=0, micro_batch_size=8)
    batch.save(tmp_path / "ids.npz")
    batch.save(tmp_path / "counts.npz", counts_only=True)
    for strategy, r in (("lpt", 0), ("eplb", 2)):
        shas = []
        for b in (batch, TraceBatch.load(tmp_path / "ids.npz"), TraceBatch.load(tmp_path / "counts.npz")):
            out = tmp_path / f"plan{len(shas)}.npz"
            plan_batch(b, model, cluster, strategy, replica_slots=r, seed=0).save(out)
            shas.append(out.read_bytes())
        assert shas[0] == shas[1] == shas[2], strategy


def test_restrict_layers_keeps_the_first_layers_counts():
    rng = np.random.default_rng(3)
    batch = make_batch(rng, [5, 0, 7], num_layers=3).with_micro_batch_size(2)
    cut = batch.restrict_layers(2)
    ref = np.zeros((3, 2, 8), np.int64)  # float-free reference: count every (token, layer, slot) id by hand
    for i in range(3):
        for row in batch.trace(i).experts[:, :2]:
            for layer, ids in enumerate(row):
                for e in ids:
                    ref[i, layer, e] += 1
    np.testing.assert_array_equal(cut.sample_expert_counts(), ref)
    np.testing.assert_array_equal(cut.layer_ids, batch.layer_ids[:2])
    np.testing.assert_array_equal(cut.micro_batch, batch.micro_batch)
    np.testing.assert_array_equal(cut.lengths, batch.lengths)
    assert batch.restrict_layers(None) is batch and batch.restrict_layers(3) is batch
    for bad in (0, True, 1.5, "2"):
        with pytest.raises(TraceError, match=f"layers={bad!r} must be an int >= 1"):
            batch.restrict_layers(bad)


# ------------------------------------------------------------------------- one-pass id check and count
@pytest.mark.parametrize("dtype", [np.int8, np.int16, np.int64, np.uint8])
def test_check_ids_counts_in_the_same_pass(dtype):
    """check_ids' compiled pass fills counts equal to a float64 loop over the rows (-1 skipped), for every id dtype;
    _counts_of agrees."""
    from relibra_moe.trace import _counts_of, check_ids

    rng = np.random.default_rng(3)
    ids = random_ids(rng, 37, 4, 9, 3, pad=0.0 if dtype == np.uint8 else 0.2).astype(dtype)
    want = np.zeros((4, 9))
    for t in range(37):
        for layer in range(4):
            for v in ids[t, layer]:
                if int(v) >= 0:
                    want[layer, int(v)] += 1.0
    counts = np.zeros((4, 9), np.int64)
    check_ids(ids, 9, lambda t: f"row {t}", counts)
    np.testing.assert_array_equal(counts, want)
    np.testing.assert_array_equal(_counts_of(ids, 9), want)


def test_check_ids_names_the_first_bad_entry_after_the_fast_pass():
    from relibra_moe.trace import check_ids

    ids = np.array([[[0, 1], [2, 3]], [[1, 2], [3, 3]]], dtype=np.int16)
    with pytest.raises(TraceError, match=r"row 1, layer 1: duplicate expert id 3"):
        check_ids(ids, 4, lambda t: f"row {t}", np.zeros((2, 4), np.int64))
    ids[0, 1, 0] = 4
    with pytest.raises(TraceError, match=r"row 0, layer 1, slot 0: expert id 4 out of range"):
        check_ids(ids, 4, lambda t: f"row {t}")


def test_save_streams_ids_and_rejects_a_sequence_of_the_wrong_length(tmp_path):
    """The experts member is written sequence by sequence: equal to the concatenated ids on load; a sequence whose
    rows disagree with its length raises TraceError naming it (nothing half-written is read back as valid)."""
    from relibra_moe.trace_files import write_trace_file

    rng = np.random.default_rng(4)
    b = make_batch(rng, [3, 0, 5], num_layers=2, e=6, k=2, pad=0.1)
    b.save(tmp_path / "b.npz")
    back = TraceBatch.load(tmp_path / "b.npz")
    np.testing.assert_array_equal(np.concatenate([t.experts for t in back.traces]),
                                  np.concatenate([t.experts for t in b.traces]))
    seqs = [t.experts for t in b.traces]
    kw = dict(num_experts=6, top_k=2, layer_ids=b.layer_ids, lengths=b.lengths, starts=np.zeros(3, np.int64),
              micro_batch=None, source="unit", counts=b.sample_expert_counts(), info={})
    with pytest.raises(TraceError, match=r"sequence 2: ids of shape \[4, 2, 2\], the lengths say \[5, 2, 2\]"):
        write_trace_file(tmp_path / "bad.npz", experts=iter([seqs[0], seqs[1], seqs[2][:4]]), **kw)
    with pytest.raises(TraceError, match="2 sequences of ids for 3 lengths"):
        write_trace_file(tmp_path / "short.npz", experts=iter(seqs[:2]), **kw)
