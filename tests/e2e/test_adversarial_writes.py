"""A write killed part way never destroys the previous file nor leaves a loadable partial one.

``BatchPlan.save`` and ``TraceBatch.save`` are interrupted at every member boundary (the k-th member write
raises ``KeyboardInterrupt``, as a Ctrl-C would): the previous file must still load and equal what it was,
and no other file may appear in the directory. The CLI's outputs (plan, trace, profile, JSON) into a missing
directory or onto a directory are named errors."""

from __future__ import annotations

import json
import zipfile

import numpy as np
import pytest

from relibra_moe.cli import main
from relibra_moe.plan import BatchPlan
from relibra_moe.planners.strategies import plan_batch
from relibra_moe.specs import cluster_preset, model_preset
from relibra_moe.trace import TraceBatch

MODEL = "gpt-oss-20b"


def _batch(seed: int, n: int = 8) -> TraceBatch:
    model = model_preset(MODEL)
    rng = np.random.default_rng(seed)
    counts = np.zeros((n, model.num_layers, model.num_experts), np.int64)
    for i in range(n):
        tokens = int(rng.integers(3, 9))
        for l in range(model.num_layers):
            for _ in range(tokens):
                counts[i, l, rng.choice(model.num_experts, model.top_k, replace=False)] += 1
    return TraceBatch.from_counts(counts, model.top_k).with_micro_batch(np.arange(n) // 4)


def _interrupt_at(monkeypatch, method: str, k: int) -> list[int]:
    """Make the k-th call (0-based) of ``zipfile.ZipFile.<method>`` raise KeyboardInterrupt."""
    real = getattr(zipfile.ZipFile, method)
    calls = [0]

    def wrapped(self, *args, **kwargs):
        calls[0] += 1
        if calls[0] - 1 == k:
            raise KeyboardInterrupt
        return real(self, *args, **kwargs)

    monkeypatch.setattr(zipfile.ZipFile, method, wrapped)
    return calls


def test_a_plan_save_killed_at_every_member_boundary_keeps_the_old_plan(tmp_path, monkeypatch):
    model, cluster = model_preset(MODEL), cluster_preset(nodes=1, gpus_per_node=4)
    old = plan_batch(_batch(0), model, cluster, strategy="static")
    new = plan_batch(_batch(1), model, cluster, strategy="eplb")
    path = tmp_path / "plan.npz"
    old.save(path)
    before = path.read_bytes()
    with zipfile.ZipFile(path) as zf:
        members = len(zf.namelist())
    assert members > 10
    for k in range(members + 1):  # k = members: the interrupt hits the close (no write left to stop)
        with monkeypatch.context() as m:
            calls = _interrupt_at(m, "writestr", k)
            if k < members:
                with pytest.raises(KeyboardInterrupt):
                    new.save(path)
                assert path.read_bytes() == before, k
                assert sorted(p.name for p in tmp_path.iterdir()) == ["plan.npz"], k
                assert BatchPlan.load(path).placement.expert_gpu.tolist() == old.placement.expert_gpu.tolist()
            else:
                new.save(path)
                assert calls[0] == members
    assert BatchPlan.load(path).placement.expert_gpu.tolist() == new.placement.expert_gpu.tolist()


def test_a_trace_save_killed_at_every_member_boundary_keeps_the_old_trace(tmp_path, monkeypatch):
    old, new = _batch(2), _batch(3)
    path = tmp_path / "t.npz"
    old.save(path, counts_only=True)
    before = path.read_bytes()
    with zipfile.ZipFile(path) as zf:
        members = len(zf.namelist())
    for k in range(members):
        with monkeypatch.context() as m:
            _interrupt_at(m, "open", k)
            with pytest.raises(KeyboardInterrupt):
                new.save(path, counts_only=True)
        assert path.read_bytes() == before, k
        assert sorted(p.name for p in tmp_path.iterdir()) == ["t.npz"], k
    np.testing.assert_array_equal(TraceBatch.load(path).sample_expert_counts(), old.sample_expert_counts())


@pytest.mark.parametrize("where", ["missing", "directory"])
def test_outputs_to_a_missing_directory_or_onto_a_directory_are_named_errors(where, tmp_path, capsys):
    out = tmp_path / "nope" / "x.npz" if where == "missing" else tmp_path
    want = "does not exist" if where == "missing" else "is a directory"
    runs = [["trace", "synth", "--model", "qwen3-30b-a3b", "--domain", "math", "--prompts", "2", "--out", str(out)],
            ["calibrate", "--model", "qwen3-30b-a3b", "--dry-run", "--out", str(out)]]
    for argv in runs:
        assert main(argv) == 1, argv
        err = capsys.readouterr().err
        assert "error: " in err and want in err and "Traceback" not in err, err


def test_compare_json_is_written_whole(tmp_path, capsys):
    _batch(4).save(tmp_path / "t.npz", counts_only=True)
    (tmp_path / "cmp.json").write_text("previous")
    rc = main(["compare", str(tmp_path / "t.npz"), "--model", MODEL, "--nodes", "1", "--gpus-per-node", "4",
               "--strategies", "static", "--json", str(tmp_path / "cmp.json")])
    assert rc == 0, capsys.readouterr().err
    assert "static" in json.loads((tmp_path / "cmp.json").read_text())["strategies"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cmp.json", "t.npz"]
