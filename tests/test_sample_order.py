"""The sample-order hook (``relibra_moe.sample_order``) against hand-written simulations of verl's and slime's
dispatch: after reordering the batch by ``sample_order``, each framework's own split gives every rank, micro-step by
micro-step, exactly the plan's samples; ``keep_cell_sizes`` keeps the cells equal so that plans can be followed."""

from __future__ import annotations

import numpy as np
import pytest

from relibra_moe.errors import PlanError
from relibra_moe.plan import SamplePlacement, round_robin_gpus
from relibra_moe.planners.strategies import plan_batch
from relibra_moe.sample_order import cell_samples, sample_order
from relibra_moe.specs import ClusterSpec, ModelSpec
from relibra_moe.synthetic import rl_batch

MODEL = ModelSpec("t", hidden=256, ffn=128, num_experts=16, top_k=2, num_layers=3)
CLUSTER = ClusterSpec(nodes=2, gpus_per_node=2)  # G = 4 data-parallel ranks
FAST = dict(iters=200, locality_iters=400, num_seeds=1, rounds=1)


def verl_split(num_samples: int, dp_size: int, mini_per_rank: int, micro: int) -> list[list[list[int]]]:
    """verl, by hand: ``DataProto.chunk(dp_size)`` (equal contiguous chunks, chunk r to rank r), then on each rank
    ``data.split(ppo_mini_batch_size)`` and ``mini_batch.split(ppo_micro_batch_size_per_gpu)``. Returns
    ``out[r][j]``: the batch positions of rank r's j-th micro-batch, counted over its mini-batches."""
    per_rank = num_samples // dp_size
    assert per_rank * dp_size == num_samples  # verl asserts an equal chunk
    out = []
    for r in range(dp_size):
        chunk = list(range(r * per_rank, (r + 1) * per_rank))
        micro_batches = []
        for i in range(0, len(chunk), mini_per_rank):
            mini = chunk[i:i + mini_per_rank]
            micro_batches += [mini[k:k + micro] for k in range(0, len(mini), micro)]
        out.append(micro_batches)
    return out


def slime_split(num_samples: int, dp_size: int, micro: int) -> list[list[list[int]]]:
    """slime, by hand (``build_dp_schedule``, static batch, ``balance_data=False``, one sample per rollout): the
    step's samples in K contiguous micro-batches of ``micro_batch_size``, micro-batch k to rank ``k % dp_size``
    (``list(range(r, K, dp_size))``). Returns ``out[r][j]`` like ``verl_split``."""
    mbs = [list(range(i, min(i + micro, num_samples))) for i in range(0, num_samples, micro)]
    assert len(mbs) % dp_size == 0  # slime's static path asserts the alignment
    return [[mbs[k] for k in range(r, len(mbs), dp_size)] for r in range(dp_size)]


def _check_follows(samples: SamplePlacement, order: np.ndarray, split: list[list[list[int]]]) -> None:
    """Every rank's j-th micro-batch, read through ``order``, is the plan's cell (j, rank), in ascending order."""
    N = samples.num_samples
    assert sorted(order.tolist()) == list(range(N))  # a permutation: no sample lost or repeated
    mb, gpu = samples.micro_batch, samples.gpu
    for r, micro_batches in enumerate(split):
        assert len(micro_batches) == samples.num_micro_batches
        for j, positions in enumerate(micro_batches):
            got = [int(order[p]) for p in positions]
            want = [n for n in range(N) if mb[n] == j and gpu[n] == r]
            assert got == want, (r, j, got, want)


def _batch():
    return rl_batch(MODEL, "mixed", 8, responses_per_prompt=4, seed=11, micro_batch_size=8, max_len=96)


@pytest.fixture(scope="module")
def planned():
    """A relibra plan with keep_cell_sizes (its locality moved samples) and a trainer-owned one."""
    batch = _batch()  # 32 samples, 4 micro-batches of 8: 2 per (micro-batch, GPU) cell
    planner = plan_batch(batch, MODEL, CLUSTER, "relibra", replica_slots=1, keep_cell_sizes=True, tol=1.0, **FAST)
    ranks = np.tile([3, 1, 0, 2, 2, 0, 1, 3], 4)
    trainer = plan_batch(batch, MODEL, CLUSTER, "relibra", replica_slots=1, sample_owner="trainer",
                         sample_gpu=ranks, **FAST)
    return batch, planner, trainer


def test_keep_cell_sizes_moves_samples_but_keeps_every_cell_count(planned):
    batch, plan, _ = planned
    mb = batch.resolve_micro_batch()
    start = round_robin_gpus(mb, CLUSTER.num_gpus)
    assert not np.array_equal(plan.samples.gpu, start)  # the locality pass did move samples
    counts = np.zeros((plan.num_micro_batches, CLUSTER.num_gpus), np.int64)
    np.add.at(counts, (plan.samples.micro_batch, plan.samples.gpu), 1)
    assert (counts == 2).all()
    assert plan.stats["options"]["keep_cell_sizes"] is True


@pytest.mark.parametrize("which", ["planner", "trainer"])
@pytest.mark.parametrize("mini_per_rank", [2, 4, 8])
def test_verl_split_of_the_reordered_batch_is_the_plan(planned, which, mini_per_rank):
    _, planner, trainer = planned
    plan = planner if which == "planner" else trainer
    order = sample_order(plan, "verl")
    _check_follows(plan.samples, order, verl_split(32, CLUSTER.num_gpus, mini_per_rank, micro=2))


@pytest.mark.parametrize("which", ["planner", "trainer"])
def test_slime_split_of_the_reordered_batch_is_the_plan(planned, which):
    _, planner, trainer = planned
    plan = planner if which == "planner" else trainer
    order = sample_order(plan, "slime")
    _check_follows(plan.samples, order, slime_split(32, CLUSTER.num_gpus, micro=2))


def test_hand_case():
    """M = 2, G = 2, one sample per cell: verl is rank-major, slime micro-batch major."""
    s = SamplePlacement(np.array([1, 0, 0, 1]), np.array([1, 1, 0, 0]), 2)
    # cells: (0, 0) = [2], (0, 1) = [1], (1, 0) = [3], (1, 1) = [0]
    assert sample_order(s, "verl", num_gpus=2).tolist() == [2, 3, 1, 0]
    assert sample_order(s, "slime", num_gpus=2).tolist() == [2, 1, 3, 0]
    assert [[c.tolist() for c in row] for row in cell_samples(s, 2)] == [[[2], [1]], [[3], [0]]]


@pytest.mark.parametrize("args, match", [
    ((SamplePlacement(np.array([0, 0, 0, 1]), np.array([0, 0, 1, 1]), 2), "verl", 2),
     r"micro-batch 0 on GPU 0 holds 2 samples, micro-batch 0 on GPU 1 holds|micro-batch 0 on GPU 1 holds 1 "
     r"samples, micro-batch 0 on GPU 0 holds 2: verl's fixed micro-batch size .* keep_cell_sizes=True"),
    ((SamplePlacement(np.array([0, 1]), np.array([0, 1]), 2), "slime", 2),
     r"micro-batch 0 on GPU 1 holds 0 samples, micro-batch 0 on GPU 0 holds 1"),
    ((SamplePlacement(np.array([0, 0]), np.array([0, 1]), 1), "megatron", 2), r"framework='megatron' is not one of"),
    ((SamplePlacement(np.array([0, 0]), np.array([0, 5]), 1), "verl", 2), r"sample_gpu\[1\] = 5 is outside \[0, 2\)"),
    ((SamplePlacement(np.array([0, 0]), np.array([0, 1]), 1), "verl", None), "num_gpus is required"),
])
def test_bad_input_is_named(args, match):
    with pytest.raises(PlanError, match=match):
        sample_order(*args)


def test_keep_cell_sizes_refuses_token_cap():
    with pytest.raises(PlanError, match="token_cap=100 .* keep_cell_sizes=True"):
        plan_batch(_batch(), MODEL, CLUSTER, "relibra", keep_cell_sizes=True, repack=True, token_cap=100)
