"""Steady state: batch sequences, the previous-plan chain (a plan's previous placement is what the simulator
charges moves against, for every strategy), eplb-history's schedule inside the chain, the summary."""

from __future__ import annotations

import numpy as np
import pytest

from relibra_moe.errors import PlanError, TraceError
from relibra_moe.evaluate import score_plan
from relibra_moe.planners.options import PlanOptions
from relibra_moe.planners.strategies import plan_batch
from relibra_moe.sim import StepResult, simulate_step
from relibra_moe.specs import cluster_preset, model_preset
from relibra_moe.steady import (
    consecutive_batches,
    domain_mix,
    drifting_batches,
    plan_steady,
    run_steady,
    summarize,
)
from relibra_moe.trace import TraceBatch


def _counts_batch(seed: int, model, n: int = 16, mbs: int = 4, hot=(0,), tokens=(100, 300)) -> TraceBatch:
    """n samples of ``tokens`` tokens, each token's k distinct experts drawn with the ``hot`` ones 12x likelier
    (Gumbel top-k)."""
    rng = np.random.default_rng(seed)
    L, E, k = model.num_layers, model.num_experts, model.top_k
    logp = np.zeros(E)
    logp[list(hot)] = np.log(12.0)
    counts = np.zeros((n, L, E), np.int64)
    for i in range(n):
        s = int(rng.integers(*tokens))
        g = logp + rng.gumbel(size=(s, L, E))
        top = np.argpartition(-g, k - 1, axis=2)[:, :, :k]
        for l in range(L):
            counts[i, l] = np.bincount(top[:, l].ravel(), minlength=E)
    return TraceBatch.from_counts(counts, k, micro_batch=np.arange(n) // mbs)


@pytest.fixture(scope="module")
def chain():
    model = model_preset("gpt-oss-20b").with_(num_layers=2)
    cluster = cluster_preset("hopper-rail", nodes=2, gpus_per_node=2)
    # long samples with hot experts that change from batch to batch: relibra's moves pay for themselves
    batches = [_counts_batch(10 + k, model, n=32, hot=(3 * k, 3 * k + 1, 3 * k + 2, 3 * k + 8, 3 * k + 9),
                             tokens=(3000, 6000)) for k in range(3)]
    return model, cluster, batches


def test_consecutive_batches_cover_the_trace_in_order():
    model = model_preset("gpt-oss-20b").with_(num_layers=1)
    batch = _counts_batch(0, model, n=22, mbs=4)  # 6 micro-batches, the last of 2 samples
    parts = consecutive_batches(batch, 4)
    assert [p.num_sequences for p in parts] == [8, 8, 4, 2]  # micro-batches split 2, 2, 1, 1
    np.testing.assert_array_equal(np.concatenate([p.sample_expert_counts() for p in parts]),
                                  batch.sample_expert_counts())
    for p in parts:
        mb = p.resolve_micro_batch()
        assert mb.min() == 0 and np.all(np.diff(mb) >= 0) and set(mb) == set(range(mb.max() + 1))
    assert consecutive_batches(batch, 1) == [batch]
    with pytest.raises(TraceError, match="num_batches=7 exceeds the 6 micro-batches"):
        consecutive_batches(batch, 7)
    with pytest.raises(TraceError, match="num_batches=0"):
        consecutive_batches(batch, 0)
    with pytest.raises(TraceError, match="no micro-batch assignment"):
        consecutive_batches(TraceBatch.from_counts(batch.sample_expert_counts(), batch.top_k), 2)


def test_domain_mix_and_drifting_batches():
    for k in range(6):
        p = domain_mix(k, 0.25)
        assert p.sum() == pytest.approx(1.0) and (p >= 0).all()
    np.testing.assert_allclose(domain_mix(0, 0.25), [2 / 3, 1 / 6, 1 / 6])
    np.testing.assert_allclose(domain_mix(3, 0.0), domain_mix(0, 0.0))
    assert np.argmax(domain_mix(0, 1 / 3)) == 0 and np.argmax(domain_mix(1, 1 / 3)) == 1
    model = model_preset("qwen3-30b-a3b").with_(num_layers=2)
    bs = drifting_batches(model, 3, 16, micro_batch_size=8, seed=1)
    again = drifting_batches(model, 3, 16, micro_batch_size=8, seed=1)
    assert len(bs) == 3
    for b, c in zip(bs, again):
        assert b.num_sequences == 64 and b.num_layers == 2 and b.num_experts == 128
        np.testing.assert_array_equal(b.sample_expert_counts(), c.sample_expert_counts())
        mb = b.resolve_micro_batch()
        dom = np.asarray(b.sample_info["domain"])
        for m in range(8):
            assert len(set(dom[mb == m])) == 1, "one domain per micro-batch"
        assert "synthetic" in b.source
    assert not np.array_equal(bs[0].sample_expert_counts(), bs[1].sample_expert_counts())
    with pytest.raises(TraceError, match="micro_batch_size=6"):
        drifting_batches(model, 2, 16, micro_batch_size=6)


@pytest.mark.parametrize("strategy", ["relibra", "eplb", "static", "eplb-history", "online"])
def test_previous_plan_chain_is_what_the_simulator_charges(chain, strategy):
    model, cluster, batches = chain
    plans, rows = plan_steady(batches, model, cluster, strategy, replica_slots=1)
    assert len(plans) == len(rows) == 3
    static = plan_batch(batches[0], model, cluster, "static").placement
    for k, (plan, row) in enumerate(zip(plans, rows)):
        prev = static if k == 0 else plans[k - 1].placement
        moved = int((plan.placement.expert_gpu != prev.expert_gpu).sum())  # independent count
        assert row["experts_moved"] == moved
        ref = simulate_step(plan, batches[k], model, cluster, previous=prev)
        assert row["step_s"] == pytest.approx(ref.step_s) and row["t_moe_s"] == pytest.approx(ref.t_moe.sum())
        # one evaluation: the steady state's moves-free sum of T_MoE is score_plan's (relibra score)
        assert row["t_moe_s"] == pytest.approx(score_plan(plan, batches[k], model, cluster).t_moe_s,
                                               rel=1e-12)
        if moved:
            # charged against the previous plan, not the static placement
            other = simulate_step(plan, batches[k], model, cluster, previous=None if k else prev)
            from_static = int((plan.placement.expert_gpu != static.expert_gpu).sum())
            assert other.experts_moved == from_static
        if strategy == "relibra":
            # the portfolio's figure of the chosen candidate is the simulator's step against the same previous
            pf = plan.stats.portfolio
            assert pf.step_s[pf.chosen] == pytest.approx(row["step_s"], rel=1e-12)
            assert row["step_s"] == pytest.approx(min(pf.step_s.values()), rel=1e-12)
        if strategy == "relibra" and k > 0 and plan.stats.portfolio.chosen == "relibra":
            # the planner priced its moves against the same placement the simulator charges
            assert plan.stats.migration.moved == moved
        if strategy == "relibra" and k > 0:
            # stats record the previous placement by its fingerprint (PlanOptions.strategy_options)
            assert plan.stats.options["previous"] == PlanOptions(previous=prev).strategy_options()["previous"]
    if strategy in ("static", "online"):
        assert all(r["experts_moved"] == 0 and r["reorder_s"] == 0.0 for r in rows)
    if strategy == "eplb":
        assert any(r["experts_moved"] > 0 for r in rows[1:]), "the chain should exercise a move after batch 0"


def test_relibra_chain_prices_against_the_last_plan(chain):
    """Re-planning batch 1 by hand with previous = the chain's plan 0 gives the chain's plan 1."""
    model, cluster, batches = chain
    plans, _ = plan_steady(batches[:2], model, cluster, "relibra", replica_slots=1)
    again = plan_batch(batches[1], model, cluster, "relibra", replica_slots=1, previous=plans[0].placement)
    np.testing.assert_array_equal(again.placement.expert_gpu, plans[1].placement.expert_gpu)
    # the migration pass prices relibra's own homes against static (the portfolio may then choose other homes)
    fresh = plan_batch(batches[1], model, cluster, "relibra", replica_slots=1, portfolio=False)
    assert fresh.stats.migration.moved == int((fresh.placement.expert_gpu != np.asarray(
        plan_batch(batches[1], model, cluster, "static").placement.expert_gpu)).sum())


def test_eplb_history_in_the_chain(chain):
    model, cluster, batches = chain
    plans, rows = plan_steady(batches, model, cluster, "eplb-history", replica_slots=1)
    assert plans[0].stats.eplb_history.layout.startswith("trivial") and rows[0]["experts_moved"] == 0
    h0 = batches[0].sample_expert_counts().sum(axis=0)
    ref = plan_batch(batches[1], model, cluster, "eplb-history", replica_slots=1, history=h0,
                     previous=plans[0].placement)
    np.testing.assert_array_equal(plans[1].placement.expert_gpu, ref.placement.expert_gpu)
    np.testing.assert_array_equal(plans[1].replicas.replica_expert, ref.replicas.replica_expert)
    # every 2 batches: batch 1 keeps the trivial layout, batch 2 re-balances on batches 0..1 (window 2)
    plans2, rows2 = plan_steady(batches, model, cluster, "eplb-history", replica_slots=1, rebalance_every=2,
                                window=2)
    assert rows2[1]["experts_moved"] == 0
    h01 = np.stack([h0, batches[1].sample_expert_counts().sum(axis=0)])
    ref2 = plan_batch(batches[2], model, cluster, "eplb-history", replica_slots=1, history=h01,
                      previous=plans2[1].placement)
    np.testing.assert_array_equal(plans2[2].placement.expert_gpu, ref2.placement.expert_gpu)


def test_summary_first_step_apart(chain):
    model, cluster, batches = chain
    res = run_steady(batches, model, cluster, ["static", "relibra"], replica_slots=1)
    for v in res["strategies"].values():
        rows = v["per_step"]
        assert v["first"]["step_s"] == rows[0]["step_s"]
        assert v["steady"]["step_s"] == pytest.approx((rows[1]["step_s"] + rows[2]["step_s"]) / 2)
        assert v["steady"]["tokens_per_s"] == pytest.approx(
            (rows[1]["tokens"] + rows[2]["tokens"]) / (rows[1]["step_s"] + rows[2]["step_s"]))
        assert v["steady"]["steps"] == 2
    st = res["strategies"]
    assert res["speedup"]["static"] == pytest.approx(st["relibra"]["steady"]["tokens_per_s"]
                                                     / st["static"]["steady"]["tokens_per_s"])
    assert res["speedup"]["relibra"] == 1.0
    one = summarize(st["static"]["per_step"][:1])
    assert one["steady"]["steps"] == 1 and one["steady"]["step_s"] == one["first"]["step_s"]


def test_evaluate_matches_the_simulator(chain):
    model, cluster, batches = chain
    plan = plan_batch(batches[0], model, cluster, "eplb", replica_slots=1)
    step = simulate_step(plan, batches[0], model, cluster)
    ev = StepResult.of(plan, step).to_dict()
    assert ev["t_moe_s"] == pytest.approx(float(step.t_moe.sum())) and ev["step_s"] == step.step_s
    assert ev["experts_moved"] == step.experts_moved and ev["solve_s"] == plan.stats.solve_seconds
    assert sum(ev["breakdown"].values()) == pytest.approx(ev["step_s"])


def test_bad_inputs(chain):
    model, cluster, batches = chain
    with pytest.raises(PlanError, match="unknown strategy 'nope'"):
        plan_steady(batches, model, cluster, "nope")
    with pytest.raises(PlanError, match="no batches"):
        plan_steady([], model, cluster, "static")


def test_table_seconds_keep_their_digits_on_a_tiny_model():
    """The compare table prints a tiny model's step (microseconds) with 4 significant digits, not 0.0000."""
    from relibra_moe.steady import _seconds

    assert _seconds(1.23456) == "1.2346" and _seconds(0.0) == "0.0000"
    assert _seconds(3.456789e-05) == "3.457e-05" and float(_seconds(2.5e-7)) == 2.5e-7
