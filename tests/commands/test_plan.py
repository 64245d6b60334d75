"""``relibra plan`` / ``relibra score`` and ``plan_batch``: every strategy gives a valid plan file, the two
commands agree, files are byte-deterministic, scores match an independent per-micro-batch reference.

``relibra plan``'s plan options: every flag reaches ``PlanOptions``, the pricing flags change what the plan
charges, ``--previous`` prices moves against a plan file and rejects one for another model or cluster.

`--sample-owner` / `--sample-gpu` of `relibra plan`, `compare` (both modes on one table) and the steady state:
the CLI's figures equal the library's in the same mode, the trainer's ranks are kept, bad flags are named.
"""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from relibra_moe.cli import build_parser, main
from relibra_moe.commands.plan import plan_options
from relibra_moe.cost import moe_cost
from relibra_moe.errors import PlanError, TraceError
from relibra_moe.evaluate import bound_micro_batch, bound_t_moe, score_plan
from relibra_moe.plan import BatchPlan, Placement, ReplicaPlan, SamplePlacement
from relibra_moe.planners.options import PlanOptions
from relibra_moe.planners.strategies import STRATEGIES, plan_batch
from relibra_moe.sim import simulate_step
from relibra_moe.specs import DEFAULT_CLUSTER, cluster_preset, model_preset
from relibra_moe.steady import consecutive_batches
from relibra_moe.trace import RoutingTrace, TraceBatch
from tests.conftest import two_hot_batch

MODEL = model_preset("gpt-oss-20b")  # 24 layers, 32 experts, top-4
CLUSTER = cluster_preset(nodes=2, gpus_per_node=4)
FAST = ["--iters", "300", "--locality-iters", "300"]


def _batch(seed: int = 0, n: int = 16) -> TraceBatch:
    rng = np.random.default_rng(seed)
    traces = []
    for i in range(n):
        S = int(rng.integers(8, 40))
        hot = rng.dirichlet(np.full(32, 0.3), size=24)  # skewed per-sample routing
        logits = np.log(hot)[None] + rng.gumbel(size=(S, 24, 32))
        ids = np.argsort(-logits, axis=-1)[..., :4].astype(np.int16)
        traces.append(RoutingTrace(ids, np.arange(24, dtype=np.int32), 32, 4, source=f"synthetic {i}"))
    return TraceBatch(traces)


@pytest.fixture(scope="module")
def trace_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("cli") / "trace.npz"
    _batch().save(path)
    return path


def _run(argv, capsys) -> dict:
    rc = main(argv)
    out = capsys.readouterr().out
    assert rc == 0, out
    return json.loads(out)


def _plan_args(trace_file, out, strategy, *extra):
    return ["plan", str(trace_file), "--model", "gpt-oss-20b", "--nodes", "2", "--gpus-per-node", "4",
            "--strategy", strategy, "--micro-batch-size", "4", "--out", str(out), "--json", *FAST, *extra]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("strategy, extra", [
    ("static", []), ("lpt", []), ("eplb", []), ("eplb", ["--replica-slots", "1"]), ("balanced", []),
    ("relibra-inter", []), ("relibra-inter", ["--repack"]), ("lplb", ["--replica-slots", "1"]),
    ("relibra", ["--replica-slots", "1"]), ("relibra", ["--replica-slots", "1", "--skew-cap", "0.05"]),
])
def test_every_strategy_plans_and_scores_agree(trace_file, tmp_path, capsys, strategy, extra):
    out = tmp_path / "plan.npz"
    res = _run(_plan_args(trace_file, out, strategy, *extra), capsys)
    for k in ("strategy", "t_moe_s", "rank_skew_mean", "solve_s"):
        assert k in res
    assert res["strategy"] == strategy
    plan = BatchPlan.load(out)
    plan.validate(MODEL, CLUSTER, num_samples=16)
    assert plan.stats.strategy == strategy and plan.stats.solve_seconds is None
    scored = _run(["score", str(trace_file), str(out), "--model", "gpt-oss-20b", "--json"], capsys)
    assert scored["t_moe_s"] == pytest.approx(res["t_moe_s"], rel=1e-12)
    assert scored["rank_skew_mean"] == pytest.approx(res["rank_skew_mean"], rel=1e-12)


def test_plan_file_is_byte_deterministic(trace_file, tmp_path, capsys):
    a, b = tmp_path / "a.npz", tmp_path / "b.npz"
    _run(_plan_args(trace_file, a, "relibra-inter", "--repack", "--seed", "3"), capsys)
    _run(_plan_args(trace_file, b, "relibra-inter", "--repack", "--seed", "3"), capsys)
    assert a.read_bytes() == b.read_bytes()


def test_cli_errors(trace_file, tmp_path, capsys):
    rc = main(["score", str(trace_file), str(tmp_path / "none.npz"), "--model", "gpt-oss-20b"])
    assert rc == 1 and "no such file" in capsys.readouterr().err
    rc = main(["plan", str(trace_file), "--model", "nope", "--nodes", "1", "--strategy", "static",
               "--out", str(tmp_path / "x.npz")])
    assert rc == 1 and "unknown model preset" in capsys.readouterr().err
    rc = main(["plan", str(trace_file), "--model", "qwen3-30b-a3b", "--nodes", "1", "--strategy", "static",
               "--micro-batch-size", "4", "--out", str(tmp_path / "x.npz")])
    assert rc == 1 and "has L=24, E=32" in capsys.readouterr().err



@pytest.mark.parametrize("flags, msg", [
    (["--nodes", "1", "--gpus-per-node", "3"], "num_experts=32 is not divisible by num_gpus=3"),
    (["--nodes", "2", "--gpus-per-node", "4", "--replica-slots", "-1"], "replica_slots=-1 must be an int >= 0"),
    (["--nodes", "2", "--gpus-per-node", "4", "--micro-batch-size", "0"], "micro_batch_size must be a positive int, "
                                                                          "got 0"),
    (["--nodes", "2", "--gpus-per-node", "4", "--workers", "0"], "workers=0 must be an int >= 1"),
    (["--nodes", "2", "--gpus-per-node", "4", "--iters", "-1"], "iters=-1 must be an int >= 0"),
    (["--nodes", "2", "--gpus-per-node", "4", "--seed", "-2"], "seed=-2 must be an int >= 0"),
    (["--nodes", "2", "--gpus-per-node", "4", "--cluster", "nope"], "'nope'"),
    (["--nodes", "2", "--gpus-per-node", "4", "--rounds", "0"], "rounds=0 must be an int >= 1"),
    (["--nodes", "2", "--gpus-per-node", "4", "--replica-slots", "2", "--strategy", "static"],
     "--replica-slots=2 only applies to eplb, lplb, relibra, eplb-history, online, balanced, not --strategy static"),
    (["--nodes", "2", "--gpus-per-node", "4"], "no micro-batch assignment (for every sample): pass --micro-batch-size"),
    (["--nodes", "2", "--gpus-per-node", "4", "--skew-cap", "-0.1"], "skew_cap=-0.1 must be a finite number >= 0"),
    (["--nodes", "2", "--gpus-per-node", "4", "--skew-cap", "0.05", "--strategy", "lpt"],
     "skew_cap=0.05 only applies to relibra and relibra-inter, not strategy 'lpt'"),
])
def test_cli_plan_bad_flags(trace_file, tmp_path, capsys, flags, msg):
    """Bad flags end in ``relibra plan: error: ...`` naming the flag's field and value, not a traceback."""
    out = tmp_path / "x.npz"
    args = ["plan", str(trace_file), "--model", "gpt-oss-20b", "--strategy", "relibra", "--out", str(out), *flags]
    if "--micro-batch-size" not in flags and "no micro-batch" not in msg:
        args += ["--micro-batch-size", "4"]
    assert main(args) == 1
    err = capsys.readouterr().err
    assert msg in err and "Traceback" not in err
    assert not out.exists()


def test_cli_unknown_strategy_is_argparse_error(trace_file, tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["plan", str(trace_file), "--model", "gpt-oss-20b", "--nodes", "2", "--strategy", "magic",
              "--out", str(tmp_path / "x.npz")])
    assert exc.value.code == 2 and "invalid choice: 'magic'" in capsys.readouterr().err


def test_score_rejects_plan_for_another_trace_or_model(trace_file, tmp_path, capsys):
    """A plan file scored on another trace with the same sample count is refused (its recorded batch_sha1
    differs); so is one for another cluster or model, in ``relibra score`` and ``relibra simulate`` alike."""
    plan_path = tmp_path / "p.npz"
    _run(_plan_args(trace_file, plan_path, "static"), capsys)
    other = tmp_path / "other.npz"
    _batch(seed=9).save(other)  # also 16 samples
    for cmd in ("score", "simulate"):
        assert main([cmd, str(other), str(plan_path), "--model", "gpt-oss-20b"]) == 1
        err = capsys.readouterr().err
        assert "plan was made for another batch" in err and "same 16 samples" in err
    with pytest.raises(PlanError, match="plan was made for another batch"):
        score_plan(BatchPlan.load(plan_path), TraceBatch.load(other), MODEL, CLUSTER)
    with pytest.raises(PlanError, match=r"plan is for 8 GPUs \(4 per node\), the cluster has 8 \(8 per node\)"):
        score_plan(BatchPlan.load(plan_path), TraceBatch.load(trace_file), MODEL, cluster_preset(nodes=1))
    small = BatchPlan.load(plan_path)
    with pytest.raises(PlanError, match="plan has L=24, E=32; model gpt-oss-20b has L=24, E=64"):
        score_plan(small, TraceBatch.from_counts(np.full((16, 24, 64), 1), 4), MODEL.with_(num_experts=64),
                   CLUSTER)


def _reference_total(plan: BatchPlan, batch: TraceBatch, cluster=CLUSTER) -> float:
    """Sum of exact T_MoE, one micro-batch at a time through moe_cost with dense ReplicaPlan.shares."""
    x = batch.loads(plan.samples.gpu, cluster.num_gpus, plan.samples.micro_batch)
    tot = 0.0
    for m in range(plan.num_micro_batches):
        sh = plan.replicas.shares(plan.placement, m)
        tot += float(moe_cost(x[m], None, MODEL, cluster, shares=sh).t_moe.sum())
    return tot


@pytest.mark.timeout(300)
def test_plan_batch_scores_match_reference_and_ordering():
    batch = _batch(1, n=24).with_micro_batch_size(4)
    opts = dict(iters=400, locality_iters=400)
    plans = {s: plan_batch(batch, MODEL, CLUSTER, s, seed=0, **opts) for s in ("static", "lpt", "relibra-inter")}
    # migration-free, annealing T_MoE itself: the pure cost-model ordering (with migration priced, layers may keep
    # static homes; with the default step objective the annealers weight compute 1.5 : 1)
    plans["relibra-inter-free"] = plan_batch(batch, MODEL, CLUSTER, "relibra-inter", seed=0, migration=False,
                                             step_objective=False, **opts)
    plans["eplb1"] = plan_batch(batch, MODEL, CLUSTER, "eplb", replica_slots=1)
    plans["relibra"] = plan_batch(batch, MODEL, CLUSTER, "relibra", replica_slots=1, **opts)
    scores = {}
    for name, p in plans.items():
        s = score_plan(p, batch, MODEL, CLUSTER)
        assert s.t_moe.shape == (6, 24)
        assert s.t_moe_s == pytest.approx(_reference_total(p, batch), rel=1e-9)
        scores[name] = s.t_moe_s
    # relibra-inter keeps LPT as a candidate per layer and only accepts improving locality
    assert scores["relibra-inter-free"] <= scores["lpt"] + 1e-15
    assert plans["relibra-inter-free"].stats.objective == pytest.approx(scores["relibra-inter-free"], rel=1e-9)
    pb = plan_batch(batch, MODEL, CLUSTER, "balanced", replica_slots=1, seed=0)
    bal = bound_t_moe(batch, MODEL, CLUSTER, 1, micro_batch=bound_micro_batch(pb, batch))
    assert score_plan(pb, batch, MODEL, CLUSTER).t_moe_s == pytest.approx(bal, rel=1e-12)
    assert bal <= min(scores.values())  # no plan beats the bound
    s = score_plan(plans["static"], batch, MODEL, CLUSTER, bound_t_moe_s=bal)
    assert s.percent_of_bound == pytest.approx(100 * bal / scores["static"])


@pytest.mark.timeout(300)
def test_relibra_is_relibra_inter_plus_replication_and_rank_balance_mode():
    """Without the portfolio (which would pick a plan without moves here, moves being charged by the step)
    relibra keeps relibra-inter's homes and samples (same seeds) and only adds replicas, so it is never slower;
    ``skew_cap`` (rank-balance mode) trades communication for node balance of the homes."""
    batch = _batch(3, n=24).with_micro_batch_size(4)
    free = dict(iters=400, locality_iters=400, migration=False, price_replicas=False, portfolio=False)
    inter = plan_batch(batch, MODEL, CLUSTER, "relibra-inter", **free)
    rel = plan_batch(batch, MODEL, CLUSTER, "relibra", replica_slots=1, **free)
    np.testing.assert_array_equal(rel.placement.expert_gpu, inter.placement.expert_gpu)
    np.testing.assert_array_equal(rel.samples.gpu, inter.samples.gpu)
    assert (rel.replicas.replica_expert >= 0).any()
    t_inter = score_plan(inter, batch, MODEL, CLUSTER).t_moe_s
    t_rel = score_plan(rel, batch, MODEL, CLUSTER).t_moe_s
    assert t_rel < t_inter

    def node_skew(plan):  # mean over cells of the busiest node's mean GPU load / the mean GPU load
        x = batch.loads(plan.samples.gpu, 8, plan.samples.micro_batch).astype(np.float64)  # [M, L, G, E]
        gl = np.einsum("mlje,leg->mlg", x, np.eye(8)[plan.placement.expert_gpu])
        return float((gl.reshape(*gl.shape[:2], 2, 4).mean(-1).max(-1) / gl.mean(-1)).mean())

    bal = plan_batch(batch, MODEL, CLUSTER, "relibra", replica_slots=1, skew_cap=0.0, **free)
    assert bal.stats.options["skew_cap"] == 0.0
    assert node_skew(bal) < node_skew(rel)


def test_registry_and_plan_batch_errors():
    assert {"static", "eplb", "balanced", "relibra-inter", "lplb", "relibra"} <= set(STRATEGIES)
    batch = _batch(2, n=8)
    with pytest.raises(PlanError, match="unknown strategy"):
        plan_batch(batch, MODEL, CLUSTER, "magic", micro_batch_size=4)
    with pytest.raises(PlanError, match="replica_slots=-1"):
        plan_batch(batch, MODEL, CLUSTER, "static", replica_slots=-1, micro_batch_size=4)
    with pytest.raises(PlanError, match="model qwen3-30b-a3b"):
        plan_batch(batch, model_preset("qwen3-30b-a3b"), CLUSTER, "static", micro_batch_size=4)
    with pytest.raises(PlanError, match="rounds=0"):
        plan_batch(batch, MODEL, CLUSTER, "relibra-inter", rounds=0, micro_batch_size=4)
    with pytest.raises(ValueError, match="micro-batch"):
        plan_batch(batch, MODEL, CLUSTER, "static")  # no assignment and no micro_batch_size

    with pytest.raises(PlanError, match=r"unknown strategy 'magic'"):
        plan_batch(batch, MODEL, CLUSTER, "magic", micro_batch_size=4)
    with pytest.raises(PlanError, match="num_experts=32 is not divisible by num_gpus=3"):
        plan_batch(batch, MODEL, cluster_preset(nodes=1, gpus_per_node=3), "static", micro_batch_size=4)
    with pytest.raises(TraceError, match="micro_batch_size must be a positive int, got 0"):
        plan_batch(batch, MODEL, CLUSTER, "static", micro_batch_size=0)


def test_plan_batch_and_score_reject_non_batches():
    batch = _batch(2, n=8).with_micro_batch_size(4)
    with pytest.raises(PlanError, match="batch must be a TraceBatch, got ndarray"):
        plan_batch(batch.sample_expert_counts(), MODEL, CLUSTER, "static")
    plan = plan_batch(batch, MODEL, CLUSTER, "static")
    with pytest.raises(PlanError, match="batch must be a TraceBatch, got ndarray"):
        score_plan(plan, batch.loads(plan.samples.gpu, 8), MODEL, CLUSTER)
    with pytest.raises(PlanError, match="plan must be a BatchPlan, got dict"):
        score_plan(plan.stats.to_dict(), batch, MODEL, CLUSTER)


def test_rank_balance_options_only_for_relibra():
    for strategy in ("static", "lpt", "eplb", "lplb"):
        with pytest.raises(PlanError, match=f"skew_cap=0.05 only applies to relibra and relibra-inter, not "
                                            f"strategy '{strategy}'"):
            plan_batch(_batch(2, n=8), MODEL, CLUSTER, strategy, micro_batch_size=4, skew_cap=0.05)
    with pytest.raises(PlanError, match="node_comp=True only applies"):
        plan_batch(_batch(2, n=8), MODEL, CLUSTER, "static", micro_batch_size=4, node_comp=True)


@pytest.mark.parametrize("kw, msg", [
    ({"replica_slots": 2.5}, "replica_slots=2.5 must be an int >= 0"),
    ({"replica_slots": "2"}, "replica_slots='2' must be an int >= 0"),
    ({"replica_slots": True}, "replica_slots=True must be an int >= 0"),
    ({"workers": 0}, "workers=0 must be an int >= 1"),
    ({"seed": -1}, "seed=-1 must be an int >= 0"),
    ({"iters": -5}, "iters=-5 must be an int >= 0"),
    ({"locality_iters": 1.5}, "locality_iters=1.5 must be an int >= 0"),
    ({"num_seeds": 0}, "num_seeds=0 must be an int >= 1"),
    ({"num_groups": 0}, "num_groups=0 must be an int >= 1"),
    ({"beta": -1.0}, "beta=-1.0 must be a finite number > 0"),
    ({"beta": float("inf")}, "beta=inf must be a finite number > 0"),
    ({"objective": "fast"}, "objective='fast' is not one of"),
    ({"itres": 5}, "unknown plan option itres=5"),
    ({"token_cap": 500}, "token_cap=500 only applies with repack=True"),
    ({"skew_cap": -0.5}, "skew_cap=-0.5 must be a finite number >= 0"),
    ({"skew_cap": "low"}, "skew_cap='low' must be a finite number >= 0"),
    ({"skew_cap": 0.05, "node_comp": False}, "skew_cap=0.05 caps the node-level compute skew of node_comp: it "
                                             "needs node_comp=True"),
])
def test_plan_batch_rejects_bad_arguments(kw, msg):
    """Bad arguments fail up front with the field and the value, before any planning work."""
    with pytest.raises(PlanError, match=msg.replace("(", r"\(").replace(")", r"\)")):
        plan_batch(_batch(2, n=8), MODEL, CLUSTER, "relibra", micro_batch_size=4, **kw)


@pytest.mark.parametrize("nodes, gpn, r", [(1, 1, 0), (4, 8, 1), (1, 8, 0)])
def test_plan_batch_edge_clusters(nodes, gpn, r):
    """One GPU (everything local: no communication, skew 1), E = G (one expert per GPU) and r = 0 give valid
    plans whose score equals an independent per-micro-batch ``moe_cost`` of the plan's own routing. One GPU
    homes every expert, so it can hold no replica: its replica_slots ceiling E - E/G is 0."""
    cluster = cluster_preset(nodes=nodes, gpus_per_node=gpn)
    batch = _batch(5, n=6).with_micro_batch_size(4)  # the last micro-batch holds 2 samples
    if cluster.num_gpus == 1:
        with pytest.raises(PlanError, match=r"replica_slots=1 is over the ceiling E - E/G = 0 \(E=32, G=1"):
            plan_batch(batch, MODEL, cluster, "relibra", replica_slots=1, micro_batch_size=4)
    plan = plan_batch(batch, MODEL, cluster, "relibra", replica_slots=r, micro_batch_size=4, iters=100,
                      locality_iters=100)
    plan.validate(MODEL, cluster, num_samples=6)
    s = score_plan(plan, batch, MODEL, cluster)
    assert s.t_moe_s == pytest.approx(_reference_total(plan, batch, cluster), rel=1e-9)
    if cluster.num_gpus == 1:
        assert s.moe_fwd_comm_s == 0.0 and s.rank_skew_mean == pytest.approx(1.0)
        assert (plan.replicas.replica_expert < 0).all()
    if r == 0:
        assert plan.replicas.replica_expert.shape[-1] == 0 and len(plan.replicas.split_index) == 0


@pytest.mark.parametrize("strategy", sorted(STRATEGIES))
def test_empty_micro_batch_and_zero_token_sample(strategy):
    """Micro-batch 1 holds no sample and sample 3 has no token: every strategy still gives a valid plan whose
    score equals the per-micro-batch reference, the empty micro-batch costs nothing and (relibra) holds no
    replica."""
    from relibra_moe.sim import simulate_step

    base = _batch(4, n=8)
    empty = RoutingTrace(np.zeros((0, 24, 4), np.int16), np.arange(24, dtype=np.int32), 32, 4, source="empty")
    batch = TraceBatch([base.trace(i) for i in range(3)] + [empty] + [base.trace(i) for i in range(3, 8)],
                       micro_batch=np.array([0, 0, 0, 0, 2, 2, 2, 2, 2], np.int32))
    assert batch.lengths[3] == 0
    # relibra* start from verl's length-balanced placement by default, which re-cuts the micro-batches (and so
    # fills micro-batch 1); on the round-robin start they keep the batch's, empty one included
    kw = {"sample_placement": "round-robin"} if strategy in ("relibra", "relibra-inter") else {}
    plan = plan_batch(batch, MODEL, CLUSTER, strategy, replica_slots=1, iters=100, locality_iters=100, **kw)
    plan.validate(MODEL, CLUSTER, num_samples=9)
    assert plan.num_micro_batches == 3 and not (plan.samples.micro_batch == 1).any()
    s = score_plan(plan, batch, MODEL, CLUSTER)
    assert s.t_moe[1].sum() == 0.0
    if strategy == "relibra":  # EPLB's and LPLB's copies are chosen per batch, the same in every micro-batch
        assert (plan.replicas.replica_expert[1] < 0).all()
    if strategy != "balanced":  # balanced is scored on the ideal's loads
        assert s.t_moe_s == pytest.approx(_reference_total(plan, batch), rel=1e-9)
    step = simulate_step(plan, batch, MODEL, CLUSTER)
    assert step.micro_batch_s[1] == 0.0 and step.tokens == int(batch.lengths.sum())


def test_score_plan_rejects_bad_beta_and_balanced_total():
    batch = _batch(2, n=8).with_micro_batch_size(4)
    plan = plan_batch(batch, MODEL, CLUSTER, "static")
    with pytest.raises(PlanError, match="beta=-1.0 must be a finite number > 0"):
        score_plan(plan, batch, MODEL, CLUSTER, beta=-1.0)
    with pytest.raises(PlanError, match="bound_t_moe_s=0.0 must be a finite number > 0"):
        score_plan(plan, batch, MODEL, CLUSTER, bound_t_moe_s=0.0)




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


def _subparser(name: str):
    return build_parser()._subparsers._group_actions[0].choices[name]


def _help_defaults(parser) -> dict[str, str]:
    """dest -> the value after "default " in the action's expanded help (argparse's %(default)s filled in)."""
    fmt = parser._get_formatter()
    out = {}
    for action in parser._actions:
        if action.help and (m := re.search(r"default:? ([^\s;:),]+)", fmt._expand_help(action))):
            out[action.dest] = m.group(1)
    return out


def _field_default(name: str):
    import dataclasses

    (f,) = [f for f in dataclasses.fields(PlanOptions) if f.name == name]
    return f.default


# the option flags' help names the PlanOptions default (hand-written once here: a drift of either side fails)
HELP_DEFAULTS = {"rounds": "2", "tol": "0.05", "beta": "20", "optimizer_bytes_per_param": "12", "objective": "batch",
                 "replica_slots": "0", "seed": "0", "workers": "1", "sample_owner": "planner", "final_iters": "8",
                 "move_horizon": "1"}


@pytest.mark.parametrize("command", ["plan", "compare", "demo"])
def test_help_defaults_are_the_plan_options_defaults(command):
    parser = _subparser(command)
    shown = _help_defaults(parser)
    checked = 0
    for dest, text in shown.items():
        if dest not in PlanOptions.names() or (command == "compare" and dest == "replica_slots") or \
                (command == "demo" and dest == "workers"):
            continue  # demo: the CPU count; compare: its own default (2), shown by %(default)s
        if _field_default(dest) is None and dest != "final_iters":
            continue  # None is a rule the help describes in words ("default: one per worker")
        if isinstance(_field_default(dest), bool):
            continue  # --migration / --replica-pricing show price / free: test_parser_defaults_... checks them
        want = HELP_DEFAULTS[dest] if dest == "final_iters" else format(_field_default(dest), "g") \
            if isinstance(_field_default(dest), float) else str(_field_default(dest))
        assert text == want, (command, dest, text, want)
        assert HELP_DEFAULTS[dest] == want, f"PlanOptions.{dest} default moved to {want}: update the docs and here"
        checked += 1
    assert checked >= {"plan": 9, "compare": 3, "demo": 2}[command]
    from relibra_moe.planners.options import FINAL_ITERS_FACTOR

    assert str(FINAL_ITERS_FACTOR) == HELP_DEFAULTS["final_iters"]


@pytest.mark.parametrize("command", ["plan", "compare", "demo"])
def test_parser_defaults_are_the_plan_options_defaults(command):
    """Every flag of a PlanOptions field that has a parser default has the field's default (demo's --workers is
    None: the CPU count; plan's None-valued flags leave the option at its default)."""
    parser = _subparser(command)
    for action in parser._actions:
        if action.dest in PlanOptions.names() and action.default is not None and action.dest != "migration":
            if command == "compare" and action.dest == "replica_slots":
                assert action.default == 2  # compare shows replicas by default
                continue
            assert action.default == _field_default(action.dest), (command, action.dest)
    migration = [a for a in _subparser("plan")._actions if a.dest in ("migration", "replica_pricing")]
    assert [a.default for a in migration] == ["price", "price"]
    assert PlanOptions().migration and PlanOptions().price_replicas


def test_simulate_optimizer_bytes_help_is_the_timing_default():
    from relibra_moe.timing import DEFAULT_OPTIMIZER_BYTES_PER_PARAM

    shown = _help_defaults(_subparser("simulate"))
    assert shown["optimizer_bytes"] == format(DEFAULT_OPTIMIZER_BYTES_PER_PARAM, "g") == "12"
    assert _field_default("optimizer_bytes_per_param") == DEFAULT_OPTIMIZER_BYTES_PER_PARAM


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
    (["--replica-slots", "2"], "replica_slots", 2),
    (["--workers", "2"], "workers", 2),
    (["--seed", "9"], "seed", 9),
    (["--sample-placement", "length-balanced"], "sample_placement", "length-balanced"),
    (["--sample-placement", "longest-first"], "sample_placement", "longest-first"),
    (["--no-resident-replicas"], "resident_replicas", False),
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
    _run(_plan_args(trace_file, out, "relibra-inter", "--migration", "free"), capsys)
    plan = BatchPlan.load(out)
    assert plan.stats.migration.to_dict() == {"enabled": False}
    ref = plan_batch(_batch().with_micro_batch_size(4), MODEL, CLUSTER, "relibra-inter", iters=300,
                     locality_iters=300, migration=False)
    np.testing.assert_array_equal(plan.placement.expert_gpu, ref.placement.expert_gpu)
    np.testing.assert_array_equal(plan.samples.gpu, ref.samples.gpu)


@pytest.mark.timeout(300)
def test_replica_pricing_free_equals_plan_batch_unpriced(trace_file, tmp_path, capsys):
    out = tmp_path / "unpriced.npz"
    _run(_plan_args(trace_file, out, "relibra", "--replica-slots", "1", "--replica-pricing", "free"), capsys)
    plan = BatchPlan.load(out)
    assert plan.stats.options == {"iters": 300, "locality_iters": 300, "price_replicas": False}
    ref = plan_batch(_batch().with_micro_batch_size(4), MODEL, CLUSTER, "relibra", replica_slots=1, iters=300,
                     locality_iters=300, price_replicas=False)
    np.testing.assert_array_equal(plan.replicas.replica_expert, ref.replicas.replica_expert)
    np.testing.assert_array_equal(plan.replicas.split_index, ref.replicas.split_index)


@pytest.mark.timeout(300)
def test_previous_prices_moves_against_that_plan(trace_file, tmp_path, capsys):
    first, second = tmp_path / "first.npz", tmp_path / "second.npz"
    _run(_plan_args(trace_file, first, "relibra-inter"), capsys)
    _run(_plan_args(trace_file, second, "relibra-inter", "--seed", "1", "--previous", str(first)), capsys)
    a, b = BatchPlan.load(first), BatchPlan.load(second)
    assert b.stats.migration.enabled
    # the pricing counted moves against the first plan's homes, not against the static placement
    assert b.stats.migration.moved == int((a.placement.expert_gpu != b.placement.expert_gpu).sum())
    assert b.stats.options["previous"].startswith("sha1:")
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
    rc = main(_plan_args(trace_file, tmp_path / "out.npz", "relibra-inter", "--previous", str(prev)))
    err = capsys.readouterr().err
    assert rc == 1
    assert f"--previous {prev}: {match}" in err
    assert not (tmp_path / "out.npz").exists()


def test_previous_that_is_not_a_plan_file(trace_file, tmp_path, capsys):
    bad = tmp_path / "junk.npz"
    bad.write_bytes(b"not a zip")
    rc = main(_plan_args(trace_file, tmp_path / "out.npz", "relibra-inter", "--previous", str(bad)))
    assert rc == 1
    assert f"--previous {bad}: not a readable plan file" in capsys.readouterr().err


OWNER_FAST = ["--iters", "200", "--locality-iters", "100", "--num-seeds", "1", "--rounds", "1"]


@pytest.fixture(scope="module")
def owner_trace_file(tmp_path_factory):
    batch = two_hot_batch(5, (10, 30))
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


def test_plan_trainer_mode_keeps_the_ranks_and_matches_the_library(owner_trace_file, tmp_path, capsys):
    d, batch, ranks = owner_trace_file
    out = tmp_path / "p.npz"
    rc = main(["plan", str(d / "t.npz"), *MODEL2, "--strategy", "relibra", "--replica-slots", "1", *OWNER_FAST,
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
def test_plan_bad_flags_are_named(owner_trace_file, tmp_path, capsys, flags, match):
    d, _, ranks = owner_trace_file
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


def test_compare_both_modes_on_one_table(owner_trace_file, tmp_path, capsys):
    d, batch, ranks = owner_trace_file
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


def test_compare_rejects_a_bad_owner(owner_trace_file, capsys):
    d, _, _ = owner_trace_file
    with pytest.raises(SystemExit):
        main(["compare", str(d / "t.npz"), *MODEL2, "--sample-owner", "nobody"])
    assert "invalid choice: 'nobody'" in capsys.readouterr().err


def test_demo_runs_both_modes_side_by_side():
    from relibra_moe.commands.demo import Scenario, run_scenario, strategy_runs
    from relibra_moe.planners.strategies import plan_batch as pb

    sc = Scenario(name="qwen3-30b-a3b/mixed", model="qwen3-30b-a3b", nodes=2, gpus_per_node=2, data="synthetic",
                  domain="mixed", num_samples=16, micro_batch_size=8, layers=2, replica_slots=1, repack=True)
    runs = strategy_runs(sc, ["static", "relibra"], "both")
    assert [(lab, own, place) for lab, _, _, own, place in runs] == [
        ("static", "planner", None), ("relibra", "planner", None),
        ("static, length-balanced (verl)", "planner", "length-balanced"),
        ("static+repack", "planner", None), ("relibra+repack", "planner", None),
        ("static (trainer)", "trainer", None), ("relibra (trainer)", "trainer", None)]
    assert all(not rep for _, _, rep, own, _ in runs if own == "trainer")
    assert [lab for lab, *_ in strategy_runs(sc, ["static", "relibra"], "trainer")] == ["static", "relibra"]
    res = run_scenario(sc, 0, 1, pb, ["static", "relibra"], sample_owner="both")
    st = res["strategies"]
    assert st["relibra (trainer)"]["sample_owner"] == "trainer" and st["relibra"]["sample_owner"] == "planner"
    assert st["static (trainer)"]["step_s"] == pytest.approx(st["static"]["step_s"], rel=1e-12)


def test_cli_overlap_and_bound(trace_file, tmp_path, capsys):
    """--overlap reaches the plan's cluster (the simulated step is the library's under that overlap, the plan
    records it) and score re-simulates under the flag it is given; --bound reports percent_of_bound <= 100."""
    out = tmp_path / "ov.npz"
    res = _run(_plan_args(trace_file, out, "relibra", "--replica-slots", "1", "--overlap", "megatron", "--bound"),
               capsys)
    assert res["cluster"]["overlap"] == "megatron" and res["overlap_hidden_s"] > 0
    assert 0 < res["percent_of_bound"] <= 100.0 and res["bound_t_moe_s"] <= res["t_moe_s"]
    plan = BatchPlan.load(out)
    assert plan.stats.overlap == "megatron"
    batch = TraceBatch.load(trace_file).with_micro_batch_size(4)
    cluster = CLUSTER.with_(overlap="megatron")
    assert res["step_s"] == pytest.approx(simulate_step(plan, batch, MODEL, cluster).step_s, rel=1e-12)
    scored = _run(["score", str(trace_file), str(out), "--model", "gpt-oss-20b", "--json"], capsys)
    assert scored["cluster"]["overlap"] == "none" and scored["step_s"] > res["step_s"]


@pytest.mark.timeout(300)
def test_move_horizon_judges_the_new_homes_on_the_previous_trace(trace_file, tmp_path, capsys):
    first, second, prev_trace = tmp_path / "first.npz", tmp_path / "second.npz", tmp_path / "prev.npz"
    _batch(seed=5).save(prev_trace)
    _run(["plan", str(prev_trace), "--model", "gpt-oss-20b", "--nodes", "2", "--gpus-per-node", "4", "--strategy",
          "relibra-inter", "--micro-batch-size", "4", "--out", str(first), "--json", *FAST], capsys)
    _run(_plan_args(trace_file, second, "relibra-inter", "--previous", str(first), "--move-horizon", "4",
                    "--previous-trace", str(prev_trace)), capsys)
    a, b = BatchPlan.load(first), BatchPlan.load(second)
    assert b.stats.options["move_horizon"] == 4 and b.stats.options["previous_loads"].startswith("sha1:")
    from relibra_moe.evaluate import plan_loads

    ref = plan_batch(_batch().with_micro_batch_size(4), MODEL, CLUSTER, "relibra-inter", iters=300,
                     locality_iters=300, previous=a.placement, move_horizon=4,
                     previous_loads=plan_loads(a, _batch(seed=5).with_micro_batch_size(4), CLUSTER.num_gpus))
    np.testing.assert_array_equal(b.placement.expert_gpu, ref.placement.expert_gpu)
    assert b.stats.options == ref.stats.options


@pytest.mark.parametrize("extra, match", [
    (["--move-horizon", "4", "--previous", "{first}"], "--move-horizon=4 with --previous {first} needs "
                                                       "--previous-trace"),
    (["--previous-trace", "{trace}"], "--previous-trace {trace} only applies with --move-horizon > 1 and "
                                      "--previous PLAN.npz"),
    (["--move-horizon", "2", "--previous-trace", "{trace}"], "--previous-trace {trace} only applies with"),
    (["--move-horizon", "2", "--previous", "{first}", "--previous-trace", "{trace}"],
     "--previous-trace {trace} against --previous {first}: plan was made for another batch"),
    (["--move-horizon", "0"], "move_horizon=0 must be an int >= 1"),
])
def test_move_horizon_flags_that_do_not_fit_name_the_flag(trace_file, tmp_path, capsys, extra, match):
    first = tmp_path / "first.npz"
    other = tmp_path / "other.npz"
    _batch(seed=5).save(other)
    _run(["plan", str(other), "--model", "gpt-oss-20b", "--nodes", "2", "--gpus-per-node", "4", "--strategy",
          "static", "--micro-batch-size", "4", "--out", str(first), "--json"], capsys)
    subs = {"first": str(first), "trace": str(trace_file)}
    rc = main(_plan_args(trace_file, tmp_path / "out.npz", "relibra-inter", *[e.format(**subs) for e in extra]))
    assert rc == 1
    assert match.format(**subs) in capsys.readouterr().err
    assert not (tmp_path / "out.npz").exists()
