"""npzio: headers are checked before any allocation (declared size, stored size, objects), errors name the file,
the member and the numbers."""

from __future__ import annotations

import io
import zipfile

import numpy as np
import pytest

from relibra_moe.errors import PlanError, TraceError
from relibra_moe.npzio import MAX_MEMBER_BYTES, member_header, read_member


def _npz(tmp_path, **arrays) -> np.lib.npyio.NpzFile:
    path = tmp_path / "a.npz"
    np.savez(path, **arrays)
    return np.load(path, allow_pickle=False)


def test_reads_a_good_member_with_its_declared_header(tmp_path):
    x = np.arange(12, dtype=np.int16).reshape(3, 4)
    with _npz(tmp_path, x=x) as data:
        assert member_header(data, "x", "a.npz", TraceError) == ((3, 4), np.dtype(np.int16))
        np.testing.assert_array_equal(read_member(data, "x", "a.npz", TraceError, kinds="iu", ndim=2), x)


def test_missing_kind_and_rank_are_named(tmp_path):
    with _npz(tmp_path, x=np.zeros((2, 2), np.float32)) as data:
        with pytest.raises(TraceError, match=r"a.npz: missing key 'y'"):
            read_member(data, "y", "a.npz", TraceError)
        with pytest.raises(PlanError, match=r"key 'x' has dtype float32, expected kind 'iu'"):
            read_member(data, "x", "a.npz", PlanError, kinds="iu")
        with pytest.raises(TraceError, match=r"key 'x' has shape \[2, 2\], expected 1 dimension"):
            read_member(data, "x", "a.npz", TraceError, ndim=1)


def test_declared_size_over_the_limit_is_refused_before_reading(tmp_path):
    # 2 x 3 int64 = 48 bytes; a limit of 40 refuses it from the header alone
    with _npz(tmp_path, x=np.zeros((2, 3), np.int64)) as data:
        with pytest.raises(TraceError, match=r"declares shape \[2, 3\] of int64 = 48 bytes, over the limit of 40"):
            read_member(data, "x", "a.npz", TraceError, max_bytes=40)
        assert read_member(data, "x", "a.npz", TraceError, max_bytes=48).shape == (2, 3)
    assert MAX_MEMBER_BYTES == 2**34


def _forged(tmp_path, shape: tuple[int, ...]) -> np.lib.npyio.NpzFile:
    """An archive whose member "x" stores 4 int32 values (16 bytes) under a header that declares ``shape``."""
    buf = io.BytesIO()
    np.lib.format.write_array_header_1_0(buf, {"descr": "<i4", "fortran_order": False, "shape": shape})
    buf.write(np.arange(4, dtype="<i4").tobytes())
    path = tmp_path / "forged.npz"
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("x.npy", buf.getvalue())
    return np.load(path, allow_pickle=False)


def test_a_header_claiming_more_than_stored_is_refused(tmp_path):
    with _forged(tmp_path, (8, 24, 2**20)) as data:  # 805 MB declared, 16 bytes stored
        with pytest.raises(TraceError, match=r"= 805306368 bytes, but stores 16 bytes of data"):
            read_member(data, "x", "forged.npz", TraceError)
    with _forged(tmp_path, (4,)) as data:  # the honest header reads
        np.testing.assert_array_equal(read_member(data, "x", "forged.npz", TraceError), np.arange(4))


def test_object_members_are_refused(tmp_path):
    path = tmp_path / "obj.npz"
    np.savez(path, x=np.array([{"a": 1}], dtype=object))
    with np.load(path, allow_pickle=False) as data:
        with pytest.raises(TraceError, match=r"key 'x' holds Python objects \(pickled\) of dtype object"):
            read_member(data, "x", "obj.npz", TraceError)


def test_a_corrupt_header_is_named(tmp_path):
    path = tmp_path / "bad.npz"
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("x.npy", b"not an npy file at all")
    with np.load(path, allow_pickle=False) as data:
        with pytest.raises(TraceError, match=r"key 'x' is truncated or corrupt \(unreadable .npy header"):
            read_member(data, "x", "bad.npz", TraceError)
