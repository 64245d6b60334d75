"""The sample-order hooks (``relibra_moe.sample_order``) against the frameworks' dispatch: after reordering, each
framework's own split gives every rank, micro-step by micro-step, exactly the plan's samples; ``keep_cell_sizes``
keeps the cells equal so that plans can be followed.

- verl 0.9.1 (PyPI; the ``verl`` extra): its own code runs the path, ``RayPPOTrainer._balance_batch`` (the method's
  source from ``verl/trainer/ppo/ray_trainer.py``, run on a stand-in trainer, since that module needs the Ray
  server stack), ``DataProto.reorder`` / ``to_tensordict``, ``left_right_2_no_padding``, the dispatch's
  ``_split_args_kwargs_data_proto``, ``tensordict_utils.make_iterator`` and ``prepare_micro_batches``, called in
  the order of ``_update_actor`` -> ``TrainingWorker.train_mini_batch`` -> ``train_batch``.
- slime (not on PyPI): a re-statement of commit 624b824's ``_post_process_rewards``,
  ``_convert_samples_to_train_data``, ``_split_train_data_by_dp`` / ``build_dp_schedule`` (static batch) and the
  GRPO returns (``slime/ray/rollout.py``, ``slime/utils/dp_schedule.py``, ``slime/utils/ppo_utils.py``).
"""

from __future__ import annotations

import ast
import copy
import importlib.util
import pickle
import textwrap
import types
from pathlib import Path

import numpy as np
import pytest

from relibra_moe.adapters import from_verl
from relibra_moe.errors import PlanError
from relibra_moe.plan import BatchPlan, SamplePlacement, round_robin_gpus
from relibra_moe.planners.strategies import plan_batch
from relibra_moe.sample_order import cell_samples, reorder_slime_train_data, reorder_verl_batch, sample_order
from relibra_moe.specs import ClusterSpec, ModelSpec
from relibra_moe.synthetic import rl_batch
from relibra_moe.trace import TraceBatch

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
    assert plan.stats.options["keep_cell_sizes"] is True


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


# ---------------------------------------------------------------------------------------------- slime at 624b824
SLIME = dict(advantage_estimator="grpo", rewards_normalization=True, grpo_std_normalization=True,
             n_samples_per_prompt=4, rollout_batch_size=16, global_batch_size=32, micro_batch_size=2,
             use_dynamic_batch_size=False, balance_data=False, balance_by_flops=False, log_passrate=False)
SLIME_TPC = dict(dp_size=4, cp_size=1, vpp_size=1, microbatch_group_size_per_vp_stage=1)


def slime_args(**changes) -> types.SimpleNamespace:
    return types.SimpleNamespace(**{**SLIME, **changes})


def slime_rewards(raw: list[float], args) -> list[float]:
    """``RolloutManager._post_process_rewards`` (slime/ray/rollout.py, 624b824): with grpo and
    ``rewards_normalization``, rewards by list position in groups of ``n_samples_per_prompt``, minus the group mean,
    over the group std + 1e-6."""
    import torch

    rewards = torch.tensor(raw, dtype=torch.float)
    if rewards.shape[-1] == args.n_samples_per_prompt * args.rollout_batch_size:
        rewards = rewards.reshape(-1, args.n_samples_per_prompt)
    else:
        rewards = rewards.view(-1, rewards.shape[-1])
    rewards = rewards - rewards.mean(dim=-1, keepdim=True)
    rewards = rewards / (rewards.std(dim=-1, keepdim=True) + 1e-6)
    return rewards.flatten().tolist()


def slime_convert(samples: list, args) -> dict:
    """``_convert_samples_to_train_data`` (624b824), the fields of a default text rollout with routing replay."""
    raw = [s.reward for s in samples]
    ids = [s.rollout_id for s in samples]
    tmp, used = 0, {r for r in ids if r is not None}
    for i, r in enumerate(ids):  # rollout ids fall back to fresh integers
        if r is None:
            while tmp in used:
                tmp += 1
            ids[i] = tmp
            used.add(tmp)
    masks = [[1] * s.response_length for s in samples]
    totals: dict[int, int] = {}
    for r, m in zip(ids, masks):
        totals[r] = totals.get(r, 0) + sum(m)
    return {"tokens": [s.tokens for s in samples], "response_lengths": [s.response_length for s in samples],
            "rewards": slime_rewards(raw, args), "raw_reward": raw, "truncated": [0] * len(samples),
            "sample_indices": [s.index for s in samples], "rollout_ids": ids, "loss_masks": masks,
            "rollout_mask_sums": [totals[r] for r in ids],
            "rollout_routed_experts": [s.rollout_routed_experts for s in samples]}


def slime_dp_split(data: dict, args, tpc: dict) -> list[dict]:
    """``_split_train_data_by_dp`` with ``build_dp_schedule``'s static path (slime/utils/dp_schedule.py, 624b824):
    steps of ``global_batch_size`` rollouts (first-occurrence order of the rollout ids), each cut into contiguous
    micro-batches of ``micro_batch_size``, micro-batch k to rank k mod dp_size; each rank gets its samples'
    per-sample fields (``partition`` order) and ``micro_batch_indices`` into them."""
    G = tpc["dp_size"]
    by_rollout: dict[int, list[int]] = {}
    for pos, rid in enumerate(data["rollout_ids"]):
        by_rollout.setdefault(rid, []).append(pos)
    rollouts = list(by_rollout)
    parts: list[list[int]] = [[] for _ in range(G)]
    mbi: list[list[list[int]]] = [[] for _ in range(G)]
    for s in range(len(rollouts) // args.global_batch_size):
        idx = [p for rid in rollouts[s * args.global_batch_size:(s + 1) * args.global_batch_size]
               for p in by_rollout[rid]]
        b = args.micro_batch_size
        mbs = [list(range(i, min(i + b, len(idx)))) for i in range(0, len(idx), b)]
        assert len(mbs) % G == 0  # slime's static path asserts it
        for r in range(G):
            for k in range(r, len(mbs), G):
                start = len(parts[r])
                parts[r] += [idx[i] for i in mbs[k]]
                mbi[r].append(list(range(start, start + len(mbs[k]))))
    keys = [k for k in data if k not in ("raw_reward",)]
    return [{"partition": parts[r], "micro_batch_indices": mbi[r], **{k: [data[k][j] for j in parts[r]] for k in keys}}
            for r in range(G)]


def slime_advantages(rank_data: dict) -> list:
    """grpo in ``compute_advantages_and_returns`` (slime/backends/megatron_utils/loss.py, 624b824) with kl_coef 0:
    ``get_grpo_returns``, each sample's reward on every response token."""
    import torch

    return [torch.ones(n) * r for r, n in zip(rank_data["rewards"], rank_data["response_lengths"])]


def slime_samples(batch: TraceBatch, seed: int = 3) -> list:
    """slime ``Sample``s (the fields the conversion reads): ``len(tokens) - 1`` routing rows, 0/1 rewards."""
    rng = np.random.default_rng(seed)
    out = []
    for i, t in enumerate(batch.iter_traces()):
        T = t.num_tokens
        out.append(types.SimpleNamespace(tokens=list(range(T + 1)), response_length=int(rng.integers(1, T + 1)),
                                         reward=float(rng.integers(0, 2)), index=i, rollout_id=None,
                                         rollout_routed_experts=t.experts))
    return out


def slime_step_plans(train_data: dict, args, G: int) -> list[BatchPlan]:
    """One plan per step, each from the step's ``rollout_routed_experts`` in train_data order."""
    from relibra_moe.trace import RoutingTrace

    gbs, plans = args.global_batch_size, []
    for s in range(len(train_data["tokens"]) // gbs):
        traces = [RoutingTrace(ids, np.arange(MODEL.num_layers), MODEL.num_experts, MODEL.top_k)
                  for ids in train_data["rollout_routed_experts"][s * gbs:(s + 1) * gbs]]
        routing = TraceBatch(traces).with_micro_batch_size(G * args.micro_batch_size)
        plans.append(plan_batch(routing, MODEL, ClusterSpec(nodes=G // 2, gpus_per_node=2), "relibra",
                                replica_slots=1, keep_cell_sizes=True, tol=1.0, **FAST))
    return plans


@pytest.fixture(scope="module")
def slime_run():
    """64 samples (16 prompts x 4), 2 steps of 32, 4 dp ranks, micro-batch 2: slime without and with the hook."""
    args = slime_args()
    samples = slime_samples(rl_batch(MODEL, "mixed", 16, responses_per_prompt=4, seed=5, max_len=96))
    data = slime_convert(samples, args)
    plans = slime_step_plans(data, args, SLIME_TPC["dp_size"])
    hooked = reorder_slime_train_data(data, plans, args, SLIME_TPC)
    return samples, data, plans, hooked, slime_dp_split(data, args, SLIME_TPC), slime_dp_split(hooked, args, SLIME_TPC)


def _check_slime_follows(data: dict, plans: list[BatchPlan], ranks: list[dict], args) -> None:
    """Rank r's micro-batch m of step s holds the plan's cell (m, r) of step s: sample positions n of the step in
    the conversion's order, identified by ``sample_indices``."""
    gbs, G = args.global_batch_size, len(ranks)
    for s, plan in enumerate(plans):
        cells = cell_samples(plan, G)
        M = plan.num_micro_batches
        for r, rank in enumerate(ranks):
            for m in range(M):
                got = [rank["sample_indices"][i] for i in rank["micro_batch_indices"][s * M + m]]
                want = [data["sample_indices"][s * gbs + int(n)] for n in cells[m][r]]
                assert got == want, (s, r, m, got, want)


def test_slime_hook_places_every_sample_and_keeps_rewards_and_advantages(slime_run):
    samples, data, plans, hooked, base, ranks = slime_run
    _check_slime_follows(data, plans, ranks, slime_args())
    moved = sum(int(plans[s].samples.gpu[n]) != (n // 2) % 4 for s in range(2) for n in range(32))
    assert moved > 0  # the plans do move samples off slime's default rank

    def per_sample(split):
        out = {}
        for rank in split:
            for i, adv in zip(rank["sample_indices"], slime_advantages(rank)):
                out[i] = (rank["rewards"][rank["sample_indices"].index(i)], adv)
        return out

    want, got = per_sample(base), per_sample(ranks)
    assert sorted(got) == sorted(want) == list(range(64))
    for i in want:
        assert got[i][0] == want[i][0]
        assert np.array_equal(got[i][1].numpy(), want[i][1].numpy())
    # the same samples in each optimizer step, and every field still belongs to its sample
    for s in range(2):
        assert sorted(hooked["sample_indices"][32 * s:32 * (s + 1)]) == list(range(32 * s, 32 * (s + 1)))
    for pos, i in enumerate(hooked["sample_indices"]):
        assert hooked["tokens"][pos] is samples[i].tokens
        assert hooked["rollout_routed_experts"][pos] is samples[i].rollout_routed_experts
        assert hooked["raw_reward"][pos] == samples[i].reward and hooked["rewards"][pos] == data["rewards"][i]


def test_slime_reordering_the_samples_before_conversion_changes_rewards(slime_run):
    """The recipe the hook replaces: reordering the Sample list before the conversion regroups the rewards."""
    samples, data, plans, _, _, _ = slime_run
    order = np.concatenate([32 * s + sample_order(p, "slime") for s, p in enumerate(plans)])
    early = slime_convert([samples[i] for i in order], slime_args())
    changed = sum(abs(r - data["rewards"][i]) > 1e-6 for r, i in zip(early["rewards"], early["sample_indices"]))
    assert changed >= 16  # 36 of 64 with these plans
    with pytest.raises(PlanError, match=r"train_data must be the dict _convert_samples_to_train_data returns .* "
                                        r"got list: reordering the Sample list"):
        reorder_slime_train_data(samples, plans, slime_args(), SLIME_TPC)


@pytest.mark.parametrize("change, match", [
    (dict(use_dynamic_batch_size=True), r"--use-dynamic-batch-size is set: slime packs each step's micro-batches"),
    (dict(balance_data=True), r"--balance-data is set: slime assigns micro-batches to ranks by estimated FLOPs"),
    (dict(balance_by_flops=True), r"--balance-by-flops is set"),
    (dict(log_passrate=True), r"--log-passrate is set: pass@k reads raw_reward in groups"),
    (dict(micro_batch_size=4), r"args.micro_batch_size=4, the cells of plans\[0\] hold 2 samples"),
    (dict(global_batch_size=64), r"2 plans for 1 training steps \(64 samples, global_batch_size 64\)"),
    (dict(global_batch_size=16), r"2 plans for 4 training steps"),
])
def test_slime_hook_refuses_settings_it_cannot_follow(slime_run, change, match):
    _, data, plans, _, _, _ = slime_run
    with pytest.raises(PlanError, match=match):
        reorder_slime_train_data(data, plans, slime_args(**change), SLIME_TPC)


def test_slime_hook_refuses_unfit_data(slime_run):
    _, data, plans, _, _, _ = slime_run
    args = slime_args()
    with pytest.raises(PlanError, match=r"train_data\['loss_masks'\] has 63 entries, train_data\['tokens'\] has 64"):
        reorder_slime_train_data({**data, "loss_masks": data["loss_masks"][:-1]}, plans, args, SLIME_TPC)
    ids = list(data["rollout_ids"])
    ids[5] = ids[4]
    with pytest.raises(PlanError, match=r"train_data\['rollout_ids'\]\[5\] = 4 repeats entry 4: slime keeps"):
        reorder_slime_train_data({**data, "rollout_ids": ids}, plans, args, SLIME_TPC)
    with pytest.raises(PlanError, match=r"plans\[0\] has 4 micro-batches per rank, not a multiple of "
                                        r"microbatch_group_size_per_vp_stage = 3"):
        reorder_slime_train_data(data, plans, args, {**SLIME_TPC, "vpp_size": 2,
                                                     "microbatch_group_size_per_vp_stage": 3})
    with pytest.raises(PlanError, match=r"micro-batch 0 on GPU \d holds 0 samples"):  # 4-rank plans, 8 dp ranks
        reorder_slime_train_data(data, plans, args, {**SLIME_TPC, "dp_size": 8})
    with pytest.raises(PlanError, match=r"train_parallel_config\['dp_size'\]=None must be an int >= 1"):
        reorder_slime_train_data(data, plans, args, {"vpp_size": 1})
    with pytest.raises(PlanError, match=r"args has no micro_batch_size"):
        reorder_slime_train_data(data, plans, types.SimpleNamespace(**{k: v for k, v in SLIME.items()
                                                                        if k != "micro_batch_size"}), SLIME_TPC)


def test_slime_hook_keeps_trailing_samples_and_array_fields(slime_run):
    """Samples past the last whole step (slime drops them) keep their place; arrays are indexed, lists stay lists."""
    _, data, plans, _, _, _ = slime_run
    extra = {k: (list(v) + list(v[:3])) for k, v in data.items()}
    extra["sample_indices"], extra["rollout_ids"] = np.arange(67), list(range(67))
    out = reorder_slime_train_data(extra, plans, slime_args(), SLIME_TPC)
    assert isinstance(out["tokens"], list) and isinstance(out["sample_indices"], np.ndarray)
    assert out["sample_indices"][64:].tolist() == [64, 65, 66]
    order = np.concatenate([32 * s + sample_order(p, "slime") for s, p in enumerate(plans)])
    assert out["sample_indices"][:64].tolist() == order.tolist()


# ---------------------------------------------------------------------------------------------------- verl 0.9.1
G_VERL, B_VERL = 4, 2  # dp ranks, ppo_micro_batch_size_per_gpu


def verl_config(**actor) -> dict:
    """The settings ``reorder_verl_batch`` reads, at verl 0.9.1's defaults (trainer/config/actor/actor.yaml)
    except the batch sizes."""
    a = dict(shuffle=False, use_dynamic_bsz=False, use_prefix_grouper=False, ppo_micro_batch_size_per_gpu=B_VERL,
             ppo_mini_batch_size=8, ppo_epochs=1, data_loader_seed=42)
    a.update(actor)
    return {"actor_rollout_ref": {"actor": a, "rollout": {"n": 4}}}


class FakeProto:
    """A stand-in for verl's DataProto where only ``len`` and ``reorder`` matter."""

    def __init__(self, n: int) -> None:
        self.ids = np.arange(n)

    def __len__(self) -> int:
        return len(self.ids)

    def reorder(self, indices) -> None:
        self.ids = self.ids[np.asarray(indices)]


def test_verl_hook_reorders_rank_major(planned):
    _, plan, _ = planned
    batch = FakeProto(32)
    order = reorder_verl_batch(batch, plan, verl_config(), dp_size=G_VERL)
    assert batch.ids.tolist() == order.tolist() == sample_order(plan, "verl").tolist()


@pytest.mark.parametrize("change, match", [
    (dict(shuffle=True), r"actor_rollout_ref.actor.shuffle=True: verl's update data loader then draws each rank's "
                         r"mini-batches in a random order.* set actor_rollout_ref.actor.shuffle=false"),
    (dict(use_dynamic_bsz=True), r"actor_rollout_ref.actor.use_dynamic_bsz=True: verl then re-forms"),
    (dict(use_prefix_grouper=True), r"actor_rollout_ref.actor.use_prefix_grouper=True"),
    (dict(ppo_micro_batch_size_per_gpu=4), r"ppo_micro_batch_size_per_gpu=4, the plan's cells hold 2 samples"),
    (dict(ppo_micro_batch_size_per_gpu=None), r"ppo_micro_batch_size_per_gpu=None, the plan's cells hold 2"),
    (dict(ppo_mini_batch_size=3), r"ppo_mini_batch_size \* rollout.n = 12: each rank's mini-batch \(12 / dp_size 4\)"
                                  r" must be whole micro-batches of 2"),
    (dict(ppo_mini_batch_size=5), r"ppo_mini_batch_size \* rollout.n = 20"),  # 5 per rank does not divide 8
    (dict(shuffle="yes"), r"actor_rollout_ref.actor.shuffle must be a bool, got 'yes'"),
])
def test_verl_hook_refuses_settings_it_cannot_follow(planned, change, match):
    _, plan, _ = planned
    batch = FakeProto(32)
    with pytest.raises(PlanError, match=match):
        reorder_verl_batch(batch, plan, verl_config(**change), dp_size=G_VERL)
    assert batch.ids.tolist() == list(range(32))  # refused before touching the batch


def test_verl_hook_refuses_a_foreign_batch(planned):
    _, plan, _ = planned
    with pytest.raises(PlanError, match=r"the plan covers 32 samples, the batch has 30"):
        reorder_verl_batch(FakeProto(30), plan, verl_config(), dp_size=G_VERL)
    with pytest.raises(PlanError, match=r"config has no actor_rollout_ref.actor.shuffle \(pass the trainer's whole"):
        reorder_verl_batch(FakeProto(32), plan, verl_config()["actor_rollout_ref"], dp_size=G_VERL)
    with pytest.raises(PlanError, match=r"dp_size=0 must be an int >= 1"):
        reorder_verl_batch(FakeProto(32), plan, verl_config(), dp_size=0)


@pytest.fixture(scope="module")
def verl_code():
    """verl 0.9.1's own functions on the update path (skips without the ``verl`` extra)."""
    pytest.importorskip("verl.workers.utils.padding", reason="verl 0.9.1 not installed (the 'verl' extra, README)")
    import torch
    import verl
    from verl import DataProto
    from verl.single_controller.base.decorator import _split_args_kwargs_data_proto
    from verl.utils import seqlen_balancing
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import left_right_2_no_padding

    assert verl.__version__ == "0.9.1", verl.__version__
    root = Path(importlib.util.find_spec("verl").submodule_search_locations[0])
    # workers/engine/utils.py loaded from its file: the package verl.workers.engine imports every engine backend
    # (FSDP's needs peft, Megatron's megatron-core), which prepare_micro_batches does not use
    spec = importlib.util.spec_from_file_location("verl_workers_engine_utils", root / "workers/engine/utils.py")
    engine_utils = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(engine_utils)
    # RayPPOTrainer._balance_batch, run from its source: ray_trainer.py imports the Ray server stack
    path = root / "trainer/ppo/ray_trainer.py"
    text = path.read_text()
    cls = next(n for n in ast.parse(text).body if isinstance(n, ast.ClassDef) and n.name == "RayPPOTrainer")
    fn = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "_balance_batch")
    scope = dict(torch=torch, DataProto=DataProto, calculate_workload=seqlen_balancing.calculate_workload,
                 get_seqlen_balanced_partitions=seqlen_balancing.get_seqlen_balanced_partitions,
                 log_seqlen_unbalance=seqlen_balancing.log_seqlen_unbalance)
    exec(compile(textwrap.dedent(ast.get_source_segment(text, fn)), str(path), "exec"), scope)
    return types.SimpleNamespace(torch=torch, DataProto=DataProto, tu=tu, split=_split_args_kwargs_data_proto,
                                 prepare_micro_batches=engine_utils.prepare_micro_batches,
                                 no_padding=left_right_2_no_padding, balance_batch=scope["_balance_batch"])


def verl_balance(v, batch) -> None:
    """``fit``'s ``self._balance_batch(batch, metrics=metrics)`` on a trainer of ``G_VERL`` actor dp ranks."""
    trainer = types.SimpleNamespace(_get_dp_size=lambda worker_group, role: G_VERL, actor_rollout_wg=None,
                                    use_prefix_grouper=False)
    v.balance_batch(trainer, batch, metrics={})


def verl_proto(v, routing: TraceBatch, P: int = 48, R: int = 96):
    """A verl batch of ``routing``'s samples: left-padded prompt (a third of the tokens) and right-padded response,
    ``routed_experts [N, P + R, L, k]`` on the real tokens (as verl's router replay carries it), ``sample_id``."""
    torch = v.torch
    N, L, k = len(routing), routing.num_layers, routing.top_k
    mask, resp = torch.zeros(N, P + R, dtype=torch.int64), torch.zeros(N, R, dtype=torch.int64)
    ids = torch.zeros(N, P + R, L, k, dtype=torch.int64)
    for i, t in enumerate(routing.iter_traces()):
        p = max(1, t.num_tokens // 3)
        r = t.num_tokens - p
        assert p <= P and 1 <= r <= R
        mask[i, P - p:P] = mask[i, P:P + r] = resp[i, :r] = 1
        rows = torch.from_numpy(np.array(t.experts))  # a writable copy of the read-only trace
        ids[i, P - p:P], ids[i, P:P + r] = rows[:p], rows[p:]
    return v.DataProto.from_dict(tensors=dict(
        input_ids=torch.arange(N * (P + R)).view(N, P + R), attention_mask=mask, response_mask=resp,
        position_ids=(mask.cumsum(-1) - 1).clamp(min=0), routed_experts=ids, sample_id=torch.arange(N)))


def verl_update(v, batch, config: dict) -> list[list]:
    """verl 0.9.1's update path on ``batch``: ``out[r]`` lists rank r's micro-batches (TensorDicts) in the order
    it runs them, over its mini-batches and epochs. The calls of ``RayPPOTrainer._update_actor``
    (trainer/ppo/ray_trainer.py), the dispatch of ``update_actor`` (single_controller/base/decorator.py,
    ``dispatch_nd_compute_dataproto``), ``TrainingWorker.train_mini_batch`` / ``train_batch``
    (workers/engine_workers.py) and the engine's ``prepare_micro_batches`` (workers/engine/utils.py), in order."""
    actor, tu = config["actor_rollout_ref"]["actor"], v.tu
    td = v.no_padding(batch.to_tensordict())
    mini = actor["ppo_mini_batch_size"] * config["actor_rollout_ref"]["rollout"]["n"]
    tu.assign_non_tensor(td, global_batch_size=mini, mini_batch_size=mini, epochs=actor["ppo_epochs"],
                         seed=actor["data_loader_seed"], dataloader_kwargs={"shuffle": actor["shuffle"]},
                         compute_loss=True)
    (chunks,), _ = v.split(G_VERL, td)
    out = []
    for r, chunk in enumerate(chunks):
        chunk = pickle.loads(pickle.dumps(chunk))  # the trip through Ray's object store (the chunk arrives unlocked)
        size, epochs = tu.pop(chunk, key="mini_batch_size"), tu.pop(chunk, key="epochs")
        seed, kwargs = tu.pop(chunk, key="seed"), tu.pop(chunk, key="dataloader_kwargs")
        micro = []
        for mini_td in tu.make_iterator(chunk, mini_batch_size=size // G_VERL, epochs=epochs, seed=seed + r,
                                        dataloader_kwargs=kwargs):
            tu.assign_non_tensor(mini_td, use_dynamic_bsz=actor["use_dynamic_bsz"],
                                 micro_batch_size_per_gpu=actor["ppo_micro_batch_size_per_gpu"])
            micro += list(v.prepare_micro_batches(mini_td)[0])
        out.append(micro)
    return out


def _sample_rows(mb, i: int) -> np.ndarray:
    """Micro-batch ``mb``'s routed-experts rows of its i-th sample (a jagged tensor after the unpadding)."""
    re = mb["routed_experts"]
    off = re.offsets()
    return re.values()[int(off[i]):int(off[i + 1])].numpy()


def _varied_batch() -> TraceBatch:
    """``_batch()``'s samples cut to 8-96 tokens (its own are all 96 long: _balance_batch would see ties only)."""
    from relibra_moe.trace import RoutingTrace

    cut = np.random.default_rng(7).integers(8, 97, size=32)
    return TraceBatch([RoutingTrace(t.experts[:c], t.layer_ids, t.num_experts, t.top_k)
                       for t, c in zip(_batch().iter_traces(), cut)])


@pytest.fixture(scope="module")
def verl_planned(verl_code):
    """A verl batch after ``_balance_batch``, its routing (from ``routed_experts`` and ``attention_mask``, as
    docs/rl-frameworks.md reads it) and a keep-cell-sizes plan for it, micro-batch G b = 8."""
    source = _varied_batch()
    batch = verl_proto(verl_code, source)
    verl_balance(verl_code, batch)
    balanced = batch.batch["sample_id"].numpy().copy()
    routing = from_verl(batch.batch["routed_experts"], batch.batch["attention_mask"],
                        num_experts=MODEL.num_experts).with_micro_batch_size(G_VERL * B_VERL)
    # relibra's own plan (portfolio off): it moves samples off verl's order, which the update-path test needs (the
    # portfolio may return a candidate on the round-robin cells, e.g. resident locality copies on them)
    plan = plan_batch(routing, MODEL, CLUSTER, "relibra", replica_slots=1, keep_cell_sizes=True, portfolio=False,
                      **FAST)
    return source, batch, balanced, routing, plan


@pytest.mark.parametrize("mini_size, epochs", [(2, 1), (8, 2), (4, 1)])
def test_verl_update_path_runs_the_plan(verl_code, verl_planned, mini_size, epochs):
    """After ``_balance_batch`` and the hook, verl's own split gives rank r, as micro-batch m (in every epoch), the
    plan's cell (m, r), each sample with its own routed-experts rows."""
    source, balanced_batch, balanced, routing, plan = verl_planned
    assert not np.array_equal(balanced, np.arange(32))  # _balance_batch did reorder
    for n in range(32):  # the routing read from the balanced batch is the samples' own
        assert np.array_equal(routing.trace(n).experts, source.trace(int(balanced[n])).experts)
    assert not np.array_equal(plan.samples.gpu, round_robin_gpus(routing.resolve_micro_batch(), G_VERL))
    config = verl_config(ppo_mini_batch_size=mini_size, ppo_epochs=epochs)
    batch = copy.deepcopy(balanced_batch)
    reorder_verl_batch(batch, plan, config, dp_size=G_VERL, routing=routing)
    out = verl_update(verl_code, batch, config)
    cells, M = cell_samples(plan), plan.num_micro_batches
    for r in range(G_VERL):
        assert len(out[r]) == epochs * M
        for step, mb in enumerate(out[r]):
            want = cells[step % M][r]
            assert mb["sample_id"].tolist() == balanced[want].tolist(), (r, step)
            for i, n in enumerate(want):
                assert np.array_equal(_sample_rows(mb, i), routing.trace(int(n)).experts)


def test_verl_shuffle_misplaces_and_is_refused(verl_code, verl_planned):
    """With ``actor.shuffle=true`` verl's data loader reorders each rank's samples: the hook refuses it; forced
    through the bare order, every sample stays on its rank but the micro-batches are not the plan's."""
    _, balanced_batch, balanced, routing, plan = verl_planned
    config = verl_config(shuffle=True)
    batch = copy.deepcopy(balanced_batch)
    with pytest.raises(PlanError, match=r"actor_rollout_ref.actor.shuffle=True"):
        reorder_verl_batch(batch, plan, config, dp_size=G_VERL, routing=routing)
    batch.reorder(verl_code.torch.as_tensor(sample_order(plan, "verl")))
    out = verl_update(verl_code, batch, config)
    cells = cell_samples(plan)
    same = 0
    for r in range(G_VERL):
        got = [mb["sample_id"].tolist() for mb in out[r]]
        assert sorted(sum(got, [])) == sorted(balanced[np.flatnonzero(plan.samples.gpu == r)].tolist())
        same += sum(g == balanced[cells[m][r]].tolist() for m, g in enumerate(got))
    assert same <= G_VERL * plan.num_micro_batches // 2  # 2 of 16 cells with this seed


def test_verl_balance_after_the_hook_breaks_the_plan(verl_code, verl_planned):
    """``_balance_batch`` must run before the hook: a plan made for the batch before it is refused (token counts
    differ), and a hook run before it is undone by it."""
    source, balanced_batch, balanced, _, _ = verl_planned
    early = verl_proto(verl_code, source)  # the batch before _balance_batch
    early_routing = from_verl(early.batch["routed_experts"], early.batch["attention_mask"],
                              num_experts=MODEL.num_experts).with_micro_batch_size(G_VERL * B_VERL)
    plan = plan_batch(early_routing, MODEL, CLUSTER, "relibra", replica_slots=1, keep_cell_sizes=True, **FAST)
    with pytest.raises(PlanError, match=r"batch row \d+ has \d+ tokens \(attention_mask\), the routing's sample \d+ "
                                        r"has \d+: the plan was made for another order"):
        reorder_verl_batch(copy.deepcopy(balanced_batch), plan, verl_config(), dp_size=G_VERL, routing=early_routing)
    reorder_verl_batch(early, plan, verl_config(), dp_size=G_VERL, routing=early_routing)
    verl_balance(verl_code, early)  # the wrong way round
    out = verl_update(verl_code, early, verl_config())
    on_rank = sum(int(plan.samples.gpu[i]) == r for r in range(G_VERL) for mb in out[r]
                  for i in mb["sample_id"].tolist())
    assert on_rank <= 16  # 5 of 32 with this batch (chance: 8)


def _cli_plan(batch: TraceBatch, tmp_path: Path, nodes: int, gpus_per_node: int) -> BatchPlan:
    """``relibra plan --keep-cell-sizes`` (relibra, one replica slot, short search) of ``batch``, read back."""
    from relibra_moe.cli import main

    batch.save(tmp_path / "batch.npz")
    assert main(["plan", str(tmp_path / "batch.npz"), "--model", "gpt-oss-20b", "--nodes", str(nodes),
                 "--gpus-per-node", str(gpus_per_node), "--strategy", "relibra", "--replica-slots", "1",
                 "--keep-cell-sizes", "--iters", "200", "--locality-iters", "400", "--num-seeds", "1", "--rounds",
                 "1", "--out", str(tmp_path / "plan.npz")]) == 0
    plan = BatchPlan.load(tmp_path / "plan.npz")
    assert (plan.samples.gpu != round_robin_gpus(batch.resolve_micro_batch(), 4)).sum() > 0
    return plan


@pytest.mark.traces
@pytest.mark.parametrize("nodes, gpus_per_node", [(1, 4), (2, 2)])
def test_gpt_oss_cli_plan_followed_by_slime(traces_dir, tmp_path, monkeypatch, nodes, gpus_per_node):
    """64 GPT-OSS-20B samples (8 prompts x 8 in slime's view), planned by ``relibra plan --keep-cell-sizes`` on 4
    GPUs, micro-batch 2 per rank: slime's static schedule runs the plan's cells and every sample keeps its
    group-normalized reward."""
    from relibra_moe.datasets import gpt_oss_batch

    monkeypatch.setenv("RELIBRA_TRACES", str(traces_dir))
    batch = gpt_oss_batch(64, seed=0).with_micro_batch_size(8)
    plan = _cli_plan(batch, tmp_path, nodes, gpus_per_node)
    args = slime_args(n_samples_per_prompt=8, rollout_batch_size=8, global_batch_size=64)
    samples = slime_samples(batch, seed=1)
    data = slime_convert(samples, args)
    hooked = reorder_slime_train_data(data, plan, args, SLIME_TPC)
    ranks = slime_dp_split(hooked, args, SLIME_TPC)
    _check_slime_follows(data, [plan], ranks, args)
    for rank in ranks:
        for i, reward in zip(rank["sample_indices"], rank["rewards"]):
            assert reward == data["rewards"][i]


@pytest.mark.traces
def test_gpt_oss_cli_plan_followed_by_verl(verl_code, traces_dir, tmp_path, monkeypatch):
    """The same 64 GPT-OSS-20B samples through verl 0.9.1: ``_balance_batch``, the routing read back with
    ``from_verl``, ``relibra plan --keep-cell-sizes`` on 2 x 2, the hook, verl's update path: every rank runs the
    plan's cells (2 mini-batches per rank)."""
    from relibra_moe.datasets import gpt_oss_batch

    monkeypatch.setenv("RELIBRA_TRACES", str(traces_dir))
    batch = verl_proto(verl_code, gpt_oss_batch(64, seed=0), P=192, R=384)
    verl_balance(verl_code, batch)
    ids = batch.batch["sample_id"].numpy().copy()
    routing = from_verl(batch.batch["routed_experts"], batch.batch["attention_mask"], num_experts=32,
                        num_moe_layers=24).with_micro_batch_size(8)
    plan = _cli_plan(routing, tmp_path, 2, 2)
    config = verl_config(ppo_mini_batch_size=8)
    reorder_verl_batch(batch, plan, config, dp_size=G_VERL, routing=routing)
    out = verl_update(verl_code, batch, config)
    cells = cell_samples(plan)
    for r in range(G_VERL):
        assert [mb["sample_id"].tolist() for mb in out[r]] == [ids[c[r]].tolist() for c in cells]
