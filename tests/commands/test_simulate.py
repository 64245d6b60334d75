"""`relibra simulate TRACE PLAN --model PRESET --json` agrees with relibra_moe.sim on the same files."""

from __future__ import annotations

import json

import numpy as np
import pytest

from relibra_moe.cli import main
from relibra_moe.evaluate import batch_sha1
from relibra_moe.plan import BatchPlan, Placement, ReplicaPlan, SamplePlacement
from relibra_moe.sim import simulate_loads
from relibra_moe.specs import cluster_preset, model_preset
from relibra_moe.trace import RoutingTrace, TraceBatch


@pytest.fixture
def files(tmp_path):
    model = model_preset("gpt-oss-20b")
    rng = np.random.default_rng(0)
    traces = []
    for _ in range(6):
        s = int(rng.integers(5, 30))
        ids = np.stack([np.stack([rng.choice(32, 4, replace=False) for _ in range(model.num_layers)])
                        for _ in range(s)])
        traces.append(RoutingTrace(ids, np.arange(model.num_layers), 32, 4, source="test"))
    batch = TraceBatch(traces)
    trace_path = tmp_path / "t.npz"
    batch.save(trace_path)
    G, L, E = 8, model.num_layers, model.num_experts
    expert_gpu = np.stack([rng.permutation(np.repeat(np.arange(G), E // G)) for _ in range(L)])
    rep = np.full((2, L, G, 1), -1)
    rep[1, 3, 1, 0] = int(np.flatnonzero(expert_gpu[3] == 0)[0])  # a replica inside node 0
    samples = SamplePlacement(np.array([0, 0, 0, 1, 1, 1]), np.array([0, 5, 2, 7, 1, 4]), 2)
    plan = BatchPlan(Placement(expert_gpu), samples, ReplicaPlan(rep, np.zeros((0, 5)), np.zeros(0)), G, 4,
                     {"strategy": "handmade", "batch_sha1": batch_sha1(batch)})
    plan_path = tmp_path / "p.npz"
    plan.save(plan_path)
    return batch, plan, trace_path, plan_path, model


def test_simulate_json_matches_library(files, capsys):
    batch, plan, trace_path, plan_path, model = files
    assert main(["simulate", str(trace_path), str(plan_path), "--model", "gpt-oss-20b", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    cluster = cluster_preset(nodes=2, gpus_per_node=4)  # the default preset (h100, Megatron's all-to-all)
    x = batch.loads(plan.samples.gpu, 8, plan.samples.micro_batch)
    ref = simulate_loads(plan, batch.lengths, x, model, cluster)
    assert out["step_s"] == pytest.approx(ref.step_s)
    assert out["tokens"] == batch.num_tokens
    assert out["tokens_per_s"] == pytest.approx(batch.num_tokens / ref.step_s)
    assert out["cluster"] == {"name": "h100", "nodes": 2, "gpus_per_node": 4, "dispatcher": "alltoall",
                              "overlap": "none"}
    assert out["strategy"] == "handmade" and out["replica_mode"] == "per-layer"
    assert out["experts_moved"] == ref.experts_moved > 0
    assert sum(out["breakdown"].values()) == pytest.approx(out["step_s"])
    assert len(out["micro_batch_s"]) == 2


def test_simulate_table_and_previous(files, capsys, tmp_path):
    _, plan, trace_path, plan_path, _ = files
    # With the plan itself as the previous placement nothing moves.
    assert main(["simulate", str(trace_path), str(plan_path), "--model", "gpt-oss-20b", "--previous",
                 str(plan_path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["experts_moved"] == 0
    assert main(["simulate", str(trace_path), str(plan_path), "--model", "gpt-oss-20b"]) == 0
    text = capsys.readouterr().out
    assert "moe_fwd_comm" in text and "tokens/s" in text


def test_simulate_model_mismatch_is_an_error(files, capsys):
    _, _, trace_path, plan_path, _ = files
    assert main(["simulate", str(trace_path), str(plan_path), "--model", "qwen3-30b-a3b"]) == 1
    err = capsys.readouterr().err
    assert "PlanError" in err and "has L=24, E=32" in err
    assert main(["simulate", str(trace_path), str(plan_path), "--model", "nope"]) == 1
    assert "unknown model preset 'nope'" in capsys.readouterr().err


def test_simulate_bad_previous_and_optimizer_bytes(files, capsys, tmp_path):
    """A --previous plan for another GPU count and a negative --optimizer-bytes end in a PlanError naming them."""
    batch, _, trace_path, plan_path, model = files
    L, E = model.num_layers, model.num_experts
    wide = BatchPlan(Placement.static(L, E, 16), SamplePlacement(np.zeros(6, np.int32), np.arange(6), 1),
                     ReplicaPlan.empty(1, L, 16, 0), 16, 8, {})
    wide_path = tmp_path / "wide.npz"
    wide.save(wide_path)
    base = ["simulate", str(trace_path), str(plan_path), "--model", "gpt-oss-20b"]
    assert main(base + ["--previous", str(wide_path)]) == 1
    err = capsys.readouterr().err
    assert f"--previous {wide_path}: num_gpus=16, but the cluster has num_gpus=8" in err, err
    assert main(base + ["--optimizer-bytes", "-1"]) == 1
    assert "optimizer_bytes_per_param=-1.0 must be a finite number >= 0" in capsys.readouterr().err
    assert main(base + ["--cluster", "nope"]) == 1
    assert "'nope'" in capsys.readouterr().err


def test_plan_score_and_simulate_report_the_same_step(tmp_path, capsys):
    """One evaluation: `relibra plan` and `relibra score` print the simulated step of `relibra simulate` (moves
    charged against the static placement, or against --previous), next to the moves-free sum of T_MoE."""
    from relibra_moe.synthetic import rl_batch

    model = model_preset("qwen3-30b-a3b")
    trace = tmp_path / "t.npz"
    rl_batch(model, "mixed", 4, seed=3, micro_batch_size=8).save(trace)
    base = [str(trace), "--model", "qwen3-30b-a3b"]
    where = ["--nodes", "2", "--gpus-per-node", "8"]

    def run(argv):
        assert main(argv) == 0
        return json.loads(capsys.readouterr().out)

    first = run(["plan", *base, *where, "--strategy", "eplb", "--replica-slots", "2", "--out", str(tmp_path / "a.npz"),
                 "--json"])
    second = run(["plan", *base, *where, "--strategy", "lpt", "--previous", str(tmp_path / "a.npz"),
                  "--out", str(tmp_path / "b.npz"), "--json"])
    for res, plan, prev in ((first, "a.npz", None), (second, "b.npz", "a.npz")):
        extra = [] if prev is None else ["--previous", str(tmp_path / prev)]
        score = run(["score", str(trace), str(tmp_path / plan), "--model", "qwen3-30b-a3b", *extra, "--json"])
        sim = run(["simulate", str(trace), str(tmp_path / plan), "--model", "qwen3-30b-a3b", *extra, "--json"])
        assert res["moves_charged_against"] == score["moves_charged_against"] == (
            "static" if prev is None else str(tmp_path / prev))
        assert res["step_s"] == score["step_s"] == sim["step_s"]
        assert res["experts_moved"] == score["experts_moved"] == sim["experts_moved"]
        assert res["t_moe_s"] == score["t_moe_s"]
    # EPLB+ moves experts away from static; lpt after it is charged against EPLB+'s placement, not static
    assert first["experts_moved"] > 0
    static_charge = run(["score", str(trace), str(tmp_path / "b.npz"), "--model", "qwen3-30b-a3b", "--json"])
    assert static_charge["experts_moved"] != second["experts_moved"]


def test_simulate_cluster_profile_and_dispatcher(files, capsys, tmp_path):
    """--cluster-profile FILE charges the profile's rates and dispatcher; --dispatcher deepep the preset's DeepEP
    rates and traffic; a --dispatcher that contradicts the profile is refused."""
    from relibra_moe.specs import cluster_profile, save_cluster_profile

    batch, plan, trace_path, plan_path, model = files
    x = batch.loads(plan.samples.gpu, 8, plan.samples.micro_batch)
    prof = cluster_preset("h800", nodes=1, gpus_per_node=4, dispatcher="deepep").with_(flops=123e12)
    path = tmp_path / "p.json"
    save_cluster_profile(path, cluster_profile(prof, "test"))
    assert main(["simulate", str(trace_path), str(plan_path), "--model", "gpt-oss-20b", "--json",
                 "--cluster-profile", str(path)]) == 0
    out = json.loads(capsys.readouterr().out)
    ref = simulate_loads(plan, batch.lengths, x, model, prof.with_(nodes=2))
    assert out["step_s"] == pytest.approx(ref.step_s)
    assert out["cluster"] == {"name": "h800", "nodes": 2, "gpus_per_node": 4, "dispatcher": "deepep",
                              "overlap": "none"}
    assert main(["simulate", str(trace_path), str(plan_path), "--model", "gpt-oss-20b", "--json",
                 "--dispatcher", "deepep"]) == 0
    out = json.loads(capsys.readouterr().out)
    ref = simulate_loads(plan, batch.lengths, x, model, cluster_preset(nodes=2, gpus_per_node=4, dispatcher="deepep"))
    assert out["step_s"] == pytest.approx(ref.step_s)
    assert main(["simulate", str(trace_path), str(plan_path), "--model", "gpt-oss-20b", "--cluster-profile",
                 str(path), "--dispatcher", "alltoall"]) == 1
    assert "--dispatcher alltoall differs from the profile" in capsys.readouterr().err
    path.write_text("{}")
    assert main(["simulate", str(trace_path), str(plan_path), "--model", "gpt-oss-20b", "--cluster-profile",
                 str(path)]) == 1
    assert "PlanError" in capsys.readouterr().err
