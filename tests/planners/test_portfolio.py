"""planners/portfolio.py: the score under the options, the tie rule, the padding of replicas, and the judge the
portfolio is given (``PlanContext.evaluator``) deciding the choice."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np
import pytest

from relibra_moe.errors import PlanError
from relibra_moe.evaluate import plan_loads
from relibra_moe.plan import Placement, ReplicaPlan
from relibra_moe.planners import portfolio as portfolio_module
from relibra_moe.planners.evaluation import SIMULATED_STEP
from relibra_moe.planners.executor import default_executor
from relibra_moe.planners.locality_replicas import locality_replicas
from relibra_moe.planners.options import PlanOptions
from relibra_moe.planners.portfolio import least_moving_best, padded, portfolio_placements, portfolio_score
from relibra_moe.planners.strategies import make_context, plan_batch, plan_with_options
from relibra_moe.sim import simulate_step
from relibra_moe.specs import ClusterSpec, ModelSpec
from relibra_moe.synthetic import rl_batch

MODEL = ModelSpec("t", hidden=256, ffn=128, num_experts=8, top_k=2, num_layers=2)
CLUSTER = ClusterSpec(nodes=2, gpus_per_node=2)
FAST = dict(iters=100, locality_iters=50, num_seeds=1, rounds=1)


def _batch():
    return rl_batch(MODEL, "mixed", 3, responses_per_prompt=4, seed=5, micro_batch_size=6, max_len=64)


@pytest.mark.parametrize("kw, want", [
    ({}, 10.0),
    ({"migration": False}, 10.0 - 2.0),
    ({"price_replicas": False}, 10.0 - 0.5),
    ({"migration": False, "price_replicas": False}, 10.0 - 2.0 - 0.5),
    ({"step_objective": False}, 3.0),
])
def test_portfolio_score_drops_what_the_options_make_free(kw, want):
    step = SimpleNamespace(step_s=10.0, t_moe_s=3.0, reorder_s=2.0, replica_exposed_s=0.5)
    assert portfolio_score(step, PlanOptions(**kw)) == want


def test_least_moving_best_breaks_ties_by_experts_then_samples_then_order():
    ctx = make_context(_batch(), MODEL, CLUSTER, "relibra", PlanOptions(), default_executor(1))
    prev = np.repeat(np.arange(4), 2)[None].repeat(2, axis=0)
    moved = prev.copy()
    moved[0, :2] = moved[0, :2][::-1] + 1  # two experts off their homes
    mb, sg = ctx.micro_batch, ctx.sample_gpu
    sg2 = sg.copy()
    sg2[0] = (sg2[0] + 1) % 4  # one sample moved
    cands = {"a": (moved, mb, sg, None), "b": (prev, mb, sg2, None), "c": (prev, mb, sg, None),
             "d": (prev, mb, sg, None), "e": (moved, mb, sg, None)}
    assert least_moving_best(ctx, cands, {"a": 1.0, "b": 1.0, "c": 1.0, "d": 1.0, "e": 0.5}, prev) == "e"
    assert least_moving_best(ctx, cands, {"a": 1.0, "b": 1.0, "c": 1.0, "d": 1.0}, prev) == "c"
    assert least_moving_best(ctx, cands, {"a": 1.0, "b": 1.0, "d": 1.0 + 1e-12}, prev) == "d"  # within 1e-9
    assert least_moving_best(ctx, cands, {"a": 1.0, "b": 1.0}, prev) == "b"


def test_padded_appends_empty_slots_and_keeps_wider_ones():
    empty = padded(None, 2, 3, 4, 2)
    assert empty.replica_expert.shape == (2, 3, 4, 2) and (empty.replica_expert == -1).all()
    one = ReplicaPlan.empty(2, 3, 4, 1)
    one = dataclasses.replace(one, replica_expert=np.full((2, 3, 4, 1), 5, np.int32))
    got = padded(one, 2, 3, 4, 3)
    assert got.replica_expert.shape == (2, 3, 4, 3)
    assert (got.replica_expert[..., 0] == 5).all() and (got.replica_expert[..., 1:] == -1).all()
    assert padded(one, 2, 3, 4, 1) is one


def test_portfolio_placements_name_the_trainers_samples_alone():
    batch = _batch()
    ranks = np.arange(batch.num_sequences) % 4
    ctx = make_context(batch, MODEL, CLUSTER, "relibra", PlanOptions(sample_owner="trainer", sample_gpu=ranks),
                       default_executor(1))
    places = portfolio_placements(ctx)
    assert list(places) == [""] and np.array_equal(places[""][1], ranks)
    ctx = make_context(batch, MODEL, CLUSTER, "relibra", PlanOptions(), default_executor(1))
    assert list(portfolio_placements(ctx))[0] == ""


@dataclass(frozen=True)
class PenaliseReplicas:
    """A judge that finds every candidate with replicas 1 s slower than the simulator does."""

    def step(self, plan, lengths, x, model, cluster, previous, opb):
        st = SIMULATED_STEP.step(plan, lengths, x, model, cluster, previous, opb)
        replicated = bool((plan.replicas.replica_expert >= 0).any())
        return SimpleNamespace(step_s=st.step_s + (1.0 if replicated else 0.0), t_moe_s=st.t_moe_s,
                               reorder_s=st.reorder_s, replica_exposed_s=st.replica_exposed_s,
                               replica_mode=st.replica_mode)

    def relayout_seconds(self, previous, placement, model, cluster, opb):
        return SIMULATED_STEP.relayout_seconds(previous, placement, model, cluster, opb)


def test_the_injected_judge_decides_the_choice():
    batch = _batch()
    opts = PlanOptions(replica_slots=1, **FAST)
    default = plan_with_options(batch, MODEL, CLUSTER, "relibra", opts)
    judged = plan_with_options(batch, MODEL, CLUSTER, "relibra", opts, evaluator=PenaliseReplicas())
    assert (default.replicas.replica_expert >= 0).any()  # the simulator's choice has replicas
    port = judged.stats.portfolio
    assert port.chosen != default.stats.portfolio.chosen
    assert port.step_s[port.chosen] == min(port.step_s.values()) < 1.0
    assert not (judged.replicas.replica_expert >= 0).any()


@dataclass(frozen=True)
class FavourResident:
    """A judge that finds every resident plan (``ReplicaPlan.resident``: EPLB+'s, LPLB+'s, locality-resident) 0 s
    long (``by=None``) or ``by`` seconds faster than the simulator does; the rest as the simulator."""

    by: float | None = None

    def step(self, plan, lengths, x, model, cluster, previous, opb):
        st = SIMULATED_STEP.step(plan, lengths, x, model, cluster, previous, opb)
        step = st.step_s if not plan.replicas.resident else 0.0 if self.by is None else st.step_s - self.by
        return SimpleNamespace(step_s=step, t_moe_s=st.t_moe_s, reorder_s=st.reorder_s,
                               replica_exposed_s=st.replica_exposed_s, replica_mode=st.replica_mode)

    def relayout_seconds(self, previous, placement, model, cluster, opb):
        return SIMULATED_STEP.relayout_seconds(previous, placement, model, cluster, opb)


def test_locality_candidates_are_offered_on_two_nodes_and_not_on_one():
    batch = _batch()
    opts = PlanOptions(replica_slots=1, **FAST)
    port = plan_with_options(batch, MODEL, CLUSTER, "relibra", opts).stats.portfolio
    for name in ("locality-resident", "locality-per-micro-batch"):
        assert name in port.step_s or name in (port.pruned or {})
    one = plan_with_options(batch, MODEL, ClusterSpec(nodes=1, gpus_per_node=4), "relibra", opts).stats.portfolio
    assert not any(k.startswith("locality") for k in [*one.step_s, *(one.pruned or {})])


def test_resident_replicas_off_drops_every_resident_candidate():
    """A judge that makes resident plans free: allowed, the choice is resident (relibra's locality-resident or
    eplb-history's redundant experts); with ``resident_replicas=False`` no resident candidate is left to choose."""
    batch = _batch()
    history = batch.sample_expert_counts().sum(axis=0)
    opts = PlanOptions(replica_slots=1, history=history, **FAST)
    allowed = plan_with_options(batch, MODEL, CLUSTER, "relibra", opts, evaluator=FavourResident())
    assert allowed.replicas.resident and allowed.stats.portfolio.step_s[allowed.stats.portfolio.chosen] == 0.0
    off = plan_with_options(batch, MODEL, CLUSTER, "relibra", opts.replace(resident_replicas=False),
                            evaluator=FavourResident())
    port = off.stats.portfolio
    assert not off.replicas.resident and min(port.step_s.values()) > 0.0
    assert "locality-resident" not in port.step_s and "locality-per-micro-batch" in port.step_s


def test_locality_candidates_are_pruned_when_their_bound_reaches_the_best_score():
    """A judge that finds every plan 0 s long: no candidate can beat 0, so both are pruned with their (positive)
    bound."""

    @dataclass(frozen=True)
    class Free:
        def step(self, plan, lengths, x, model, cluster, previous, opb):
            return SimpleNamespace(step_s=0.0, t_moe_s=0.0, reorder_s=0.0, replica_exposed_s=0.0,
                                   replica_mode="per-layer")

        def relayout_seconds(self, previous, placement, model, cluster, opb):
            return 0.0

    batch = _batch()
    port = plan_with_options(batch, MODEL, CLUSTER, "relibra", PlanOptions(replica_slots=2, **FAST),
                             evaluator=Free()).stats.portfolio
    assert port.pruned["locality-resident"] == port.pruned["locality-per-micro-batch"] > 0.0
    assert not any(k.startswith("locality") for k in port.step_s)


@dataclass(frozen=True)
class FavourResidentOn:
    """A judge that finds every resident plan on the homes ``homes`` whose samples' GPUs are not ``not_gpu`` 0 s
    long; the rest as the simulator."""

    homes: np.ndarray
    not_gpu: np.ndarray

    def step(self, plan, lengths, x, model, cluster, previous, opb):
        st = SIMULATED_STEP.step(plan, lengths, x, model, cluster, previous, opb)
        free = (plan.replicas.resident and np.array_equal(plan.placement.expert_gpu, self.homes)
                and not np.array_equal(plan.samples.gpu, self.not_gpu))
        return SimpleNamespace(step_s=0.0 if free else st.step_s, t_moe_s=st.t_moe_s, reorder_s=st.reorder_s,
                               replica_exposed_s=st.replica_exposed_s, replica_mode=st.replica_mode)

    def relayout_seconds(self, previous, placement, model, cluster, opb):
        return SIMULATED_STEP.relayout_seconds(previous, placement, model, cluster, opb)


def test_resident_locality_candidates_on_every_placement_are_the_library_plans():
    """On two nodes the portfolio offers resident locality replicas on the previous homes and on relibra's homes
    with each placement's samples (each built or pruned by its bound). A judge that favours resident plans on
    the previous homes on other samples than relibra's own makes relibra return one of them (no expert moved,
    the placement's samples), and its replicas are exactly ``locality_replicas`` (resident) of that placement's
    loads on those homes."""
    batch = _batch()
    prev = Placement.static(MODEL.num_layers, MODEL.num_experts, CLUSTER.num_gpus).expert_gpu
    opts = PlanOptions(replica_slots=2, **FAST)
    own_plan = plan_with_options(batch, MODEL, CLUSTER, "relibra", opts.replace(portfolio=False))
    own = own_plan.samples.gpu
    plan = plan_with_options(batch, MODEL, CLUSTER, "relibra", opts, evaluator=FavourResidentOn(prev, own))
    port = plan.stats.portfolio
    offered = {*port.step_s, *(port.pruned or {})}
    ctx = make_context(batch, MODEL, CLUSTER, "relibra", opts, default_executor(1))
    places = portfolio_placements(ctx)
    for i, (suffix, (mb, sg)) in enumerate(places.items()):
        same = [np.array_equal(mb, m) and np.array_equal(sg, g) for m, g in list(places.values())[:i]]
        dup = any(same) or (np.array_equal(prev, own_plan.placement.expert_gpu)
                            and np.array_equal(mb, own_plan.samples.micro_batch) and np.array_equal(sg, own))
        assert ("previous-locality" + (suffix or "@round-robin") in offered) != dup  # one per distinct plan
    assert port.chosen.startswith("previous-locality") and port.step_s[port.chosen] == 0.0
    np.testing.assert_array_equal(plan.placement.expert_gpu, prev)
    mb, sg = places[port.chosen.removeprefix("previous-locality").replace("@round-robin", "")]
    np.testing.assert_array_equal(plan.samples.micro_batch, mb)
    np.testing.assert_array_equal(plan.samples.gpu, sg)
    want = locality_replicas(plan_loads(plan, batch, CLUSTER.num_gpus), prev, MODEL, CLUSTER, 2, True)
    assert plan.replicas.resident and plan.replicas.scope == "global"
    np.testing.assert_array_equal(plan.replicas.replica_expert, want.replica_expert)
    np.testing.assert_array_equal(plan.replicas.split_index, want.split_index)
    np.testing.assert_array_equal(plan.replicas.split_share, want.split_share)
    off = plan_with_options(batch, MODEL, CLUSTER, "relibra", opts.replace(resident_replicas=False),
                            evaluator=FavourResidentOn(prev, own)).stats.portfolio
    assert not any("locality-" in k and "per-micro-batch" not in k for k in [*off.step_s, *(off.pruned or {})])


def test_trainer_owned_samples_get_one_previous_locality_candidate_on_the_trainers_ranks():
    """When the trainer owns the samples the resident locality candidates keep its ranks: ``previous-locality``
    (no suffix) on the previous homes; relibra's homes on the same samples are ``locality-resident`` itself. A
    judge favouring resident plans on the previous homes returns it, on the trainer's ranks."""
    batch = _batch()
    ranks = (np.arange(batch.num_sequences) * 3) % 4
    prev = Placement.static(MODEL.num_layers, MODEL.num_experts, CLUSTER.num_gpus).expert_gpu
    opts = PlanOptions(replica_slots=2, sample_owner="trainer", sample_gpu=ranks, **FAST)
    plan = plan_with_options(batch, MODEL, CLUSTER, "relibra", opts,
                             evaluator=FavourResidentOn(prev, np.full(batch.num_sequences, -1)))
    port = plan.stats.portfolio
    offered = {*port.step_s, *(port.pruned or {})}
    assert {k for k in offered if "locality" in k} <= {"previous-locality", "locality-resident",
                                                       "locality-per-micro-batch"}
    assert port.step_s[port.chosen] == 0.0 and plan.replicas.resident
    np.testing.assert_array_equal(plan.placement.expert_gpu, prev)
    np.testing.assert_array_equal(plan.samples.gpu, ranks)


@pytest.mark.parametrize("r", [1, 2])
def test_eplb_and_lplb_candidates_are_the_strategies_plans(r):
    """When the judge favours them, relibra returns EPLB+'s (the first built of the resident candidates) plan on
    that placement, the very plan of ``plan_batch(strategy="eplb")`` there; every eplb / lplb candidate judged
    scores what the strategy's own plan scores under the simulator. Moves free: with them charged the tiny
    model's re-layout prunes every EPLB+ / LPLB+ candidate."""
    batch = _batch()
    opts = PlanOptions(replica_slots=r, migration=False, **FAST)
    plan = plan_with_options(batch, MODEL, CLUSTER, "relibra", opts, evaluator=FavourResident(by=1.0))
    port = plan.stats.portfolio
    name, _, where = port.chosen.partition("@")
    assert name == "eplb"
    ref = plan_with_options(batch, MODEL, CLUSTER, "eplb", PlanOptions(replica_slots=r, sample_placement=where or
                                                                        "round-robin"))
    np.testing.assert_array_equal(plan.placement.expert_gpu, ref.placement.expert_gpu)
    np.testing.assert_array_equal(plan.samples.micro_batch, ref.samples.micro_batch)
    np.testing.assert_array_equal(plan.samples.gpu, ref.samples.gpu)
    np.testing.assert_array_equal(plan.replicas.replica_expert, ref.replicas.replica_expert)
    np.testing.assert_array_equal(plan.replicas.split_index, ref.replicas.split_index)
    assert plan.replicas.scope == ref.replicas.scope == "global"
    default = plan_with_options(batch, MODEL, CLUSTER, "relibra", opts).stats.portfolio
    judged = [k for k in default.step_s if k.split("@")[0] in ("eplb", "lplb")]
    assert judged
    for k in judged:
        base, _, where = k.partition("@")
        other = plan_with_options(batch, MODEL, CLUSTER, base, PlanOptions(replica_slots=r, sample_placement=where or
                                                                            "round-robin"))
        step = SIMULATED_STEP.step(other, batch.lengths, batch.loads(other.samples.gpu, 4, other.samples.micro_batch),
                                   MODEL, CLUSTER, Placement.static(2, 8, 4), 12.0)
        assert default.step_s[k] == pytest.approx(portfolio_score(step, opts), rel=1e-12), k
    names = {b + p for b in ("eplb", "lplb") for p in ("", "@length-balanced", "@longest-first")}
    assert names <= set(default.step_s) | set(default.pruned or {})


def test_the_balancers_option_and_r_0():
    """``portfolio_balancers=False`` leaves EPLB+ and LPLB+ out (and is recorded in the plan's options); with r = 0
    LPLB+ (then EPLB+'s plan) is left out, EPLB+ kept."""
    batch = _batch()
    names = lambda pf: {k.split("@")[0] for k in set(pf.step_s) | set(pf.pruned or {})}  # noqa: E731
    off = plan_with_options(batch, MODEL, CLUSTER, "relibra", PlanOptions(replica_slots=1, portfolio_balancers=False,
                                                                        **FAST))
    assert not names(off.stats.portfolio) & {"eplb", "lplb"}
    assert off.stats.options["portfolio_balancers"] is False
    zero = plan_with_options(batch, MODEL, CLUSTER, "relibra", PlanOptions(**FAST))
    assert "eplb" in names(zero.stats.portfolio) and "lplb" not in names(zero.stats.portfolio)


# ------------------------------------------------------------------ option move_horizon (the credit)
# a one-node cell where relibra without a horizon keeps the static homes, and with one moves 10 experts
HMODEL = ModelSpec("t", hidden=2048, ffn=768, num_experts=16, top_k=2, num_layers=2)
HCLUSTER = ClusterSpec(nodes=1, gpus_per_node=4)
HFAST = {"iters": 300, "locality_iters": 200, "optimizer_bytes_per_param": 30.0}


@pytest.fixture(scope="module")
def horizon_cell():
    """Two consecutive synthetic batches and relibra's plan of the first (no horizon: it keeps the static homes)."""
    b0 = rl_batch(HMODEL, "code", 4, responses_per_prompt=4, seed=1, micro_batch_size=8, max_len=1024)
    b1 = rl_batch(HMODEL, "code", 4, responses_per_prompt=4, seed=2, micro_batch_size=8, max_len=1024)
    p0 = plan_batch(b0, HMODEL, HCLUSTER, "relibra", replica_slots=0, **HFAST)
    assert int((p0.placement.expert_gpu != _static()).sum()) == 0
    return b0, b1, p0


def _static():
    return np.repeat(np.arange(HCLUSTER.num_gpus), HMODEL.num_experts // HCLUSTER.num_gpus)[None].repeat(
        HMODEL.num_layers, axis=0)


def test_relibra_with_a_horizon_moves_where_it_pays_and_says_what_it_credited(horizon_cell):
    b0, b1, p0 = horizon_cell
    kw = dict(replica_slots=0, previous=p0.placement, **HFAST)
    stay = plan_batch(b1, HMODEL, HCLUSTER, "relibra", **kw)
    prev_loads = plan_loads(p0, b0, HCLUSTER.num_gpus)
    move = plan_batch(b1, HMODEL, HCLUSTER, "relibra", move_horizon=4, previous_loads=prev_loads, **kw)
    assert int((stay.placement.expert_gpu != p0.placement.expert_gpu).sum()) == 0
    assert int((move.placement.expert_gpu != p0.placement.expert_gpu).sum()) > 0
    pf = move.stats.portfolio
    assert pf.chosen == "relibra-horizon" and pf.credit_s[pf.chosen] > 0
    assert move.stats.options["move_horizon"] == 4
    # the simulator charges the whole move to this step; it may exceed staying by at most the credit, and the
    # homes are faster than staying on every batch that does not move them again
    first = simulate_step(move, b1, HMODEL, HCLUSTER, previous=p0.placement)
    base = simulate_step(stay, b1, HMODEL, HCLUSTER, previous=p0.placement).step_s
    assert first.reorder_s > 0 and first.step_s <= base + pf.credit_s[pf.chosen] + 1e-12
    assert first.step_s - first.reorder_s < base
    # no earlier batch, or one on which the new homes save nothing: the plan without a horizon
    for loads in (None, np.zeros_like(prev_loads)):
        same = plan_batch(b1, HMODEL, HCLUSTER, "relibra", move_horizon=4, previous_loads=loads, **kw)
        np.testing.assert_array_equal(same.placement.expert_gpu, stay.placement.expert_gpu)
        np.testing.assert_array_equal(same.samples.gpu, stay.samples.gpu)
        assert same.stats.portfolio.credit_s is None


def test_the_credited_pruning_bound_is_below_every_credited_score(horizon_cell, monkeypatch):
    """With pruning off, every candidate that would have been bounded is built: its credited bound
    (``_Candidates.credited_bound``, what ``_add_unless_pruned`` compares) must not exceed its final score."""
    b0, b1, p0 = horizon_cell
    seen: dict[str, float] = {}
    lowered: list[str] = []
    real = portfolio_module._add_unless_pruned

    def record(pf, name, bound, make, homes):
        if bound is not None:
            seen[name] = pf.credited_bound(bound, homes)
            if -np.inf < seen[name] < bound:
                lowered.append(name)
        real(pf, name, None, make, homes)

    monkeypatch.setattr(portfolio_module, "_add_unless_pruned", record)
    for cl in (HCLUSTER, ClusterSpec(nodes=2, gpus_per_node=2)):
        seen.clear()
        plan = plan_batch(b1, HMODEL, cl, "relibra", replica_slots=1, previous=p0.placement.expert_gpu,
                          move_horizon=8, previous_loads=plan_loads(p0, b0, cl.num_gpus), **HFAST)
        steps = plan.stats.portfolio.step_s
        assert seen and set(seen) <= set(steps)
        for name, bound in seen.items():
            assert bound <= steps[name] + 1e-12, (cl.nodes, name)
    assert lowered  # some bound was lowered by a credit, not only left at -inf or as it was


def test_the_steady_runner_and_the_planner_pass_the_last_batch(horizon_cell):
    from relibra_moe.planners.service import Planner
    from relibra_moe.steady import plan_steady, run_steady

    b0, b1, _ = horizon_cell
    b2 = rl_batch(HMODEL, "code", 4, responses_per_prompt=4, seed=3, micro_batch_size=8, max_len=1024)
    plans, rows = plan_steady([b0, b1, b2, b0, b1, b2], HMODEL, HCLUSTER, "relibra", replica_slots=0, move_horizon=4,
                              **HFAST)
    kw = dict(replica_slots=0, previous=plans[0].placement, move_horizon=4,
              previous_loads=plan_loads(plans[0], b0, HCLUSTER.num_gpus), **HFAST)
    # the steady runner also hands relibra the last batch's expert loads (its eplb-history candidates)
    direct = plan_batch(b1, HMODEL, HCLUSTER, "relibra", history=b0.sample_expert_counts().sum(axis=0)[None], **kw)
    assert plans[1].stats.options == direct.stats.options
    np.testing.assert_array_equal(plans[1].placement.expert_gpu, direct.placement.expert_gpu)
    assert plans[1].stats.portfolio.credit_s == direct.stats.portfolio.credit_s
    assert rows[1]["experts_moved"] > 0 and plans[1].stats.move_credited
    # the credited homes serve the 3 batches they were credited for: no previous_loads, so no credit, until then
    assert ["previous_loads" in p.stats.options for p in plans] == [False, True, False, False, False, True]
    with Planner(HMODEL, HCLUSTER, replica_slots=0, workers=1, executor="inline", move_horizon=4, **HFAST) as p:
        first = p.plan(b0)
        second = p.plan(b1)
        assert second.stats.move_credited
        later = [p.plan(b) for b in (b2, b0)]
    assert [a.stats.portfolio.credit_s for a in later] == [None, None]  # no evidence passed: no credit
    np.testing.assert_array_equal(first.placement.expert_gpu, plans[0].placement.expert_gpu)
    alone = plan_batch(b1, HMODEL, HCLUSTER, "relibra", **kw)
    np.testing.assert_array_equal(second.placement.expert_gpu, alone.placement.expert_gpu)
    assert second.stats.portfolio.credit_s == alone.stats.portfolio.credit_s
    assert alone.stats.portfolio.chosen == "relibra-horizon"
    res = run_steady([b0, b1], HMODEL, HCLUSTER, ("static", "relibra"), replica_slots=0, move_horizon=4)
    assert res["move_horizon"] == 4
    with pytest.raises(PlanError, match="move_horizon=0 must be an int >= 1"):
        run_steady([b0], HMODEL, HCLUSTER, ("relibra",), move_horizon=0)
