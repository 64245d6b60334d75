"""``relibra plan``'s plan options: every flag reaches ``PlanOptions``, the pricing flags change what the plan
charges, ``--previous`` prices moves against a plan file and rejects one for another model or cluster."""

from __future__ import annotations

import json

import numpy as np
import pytest

from relibra_moe.cli import build_parser, main
from relibra_moe.commands.plan import plan_options
from relibra_moe.errors import PlanError
from relibra_moe.plan import BatchPlan, Placement, ReplicaPlan, SamplePlacement
from relibra_moe.planners.options import PlanOptions
from relibra_moe.planners.strategies import STRATEGIES, plan_batch
from relibra_moe.specs import cluster_preset, model_preset
from relibra_moe.trace import RoutingTrace, TraceBatch

MODEL = model_preset("gpt-oss-20b")  # 24 layers, 32 experts, top-4
CLUSTER = cluster_preset(nodes=2, gpus_per_node=4)
FAST = ["--iters", "300", "--locality-iters", "300"]


def _batch(seed: int = 0, n: int = 16) -> TraceBatch:
    rng = np.random.default_rng(seed)
    traces = []
    for i in range(n):
        S = int(rng.integers(8, 40))
        hot = rng.dirichlet(np.full(32, 0.3), size=24)
        logits = np.log(hot)[None] + rng.gumbel(size=(S, 24, 32))
        ids = np.argsort(-logits, axis=-1)[..., :4].astype(np.int16)
        traces.append(RoutingTrace(ids, np.arange(24, dtype=np.int32), 32, 4, source=f"synthetic {i}"))
    return TraceBatch(traces)


@pytest.fixture(scope="module")
def trace_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("cli_opts") / "trace.npz"
    _batch().save(path)
    return path


def _argv(trace_file, out, strategy, *extra):
    return ["plan", str(trace_file), "--model", "gpt-oss-20b", "--nodes", "2", "--gpus-per-node", "4",
            "--strategy", strategy, "--micro-batch-size", "4", "--out", str(out), "--json", *FAST, *extra]


def _run(argv, capsys) -> dict:
    rc = main(argv)
    out = capsys.readouterr().out
    assert rc == 0, out
    return json.loads(out)


def _options(*extra) -> PlanOptions:
    args = build_parser().parse_args(["plan", "t.npz", "--model", "gpt-oss-20b", "--nodes", "2", "--strategy",
                                      "relibra", "--out", "p.npz", *extra])
    return plan_options(args)


def test_strategy_choices_are_the_registry():
    parser = build_parser()
    plan_parser = parser._subparsers._group_actions[0].choices["plan"]
    (action,) = [a for a in plan_parser._actions if a.dest == "strategy"]
    assert tuple(action.choices) == tuple(STRATEGIES)


def test_defaults_are_plan_options_defaults():
    assert _options() == PlanOptions()


@pytest.mark.parametrize("flags, field, value", [
    (["--iters", "123"], "iters", 123),
    (["--locality-iters", "45"], "locality_iters", 45),
    (["--num-seeds", "3"], "num_seeds", 3),
    (["--rounds", "3"], "rounds", 3),
    (["--tol", "0.1"], "tol", 0.1),
    (["--beta", "30"], "beta", 30.0),
    (["--repack", "--token-cap", "900"], "token_cap", 900),
    (["--num-groups", "4"], "num_groups", 4),
    (["--final-reorder"], "final_reorder", True),
    (["--final-iters", "77"], "final_iters", 77),
    (["--optimizer-bytes", "4"], "optimizer_bytes_per_param", 4.0),
    (["--skew-cap", "0.05"], "skew_cap", 0.05),
    (["--cell-chunk", "5"], "cell_chunk", 5),
    (["--migration", "free"], "migration", False),
    (["--migration", "price"], "migration", True),
    (["--replica-pricing", "free"], "price_replicas", False),
    (["--objective", "aggregate"], "objective", "aggregate"),
    (["--balanced-sources", "even"], "balanced_sources", "even"),
    (["--replica-slots", "2"], "replica_slots", 2),
    (["--workers", "2"], "workers", 2),
    (["--seed", "9"], "seed", 9),
])
def test_each_flag_sets_its_option(flags, field, value):
    opts = _options(*flags)
    assert getattr(opts, field) == value
    others = {f: getattr(opts, f) for f in PlanOptions.names() if f not in (field, "repack")}
    assert others == {f: getattr(PlanOptions(), f) for f in others}  # nothing else moved


@pytest.mark.parametrize("flags, match", [
    (["--rounds", "0"], "rounds=0 must be an int >= 1"),
    (["--tol", "-1"], "tol=-1.0 must be a finite number >= 0"),
    (["--token-cap", "10"], "token_cap=10 only applies with repack=True"),
    (["--num-seeds", "0"], "num_seeds=0 must be an int >= 1"),
    (["--beta", "0"], "beta=0.0 must be a finite number > 0"),
])
def test_bad_flag_values_name_the_option(flags, match):
    with pytest.raises(PlanError, match=match):
        _options(*flags)


@pytest.mark.timeout(300)
def test_migration_free_skips_the_pricing_and_equals_plan_batch(trace_file, tmp_path, capsys):
    out = tmp_path / "free.npz"
    _run(_argv(trace_file, out, "relibra-inter", "--migration", "free"), capsys)
    plan = BatchPlan.load(out)
    assert plan.stats["migration"] == {"enabled": False}
    ref = plan_batch(_batch().with_micro_batch_size(4), MODEL, CLUSTER, "relibra-inter", iters=300,
                     locality_iters=300, migration=False)
    np.testing.assert_array_equal(plan.placement.expert_gpu, ref.placement.expert_gpu)
    np.testing.assert_array_equal(plan.samples.gpu, ref.samples.gpu)


@pytest.mark.timeout(300)
def test_replica_pricing_free_equals_plan_batch_unpriced(trace_file, tmp_path, capsys):
    out = tmp_path / "unpriced.npz"
    _run(_argv(trace_file, out, "relibra", "--replica-slots", "1", "--replica-pricing", "free"), capsys)
    plan = BatchPlan.load(out)
    assert plan.stats["options"] == {"iters": 300, "locality_iters": 300, "price_replicas": False}
    ref = plan_batch(_batch().with_micro_batch_size(4), MODEL, CLUSTER, "relibra", replica_slots=1, iters=300,
                     locality_iters=300, price_replicas=False)
    np.testing.assert_array_equal(plan.replicas.replica_expert, ref.replicas.replica_expert)
    np.testing.assert_array_equal(plan.replicas.split_index, ref.replicas.split_index)


@pytest.mark.timeout(300)
def test_previous_prices_moves_against_that_plan(trace_file, tmp_path, capsys):
    first, second = tmp_path / "first.npz", tmp_path / "second.npz"
    _run(_argv(trace_file, first, "relibra-inter"), capsys)
    _run(_argv(trace_file, second, "relibra-inter", "--seed", "1", "--previous", str(first)), capsys)
    a, b = BatchPlan.load(first), BatchPlan.load(second)
    assert b.stats["migration"]["enabled"]
    # the pricing counted moves against the first plan's homes, not against the static placement
    assert b.stats["migration"]["moved"] == int((a.placement.expert_gpu != b.placement.expert_gpu).sum())
    assert b.stats["options"]["previous"].startswith("sha1:")
    ref = plan_batch(_batch().with_micro_batch_size(4), MODEL, CLUSTER, "relibra-inter", seed=1, iters=300,
                     locality_iters=300, previous=a.placement)
    np.testing.assert_array_equal(b.placement.expert_gpu, ref.placement.expert_gpu)


def _plan_file(path, num_layers, num_experts, num_gpus, gpus_per_node):
    mb = np.zeros(4, np.int32)
    BatchPlan(Placement.static(num_layers, num_experts, num_gpus), SamplePlacement(mb, np.arange(4) % num_gpus, 1),
              ReplicaPlan.empty(1, num_layers, num_gpus, 0), num_gpus, gpus_per_node, {}).save(path)
    return path


@pytest.mark.parametrize("shape, match", [
    ((24, 64, 8, 4), "num_experts=64, but model gpt-oss-20b has num_experts=32"),
    ((12, 32, 8, 4), "num_layers=12, but model gpt-oss-20b has num_layers=24"),
    ((24, 32, 16, 8), "num_gpus=16, but the cluster has num_gpus=8"),
    ((24, 32, 8, 2), "gpus_per_node=2, but the cluster has gpus_per_node=4"),
])
def test_previous_for_another_model_or_cluster_names_file_and_field(trace_file, tmp_path, capsys, shape, match):
    prev = _plan_file(tmp_path / "other.npz", *shape)
    rc = main(_argv(trace_file, tmp_path / "out.npz", "relibra-inter", "--previous", str(prev)))
    err = capsys.readouterr().err
    assert rc == 1
    assert f"--previous {prev}: {match}" in err
    assert not (tmp_path / "out.npz").exists()


def test_previous_that_is_not_a_plan_file(trace_file, tmp_path, capsys):
    bad = tmp_path / "junk.npz"
    bad.write_bytes(b"not a zip")
    rc = main(_argv(trace_file, tmp_path / "out.npz", "relibra-inter", "--previous", str(bad)))
    assert rc == 1
    assert f"--previous {bad}: not a readable plan file" in capsys.readouterr().err
