"""planners/locality_replicas.py: the slots by hand on small cells (the greedy's RDMA gains, the in-node hot fill,
the GPU choice), the split against a hand optimum and the all-home / all-to-the-copy splits, and the two plans:
valid global-scope plans, every token kept (shares of a (m, l, j, e) sum to 1), byte-deterministic, resident
exactly when asked."""

from __future__ import annotations

import numpy as np
import pytest

from relibra_moe.cost import DEFAULT_BETA, smooth_max
from relibra_moe.cost_terms import link_masks
from relibra_moe.errors import PlanError
from relibra_moe.plan import BatchPlan, Placement, SamplePlacement
from relibra_moe.planners.locality_replicas import (
    global_holders,
    locality_replicas,
    locality_slots,
    locality_split,
    relocate_cells,
    slot_swap_moves,
)
from relibra_moe.planners.split import cell_weights, split_cost
from relibra_moe.specs import cluster_preset, model_preset

MODEL = model_preset("gpt-oss-20b").with_(num_layers=2, num_experts=4, top_k=2)
CLUSTER = cluster_preset("hopper-rail", nodes=2, gpus_per_node=2)
HOMES = np.arange(4)  # expert e homed on GPU e: node 0 homes experts 0, 1; node 1 homes 2, 3

CROSS = np.array([[5, 0, 8, 1], [0, 5, 6, 2], [7, 1, 5, 0], [3, 2, 0, 5]], np.float64)


def test_slots_by_hand_take_the_rdma_bottleneck_first():
    """By hand: cross-node tokens per source (tx) 9, 8, 8, 5 and per home (rx) 10, 3, 14, 3: the copy of expert 2
    in node 0 takes rx 14 -> 0 (max 14 -> 10), then expert 0 in node 1 (10 -> 3); experts 3 and 1 gain nothing on
    the maximum and keep 3 tokens each: node order breaks the tie. Inside node 0 expert 2 (14 tokens) goes to the
    GPU of least compute, GPU 1 (8 < 15), expert 3 to GPU 0 (GPU 1's only slot is taken); in node 1 the homes'
    loads are 19 - 14 = 5 and 8 - 3 = 5 after the copies took their tokens, so expert 0 goes to GPU 2 (the
    lower id), expert 1 to GPU 3. (The greedy alone: ``max_passes=0``.)"""
    rep = locality_slots(CROSS[None], HOMES, MODEL, CLUSTER, 1, max_passes=0)
    np.testing.assert_array_equal(rep, [[3], [2], [0], [1]])


def test_slots_fill_with_in_node_hot_experts_when_no_remote_copy_saves_traffic():
    """Every source routes inside its node only: the slots hold second holders of the node's own experts, the
    hottest first (expert 0 with 15 tokens on GPU 1, expert 1 on GPU 0; expert 3 with 11 on GPU 2, expert 2 on
    GPU 3). Homes and copies are the only holders and each GPU's slot is the one expert of its node it does not
    home, so the swaps have nothing to exchange."""
    x = np.array([[9, 1, 0, 0], [6, 2, 0, 0], [0, 0, 4, 3], [0, 0, 1, 8]], np.float64)
    np.testing.assert_array_equal(locality_slots(x[None], HOMES, MODEL, CLUSTER, 1), [[1], [0], [3], [2]])
    assert (locality_slots(np.zeros((1, 4, 4)), HOMES, MODEL, CLUSTER, 2) == -1).all()  # nothing routed: empty


def test_slot_swaps_put_a_copy_beside_the_samples_that_use_it():
    """By hand: in node 0 source 1 sends 10 tokens to expert 2 and source 0 sends 6 to expert 3 (both homed on node
    1), nothing else is routed. The greedy gives the larger copy (expert 2) to the GPU of least expected compute,
    GPU 0 (a tie: the lower id), and expert 3 to GPU 1, so both copies' tokens cross NVLink; the swap puts each
    copy on the GPU of its tokens: compute stays at most 10 and nothing moves, T_MoE = 10 token units exactly,
    against the greedy's 12.24 under the split LP. (Node 1 has no tokens to keep: its slots hold its own experts.)"""
    x = np.zeros((4, 4))
    x[1, 2], x[0, 3] = 10, 6
    greedy = locality_slots(x[None], HOMES, MODEL, CLUSTER, 1, max_passes=0)
    swapped = locality_slots(x[None], HOMES, MODEL, CLUSTER, 1)
    np.testing.assert_array_equal(greedy[:2], [[2], [3]])
    np.testing.assert_array_equal(swapped[:2], [[3], [2]])
    w = cell_weights(MODEL, CLUSTER)
    assert locality_split(x, HOMES, swapped, MODEL, CLUSTER).t_moe == pytest.approx(10 * w.sec_per_token, rel=1e-9)
    assert locality_split(x, HOMES, greedy, MODEL, CLUSTER).t_moe > 12 * w.sec_per_token


def test_per_micro_batch_slots_are_swapped_and_resident_ones_keep_the_greedy():
    """The by-hand cell of the swaps in two identical micro-batches: per micro-batch each cell gets the swapped
    slots (each copy beside its tokens), the resident slot set keeps the greedy's (docs/method.md, "Locality
    replicas": the proxy misjudges a set shared by many cells)."""
    x = np.zeros((2, 1, 4, 4))
    x[:, 0, 1, 2], x[:, 0, 0, 3] = 10, 6
    homes = HOMES[None]
    per = locality_replicas(x, homes, MODEL, CLUSTER, 1, resident=False).replica_expert
    res = locality_replicas(x, homes, MODEL, CLUSTER, 1, resident=True).replica_expert
    greedy = locality_slots(x[:, 0], HOMES, MODEL, CLUSTER, 1, max_passes=0)
    np.testing.assert_array_equal(per[:, 0, :2], [[[3], [2]], [[3], [2]]])
    np.testing.assert_array_equal(res[:, 0], np.stack([greedy, greedy]))
    np.testing.assert_array_equal(greedy[:2], [[2], [3]])


@pytest.mark.parametrize("bad", [-1, 1.5, True, "8"])
def test_slot_swap_passes_must_be_an_int_at_least_zero(bad):
    with pytest.raises(PlanError, match=f"max_passes={bad!r} must be an int >= 0"):
        locality_slots(CROSS[None], HOMES, MODEL, CLUSTER, 1, max_passes=bad)


def test_slot_swap_moves_by_hand():
    """2 x 2 GPUs, r = 1, homes e -> GPU e. Slots 3, 2 | 0, 1: both nodes' two slots may exchange. Slots 1, 0 in node
    0: the exchange would give each GPU its own home's expert, so none; an empty slot may take the other's expert
    (a move) unless that is the receiving GPU's home."""
    node = np.array([0, 0, 1, 1])
    np.testing.assert_array_equal(slot_swap_moves(np.array([[3], [2], [0], [1]]), HOMES, node),
                                  [[0, 0, 1, 0], [2, 0, 3, 0]])
    assert slot_swap_moves(np.array([[1], [0], [-1], [-1]]), HOMES, node).shape == (0, 4)
    np.testing.assert_array_equal(slot_swap_moves(np.array([[3], [-1], [-1], [1]]), HOMES, node),
                                  [[0, 0, 1, 0], [2, 0, 3, 0]])
    assert slot_swap_moves(np.array([[-1], [0], [-1], [-1]]), HOMES, node).shape == (0, 4)  # 0 is GPU 0's home


def _proxy_reference(x: np.ndarray, homes: np.ndarray, rep: np.ndarray, model, cluster) -> float:
    """float64 loop of the swaps' proxy (``locality_replicas._swap_slots``): a source holding the expert keeps its
    tokens, else its node's holders share them evenly, else the home takes them; per cell the LSE-smoothed max of
    the GPUs' loads plus that of their link terms at the comm weights (scale: the mean load), summed."""
    C, G, E = x.shape
    node = np.arange(G) // cluster.gpus_per_node
    nvm, rdm = link_masks(cluster.link_classes)
    w = cell_weights(model, cluster)
    total = 0.0
    for c in range(C):
        flow = np.zeros((G, G))
        for e in range(E):
            holders = [int(homes[e])] + [g for g in range(G) for k in range(rep.shape[1]) if rep[g, k] == e]
            for j in range(G):
                near = [g for g in holders if node[g] == node[j]]
                if j in holders:
                    flow[j, j] += x[c, j, e]
                elif near:
                    for g in near:
                        flow[j, g] += x[c, j, e] / len(near)
                else:
                    flow[j, holders[0]] += x[c, j, e]
        load = flow.sum(axis=0)
        links = np.concatenate([w.w_nv * (flow * nvm).sum(axis=1), w.w_nv * (flow * nvm).sum(axis=0),
                                w.w_rdma * (flow * rdm).sum(axis=1), w.w_rdma * (flow * rdm).sum(axis=0)])
        scale = max(load.mean(), 1e-12)
        total += float(smooth_max(load, DEFAULT_BETA, scale) + smooth_max(links, DEFAULT_BETA, scale))
    return total


@pytest.mark.parametrize("seed", range(6))
def test_slot_swaps_never_raise_the_proxy_and_keep_each_nodes_copies(seed):
    """Random cells on 2 x 3 GPUs, r = 2, one to three cells sharing the slots: the swaps' result scores at most the
    greedy's under a float64 loop of the proxy, every node keeps the same multiset of copies, no GPU holds an
    expert twice or a copy of its own home, and the result is deterministic."""
    rng = np.random.default_rng(seed)
    cluster = cluster_preset("hopper-rail", nodes=2, gpus_per_node=3)
    model = MODEL.with_(num_experts=12, top_k=3)
    C = 1 + seed % 3
    x = rng.integers(0, 20, size=(C, 6, 12)) * (rng.random((C, 6, 12)) < 0.6)
    homes = rng.permutation(np.repeat(np.arange(6), 2))
    greedy = locality_slots(x, homes, model, cluster, 2, max_passes=0)
    swapped = locality_slots(x, homes, model, cluster, 2)
    np.testing.assert_array_equal(swapped, locality_slots(x, homes, model, cluster, 2))
    assert _proxy_reference(x, homes, swapped, model, cluster) <= _proxy_reference(x, homes, greedy, model,
                                                                                   cluster) * (1 + 1e-9)
    for n in range(2):
        assert sorted(greedy[3 * n:3 * n + 3].ravel()) == sorted(swapped[3 * n:3 * n + 3].ravel())
    for g in range(6):
        held = swapped[g][swapped[g] >= 0]
        assert len(set(held)) == len(held) and not (homes[held] == g).any()


def test_global_holders_list_the_home_then_the_copies_by_gpu():
    rep = np.array([[2, -1], [2, 3], [0, -1], [-1, -1]])
    np.testing.assert_array_equal(global_holders(HOMES, rep), [[0, 2, -1], [1, -1, -1], [2, 0, 1], [3, 1, -1]])
    np.testing.assert_array_equal(global_holders(HOMES, np.full((4, 1), -1)), [[0], [1], [2], [3]])


def test_split_by_hand_on_one_gpu_per_node():
    """Two nodes of one GPU, expert 1 homed on GPU 1 and copied on GPU 0, 10 tokens of source 0 for it: serving a
    share s locally costs ``max(10 s, 10 (1 - s)) + w_rdma 10 (1 - s)`` token units, least at s = 1 (10) when
    ``w_rdma >= 1``, else at s = 1/2 (5 + 5 w_rdma)."""
    cluster = cluster_preset("hopper-rail", nodes=2, gpus_per_node=1)
    model = MODEL.with_(num_experts=2)
    x = np.array([[0.0, 10.0], [0.0, 0.0]])
    sol = locality_split(x, np.array([0, 1]), np.array([[1], [-1]]), model, cluster)
    w = cell_weights(model, cluster)
    assert sol.t_moe == pytest.approx(min(10.0, 5.0 + 5.0 * w.w_rdma) * w.sec_per_token, rel=1e-6)
    assert sol.t_moe == pytest.approx(split_cost(x, [0, 1], sol.rows, sol.share, model, cluster), rel=1e-9)


def test_split_is_never_worse_than_all_home_or_all_to_the_in_node_copy():
    rep = locality_slots(CROSS[None], HOMES, MODEL, CLUSTER, 1)
    sol = locality_split(CROSS, HOMES, rep, MODEL, CLUSTER)
    home = split_cost(CROSS, HOMES, np.zeros((0, 3), int), np.zeros(0), MODEL, CLUSTER)
    node = np.arange(4) // 2
    to_copy = [(j, e, g) for g in range(4) for e in rep[g] if e >= 0 for j in range(4)
               if node[j] == node[g] and CROSS[j, e] > 0]  # the hand plan: the node's sources use its copy
    hand = split_cost(CROSS, HOMES, np.array(to_copy), np.ones(len(to_copy)), MODEL, CLUSTER)
    assert sol.t_moe <= min(home, hand) * (1 + 1e-9)
    assert sol.t_moe < home  # the copies save RDMA traffic here


def _loads(seed: int, M: int = 3) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.integers(0, 12, size=(M, 2, 4, 4)) * (rng.random((M, 2, 4, 4)) < 0.7)


@pytest.mark.parametrize("resident", [True, False])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_plans_are_valid_keep_every_token_and_are_byte_deterministic(resident, seed, tmp_path):
    x = _loads(seed)
    homes = np.stack([np.array([0, 1, 2, 3]), np.array([3, 2, 1, 0])])
    reps = locality_replicas(x, homes, MODEL, CLUSTER, 2, resident)
    assert reps.scope == "global" and reps.replica_expert.shape == (3, 2, 4, 2)
    reps.validate(Placement(homes), MODEL, CLUSTER, 3)
    idx, share = reps.split_index, reps.split_share.astype(np.float64)
    sums: dict[tuple, float] = {}
    for row, s in zip(map(tuple, idx[:, :4]), share):
        sums[row] = sums.get(row, 0.0) + s
    assert all(abs(v - 1.0) < 1e-5 for v in sums.values())
    m, l, j, e = idx[:, :4].T
    assert (x[m, l, j, e] > 0).all()  # rows only for pairs with tokens
    assert reps.resident == (resident and bool((reps.replica_expert >= 0).any()))
    plan = BatchPlan(Placement(homes), SamplePlacement(np.arange(3), np.zeros(3, np.int32), 3), reps, 4, 2)

    def saved(p: BatchPlan) -> bytes:
        path = tmp_path / "plan.npz"
        p.save(path)
        return path.read_bytes()

    again = BatchPlan(Placement(homes), plan.samples, locality_replicas(x, homes, MODEL, CLUSTER, 2, resident), 4, 2)
    assert saved(plan) == saved(again)


def test_per_micro_batch_slots_follow_each_micro_batch():
    """Micro-batch 0 routes node 0's sources to expert 2, micro-batch 1 to expert 3: per micro-batch the copy in
    node 0 follows; resident, one copy set serves both."""
    x = np.zeros((2, 2, 4, 4))
    x[0, :, 0, 2] = x[0, :, 1, 2] = 9
    x[1, :, 0, 3] = x[1, :, 1, 3] = 9
    per = locality_replicas(x, np.tile(HOMES, (2, 1)), MODEL, CLUSTER, 1, resident=False).replica_expert
    assert 2 in per[0, 0, :2] and 3 not in per[0, 0, :2] and 3 in per[1, 0, :2] and 2 not in per[1, 0, :2]
    res = locality_replicas(x, np.tile(HOMES, (2, 1)), MODEL, CLUSTER, 1, resident=True).replica_expert
    assert set(res[0, 0, :2].ravel()) == {2, 3} and (res == res[:1]).all()


def test_relocate_cells_by_hand():
    """E = 8 on 2 x 2 GPUs (node 0 homes experts 0-3, node 1 experts 4-7), r = 1 (2 copies per node): the cell on
    GPU 0 routes 10 tokens to each of experts 4-7, the cell on GPU 2 to each of 0-3. Each node copies two of the
    four and 20 tokens still cross; swapping the two cells sends nothing across, the only swap that does, so
    cell 0 goes to GPU 2 and cell 2 to GPU 0. With cell counts 1, 1, 2, 2 (``keep_cell_sizes``) no two cells on
    different nodes have equal counts: nothing moves."""
    homes = np.repeat(np.arange(4), 2)[None]
    x = np.zeros((1, 1, 4, 8))
    x[0, 0, 0, 4:] = 10
    x[0, 0, 2, :4] = 10
    np.testing.assert_array_equal(relocate_cells(x, homes, CLUSTER, 1), [[2, 1, 0, 3]])
    np.testing.assert_array_equal(relocate_cells(x, homes, CLUSTER, 1, np.array([[1, 1, 2, 2]])), [[0, 1, 2, 3]])
    np.testing.assert_array_equal(relocate_cells(x, homes, CLUSTER, 1, max_swaps=0), [[0, 1, 2, 3]])


class _FailSecond:
    """An executor that runs every task in order but reports the second chunk as failed."""

    workers = 2

    def map(self, fn, args, keys):
        from relibra_moe.planners.executor import TaskFailed

        return [TaskFailed("test") if i == 1 else fn(*a) for i, a in enumerate(args)]

    @property
    def expired(self):
        return False


def test_chunks_on_a_pool_give_the_same_plan_and_a_failed_chunk_leaves_its_layers_at_home():
    from relibra_moe.planners.executor import PoolExecutor

    x = np.concatenate([_loads(0), _loads(1)], axis=1)  # 4 layers
    homes = np.tile(HOMES, (4, 1))
    model = MODEL.with_(num_layers=4)
    inline = locality_replicas(x, homes, model, CLUSTER, 2, False)
    pooled = locality_replicas(x, homes, model, CLUSTER, 2, False, PoolExecutor(2))
    np.testing.assert_array_equal(inline.replica_expert, pooled.replica_expert)
    np.testing.assert_array_equal(inline.split_index, pooled.split_index)
    np.testing.assert_array_equal(inline.split_share, pooled.split_share)
    failed = locality_replicas(x, homes, model, CLUSTER, 2, False, _FailSecond())  # chunks of one layer: layer 1
    failed.validate(Placement(homes), model, CLUSTER, 3)
    assert (failed.replica_expert[:, 1] == -1).all() and not (failed.split_index[:, 1] == 1).any()
    np.testing.assert_array_equal(failed.replica_expert[:, [0, 2, 3]], inline.replica_expert[:, [0, 2, 3]])


def test_exchange_swaps_a_copy_for_a_better_one_of_its_node():
    """By hand: two sources of node 0 send 8 and 6 cross-node tokens; candidate copies take 3 off the first (expert
    10), 5 off the second (expert 11), 1 off the first (expert 12). Holding expert 12 leaves max(7, 6) = 7;
    exchanging it for expert 10 leaves max(5, 6) = 6, for 11 max(8, 1) = 8; from 10 no exchange helps."""
    from relibra_moe.planners.locality_replicas import _exchange

    d_tx = np.array([[[3.0, 0.0, 1.0], [0.0, 5.0, 0.0]]])  # [C=1, G=2, K=3]
    tx = np.array([[8.0 - 1.0, 6.0]])  # with candidate 2 taken
    zero = np.zeros((1, 2))
    got = _exchange([2], np.zeros(3, np.int64), tx, zero, d_tx, np.zeros_like(d_tx), np.array([10, 11, 12]))
    assert got == [(0, 10)]
    assert _exchange([0], np.zeros(3, np.int64), np.array([[5.0, 6.0]]), zero, d_tx, np.zeros_like(d_tx),
                     np.array([10, 11, 12])) == [(0, 10)]
