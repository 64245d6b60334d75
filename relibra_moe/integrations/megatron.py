"""Megatron-core integration: relibra plans driving Megatron's MoE layers and its ``RouterReplay``.

verl, slime, NeMo-RL and SkyRL train MoE policies on Megatron-core and pin the routing with its
``RouterReplay`` (``megatron.core.transformer.moe.router_replay``). This module lets such a training loop
follow a relibra :class:`~relibra_moe.plan.BatchPlan` (``pip install relibra-moe[megatron]``; see
``docs/megatron.md``)::

    from relibra_moe.integrations import megatron as rm

    rm.swap_moe_layers(model, replica_slots=2, gpus_per_node=8)   # once, after building the model
    rm.relayout(model, plan, optimizer)                           # once per global batch
    for m in range(plan.num_micro_batches):                       # every micro-batch
        samples, ids = rm.replay_data(batch, plan, m)              # this rank's samples, in plan order
        rm.replay_micro_batch(model, ids, plan=plan, micro_batch=m)
        loss = loss_fn(model(*packed_inputs(samples)))
        loss.backward()

Capture: :class:`MegatronRoutingRecorder` turns ``RouterReplay`` recordings (per rank, per micro-batch)
into a :class:`~relibra_moe.trace.TraceBatch`; :func:`replay_data` is the inverse (a ``TraceBatch`` and a
``BatchPlan`` -> this rank's per-layer ``[T, k]`` ids of one micro-batch, in the plan's sample placement).

Execution: :class:`MegatronReplayMoE` is a Megatron ``MoELayer`` (so ``TransformerLayer`` treats it as MoE)
that keeps Megatron's router (its aux losses, expert bias, z-loss), shared experts and process groups,
and runs the routed experts through a :class:`~relibra_moe.layers.moe.ReplayBalancedMoE`: experts homed
where the plan's ``Placement`` says (Megatron's contiguous ``E / EP`` blocks become a permutation),
replica slots and token splits of each micro-batch, relibra's dispatch and grouped-GEMM kernels.

Recompute. Megatron replays through ``RouterReplay`` actions and never switches them itself; with
activation recompute a forward replayed with ``REPLAY_FORWARD`` and recomputed in backward with the same
action silently uses the wrong ids. :class:`MegatronReplayMoE` sets the action of its router on every
forward: ``REPLAY_FORWARD`` for a forward, ``REPLAY_BACKWARD`` for a forward recomputed inside backward
(which pops Megatron's per-router list in forward order), and replays the same micro-batch's plan slice
in the recomputed forward. Recompute is correct by construction whatever the schedule.

Token order. Megatron's MoE input is ``[S, B, H]`` and its router flattens it to ``S * B`` rows
(``s * B + b``). :func:`replay_data` and :meth:`MegatronRoutingRecorder.record` take a ``layout``:
``"packed"`` (the micro-batch's samples concatenated in ascending sample order: one packed sequence,
``B = 1``) or ``"sbh"`` (samples of one length fed as a ``[B, S]`` batch).

Limits: no tensor, expert-tensor or pipeline parallelism (data and expert parallelism), SwiGLU experts without
biases (``gated_linear_unit=True``, ``activation_func=silu``, ``add_bias_linear=False``), no token dropping
(``moe_expert_capacity_factor=None``), no latent MoE projections, no shared-expert overlap. The swapped
layer's expert parameters are relibra's stacked ``w_gate_up [E_loc, H, 2F]`` / ``w_down [E_loc, F, H]``
(``expert_state_dict`` gives them back in Megatron's ``SequentialMLP`` names and layout).

Checkpoints. :meth:`MegatronReplayMoE.sharded_state_dict` gives Megatron's ``dist_checkpointing`` the plain
``SequentialMLP`` keys and layout, every home expert at the offset of its logical id
(:mod:`relibra_moe.layers.expert_sharding`): every expert is saved once, in any placement, and loads into
any EP size, relibra or plain Megatron; Megatron's ``FP32Optimizer`` saves the experts' state alike.
"""

from __future__ import annotations

import collections
import functools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from ..adapters import from_megatron
from ..errors import PlanError, ReplayError
from ..layers.expert_sharding import ExpertShard, expert_shards
from ..layers.experts import GroupedSwiGLUExperts
from ..layers.moe import ReplayBalancedMoE
from ..layers.relayout import relayout as _relayout_layers
from ..layers.replay import LayerReplay, build_ahead, replay, scheduled_states, take_ahead
from ..layers.replica_buffer import LayerSharedReplicaBuffer
from ..layers.router import RouterOutput, check_replay_ids
from ..plan import BatchPlan, Placement, check_replica_slots
from ..trace import TraceBatch
from ..validate import check_int, is_int
from .adopted import deprecated_names
from .upstream_megatron import adopt_layer_attributes

try:  # optional dependency: megatron-core
    from megatron.core.tensor_parallel.random import checkpoint as _mcore_checkpoint
    from megatron.core.tensor_parallel.random import is_checkpointing
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    HAVE_MEGATRON = True
except Exception:  # noqa: BLE001 - any import failure means "not available"
    MoELayer = nn.Module  # type: ignore[misc,assignment]
    HAVE_MEGATRON = False

LAYOUTS = ("packed", "sbh")
#: Megatron optimizer wrappers relayout refuses by name: they step separate fp32 main copies of the parameters
_MAIN_COPY_OPTIMIZERS = {"DistributedOptimizer": "sharded over the data-parallel ranks in flat buffers",
                         "Float16OptimizerWithFloat16Params": "one fp32 copy per bf16/fp16 parameter"}
_MAIN_GRAD_KEY = "relibra_megatron_main_grad"  # where relayout carries Megatron DDP's main_grad (removed after)

__all__ = ["HAVE_MEGATRON", "LAYOUTS", "MegatronReplayMoE", "MegatronRoutingRecorder", "check_config",
           "expert_state_dict", "megatron_moe_layers", "relayout", "replay_data", "replay_layer_spec",
           "replay_micro_batch", "stop_replay", "swap_moe_layers"]


def _require_megatron() -> None:
    if not HAVE_MEGATRON:
        raise ImportError("relibra_moe.integrations.megatron needs megatron-core: pip install 'relibra-moe[megatron]'")


def _in_backward() -> bool:
    """True while the autograd engine runs a backward on this thread (a recomputed forward runs there)."""
    return torch._C._current_graph_task_id() != -1


# ---------------------------------------------------------------------------------------------- config


def check_config(config) -> None:
    """Raise for a Megatron ``TransformerConfig`` the relibra layer cannot follow, naming the setting.

    ``ReplayError``: ``moe_router_fusion=True`` (the fused top-k bypasses ``RouterReplay``: replayed ids
    would be ignored), ``moe_enable_routing_replay=False`` (the routers have no ``RouterReplay``).
    ``ValueError``: token dropping, latent projections, shared-expert overlap, tensor, expert-tensor or
    pipeline parallelism, experts other than bias-free SwiGLU.
    """
    if getattr(config, "moe_router_fusion", False):
        raise ReplayError("moe_router_fusion=True: Megatron's fused top-k router bypasses RouterReplay, so replayed "
                          "routing would be silently ignored; set moe_router_fusion=False")
    if not getattr(config, "moe_enable_routing_replay", False):
        raise ReplayError("moe_enable_routing_replay=False: the routers have no RouterReplay to record or replay "
                          "with; set moe_enable_routing_replay=True")
    checks = (
        ("moe_expert_capacity_factor", None, "token dropping is not supported (relibra never drops a token)"),
        ("moe_latent_size", None, "latent MoE projections are not supported"),
        ("moe_shared_expert_overlap", False, "the overlap runs inside Megatron's token dispatcher, which the relibra "
                                             "layer replaces"),
        ("gated_linear_unit", True, "relibra's experts are SwiGLU"),
        ("add_bias_linear", False, "relibra's SwiGLU experts have no biases"),
        ("expert_tensor_parallel_size", 1, "expert tensor parallelism is not supported"),
        ("tensor_model_parallel_size", 1, "the layer runs on the expert-parallel group only (no tensor parallelism)"),
        ("pipeline_model_parallel_size", 1, "plans index the model's MoE layers from 0 (no pipeline stages)"),
        ("moe_router_padding_for_fp8", False, "fp8 routing-map padding is not supported"),
    )
    for field, want, why in checks:
        value = getattr(config, field, want)
        if value != want:
            raise ValueError(f"{field}={value!r}: {why}; set {field}={want!r}")
    act = getattr(config, "activation_func", None)
    if act is not torch.nn.functional.silu:
        raise ValueError(f"activation_func={getattr(act, '__name__', act)!r}: relibra's experts are SwiGLU; set "
                         "activation_func=torch.nn.functional.silu")


# ---------------------------------------------------------------------------------------------- layer


def _ids_digest(ids: torch.Tensor) -> torch.Tensor:
    """A 64-bit digest of replayed ids ``[T, k]`` as an int64 0-d tensor on their device (no host sync):
    the ids weighted by position-dependent odd multipliers, summed with int64 wrap-around."""
    flat = ids.detach().reshape(-1).to(torch.int64)
    pos = torch.arange(1, flat.numel() + 1, device=flat.device, dtype=torch.int64)
    return ((flat + 1) * (pos * 6364136223846793005 + 1442695040888963407)).sum()


class _MegatronRouter(nn.Module):
    """Adapter with ReplayBalancedMoE's router interface over the owning layer's Megatron router.

    ``forward(x [T, H]) -> RouterOutput``: calls Megatron's router on ``x`` viewed back as ``[S, B, H]``
    (its sequence aux loss reads ``S`` and ``B``), so its replay, aux losses and expert bias apply; ids are
    the ``k`` experts of each row of its routing map (ascending), gates its probabilities there (fp32).
    The Megatron router is registered on the owning layer only (one ``state_dict`` entry).
    """

    def __init__(self, owner: MegatronReplayMoE, num_experts: int, top_k: int) -> None:
        super().__init__()
        self.num_experts, self.top_k = num_experts, top_k
        object.__setattr__(self, "_owner", owner)  # a plain attribute, not a submodule: the owner registers the router
        self.name = "moe"

    def forward(self, x: torch.Tensor, replay_ids: torch.Tensor | None = None) -> RouterOutput:
        owner: MegatronReplayMoE = self._owner
        call = owner._call
        T, k, E = x.shape[0], self.top_k, self.num_experts
        if replay_ids is not None:  # a schedule's ids (checked on the host, also in RouterReplay): no host read
            probs, _ = owner.router(x.view(call.shape), call.padding_mask)
            return RouterOutput(ids=replay_ids, gates=probs.gather(1, replay_ids).float(), logits=probs)
        if call.action is not None:
            rr = owner.router.router_replay
            if call.action == RouterReplayAction.REPLAY_BACKWARD:
                if not rr.replay_backward_list:
                    raise ReplayError(f"layer {self.name}: a recomputed forward found no replay data left "
                                      "(RouterReplay.replay_backward_list is empty)")
                target = rr.replay_backward_list[0]
            else:
                target = rr.target_topk_idx
                if target is None:
                    raise ReplayError(f"layer {self.name}: replay is on but no replay data was set for this "
                                      "micro-batch (replay_micro_batch or RouterReplay.set_replay_data)")
            ids = check_replay_ids(target, T, k, E, layer=self.name)
            if ids.numel() and bool((ids < 0).any()):
                t = int((ids < 0).any(dim=1).nonzero()[0])
                raise ReplayError(f"layer {self.name}: replayed row {t} = {ids[t].tolist()} has -1 (no expert); "
                                  "Megatron's RouterReplay has no padding id")
        probs, routing_map = owner.router(x.view(call.shape), call.padding_mask)
        per_row = routing_map.sum(dim=1)
        if bool((per_row != k).any()):
            t = int((per_row != k).nonzero()[0])
            raise ReplayError(f"layer {self.name}: Megatron's router routed token {t} to {int(per_row[t])} experts, "
                              f"expected moe_router_topk={k}")
        ids = routing_map.nonzero()[:, 1].view(T, k)
        gates = probs.gather(1, ids).float()
        # Megatron's router returns probabilities, not logits; the layer reads ids and gates only
        return RouterOutput(ids=ids, gates=gates, logits=probs)


@dataclass
class _Call:
    """What the adapter needs from the current forward of its layer."""

    shape: torch.Size
    padding_mask: torch.Tensor | None
    action: object  # RouterReplayAction to check replay data for, or None (live routing / recording)


class MegatronReplayMoE(MoELayer):
    """A Megatron ``MoELayer`` whose routed experts follow a relibra plan (see the module docstring).

    Built from a constructed Megatron ``MoELayer`` (:func:`swap_moe_layers` does it for a whole model): it
    adopts the layer's router, shared experts, config, layer number and process groups; its experts
    (``SequentialMLP`` or the legacy ``GroupedMLP``, this rank's contiguous block of ``E / EP`` experts)
    become the home experts of a :class:`~relibra_moe.layers.moe.ReplayBalancedMoE` (``self.relibra``) on
    Megatron's expert-parallel group, with the default placement ``expert e -> rank e // (E / EP)``.
    Megatron's token dispatcher is not used.

    Args:
        moe: the Megatron ``MoELayer`` to replace.
        gpus_per_node: ranks per node of the EP group (replicas of node-scoped plans stay in a node).
        replica_buffer: the model's :class:`LayerSharedReplicaBuffer` (shared by its MoE layers).
        layer_index: this layer's index among the model's MoE layers (the plan's ``l``).
        block_m: row block of relibra's grouped GEMM (None: chosen from the shapes, ``triton_kernels.heuristics``).

    Or built by Megatron from a ``ModuleSpec`` (:func:`replay_layer_spec`): ``config``, ``submodules``,
    ``layer_number`` and ``pg_collection`` are ``MoELayer``'s; Megatron's layer is built first (same weights as
    the plain spec's, from the same seed), then adopted.

    ``forward(hidden_states [S, B, H], padding_mask=None) -> (output [S, B, H], None)``.
    """

    def __init__(self, moe: MoELayer | None = None, *, gpus_per_node: int | None = None,
                 replica_buffer: LayerSharedReplicaBuffer | None = None, layer_index: int | None = None,
                 block_m: int | None = None, config=None, submodules=None, layer_number: int | None = None,
                 pg_collection=None) -> None:
        _require_megatron()
        if moe is not None:
            self._adopt(moe, gpus_per_node, replica_buffer, layer_index, block_m)
            return
        # built from a ModuleSpec (replay_layer_spec): Megatron's own layer first, initialized as the plain spec's
        if config is None or submodules is None:
            raise TypeError("MegatronReplayMoE needs a built MoELayer, or the config and submodules of its ModuleSpec")
        check_config(config)
        moe = MoELayer(config, submodules, layer_number, pg_collection)
        cuda = [p.device for p in moe.parameters() if p.is_cuda][:1]
        with torch.random.fork_rng(devices=cuda):  # relibra's experts take Megatron's weights: the RNG stays as in
            self._adopt(moe, gpus_per_node, replica_buffer, layer_index, block_m)  # the plain model's build

    def _adopt(self, moe: MoELayer, gpus_per_node: int | None, replica_buffer: LayerSharedReplicaBuffer | None,
               layer_index: int | None, block_m: int | None) -> None:
        """Become the relibra layer of the built Megatron ``moe`` (see the class docstring)."""
        if not isinstance(moe, MoELayer):
            raise TypeError(f"expected a megatron.core MoELayer, got {type(moe).__name__}")
        config = moe.config
        check_config(config)
        nn.Module.__init__(self)
        adopt_layer_attributes(self, moe)  # config, layer_number, process groups, recompute flags, ...
        self.router = moe.router
        self.shared_experts = moe.shared_experts
        self.experts = None
        self.token_dispatcher = None
        H, E, k = config.hidden_size, config.num_moe_experts, config.moe_router_topk
        F = config.moe_ffn_hidden_size
        w_gate_up, w_down = _stacked_expert_weights(moe.experts, H, F, moe.num_local_experts)
        experts = GroupedSwiGLUExperts(H, F, moe.num_local_experts, dtype=w_gate_up.dtype, device=w_gate_up.device,
                                       block_m=block_m)
        with torch.no_grad():
            experts.w_gate_up.copy_(w_gate_up)
            experts.w_down.copy_(w_down)
        # Megatron's marker of expert-parallel parameters (False: reduced over the expert data-parallel group), as
        # Megatron set it on the experts (True at EP 1): optimizers and DDP group the parameters as the plain model's
        allreduce = all(getattr(p, "allreduce", True) for p in moe.experts.parameters())
        for p in experts.parameters():
            p.allreduce = allreduce
        self.relibra = ReplayBalancedMoE(H, F, E, k, ep_group=moe.ep_group, gpus_per_node=gpus_per_node,
                                         replica_buffer=replica_buffer, router=_MegatronRouter(self, E, k),
                                         layer_index=layer_index, experts=experts)
        if self.relibra.home_experts.tolist() != list(moe.local_expert_indices):
            raise PlanError(f"the EP group's rank {self.relibra.rank} holds Megatron experts "
                            f"{list(moe.local_expert_indices)}, relibra's default placement gives it "
                            f"{self.relibra.home_experts.tolist()}")
        # Megatron's expert data-parallel group (replicas of the same experts): checkpoint replica ids
        self._expert_dp_group = getattr(moe.experts, "dp_group", None)
        self._call = _Call(torch.Size(), None, None)
        self._replaying = False
        self._pending: tuple[BatchPlan | None, int | None] = (None, None)
        # an error replay_micro_batch found on this rank (maybe on it alone): the next forward raises it on every
        # rank of the EP group through the layer's agreement, instead of this rank raising before a collective
        self._pending_error: ReplayError | PlanError | None = None
        self._recompute: collections.deque[tuple[BatchPlan | None, int | None, bool]] = collections.deque()
        # replay_micro_batch calls so far, whether the last one left the ids in RouterReplay, and (call, tokens,
        # digest) of the ids the last replayed forward used: how a forward finds another micro-batch's ids
        self._arm = 0
        self._arm_from_router = False
        self._replayed: tuple[int, int, torch.Tensor] | None = None

    @property
    def name(self) -> str:
        return self.relibra.name

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None):
        """Megatron ``dist_checkpointing``'s description of this layer, in plain Megatron's keys and layout.

        Router and shared experts: as Megatron's ``MoELayer``. Routed experts: as the local spec's
        ``SequentialMLP``: ``{prefix}experts.experts.linear_fc1.weight`` (global ``[*, E, 2F, H]``, gate
        rows then up rows) and ``linear_fc2.weight`` (``[*, E, H, F]``), each home expert at the offset
        of its logical id (:func:`~relibra_moe.layers.expert_sharding.expert_shards`: whatever the
        placement), replica id ``(0, 0, expert data-parallel rank)``: every expert is written once and
        loads into any EP size, relibra or plain Megatron. The placement (``relibra.expert_gpu``) is not
        saved: a loaded model keeps its own and reads each of its home experts by logical id.
        """
        from megatron.core.dist_checkpointing.mapping import LocalNonpersistentObject
        from megatron.core.transformer.utils import sharded_state_dict_default

        if (metadata or {}).get("singleton_local_shards", False):
            raise ValueError("metadata singleton_local_shards=True is not supported by the relibra MoE layer "
                             "(its experts are saved as shards of the global expert dimension)")
        out: dict = {}
        for name, module in self.named_children():
            if name != "relibra":
                out.update(sharded_state_dict_default(module, f"{prefix}{name}.", sharded_offsets, metadata))
        shards = expert_shards(self.relibra)
        dp = self._expert_dp_group
        replica_id = (0, 0, dist.get_rank(dp) if dp is not None and dist.is_initialized() else 0)
        for tensor, fc, glu in (("w_gate_up", "linear_fc1", True), ("w_down", "linear_fc2", False)):
            out[f"{prefix}relibra.experts.{tensor}"] = _expert_factory(
                f"{prefix}experts.experts.{fc}.weight", getattr(self.relibra.experts, tensor),
                shards[f"experts.{tensor}"], tuple(sharded_offsets), glu, replica_id)
        out[f"{prefix}relibra.expert_gpu"] = LocalNonpersistentObject(self.relibra.expert_gpu)
        return out

    def forward(self, hidden_states: torch.Tensor, intermediate_tensors=None,
                padding_mask: torch.Tensor | None = None):
        """``hidden_states [S, B, H]`` (and Megatron's ``padding_mask [B, S]``, True = valid token) ->
        ``(output [S, B, H], None)``."""
        if intermediate_tensors is not None:
            raise ValueError("intermediate_tensors (partial CUDA-graph capture of the MoE layer) is not supported")
        if padding_mask is not None:
            padding_mask = padding_mask.transpose(0, 1).bool()
        if self.moe_layer_recompute:
            return _mcore_checkpoint(lambda h: self._forward(h, padding_mask), False, hidden_states)
        return self._forward(hidden_states, padding_mask)

    def _follow_action(self, rr) -> bool:
        """Whether this (not recomputed) forward replays: the router's action, as the user left it, decides.

        ``REPLAY_FORWARD`` / ``REPLAY_BACKWARD`` (set by :func:`replay_micro_batch`, or by the framework, e.g.
        ``RouterReplay.set_global_router_replay_action``): replay (the layer switches between the two itself).
        ``RECORD`` or no action (``clear_global_router_replay_action``): the user ended replay; the layer
        leaves replay mode (forgets the pending plan slice) and routes live, recording under ``RECORD``,
        as Megatron's own router does.
        """
        action = getattr(rr, "router_replay_action", None)
        if action in (RouterReplayAction.REPLAY_FORWARD, RouterReplayAction.REPLAY_BACKWARD):
            self._replaying = True
        elif self._replaying:
            self._replaying = False
            self._pending = (None, None)
        return self._replaying

    def _stale_replay(self, rr) -> ReplayError | None:
        """``ReplayError`` when this forward would replay the ids another micro-batch already replayed.

        Replay data left in ``RouterReplay`` (``replay_micro_batch(model, None)``, verl / SkyRL style) is
        identified by its token count and a digest; the first forward after each :func:`replay_micro_batch`
        compares it with the data the previous micro-batch replayed: equal means ``set_replay_data`` was not
        called for this micro-batch (without ``RouterReplay.clear_global_indices()`` in between the old ids
        are still there). Ids handed to ``replay_micro_batch`` itself are this micro-batch's by definition.
        """
        target = getattr(rr, "target_topk_idx", None)
        if not isinstance(target, torch.Tensor) or target.dim() != 2 or target.shape[0] == 0:
            return None  # nothing to replay: the router adapter names the problem
        T = int(target.shape[0])
        prev, self._replayed = self._replayed, (self._arm, T, _ids_digest(target))
        if prev is None or prev[0] == self._arm or not self._arm_from_router or prev[1] != T:
            return None
        if int(prev[2]) != int(self._replayed[2]):
            return None
        return ReplayError(f"layer {self.name}: this micro-batch would replay the ids the previous micro-batch "
                           f"replayed ({T} tokens, digest {int(prev[2]) & (2**64 - 1):016x}): no "
                           "RouterReplay.set_replay_data for this micro-batch, and no "
                           "RouterReplay.clear_global_indices() since the last one; set this micro-batch's "
                           "replay data (or pass it to replay_micro_batch)")

    def _forward(self, hidden_states: torch.Tensor, padding_mask: torch.Tensor | None):
        rr = getattr(self.router, "router_replay", None)
        if _in_backward():  # a forward recomputed in backward: replay what its forward used
            if not self._recompute:
                raise ReplayError(f"layer {self.name}: a recomputed forward has no matching forward")
            plan, m, replaying, state = self._recompute.popleft()
            action = RouterReplayAction.REPLAY_BACKWARD if replaying else None
            stale = None
        else:
            replaying = self._follow_action(rr)
            plan, m = self._pending
            action = RouterReplayAction.REPLAY_FORWARD if replaying else None
            stale = self._stale_replay(rr) if replaying else None
            # the schedule replay_micro_batch built for this forward (an agreed error is raised whatever the action)
            state, self._scheduled = getattr(self, "_scheduled", None), None
            if state is not None and state.error is None and state.schedule.error is None and (
                    not replaying or stale is not None or self._pending_error is not None):
                state = None
            if is_checkpointing():
                self._recompute.append((plan, m, replaying, state))
            elif replaying and rr is not None and rr.replay_backward_list \
                    and rr.replay_backward_list[-1] is rr.target_topk_idx:
                # no recompute will pop the entry set_target_indices queued for this forward
                rr.replay_backward_list.pop()
        if replaying:
            rr.set_router_replay_action(action)
        self.relibra.router.name = self.name
        self._call = _Call(hidden_states.shape, padding_mask, action)
        shared = self.shared_experts_compute(hidden_states)
        try:
            if state is not None:  # stages 1-3 ran in replay_micro_batch: no host sync in this forward
                out = self._forward_scheduled(hidden_states, state)
            else:
                out = self._forward_live(hidden_states, plan, m, stale)
        finally:
            self._call = _Call(torch.Size(), None, None)
        if shared is not None:
            out = out + shared
        return out, None

    def _forward_scheduled(self, hidden_states: torch.Tensor, state: LayerReplay) -> torch.Tensor:
        """The relibra layer following the schedule of :func:`replay_micro_batch` (its ``replay_state`` for the
        call)."""
        previous, self.relibra.replay_state = self.relibra.replay_state, state
        try:
            return self.relibra(hidden_states)
        finally:
            self.relibra.replay_state = previous

    def _forward_live(self, hidden_states: torch.Tensor, plan: BatchPlan | None, m: int | None,
                      stale: ReplayError | None) -> torch.Tensor:
        """The relibra layer placing the pairs in the forward (live routing, or replay data left in
        ``RouterReplay``): its one sync point and agreement per layer."""
        with replay(self.relibra, None, plan=plan, micro_batch=m):
            error = self._pending_error if self._pending_error is not None else stale
            if error is not None:  # the agreement raises it on every rank of the EP group
                self.relibra.replay_state = LayerReplay(error=error)
            return self.relibra(hidden_states)


def _stacked_expert_weights(experts: nn.Module, H: int, F: int, E_loc: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Megatron's local experts as ``w_gate_up [E_loc, H, 2F]`` (gate columns first) and ``w_down [E_loc, F, H]``."""
    kind = type(experts).__name__
    if hasattr(experts, "local_experts"):  # SequentialMLP: linear_fc1.weight [2F, H], linear_fc2.weight [H, F]
        fc1 = torch.stack([e.linear_fc1.weight.detach() for e in experts.local_experts])
        fc2 = torch.stack([e.linear_fc2.weight.detach() for e in experts.local_experts])
        for name, t, want in (("linear_fc1", fc1, (E_loc, 2 * F, H)), ("linear_fc2", fc2, (E_loc, H, F))):
            if tuple(t.shape) != want:
                raise ValueError(f"{kind}.{name} weights have shape {tuple(t.shape)}, expected {want}")
        return fc1.transpose(1, 2), fc2.transpose(1, 2)
    if hasattr(experts, "weight1") and hasattr(experts, "weight2"):  # legacy GroupedMLP: [H, E_loc*2F], [E_loc*F, H]
        w1, w2 = experts.weight1.detach(), experts.weight2.detach()
        if tuple(w1.shape) != (H, E_loc * 2 * F) or tuple(w2.shape) != (E_loc * F, H):
            raise ValueError(f"GroupedMLP weights have shapes {tuple(w1.shape)}, {tuple(w2.shape)}, expected "
                             f"{(H, E_loc * 2 * F)}, {(E_loc * F, H)}")
        return w1.view(H, E_loc, 2 * F).permute(1, 0, 2), w2.view(E_loc, F, H)
    raise ValueError(f"experts of type {kind} are not supported (SequentialMLP or GroupedMLP; for TE grouped "
                     "experts build the model with moe_grouped_gemm=False)")


def _expert_factory(key: str, param: torch.Tensor, shard: ExpertShard, offsets: tuple, glu: bool, replica_id: tuple):
    """A ``ShardedTensorFactory`` over one stacked expert tensor ``[E_loc, H, 2F]`` / ``[E_loc, F, H]``.

    Built (model weights or, through Megatron's optimizer, any state tensor of the same shape): one
    ``ShardedTensor`` per home expert ``e`` (two for the SwiGLU ``linear_fc1``: gate rows, up rows) of the
    transposed row, at expert offset ``e`` of ``E`` on the axis after ``offsets``; for the model weights
    also the (empty) ``_extra_state`` object Megatron's ``SequentialMLP`` writes per expert, so a plain
    model finds every key it reads. Merged: the loaded rows stacked back into ``[E_loc, ...]``.
    """
    from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory

    return ShardedTensorFactory(key, param, functools.partial(_build_experts, shard=shard, offsets=offsets, glu=glu,
                                                              param=param),
                                functools.partial(_merge_experts, glu=glu), replica_id)


def _build_experts(key: str, data: torch.Tensor, replica_id, flattened_range, *, shard: ExpertShard,
                   offsets: tuple, glu: bool, param: torch.Tensor) -> dict:
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor

    if flattened_range is not None:
        raise ValueError(f"{key}: a flattened range (Megatron's DistributedOptimizer) is not supported for the "
                         "relibra MoE layer's experts; use a torch optimizer or FP32Optimizer")
    shard.check_local(data)
    ax, E = len(offsets), shard.num_experts
    rows, extra = [], []
    for i, e in enumerate(shard.expert_ids.tolist()):
        at = (*offsets, (ax, e, E))
        w = data[i].t()  # Megatron's [2F, H] / [H, F]
        halves = torch.chunk(w, 2, dim=0) if glu else (w,)
        rows.append([ShardedTensor.from_rank_offsets(key, h, *at, *([(ax + 1, j, 2)] if glu else []),
                                                     replica_id=replica_id, prepend_axis_num=ax + 1)
                     for j, h in enumerate(halves)])
        if data is param:
            extra.append(ShardedObject(key.rsplit(".", 1)[0] + "._extra_state", None,
                                       tuple(o[2] for o in at), tuple(o[1] for o in at), replica_id))
    # no empty list: dist_checkpointing would keep it as common (non-sharded) state and fail to merge it back
    return {"rows": rows, "extra": extra} if extra else {"rows": rows}


def _merge_experts(loaded: dict, *, glu: bool) -> torch.Tensor:
    rows = [torch.cat(parts, dim=0) if glu else parts[0] for parts in loaded["rows"]]
    return torch.stack(rows).transpose(1, 2).contiguous()


def expert_state_dict(layer: MegatronReplayMoE) -> dict[str, torch.Tensor]:
    """This rank's home experts in Megatron ``SequentialMLP`` names and layout, for checkpoints.

    Keys ``local_experts.{i}.linear_fc1.weight`` (``[2F, H]``) / ``linear_fc2.weight`` (``[H, F]``) for the
    ``i``-th home expert, plus ``global_expert_ids`` (int64 ``[E_loc]``: the logical id of each; after a
    relayout they are no longer Megatron's contiguous block).
    """
    ex = layer.relibra.experts
    out: dict[str, torch.Tensor] = {}
    for i in range(ex.num_local):
        out[f"local_experts.{i}.linear_fc1.weight"] = ex.w_gate_up[i].detach().t().contiguous()
        out[f"local_experts.{i}.linear_fc2.weight"] = ex.w_down[i].detach().t().contiguous()
    out["global_expert_ids"] = torch.as_tensor(layer.relibra.home_experts, dtype=torch.int64)
    return out


# ---------------------------------------------------------------------------------------------- model


def megatron_moe_layers(model: nn.Module) -> list[nn.Module]:
    """The model's Megatron MoE layers (``MoELayer``, relibra or not) in module order."""
    _require_megatron()
    return [m for m in model.modules() if isinstance(m, MoELayer)]


def _relibra_layers(model: nn.Module) -> list[MegatronReplayMoE]:
    layers = [m for m in model.modules() if isinstance(m, MegatronReplayMoE)]
    if not layers:
        raise ValueError("the model has no MegatronReplayMoE: call swap_moe_layers(model) first")
    return layers


def swap_moe_layers(model: nn.Module, *, replica_slots: int = 0, gpus_per_node: int | None = None,
                    block_m: int | None = None) -> list[MegatronReplayMoE]:
    """Replace every Megatron ``MoELayer`` of a built model by a :class:`MegatronReplayMoE` (same weights).

    ``replica_slots``: r replica slots per rank, one :class:`LayerSharedReplicaBuffer` shared by all the
    model's MoE layers; at most ``E - E / EP`` (``PlanError`` above it, as ``Planner``: at EP 1 there is
    nothing to replicate). ``gpus_per_node``: ranks per node of the EP group. Layer ``l`` (module order) is
    the plan's MoE layer ``l``. Call it on every rank (a collective on the EP group: the dispatcher's
    node sub-groups), after moving the model to its device and dtype, before building the optimizer.
    Layers Megatron built as :class:`MegatronReplayMoE` (:func:`replay_layer_spec`) stay; they get their index
    and the replica buffer here. Returns the model's relibra layers.
    """
    _require_megatron()
    targets = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
               if isinstance(child, MoELayer)]
    if not targets or (all(isinstance(c, MegatronReplayMoE) and c.relibra.layer_index is not None
                           for _, _, c in targets)):
        raise ValueError("the model has no megatron.core MoELayer to swap")
    check_int("replica_slots", replica_slots, 0, error=ValueError)
    first = targets[0][2]
    ep = dist.get_world_size(first.ep_group) if dist.is_initialized() and first.ep_group is not None else 1
    check_replica_slots(replica_slots, first.config.num_moe_experts, ep)
    buf = None
    out = []
    for i, (parent, name, child) in enumerate(targets):
        if isinstance(child, MegatronReplayMoE):  # built by replay_layer_spec: its index and the buffer come here
            layer = child
            layer.relibra.layer_index = i
        else:
            layer = MegatronReplayMoE(child, gpus_per_node=gpus_per_node, replica_buffer=None, layer_index=i,
                                      block_m=block_m)
        if replica_slots and buf is None:
            buf = LayerSharedReplicaBuffer.for_experts(layer.relibra.experts, replica_slots)
        if buf is not None:
            buf.check_experts(layer.relibra.experts.expert_tensors())
            layer.relibra.replica_buffer = buf
        setattr(parent, name, layer)
        out.append(layer)
    return out


def replay_layer_spec(layer_spec, *, gpus_per_node: int | None = None, block_m: int | None = None):
    """Megatron's transformer layer ``ModuleSpec`` (e.g. ``get_gpt_layer_local_spec(num_experts=E)``) with its MoE
    layer built as a :class:`MegatronReplayMoE` (``gpus_per_node`` and ``block_m`` as for it): Megatron's
    spec-based construction, for a model built with relibra's layers from the start (``GPTModel(config,
    replay_layer_spec(spec), ...)``; then :func:`swap_moe_layers` gives the layers their plan index and the
    replica slots). A copy: ``layer_spec`` is not changed. ``ValueError`` when its ``mlp`` is not an ``MoELayer``."""
    import dataclasses

    _require_megatron()
    mlp = getattr(getattr(layer_spec, "submodules", None), "mlp", None)
    module = getattr(mlp, "module", None)
    if not (isinstance(module, type) and issubclass(module, MoELayer)):
        raise ValueError(f"the layer spec's mlp builds {getattr(module, '__name__', module)!r}, not a megatron.core "
                         "MoELayer: build the spec with num_experts")
    params = dict(mlp.params, gpus_per_node=gpus_per_node, block_m=block_m)
    new_mlp = dataclasses.replace(mlp, module=MegatronReplayMoE, params=params)
    return dataclasses.replace(layer_spec, submodules=dataclasses.replace(layer_spec.submodules, mlp=new_mlp))


# ---------------------------------------------------------------------------------------------- capture


def _expert_parallel_rank() -> int:
    """This process's rank in Megatron's expert-parallel group (0 without torch.distributed)."""
    if not dist.is_initialized():
        return 0
    try:
        from megatron.core import parallel_state

        if parallel_state.model_parallel_is_initialized():
            return int(parallel_state.get_expert_model_parallel_rank())
    except ImportError:
        pass
    return dist.get_rank()


class MegatronRoutingRecorder:
    """Record Megatron's routing (``RouterReplay`` in ``RECORD`` mode) into a :class:`TraceBatch`.

    ::

        with MegatronRoutingRecorder(model) as rec:
            for m, micro_batch in enumerate(micro_batches):
                model(**micro_batch)                      # forward only (e.g. log-prob computation)
                rec.record(seq_lengths_of(micro_batch))   # this rank's sequences, in token order
        batch = rec.trace_batch()                         # every rank's sequences (a collective)

    ``record(seq_lengths)`` splits the last forward's recorded ``[T, k]`` ids of every MoE layer into
    one :class:`~relibra_moe.trace.RoutingTrace` per sequence (``sum(seq_lengths) == T``, rows in Megatron's
    flattened ``[S, B]`` order: pack the sequences). ``layer_ids`` are the MoE layers' decoder indices
    (``layer_number - 1``). Works on plain Megatron ``MoELayer`` models and swapped ones.
    """

    def __init__(self, model: nn.Module, num_experts: int | None = None) -> None:
        _require_megatron()
        self.layers = megatron_moe_layers(model)
        if not self.layers:
            raise ValueError("the model has no megatron.core MoELayer to record")
        check_config(self.layers[0].config)
        self.num_experts = num_experts or self.layers[0].config.num_moe_experts
        self.layer_ids = np.array([int(layer.layer_number or i + 1) - 1 for i, layer in enumerate(self.layers)])
        self.traces: list = []
        self.micro_batch: list[int] = []
        self._calls = 0

    def __enter__(self) -> MegatronRoutingRecorder:
        for layer in self.layers:
            layer.router.router_replay.clear_indices()
            layer.router.router_replay.set_router_replay_action(RouterReplayAction.RECORD)
            if isinstance(layer, MegatronReplayMoE):
                layer._replaying = False
        return self

    def __exit__(self, *exc) -> None:
        for layer in self.layers:
            layer.router.router_replay.clear_router_replay_action()

    def record(self, seq_lengths: Sequence[int], layout: str = "packed") -> None:
        """Add the sequences of the last forward: ``seq_lengths`` tokens of each; ``layout`` ``"packed"``
        (concatenated, ``B = 1``) or ``"sbh"`` (a ``[B, S]`` batch of equal lengths), as for :func:`replay_data`."""
        lengths = [int(n) for n in seq_lengths]
        if any(n <= 0 for n in lengths):
            raise ReplayError(f"seq_lengths={lengths}: every sequence has at least one token")
        _check_layout(layout, lengths)
        ids = []
        for layer in self.layers:
            rec = layer.router.router_replay.get_recorded_indices()
            if rec is None:
                raise ReplayError(f"MoE layer {layer.layer_number}: nothing recorded (run a forward inside the "
                                  "recorder first)")
            ids.append(rec.detach().cpu())
        T = ids[0].shape[0]
        if sum(lengths) != T:
            raise ReplayError(f"seq_lengths sum to {sum(lengths)} tokens, the recorded forward had {T}")
        stacked = torch.stack(ids, dim=1).numpy()  # [T, L, k]
        for part in _rows_to_samples(stacked, lengths, layout):
            self.traces.append(from_megatron(part, num_experts=self.num_experts, layer_ids=self.layer_ids))
            self.micro_batch.append(self._calls)
        self._calls += 1
        for layer in self.layers:
            layer.router.router_replay.record_indices(None)

    def trace_batch(self, group: dist.ProcessGroup | None = None) -> TraceBatch:
        """Every rank's recorded sequences (a collective over ``group``, default the layers' expert-parallel
        group, whose ranks are the plan's GPUs): rank 0's in recording order, then rank 1's, ...;
        ``micro_batch`` is the recording call's index on its rank."""
        if group is None:
            group = self.layers[0].ep_group
        traces, mb = list(self.traces), list(self.micro_batch)
        if dist.is_initialized() and dist.get_world_size(group) > 1:
            parts: list = [None] * dist.get_world_size(group)
            dist.all_gather_object(parts, (traces, mb), group=group)
            traces = [t for p in parts for t in p[0]]
            mb = [m for p in parts for m in p[1]]
        if not traces:
            raise ReplayError("no sequence was recorded on any rank")
        return TraceBatch(traces, micro_batch=np.asarray(mb), source="megatron")


def _check_layout(layout: str, lengths: Sequence[int]) -> None:
    if layout not in LAYOUTS:
        raise ReplayError(f"layout={layout!r} is not one of {LAYOUTS}")
    if layout == "sbh" and len(set(int(n) for n in lengths)) > 1:
        raise ReplayError(f"layout='sbh' needs sequences of one length (a [S, B] batch), got lengths "
                          f"{[int(n) for n in lengths]}")


def _rows_to_samples(rows: np.ndarray, lengths: Sequence[int], layout: str) -> list[np.ndarray]:
    """Megatron's router rows ``[T, ...]`` -> one ``[S_i, ...]`` array per sequence."""
    if layout == "sbh" and len(lengths):
        S, B = int(lengths[0]), len(lengths)
        rows = rows.reshape((S, B) + rows.shape[1:]).swapaxes(0, 1).reshape((S * B,) + rows.shape[1:])
    cuts = np.cumsum([int(n) for n in lengths])[:-1]
    return np.split(rows, cuts)


def replay_data(batch: TraceBatch, plan: BatchPlan, micro_batch: int, rank: int | None = None,
                device: torch.device | str | None = None, layout: str = "packed"
                ) -> tuple[np.ndarray, list[torch.Tensor]]:
    """This rank's samples of one micro-batch in the plan's sample placement, and their replay data.

    Returns ``(samples, ids)``: ``samples`` int64 ``[n]`` (ascending sample indices of ``batch`` with
    ``plan.samples.micro_batch == micro_batch`` and ``plan.samples.gpu == rank``) and ``ids``, one int64
    ``[T, k]`` tensor per MoE layer over their ``T`` tokens: the list ``RouterReplay.set_replay_data``
    takes, or :func:`replay_micro_batch`'s ``per_layer_ids``. Row order follows ``layout``:
    ``"packed"``: the samples' tokens concatenated in ``samples`` order (one packed sequence, ``B = 1``);
    ``"sbh"``: samples of one length ``S`` fed as a ``[B = n, S]`` batch, rows in Megatron's flattened
    ``[S, B]`` order (``s * n + b``). ``rank`` defaults to this process's rank in Megatron's expert-parallel
    group (the plan's GPU; with data parallelism beyond EP, each EP group plans its own batch).
    """
    if not isinstance(plan, BatchPlan):
        raise PlanError(f"plan must be a BatchPlan, got {type(plan).__name__}")
    if plan.samples.num_samples != batch.num_sequences:
        raise PlanError(f"the plan places {plan.samples.num_samples} samples, the batch has {batch.num_sequences}")
    if plan.num_layers != batch.num_layers:
        raise PlanError(f"the plan covers {plan.num_layers} MoE layers, the batch {batch.num_layers}")
    M = plan.num_micro_batches
    if not is_int(micro_batch) or not 0 <= micro_batch < M:
        raise PlanError(f"micro_batch={micro_batch!r} is outside [0, {M})")
    if rank is None:
        rank = _expert_parallel_rank()
    if not 0 <= rank < plan.num_gpus:
        raise PlanError(f"rank={rank} is outside the plan's num_gpus={plan.num_gpus}")
    samples = np.flatnonzero((plan.samples.micro_batch == micro_batch) & (plan.samples.gpu == rank)).astype(np.int64)
    _check_layout(layout, batch.lengths[samples])
    L, k = batch.num_layers, batch.top_k
    if len(samples):
        per = [batch.trace(int(i)).experts.astype(np.int64) for i in samples]
        rows = np.stack(per, axis=1).reshape(-1, L, k) if layout == "sbh" else np.concatenate(per)
    else:
        rows = np.zeros((0, L, k), np.int64)
    if (rows < 0).any():
        raise ReplayError("the batch has -1 (unrouted) ids in the replayed samples; Megatron's RouterReplay has no "
                          "padding id")
    t = torch.as_tensor(rows, device=device)
    return samples, [t[:, l].contiguous() for l in range(L)]


# ---------------------------------------------------------------------------------------------- replay


def replay_micro_batch(model: nn.Module, per_layer_ids: Sequence[torch.Tensor] | None,
                       plan: BatchPlan | None = None, micro_batch: int | None = None, *,
                       batch: TraceBatch | None = None, layout: str = "packed") -> None:
    """Make the next forward of every relibra MoE layer replay ``per_layer_ids`` and follow ``plan``.

    Call once before each micro-batch's forward (whatever runs the forward and backward: a plain loop or
    Megatron's ``forward_backward_func`` inside ``forward_step_func``). ``per_layer_ids``: one ``[T, k]``
    tensor per MoE layer (:func:`replay_data`), handed to each layer's ``RouterReplay``; ``None`` keeps
    replay data set by ``RouterReplay.set_replay_data`` (verl-style). ``plan`` / ``micro_batch``: the
    replica plan slice of this micro-batch (``plan.placement`` must be applied with :func:`relayout`).
    Sets every router's action to ``REPLAY_FORWARD``; the layers switch ``REPLAY_FORWARD`` /
    ``REPLAY_BACKWARD`` themselves, and leave replay when the router's action is set to ``RECORD`` or
    cleared (as Megatron's router does; no :func:`stop_replay` needed). With ``per_layer_ids=None`` the
    first forward checks that the ids in ``RouterReplay`` are not the previous micro-batch's (token count
    and digest; ``ReplayError`` on every rank of the EP group).

    With ``per_layer_ids`` the layers' schedules are built, checked and agreed here (one collective over the EP
    group for all layers: call it on every rank), so the forwards make no host sync. With ``batch`` (the
    ``TraceBatch`` the ids come from, ``replay_data(batch, plan, micro_batch, layout=layout)``) and a
    ``BatchPlan``, the next micro-batch's schedules are built meanwhile in a background thread from
    ``replay_data(batch, plan, micro_batch + 1, layout=layout)`` and taken by the next call when it passes the
    same ids (else rebuilt).

    ``ReplayError`` (wrong number of layers, or a router without ``RouterReplay``) and ``PlanError`` (a plan
    for another EP size, number of experts or layers): raised here on a one-rank group; on an EP group of
    several ranks (where the argument may be bad on this rank only) the next forward raises it on every
    rank, through the first layer's agreement. Per-layer token counts and ids are checked by each layer's
    forward, on every rank of the EP group.
    """
    layers = _relibra_layers(model)
    L = len(layers)
    for layer in layers:
        layer._pending_error = None
        layer._scheduled = None
    try:
        if per_layer_ids is not None:
            ids = list(per_layer_ids)
            if len(ids) != L:
                raise ReplayError(f"replay data covers {len(ids)} MoE layers, the model has {L}")
            for layer, t in zip(layers, ids):
                _check_no_padding(layer, t)
        if plan is not None:
            _check_plan(layers, plan)
    except (ReplayError, PlanError) as exc:
        if not layers or layers[0].relibra.world_size <= 1:
            raise
        exc = exc.with_traceback(None)
        for layer in layers:
            layer._replaying = False
            layer._pending = (None, None)
            layer._pending_error = exc
        if per_layer_ids is not None:  # the peers agree on their schedules: this rank joins with its error
            _schedule_layers(layers, None, plan, micro_batch, exc)
        return
    if per_layer_ids is not None:
        built = _take_ahead(model, layers, batch, plan, micro_batch, ids)
        _schedule_layers(layers, ids, plan, micro_batch, None, built)
        _build_next(model, layers, batch, plan, micro_batch, layout)
    for i, layer in enumerate(layers):
        rr = layer.router.router_replay
        if per_layer_ids is not None:
            rr.set_target_indices(ids[i])
        rr.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
        layer._replaying = True
        layer._pending = (plan, micro_batch)
        layer._arm += 1
        layer._arm_from_router = per_layer_ids is None


def _check_no_padding(layer: MegatronReplayMoE, ids: object) -> None:
    """``ReplayError`` for a ``-1`` (or negative) id in ``ids [T, k]``: Megatron's RouterReplay has no padding id.
    Read on the host once per micro-batch (the schedule copies the ids there anyway); other defects are named
    by the schedule's checks."""
    host = ids.detach().cpu() if isinstance(ids, torch.Tensor) else ids
    arr = np.asarray(host) if host is not None else None
    if arr is not None and arr.ndim == 2 and arr.size and np.issubdtype(arr.dtype, np.integer) and (arr < 0).any():
        t = int(np.flatnonzero((arr < 0).any(axis=1))[0])
        raise ReplayError(f"layer {layer.name}: replayed row {t} = {arr[t].tolist()} has -1 (no expert); "
                          "Megatron's RouterReplay has no padding id")


def _schedule_layers(layers: Sequence[MegatronReplayMoE], ids: list | None, plan: BatchPlan | None,
                     micro_batch: int | None, error: ReplayError | PlanError | None,
                     built: list[LayerReplay] | None = None) -> None:
    """Build (or take ``built``), check, agree (one collective for all layers) and upload every layer's schedule
    for its next forward (:func:`~relibra_moe.layers.replay.scheduled_states`); ``error``: this rank's argument
    error, agreed instead."""
    states = scheduled_states([layer.relibra for layer in layers], ids, plan, micro_batch, error, built)
    for layer, state in zip(layers, states):
        layer._scheduled = state


def _ahead_key(batch: TraceBatch, plan: BatchPlan, micro_batch: int) -> tuple:
    return ("megatron", id(batch), id(plan), int(micro_batch), _expert_parallel_rank())


def _take_ahead(model: nn.Module, layers: Sequence[MegatronReplayMoE], batch: TraceBatch | None, plan: BatchPlan | None,
                micro_batch: int | None, ids: list) -> list[LayerReplay] | None:
    """The states built ahead for this micro-batch of ``batch`` when they were built from ``ids`` (host compare),
    else ``None``."""
    if batch is None or not isinstance(plan, BatchPlan) or not is_int(micro_batch):
        return None
    got = take_ahead(model, [layer.relibra for layer in layers], _ahead_key(batch, plan, micro_batch))
    if got is None:
        return None
    states = got[1]
    for state, t in zip(states, ids):
        if not isinstance(state.ids, torch.Tensor) or not isinstance(t, torch.Tensor) \
                or state.ids.shape != t.shape or not torch.equal(state.ids, t.detach().cpu()):
            return None
    return states


def _build_next(model: nn.Module, layers: Sequence[MegatronReplayMoE], batch: TraceBatch | None, plan: BatchPlan | None,
                micro_batch: int | None, layout: str = "packed") -> None:
    """With ``batch`` and a ``BatchPlan``: start building micro-batch ``micro_batch + 1``'s states in the background
    thread (:func:`~relibra_moe.layers.replay.build_ahead`)."""
    if batch is None or not isinstance(plan, BatchPlan) or not is_int(micro_batch) \
            or micro_batch + 1 >= plan.num_micro_batches:
        return
    rank = _expert_parallel_rank()
    build_ahead(model, [layer.relibra for layer in layers], _ahead_key(batch, plan, micro_batch + 1),
                lambda: replay_data(batch, plan, micro_batch + 1, rank, layout=layout)[1], plan, micro_batch + 1)


def stop_replay(model: nn.Module) -> None:
    """Back to live routing: forget pending replay data and plans of every relibra MoE layer."""
    for layer in _relibra_layers(model):
        layer._scheduled = None
        layer._replaying = False
        layer._pending = (None, None)
        layer._pending_error = None
        layer._recompute.clear()
        layer._replayed = None
        layer.router.router_replay.clear_indices()
        layer.router.router_replay.clear_router_replay_action()


def _check_plan(layers: Sequence[MegatronReplayMoE], plan: BatchPlan) -> None:
    """PlanError naming the setting when ``plan`` was made for another model or EP group."""
    if not isinstance(plan, BatchPlan):
        raise PlanError(f"plan must be a BatchPlan, got {type(plan).__name__}")
    core = layers[0].relibra
    if plan.num_gpus != core.world_size:
        raise PlanError(f"the plan is for num_gpus={plan.num_gpus}, the Megatron expert-parallel group has "
                        f"expert_model_parallel_size={core.world_size}")
    if plan.gpus_per_node != core.gpus_per_node:
        raise PlanError(f"the plan is for gpus_per_node={plan.gpus_per_node}, the layers were swapped with "
                        f"gpus_per_node={core.gpus_per_node}")
    E = plan.placement.expert_gpu.shape[1]
    if E != core.num_experts:
        raise PlanError(f"the plan is for {E} experts, the model has num_moe_experts={core.num_experts}")
    if plan.num_layers != len(layers):
        raise PlanError(f"the plan covers {plan.num_layers} MoE layers, the model has {len(layers)}")


# ---------------------------------------------------------------------------------------------- relayout


def _torch_optimizers(optimizer) -> list[torch.optim.Optimizer]:
    """The torch optimizers inside ``optimizer`` (itself, a Megatron wrapper's ``.optimizer``, every optimizer of
    a ``ChainedOptimizer``); ``ValueError`` naming a wrapper that steps fp32 main copies, or an unknown type."""
    kind = type(optimizer).__name__
    if kind in _MAIN_COPY_OPTIMIZERS:
        raise ValueError(f"relayout does not support Megatron's {kind}: it steps fp32 main copies of the parameters "
                         f"({_MAIN_COPY_OPTIMIZERS[kind]}), not laid out per expert; use a torch optimizer or "
                         "FP32Optimizer (fp32 parameters)")
    if isinstance(optimizer, torch.optim.Optimizer):
        return [optimizer]
    chained = vars(optimizer).get("chained_optimizers")
    if chained is not None:
        return [t for o in chained for t in _torch_optimizers(o)]
    inner = vars(optimizer).get("optimizer")  # not ChainedOptimizer's property (it asserts a single optimizer)
    if isinstance(inner, torch.optim.Optimizer):
        return [inner]
    raise ValueError(f"optimizer of type {kind} is neither a torch optimizer nor a Megatron wrapper with one")


def _expert_optimizer(optimizer, params: Sequence[torch.Tensor]) -> torch.optim.Optimizer:
    """The one torch optimizer inside ``optimizer`` that steps every expert parameter itself (``ValueError``)."""
    want = {id(p) for p in params}
    found = [o for o in _torch_optimizers(optimizer)
             if want & {id(p) for g in o.param_groups for p in g["params"]}]
    stepped = {id(p) for o in found for g in o.param_groups for p in g["params"]}
    if not found or not want <= stepped:
        raise ValueError(f"optimizer {type(optimizer).__name__} does not step the expert parameters themselves "
                         "(it keeps separate main copies, e.g. a mixed-precision or distributed Megatron "
                         "optimizer); use a torch optimizer over the model's parameters")
    if len(found) > 1:
        raise ValueError(f"optimizer {type(optimizer).__name__} steps the expert parameters with {len(found)} "
                         "optimizers; relayout moves the state of one (put every expert parameter in one)")
    return found[0]


def relayout(model: nn.Module, placement: Placement | BatchPlan | np.ndarray,
             optimizer: torch.optim.Optimizer | None = None) -> dict[str, int]:
    """Move every relibra MoE layer's experts to ``placement`` with their gradients and optimizer state.

    What moves per expert: its rows of ``w_gate_up`` / ``w_down``, of their ``.grad``, of Megatron DDP's
    ``main_grad`` buffers when present, and of every optimizer state tensor shaped like the parameter
    (Adam's moments, SGD momentum). ``optimizer``: a ``torch.optim.Optimizer`` over the model's
    parameters, or a Megatron optimizer wrapper whose inner ``.optimizer`` steps the model's parameters
    themselves (``FP32Optimizer``, alone or in a ``ChainedOptimizer``: the one stepping the experts).
    Wrappers that step separate fp32 main copies (``Float16OptimizerWithFloat16Params``,
    ``DistributedOptimizer``, which also shards its state over data-parallel ranks) are refused by name with
    a ``ValueError``: their copies are not laid out per expert. A collective over the EP group; raises
    ``PlanError`` (on every rank) for a placement that does not fit. Also clears pending recomputes.
    """
    layers = _relibra_layers(model)
    if isinstance(placement, BatchPlan):
        _check_plan(layers, placement)
        placement = placement.placement
    params = [p for layer in layers for p in layer.relibra.experts.parameters()]
    opt = _expert_optimizer(optimizer, params) if optimizer is not None else None
    # Megatron DDP keeps gradients in main_grad views of its grad buffer. relayout moves, in place, every
    # optimizer state tensor shaped like the parameter: main_grad rides along as one, under a reserved key
    carrier = opt if opt is not None else torch.optim.SGD(params, lr=0.0)
    lent = []
    for p in params:
        main = getattr(p, "main_grad", None)
        shared = p.grad is not None and isinstance(main, torch.Tensor) and main.data_ptr() == p.grad.data_ptr()
        if isinstance(main, torch.Tensor) and main.shape == p.shape and not shared:  # a shared one moves as .grad
            carrier.state[p][_MAIN_GRAD_KEY] = main
            lent.append(p)
    try:
        out = _relayout_layers(model, placement, carrier if lent or opt is not None else None)
    finally:
        for p in lent:
            del carrier.state[p][_MAIN_GRAD_KEY]
            if not carrier.state[p]:
                del carrier.state[p]
    for layer in layers:
        layer._recompute.clear()
    return out


#: Deprecated names (the swapped blocks are named ``<Framework>ReplayMoE``): still importable, with a warning.
DEPRECATED_NAMES = {"MegatronReplayMoE": "MegatronReplayMoE"}
__getattr__ = deprecated_names(__name__, DEPRECATED_NAMES, globals())
