"""Numbers nobody checked: cluster profiles, model configs, swap and trainer arguments. Each is refused at the
boundary with the field, the value and the accepted range (or rule), and nothing changes before the refusal."""

from __future__ import annotations

import json

import pytest
import torch

from relibra_moe.cli import main
from relibra_moe.errors import PlanError, ReplayError
from relibra_moe.integrations.hf import moe_blocks, swap_moe_blocks
from relibra_moe.integrations.hf_tiny import tiny_model
from relibra_moe.specs import ModelSpec, cluster_preset, cluster_profile, load_cluster_profile


@pytest.mark.parametrize("field,value,fragment", [
    ("flops", 5e-324, "flops must be a rate in [1e-06, 1e+20] FLOP/s, got 5e-324"),
    ("rdma_bw", 1e-300, "rdma_bw must be a rate in [1e-06, 1e+20] bytes/s, got 1e-300"),
    ("nvlink_latency", 1e300, "nvlink_latency must be a latency in [0, 1e+06] seconds, got 1e+300"),
    ("attn_flops", float("inf"), "attn_flops"),
])
def test_a_cluster_profile_with_an_absurd_rate_is_refused(field, value, fragment, tmp_path, capsys):
    prof = cluster_profile(cluster_preset("h100", nodes=1), "test")
    prof[field] = value
    path = tmp_path / "p.json"
    path.write_text(json.dumps(prof))
    with pytest.raises(PlanError, match="cluster profile") as exc:
        load_cluster_profile(path, nodes=1)
    assert fragment in str(exc.value)
    out, trace = tmp_path / "plan.npz", tmp_path / "t.npz"
    assert main(["trace", "synth", "--model", "gpt-oss-20b", "--domain", "math", "--prompts", "1", "--counts-only",
                 "--out", str(trace)]) == 0
    capsys.readouterr()
    rc = main(["plan", str(trace), "--model", "gpt-oss-20b", "--nodes", "1", "--gpus-per-node", "8", "--strategy",
               "static", "--cluster-profile", str(path), "--out", str(out)])
    err = capsys.readouterr().err
    assert rc == 1 and "error: PlanError: " in err and fragment in err and "Traceback" not in err, err
    assert not out.exists()


def test_a_profile_nested_too_deep_is_a_plan_error(tmp_path):
    (tmp_path / "p.json").write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(PlanError, match="nests deeper"):
        load_cluster_profile(tmp_path / "p.json", nodes=1)


BASE = {"model_type": "qwen3_moe", "hidden_size": 64, "moe_intermediate_size": 32, "num_experts": 8,
        "num_experts_per_tok": 2, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16}


@pytest.mark.parametrize("change,fragment", [
    ({"mlp_only_layers": "0,1"}, "field 'mlp_only_layers' = '0,1' must be a list of decoder-layer indices in [0, 4)"),
    ({"mlp_only_layers": [0.5]}, "field 'mlp_only_layers' = [0.5]"),
    ({"mlp_only_layers": 5}, "field 'mlp_only_layers' = 5"),
    ({"hidden_size": 10 ** 12}, "ModelSpec.hidden=1000000000000 must be an int in [0, 1048576]"),
    ({"num_key_value_heads": 64}, "ModelSpec.num_kv_heads=64 must divide num_heads=4"),
    ({"num_key_value_heads": 3}, "ModelSpec.num_kv_heads=3 must divide num_heads=4"),
])
def test_model_config_fields_are_checked(change, fragment, tmp_path, capsys):
    with pytest.raises(ValueError) as exc:
        ModelSpec.from_hf_config({**BASE, **change})
    assert fragment in str(exc.value)
    (tmp_path / "config.json").write_text(json.dumps({**BASE, **change}))
    rc = main(["trace", "synth", "--model-config", str(tmp_path / "config.json"), "--domain", "math", "--prompts",
               "2", "--out", str(tmp_path / "t.npz")])
    err = capsys.readouterr().err
    assert rc == 1 and fragment in err and "Traceback" not in err, err


def test_mlp_only_layers_still_selects_the_dense_layers():
    assert ModelSpec.from_hf_config({**BASE, "mlp_only_layers": [0, 1]}).num_layers == 2
    assert ModelSpec.from_hf_config({**BASE, "mlp_only_layers": []}).num_layers == 4


def test_torchtitan_swap_with_a_bad_gpus_per_node_changes_nothing_and_a_retry_works():
    pytest.importorskip("torchtitan")
    from tests.integrations.test_torchtitan import _run, _tokens, qwen3_moe

    model = qwen3_moe()
    x = _tokens()
    with torch.no_grad():
        ref = _run(model, x)
    before = [(name, b, {n: type(m) for n, m in b.named_modules()}) for _, name, b in moe_blocks(model)]
    for kwargs, msg in (({"gpus_per_node": 3}, "gpus_per_node=3 does not divide the EP group size 1"),
                        ({"replica_slots": 100000}, r"replica_slots=100000 is over the ceiling E - E/G = 0")):
        with pytest.raises(ValueError, match=msg):
            swap_moe_blocks(model, **kwargs)
        assert [(name, b, {n: type(m) for n, m in b.named_modules()}) for _, name, b in moe_blocks(model)] == before
        with torch.no_grad():
            assert torch.equal(_run(model, x), ref)  # block 0's router is torchtitan's own
    swap_moe_blocks(model)
    with torch.no_grad():
        torch.testing.assert_close(_run(model, x), ref, atol=2e-2, rtol=2e-2)  # test_torchtitan's tolerance


@pytest.mark.parametrize("kwargs,fragment", [
    ({"strategy": "foo"}, "unknown strategy 'foo'"),
    ({"replica_slots": 10 ** 6}, "replica_slots=1000000 is over the ceiling E - E/G = 7 (E=8, G=8"),
    ({"replica_slots": -1}, "replica_slots=-1 must be an int >= 0"),
    ({"planner_options": {"bogus": 1}}, "unknown plan option bogus=1"),
    ({"planner_options": "beta=2"}, "planner_options='beta=2' must be a dict"),
    ({"planner": "not a planner"}, "planner='not a planner' must be a relibra_moe.Planner"),
    ({"gpus_per_node": 0}, "gpus_per_node=0 must be an int >= 1"),
    ({"cluster": "h100"}, "cluster='h100' must be a relibra_moe.ClusterSpec"),
])
def test_replay_grpo_trainer_refuses_bad_arguments_at_construction(kwargs, fragment):
    pytest.importorskip("trl")
    from relibra_moe.integrations.trl import ReplayGRPOTrainer

    model = tiny_model("qwen3_moe")
    blocks = [b for _, _, b in moe_blocks(model)]
    with pytest.raises(ReplayError) as exc:
        ReplayGRPOTrainer(model, reward_funcs=[], **kwargs)
    assert fragment in str(exc.value) and "ReplayGRPOTrainer" in str(exc.value)
    assert [b for _, _, b in moe_blocks(model)] == blocks  # refused before anything was swapped
