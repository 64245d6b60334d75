"""dumps: read_dump's npz, vllm and megatron layouts give the sequences written by hand, several files are one
batch in file order, and bad input is a TraceError that names the file and the field."""

from __future__ import annotations

import numpy as np
import pytest

from relibra_moe.dumps import FORMATS, read_dump
from relibra_moe.errors import TraceError

IDS = np.array([[[0, 1], [2, 3]], [[1, 2], [3, 0]], [[3, 1], [0, 2]]], np.int64)  # [rows=3, L=2, k=2]


def _npz(tmp_path, name="d.npz", **arrays):
    path = tmp_path / name
    np.savez(path, **arrays)
    return path


def test_npz_offsets_cut_the_sequences(tmp_path):
    path = _npz(tmp_path, ids=IDS, offsets=np.array([0, 1, 3]), num_experts=np.int64(4),
                layer_ids=np.array([1, 3]), micro_batch=np.array([0, 1]))
    batch = read_dump("npz", [path])
    assert batch.num_sequences == 2
    np.testing.assert_array_equal(batch.traces[0].experts, IDS[:1])
    np.testing.assert_array_equal(batch.traces[1].experts, IDS[1:])
    np.testing.assert_array_equal(batch.traces[0].layer_ids, [1, 3])
    np.testing.assert_array_equal(batch.micro_batch, [0, 1])
    # counts by hand: sequence 1 (rows 1, 2), layer 0 routes to {1, 2} and {3, 1}
    np.testing.assert_array_equal(batch.sample_expert_counts()[1, 0], [0, 2, 1, 1])


def test_several_files_are_one_batch_in_file_order(tmp_path):
    a = _npz(tmp_path, "a.npz", ids=IDS[:1], offsets=np.array([0, 1]), num_experts=np.int64(4))
    b = _npz(tmp_path, "b.npz", ids=IDS[1:], offsets=np.array([0, 2]), num_experts=np.int64(4))
    batch = read_dump("npz", [b, a])
    assert batch.num_sequences == 2
    np.testing.assert_array_equal(batch.traces[0].experts, IDS[1:])
    np.testing.assert_array_equal(batch.traces[1].experts, IDS[:1])


@pytest.mark.parametrize("arrays, match", [
    ({"ids": IDS, "offsets": np.array([0, 2])}, r"field 'offsets' must be \[B \+ 1\] non-decreasing from 0 to the "
                                                r"3 rows"),
    ({"ids": IDS[0], "offsets": np.array([0, 2])}, r"field 'ids' must have rank 3"),
    ({"offsets": np.array([0, 3])}, r"ids"),
    ({"ids": IDS, "offsets": np.array([0, 3]), "num_experts": np.int64(8)}, r"field 'num_experts' = 8, the model "
                                                                            r"has num_experts=4"),
])
def test_npz_errors_name_the_file_and_the_field(tmp_path, arrays, match):
    path = _npz(tmp_path, **arrays)
    with pytest.raises(TraceError, match=match) as exc:
        read_dump("npz", [path], num_experts=4)
    assert str(exc.value).startswith(f"{path}:")


def test_vllm_rollout_keeps_prompt_then_response_rows(tmp_path):
    prompt = IDS[None, :1]  # [B=1, P=1, L, k]
    response = IDS[None, 1:]  # [B=1, R=2, L, k]
    path = _npz(tmp_path, "v.npz", routed_experts=response, prompt_routed_experts=prompt)
    batch = read_dump("vllm", [path], num_experts=4)
    assert batch.num_sequences == 1
    np.testing.assert_array_equal(batch.traces[0].experts, IDS)


def test_megatron_tensor_is_one_sequence(tmp_path):
    path = tmp_path / "m.npy"
    np.save(path, IDS)  # one [T, L, k] array
    batch = read_dump("megatron", [path], num_experts=4)
    assert batch.num_sequences == 1
    np.testing.assert_array_equal(batch.traces[0].experts, IDS)
    with pytest.raises(TraceError, match=r"format .megatron. needs the expert count: pass --num-experts E"):
        read_dump("megatron", [path])  # a padded format: E must be given


def test_format_and_file_errors(tmp_path):
    assert "npz" in FORMATS and "sglang" in FORMATS
    with pytest.raises(TraceError, match=r"unknown dump format 'parquet'; known: verl, slime"):
        read_dump("parquet", [tmp_path / "x"])
    with pytest.raises(TraceError, match=r"format 'npz' needs at least one dump file"):
        read_dump("npz", [])
    with pytest.raises(TraceError, match=r"nope.npz: no such file"):
        read_dump("npz", [tmp_path / "nope.npz"])
    bad = tmp_path / "bad.json"
    bad.write_text("{not json\n")
    with pytest.raises(TraceError, match=r"bad.json: line 1 is not JSON"):
        read_dump("sglang", [bad])
