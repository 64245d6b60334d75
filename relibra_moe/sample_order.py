"""The sample-order hooks: a plan's sample placement as the order in which a trainer's dispatch must see the batch.

Trainers that reorder their global batch before dispatching it to the data-parallel ranks (verl, slime) can follow
a plan's sample placement exactly: reorder what the framework trains on by the plan, and its own split hands rank
r, micro-step by micro-step, exactly the samples the plan runs on GPU r in micro-batch m. The hooks, with the
framework settings they check (docs/rl-frameworks.md, "Following the plan's sample placement"):

- ``reorder_verl_batch(batch, plan, config, dp_size=...)``: verl 0.9.1, in the driver after ``_balance_batch``
  (override ``RayPPOTrainer._update_actor``). Refuses ``actor.shuffle=true``, ``use_dynamic_bsz``, the
  PrefixGrouper and a micro-batch size other than the plan's cells.
- ``reorder_slime_train_data(train_data, plans, args, train_parallel_config)``: slime (commit 624b824), on the
  dict ``_convert_samples_to_train_data`` returns, so the group-normalized rewards are computed before the
  reorder and move with their samples. Refuses ``--use-dynamic-batch-size``, ``--balance-data`` (and
  ``--balance-by-flops``), ``--log-passrate`` and a micro-batch or step size other than the plan's.

``sample_order(plan, framework)`` is the bare permutation both use. How the frameworks split a reordered batch
(fixed micro-batch size b, no dynamic batching):

- **verl 0.9.1** (engine workers): ``update_actor``'s dispatch cuts the batch into G equal contiguous chunks
  (``chunk_tensordict``), chunk r to data-parallel rank r; ``TrainingWorker.train_mini_batch`` iterates each
  chunk in mini-batches (``tensordict_utils.make_iterator``, in order when ``shuffle`` is false) and the engine
  cuts each mini-batch into micro-batches of ``ppo_micro_batch_size_per_gpu`` = b (``prepare_micro_batches``).
  Rank r's j-th micro-batch (counted over its mini-batches) is positions ``r N/G + j b .. r N/G + (j + 1) b``:
  the order is rank-major, rank 0's micro-batches 0..M-1, then rank 1's, and so on.
- **slime** (``slime.utils.dp_schedule.build_dp_schedule``, static batch): a step's samples are cut into K
  contiguous micro-batches of ``micro_batch_size`` = b, and micro-batch k goes to rank ``k mod G`` as that
  rank's micro-batch ``k // G`` (the strided round-robin of ``balance_data=False``). The order is micro-batch
  major: micro-step 0 of ranks 0..G-1, then micro-step 1, and so on.

Both need every (micro-batch, GPU) cell of the plan to hold the same number b of samples: plan with
``keep_cell_sizes=True`` (the locality then only swaps samples; the round-robin start has B / G per cell when G
divides B) or with ``sample_owner="trainer"`` and an equal assignment. Within a cell the samples keep their
order in the batch (ascending index).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from .errors import PlanError
from .plan import BatchPlan, SamplePlacement
from .trace import TraceBatch
from .validate import check_bool, check_int

__all__ = ["FRAMEWORKS", "sample_order", "cell_samples", "reorder_verl_batch", "reorder_slime_train_data"]

FRAMEWORKS = ("verl", "slime")
"""The dispatch orders ``sample_order`` knows: "verl" (rank-major) and "slime" (micro-batch major)."""


def cell_samples(samples: SamplePlacement | BatchPlan, num_gpus: int | None = None) -> list[list[np.ndarray]]:
    """``out[m][g]``: int64 indices of the samples of micro-batch m on GPU g, ascending.

    Args:
        samples: a ``SamplePlacement`` or a ``BatchPlan`` (its ``samples``).
        num_gpus: G (default: the plan's ``num_gpus``; required for a bare ``SamplePlacement``).
    """
    samples, G = _placement(samples, num_gpus)
    mb = samples.micro_batch.astype(np.int64)
    gpu = samples.gpu.astype(np.int64)
    M = int(samples.num_micro_batches)
    return [[np.flatnonzero((mb == m) & (gpu == g)) for g in range(G)] for m in range(M)]


def sample_order(samples: SamplePlacement | BatchPlan, framework: str, num_gpus: int | None = None) -> np.ndarray:
    """int64 ``[N]`` permutation of the batch for ``framework``'s dispatch to follow the plan's sample placement.

    Position i of the reordered batch holds sample ``order[i]`` of the batch the plan was made for. After the
    framework's own split (module docstring), data-parallel rank g runs, as its micro-batch m, exactly the plan's
    samples of micro-batch m on GPU g, in ascending index order. The bare permutation checks no framework
    setting: use ``reorder_verl_batch`` / ``reorder_slime_train_data``, which apply it where it is safe and
    refuse the settings under which the framework would not follow it. In slime, never reorder the ``Sample``
    list before ``_convert_samples_to_train_data``: its reward normalization groups samples by list position.

    Args:
        samples: the plan (``BatchPlan``) or its ``SamplePlacement``.
        framework: one of ``FRAMEWORKS``.
        num_gpus: G = the data-parallel ranks of the EP group (default: the plan's ``num_gpus``).

    Raises:
        PlanError: an unknown framework, or a cell whose sample count differs from the others' (the
            frameworks' fixed micro-batch size b needs every (micro-batch, GPU) cell to hold b samples; plan
            with ``keep_cell_sizes=True``); the message names the cell, its count and b.
    """
    if framework not in FRAMEWORKS:
        raise PlanError(f"framework={framework!r} is not one of {FRAMEWORKS}")
    cells = cell_samples(samples, num_gpus)
    M, G = len(cells), len(cells[0]) if cells else 0
    b = len(cells[0][0]) if M and G else 0
    for m in range(M):
        for g in range(G):
            if len(cells[m][g]) != b:
                raise PlanError(
                    f"micro-batch {m} on GPU {g} holds {len(cells[m][g])} samples, micro-batch 0 on GPU 0 holds "
                    f"{b}: {framework}'s fixed micro-batch size needs the same count in every (micro-batch, GPU) "
                    "cell; plan with keep_cell_sizes=True (or give the trainer's equal assignment with "
                    "sample_owner='trainer')")
    if b == 0 and M:
        raise PlanError(f"micro-batch 0 on GPU 0 holds no sample: {framework} gives every rank at least one")
    if framework == "verl":
        parts = [cells[m][g] for g in range(G) for m in range(M)]
    else:
        parts = [cells[m][g] for m in range(M) for g in range(G)]
    return np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, np.int64)


def _placement(samples: Any, num_gpus: int | None) -> tuple[SamplePlacement, int]:
    if isinstance(samples, BatchPlan):
        G = samples.num_gpus if num_gpus is None else num_gpus
        samples = samples.samples
    elif isinstance(samples, SamplePlacement):
        if num_gpus is None:
            raise PlanError("num_gpus is required with a SamplePlacement (a BatchPlan carries its own)")
        G = num_gpus
    else:
        raise PlanError(f"samples must be a BatchPlan or a SamplePlacement, got {type(samples).__name__}")
    check_int("num_gpus", G, 1)
    gpu = samples.gpu
    if gpu.size and (int(gpu.min()) < 0 or int(gpu.max()) >= G):
        i = int(np.flatnonzero((gpu < 0) | (gpu >= G))[0])
        raise PlanError(f"sample_gpu[{i}] = {int(gpu[i])} is outside [0, {int(G)})")
    return samples, int(G)


def _setting(config: Any, path: str, default: Any = PlanError) -> Any:
    """``config``'s value at the dotted ``path`` (a mapping such as OmegaConf's DictConfig, or attributes);
    ``default`` where a key is missing, or PlanError naming the path when no default is given."""
    obj = config
    for part in path.split("."):
        if isinstance(obj, Mapping) and part in obj:
            obj = obj[part]
        elif not isinstance(obj, Mapping) and hasattr(obj, part):
            obj = getattr(obj, part)
        elif default is PlanError:
            raise PlanError(f"config has no {path} (pass the trainer's whole config: the settings the plan needs "
                            "are read from it)")
        else:
            return default
    return obj


def _cell_size(plan: BatchPlan, framework: str, num_gpus: int) -> tuple[np.ndarray, int]:
    """The framework's permutation for ``plan`` and the plan's per-cell sample count b."""
    order = sample_order(plan, framework, num_gpus)
    cells = cell_samples(plan, num_gpus)
    return order, len(cells[0][0]) if cells else 0


def reorder_verl_batch(batch: Any, plan: BatchPlan, config: Any, *, dp_size: int,
                       routing: TraceBatch | None = None) -> np.ndarray:
    """Reorder verl's ``DataProto`` in place so that verl 0.9.1's update follows ``plan``; returns the order.

    Call it in the driver on the batch ``RayPPOTrainer._update_actor`` receives (``fit`` has run
    ``_balance_batch`` on it, and its advantages, grouped by ``uid``, not by position): the plan must be made for
    the batch in that order (the order ``_balance_batch`` left). Every field of the DataProto moves with its
    sample (``DataProto.reorder``). The workers then run, as micro-batch m of dp rank g, the plan's samples of
    micro-batch m on GPU g (in every PPO epoch).

    Args:
        batch: the ``DataProto`` (``len(batch)`` samples; ``batch.batch["attention_mask"]`` when ``routing``).
        plan: the ``BatchPlan``, N = ``len(batch)``, every (micro-batch, GPU) cell of the same size b.
        config: the trainer's config (``self.config``); read: ``actor_rollout_ref.actor.shuffle``,
            ``.use_dynamic_bsz``, ``.ppo_micro_batch_size_per_gpu``, ``.ppo_mini_batch_size``,
            ``.use_prefix_grouper`` (absent = false, as in verl) and ``actor_rollout_ref.rollout.n``.
        dp_size: the actor's data-parallel size (``self._get_dp_size(self.actor_rollout_wg, "actor")``).
        routing: the ``TraceBatch`` the plan was made for; when given, sample i's token count must equal the
            ``attention_mask`` ones of the batch's row i (a plan made for another order of the batch is refused).

    Raises:
        PlanError: naming the setting and its value: ``shuffle`` true (each rank's mini-batches are drawn in a
            random order), ``use_dynamic_bsz`` true (micro-batches re-formed by token count), the PrefixGrouper,
            ``ppo_micro_batch_size_per_gpu`` other than the plan's b, a mini-batch that is not whole micro-batches,
            N other than ``len(batch)``, a token count that differs from the routing's; and ``sample_order``'s
            errors (unequal cells).
    """
    actor = "actor_rollout_ref.actor"
    for key in ("shuffle", "use_dynamic_bsz", "use_prefix_grouper"):
        value = check_bool(f"{actor}.{key}", _setting(config, f"{actor}.{key}",
                                                      False if key == "use_prefix_grouper" else PlanError))
        if value:
            why = {"shuffle": "verl's update data loader then draws each rank's mini-batches in a random order",
                   "use_dynamic_bsz": "verl then re-forms each rank's micro-batches by token count",
                   "use_prefix_grouper": "_balance_batch then keeps each uid group on one rank, in its order"}[key]
            raise PlanError(f"{actor}.{key}=True: {why}, so the plan's micro-batches cannot be followed; set "
                            f"{actor}.{key}=false to follow the plan")
    G = check_int("dp_size", dp_size, 1)
    if plan.samples.num_samples != len(batch):
        raise PlanError(f"the plan covers {plan.samples.num_samples} samples, the batch has {len(batch)}")
    order, b = _cell_size(plan, "verl", G)
    micro = _setting(config, f"{actor}.ppo_micro_batch_size_per_gpu")
    if micro != b:
        raise PlanError(f"{actor}.ppo_micro_batch_size_per_gpu={micro!r}, the plan's cells hold {b} samples: plan "
                        "with micro-batches of dp_size * ppo_micro_batch_size_per_gpu samples")
    mini = (check_int(f"{actor}.ppo_mini_batch_size", _setting(config, f"{actor}.ppo_mini_batch_size"), 1)
            * check_int("actor_rollout_ref.rollout.n", _setting(config, "actor_rollout_ref.rollout.n"), 1))
    if mini % G or (mini // G) % b or (len(batch) // G) % (mini // G):
        raise PlanError(f"{actor}.ppo_mini_batch_size * rollout.n = {mini}: each rank's mini-batch ({mini} / "
                        f"dp_size {G}) must be whole micro-batches of {b} and divide its {len(batch) // G} samples")
    if routing is not None:
        _check_lengths(batch, routing)
    import torch

    batch.reorder(torch.as_tensor(order))
    return order


def _check_lengths(batch: Any, routing: TraceBatch) -> None:
    tokens = np.asarray(batch.batch["attention_mask"].sum(-1)).astype(np.int64)
    if tokens.shape != routing.lengths.shape:
        raise PlanError(f"the routing has {routing.lengths.shape[0]} samples, the batch {tokens.shape[0]}")
    bad = np.flatnonzero(tokens != routing.lengths)
    if bad.size:
        i = int(bad[0])
        raise PlanError(f"batch row {i} has {int(tokens[i])} tokens (attention_mask), the routing's sample {i} has "
                        f"{int(routing.lengths[i])}: the plan was made for another order of the batch (plan the "
                        "batch as _update_actor receives it, after _balance_batch)")


def reorder_slime_train_data(train_data: Mapping[str, Any], plans: BatchPlan | Sequence[BatchPlan], args: Any,
                             train_parallel_config: Mapping[str, int]) -> dict[str, Any]:
    """slime's ``train_data`` with every per-sample field in the order under which slime follows ``plans``.

    Call it in ``RolloutManager.generate`` (``slime/ray/rollout.py``) between
    ``data = self._convert_samples_to_train_data(data)`` and ``self._split_train_data_by_dp(data)``:
    ``rewards`` were normalized there by list position in groups of ``n_samples_per_prompt``, so reordering after
    it moves each sample's reward (and so its advantage) with the sample. Step s of the rollout (samples
    ``s * global_batch_size ..``, one sample per rollout) is reordered by ``plans[s]`` within the step, so every
    optimizer step trains on the same samples as without the hook; samples past the last whole step (which
    slime drops) keep their place. ``build_dp_schedule`` then gives dp rank g, as its micro-batch m of step s,
    the samples of micro-batch m on GPU g of ``plans[s]``.

    Args:
        train_data: the dict of per-sample lists (or arrays / tensors, first axis N) that
            ``_convert_samples_to_train_data`` returns, N = its ``len(train_data["tokens"])``.
        plans: one ``BatchPlan`` per training step of the rollout (``N // global_batch_size`` of them; a bare
            plan for one step), plan s made for the step's samples in their ``train_data`` order.
        args: slime's arguments (``self.args``); read: ``use_dynamic_batch_size``, ``balance_data``,
            ``balance_by_flops``, ``log_passrate``, ``micro_batch_size``, ``global_batch_size``.
        train_parallel_config: ``self.train_parallel_config`` (``dp_size``, ``vpp_size``,
            ``microbatch_group_size_per_vp_stage``).

    Returns:
        A new dict with the same keys, each value reordered (lists stay lists).

    Raises:
        PlanError: naming the setting or field: ``train_data`` not a dict with ``tokens`` and ``rewards`` (a
            ``Sample`` list: reordering it before the conversion changes the group-normalized rewards), a field
            whose length is not N, a repeated ``rollout_ids`` entry (slime keeps a rollout's samples together, out
            of the plan's order), ``use_dynamic_batch_size`` / ``balance_data`` / ``balance_by_flops`` (slime
            packs or assigns micro-batches by length or FLOPs), ``log_passrate`` (pass@k groups ``raw_reward`` by
            position), ``micro_batch_size`` other than the plans' b, ``global_batch_size`` other than a plan's N,
            a plan count other than the steps', micro-batches not a multiple of the VPP group; and
            ``sample_order``'s errors (unequal cells, GPUs outside ``dp_size``).
    """
    N, keys = _slime_fields(train_data)
    for key in ("use_dynamic_batch_size", "balance_data", "balance_by_flops", "log_passrate"):
        value = getattr(args, key, False) if key == "balance_by_flops" else _arg(args, key)
        if check_bool(f"args.{key}", value):
            why = {"use_dynamic_batch_size": "slime packs each step's micro-batches by token count (first fit)",
                   "balance_data": "slime assigns micro-batches to ranks by estimated FLOPs (Karmarkar-Karp)",
                   "balance_by_flops": "slime packs and assigns micro-batches by estimated FLOPs",
                   "log_passrate": "pass@k reads raw_reward in groups of n_samples_per_prompt by list position"}[key]
            raise PlanError(f"--{key.replace('_', '-')} is set: {why}, which the plan's order does not survive; "
                            "turn it off to follow the plan")
    plans = [plans] if isinstance(plans, BatchPlan) else list(plans)
    gbs = check_int("args.global_batch_size", _arg(args, "global_batch_size"), 1)
    steps = N // gbs
    if len(plans) != steps:
        raise PlanError(f"{len(plans)} plans for {steps} training steps ({N} samples, global_batch_size {gbs}): "
                        "give one plan per step")
    G = check_int("train_parallel_config['dp_size']", train_parallel_config.get("dp_size"), 1)
    mb_group = (train_parallel_config.get("microbatch_group_size_per_vp_stage", 1)
                if train_parallel_config.get("vpp_size", 1) > 1 else 1)
    order = np.arange(N, dtype=np.int64)
    for s, plan in enumerate(plans):
        if not isinstance(plan, BatchPlan):
            raise PlanError(f"plans[{s}] must be a BatchPlan, got {type(plan).__name__}")
        if plan.samples.num_samples != gbs:
            raise PlanError(f"plans[{s}] covers {plan.samples.num_samples} samples, a step has global_batch_size = "
                            f"{gbs}")
        step_order, b = _cell_size(plan, "slime", G)
        if _arg(args, "micro_batch_size") != b:
            raise PlanError(f"args.micro_batch_size={_arg(args, 'micro_batch_size')!r}, the cells of plans[{s}] hold "
                            f"{b} samples")
        if plan.num_micro_batches % mb_group:
            raise PlanError(f"plans[{s}] has {plan.num_micro_batches} micro-batches per rank, not a multiple of "
                            f"microbatch_group_size_per_vp_stage = {mb_group} (slime's VPP schedule)")
        order[s * gbs:(s + 1) * gbs] = s * gbs + step_order
    return {key: _take(train_data[key], order) for key in keys}


def _arg(args: Any, key: str) -> Any:
    if not hasattr(args, key):
        raise PlanError(f"args has no {key} (pass slime's parsed arguments, self.args)")
    return getattr(args, key)


def _slime_fields(train_data: Any) -> tuple[int, list[str]]:
    """N and the keys of slime's ``train_data``; PlanError unless every field is per-sample and rollouts are
    one sample each."""
    if not isinstance(train_data, Mapping) or "tokens" not in train_data or "rewards" not in train_data:
        got = type(train_data).__name__ if not isinstance(train_data, Mapping) else f"keys {sorted(train_data)}"
        raise PlanError(f"train_data must be the dict _convert_samples_to_train_data returns (with 'tokens' and "
                        f"'rewards'), got {got}: reordering the Sample list before the conversion changes the "
                        "group-normalized rewards")
    N = len(train_data["tokens"])
    for key, value in train_data.items():
        n = len(value) if hasattr(value, "__len__") else None
        if n != N:
            raise PlanError(f"train_data[{key!r}] has {n} entries, train_data['tokens'] has {N}: every field must "
                            "be per-sample to move with its sample")
    ids = train_data.get("rollout_ids")
    if ids is not None:
        seen: dict[Any, int] = {}
        for i, rid in enumerate(ids):
            if rid in seen:
                raise PlanError(f"train_data['rollout_ids'][{i}] = {rid!r} repeats entry {seen[rid]}: slime keeps a "
                                "rollout's samples together in one step, out of the plan's order (one sample per "
                                "rollout is needed)")
            seen[rid] = i
    return N, list(train_data)


def _take(value: Any, order: np.ndarray) -> Any:
    """``value`` reordered along its first axis: lists as lists, arrays and tensors by index."""
    if isinstance(value, (list, tuple)):
        return type(value)(value[i] for i in order)
    return value[order]
