"""`relibra compare TRACE ...`: the table and JSON agree with plan_batch + simulate_step on the same file, the
steady-state mode chains the plans, and bad arguments are specific errors."""

from __future__ import annotations

import json

import pytest

from relibra_moe.cli import main
from relibra_moe.planners.strategies import plan_batch
from relibra_moe.sim import simulate_step
from relibra_moe.specs import cluster_preset, model_preset
from relibra_moe.trace import TraceBatch
from tests.conftest import two_hot_batch


@pytest.fixture(scope="module")
def trace_file(tmp_path_factory):
    batch = two_hot_batch(3, (30, 80))
    path = tmp_path_factory.mktemp("cmp") / "t.npz"
    batch.save(path)
    return path, batch


def _run(args, capsys):
    rc = main(args)
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


def test_compare_single_batch_matches_library(trace_file, tmp_path, capsys):
    path, batch = trace_file
    out = tmp_path / "cmp.json"
    rc, text, _ = _run(["compare", str(path), "--model", "gpt-oss-20b", "--nodes", "2", "--gpus-per-node", "2",
                        "--strategies", "static,eplb,online,relibra", "--replica-slots", "1", "--layers", "2",
                        "--json", str(out)], capsys)
    assert rc == 0
    res = json.loads(out.read_text())
    assert res["mode"] == "single" and res["num_batches"] == 1 and res["layers"] == 2 and res["layers_total"] == 24
    # the baselines on round-robin and on verl's length-balanced placement (the default --placements), labelled
    assert list(res["strategies"]) == ["static", "static@length-balanced", "eplb", "eplb@length-balanced", "online",
                                       "online@length-balanced", "relibra"]
    assert res["placements"] == ["round-robin", "length-balanced"]
    for name in res["strategies"]:
        assert name.replace("@", ", ") in text
    assert "sum T_MoE" in text and "moves free" in text and "what a verl user already has" in text
    model = model_preset("gpt-oss-20b").with_(num_layers=2)
    cluster = cluster_preset(nodes=2, gpus_per_node=2)  # the default preset
    small = TraceBatch.load(path).restrict_layers(2)
    for name, v in res["strategies"].items():
        strategy, _, placement = name.partition("@")
        r = 1 if strategy != "static" else 0
        kw = {"sample_placement": placement} if placement else {}
        plan = plan_batch(small, model, cluster, strategy, replica_slots=r, **kw)
        step = simulate_step(plan, small, model, cluster)
        row = v["per_step"][0]
        assert row["step_s"] == pytest.approx(step.step_s) and row["t_moe_s"] == pytest.approx(step.t_moe.sum())
        assert row["experts_moved"] == step.experts_moved and row["replica_slots"] == r
        assert v["steady"]["step_s"] == row["step_s"]  # one batch: the steady figure is that batch
    assert res["speedup"]["relibra"] == 1.0
    assert res["speedup"]["static"] == pytest.approx(res["strategies"]["static"]["steady"]["step_s"]
                                                     / res["strategies"]["relibra"]["steady"]["step_s"])


def test_compare_steady_mode_chains_plans(trace_file, tmp_path, capsys):
    path, _ = trace_file
    out = tmp_path / "steady.json"
    rc, text, _ = _run(["compare", str(path), "--model", "gpt-oss-20b", "--nodes", "2", "--gpus-per-node", "2",
                        "--strategies", "eplb,eplb-history", "--replica-slots", "1", "--layers", "2",
                        "--batches", "2", "--json", str(out)], capsys)
    assert rc == 0
    res = json.loads(out.read_text())
    assert res["mode"] == "steady" and res["num_batches"] == 2 and res["samples_per_batch"] == [8, 8]
    assert "first step" in text and "steady state of 2 consecutive batches" in text
    eh = res["strategies"]["eplb-history"]["per_step"]
    assert eh[0]["experts_moved"] == 0  # no history yet: the trivial layout
    assert res["reference"] == "eplb"  # relibra not asked: the first strategy is the reference


@pytest.mark.parametrize("args, message", [
    (["--strategies", "static,nope"], "unknown strategy 'nope'"),
    (["--strategies", "static,static"], "names 'static' twice"),
    (["--strategies", " , "], "names no strategy"),
    (["--batches", "9"], "num_batches=9 exceeds the 4 micro-batches"),
    (["--batches", "0"], "--batches=0 must be >= 1"),
    (["--layers", "30"], "--layers=30 exceeds the 24 MoE layers"),
    (["--replica-slots", "-1"], "--replica-slots=-1 must be >= 0"),
    (["--rebalance-every", "0"], "--rebalance-every=0 must be >= 1"),
    (["--move-horizon", "0"], "--move-horizon=0 must be >= 1"),
])
def test_compare_bad_arguments(trace_file, capsys, args, message):
    path, _ = trace_file
    rc, _, err = _run(["compare", str(path), "--model", "gpt-oss-20b", "--nodes", "2", "--gpus-per-node", "2",
                       "--layers", "2", *args], capsys)
    assert rc == 1 and message in err and "relibra compare: error" in err


def test_compare_trace_for_another_model_and_no_assignment(trace_file, tmp_path, capsys):
    path, batch = trace_file
    rc, _, err = _run(["compare", str(path), "--model", "qwen3-30b-a3b", "--nodes", "2"], capsys)
    assert rc == 1 and "model qwen3-30b-a3b has L=48, E=128" in err
    bare = tmp_path / "bare.npz"
    TraceBatch(batch.traces).save(bare)
    rc, _, err = _run(["compare", str(bare), "--model", "gpt-oss-20b", "--nodes", "2", "--gpus-per-node", "2"],
                      capsys)
    assert rc == 1 and "no micro-batch assignment" in err and "--micro-batch-size" in err


@pytest.mark.timeout(600)
def test_compare_agrees_with_plan_previous_and_simulate(trace_file, tmp_path, capsys):
    """The steady chain of `relibra compare --batches 2` is what `relibra plan --previous` + `relibra simulate
    --previous` give on the same two consecutive batches saved as files (moves priced and charged alike)."""
    from relibra_moe.steady import consecutive_batches

    path, batch = trace_file
    out = tmp_path / "chain.json"
    rc, _, _ = _run(["compare", str(path), "--model", "gpt-oss-20b", "--nodes", "2", "--gpus-per-node", "2",
                     "--strategies", "relibra,online", "--replica-slots", "1", "--batches", "2",
                     "--json", str(out)], capsys)
    assert rc == 0
    res = json.loads(out.read_text())
    files = []
    for k, b in enumerate(consecutive_batches(TraceBatch.load(path), 2)):
        files.append(tmp_path / f"b{k}.npz")
        b.save(files[-1])
    common = ["--model", "gpt-oss-20b", "--nodes", "2", "--gpus-per-node", "2", "--replica-slots", "1"]
    for strategy in ("relibra", "online"):
        prev = None
        for k, f in enumerate(files):
            plan = tmp_path / f"{strategy}{k}.npz"
            extra = ["--previous", str(prev)] if prev is not None and strategy == "relibra" else []
            assert main(["plan", str(f), "--strategy", strategy, "--out", str(plan), *common, *extra]) == 0
            sim = ["--previous", str(prev)] if prev is not None else []
            capsys.readouterr()
            assert main(["simulate", str(f), str(plan), "--model", "gpt-oss-20b", "--json", *sim]) == 0
            got = json.loads(capsys.readouterr().out)
            row = res["strategies"][strategy]["per_step"][k]
            assert got["step_s"] == pytest.approx(row["step_s"], rel=1e-12), (strategy, k)
            assert got["experts_moved"] == row["experts_moved"] and got["replica_mode"] == row["replica_mode"]
            assert got["t_moe_s"] == pytest.approx(row["t_moe_s"], rel=1e-12)
            prev = plan
    assert res["strategies"]["online"]["per_step"][0]["replica_mode"] == "after-router"


@pytest.mark.timeout(600)
def test_compare_move_horizon_plans_relibra_from_the_batch_before(trace_file, tmp_path, capsys):
    """`relibra compare --batches 2 --move-horizon 4`: relibra's second plan is the library's with the first
    batch's loads under its first plan as ``previous_loads`` (and the steady runner's history); the simulator
    charges its moves in full."""
    from relibra_moe.evaluate import plan_loads
    from relibra_moe.planners.strategies import plan_batch
    from relibra_moe.sim import simulate_step
    from relibra_moe.specs import cluster_preset, model_preset
    from relibra_moe.steady import consecutive_batches

    path, _ = trace_file
    out = tmp_path / "horizon.json"
    rc, _, _ = _run(["compare", str(path), "--model", "gpt-oss-20b", "--nodes", "2", "--gpus-per-node", "2",
                     "--strategies", "static,relibra", "--replica-slots", "1", "--layers", "2", "--batches", "2",
                     "--move-horizon", "4", "--json", str(out)], capsys)
    assert rc == 0
    res = json.loads(out.read_text())
    assert res["move_horizon"] == 4
    b0, b1 = consecutive_batches(TraceBatch.load(path).restrict_layers(2), 2)
    model = model_preset("gpt-oss-20b").with_(num_layers=2)
    cluster = cluster_preset(nodes=2, gpus_per_node=2)
    p0 = plan_batch(b0, model, cluster, "relibra", replica_slots=1, move_horizon=4)
    p1 = plan_batch(b1, model, cluster, "relibra", replica_slots=1, previous=p0.placement, move_horizon=4,
                    previous_loads=plan_loads(p0, b0, cluster.num_gpus),
                    history=b0.sample_expert_counts().sum(axis=0)[None])
    rows = res["strategies"]["relibra"]["per_step"]
    for k, (plan, batch, prev) in enumerate(((p0, b0, None), (p1, b1, p0.placement))):
        step = simulate_step(plan, batch, model, cluster, previous=prev)
        assert rows[k]["step_s"] == pytest.approx(step.step_s, rel=1e-12)
        assert rows[k]["experts_moved"] == step.experts_moved


def test_compare_rate_band_and_overlap(trace_file, tmp_path, capsys):
    """--rate-band: every strategy again at each end of the GEMM-rate band (the library's plans and steps at that
    rate); --overlap: the cluster the strategies plan and simulate on."""
    path, _ = trace_file
    out = tmp_path / "band.json"
    rc, _, err = _run(["compare", str(path), "--model", "gpt-oss-20b", "--nodes", "2", "--gpus-per-node", "2",
                       "--strategies", "static,relibra", "--replica-slots", "1", "--layers", "2", "--overlap",
                       "megatron", "--rate-band", "300,600", "--json", str(out)], capsys)
    assert rc == 0, err
    res = json.loads(out.read_text())
    band = res["rate_band"]
    assert band["flops"] == [300e12, 600e12] and band["reference"] == "relibra"
    model = model_preset("gpt-oss-20b").with_(num_layers=2)
    small = TraceBatch.load(path).restrict_layers(2)
    for end, flops in (("low", 300e12), ("high", 600e12)):
        cluster = cluster_preset(nodes=2, gpus_per_node=2, overlap="megatron").with_(flops=flops)
        steps = {}
        for name in ("static", "relibra"):
            plan = plan_batch(small, model, cluster, name, replica_slots=1 if name == "relibra" else 0)
            steps[name] = simulate_step(plan, small, model, cluster).step_s
            assert band["step_s"][end][name] == pytest.approx(steps[name])
        assert band["speedup"][end]["static"] == pytest.approx(steps["static"] / steps["relibra"])
    assert main(["compare", str(path), "--model", "gpt-oss-20b", "--nodes", "2", "--rate-band", "600,300"]) == 1
    assert "--rate-band='600,300' must hold 0 < LO <= HI" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["compare", str(path), "--model", "gpt-oss-20b", "--nodes", "2", "--overlap", "full"])


def test_placements_flag_is_checked_against_the_known_placements():
    from relibra_moe.commands.compare import parse_placements
    from relibra_moe.errors import PlanError
    from relibra_moe.sample_placements import SAMPLE_PLACEMENTS

    assert parse_placements(",".join(SAMPLE_PLACEMENTS)) == list(SAMPLE_PLACEMENTS)
    for text, match in (("round-robin,packed", "unknown sample placement 'packed'"), (" , ", "names no sample"),
                        ("longest-first,longest-first", "names 'longest-first' twice")):
        with pytest.raises(PlanError, match=match):
            parse_placements(text)
