"""trace_files: the file's dtypes are the smallest that hold the values, the checks name the key and the index,
a written file reads back member for member (compared with the plain numpy reading of the same file)."""

from __future__ import annotations

import numpy as np
import pytest

from relibra_moe.errors import TraceError
from relibra_moe.trace_files import (
    FORMAT_VERSION,
    MAX_SEQUENCE_TOKENS,
    NO_ROUTE,
    as_int_array,
    check_layer_ids,
    check_offsets,
    counts_dtype,
    file_ids_dtype,
    read_trace_file,
    write_trace_file,
)


@pytest.mark.parametrize("num_experts, dtype", [(1, np.int8), (128, np.int8), (129, np.int16), (32768, np.int16),
                                                (32769, np.int32)])
def test_ids_dtype_is_the_smallest_signed_one(num_experts, dtype):
    assert file_ids_dtype(num_experts) == np.dtype(dtype)  # ids 0..E-1 and NO_ROUTE = -1


@pytest.mark.parametrize("max_count, dtype", [(0, np.uint8), (255, np.uint8), (256, np.uint16), (65535, np.uint16),
                                              (65536, np.uint32), (2**32, np.uint64)])
def test_counts_dtype_is_the_smallest_unsigned_one(max_count, dtype):
    assert counts_dtype(max_count) == np.dtype(dtype)


def test_as_int_array_and_its_errors():
    np.testing.assert_array_equal(as_int_array("ids", [[1, 2], [3, 4]]), [[1, 2], [3, 4]])
    with pytest.raises(TraceError, match="ids must hold integers, got dtype float64"):
        as_int_array("ids", [1.5])
    with pytest.raises(TraceError, match="ids is not a rectangular integer array"):
        as_int_array("ids", [[1, 2], [3]])


def test_layer_ids_checks():
    check_layer_ids(np.array([3, 1, 7]))
    with pytest.raises(TraceError, match=r"layer_ids must be distinct, got \[1, 1\]"):
        check_layer_ids(np.array([1, 1]))
    with pytest.raises(TraceError, match=r"layer_ids must lie in \[0, 2147483647\], got \[-1\]"):
        check_layer_ids(np.array([-1]))


def test_offsets_checks_name_the_index():
    check_offsets(np.array([0, 3, 3, 10], np.int64))
    with pytest.raises(TraceError, match=r"'offsets'\[0\] = 2: offsets must rise from 0"):
        check_offsets(np.array([2, 3], np.int64))
    with pytest.raises(TraceError, match=r"'offsets'\[1:3\] = \[5, 4\]: sample 1 has -1 tokens"):
        check_offsets(np.array([0, 5, 4], np.int64))
    with pytest.raises(TraceError, match=r"sample 0 has 2147483648 tokens"):
        check_offsets(np.array([0, MAX_SEQUENCE_TOKENS + 1], np.int64))
    with pytest.raises(TraceError, match=r"'offsets'\[1\] = -1 is outside"):
        check_offsets(np.array([0, -1], np.int64))


def test_written_file_reads_back(tmp_path):
    ids = [np.array([[[0, 2]], [[1, 2]]], np.int64), np.array([[[2, 0]]], np.int64)]  # [S_i, L=1, k=2]
    counts = np.array([[[1, 1, 2]], [[1, 0, 1]]])  # [N=2, L=1, E=3], counted by hand from ids
    path = tmp_path / "t.npz"
    write_trace_file(path, num_experts=3, top_k=2, layer_ids=np.array([5]), lengths=np.array([2, 1]),
                     starts=np.array([0, 7]), micro_batch=None, source="hand", counts=counts, experts=iter(ids),
                     info={"domain": np.array(["math", "code"])})
    with np.load(path, allow_pickle=False) as raw:  # the plain numpy reading of the same members
        assert raw["experts"].dtype == np.int8 and raw["counts"].dtype == np.uint8
        np.testing.assert_array_equal(raw["experts"], np.concatenate(ids))
        np.testing.assert_array_equal(raw["offsets"], [0, 2, 3])
        np.testing.assert_array_equal(raw["micro_batch"], [-1, -1])
        assert int(raw["no_route"]) == NO_ROUTE and not bool(raw["counts_only"])
    version, arrays, header = read_trace_file(path)
    assert version == FORMAT_VERSION == 2
    assert header == ((3, 1, 2), np.dtype(np.int8))  # the ids are left in the file, their header checked
    assert "experts" not in arrays
    np.testing.assert_array_equal(arrays["counts"], counts)
    np.testing.assert_array_equal(arrays["info_domain"], ["math", "code"])
    assert str(arrays["source"]) == "hand" and int(arrays["topk"]) == 2


def test_ids_of_the_wrong_shape_are_refused(tmp_path):
    with pytest.raises(TraceError, match=r"sequence 0: ids of shape \[3, 1, 2\], the lengths say \[2, 1, 2\]"):
        write_trace_file(tmp_path / "t.npz", num_experts=3, top_k=2, layer_ids=np.array([0]),
                         lengths=np.array([2]), starts=np.array([0]), micro_batch=None, source="",
                         counts=np.zeros((1, 1, 3), np.int64), experts=iter([np.zeros((3, 1, 2), np.int64)]), info={})
    assert not (tmp_path / "t.npz").exists()  # the atomic write left nothing behind
