"""`--sample-owner` / `--sample-gpu` of `relibra plan`, `compare` (both modes on one table) and the steady state:
the CLI's figures equal the library's in the same mode, the trainer's ranks are kept, bad flags are named."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from relibra_moe.cli import main
from relibra_moe.plan import BatchPlan
from relibra_moe.planners.strategies import plan_batch
from relibra_moe.sim import simulate_step
from relibra_moe.specs import DEFAULT_CLUSTER, cluster_preset, model_preset
from relibra_moe.steady import consecutive_batches
from relibra_moe.trace import RoutingTrace, TraceBatch

FAST = ["--iters", "200", "--locality-iters", "100", "--num-seeds", "1", "--rounds", "1"]


@pytest.fixture(scope="module")
def trace_file(tmp_path_factory):
    model = model_preset("gpt-oss-20b")
    rng = np.random.default_rng(5)
    traces = []
    for _ in range(16):
        s = int(rng.integers(10, 30))
        p = np.ones(32)
        p[rng.integers(0, 32, size=2)] = 10.0
        g = np.log(p) + rng.gumbel(size=(s, model.num_layers, 32))
        ids = np.argpartition(-g, 3, axis=2)[:, :, :4]
        traces.append(RoutingTrace(ids, np.arange(model.num_layers), 32, 4, source="test"))
    batch = TraceBatch(traces, micro_batch=np.arange(16) // 4)
    d = tmp_path_factory.mktemp("owner")
    batch.save(d / "t.npz")
    ranks = np.random.default_rng(1).integers(0, 4, size=16).astype(np.int64)
    np.save(d / "ranks.npy", ranks)
    return d, batch, ranks


MODEL2 = ["--model", "gpt-oss-20b", "--nodes", "2", "--gpus-per-node", "2"]


def _model(layers=None):
    model = model_preset("gpt-oss-20b")
    return (model.with_(num_layers=layers) if layers else model), cluster_preset(DEFAULT_CLUSTER, nodes=2,
                                                                                 gpus_per_node=2)


def test_plan_trainer_mode_keeps_the_ranks_and_matches_the_library(trace_file, tmp_path, capsys):
    d, batch, ranks = trace_file
    out = tmp_path / "p.npz"
    rc = main(["plan", str(d / "t.npz"), *MODEL2, "--strategy", "relibra", "--replica-slots", "1", *FAST,
               "--sample-owner", "trainer", "--sample-gpu", str(d / "ranks.npy"), "--out", str(out), "--json"])
    res = json.loads(capsys.readouterr().out)
    assert rc == 0 and res["sample_owner"] == "trainer"
    plan = BatchPlan.load(out)
    np.testing.assert_array_equal(plan.samples.gpu, ranks)
    model, cluster = _model()
    ref = plan_batch(batch, model, cluster, "relibra", replica_slots=1, iters=200, locality_iters=100, num_seeds=1,
                     rounds=1, sample_owner="trainer", sample_gpu=ranks)
    np.testing.assert_array_equal(plan.placement.expert_gpu, ref.placement.expert_gpu)
    assert res["step_s"] == pytest.approx(simulate_step(ref, batch, model, cluster).step_s, rel=1e-12)
    rc = main(["simulate", str(d / "t.npz"), str(out), "--model", "gpt-oss-20b", "--json"])
    assert rc == 0 and json.loads(capsys.readouterr().out)["sample_owner"] == "trainer"


@pytest.mark.parametrize("flags, match", [
    (["--sample-gpu", "RANKS"], "--sample-gpu .* only applies with --sample-owner trainer"),
    (["--sample-owner", "trainer", "--sample-gpu", "BAD"], r"must be an int \[N=16\] array of ranks"),
    (["--sample-owner", "trainer", "--sample-gpu", "MISSING"], "not a readable .npy file"),
    (["--sample-owner", "trainer", "--sample-gpu", "HIGH"], r"sample_gpu\[3\] = 4 is outside \[0, 4\)"),
    (["--sample-owner", "trainer", "--repack"], "repack=True .* sample_owner='trainer'"),
])
def test_plan_bad_flags_are_named(trace_file, tmp_path, capsys, flags, match):
    d, _, ranks = trace_file
    np.save(tmp_path / "bad.npy", np.zeros(15, np.int64))
    high = ranks.copy()
    high[3] = 4
    np.save(tmp_path / "high.npy", high)
    paths = {"RANKS": str(d / "ranks.npy"), "BAD": str(tmp_path / "bad.npy"), "MISSING": str(tmp_path / "no.npy"),
             "HIGH": str(tmp_path / "high.npy")}
    flags = [paths.get(f, f) for f in flags]
    rc = main(["plan", str(d / "t.npz"), *MODEL2, "--strategy", "static", *flags, "--out", str(tmp_path / "p.npz")])
    err = capsys.readouterr().err
    assert rc == 1 and re.search(match, err), err


def test_compare_both_modes_on_one_table(trace_file, tmp_path, capsys):
    d, batch, ranks = trace_file
    out = tmp_path / "cmp.json"
    rc = main(["compare", str(d / "t.npz"), *MODEL2, "--strategies", "static,relibra", "--replica-slots", "1",
               "--batches", "2", "--layers", "2", "--sample-owner", "both", "--sample-gpu", str(d / "ranks.npy"),
               "--json", str(out)])
    text = capsys.readouterr().out
    assert rc == 0
    res = json.loads(out.read_text())
    assert res["sample_owner"] == "both" and res["sample_gpu"].endswith("ranks.npy")
    assert "trainer/planner step" in text and "trainer" in text and "planner" in text
    model, cluster = _model(2)
    seq = consecutive_batches(batch.restrict_layers(2), 2)
    # the trainer rows: every batch keeps its slice of the trainer's ranks; the figures are the library's
    prev = None
    for k, b in enumerate(seq):
        kw = {"previous": prev.placement} if prev is not None else {}
        p = plan_batch(b, model, cluster, "relibra", replica_slots=1, sample_owner="trainer",
                       sample_gpu=ranks[8 * k:8 * (k + 1)], **kw)
        np.testing.assert_array_equal(p.samples.gpu, ranks[8 * k:8 * (k + 1)])
        step = simulate_step(p, b, model, cluster, previous=None if prev is None else prev.placement)
        assert res["trainer"]["relibra"]["per_step"][k]["step_s"] == pytest.approx(step.step_s, rel=1e-12)
        prev = p
    for s in ("static", "relibra"):
        gap = res["trainer"][s]["steady"]["step_s"] / res["strategies"][s]["steady"]["step_s"]
        assert res["trainer_gap"][s]["step_s"] == pytest.approx(gap)
        assert res["trainer_speedup"][s] == pytest.approx(res["strategies"]["relibra"]["steady"]["tokens_per_s"]
                                                          / res["trainer"][s]["steady"]["tokens_per_s"])
    # static never moves samples and the planner's are round-robin: with round-robin ranks both modes agree
    rc = main(["compare", str(d / "t.npz"), *MODEL2, "--strategies", "static", "--sample-owner", "both",
               "--layers", "2", "--json", str(out)])
    capsys.readouterr()
    res = json.loads(out.read_text())
    assert rc == 0 and res["trainer_gap"]["static"]["step_s"] == pytest.approx(1.0, rel=1e-12)
    assert res["sample_gpu"] == "round-robin"


def test_compare_rejects_a_bad_owner(trace_file, capsys):
    d, _, _ = trace_file
    with pytest.raises(SystemExit):
        main(["compare", str(d / "t.npz"), *MODEL2, "--sample-owner", "nobody"])
    assert "invalid choice: 'nobody'" in capsys.readouterr().err


def test_demo_runs_both_modes_side_by_side():
    from relibra_moe.commands.demo import Scenario, run_scenario, strategy_runs
    from relibra_moe.planners.strategies import plan_batch as pb

    sc = Scenario(name="qwen3-30b-a3b/mixed", model="qwen3-30b-a3b", nodes=2, gpus_per_node=2, data="synthetic",
                  domain="mixed", num_samples=16, micro_batch_size=8, layers=2, replica_slots=1, repack=True)
    runs = strategy_runs(sc, ["static", "relibra"], "both")
    assert [(lab, own) for lab, _, _, own in runs] == [
        ("static", "planner"), ("relibra", "planner"), ("static+repack", "planner"), ("relibra+repack", "planner"),
        ("static (trainer)", "trainer"), ("relibra (trainer)", "trainer")]
    assert all(not rep for _, _, rep, own in runs if own == "trainer")
    assert [lab for lab, *_ in strategy_runs(sc, ["static", "relibra"], "trainer")] == ["static", "relibra"]
    res = run_scenario(sc, 0, 1, pb, ["static", "relibra"], sample_owner="both")
    st = res["strategies"]
    assert st["relibra (trainer)"]["sample_owner"] == "trainer" and st["relibra"]["sample_owner"] == "planner"
    assert st["static (trainer)"]["step_s"] == pytest.approx(st["static"]["step_s"], rel=1e-12)
