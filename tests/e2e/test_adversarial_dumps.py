"""Hostile and damaged framework dumps through ``relibra trace import``: no code from a file runs, no declared
size is allocated before it is checked, and every failure is a TraceError naming the file (and the field).

Every malicious pickle here is real: its ``__reduce__`` calls ``os.system`` / ``open`` on a marker path, so a
loader that runs the file's code creates the marker. The checks are from the CLI (exit status 1, one named
error line, no traceback) and from :func:`relibra_moe.dumps.read_dump`."""

from __future__ import annotations

import io
import json
import os
import pickle
import sys
import types
import zipfile

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from relibra_moe.cli import main  # noqa: E402
from relibra_moe.dumps import read_dump  # noqa: E402
from relibra_moe.errors import TraceError  # noqa: E402
from relibra_moe.trace import TraceBatch  # noqa: E402

E, K, L = 8, 2, 3


class _System:
    """Unpickles to ``os.system("touch MARKER")``."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


class _Open:
    """Unpickles to ``open(MARKER, "w")`` (creates the file)."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


class Custom:
    """A class of this module: importable, so ``--trust-pickle`` can load a dump that holds one."""

    def __init__(self):
        self.note = "mine"


def _ids(rows: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.argsort(rng.random((rows, L, E)), axis=-1)[..., :K].astype(np.int64)


def _cli(capsys, fmt, path, out, *extra):
    rc = main(["trace", "import", fmt, str(path), "--out", str(out), "--num-experts", str(E), *extra])
    cap = capsys.readouterr()
    return rc, cap.out + cap.err


def _refused(capsys, fmt, path, tmp_path, *fragments):
    rc, text = _cli(capsys, fmt, path, tmp_path / "refused.npz")
    assert rc == 1 and "error: TraceError: " in text and "Traceback" not in text, text
    assert str(path) in text, text
    for frag in fragments:
        assert frag in text, (frag, text)
    assert not (tmp_path / "refused.npz").exists()
    return text


def _verl_module(getstate):
    """A stand-in ``verl.protocol.DataProto`` whose ``__getstate__`` is ``getstate`` (verl's own layouts)."""
    mod = types.ModuleType("verl.protocol")

    class DataProto:
        def __init__(self, batch):
            self.batch = batch

        def __getstate__(self):
            return getstate(self.batch)

    DataProto.__module__, DataProto.__qualname__ = "verl.protocol", "DataProto"
    mod.DataProto = DataProto
    return mod


def _pickle_dataproto(path, batch, getstate):
    mod = _verl_module(getstate)
    sys.modules.update({"verl": types.ModuleType("verl"), "verl.protocol": mod})
    try:
        with open(path, "wb") as f:
            pickle.dump(mod.DataProto(batch), f)
    finally:
        del sys.modules["verl.protocol"], sys.modules["verl"]


def _torch_bytes(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


# ------------------------------------------------------------------------------------- code in the file
def _malicious(fmt, payload, tmp_path):
    """A dump of ``fmt`` carrying ``payload`` (an object whose unpickling runs code) where its data would be."""
    ids = torch.from_numpy(_ids(4)[None])
    mask = torch.ones(1, 4, dtype=torch.int64)
    path = tmp_path / f"{fmt}.{'pkl' if fmt == 'verl-pkl' else 'pt'}"
    if fmt == "verl-pkl":  # the code sits in the DataProto's non_tensor_batch, the batch is valid
        _pickle_dataproto(path, {"routed_experts": ids, "attention_mask": mask},
                          lambda b: (_torch_bytes(b), {"uid": payload}, {}))
    elif fmt == "verl-pkl-batch":  # the code sits in the torch.save bytes of the batch
        path = tmp_path / "verl-batch.pkl"
        _pickle_dataproto(path, {"routed_experts": ids, "attention_mask": mask, "x": payload},
                          lambda b: (_torch_bytes(b), {}, {}))
    elif fmt == "verl":
        torch.save({"routed_experts": ids, "attention_mask": mask, "extra": payload}, path)
    elif fmt == "slime":
        torch.save({"rollout_id": 0, "samples": [{"tokens": list(range(5)), "rollout_routed_experts": _ids(4),
                                                  "metadata": payload}]}, path)
    elif fmt == "nemo-rl":
        torch.save({"routed_experts": ids, "input_lengths": torch.tensor([4]), "x": payload}, path)
    elif fmt == "vllm":
        torch.save([{"routed_experts": _ids(4), "x": payload}], path)
    else:
        torch.save([torch.from_numpy(_ids(4)[:, i]) for i in range(L)] + [payload], path)
    return path


FORMATS = ["verl-pkl", "verl-pkl-batch", "verl", "slime", "nemo-rl", "vllm", "megatron"]


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("kind", [_System, _Open])
def test_a_crafted_dump_never_runs_its_code(fmt, kind, tmp_path, capsys):
    marker = tmp_path / "marker"
    path = _malicious(fmt, kind(marker), tmp_path)
    cli_fmt = "verl" if fmt.startswith("verl") else fmt
    text = _refused(capsys, cli_fmt, path, tmp_path, "not on the allow-list", "--trust-pickle")
    assert ("system" in text) or ("open" in text), text  # the refused global is named
    assert not marker.exists()
    with pytest.raises(TraceError, match="not on the allow-list"):
        read_dump(cli_fmt, [path], num_experts=E)
    assert not marker.exists()
    try:  # the payload is live: loading with the file's own code (--trust-pickle) runs it
        read_dump(cli_fmt, [path], num_experts=E, trust_pickle=True)
    except TraceError:
        pass
    assert marker.exists()


def test_trust_pickle_is_the_only_way_to_run_a_files_classes(tmp_path, capsys):
    torch.save({"routed_experts": torch.from_numpy(_ids(4)[None]), "attention_mask": torch.ones(1, 4),
                "mine": Custom()}, tmp_path / "mine.pt")
    _refused(capsys, "verl", tmp_path / "mine.pt", tmp_path, f"'{__name__}.Custom'", "--trust-pickle")
    rc, text = _cli(capsys, "verl", tmp_path / "mine.pt", tmp_path / "out.npz", "--trust-pickle")
    assert rc == 0, text
    np.testing.assert_array_equal(TraceBatch.load(tmp_path / "out.npz").traces[0].experts, _ids(4))
    with pytest.raises(SystemExit):
        main(["trace", "import", "-h"])
    assert "--trust-pickle" in capsys.readouterr().out


# ------------------------------------------------------------------------------------- declared sizes
class _BigArray:
    """Unpickles to numpy's ``_reconstruct(ndarray, (2**40,), 'b')``: a 1 TiB array, declared."""

    def __reduce__(self):
        return (np._core.multiarray._reconstruct, (np.ndarray, (1 << 40,), b"b"))


def _laughs(depth: int = 40):
    x = [0]
    for _ in range(depth):
        x = [x, x]
    return x


@pytest.mark.parametrize("container", ["torch", "pickle"])
@pytest.mark.parametrize("bomb", ["laughs", "big-array", "deep"])
def test_pickle_bombs_are_trace_errors(container, bomb, tmp_path, capsys):
    payload = {"laughs": _laughs(), "big-array": _BigArray(), "deep": None}[bomb]
    if bomb == "deep":
        payload = []
        for _ in range(200):
            payload = [payload]
    if container == "torch":
        path = tmp_path / "bomb.pt"
        torch.save({"routed_experts": payload, "attention_mask": torch.ones(1, 4)}, path)
    else:
        path = tmp_path / "bomb.pkl"
        _pickle_dataproto(path, {}, lambda b: (b"", {"x": payload}, {}))
    want = {"laughs": "pickle bomb", "big-array": "over the limit", "deep": "deeper than"}[bomb]
    _refused(capsys, "verl", path, tmp_path, want)


def test_a_stride_0_tensor_does_not_become_a_huge_trace(tmp_path, capsys):
    ids = torch.from_numpy(_ids(1)[None]).expand(1, 1 << 20, L, K)  # 1 row stored, 2^20 declared
    torch.save({"routed_experts": ids, "attention_mask": torch.ones(1, 1).expand(1, 1 << 20)}, tmp_path / "v.pt")
    assert (tmp_path / "v.pt").stat().st_size < 4096
    _refused(capsys, "verl", tmp_path / "v.pt", tmp_path, "strides", "refused")
    # megatron: one [T, k] tensor per layer declaring 2^30 tokens over one stored row
    row = torch.zeros(1, K, dtype=torch.int64)
    torch.save([row.expand(1 << 30, K) for _ in range(L)], tmp_path / "m.pt")
    _refused(capsys, "megatron", tmp_path / "m.pt", tmp_path, "[1073741824, 2]", "refused")


def test_a_zip_declaring_more_than_the_limit_is_not_read(tmp_path, capsys):
    data = _torch_bytes({"routed_experts": torch.zeros(1, 2, L, K, dtype=torch.int64)})
    with zipfile.ZipFile(io.BytesIO(data)) as zf:
        members = [(i, zf.read(i)) for i in zf.infolist()]
    with zipfile.ZipFile(tmp_path / "z.pt", "w") as out:
        for info, blob in members:
            out.writestr(info, blob)
    raw = bytearray((tmp_path / "z.pt").read_bytes())
    # forge every central-directory entry's uncompressed size to ~4 GiB (the check reads the declared sizes
    # before anything is extracted)
    cd = raw.find(b"PK\x01\x02")
    assert cd > 0
    while cd >= 0:
        raw[cd + 24:cd + 28] = (0xFFFFFFF0).to_bytes(4, "little")
        cd = raw.find(b"PK\x01\x02", cd + 1)
    (tmp_path / "z.pt").write_bytes(bytes(raw))
    _refused(capsys, "verl", tmp_path / "z.pt", tmp_path, "over the limit")


# ------------------------------------------------------------------------------------- npz and vllm .npz
def _forged(shape, dtype="<i8", payload=64) -> bytes:
    buf = io.BytesIO()
    np.lib.format.write_array_header_1_0(buf, {"descr": dtype, "fortran_order": False, "shape": shape})
    return buf.getvalue() + b"\0" * payload


def _npz_with(path, raw: dict[str, bytes] | None = None, **arrays):
    with zipfile.ZipFile(path, "w") as z:
        for key, value in arrays.items():
            buf = io.BytesIO()
            np.save(buf, value, allow_pickle=True)
            z.writestr(key + ".npy", buf.getvalue())
        for key, blob in (raw or {}).items():
            z.writestr(key + ".npy", blob)


@pytest.mark.parametrize("fmt,key", [("npz", "ids"), ("vllm", "routed_experts")])
@pytest.mark.parametrize("damage", ["truncated", "empty", "huge", "short", "pickled"])
def test_npz_damage_names_file_and_member(fmt, key, damage, tmp_path, capsys):
    good = {"npz": dict(ids=_ids(6), offsets=np.array([0, 2, 6]), num_experts=np.int64(E)),
            "vllm": dict(routed_experts=_ids(6)[None], response_mask=np.ones((1, 6), bool))}[fmt]
    path = tmp_path / "d.npz"
    if damage == "truncated":
        _npz_with(path, **good)
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
        _refused(capsys, fmt, path, tmp_path, "not a readable .npz")
        return
    if damage == "empty":
        path.write_bytes(b"")
        _refused(capsys, fmt, path, tmp_path, "not a readable .npz")
        return
    rest = {k: v for k, v in good.items() if k != key}
    if damage == "huge":
        _npz_with(path, raw={key: _forged((1 << 40, L, K))}, **rest)
        msg = "over the limit"
    elif damage == "short":
        _npz_with(path, raw={key: _forged((6, L, K), payload=8)}, **rest)
        msg = "stores 8 bytes"
    else:
        _npz_with(path, **{key: np.array([Custom()], dtype=object)}, **rest)
        msg = "Python objects"
    _refused(capsys, fmt, path, tmp_path, f"key '{key}'", msg)


@pytest.mark.parametrize("value", [np.float64(8.9), np.str_("eight"), np.array([8, 8]), np.bool_(True),
                                   np.int64(0)])
def test_npz_num_experts_must_be_a_positive_int_scalar(value, tmp_path, capsys):
    _npz_with(tmp_path / "n.npz", ids=_ids(4), offsets=np.array([0, 4]), num_experts=value)
    rc = main(["trace", "import", "npz", str(tmp_path / "n.npz"), "--out", str(tmp_path / "o.npz")])
    text = capsys.readouterr().err
    assert rc == 1 and "error: TraceError: " in text and "num_experts" in text and "Traceback" not in text, text
    assert not (tmp_path / "o.npz").exists()


def test_npz_num_experts_imports_exactly(tmp_path, capsys):
    _npz_with(tmp_path / "n.npz", ids=_ids(4), offsets=np.array([0, 1, 4]), num_experts=np.int64(E))
    rc = main(["trace", "import", "npz", str(tmp_path / "n.npz"), "--out", str(tmp_path / "o.npz")])
    assert rc == 0, capsys.readouterr().err
    b = TraceBatch.load(tmp_path / "o.npz")
    np.testing.assert_array_equal(np.concatenate([t.experts for t in b.traces]), _ids(4))
    assert b.num_experts == E


def test_deep_sglang_json_is_a_trace_error(tmp_path, capsys):
    (tmp_path / "deep.json").write_text("[" * 200_000 + "]" * 200_000)
    rc = main(["trace", "import", "sglang", str(tmp_path / "deep.json"), "--out", str(tmp_path / "o.npz"),
               "--top-k", str(K), "--num-experts", str(E)])
    text = capsys.readouterr().err
    assert rc == 1 and "deep.json" in text and "nests deeper" in text and "Traceback" not in text, text
    (tmp_path / "lines.jsonl").write_text('{"meta_info": {}}\n' + "[" * 200_000 + "\n")
    rc = main(["trace", "import", "sglang", str(tmp_path / "lines.jsonl"), "--out", str(tmp_path / "o.npz"),
               "--top-k", str(K), "--num-experts", str(E)])
    text = capsys.readouterr().err
    assert rc == 1 and "lines.jsonl" in text and "Traceback" not in text, text


# ------------------------------------------------------------------------------------- verl numpy, slime start
def _verl_numpy_state(batch):
    """verl 0.9.1's ``__getstate__`` under VERL_DATAPROTO_SERIALIZATION_METHOD=numpy (``serialize_tensordict``
    of protocol.py: ``(batch_size, device, {key: (dtype name, shape, uint8 array)})``)."""
    items = {k: (str(v.dtype).removeprefix("torch."), v.shape, v.flatten().contiguous().view(torch.uint8).numpy())
             for k, v in batch.items()}
    return (next(iter(batch.values())).shape[:1], None, items), {"uid": np.array(["a"], dtype=object)}, {}


def test_verl_numpy_serialization_imports_exactly(tmp_path, capsys):
    truth = [_ids(3, 1), _ids(5, 2)]
    S = 6
    ids = torch.zeros(2, S, L, K, dtype=torch.int64)
    mask = torch.zeros(2, S, dtype=torch.int64)
    ids[0, 1:4], mask[0, 1:4] = torch.from_numpy(truth[0]), 1  # left-padded, then right-padded
    ids[1, 0:5], mask[1, 0:5] = torch.from_numpy(truth[1]), 1
    _pickle_dataproto(tmp_path / "np.pkl", {"routed_experts": ids, "attention_mask": mask}, _verl_numpy_state)
    rc, text = _cli(capsys, "verl", tmp_path / "np.pkl", tmp_path / "out.npz")
    assert rc == 0, text
    got = TraceBatch.load(tmp_path / "out.npz")
    for t, want in zip(got.traces, truth, strict=True):
        np.testing.assert_array_equal(t.experts, want)  # = routed_experts[attention_mask == 1]

    def short(batch):  # the routed_experts bytes do not cover the declared shape
        state = _verl_numpy_state(batch)
        dtype, shape, data = state[0][2]["routed_experts"]
        state[0][2]["routed_experts"] = (dtype, shape, data[:-8])
        return state

    _pickle_dataproto(tmp_path / "short.pkl", {"routed_experts": ids, "attention_mask": mask}, short)
    _refused(capsys, "verl", tmp_path / "short.pkl", tmp_path, "field 'routed_experts'",
             "VERL_DATAPROTO_SERIALIZATION_METHOD=numpy")


def _slime_dump(path, rows_by_sample, start_key=None):
    samples = []
    for i, (n_tokens, rows) in enumerate(rows_by_sample):
        s = {"index": i, "tokens": list(range(n_tokens)), "rollout_routed_experts": _ids(rows, i).astype(np.int32),
             "status": "completed"}
        if start_key is not None:
            s["routed_experts_start_len"] = start_key
        samples.append(s)
    torch.save({"rollout_id": 0, "samples": samples}, path)


def test_slime_routed_experts_start_len(tmp_path, capsys):
    # tokens 12, routed_experts_start_len 3: SGLang returned rows for positions 3 .. 10 (8 rows)
    _slime_dump(tmp_path / "s.pt", [(12, 8), (5, 4)])
    rc, text = _cli(capsys, "slime", tmp_path / "s.pt", tmp_path / "out.npz")
    assert rc == 0, text
    got = TraceBatch.load(tmp_path / "out.npz")
    assert [t.start for t in got.traces] == [3, 0]  # the first 3 prompt tokens are not in the trace
    np.testing.assert_array_equal(got.traces[0].experts, _ids(8, 0))
    np.testing.assert_array_equal(got.traces[1].experts, _ids(4, 1))
    # the sample says its start: it must agree with the rows
    _slime_dump(tmp_path / "k.pt", [(12, 8)], start_key=3)
    assert _cli(capsys, "slime", tmp_path / "k.pt", tmp_path / "out.npz")[0] == 0
    _slime_dump(tmp_path / "bad.pt", [(12, 8)], start_key=2)
    _refused(capsys, "slime", tmp_path / "bad.pt", tmp_path, "len(tokens) - 1 - routed_experts_start_len")
    _slime_dump(tmp_path / "long.pt", [(5, 9)])
    _refused(capsys, "slime", tmp_path / "long.pt", tmp_path, "9 rows, more than len(tokens) - 1 = 4")
    _slime_dump(tmp_path / "neg.pt", [(12, 8)], start_key=-1)
    _refused(capsys, "slime", tmp_path / "neg.pt", tmp_path, "routed_experts_start_len")


@pytest.mark.parametrize("samples", [[{"tokens": 5, "rollout_routed_experts": np.zeros((4, L, K), np.int32)}],
                                     [{"tokens": [1, 2], "rollout_routed_experts": [[1, 2], [3]]}],
                                     [{"tokens": [1, 2], "rollout_routed_experts": "ids"}],
                                     [7]])
def test_slime_odd_fields_are_trace_errors(samples, tmp_path, capsys):
    torch.save({"rollout_id": 0, "samples": samples}, tmp_path / "odd.pt")
    _refused(capsys, "slime", tmp_path / "odd.pt", tmp_path, "samples[0]")


def test_json_dump_never_builds_a_partial_out_file(tmp_path, capsys):
    """A failed import leaves a previous --out file as it was."""
    (tmp_path / "out.npz").write_bytes(b"previous")
    (tmp_path / "bad.json").write_text(json.dumps({"meta_info": {"routed_experts": 5}}))
    rc = main(["trace", "import", "sglang", str(tmp_path / "bad.json"), "--out", str(tmp_path / "out.npz"),
               "--top-k", str(K), "--num-experts", str(E)])
    assert rc == 1
    assert (tmp_path / "out.npz").read_bytes() == b"previous"


def _fake_class(module: str, name: str, base: type) -> type:
    """A class pickled under ``module.name`` (a framework's), registered in ``sys.modules`` while it exists."""
    parts = module.split(".")
    for i in range(1, len(parts) + 1):
        sys.modules.setdefault(".".join(parts[:i]), types.ModuleType(".".join(parts[:i])))
    cls = type(name, (base,), {"__module__": module})
    setattr(sys.modules[module], name, cls)
    return cls


def _forget(module: str) -> None:
    for key in [k for k in sys.modules if k == module.split(".")[0] or k.startswith(module.split(".")[0] + ".")]:
        del sys.modules[key]


def test_framework_records_import_without_the_framework(tmp_path, capsys):
    """A TensorDict batch (verl) and a BatchedDataDict (NeMo-RL, a UserDict) are read as records: their
    tensors come out, no framework code is imported or run."""
    from collections import UserDict

    ids = torch.from_numpy(_ids(4)[None])
    TD = _fake_class("tensordict._td", "TensorDict", object)
    td = TD()
    td._tensordict, td._batch_size = {"routed_experts": ids, "attention_mask": torch.ones(1, 4)}, torch.Size([1])
    BDD = _fake_class("nemo_rl.distributed.batched_data_dict", "BatchedDataDict", UserDict)
    try:
        torch.save(td, tmp_path / "td.pt")
        torch.save(BDD({"routed_experts": ids, "input_lengths": torch.tensor([4])}), tmp_path / "bdd.pt")
    finally:
        _forget("tensordict._td")
        _forget("nemo_rl.distributed.batched_data_dict")
    for fmt, name in (("verl", "td.pt"), ("nemo-rl", "bdd.pt")):
        rc, text = _cli(capsys, fmt, tmp_path / name, tmp_path / f"{fmt}.npz")
        assert rc == 0, text
        np.testing.assert_array_equal(TraceBatch.load(tmp_path / f"{fmt}.npz").traces[0].experts, _ids(4))
