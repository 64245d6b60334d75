"""Adversarial trace and plan files: nothing is trusted before it is checked.

Every case is a file a careful user could produce by accident (or a hostile one on purpose): a header that
declares terabytes, negative or implausible counts, scalars that disagree with the arrays, a ``stats_json``
that is not an object, a plan for another batch with its fingerprint gone. Each must give a named error
(``TraceError`` / ``PlanError``) naming the file, the key and the index with plain Python numbers, from the
Python API and from the CLI (exit status 1, no traceback), or the correct result."""

from __future__ import annotations

import io
import json
import time
import zipfile

import numpy as np
import pytest

from relibra_moe.cli import main
from relibra_moe.errors import PlanError, TraceError
from relibra_moe.evaluate import score_plan
from relibra_moe.plan import BatchPlan, max_replica_slots
from relibra_moe.planners.strategies import plan_batch
from relibra_moe.sim import simulate_step
from relibra_moe.specs import cluster_preset, model_preset
from relibra_moe.trace import TraceBatch

MODEL = "gpt-oss-20b"  # L = 24, E = 32, k = 4


def _batch(seed: int, n: int = 8) -> TraceBatch:
    model = model_preset(MODEL)
    rng = np.random.default_rng(seed)
    L, E, k = model.num_layers, model.num_experts, model.top_k
    counts = np.zeros((n, L, E), np.int64)
    for i in range(n):
        s = int(rng.integers(3, 9))
        for l in range(L):
            for _ in range(s):
                counts[i, l, rng.choice(E, k, replace=False)] += 1
    return TraceBatch.from_counts(counts, k).with_micro_batch(np.arange(n) // 4)


def _rewrite(src, dst, drop=(), raw: dict[str, bytes] | None = None, **arrays) -> None:
    """Copy the .npz ``src`` to ``dst`` with some members replaced (``arrays``), dropped, or given raw bytes."""
    raw = raw or {}
    with np.load(src, allow_pickle=False) as f:
        members = {k: f[k] for k in f.files if k not in drop}
    members.update(arrays)
    with zipfile.ZipFile(dst, "w") as z:
        for key, value in members.items():
            if key in raw:
                continue
            buf = io.BytesIO()
            np.save(buf, value)
            z.writestr(key + ".npy", buf.getvalue())
        for key, data in raw.items():
            z.writestr(key + ".npy", data)


def _forged_header(shape: tuple[int, ...], dtype: str, payload: int = 64) -> bytes:
    """A .npy member whose header declares ``shape`` of ``dtype`` but that stores ``payload`` bytes."""
    buf = io.BytesIO()
    np.lib.format.write_array_header_1_0(buf, {"descr": np.dtype(dtype).str, "fortran_order": False, "shape": shape})
    return buf.getvalue() + b"\0" * payload


def _cli_error(capsys, argv: list[str], cls: str, *fragments: str) -> str:
    """Run the CLI: exit status 1, a one-line named error holding every fragment, no traceback."""
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert f"error: {cls}: " in err and "Traceback" not in err, err
    for frag in fragments:
        assert frag in err, (frag, err)
    return err


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("adv-files")
    model, cluster = model_preset(MODEL), cluster_preset(nodes=1, gpus_per_node=8)
    batch, other = _batch(0), _batch(1)
    trace, counts_only, other_trace = d / "t.npz", d / "c.npz", d / "o.npz"
    batch.save(counts_only, counts_only=True)
    _batch(0).save(trace, counts_only=True)
    other.save(other_trace, counts_only=True)
    plan = plan_batch(batch, model, cluster, "eplb", replica_slots=2)
    plan_path = d / "p.npz"
    plan.save(plan_path)
    return dict(d=d, model=model, cluster=cluster, batch=batch, other=other, trace=trace, counts_only=counts_only,
                other_trace=other_trace, plan=plan, plan_path=plan_path)


# ----------------------------------------------------------------------------------------------- traces

def test_negative_count_in_counts_only_trace(files, capsys):
    bad = files["d"] / "neg.npz"
    with np.load(files["counts_only"]) as f:
        counts = f["counts"].astype(np.int16)
    counts[2, 5, 7] = -3
    _rewrite(files["counts_only"], bad, counts=counts)
    with pytest.raises(TraceError, match=r"neg.npz: key 'counts'\[2, 5, 7\] = -3 is negative"):
        TraceBatch.load(bad)
    _cli_error(capsys, ["trace", "stats", str(bad)], "TraceError", "key 'counts'[2, 5, 7] = -3")
    _cli_error(capsys, ["plan", str(bad), "--model", MODEL, "--nodes", "1", "--strategy", "eplb", "--out",
                        str(files["d"] / "x.npz")], "TraceError", "neg.npz", "= -3 is negative")


def test_negative_count_in_trace_with_ids(files, tmp_path):
    ids_trace = tmp_path / "ids.npz"
    rng = np.random.default_rng(3)
    from relibra_moe.trace import RoutingTrace

    traces = [RoutingTrace(np.stack([np.stack([rng.choice(8, 2, replace=False) for _ in range(2)])
                                     for _ in range(4)]), [0, 1], 8, 2) for _ in range(3)]
    TraceBatch(traces).save(ids_trace)
    with np.load(ids_trace) as f:
        counts = f["counts"].astype(np.int16)
    counts[0, 0, 0] = -3
    bad = tmp_path / "ids_neg.npz"
    _rewrite(ids_trace, bad, counts=counts)
    with pytest.raises(TraceError, match=r"ids_neg.npz: key 'counts'\[0, 0, 0\] = -3 is negative"):
        TraceBatch.load(bad)


def test_offsets_declaring_1e15_tokens(files, capsys):
    bad = files["d"] / "huge.npz"
    with np.load(files["counts_only"]) as f:
        offsets = f["offsets"].copy()
    offsets[-1] = 10 ** 15
    _rewrite(files["counts_only"], bad, offsets=offsets)
    with pytest.raises(TraceError, match=r"huge.npz: key 'offsets'\[8\] = 1000000000000000 is outside \[0, "):
        TraceBatch.load(bad)
    _cli_error(capsys, ["trace", "stats", str(bad)], "TraceError", "key 'offsets'[8] = 1000000000000000")
    # one sequence over the per-sequence bound (int32 positions), the batch total still small enough
    offsets = np.arange(9, dtype=np.int64) * (1 << 31)
    _rewrite(files["counts_only"], bad, offsets=offsets)
    with pytest.raises(TraceError, match=r"key 'offsets'\[0:2\] = \[0, 2147483648\]: sample 0 has 2147483648 "
                                         r"tokens, outside \[0, MAX_SEQUENCE_TOKENS = 2147483647\]"):
        TraceBatch.load(bad)


def test_forged_header_declaring_terabytes_is_rejected_before_allocation(files, capsys):
    bad = files["d"] / "forged.npz"
    _rewrite(files["counts_only"], bad, raw={"counts": _forged_header((8, 24, 2 ** 36), "<u1")})
    t0 = time.perf_counter()
    with pytest.raises(TraceError, match=r"forged.npz: key 'counts' declares shape \[8, 24, 68719476736\] of uint8 = "
                                         r"13194139533312 bytes, over the limit"):
        TraceBatch.load(bad)
    assert time.perf_counter() - t0 < 1.0
    _cli_error(capsys, ["trace", "stats", str(bad)], "TraceError", "key 'counts' declares shape")
    # under the limit but more than the member stores: a forged header, not read either
    _rewrite(files["counts_only"], bad, raw={"counts": _forged_header((8, 24, 64), "<u1")})
    with pytest.raises(TraceError, match=r"key 'counts' declares shape \[8, 24, 64\] of uint8 = 12288 bytes, but "
                                         r"stores 64 bytes"):
        TraceBatch.load(bad)


def test_experts_header_declaring_2_to_40_rows(tmp_path):
    from relibra_moe.trace import RoutingTrace

    rng = np.random.default_rng(4)
    traces = [RoutingTrace(np.stack([np.stack([rng.choice(8, 2, replace=False) for _ in range(2)])
                                     for _ in range(4)]), [0, 1], 8, 2) for _ in range(3)]
    good, bad = tmp_path / "g.npz", tmp_path / "e.npz"
    TraceBatch(traces).save(good)
    _rewrite(good, bad, raw={"experts": _forged_header((2 ** 40, 2, 2), "|i1", payload=48)})
    with pytest.raises(TraceError, match=r"e.npz: key 'experts' declares shape \[1099511627776, 2, 2\] of int8"):
        TraceBatch.load(bad)  # at load, not at the first id read


# ------------------------------------------------------------------------------------------------ plans

def test_plan_scalars_must_agree_with_arrays(files, capsys):
    bad = files["d"] / "scalars.npz"
    for key, value, says in (("num_layers", 99, 24), ("num_experts", 7, 32), ("replica_slots", 9, 2)):
        _rewrite(files["plan_path"], bad, **{key: np.array(value, np.int32)})
        with pytest.raises(PlanError, match=rf"scalars.npz: key '{key}' = {value}, but .* says {says}"):
            BatchPlan.load(bad)
    _cli_error(capsys, ["score", str(files["trace"]), str(bad), "--model", MODEL], "PlanError",
               "key 'replica_slots' = 9")


def test_stats_json_must_be_an_object(files, capsys):
    bad = files["d"] / "list.npz"
    _rewrite(files["plan_path"], bad, stats_json=np.array("[1, 2]"))
    with pytest.raises(PlanError, match=r"list.npz: key 'stats_json' must hold a JSON object, got a JSON list"):
        BatchPlan.load(bad)
    for cmd in ("score", "simulate"):
        _cli_error(capsys, [cmd, str(files["trace"]), str(bad), "--model", MODEL], "PlanError", "JSON object")


def test_plan_without_fingerprint_needs_an_explicit_flag(files, capsys):
    bad = files["d"] / "nofp.npz"
    _rewrite(files["plan_path"], bad, stats_json=np.array("{}"))
    plan = BatchPlan.load(bad)
    model, cluster = files["model"], files["cluster"]
    for fn in (score_plan, simulate_step):
        with pytest.raises(PlanError, match=r"nofp.npz has no batch fingerprint .* allow_missing_fingerprint=True"):
            fn(plan, files["other"], model, cluster)
    for cmd in ("score", "simulate"):  # a plan for ANOTHER batch: without its fingerprint nothing could tell
        _cli_error(capsys, [cmd, str(files["other_trace"]), str(bad), "--model", MODEL], "PlanError",
                   "no batch fingerprint", "--allow-unfingerprinted")
    # asked for explicitly, the right batch scores as the fingerprinted plan does
    ref = score_plan(files["plan"], files["batch"], model, cluster)
    got = score_plan(plan, files["batch"], model, cluster, allow_missing_fingerprint=True)
    assert got.t_moe_s == ref.t_moe_s
    assert main(["simulate", str(files["trace"]), str(bad), "--model", MODEL, "--allow-unfingerprinted",
                 "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["step_s"] > 0
    # and a fingerprinted plan for another batch is still refused
    with pytest.raises(PlanError, match="plan was made for another batch"):
        score_plan(files["plan"], files["other"], model, cluster)


def test_plan_errors_name_the_file_and_plain_numbers(files, capsys):
    bad = files["d"] / "split.npz"
    with np.load(files["plan_path"]) as f:
        idx = f["split_index"].copy()
    assert len(idx), "the eplb plan with r = 2 has split rows"
    idx[0, 4] = 99
    _rewrite(files["plan_path"], bad, split_index=idx)
    plan = BatchPlan.load(bad)
    with pytest.raises(PlanError) as exc:
        plan.validate(files["model"], files["cluster"])
    msg = str(exc.value)
    assert msg.startswith(f"plan file {bad}: split_index[0] = ({', '.join(str(int(v)) for v in idx[0])}): g=99 "
                          "is outside [0, 8)"), msg
    assert "np." not in msg
    _cli_error(capsys, ["score", str(files["trace"]), str(bad), "--model", MODEL], "PlanError", "g=99")


def test_bad_sample_gpu_is_a_plan_error(files, capsys):
    bad = files["d"] / "gpu.npz"
    with np.load(files["plan_path"]) as f:
        gpu = f["sample_gpu"].copy()
    gpu[3] = 11
    _rewrite(files["plan_path"], bad, sample_gpu=gpu)
    with pytest.raises(PlanError, match=r"gpu.npz: sample_gpu\[3\] = 11 is outside \[0, 8\)"):
        simulate_step(BatchPlan.load(bad), files["batch"], files["model"], files["cluster"])
    _cli_error(capsys, ["simulate", str(files["trace"]), str(bad), "--model", MODEL], "PlanError",
               "sample_gpu[3] = 11")


def test_replica_slots_ceiling(files, capsys):
    model, cluster, batch = files["model"], files["cluster"], files["batch"]
    assert max_replica_slots(32, 8) == 28
    t0 = time.perf_counter()
    with pytest.raises(PlanError, match=r"replica_slots=1000 is over the ceiling E - E/G = 28 \(E=32, G=8"):
        plan_batch(batch, model, cluster, "eplb", replica_slots=1000)
    assert time.perf_counter() - t0 < 1.0  # refused up front, not after minutes of planning
    _cli_error(capsys, ["plan", str(files["trace"]), "--model", MODEL, "--nodes", "1", "--strategy", "eplb",
                        "--replica-slots", "1000", "--out", str(files["d"] / "x.npz")], "PlanError", "over the ceiling")
    from relibra_moe.planners.service import Planner

    with pytest.raises(PlanError, match=r"replica_slots=1000 is over the ceiling E - E/G = 28"):
        Planner(model, cluster, "eplb", replica_slots=1000, executor="inline")  # refused at construction
    # at the ceiling it plans (every slot could hold a distinct expert homed elsewhere)
    assert plan_batch(batch, model, cluster, "eplb", replica_slots=28).replica_slots == 28
    # a plan file with more slots than the ceiling is refused by validate, naming the file
    from relibra_moe.plan import ReplicaPlan

    p = files["plan"]
    wide = BatchPlan(p.placement, p.samples, ReplicaPlan(np.full((2, 24, 8, 29), -1), np.zeros((0, 5)),
                                                         np.zeros(0), p.replicas.scope), 8, 8, p.stats.to_dict())
    path = files["d"] / "wide.npz"
    wide.save(path)
    with pytest.raises(PlanError, match=r"wide.npz: replica_expert has r=29 slots per GPU, over the ceiling"):
        BatchPlan.load(path).validate(model, cluster)
