"""safe_pickle: the allow-list, the checked numpy constructors and the tree bounds, one rule per test."""

from __future__ import annotations

import io
import os
import pickle

import numpy as np
import pytest

from relibra_moe.errors import TraceError
from relibra_moe.safe_pickle import (
    MAX_DEPTH,
    PickledObject,
    check_tree,
    load_pickle,
    load_torch,
    stub_class,
)


class _Touch:
    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (os.system, (f"touch {self.path}",))


@pytest.mark.parametrize("protocol", [2, 4, 5])
def test_numpy_arrays_scalars_and_containers_round_trip(protocol):
    obj = {"i": np.arange(6, dtype=np.int32).reshape(2, 3), "f": np.asfortranarray(np.eye(3)),
           "o": np.array(["a", None], dtype=object), "s": np.int64(7), "t": (1, [2.5, "x"]), "b": b"\x00\xff",
           "set": {1, 2}}
    got = load_pickle(pickle.dumps(obj, protocol=protocol), "f")
    for k in ("i", "f"):
        assert type(got[k]) is np.ndarray
        np.testing.assert_array_equal(got[k], obj[k])
    assert got["o"].tolist() == ["a", None] and got["s"] == 7 and got["t"] == (1, [2.5, "x"])
    assert got["b"] == b"\x00\xff" and got["set"] == {1, 2}


def test_a_global_outside_the_allow_list_is_named_and_not_run(tmp_path):
    with pytest.raises(TraceError, match=r"f: the pickle names 'posix.system'.*--trust-pickle"):
        load_pickle(pickle.dumps([_Touch(tmp_path / "m")]), "f")
    assert not (tmp_path / "m").exists()
    load_pickle(pickle.dumps([_Touch(tmp_path / "m")]), "f", trust=True)  # trust runs it: the payload is live
    assert (tmp_path / "m").exists()


def test_stubs_record_a_framework_object_without_its_class():
    class DataProto:
        def __init__(self):
            self.x = 1

        def __getstate__(self):
            return (b"batch", {"k": 1}, {})

    DataProto.__module__, DataProto.__qualname__ = __name__, "DataProto"
    globals()["DataProto"] = DataProto
    try:
        data = pickle.dumps(DataProto())
    finally:
        del globals()["DataProto"]
    name = f"{__name__}.DataProto"
    got = load_pickle(data, "f", stubs={name: stub_class(name)})
    assert isinstance(got, PickledObject) and got.pickled_name == name and got.state == (b"batch", {"k": 1}, {})


class _Reconstruct:
    def __init__(self, shape, dtype=b"b", cls=np.ndarray):
        self.args = (cls, shape, dtype)

    def __reduce__(self):
        return (np._core.multiarray._reconstruct, self.args)


def test_declared_array_sizes_are_bounded_before_allocation():
    with pytest.raises(TraceError, match="over the limit"):
        load_pickle(pickle.dumps(_Reconstruct((1 << 40,))), "f")
    with pytest.raises(TraceError, match="'numpy.matrix'"):
        load_pickle(pickle.dumps(_Reconstruct((1,), cls=np.matrix)), "f")
    good = pickle.dumps(np.arange(4, dtype=np.int64), protocol=2)
    forged = good.replace(b"K\x04\x85", b"J\x00\x00\x00\x40\x85")  # the state's shape (4,) -> (2**30,)
    assert forged != good
    with pytest.raises(TraceError, match="declares shape"):
        load_pickle(forged, "f")


def test_tree_bounds_depth_and_shared_references():
    deep: list = []
    for _ in range(MAX_DEPTH + 5):
        deep = [deep]
    with pytest.raises(TraceError, match="deeper than"):
        check_tree(deep, "f")
    x: list = [0]
    for _ in range(40):
        x = [x, x]
    with pytest.raises(TraceError, match="pickle bomb"):
        load_pickle(pickle.dumps(x), "f")
    cyclic: list = []
    cyclic.append(cyclic)
    with pytest.raises(TraceError, match="deeper than"):
        load_pickle(pickle.dumps(cyclic), "f")
    assert check_tree([[1], [2]], "f") == [[1], [2]]


def test_damaged_streams_are_trace_errors():
    for data in (b"", b"\x80\x05", pickle.dumps({"a": 1})[:-3], b"garbage"):
        with pytest.raises(TraceError, match="^f: "):
            load_pickle(data, "f")
    # a bytearray declaring 8 GiB in a 30-byte file: refused before pickle allocates the declared size
    forged = b"\x80\x05\x96" + (1 << 33).to_bytes(8, "little") + b"\x00" * 16 + b"."
    with pytest.raises(TraceError, match="expected 8589934592 bytes in a bytearray8"):
        load_pickle(forged, "f")


def test_torch_files_load_weights_only_with_tensors_bounded_by_storage():
    torch = pytest.importorskip("torch")
    buf = io.BytesIO()
    torch.save({"t": torch.arange(6).view(2, 3), "a": np.arange(3), "size": torch.Size([1])}, buf)
    got = load_torch(buf.getvalue(), "f")
    assert got["t"].tolist() == [[0, 1, 2], [3, 4, 5]] and type(got["a"]) is np.ndarray
    buf = io.BytesIO()
    torch.save({"t": torch.zeros(1).expand(100)}, buf)
    with pytest.raises(TraceError, match=r"shape \[100\] and strides \[0\]"):
        load_torch(buf.getvalue(), "f")
    buf = io.BytesIO()
    torch.save({"x": _Touch("/nonexistent/never")}, buf)
    with pytest.raises(TraceError, match="'posix.system'"):
        load_torch(buf.getvalue(), "f")
    buf = io.BytesIO()
    torch.save({"a": 1}, buf, _use_new_zipfile_serialization=False)
    with pytest.raises(TraceError, match="legacy"):
        load_torch(buf.getvalue(), "f")


class _Record:
    """A class a dump may not hold unless someone allows it."""

    def __init__(self, value: int) -> None:
        self.value = value


def test_a_process_wide_allow_list_neither_replaces_nor_widens_ours(tmp_path):
    """torch keeps one process-wide allow-list (accelerate / transformers add the real numpy rebuild functions to
    it): load_torch reads with exactly its own list, so a dump still loads through the size-checked rebuilders, a
    class another library allowed is still refused, and the process-wide list is restored."""
    import numpy as np
    import torch

    from relibra_moe.errors import TraceError
    from relibra_moe.safe_pickle import load_torch

    arr = np.arange(6, dtype=np.int64).reshape(2, 3)
    good, bad = tmp_path / "good.pt", tmp_path / "bad.pt"
    torch.save({"a": arr}, good)
    torch.save({"c": _Record(3)}, bad)
    extra = [np._core.multiarray._reconstruct, np.ndarray, np.dtype, type(np.dtype(np.int64)), _Record]
    before = torch.serialization.get_safe_globals()
    torch.serialization.add_safe_globals(extra)
    try:
        for _ in range(20):  # the process-wide set's iteration order varies with its contents
            np.testing.assert_array_equal(load_torch(good, "good.pt")["a"], arr)
        with pytest.raises(TraceError, match="allow-list"):
            load_torch(bad, "bad.pt")
        assert set(torch.serialization.get_safe_globals()) == set(before) | set(extra)
    finally:
        torch.serialization.clear_safe_globals()
        torch.serialization.add_safe_globals(before)
