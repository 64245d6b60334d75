"""planners/colocation.py: the co-located homes and cells, against float64 references, a planted instance and the
portfolio that offers them."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np
import pytest

from relibra_moe.errors import PlanError
from relibra_moe.evaluate import plan_flow, plan_loads
from relibra_moe.planners import colocation as col
from relibra_moe.planners.evaluation import SIMULATED_STEP
from relibra_moe.planners.locality_replicas import locality_replicas, node_copies
from relibra_moe.planners.options import PlanOptions
from relibra_moe.planners.strategies import plan_with_options
from relibra_moe.specs import ClusterSpec, ModelSpec
from relibra_moe.synthetic import rl_batch

MODEL = ModelSpec("t", hidden=256, ffn=128, num_experts=8, top_k=2, num_layers=2)
CLUSTER = ClusterSpec(nodes=2, gpus_per_node=2)
FAST = dict(iters=100, locality_iters=50, num_seeds=1, rounds=1)


def _left_ref(xn: np.ndarray, hn: np.ndarray, n: int, k: int) -> float:
    """Node n's tokens for remote experts less the k largest: a plain loop."""
    remote = sorted((float(v) for v, h in zip(xn, hn) if h != n), reverse=True)
    return sum(remote[k:])


def _objective_ref(x: np.ndarray, where: np.ndarray, hn: np.ndarray, P: int, k: int) -> float:
    """``sum_{m, l} max_n left`` by loops: cells ``x [M, L, G, E]`` on GPUs ``where [M, G]``."""
    M, L, G, E = x.shape
    total = 0.0
    for m, layer in itertools.product(range(M), range(L)):
        nodes = G // P
        xn = np.zeros((nodes, E))
        for c in range(G):
            xn[where[m, c] // P] += x[m, layer, c]
        total += max(_left_ref(xn[n], hn[layer], n, k) for n in range(nodes))
    return total


def test_top_sums_match_a_sort():
    rng = np.random.default_rng(0)
    for _ in range(200):
        v = rng.integers(0, 5, size=int(rng.integers(1, 12))).astype(float)
        k = int(rng.integers(0, len(v) + 2))
        assert col._top_sum(v, k) == sum(sorted(v, reverse=True)[:k])
        s = -np.sort(-v)
        out_v, in_v = float(rng.choice(v)), float(rng.integers(0, 6))
        w = list(v)
        w.remove(out_v)
        assert col._top_after(s, k, out_v, in_v) == sum(sorted(w + [in_v], reverse=True)[:k])


def _random_cells(seed: int, M=3, L=2, G=4, E=8):
    rng = np.random.default_rng(seed)
    return rng.integers(0, 20, size=(M, L, G, E)).astype(float)


@pytest.mark.parametrize("seed", range(4))
def test_expert_swaps_keep_node_sizes_and_report_their_objective(seed):
    x = _random_cells(seed)
    P, k = 2, 2
    where = np.tile(np.arange(4), (3, 1))
    hn = np.tile(np.arange(8) // 4, (2, 1))
    before = _objective_ref(x, where, hn, P, k)
    xn = col._node_loads(x, where, P, 2)
    got = sum(col._homes_node_sweeps(np.ascontiguousarray(xn[:, layer]), hn[layer], k, 50) for layer in range(2))
    assert got == pytest.approx(_objective_ref(x, where, hn, P, k), abs=1e-9) and got <= before + 1e-9
    assert (np.bincount(hn.ravel(), minlength=2) == 8).all()  # 4 experts a node in each layer


@pytest.mark.parametrize("seed", range(4))
def test_cell_swaps_are_a_permutation_that_never_costs(seed):
    x = _random_cells(seed + 10)
    P, k = 2, 2
    hn = np.array([[0, 1, 0, 1, 0, 1, 0, 1], [1, 1, 0, 0, 1, 0, 1, 0]])
    where = np.tile(np.arange(4), (3, 1))
    before = _objective_ref(x, where, hn, P, k)
    counts = np.array([1, 2, 1, 2])  # cells 0 and 2 may swap, 1 and 3 may
    for m in range(3):
        col._cells_node_swaps(x[m], where[m], hn, counts, P, k, 4)
        assert sorted(where[m]) == [0, 1, 2, 3]
        assert np.array_equal(counts[np.argsort(where[m])], counts)  # equal counts on every GPU as before
    assert _objective_ref(x, where, hn, P, k) <= before + 1e-9


def test_colocate_finds_the_planted_split():
    """Two kinds of cells: kind A routes only to experts 0-3, kind B only to 4-7; every micro-batch has two of
    each, and the start interleaves both the kinds and the experts over the nodes. The co-located plan puts each
    kind with its experts: nothing crosses nodes, even without replica slots."""
    M, L, G, E = 4, 2, 4, 8
    rng = np.random.default_rng(3)
    x = np.zeros((M, L, G, E))
    for m in range(M):
        kinds = rng.permutation([0, 0, 1, 1])
        for g, kind in enumerate(kinds):
            x[m, :, g, 4 * kind:4 * kind + 4] = rng.integers(1, 9, size=(L, 4))
    start = np.tile(np.array([0, 2, 1, 3, 0, 2, 1, 3]), (L, 1))  # each node homes two of each kind's experts
    model = ModelSpec("t", hidden=256, ffn=128, num_experts=E, top_k=2, num_layers=L)
    homes, where = col.colocate(x, start, model, CLUSTER, 0)
    assert (np.sort(homes, axis=1) == np.repeat(np.arange(G), E // G)).all()
    for m in range(M):
        assert sorted(where[m]) == list(range(G))
        for g in range(G):
            used = np.flatnonzero(x[m, :, g].sum(axis=0))
            assert (homes[:, used] // 2 == where[m, g] // 2).all()  # the cell's experts live in its node
    assert _objective_ref(x, where, homes // 2, 2, 0) == 0.0
    same = col.colocate(x, start, model, CLUSTER, 0)
    assert np.array_equal(same[0], homes) and np.array_equal(same[1], where)  # deterministic
    h2, w2 = col.colocate(x, start, model, CLUSTER, 0, move_cells=False)
    assert np.array_equal(w2, np.tile(np.arange(G), (M, 1)))
    assert _objective_ref(x, w2, h2 // 2, 2, 0) < _objective_ref(x, w2, start // 2, 2, 0)  # the homes alone help
    h3, w3 = col.colocate(x, start, model, CLUSTER, 0, move_homes=False)
    assert np.array_equal(h3, start)
    assert _objective_ref(x, w3, start // 2, 2, 0) <= _objective_ref(x, w2, start // 2, 2, 0)


def _batch():
    return rl_batch(MODEL, "mixed", 3, responses_per_prompt=4, seed=5, micro_batch_size=6, max_len=64)


@dataclass(frozen=True)
class FavourColocated:
    """A judge that finds per-micro-batch global-scope plans on the homes ``homes`` 0 s long; the rest as the
    simulator."""

    homes: np.ndarray

    def step(self, plan, lengths, x, model, cluster, previous, opb):
        st = SIMULATED_STEP.step(plan, lengths, x, model, cluster, previous, opb)
        mine = (plan.replicas.scope == "global" and not plan.replicas.resident
                and np.array_equal(plan.placement.expert_gpu, self.homes))
        return SimpleNamespace(step_s=0.0 if mine else st.step_s, t_moe_s=st.t_moe_s, reorder_s=st.reorder_s,
                               replica_exposed_s=st.replica_exposed_s, replica_mode=st.replica_mode)

    def relayout_seconds(self, previous, placement, model, cluster, opb):
        return SIMULATED_STEP.relayout_seconds(previous, placement, model, cluster, opb)


@pytest.mark.parametrize("owner", ["planner", "trainer"])
def test_the_portfolio_offers_the_colocated_plan(owner):
    """The portfolio's ``colocated-per-micro-batch`` is ``colocate`` on relibra's own plan with the library's
    locality replicas on its loads; with trainer-owned samples every sample keeps its rank."""
    batch = _batch()
    kw = {}
    if owner == "trainer":
        kw = dict(sample_owner="trainer", sample_gpu=(np.arange(batch.num_sequences) * 3) % 4)
    opts = PlanOptions(replica_slots=2, **FAST, **kw)
    own = plan_with_options(batch, MODEL, CLUSTER, "relibra", opts.replace(portfolio=False))
    x = plan_loads(own, batch, CLUSTER.num_gpus)
    homes, where = col.colocate(x, own.placement.expert_gpu, MODEL, CLUSTER, 2, move_cells=owner == "planner")
    plan = plan_with_options(batch, MODEL, CLUSTER, "relibra", opts, evaluator=FavourColocated(homes))
    port = plan.stats.portfolio
    assert port.chosen == "colocated-per-micro-batch" and port.step_s[port.chosen] == 0.0
    np.testing.assert_array_equal(plan.placement.expert_gpu, homes)
    np.testing.assert_array_equal(plan.samples.micro_batch, own.samples.micro_batch)
    np.testing.assert_array_equal(plan.samples.gpu, where[own.samples.micro_batch, own.samples.gpu])
    if owner == "trainer":
        np.testing.assert_array_equal(plan.samples.gpu, kw["sample_gpu"])
    want = locality_replicas(plan_loads(plan, batch, CLUSTER.num_gpus), homes, MODEL, CLUSTER, 2, False)
    np.testing.assert_array_equal(plan.replicas.replica_expert, want.replica_expert)
    np.testing.assert_array_equal(plan.replicas.split_share, want.split_share)
    flow = plan_flow(plan, plan_loads(plan, batch, CLUSTER.num_gpus))
    assert flow.sum() == pytest.approx(plan_loads(plan, batch, CLUSTER.num_gpus).sum())  # no token lost


def test_no_colocation_on_one_node_or_past_the_work_limit(monkeypatch):
    batch = _batch()
    opts = PlanOptions(replica_slots=2, **FAST)
    one = plan_with_options(batch, MODEL, ClusterSpec(nodes=1, gpus_per_node=4), "relibra", opts).stats.portfolio
    assert not any(k.startswith("colocated") for k in [*one.step_s, *(one.pruned or {})])
    two = plan_with_options(batch, MODEL, CLUSTER, "relibra", opts).stats.portfolio
    assert any(k.startswith("colocated") for k in [*two.step_s, *(two.pruned or {})])
    monkeypatch.setattr("relibra_moe.planners.portfolio.COLOCATE_MAX_WORK", 0.0)
    capped = plan_with_options(batch, MODEL, CLUSTER, "relibra", opts).stats.portfolio
    assert not any(k.startswith("colocated") for k in [*capped.step_s, *(capped.pruned or {})])


@pytest.mark.parametrize("k", [0, 3, 8, 13])
def test_node_objective_matches_the_loop_for_any_copy_count(k):
    """Including more copies than remote experts (every remote token covered)."""
    x = _random_cells(7)
    where = np.array([[0, 1, 2, 3], [2, 3, 0, 1], [1, 2, 3, 0]])
    hn = np.array([[0, 1, 0, 1, 0, 1, 0, 1], [1, 1, 0, 0, 1, 0, 1, 0]])
    got = col._node_objective(col._node_loads(x, where, 2, 2), hn, k)
    assert got == pytest.approx(_objective_ref(x, where, hn, 2, k), abs=1e-9)
    xn = col._node_loads(x, where, 2, 2)
    sweeps = sum(col._homes_node_sweeps(np.ascontiguousarray(xn[:, layer]), hn[layer].copy(), k, 0)
                 for layer in range(2))
    assert sweeps == pytest.approx(got, abs=1e-9)  # the kernels' bookkeeping, no swap taken


@pytest.mark.parametrize("change, match", [
    (dict(x=np.zeros((2, 2, 4))), r"x has shape \(2, 2, 4\), expected \[M, L=2, G=4, E=8\]"),
    (dict(x=np.zeros((2, 2, 3, 8))), r"x has shape \(2, 2, 3, 8\), expected"),
    (dict(x=np.full((2, 2, 4, 8), -1.0)), "x"),
    (dict(homes=np.zeros((2, 8), np.int64)), "expert_gpu"),
    (dict(homes=np.zeros((1, 8), np.int64)), r"expert_gpu has shape \(1, 8\)"),
    (dict(r=-1), "replica_slots"),
    (dict(rounds=0), "rounds"),
    (dict(max_sweeps=-2), "max_sweeps"),
    (dict(cell_counts=np.zeros((3, 4), np.int64)), r"cell_counts has shape \(3, 4\), expected \[M=2, G=4\]"),
])
def test_bad_inputs_raise_a_plan_error_naming_them(change, match):
    args = dict(x=np.ones((2, 2, 4, 8)), homes=np.tile(np.arange(8) // 2, (2, 1)), r=1, rounds=8, max_sweeps=50,
                cell_counts=None)
    args.update(change)
    with pytest.raises(PlanError, match=match):
        col.colocate(args["x"], args["homes"], MODEL, CLUSTER, args["r"], rounds=args["rounds"],
                     max_sweeps=args["max_sweeps"], cell_counts=args["cell_counts"])


def test_node_copies_by_hand():
    """Node 0 homes experts 0-1, node 1 experts 2-3; two copies a node: node 0 copies the remote 3 (5 tokens) and 2
    (2), not its own 0; node 1 copies 0 (4) but not 1 (no tokens), and with one copy a tie (3 = 3) goes to the
    lower expert."""
    xn = np.array([[9.0, 1.0, 2.0, 5.0], [4.0, 0.0, 7.0, 7.0]])
    remote = np.array([[False, False, True, True], [True, True, False, False]])
    np.testing.assert_array_equal(node_copies(xn, remote, 2), [[False, False, True, True], [True, False, False, False]])
    tie = np.array([[0.0, 0.0, 3.0, 3.0]])
    np.testing.assert_array_equal(node_copies(tie, remote[:1], 1), [[False, False, True, False]])
    assert not node_copies(xn, remote, 0).any()
