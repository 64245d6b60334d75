"""TRL integration: :class:`ReplayGRPOTrainer`, a ``trl.GRPOTrainer`` that trains with routing replay and
ReLibra plans (``pip install 'relibra-moe[trl]'``; TRL >= 1.16).

A plain GRPO script becomes a relibra one by changing the class name (planning options are extra
keyword arguments)::

    from relibra_moe.integrations.trl import ReplayGRPOTrainer

    trainer = ReplayGRPOTrainer(model=model, reward_funcs=reward, args=GRPOConfig(...),
                                train_dataset=dataset, processing_class=tokenizer, replica_slots=2)
    trainer.train()

Launch on several ranks as any TRL script (``torchrun --nproc-per-node G train.py``, or ``accelerate launch
--multi_gpu --num_processes G train.py``: on a CPU-only machine accelerate starts one process without
``--multi_gpu``); expert parallelism spans all ranks. What the trainer does per generation batch
(docs/rl-frameworks.md, "TRL"):

1. **Swap** (once, in ``__init__``): :func:`~relibra_moe.integrations.hf.swap_moe_blocks` over the world
   (E/G experts per rank, ``replica_slots`` slots); the experts are kept out of DDP's reducer, their
   gradients scaled like DDP's average, and the accelerator's ``clip_grad_norm_`` (the ``Trainer``'s
   ``max_grad_norm`` path) clips by the global norm (:mod:`relibra_moe.layers.data_parallel`).
2. **Record** during TRL's ``generate()`` (:class:`~relibra_moe.integrations.hf.RoutingRecorder`), with
   ``synced_gpus=True`` on several ranks: the EP layers are collectives, so a rank whose sequences all
   finished keeps stepping until every rank is done (no deadlock, no ``min_new_tokens`` workaround).
   Traces are trimmed to what the training forward feeds (prompt + completion up to its EOS, TRL's
   masks); the last completion token, never fed during the rollout, is routed live (``unrouted``).
3. **Plan** on rank 0, broadcast to every rank. ``sample_owner="planner"`` (default): right after
   ``_generate`` the traces are gathered and the plan runs on a background thread while TRL computes rewards
   and log-probs; at the first micro-step the samples are exchanged (one ``all_gather_object`` of TRL's
   per-sample tensors) so each rank trains the samples the plan puts on it. ``"trainer"``: the plan is made
   once TRL has shuffled and split the batch, for TRL's own assignment (every row carries its sample index
   ``relibra_row`` through the shuffle and split).
4. **Relayout** the experts with their gradients and optimizer state to the plan's homes
   (:func:`relibra_moe.relayout`), and log what the plan did (:data:`TELEMETRY`, ``relibra/*`` in
   ``log_history``).
5. **Replay** every micro-step: :func:`relibra_moe.replay` is open from the micro-step's input
   preparation until after its backward, so activation checkpointing (TRL's default) recomputes with
   the same routing; each micro-batch's rows follow the plan's sample order. ``replay_routing`` names what
   the optimizer steps after the first of a generation batch route by (:data:`REPLAY_ROUTING`).

Checkpoints (``save_model``, the Trainer's ``_save_checkpoint``) hold every rank's experts, their optimizer
state whole in logical order, and the placement (``relibra_placement.json``); ``resume_from_checkpoint``
restores the homes, the weights and the state (docs/rl-frameworks.md, "Checkpoints and resume").

Rollouts through vLLM, transformers' continuous batching, ``rollout_func`` or tools are not recorded by
this trainer, and DeepSpeed / FSDP launches are not its layout: all are refused in ``__init__``
(``ReplayError``).
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from trl import GRPOTrainer

from ..errors import PlanError, ReplayError, TraceError
from ..layers.data_parallel import use_global_clip
from ..layers.expert_sharding import gather_optimizer_state, local_optimizer_state
from ..layers.moe import moe_layers
from ..layers.relayout import relayout
from ..layers.replay import UNROUTED, replay
from ..layers.upstream_torch import default_store
from ..plan import BatchPlan, Placement
from ..planners.service import Planner
from ..planners.strategies import plan_batch
from ..sim import simulate_step
from ..specs import ClusterSpec, ModelSpec
from ..trace import RoutingTrace, TraceBatch
from ..validate import check_choice, check_int, check_positive
from .hf import (
    RoutingRecorder,
    check_replay_trainer_args,
    checkpoint_state_dict,
    full_state_dict,
    load_full_state_dict,
    moe_blocks,
    swap_moe_blocks,
)

__all__ = ["ReplayGRPOTrainer", "model_spec"]

ROW = "relibra_row"
"""Key of the sample index every row of TRL's generation batch carries through its shuffle and split."""
PLACEMENT_FILE = "relibra_placement.json"
"""The experts' homes in a saved checkpoint: ``{"world_size": G, "expert_gpu": [L][E] ranks}``."""

SAMPLE_OWNERS = ("planner", "trainer")
"""``sample_owner``: the plan chooses every sample's rank (its samples are exchanged after generation), or TRL's
data loader does (each rank trains the samples it generated)."""
OWNER_TEXT = {"planner": "the plan puts each sample on a rank: samples exchanged after generation, planning overlapped "
                         "with rewards and log-prob forwards",
              "trainer": "samples stay on TRL's rank and micro-batch; planning waits at the first micro-step"}
REPLAY_ROUTING = ("rollout", "refresh")
"""``replay_routing``: what optimizer steps after the first of a generation batch (``num_iterations > 1`` or
``steps_per_generation > gradient_accumulation_steps``) route by: the rollout's recorded routing, or the current
policy's routing (live, as plain TRL)."""
ROUTING_TEXT = {"rollout": "every training forward replays the rollout's routing (also after the policy moved)",
                "refresh": "the first optimizer step of a generation batch replays the rollout's routing, later ones "
                           "route live by the current policy"}
BASELINES = ("static", "eplb", "online")
"""The baselines the telemetry prices each plan against (``online`` only with replica slots)."""
TELEMETRY = {
    "experts_moved": "(layer, expert) pairs whose home the relayout changed this generation batch",
    "experts_proposed": "moves the planner's annealed homes proposed (before its migration pricing kept some layers)",
    "replicas": "replica slots the plan filled (over micro-batches, layers and ranks)",
    "step_s": "the plan's modelled step (simulator, planner's model and cluster), seconds",
    "static_step_s": "the static layout's modelled step, seconds",
    "speedup_vs_static": "static_step_s / step_s",
    "best_baseline_step_s": "the fastest baseline's (static, eplb, online) modelled step, seconds",
    "speedup_vs_best_baseline": "best_baseline_step_s / step_s",
    "planning_s": "wall seconds from the planner's start to its plan (rank 0)",
    "planning_wait_s": "wall seconds the first micro-step waited for the plan",
    "planning_hidden": "1 when the plan was ready before the first micro-step needed it (overlapped), else 0",
    "fallbacks": "planner cells that fell back (deadline, dead worker)",
}
"""``log_history`` fields (``relibra/<name>``, one value per generation batch, averaged per logging step)."""

logger = logging.getLogger(__name__)


def model_spec(model: nn.Module, name: str = "") -> ModelSpec:
    """The :class:`~relibra_moe.specs.ModelSpec` of a swapped HF model, for the planner's cost model: its config
    read by :meth:`ModelSpec.from_hf_config` (every family's keys, shared experts included), with the bytes per
    element of the experts the model holds. ValueError when the config's MoE layer count differs from the
    swapped blocks'."""
    blocks = [b for _, _, b in moe_blocks(model)]
    dtype = blocks[0].experts.expert_tensors()[0].dtype
    spec = ModelSpec.from_hf_config(model.config, name=name or f"hf:{type(model).__name__}",
                                    dtype_bytes=torch.empty((), dtype=dtype).element_size())
    if spec.num_layers != len(blocks):
        raise ValueError(f"{type(model).__name__}: its config has {spec.num_layers} MoE layers, the model "
                         f"{len(blocks)} swapped MoE blocks")
    return spec


@contextlib.contextmanager
def _synced_generate(model: nn.Module, on: bool) -> Iterator[None]:
    """Within the block, ``model.generate`` runs with ``synced_gpus=True`` (this instance only)."""
    if not on:
        yield
        return
    with _patched(model, "generate", functools.partial(model.generate, synced_gpus=True)):
        yield


@contextlib.contextmanager
def _patched(obj: Any, name: str, fn: Callable) -> Iterator[None]:
    """Within the block, ``obj.name`` is ``fn`` (an instance attribute; the class's method afterwards)."""
    had = name in vars(obj)  # an instance attribute before: put it back; else delete ours (the class's shows again)
    previous = vars(obj).get(name)
    setattr(obj, name, fn)
    try:
        yield
    finally:
        if had:
            setattr(obj, name, previous)
        else:
            delattr(obj, name)


def _read_safetensors(checkpoint: str) -> dict[str, torch.Tensor] | None:
    """Every tensor of a ``save_pretrained`` checkpoint's safetensors file(s) (on the CPU); None without any."""
    from safetensors.torch import load_file

    folder = Path(checkpoint)
    if (folder / "model.safetensors").is_file():
        return load_file(str(folder / "model.safetensors"), device="cpu")
    index = folder / "model.safetensors.index.json"
    if not index.is_file():
        return None
    out: dict[str, torch.Tensor] = {}
    for name in sorted(set(json.loads(index.read_text())["weight_map"].values())):
        out.update(load_file(str(folder / name), device="cpu"))
    return out


def _rows_of(batch: dict[str, Any]) -> int:
    return int(batch[ROW].shape[0])


def _is_row_tensor(value: Any, rows: int) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() >= 1 and value.shape[0] == rows


def _concat_micro_batches(batches: list[dict[str, Any]]) -> dict[str, Any]:
    """One rank's TRL micro-batches back as one dict: per-row tensors concatenated (the micro-batches of one
    generation batch share their widths), everything else (``num_items_in_batch``, ...) from the first."""
    rows = _rows_of(batches[0])
    return {k: (torch.cat([b[k] for b in batches]) if _is_row_tensor(v, rows) else v) for k, v in batches[0].items()}


def _pad_width(t: torch.Tensor, width: int, left: bool, value: int) -> torch.Tensor:
    """``t [B, W, ...]`` padded with ``value`` to ``[B, width, ...]`` on the left or the right of dim 1."""
    if t.shape[1] == width:
        return t
    out = t.new_full((t.shape[0], width) + tuple(t.shape[2:]), value)
    if left:
        out[:, width - t.shape[1]:] = t
    else:
        out[:, :t.shape[1]] = t
    return out


def _stack_parts(parts: list[dict[str, Any]], pad_id: int) -> dict[str, torch.Tensor]:
    """Every rank's generation batch (``parts[g]``) as one: each per-row tensor concatenated in rank order, token
    tensors ``[B, W, ...]`` padded to the widest rank's ``W`` (``prompt_*`` on the left, the rest on the right;
    ``*_ids`` with the pad token, the rest with 0). A per-row entry that is not a tensor is refused by name."""
    rows = _rows_of(parts[0])
    out = {}
    for key, value in parts[0].items():
        if isinstance(value, (list, tuple)) and len(value) == rows:
            raise ReplayError(f"ReplayGRPOTrainer: the generation batch's {key!r} is a per-sample "
                              f"{type(value).__name__}; sample_owner='planner' exchanges tensors only (use "
                              "sample_owner='trainer')")
        if not _is_row_tensor(value, rows):
            continue
        ts = [p[key] for p in parts]
        if value.dim() >= 2:
            width = max(int(t.shape[1]) for t in ts)
            ts = [_pad_width(t, width, key.startswith("prompt"), pad_id if key.endswith("_ids") else 0) for t in ts]
        out[key] = torch.cat(ts)
    return out


class ReplayGRPOTrainer(GRPOTrainer):
    """``trl.GRPOTrainer`` with routing replay, ReLibra plans and expert parallelism over all ranks (see
    the module docstring for what it does).

    Args:
        *args, **kwargs: every ``GRPOTrainer`` argument, unchanged. The model must be a supported HF MoE
            model (``relibra_moe.integrations.hf.SUPPORTED_BLOCKS``, layer families).
        replica_slots: r replica slots per rank (the plan's replicas); 0: placement only.
        strategy: the planning strategy (``relibra_moe.planners.strategies.STRATEGIES``).
        gpus_per_node: ranks per node (replicas stay inside a node); default: all ranks are one node.
        cluster: the :class:`~relibra_moe.specs.ClusterSpec` the planner prices (default: ``nodes x
            gpus_per_node`` with the default link and FLOP figures).
        planner: a ready :class:`~relibra_moe.planners.service.Planner` (its ``sample_owner`` option decides the
            mode; ``"planner"`` needs ``keep_cell_sizes=True``); default: one with ``strategy``, ``replica_slots``,
            one inline worker, the run's seed, ``sample_owner`` and ``planner_options``.
        planner_options: further :class:`~relibra_moe.planners.options.PlanOptions` fields for the default
            planner (e.g. ``{"migration": False}``).
        unrouted: what a token the rollout never routed gets in the training forward (``"live"``: routed
            live, the plain model's math; ``"none"``: no expert; ``"error"``).
        save_timeout_s: seconds a save waits for every rank to call it before ``ReplayError`` (a save called
            on some ranks only fails by name instead of hanging in the experts' gather).
        sample_owner: ``"planner"`` (the plan places every sample; samples exchanged after generation, planning
            overlapped) or ``"trainer"`` (TRL's placement kept): :data:`SAMPLE_OWNERS`.
        replay_routing: ``"rollout"`` or ``"refresh"``: :data:`REPLAY_ROUTING`.

    Attributes:
        recorder: the :class:`~relibra_moe.integrations.hf.RoutingRecorder` of the rollouts.
        last_batch: the :class:`~relibra_moe.trace.TraceBatch` of the last generation batch (all ranks'
            samples, sample ``n`` = row ``n % N_local`` of rank ``n // N_local``, ``micro_batch`` = TRL's
            micro-step of the sample).
        last_plan: its :class:`~relibra_moe.plan.BatchPlan` (``None`` on one rank: replay without a plan).
    """

    def __init__(self, *args: Any, replica_slots: int = 2, strategy: str = "relibra", gpus_per_node: int | None = None,
                 cluster: ClusterSpec | None = None, planner: Planner | None = None,
                 planner_options: dict[str, Any] | None = None, unrouted: str = "live", save_timeout_s: float = 60.0,
                 sample_owner: str = "planner", replay_routing: str = "rollout", **kwargs: Any) -> None:
        check_replay_trainer_args(args[0] if args else kwargs.get("model"), strategy=strategy,
                                  replica_slots=replica_slots, planner=planner, planner_options=planner_options,
                                  gpus_per_node=gpus_per_node, cluster=cluster)
        if unrouted not in UNROUTED:  # checked before TRL loads anything
            raise ReplayError(f"ReplayGRPOTrainer: unrouted={unrouted!r} is not one of {UNROUTED}")
        check_int("ReplayGRPOTrainer: replica_slots", replica_slots, error=ReplayError)
        check_positive("ReplayGRPOTrainer: save_timeout_s", save_timeout_s, error=ReplayError)
        check_choice("ReplayGRPOTrainer: sample_owner", sample_owner, SAMPLE_OWNERS, error=ReplayError)
        check_choice("ReplayGRPOTrainer: replay_routing", replay_routing, REPLAY_ROUTING, error=ReplayError)
        self.replay_routing = replay_routing
        self.save_timeout_s = float(save_timeout_s)
        self._save_calls = 0
        super().__init__(*args, **kwargs)
        refused = [name for name, on in (("use_vllm", self.use_vllm),
                                         ("use_transformers_continuous_batching",
                                          self.use_transformers_continuous_batching),
                                         ("rollout_func", self.rollout_func is not None),
                                         ("tools", bool(self.tools)),
                                         ("DeepSpeed", bool(getattr(self, "is_deepspeed_enabled", False))),
                                         ("FSDP", bool(getattr(self, "is_fsdp_enabled", False)))) if on]
        if refused:
            raise ReplayError(f"ReplayGRPOTrainer records routing during transformers generate() and runs expert "
                              f"parallelism under DDP; {refused[0]} is not supported by it (use GRPOTrainer with "
                              "relibra_moe.replay by hand, or docs/fsdp.md for FSDP2)")
        self.unrouted = unrouted
        self.world = int(self.accelerator.num_processes)
        self.rank = int(self.accelerator.process_index)
        swap_moe_blocks(self.model, replica_slots=replica_slots if self.world > 1 else 0,
                        gpus_per_node=gpus_per_node)
        if self.world > 1:
            use_global_clip(self.accelerator, self.model)
            if planner is None:
                per_node = self.world if gpus_per_node is None else int(gpus_per_node)
                cluster = cluster or ClusterSpec(nodes=self.world // per_node, gpus_per_node=per_node)
                owned = {"keep_cell_sizes": True} if sample_owner == "planner" else {}  # TRL's fixed micro-batch size
                planner = Planner(model_spec(self.model), cluster, strategy=strategy, replica_slots=replica_slots,
                                  workers=1, executor="inline", seed=int(self.args.seed), sample_owner=sample_owner,
                                  **{**owned, **(planner_options or {})})
        self.planner = planner
        self.sample_owner = planner.options.sample_owner if planner is not None else sample_owner
        if planner is not None and self.sample_owner == "planner" and not planner.options.keep_cell_sizes:
            raise ReplayError("ReplayGRPOTrainer: a planner with sample_owner='planner' needs keep_cell_sizes=True "
                              "(TRL trains per_device_train_batch_size samples per rank and micro-step)")
        self.recorder = RoutingRecorder(self.model, source="trl")
        self.last_batch: TraceBatch | None = None
        self.last_plan: BatchPlan | None = None
        self._local_traces: list[RoutingTrace] | None = None
        self._new_generation = False
        self._replay = contextlib.ExitStack()
        self._plan_future: Future | None = None
        self._plan_thread: ThreadPoolExecutor | None = None
        self._rollout_lengths: np.ndarray | None = None
        self._generation_step = 0
        if self.accelerator.is_main_process:
            print(self.describe(), flush=True)

    def describe(self) -> str:
        """One line: what relibra does in this run (printed by the main process at construction)."""
        if self.world == 1:
            return ("relibra: 1 rank, all experts local: routing replay only (no plan, no expert parallelism); "
                    f"{ROUTING_TEXT[self.replay_routing]}")
        E = moe_layers(self.model)[0].num_experts
        return (f"relibra: expert parallelism over {self.world} ranks ({E // self.world} of {E} experts each), "
                f"strategy={self.planner.strategy!r}, replica_slots={self.planner.replica_slots}, "
                f"sample_owner={self.sample_owner!r} ({OWNER_TEXT[self.sample_owner]}); "
                f"{ROUTING_TEXT[self.replay_routing]}; per-step plan telemetry in log_history as relibra/*")

    # ---------------------------------------------------------------------------------- rollout
    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        """TRL's generation, recorded, with ``synced_gpus=True`` on several ranks."""
        if not self.model.training:  # evaluation: nothing to replay, but the EP layers still need every rank
            with _synced_generate(self.model, self.world > 1):
                return super()._generate_single_turn(prompt_ids, images, multimodal_fields, num_generations,
                                                     has_tool_images)
        self.recorder.clear()
        with self.recorder, _synced_generate(self.model, self.world > 1):
            out = super()._generate_single_turn(prompt_ids, images, multimodal_fields, num_generations,
                                                has_tool_images)
        return out

    def _generate(self, prompts: list):
        """TRL's rollout; with ``sample_owner="planner"`` on several ranks the traces are gathered right after it
        and rank 0 starts planning on a background thread, while TRL computes rewards and log-probs."""
        out = super()._generate(prompts)
        if self.model.training and self.world > 1 and self.sample_owner == "planner":
            prompt_ids, completion_ids = out[0], out[1]
            keep = [len(c) if not self.mask_truncated_completions or (c and c[-1] in self._eos_and_pad()) else 0
                    for c in completion_ids]  # TRL's completion_mask: a truncated completion masked entirely
            self._rollout_lengths = np.asarray([len(p) + k for p, k in zip(prompt_ids, keep)], dtype=np.int64)
            self._start_planning(self.recorder.traces(lengths=self._rollout_lengths))
        return out

    def _eos_and_pad(self) -> list[int]:
        return [*self.eos_token_ids, self._tokenizer.pad_token_id]

    def _generate_and_score_completions(self, inputs):
        """TRL's batch, plus each row's sample index (``relibra_row``) and this rank's trimmed traces."""
        out = super()._generate_and_score_completions(inputs)
        if not self.model.training:
            return out
        lengths = (out["prompt_mask"].sum(1) + out["completion_mask"].sum(1)).cpu().numpy()
        if self._rollout_lengths is not None and not np.array_equal(lengths, self._rollout_lengths):
            raise ReplayError(f"ReplayGRPOTrainer: the traces planned after generation have lengths "
                              f"{self._rollout_lengths.tolist()}, TRL's masks feed {lengths.tolist()}")
        traces = self.recorder.traces(lengths=lengths)
        if len(traces) != len(lengths):
            raise ReplayError(f"ReplayGRPOTrainer: recorded {len(traces)} sequences for {len(lengths)} rows")
        n = len(traces)
        out[ROW] = torch.arange(n, device=out["prompt_ids"].device) + self.rank * n
        self._local_traces = traces
        self._rollout_lengths = None
        self._new_generation = True
        return out

    # ---------------------------------------------------------------------------------- training
    def _prepare_inputs(self, generation_batch):
        """TRL's micro-batch, its rows in the plan's sample order, with :func:`relibra_moe.replay` opened
        for it (closed by :meth:`training_step` after the backward)."""
        inputs = super()._prepare_inputs(generation_batch)
        if not self.model.training:
            return inputs
        m = self._step % self.args.steps_per_generation
        if self._new_generation:
            self._new_generation = False
            self._generation_step = self._step
            self._plan_generation()
            inputs = self._buffered_inputs[m]
        rows = inputs[ROW]
        order = torch.argsort(rows)
        B = int(rows.shape[0])
        inputs = {k: (v[order] if isinstance(v, torch.Tensor) and v.dim() >= 1 and v.shape[0] == B else v)
                  for k, v in inputs.items()}
        self._replay.close()
        if self.replay_routing == "refresh" and ((self._step - self._generation_step)
                                                 // self.current_gradient_accumulation_steps) > 0:
            return inputs  # the policy moved since the rollout: route live (TRL's own forward)
        mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
        selected = self._replay.enter_context(replay(self.model, self.last_batch, self.last_plan, micro_batch=m,
                                                     attention_mask=mask, rank=self.rank if self.last_plan else None,
                                                     unrouted=self.unrouted))
        want = inputs[ROW].cpu().tolist()
        if selected != want:
            self._replay.close()
            raise ReplayError(f"ReplayGRPOTrainer: micro-step {m} holds samples {want}, the plan runs {selected} "
                              "on this rank")
        return inputs

    def training_step(self, model, inputs, num_items_in_batch=None):
        """TRL's micro-step (generation when due, forward, backward) with replay open until its end."""
        try:
            return super().training_step(model, inputs, num_items_in_batch)
        finally:
            self._replay.close()

    # ---------------------------------------------------------------------------------- saving
    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """TRL's / the Trainer's save, with the whole experts and the placement: every rank gathers the full HF
        state dict (:func:`~relibra_moe.integrations.hf.full_state_dict`, a collective), the main process
        writes it (it loads into the plain HF class) and ``relibra_placement.json`` (the current homes).

        Every rank must call it. The ranks meet first (``save_timeout_s``): a call on some ranks only raises
        ``ReplayError`` on those ranks, naming the missing ones, instead of waiting in the gather."""
        self._save_rendezvous("save_model")
        self._full_state = full_state_dict(self.model)
        try:
            super().save_model(output_dir, _internal_call)
        finally:
            self._full_state = None
        if self.args.should_save:
            self._write_placement(output_dir if output_dir is not None else self.args.output_dir)

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        if state_dict is None and getattr(self, "_full_state", None) is not None:
            state_dict = self._full_state
        super()._save(output_dir, state_dict)

    def _save_rendezvous(self, what: str) -> None:
        """Meet every rank before a save's collectives, through the process group's store (no collective, so
        a missing rank cannot desynchronize one): ``ReplayError`` after ``save_timeout_s`` without them."""
        if self.world == 1:
            return
        from datetime import timedelta

        store = default_store()
        key = f"relibra/save/{self._save_calls}/".__add__
        store.set(key(str(self.rank)), what)
        try:
            store.wait([key(str(r)) for r in range(self.world)], timedelta(seconds=self.save_timeout_s))
        except RuntimeError:
            missing = [r for r in range(self.world) if not store.check([key(str(r))])]
            store.delete_key(key(str(self.rank)))  # a rank arriving later waits for a matching call again
            raise ReplayError(f"ReplayGRPOTrainer.{what}: ranks {missing} did not call it within save_timeout_s="
                              f"{self.save_timeout_s:g} s; every rank must call {what} (each holds only its home "
                              "experts, gathered into the checkpoint)") from None
        self._save_calls += 1

    def _write_placement(self, output_dir: str) -> None:
        homes = [np.asarray(layer.expert_gpu_host, np.int64).tolist() for layer in moe_layers(self.model)]
        Path(output_dir).mkdir(parents=True, exist_ok=True)
        Path(output_dir, PLACEMENT_FILE).write_text(json.dumps({"world_size": self.world, "expert_gpu": homes}))

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        """The Trainer's ``optimizer.pt`` with every expert's state whole ``[E, ...]`` in logical order
        (:func:`~relibra_moe.layers.expert_sharding.gather_optimizer_state`, a collective): the plain model's
        optimizer state, whatever the homes and the EP size."""
        self._save_rendezvous("_save_optimizer_and_scheduler")
        whole = gather_optimizer_state(self.model, self.optimizer)
        with _patched(self.optimizer, "state_dict", lambda: whole):
            super()._save_optimizer_and_scheduler(output_dir)

    # ---------------------------------------------------------------------------------- resuming
    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: nn.Module | None = None) -> None:
        """Resume: restore the saved homes (``relibra_placement.json``, same EP size; another EP size keeps
        the static homes), then load the whole HF checkpoint, each rank taking its home experts' rows
        (:func:`~relibra_moe.integrations.hf.load_full_state_dict`: the swapped blocks load their own
        weights, which the Trainer's plain ``load_state_dict`` of the converted file misses)."""
        model = self.model if model is None else model
        self._restore_placement(resume_from_checkpoint, model)
        saved = _read_safetensors(resume_from_checkpoint)
        if saved is None:  # not a safetensors checkpoint: the Trainer's own loader and its messages
            return super()._load_from_checkpoint(resume_from_checkpoint, model)
        result = load_full_state_dict(model, checkpoint_state_dict(model, saved), strict=False)
        self._issue_warnings_after_load(result)

    def _restore_placement(self, checkpoint: str, model: nn.Module) -> None:
        path = Path(checkpoint, PLACEMENT_FILE)
        layers = moe_layers(model)
        if not path.is_file() or not layers:
            return
        saved = json.loads(path.read_text())
        grid = np.asarray(saved.get("expert_gpu"), dtype=np.int64)
        E = layers[0].num_experts
        if grid.shape != (len(layers), E):
            raise ReplayError(f"{path}: expert_gpu has shape {grid.shape}, the model has {len(layers)} MoE layers of "
                              f"{E} experts")
        if int(saved.get("world_size", -1)) != self.world:
            logger.warning(f"{path}: saved on {saved.get('world_size')} ranks, resumed on {self.world}: the experts "
                           "keep the static homes (weights and optimizer state load by logical expert)")
            return
        if self.world > 1:
            relayout(model, grid)  # a collective; before any expert is read, so each rank reads its saved homes
            if self.rank == 0 and self.planner is not None:
                self.planner.previous = Placement(grid)  # moves of the next plan are priced from these homes

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        """The Trainer's load of ``optimizer.pt``, each expert parameter's whole state cut to this rank's homes
        (:func:`~relibra_moe.layers.expert_sharding.local_optimizer_state`)."""
        if checkpoint is None or self.optimizer is None:
            return super()._load_optimizer_and_scheduler(checkpoint)
        load = self.optimizer.load_state_dict
        with _patched(self.optimizer, "load_state_dict",
                      lambda sd: load(local_optimizer_state(self.model, self.optimizer, sd))):
            super()._load_optimizer_and_scheduler(checkpoint)

    def _start_planning(self, local: list[RoutingTrace]) -> None:
        """Gather every rank's traces (a collective) and start the plan on rank 0's background thread
        (``sample_owner="planner"``: micro-batch ``m`` holds each rank's local rows ``m*B .. (m+1)*B - 1``,
        ``B = per_device_train_batch_size``, and the plan chooses each sample's rank)."""
        B = int(self.args.per_device_train_batch_size)
        micro = (np.arange(len(local)) // B).astype(np.int64)
        batch, _ = self._gather_batch(local, micro)
        if self.rank == 0:
            if self._plan_thread is None:
                self._plan_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="relibra-trl-plan")
            self._plan_future = self._plan_thread.submit(self._plan_job, batch, None)
        self.last_batch = batch

    def _gather_batch(self, local: list[RoutingTrace], micro: np.ndarray) -> tuple[TraceBatch, np.ndarray]:
        """All ranks' traces as one TraceBatch (sample ``n`` = row ``n % N_local`` of rank ``n // N_local``) and
        each sample's generating rank; a collective."""
        parts: list[Any] = [None] * self.world
        dist.all_gather_object(parts, (local, micro))
        traces = [t for part in parts for t in part[0]]
        micro_batch = np.concatenate([part[1] for part in parts]).astype(np.int32)
        return TraceBatch(traces, micro_batch, source="trl"), np.repeat(np.arange(self.world),
                                                                        [len(part[0]) for part in parts])

    def _plan_job(self, batch: TraceBatch, sample_gpu: np.ndarray | None) -> tuple[BatchPlan, dict[str, float]]:
        """Plan and price one batch (rank 0; on the background thread when overlapped)."""
        t0 = time.perf_counter()
        plan = self.planner.plan(batch, sample_gpu=sample_gpu)
        return plan, self._plan_telemetry(batch, plan, sample_gpu, time.perf_counter() - t0)

    def _plan_generation(self) -> None:
        """Get the plan (rank 0's, broadcast), relayout, and with ``sample_owner="planner"`` exchange the samples
        so each rank's micro-batches are the plan's; with ``"trainer"`` plan here for TRL's own split."""
        local = self._local_traces
        n = len(local)
        if self.world == 1:
            micro = np.full(n, -1, dtype=np.int64)
            for m, mb in enumerate(self._buffered_inputs):
                micro[mb[ROW].cpu().numpy()] = m
            self.last_batch = TraceBatch(local, micro.astype(np.int32), source="trl")
            self.last_plan = None
            return
        box: list[Any] = [None]
        t0 = time.perf_counter()
        if self.sample_owner == "trainer":
            micro = np.full(n, -1, dtype=np.int64)
            for m, mb in enumerate(self._buffered_inputs):
                micro[mb[ROW].cpu().numpy() - self.rank * n] = m
            if (micro < 0).any():
                raise ReplayError(f"ReplayGRPOTrainer: samples {np.flatnonzero(micro < 0).tolist()} of rank "
                                  f"{self.rank} are in no micro-batch of TRL's split")
            self.last_batch, sample_gpu = self._gather_batch(local, micro)
        if self.rank == 0:
            hidden = self._plan_future is not None and self._plan_future.done()
            try:
                future, self._plan_future = self._plan_future, None
                box[0] = future.result() if future is not None else self._plan_job(self.last_batch, sample_gpu)
                box[0][1]["planning_wait_s"] = 0.0 if hidden else time.perf_counter() - t0
                box[0][1]["planning_hidden"] = float(hidden)
            except (PlanError, TraceError) as exc:  # every rank raises, none waits in the broadcast
                box[0] = exc.with_traceback(None)
            except Exception as exc:  # noqa: BLE001 - a bug in planning must not leave the other ranks waiting
                box[0] = ReplayError(f"ReplayGRPOTrainer: planning failed on rank 0: {type(exc).__name__}: {exc}")
        dist.broadcast_object_list(box, src=0)
        if isinstance(box[0], Exception):
            raise box[0]
        plan, telemetry = box[0]
        optimizer = getattr(self.optimizer, "optimizer", self.optimizer)
        moved = relayout(self.model, plan.placement, optimizer)["experts_moved"]
        self.last_plan = plan
        if self.sample_owner == "planner":
            self._buffered_inputs = self._exchange_samples(plan)
        self._log_telemetry({**telemetry, "experts_moved": float(moved)})

    def _exchange_samples(self, plan: BatchPlan) -> list[dict[str, Any]]:
        """Every rank's generation batch to every rank (one ``all_gather_object`` of TRL's per-sample tensors, on
        the CPU), then this rank's micro-batches as the plan places them: micro-batch ``m`` = the samples with
        ``plan.samples.micro_batch == m`` and ``gpu == rank``, ascending. Token tensors are padded to the widest
        rank's width (prompts on the left, everything else on the right, as TRL pads)."""
        local = _concat_micro_batches(self._buffered_inputs)
        parts: list[Any] = [None] * self.world
        dist.all_gather_object(parts, {k: (v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in local.items()})
        whole = _stack_parts(parts, self._tokenizer.pad_token_id)
        device = self.accelerator.device
        pos = {int(r): i for i, r in enumerate(whole[ROW].tolist())}
        out = []
        for m in range(plan.num_micro_batches):
            mine = np.flatnonzero((plan.samples.micro_batch == m) & (plan.samples.gpu == self.rank))
            idx = torch.as_tensor([pos[int(n)] for n in mine], dtype=torch.long)
            out.append({k: (whole[k][idx].to(device) if k in whole else v) for k, v in local.items()})
        return out

    def _plan_telemetry(self, batch: TraceBatch, plan: BatchPlan, sample_gpu: np.ndarray | None,
                        planning_s: float) -> dict[str, float]:
        """What the plan does, for ``log_history`` (rank 0; see :data:`TELEMETRY`). The modelled steps are the
        simulator's (:func:`relibra_moe.sim.simulate_step`, the planner's model and cluster), every plan priced
        from the current homes; the baselines are planned for the same samples."""
        spec, cluster = self.planner.model, self.planner.cluster
        previous = Placement(np.stack([layer.expert_gpu_host for layer in moe_layers(self.model)]))
        step = simulate_step(plan, batch, spec, cluster, previous=previous).step_s
        owner = {} if sample_gpu is None else {"sample_owner": "trainer", "sample_gpu": sample_gpu}
        slots = self.planner.replica_slots
        baselines = {}
        for name in BASELINES:
            if name == "online" and not slots:
                continue
            base = plan_batch(batch, spec, cluster, name, replica_slots=slots if name == "online" else 0,
                              seed=self.planner.seed, **owner)
            baselines[name] = simulate_step(base, batch, spec, cluster,
                                            previous=None if name == "static" else previous).step_s
        best = min(baselines.values())
        migration = plan.stats.migration
        moved = int((plan.placement.expert_gpu != previous.expert_gpu).sum())
        if migration is not None and migration.moved_after_relabel is not None:
            moved = migration.moved_after_relabel
        return {"experts_proposed": float(moved),
                "replicas": float((plan.replicas.replica_expert >= 0).sum()),
                "step_s": step, "static_step_s": baselines["static"], "speedup_vs_static": baselines["static"] / step,
                "best_baseline_step_s": best, "speedup_vs_best_baseline": best / step,
                "planning_s": planning_s,
                "fallbacks": float(plan.stats.fallbacks or 0)}

    def _log_telemetry(self, telemetry: dict[str, float]) -> None:
        """Append each field to TRL's metrics (averaged per logging step into ``log_history`` as ``relibra/<field>``,
        and from there to W&B / TensorBoard through the Trainer's callbacks)."""
        for key, value in telemetry.items():
            self._metrics["train"][f"relibra/{key}"].append(float(value))
