"""`relibra demo --quick`: the report's fields, every strategy, the plots; and the scenario helpers."""

from __future__ import annotations

import json

import pytest

from relibra_moe.cli import main
from relibra_moe.commands.demo import ablation, check_targets, default_scenarios, select_scenarios
from relibra_moe.errors import RelibraError
from relibra_moe.planners.strategies import COMPARED_STRATEGIES

SCENARIO_FIELDS = {"name", "model", "nodes", "gpus_per_node", "num_gpus", "data", "num_sequences", "num_tokens",
                   "num_micro_batches", "layers_simulated", "layers_total", "reduced", "replica_slots",
                   "expert_skew_mean", "intersection_mean", "strategies"}
RESULT_FIELDS = {"step_s", "tokens_per_s", "speedup_vs_static", "percent_of_bound_throughput", "rank_skew_mean",
                 "solve_s", "t_moe_s", "breakdown", "rank_skew_per_micro_batch", "experts_moved",
                 "percent_of_bound", "reorder_share", "replica_share"}


def _expected_strategies() -> list[str]:
    assert set(COMPARED_STRATEGIES) == {"static", "eplb", "lplb", "relibra-inter", "relibra", "balanced"}
    return list(COMPARED_STRATEGIES)


@pytest.mark.timeout(300)
def test_demo_quick_report(tmp_path, capsys):
    out = tmp_path / "demo"
    assert main(["demo", "--quick", "--out", str(out), "--no-progress", "--workers", "1"]) == 0
    text = capsys.readouterr().out
    rep = json.loads((out / "report.json").read_text())
    assert rep["version"] == 1 and rep["quick"] is True
    assert rep["strategies"] == _expected_strategies()
    ran = {s["name"] for s in rep["scenarios"]}
    skipped = {s["scenario"] for s in rep["skipped"]}
    assert ran | skipped == {s.name for s in default_scenarios(quick=True)} and not ran & skipped
    assert rep["scenarios"], "the quick demo ran no scenario"
    for sc in rep["scenarios"]:
        assert SCENARIO_FIELDS <= set(sc), SCENARIO_FIELDS - set(sc)
        assert sc["name"] in text
        assert set(rep["strategies"]) <= set(sc["strategies"])
        for name, r in sc["strategies"].items():
            assert RESULT_FIELDS <= set(r), (name, RESULT_FIELDS - set(r))
            assert r["step_s"] > 0 and r["tokens_per_s"] == pytest.approx(sc["num_tokens"] / r["step_s"])
            assert sum(r["breakdown"].values()) == pytest.approx(r["step_s"])
            assert len(r["rank_skew_per_micro_batch"]) == sc["num_micro_batches"]
        assert sc["strategies"]["static"]["speedup_vs_static"] == pytest.approx(1.0)
        # the baselines also on verl's length-balanced placement (what a verl user already has), relibra once
        lb = sc["strategies"]["static, length-balanced (verl)"]
        assert lb["sample_placement"] == "length-balanced" and lb["strategy"] == "static"
        assert not any(k.startswith("relibra") and "length-balanced" in k for k in sc["strategies"])
        if "balanced" in sc["strategies"]:
            assert sc["strategies"]["balanced"]["percent_of_bound_throughput"] == pytest.approx(100.0)
            for r in sc["strategies"].values():  # the bound: no strategy beats it
                assert r["percent_of_bound_throughput"] <= 100.0 + 1e-9 and r["percent_of_bound"] <= 100.0 + 1e-9
        if sc["data"].startswith("synthetic"):
            assert "synthetic" in text.lower()
        check_overlaps(sc, rep["overlaps"])
    for p in rep["plots"]:
        assert (out / p).stat().st_size > 1000 and p.endswith(".png")
    assert "throughput.png" in rep["plots"]
    assert sum(p.startswith("gpu_load_") for p in rep["plots"]) == len(rep["scenarios"])
    assert sum(p.startswith("rank_skew_") for p in rep["plots"]) == len(rep["scenarios"])


def check_overlaps(sc: dict, overlaps: list[str]) -> None:
    """Every run's step with and without overlap (``by_overlap``): the first overlap's figures are the run's own;
    a baseline's plan ignores the overlap, so its overlapped step is its own plan simulated under it; the
    overlap hides part of the step, never adds to it; relibra (planned again under the overlap) is never slower
    than the static plan there."""
    from relibra_moe.commands.demo import build_batch, default_scenarios
    from relibra_moe.planners.strategies import plan_batch
    from relibra_moe.sim import simulate_step
    from relibra_moe.specs import cluster_preset, model_preset

    assert overlaps == ["none", "megatron"] and sc["overlap"] == "none"
    for name, r in sc["strategies"].items():
        assert list(r["by_overlap"]) == overlaps
        assert r["by_overlap"]["none"]["step_s"] == pytest.approx(r["step_s"], rel=1e-12)
        assert r["by_overlap"]["none"]["speedup_vs_static"] == pytest.approx(r["speedup_vs_static"], rel=1e-12)
        if name in ("static", "eplb"):  # independent: replan the baseline and simulate it under the overlap
            scen = next(s for s in default_scenarios(quick=True) if s.name == sc["name"])
            batch = build_batch(scen, 0)
            model = model_preset(scen.model).with_(num_layers=batch.num_layers)
            cl = cluster_preset("hopper-rail", nodes=scen.nodes, gpus_per_node=scen.gpus_per_node, overlap="megatron")
            plan = plan_batch(batch, model, cl, name, replica_slots=scen.replica_slots if name == "eplb" else 0)
            want = simulate_step(plan, batch, model, cl).step_s
            assert r["by_overlap"]["megatron"]["step_s"] == pytest.approx(want, rel=1e-12)
            assert want < r["step_s"]  # megatron overlap hides some all-to-all on 2 nodes
    st = {k: v["by_overlap"]["megatron"]["step_s"] for k, v in sc["strategies"].items()}
    assert st["relibra"] <= st["static"] * (1 + 1e-9)
    assert sc["strategies"]["static"]["by_overlap"]["megatron"]["speedup_vs_static"] == pytest.approx(1.0)


def test_demo_rejects_an_unknown_overlap(capsys):
    assert main(["demo", "--quick", "--overlap", "none,pipelined", "--out", "/nonexistent-never-written"]) == 1
    assert "--overlap='none,pipelined': 'pipelined' is not one of" in capsys.readouterr().err


def test_demo_skips_real_trace_when_absent(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("RELIBRA_TRACES", str(tmp_path / "nowhere"))
    out = tmp_path / "demo"
    assert main(["demo", "--quick", "--scenario", "gpt-oss-ep8", "--out", str(out), "--no-progress"]) == 0
    rep = json.loads((out / "report.json").read_text())
    assert rep["scenarios"] == []
    assert [s["scenario"] for s in rep["skipped"]] == ["gpt-oss-ep8"]
    assert "not found" in rep["skipped"][0]["reason"]
    assert "skipping gpt-oss-ep8" in capsys.readouterr().out


def test_scenario_selection_and_list(capsys):
    full = default_scenarios()
    names = [s.name for s in full]
    assert {"gpt-oss-ep8", "gpt-oss-ep16"} <= set(names)
    for model in ("qwen3-30b-a3b", "glm4.5-106b-a12b", "qwen3-235b-a22b"):
        assert {f"{model}/{d}" for d in ("math", "code", "instruction", "mixed")} <= set(names)
    assert [s.name for s in select_scenarios(full, ["qwen3-235b-a22b/mixed"])] == ["qwen3-235b-a22b/mixed"]
    assert len(select_scenarios(full, ["qwen3-30b-a3b"])) == 4
    assert len(select_scenarios(full, ["*/mixed"])) == 3
    with pytest.raises(RelibraError, match=r"--scenario \['nope'\] matches none of"):
        select_scenarios(full, ["nope"])
    assert main(["demo", "--list"]) == 0
    assert "qwen3-235b-a22b/mixed" in capsys.readouterr().out
    assert main(["demo", "--scenario", "nope", "--out", "/nonexistent-never-written"]) == 1
    capsys.readouterr()
    for flags, msg in ((["--workers", "0"], "--workers=0 must be >= 1"), (["--seed", "-1"], "--seed=-1 must be >= 0")):
        assert main(["demo", "--quick", "--out", "/nonexistent-never-written", *flags]) == 1
        assert msg in capsys.readouterr().err


def test_ablation_and_targets_from_results():
    def sc(name, rel):
        return {"name": name, "strategies": {k: {"speedup_vs_static": v, "tokens_per_s": 100 * v,
                                                 "percent_of_bound_throughput": 100 * v / rel["balanced"],
                                                 "percent_of_bound": 95.0}
                                             for k, v in rel.items()}}
    res = [sc("qwen3-235b-a22b/mixed", {"static": 1.0, "eplb": 1.1, "relibra-inter": 1.15, "relibra": 1.3,
                                        "balanced": 1.4}),
           sc("gpt-oss-ep8", {"static": 1.0, "relibra": 1.2, "balanced": 1.25})]
    abl = ablation(res)
    assert abl["rows"] == [{"scenario": "qwen3-235b-a22b/mixed", "speedup": [1.0, 1.15, 1.3]}]
    t = {x["target"]: x for x in check_targets(res)}
    assert t["qwen3-235b-a22b/mixed: relibra vs static"]["met"]
    assert t["qwen3-235b-a22b/mixed: relibra vs eplb"]["value"] == pytest.approx(1.3 / 1.1)
    assert t["qwen3-235b-a22b/mixed: relibra % of bound"]["value"] == pytest.approx(100 * 1.3 / 1.4)
    assert t["gpt-oss-ep8 (r=2): relibra % of bound"]["met"]
    assert t["gpt-oss-ep8 (r=2): relibra % of bound, sum T_MoE only"]["value"] == 95.0


def test_notes_flag_dominant_reorder_and_replica_traffic():
    from relibra_moe.commands.demo import notes

    sc = {"name": "x", "num_tokens": 1000, "expert_mib": 47.0,
          "strategies": {"relibra": {"reorder_share": 0.2, "replica_share": 0.01}}}
    out = notes([sc])
    assert len(out) == 1 and "20% of relibra's step" in out[0] and "1,000 tokens" in out[0]
    sc["strategies"]["relibra"].update(reorder_share=0.01, replica_share=0.3)
    out = notes([sc])
    assert len(out) == 1 and "30%" in out[0] and "47 MiB" in out[0]
    sc["strategies"]["relibra"].update(replica_share=0.0)
    assert notes([sc]) == []
