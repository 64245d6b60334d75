"""ReplayBalancedMoE: a drop-in expert-parallel MoE layer that follows a ReLibra plan.

Minimal training loop (one process; with ``torch.distributed`` initialized, pass ``ep_group`` and
every rank holds ``num_experts / G`` home experts)::

    import torch
    from relibra_moe import ReplayBalancedMoE, replay

    moe = ReplayBalancedMoE(hidden=64, ffn=128, num_experts=8, top_k=2)
    opt = torch.optim.AdamW(moe.parameters(), lr=1e-3)
    x = torch.randn(32, 64)
    with torch.no_grad():                  # "rollout": record the routing
        moe(x)
    recorded = moe.last_routing.clone()    # [T, k] expert ids
    for step in range(3):                  # "training": replay it
        with replay(moe, [recorded]):
            loss = moe(x).pow(2).mean()
        loss.backward()                    # backward may run outside the replay block
        opt.step()
        opt.zero_grad()

With a plan (``relibra_moe.plan.BatchPlan``) each micro-batch runs inside
``replay(model, per_layer_ids, plan=plan, micro_batch=m)`` after
``relibra_moe.relayout(model, plan.placement, optimizer)`` has moved the experts to the plan's homes.

What one forward does on rank ``j`` of the EP group (``G`` ranks, ``E_loc = E / G`` home experts), one
method per stage (:meth:`~ReplayBalancedMoE.route_and_place` runs stages 1 and 3 on this rank alone before
stage 2, since this rank's pair counts per destination travel with its status in one exchange):

1. route: live top-k, or the replayed ids with gates from the live logits (``TopKRouter``), and the plan
   slice of this layer and micro-batch (:meth:`~ReplayBalancedMoE.plan_slice`, ``PlanError``); a bad
   replay or plan is kept, not raised;
Inside :func:`relibra_moe.replay`, stages 1 (the checks), 2 and 3 run on the host before the forward, for all
layers at once (:meth:`~ReplayBalancedMoE.build_schedule`, :meth:`~ReplayBalancedMoE.agree_schedules`: one
exchange per micro-batch): the replayed forward and backward only launch work, with no device-to-host sync
(:class:`LayerSchedule`). Live routing runs the stages in the forward:

2. agree on errors across the EP group (:meth:`~ReplayBalancedMoE.agree`): every rank reports its status
   (and the message of its error), and the digest of the plan slice it follows (:func:`slice_digest`),
   in the one exchange of pair counts, so a bad input, bad replay data or a bad plan on any rank (also
   one found by :func:`relibra_moe.replay` at entry), or ranks following different plan slices, raise the
   same error on every rank before any token moves (nothing hangs);
3. destinations (:meth:`~ReplayBalancedMoE.destinations`) of every routed (token, k) pair: its expert's
   home, or for a split expert the home or one of its replicas, with integer counts per destination
   materialized from this rank's actual count of pairs per expert and the plan's shares ``y[j, e, :]``
   by largest remainder (:func:`materialize_counts`); pairs of one expert go to the destinations in
   ascending rank order, in pair order;
4. dispatch (:meth:`~ReplayBalancedMoE.dispatch`): all-to-all of the pairs sorted by destination;
5. experts (:meth:`~ReplayBalancedMoE.compute_experts`): fill the layer-shared replica slots, grouped
   SwiGLU over home experts and replica slots; a resident plan (``ReplicaPlan.resident``: the same replicas in
   every micro-batch) uses the layer's own slots instead, filled at micro-batch 0 only, their gradients sent
   home once per batch (:class:`~relibra_moe.layers.replica_buffer.ResidentReplicas`);
6. combine (:meth:`~ReplayBalancedMoE.combine`): all-to-all back, weighted sum with the gates in fp32.

Without a plan it is a plain EP MoE layer. No token is ever dropped. A plan never changes the math:
outputs and gradients equal the plain layer's with the same routing (up to fp32 summation order).
"""

from __future__ import annotations

import copy
import hashlib
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import numpy as np
import torch
from torch import nn

from ..errors import PlanError, ReplayError
from ..plan import BatchPlan, ReplicaPlan
from ..triton_kernels.backend import use_triton
from ..triton_kernels.heuristics import row_tile
from ..triton_kernels.permute import combine as combine_pairs
from ..triton_kernels.permute import permute
from ..triton_kernels.routing import RoutingMeta, routing_metadata, trusted_indices
from ..validate import check_int, is_int
from .data_parallel import check_data_parallel
from .dispatch import Dispatcher, ep_process_group, get_dispatcher, post_failure, set_collective_stage
from .experts import (
    GroupedExperts,
    GroupedSwiGLUExperts,
    LocalRows,
    experts_forward,
    grouped_mm_fits,
    local_rows,
    reference_local_experts,
    resident_experts_forward,
)
from .replay import LayerReplay
from .replica_buffer import LayerSharedReplicaBuffer, ReplicaTransfer, ResidentKey, ResidentReplicas, in_backward
from .router import LIVE, RouterOutput, TopKRouter, check_replay_ids, trusted_replay

__all__ = ["LayerPlan", "LayerSchedule", "ReplayBalancedMoE", "RoutedPairs", "host_destinations", "materialize_counts",
           "moe_layers", "padded_counts", "slice_digest"]

_OK, _REPLAY_BAD, _PLAN_BAD = 0, 1, 2
_MSG_WORDS = 48  # int64 words of an error message in the agreement row (384 UTF-8 bytes, longer ones cut)
#: Columns of one row of the agreement exchange: pairs sent, status, slice kind, micro-batch, layer, two digest
#: words, message length in bytes, then the message.
_AGREE_COLS = 8 + _MSG_WORDS


def _encode_message(text: str) -> np.ndarray:
    """``text`` as int64 words ``[1 + _MSG_WORDS]`` (byte length, then UTF-8 bytes zero-padded; cut to fit)."""
    raw = text.encode("utf-8")
    cap = 8 * _MSG_WORDS
    if len(raw) > cap:
        raw = raw[:cap - 3].decode("utf-8", "ignore").encode("utf-8") + b"..."
    out = np.zeros(1 + _MSG_WORDS, np.int64)
    out[0] = len(raw)
    out[1:] = np.frombuffer(raw.ljust(cap, b"\0"), dtype=np.int64)
    return out


def _decode_message(words: np.ndarray) -> str:
    """Inverse of :func:`_encode_message` (a length out of range reads as the whole field)."""
    n = int(words[0])
    raw = np.ascontiguousarray(words[1:], dtype=np.int64).tobytes()
    return raw[:n if 0 <= n <= len(raw) else len(raw)].decode("utf-8", "replace")


def _describe_slice(words: np.ndarray) -> str:
    """Words 2-6 of an agreement row (``LayerPlan.digest``) in words, for a ``PlanError``."""
    digest = np.asarray(words[3:5], np.int64).tobytes().hex()
    if int(words[0]) == 0:
        return f"follows no plan (homes digest {digest})"
    return f"follows micro-batch {int(words[1])} of layer {int(words[2])} of its plan (digest {digest})"


def slice_digest(home: np.ndarray, plan: ReplicaPlan | None, micro_batch: int, layer: int) -> np.ndarray:
    """A 128-bit digest of what one layer follows in one forward, as two int64 words ``[2]``.

    It covers the homes ``home [E]`` and, with ``plan``, the replica slots ``replica_expert[m, l]`` and
    the split rows (``split_index``, ``split_share``) of micro-batch ``m`` = ``micro_batch`` and layer
    ``l`` = ``layer`` (all rank-independent: every rank of the EP group must get the same digest).
    ``plan=None`` ("no plan") hashes the homes alone, under another tag.
    """
    h = hashlib.blake2b(digest_size=16)
    h.update(np.ascontiguousarray(home, dtype=np.int64).tobytes())
    if plan is None:
        h.update(b"no plan")
    else:
        rows = plan.rows_of(micro_batch, layer)
        for part in (plan.replica_expert[micro_batch, layer], plan.split_index[rows], plan.split_share[rows]):
            h.update(np.asarray(part.shape, np.int64).tobytes())
            h.update(np.ascontiguousarray(part).tobytes())
    return np.frombuffer(h.digest(), dtype=np.int64).copy()


def _slice_row(home: np.ndarray, plan: ReplicaPlan | None, micro_batch: int, layer: int | None) -> np.ndarray:
    """int64 ``[5]``, a ``LayerPlan.digest``: 1 with a plan (0: none), the micro-batch, the layer (-1 when
    unknown), then the two words of :func:`slice_digest`."""
    layer = -1 if layer is None else layer
    return np.concatenate([[int(plan is not None), micro_batch, layer], slice_digest(home, plan, micro_batch, layer)])


def materialize_counts(counts: np.ndarray, shares: np.ndarray) -> np.ndarray:
    """Integer split of ``counts [E]`` over destinations by ``shares [E, G]``, by largest remainder.

    Each row of ``shares`` is normalized to sum to 1 (rows of zeros are invalid). Returns int64
    ``[E, G]`` with row sums equal to ``counts``; a destination with share 0 gets nothing; ties in the
    remainders go to the lower destination index. Deterministic.
    """
    n = np.asarray(counts)
    s = np.asarray(shares, dtype=np.float64)
    if n.ndim != 1 or not (np.issubdtype(n.dtype, np.integer) or n.size == 0) or (n < 0).any():
        raise PlanError(f"counts must be non-negative integers [E], got dtype {n.dtype} shape {n.shape}"
                        + (f" with minimum {n.min()}" if n.size else ""))
    if s.shape[:1] != n.shape or s.ndim != 2:
        raise PlanError(f"shares has shape {s.shape}, expected [E={n.shape[0]}, G]")
    if not np.isfinite(s).all() or (s < 0).any():
        e = int(np.flatnonzero(~(np.isfinite(s) & (s >= 0)).all(axis=1))[0])
        raise PlanError(f"shares of expert {e} = {s[e].tolist()} must be finite and >= 0")
    n = n.astype(np.int64)
    tot = s.sum(axis=1, keepdims=True)
    if (tot <= 0).any():
        raise PlanError(f"shares of expert {int(np.flatnonzero(tot[:, 0] <= 0)[0])} sum to 0")
    s = s / tot
    q = n[:, None] * s
    base = np.floor(q).astype(np.int64)
    base = np.minimum(base, n[:, None])
    rem = n - base.sum(axis=1)
    frac = np.where(s > 0, q - base, -np.inf)
    order = np.argsort(-frac, axis=1, kind="stable")  # largest remainder first, ties -> lower index
    support = (s > 0).sum(axis=1)
    rank = np.empty_like(order)
    np.put_along_axis(rank, order, np.arange(s.shape[1])[None, :].repeat(s.shape[0], 0), axis=1)
    # rem < support in exact arithmetic; the modulo keeps float rounding from leaking to share-0 GPUs
    extra = rem[:, None] // np.maximum(support, 1)[:, None] + (rank < (rem % np.maximum(support, 1))[:, None])
    return base + np.where(s > 0, extra, 0)


def host_destinations(ids: np.ndarray, home: np.ndarray, slot_table: np.ndarray, shares: np.ndarray | None
                      ) -> tuple[np.ndarray, np.ndarray]:
    """Destination rank and local slot of every routed pair, two int64 arrays shaped like ``ids [T, k]``
    (-1 for unrouted pairs), on the host.

    ``home [E]``: each expert's rank; ``slot_table [E, G]``: the local slot on rank g serving expert e;
    ``shares [E, G]`` (or ``None``: every pair goes home): this rank's split of each expert's pairs. The
    pairs of expert ``e`` are split by :func:`materialize_counts` of this rank's counts and go, in pair
    order, to the destinations in ascending rank order.
    """
    E, G = slot_table.shape
    flat = np.asarray(ids, np.int64).reshape(-1)
    valid = flat >= 0
    e = np.maximum(flat, 0)
    if shares is None:
        dest = np.asarray(home, np.int64)[e]
    else:
        cum = np.cumsum(materialize_counts(np.bincount(flat[valid], minlength=E), shares), axis=1)
        key = np.where(valid, flat, E)
        order = np.argsort(key, kind="stable")
        start = np.zeros(E + 1, np.int64)
        start[1:] = np.cumsum(np.bincount(key, minlength=E + 1)[:-1])
        pos = np.empty_like(flat)
        pos[order] = np.arange(flat.size) - start[key[order]]
        dest = (pos[:, None] >= cum[e]).sum(axis=1)
    slot = slot_table[e, np.minimum(dest, G - 1)]
    shape = np.shape(ids)
    return np.where(valid, dest, -1).reshape(shape), np.where(valid, slot, -1).reshape(shape)


@dataclass(frozen=True)
class LayerPlan:
    """One layer's validated plan slice for one forward: the destination tables and the replica transfer.

    Attributes:
        slot_table: int64 ``[E, G]``, the local slot on GPU g serving expert e (-1: g does not serve e).
        shares: float64 ``[E, G]``, this source rank's split of each expert's pairs over the GPUs; ``None``
            when every pair goes to its expert's home.
        transfer: the replica slots this rank fills and serves, ``None`` without replicas.
        digest: int64 ``[5]``: 1 with a plan (0: none), the micro-batch, the layer, then the two words of
            :func:`slice_digest`; every rank of the EP group must hold the same (checked by ``agree``);
            ``None`` reads as "no plan" on the layer's current homes.
        resident: with a resident plan (``ReplicaPlan.resident``), what the layer's own slots must hold for
            this forward (the layer runs it resident); ``None``: the layer-shared buffer, refilled per forward.
    """

    slot_table: np.ndarray
    shares: np.ndarray | None
    transfer: ReplicaTransfer | None
    digest: np.ndarray | None = None
    resident: ResidentKey | None = None


@dataclass(eq=False)
class LayerSchedule:
    """Everything one layer's forward needs for one micro-batch, computed and checked on the host before the
    forward (:meth:`ReplayBalancedMoE.build_schedule`, possibly in a background thread), agreed across the
    EP group once per micro-batch for all layers (:meth:`ReplayBalancedMoE.agree_schedules`) and uploaded
    (:meth:`ReplayBalancedMoE.upload_schedule`: pinned memory, non-blocking copies on CUDA).

    Attributes:
        ids: int64 ``[T, k]`` replayed expert ids, validated (:data:`~relibra_moe.layers.router.LIVE` rows
            included), on the host; after upload ``ids_dev`` on the layer's device.
        plan: the layer's validated plan slice (destination tables, replica transfer, digest).
        live_rows: some row is ``LIVE``: its experts are chosen in the forward, so the destinations too
            (the forward takes the live path, with its one sync point).
        dest, slot: int64 ``[T, k]``, destination rank and local slot of every pair (-1: unrouted); ``None``
            with ``live_rows``.
        send_splits: pairs sent to each rank (``G`` ints); ``recv_splits`` the pairs received from each rank
            (from the agreement; one rank: ``send_splits``).
        num_rows: R, rows of the send side: ``T * k`` on one rank (fixed shapes: CUDA-graph capturable, the
            unrouted pairs are padding rows), else ``sum(send_splits)``.
        send_meta: the :class:`RoutingMeta` sorting the pairs by destination (``R`` rows).
        slot_send: int64 ``[R]``, the local slot (on its destination) of every sorted row, -1 for padding.
        exchange_in_forward: set by the agreement when some rank has ``LIVE`` rows in this layer: every rank
            then exchanges its pair counts in the forward (the live path).
        send_slot_counts: int64 ``[G, S]``, the pairs sent to each rank per local slot there (``S = E_loc + r``);
            the send side is sorted by destination, then slot. ``slot_recv``: int64 ``[sum(recv_splits)]``, the
            local slot of every received row, from the agreement's counts (no all-to-all of slot ids).
        local_meta: one rank without replicas: the :class:`RoutingMeta` sorting the ``(token, k)`` pairs by
            local slot directly (``T * k`` rows, unrouted pairs as padding rows: fixed shapes), so the forward
            skips the dispatch sort; ``slot_counts`` (int64 ``[E_loc + r]``) the pairs per slot; ``local_rows``
            the gather / combine indices of ``local_meta`` for the CPU reference path
            (:func:`~relibra_moe.layers.experts.reference_local_experts`; layers on the CPU only).
        error: the ``ReplayError`` / ``PlanError`` of this layer (or the one agreed by the EP group), raised
            by the forward.
        home: the homes ``[E]`` the schedule was built against.
    """

    ids: np.ndarray | None = None
    plan: LayerPlan | None = None
    live_rows: bool = False
    dest: np.ndarray | None = None
    slot: np.ndarray | None = None
    send_splits: tuple[int, ...] | None = None
    recv_splits: tuple[int, ...] | None = None
    num_rows: int = 0
    send_meta: RoutingMeta | None = None
    slot_send: torch.Tensor | None = None
    exchange_in_forward: bool = False
    error: ReplayError | PlanError | None = None
    home: np.ndarray | None = None
    ids_dev: torch.Tensor | None = field(default=None, repr=False)
    local_meta: RoutingMeta | None = None
    slot_counts: torch.Tensor | None = None
    send_slot_counts: np.ndarray | None = None
    slot_recv: torch.Tensor | None = None
    local_rows: LocalRows | None = None

    @property
    def num_tokens(self) -> int:
        return 0 if self.ids is None else int(self.ids.shape[0])

    def copy_(self, other: LayerSchedule) -> LayerSchedule:
        """Refresh this uploaded one-rank schedule in place with ``other`` (another micro-batch of the same
        token count): its device tensors are overwritten, so a CUDA graph captured while following this
        schedule replays ``other``'s routing. Both must have ``local_meta`` (one rank, no replicas) and the same
        shapes (``ReplayError`` otherwise). Returns ``self``."""
        mine, theirs = self._device_tensors(), other._device_tensors()
        if self.local_meta is None or other.local_meta is None or len(mine) != len(theirs) or any(
                a.shape != b.shape or a.dtype != b.dtype for a, b in zip(mine, theirs)):
            raise ReplayError("LayerSchedule.copy_: both schedules must be uploaded one-rank schedules without "
                              f"replicas of the same shapes (tokens {self.num_tokens} and {other.num_tokens})")
        for a, b in zip(mine, theirs):
            a.copy_(b, non_blocking=True)
        if self.local_rows is not None:  # masked unless both are known to route every pair
            self.local_rows = replace(self.local_rows, all_routed=self.local_rows.all_routed and (
                other.local_rows is not None and other.local_rows.all_routed))
        for name in ("ids", "plan", "dest", "slot", "send_splits", "recv_splits", "home"):
            setattr(self, name, getattr(other, name))
        return self

    def _device_tensors(self) -> list[torch.Tensor]:
        """The uploaded tensors the forward reads (``[]`` before the upload)."""
        if self.ids_dev is None:
            return []
        out = [self.ids_dev]
        for meta in (self.send_meta, self.local_meta):
            if meta is not None:
                out += [getattr(meta, f) for f in _META_TENSORS]
        out += list(self.local_rows.tensors()) if self.local_rows is not None else []
        return out + [t for t in (self.slot_send, self.slot_counts) if t is not None]

    @property
    def replayed(self) -> bool:
        """Whether the forward follows it without an exchange (replayed ids, no ``LIVE`` row on any rank)."""
        return self.ids is not None and self.error is None and not self.live_rows and not self.exchange_in_forward \
            and self.recv_splits is not None


def _pinned(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` on ``device``: from pinned memory with a non-blocking copy on CUDA, as is on the CPU."""
    if device.type == "cpu":
        return t
    if device.type == "cuda":
        t = t.pin_memory()
    return t.to(device, non_blocking=True)


@dataclass
class RoutedPairs:
    """This rank's routed (token, k) pairs of one forward, before any token moves (stages 1-3).

    Attributes:
        route: the router output (``ids``, ``gates`` ``[T, k]``); ``None`` when ``error`` is set.
        plan: the layer's plan slice; ``None`` when ``error`` is set.
        dest, slot: int64 ``[T, k]``, destination rank and its local slot of every pair (-1: unrouted).
        error: the replay or plan error of this rank, raised by :meth:`ReplayBalancedMoE.agree`.
        sched: the pairs' :class:`LayerSchedule` (placed on the host, uploaded; ``recv_splits`` not yet known).
    """

    route: RouterOutput | None
    plan: LayerPlan | None
    dest: torch.Tensor | None
    slot: torch.Tensor | None
    error: ReplayError | PlanError | None = None
    sched: LayerSchedule | None = None


class ReplayBalancedMoE(nn.Module):
    """An expert-parallel top-k MoE layer with routing replay and ReLibra replica plans.

    Minimal training loop (single process shown; under ``torch.distributed`` every rank runs the same
    code with ``ep_group=...`` and its own tokens, and holds ``num_experts / G`` home experts)::

        import torch
        from relibra_moe import ReplayBalancedMoE, replay

        moe = ReplayBalancedMoE(hidden=64, ffn=128, num_experts=8, top_k=2)
        opt = torch.optim.AdamW(moe.parameters(), lr=1e-3)
        x = torch.randn(32, 64)
        with torch.no_grad():
            moe(x)                               # rollout: live routing
        ids = moe.last_routing.clone()           # recorded [T, k] expert ids
        for step in range(3):                    # training: replay the recorded routing
            with replay(moe, [ids]):             # + plan=batch_plan, micro_batch=m with a plan
                loss = moe(x).pow(2).mean()
            loss.backward()                      # gates come from the live logits: the router learns
            opt.step()
            opt.zero_grad()

    With a ``BatchPlan``: call ``relibra_moe.relayout(model, plan.placement, opt)`` once per global
    batch, give every MoE layer the same ``LayerSharedReplicaBuffer``, and run each micro-batch ``m``
    inside ``replay(model, ids_m, plan=plan, micro_batch=m)``.

    Replica modes, chosen by the plan (``ReplicaPlan.resident``, the rule the simulator charges by):

    * per layer (any plan): the layer-shared buffer is filled in each forward (a collective) and refilled in
      backward when another layer used it; slot gradients go home in each micro-batch's backward.
    * resident (the same replicas in every micro-batch, M > 1): the layer keeps its own ``r`` slots
      (``resident_replicas``; allocated by the first resident forward: ``L x r`` experts per rank for a model,
      beside the shared buffer, which still sets ``r``), filled once per batch, in micro-batch 0's forward (an
      activation recompute does not refill). Slot gradients accumulate on the slot rank and go home once, in the
      backward that completes the batch's ``M`` micro-batches (micro-batch ``M - 1``'s when each micro-batch's
      backward follows its forward), added to that backward's home gradients: after it, hooks (DDP, FSDP,
      gradient accumulation) see complete home gradients, as in the per-layer mode. A skipped micro-batch
      backward raises ``ReplayError`` on every rank (at the end of the last micro-batch's backward, or agreed at
      the next batch's entry). ``resident_replicas.buffer.fills`` and ``.returns`` count one each per batch.

    Args:
        hidden: H, model hidden size.
        ffn: F, expert FFN width (SwiGLU).
        num_experts: E routed experts (divisible by the EP group size G).
        top_k: k experts per token.
        ep_group: the process group of expert parallelism, or a ``DeviceMesh`` (1-D, or with an ``"ep"``
            dimension: its group for this rank); ``None`` uses the
            world when ``torch.distributed`` is initialized, else a single rank.
        gpus_per_node: ranks per node in the EP group (replicas of node-scoped plans stay in a node);
            default: the whole group is one node.
        replica_buffer: the model's :class:`LayerSharedReplicaBuffer` (shared by all its MoE layers);
            needed only when a plan puts replicas into slots (its ``slots`` is the plans' ``r``, also for
            resident plans, which run on the layer's own slots).
        router: a :class:`TopKRouter`, a dict of its keyword arguments, or a scoring name
            (``"softmax"``, ``"sigmoid"``).
        shared_expert: optional module applied to every token and added to the output.
        experts: this rank's expert container (a :class:`~relibra_moe.layers.experts.GroupedExperts`
            holding ``num_experts / G`` experts, e.g. :class:`~relibra_moe.layers.experts.BiasedGatedExperts`
            for GPT-OSS-style experts); default: :class:`~relibra_moe.layers.experts.GroupedSwiGLUExperts`
            of ``hidden`` x ``ffn`` (``block_m``: its grouped GEMM's row block, by default chosen from the
            shapes; ``dtype`` and ``device`` apply to it). The replica buffer must match it
            (:meth:`LayerSharedReplicaBuffer.for_experts`).
        router_attr: the attribute (and ``state_dict`` prefix) the router is registered under; ``router``
            reads it whatever the name (e.g. ``"gate"`` to keep a Hugging Face block's names).
        layer_index: this layer's index among the model's MoE layers (the plan's ``l``);
            :func:`relibra_moe.replay` assigns it in module order when unset.
        dispatcher: ``"auto"``, ``"alltoall"``, ``"deepep"``, or a :class:`Dispatcher`.
        dtype, device: of the expert weights (the router weight too).

    ``forward(x [..., H]) -> [..., H]``. After each forward, ``last_routing`` holds the ids used
    (``[T, k]``, on the device), ``last_send_counts`` (int64 numpy ``[G]``) the pairs this rank sent to each
    rank, ``last_load`` (an int) the pairs this rank's experts computed (home and replica slots), and
    ``last_slot_counts`` (an int64 tensor ``[E_loc + r]`` on the layer's device: reading it is the caller's
    sync) those pairs per local slot. ``replay_state`` (a
    :class:`~relibra_moe.layers.replay.LayerReplay` or ``None``) is what :func:`relibra_moe.replay` sets and
    the forward follows; :meth:`prepare_replay` builds it. ``expert_gpu`` (int64 ``[E]`` buffer) holds the
    rank homing each expert, ``expert_gpu_host`` its host copy.
    """

    def __init__(self, hidden: int, ffn: int, num_experts: int, top_k: int, *,
                 ep_group: torch.distributed.ProcessGroup | None = None,
                 gpus_per_node: int | None = None, replica_buffer: LayerSharedReplicaBuffer | None = None,
                 router: TopKRouter | dict | str = "softmax", shared_expert: nn.Module | None = None,
                 layer_index: int | None = None, dispatcher: str | Dispatcher = "auto",
                 dtype: torch.dtype | None = None, device: torch.device | str | None = None,
                 block_m: int | None = None, experts: GroupedExperts | None = None,
                 router_attr: str = "router") -> None:
        super().__init__()
        for name, value in (("hidden", hidden), ("ffn", ffn), ("num_experts", num_experts), ("top_k", top_k)):
            check_int(name, value, 1, error=ValueError)
        if block_m is not None:
            check_int("block_m", block_m, 1, error=ValueError)
        if gpus_per_node is not None:
            check_int("gpus_per_node", gpus_per_node, 1, error=ValueError)
        if layer_index is not None and (not is_int(layer_index) or layer_index < 0):
            raise ValueError(f"layer_index={layer_index!r} must be a non-negative integer or None")
        if not isinstance(router, (nn.Module, dict, str)):
            raise ValueError(f"router={router!r}: expected a TopKRouter (or another nn.Module), a dict of "
                             "TopKRouter keyword arguments, or a scoring name ('softmax', 'sigmoid')")
        self.hidden, self.ffn, self.num_experts, self.top_k = hidden, ffn, num_experts, top_k
        ep_group = ep_process_group(ep_group)  # a DeviceMesh (1-D, or with an "ep" dimension) -> its group
        self.ep_group = ep_group
        self.dispatcher: Dispatcher = dispatcher if not isinstance(dispatcher, str) else \
            get_dispatcher(ep_group, gpus_per_node, dispatcher)
        self.rank, self.world_size = self.dispatcher.rank, self.dispatcher.world_size
        G = self.world_size
        self.gpus_per_node = G if gpus_per_node is None else int(gpus_per_node)
        if G % self.gpus_per_node:
            raise ValueError(f"gpus_per_node={self.gpus_per_node} does not divide the EP group size {G}")
        if num_experts % G:
            raise ValueError(f"num_experts={num_experts} is not divisible by the EP group size {G}")
        self.num_local = num_experts // G
        self.layer_index = layer_index
        if isinstance(router, str):
            router = TopKRouter(hidden, num_experts, top_k, scoring=router, dtype=dtype, device=device)
        elif isinstance(router, dict):
            router = TopKRouter(hidden, num_experts, top_k, dtype=dtype, device=device, **router)
        if getattr(router, "num_experts", num_experts) != num_experts or getattr(router, "top_k", top_k) != top_k:
            raise ValueError(f"router routes to {router.num_experts} experts top-{router.top_k}, the layer has "
                             f"{num_experts} top-{top_k}")
        self._router_attr = router_attr
        self.add_module(router_attr, router)
        if experts is None:
            experts = GroupedSwiGLUExperts(hidden, ffn, self.num_local, dtype=dtype, device=device, block_m=block_m)
        elif experts.num_local != self.num_local:
            raise ValueError(f"experts holds {experts.num_local} experts, the layer needs num_experts / G = "
                             f"{self.num_local} per rank")
        self.experts = experts
        if replica_buffer is not None:
            replica_buffer.check_experts(self.experts.expert_tensors())
        self.replica_buffer = replica_buffer
        self.shared_expert = shared_expert
        self.register_buffer("expert_gpu", torch.arange(num_experts, dtype=torch.int64) // self.num_local)
        self.replay_state: LayerReplay | None = None  # set by relibra_moe.replay
        self._calls = 0
        self.last_routing: torch.Tensor | None = None
        self.last_send_counts = np.zeros(G, np.int64)
        self.last_load = 0
        self.last_slot_counts = np.zeros(self.num_local, np.int64)

    @property
    def router(self) -> nn.Module:
        """The router module (registered under ``router_attr``)."""
        try:
            return self._modules[self.__dict__.get("_router_attr", "router")]
        except KeyError:
            raise AttributeError("router") from None

    # ------------------------------------------------------------------ placement

    @property
    def name(self) -> str:
        """``moe[l]`` with the layer's ``layer_index`` (``moe`` when unset): how errors name the layer."""
        return f"moe[{self.layer_index}]" if self.layer_index is not None else "moe"

    @property
    def expert_gpu_host(self) -> np.ndarray:
        """int64 ``[E]``: the rank homing each expert (this layer's row of the placement).

        A host copy of the ``expert_gpu`` buffer, refreshed when the buffer changes (in-place writes,
        ``load_state_dict``, ``.to(device)``), so a forward does not sync with the device for it."""
        buf = self.expert_gpu
        cache = self.__dict__.get("_home_cache")
        if cache is None or cache[0] is not buf or cache[1] != buf._version:
            arr = buf.detach().cpu().numpy().astype(np.int64)
            arr.setflags(write=False)
            cache = (buf, buf._version, arr)
            self.__dict__["_home_cache"] = cache
        return cache[2]

    @property
    def resident_replicas(self) -> ResidentReplicas:
        """This layer's own replica slots for resident plans (``ReplicaPlan.resident``), created on first use;
        their buffer is allocated by the first resident forward (``r`` experts: ``L x r`` per rank for a model)."""
        res = self.__dict__.get("_resident")
        if res is None:
            res = self.__dict__["_resident"] = ResidentReplicas()
        return res

    @property
    def num_slots(self) -> int:
        """``S = E_loc + r``: local slots of this rank (home experts, then the replica buffer's slots)."""
        return self.num_local + (0 if self.replica_buffer is None else self.replica_buffer.slots)

    @property
    def home_experts(self) -> np.ndarray:
        """Logical ids of this rank's home experts, ascending (row i of the expert parameters)."""
        return np.flatnonzero(self.expert_gpu_host == self.rank)

    def local_index(self) -> np.ndarray:
        """int64 ``[E]``: row of each expert in its home rank's stacked parameters."""
        home = self.expert_gpu_host
        out = np.zeros(self.num_experts, np.int64)
        for g in range(self.world_size):
            mine = np.flatnonzero(home == g)
            out[mine] = np.arange(len(mine))
        return out

    def set_placement_row(self, expert_gpu: np.ndarray) -> None:
        """Record new homes (no data moves; :func:`relibra_moe.layers.relayout.relayout` moves the data)."""
        row = np.asarray(expert_gpu, dtype=np.int64)
        counts = np.bincount(row, minlength=self.world_size) if row.size else np.zeros(self.world_size)
        if row.shape != (self.num_experts,) or (row < 0).any() or (row >= self.world_size).any() \
                or (counts != self.num_local).any():
            raise PlanError(f"layer {self.name}: expert_gpu row {row.tolist()} is not a placement of "
                            f"{self.num_experts} experts on {self.world_size} ranks ({self.num_local} each)")
        self.expert_gpu.copy_(torch.tensor(row))

    # ------------------------------------------------------------------ replay

    def prepare_replay(self, ids: torch.Tensor | None = None, plan: BatchPlan | ReplicaPlan | None = None,
                       micro_batch: int | None = None) -> LayerReplay:
        """What this layer follows inside :func:`relibra_moe.replay`: the replayed ``ids [T, k]`` (``None``:
        live routing) and the plan's replica slots and splits of ``micro_batch`` for ``layer_index``.

        ``plan``: a :class:`BatchPlan` (its placement must equal this layer's current homes at the forward)
        or a :class:`ReplicaPlan` (read against the current homes). Checks the plan arguments (``PlanError``);
        the ids and the plan's rules are checked by the forward, on every rank of the EP group.
        """
        replicas, expert_gpu = None, None
        if micro_batch is not None and not is_int(micro_batch):
            raise PlanError(f"micro_batch={micro_batch!r} must be an integer micro-batch index")
        if plan is not None:
            if self.layer_index is None:
                raise PlanError("a plan needs the layer's layer_index (set it, or replay the whole model)")
            if isinstance(plan, BatchPlan):
                replicas = plan.replicas
                if not 0 <= self.layer_index < plan.num_layers:
                    raise PlanError(f"layer {self.name}: the plan covers {plan.num_layers} MoE layers")
                if (plan.num_gpus, plan.gpus_per_node) != (self.world_size, self.gpus_per_node):
                    raise PlanError(f"layer {self.name}: the plan is for num_gpus={plan.num_gpus}, gpus_per_node="
                                    f"{plan.gpus_per_node}; the layer's EP group has {self.world_size} ranks, "
                                    f"gpus_per_node={self.gpus_per_node}")
                if plan.placement.expert_gpu.shape[1] != self.num_experts:
                    raise PlanError(f"layer {self.name}: the plan's placement has expert_gpu shape "
                                    f"{tuple(plan.placement.expert_gpu.shape)}, the layer has "
                                    f"num_experts={self.num_experts}")
                expert_gpu = plan.placement.expert_gpu[self.layer_index]
            elif isinstance(plan, ReplicaPlan):
                replicas = plan
            else:
                raise PlanError(f"plan must be a BatchPlan or ReplicaPlan, got {type(plan).__name__}")
            M = replicas.num_micro_batches
            if micro_batch is None:
                if M > 1:
                    raise PlanError(f"the plan has {M} micro-batches: pass micro_batch")
                micro_batch = 0
            if not 0 <= micro_batch < max(M, 1):
                raise PlanError(f"micro_batch={micro_batch} is outside [0, {M})")
        return LayerReplay(ids, replicas, expert_gpu, 0 if micro_batch is None else int(micro_batch))

    def plan_slice(self, state: LayerReplay | None) -> LayerPlan:
        """Validate this layer's slice of the plan in ``state`` against its current homes and build the
        destination tables (raises ``PlanError``); ``None`` or no replicas: every expert at its home."""
        G, E, E_loc = self.world_size, self.num_experts, self.num_local
        home = self.expert_gpu_host
        slot_table = np.full((E, G), -1, np.int64)
        slot_table[np.arange(E), home] = self.local_index()
        if state is None or state.replicas is None:
            return LayerPlan(slot_table, None, None, _slice_row(home, None, 0, self.layer_index))
        l, m, name = self.layer_index, state.micro_batch, self.name
        if state.expert_gpu is not None and not np.array_equal(state.expert_gpu, home):
            raise PlanError(f"layer {name}: the plan's placement {np.asarray(state.expert_gpu).tolist()} differs "
                            f"from the layer's current homes {home.tolist()}; apply relayout(model, plan.placement) "
                            "first")
        plan = state.replicas
        _, L, Gp, r = plan.replica_expert.shape
        if Gp != G or l >= L:
            raise PlanError(f"layer {name}: replica_expert has shape {plan.replica_expert.shape}, expected "
                            f"[M, L > {l}, G={G}, r]")
        try:
            plan.validate_layer(m, l, home, self.gpus_per_node)
        except PlanError as exc:
            raise PlanError(f"layer {name}, micro-batch {m}: {exc}") from None
        rep = plan.replica_expert[m, l]
        filled = rep >= 0
        transfer = None
        if filled.any():
            buf = self.replica_buffer
            if buf is None:
                raise PlanError(f"layer {name}, micro-batch {m}: the plan fills replica slots but the layer has "
                                "no replica_buffer")
            if buf.slots != r:
                raise PlanError(f"layer {name}, micro-batch {m}: the plan has r={r} replica slots per rank, the "
                                f"layer's buffer {buf.slots}")
            g_idx, s_idx = np.nonzero(filled)
            slot_table[rep[g_idx, s_idx], g_idx] = E_loc + s_idx
            transfer = ReplicaTransfer.build(rep, home, self.rank, self.gpus_per_node, plan.scope)
        resident = self._resident_key(plan, m, home) if transfer is not None else None
        rows = plan.rows_of(m, l)
        idx = plan.split_index[rows]
        mine = idx[:, 2] == self.rank
        shares = None
        if mine.any():
            shares = np.zeros((E, G))
            shares[np.arange(E), home] = 1.0
            e_rows = idx[mine, 3]
            shares[e_rows] = 0.0
            np.add.at(shares, (e_rows, idx[mine, 4]), plan.split_share[rows][mine].astype(np.float64))
            shares[slot_table < 0] = 0.0  # share-0 rows to non-holders passed validation; drop them
        return LayerPlan(slot_table, shares, transfer, _slice_row(home, plan, m, l), resident)

    def _resident_key(self, plan: ReplicaPlan, m: int, home: np.ndarray) -> ResidentKey | None:
        """For a resident plan (``plan.resident``, the simulator's ``persistent`` rule), what this layer's own
        slots must hold in micro-batch ``m``; else ``None``. Micro-batch 0 begins a batch: ``ReplayError``
        (agreed like every plan error) when the previous batch never returned its slot gradients."""
        rule = self.__dict__.get("_resident_rule")
        if rule is None or rule[0] is not plan:  # the rule reads the whole [M, L, G, r]: once per plan and layer
            rule = self.__dict__["_resident_rule"] = (plan, plan.resident)
        if not rule[1]:
            return None
        if m == 0 and not in_backward():
            error = self.resident_replicas.stale_error(self.name)
            if error is not None:
                raise error
        rep = np.ascontiguousarray(plan.replica_expert[m, self.layer_index], np.int64)
        return ResidentKey(rep.tobytes(), np.ascontiguousarray(home, np.int64).tobytes(), int(m),
                           int(plan.num_micro_batches))

    # ------------------------------------------------------------------ schedule (host, before the forward)

    def build_schedule(self, state: LayerReplay | None) -> LayerSchedule:
        """This layer's :class:`LayerSchedule` for ``state`` (host work only; safe in a background thread).

        Checks the replayed ids (:func:`~relibra_moe.layers.router.check_replay_ids`) and the plan slice
        (:meth:`plan_slice`), places every pair (:func:`host_destinations`) and sorts the pairs by destination.
        A bad replay or plan is kept in ``error`` (the forward raises it, on every rank after the agreement).
        Without replayed ids (live routing) only the plan slice is kept: the forward routes and places then.
        """
        home = self.expert_gpu_host
        try:
            if state is not None and state.error is not None:
                raise state.error
            plan = self.plan_slice(state)
            if state is None or state.ids is None:
                return LayerSchedule(plan=plan, home=home)
            raw = state.ids
            if isinstance(raw, torch.Tensor):
                raw = raw.detach().cpu()  # recorded ids on a device: one copy at replay entry, not in the forward
            n = int(np.shape(raw)[0]) if np.ndim(raw) else 0
            # a copy the schedule owns (never the caller's memory: uploads on the CPU are the same tensor)
            ids = check_replay_ids(raw, n, self.top_k, self.num_experts, self.name, allow_live=True).numpy().copy()
        except (ReplayError, PlanError) as exc:
            return LayerSchedule(error=exc.with_traceback(None), home=home)
        if (ids == LIVE).any():
            return LayerSchedule(ids=ids, plan=plan, live_rows=True, home=home)
        return self._place(ids, plan, home)

    def _place(self, ids: np.ndarray, plan: LayerPlan, home: np.ndarray) -> LayerSchedule:
        """Host placement of ``ids [T, k]`` (no ``LIVE`` row): destinations, send splits, the send-side sort."""
        G = self.world_size
        dest, slot = host_destinations(ids, home, plan.slot_table, plan.shares)
        send = np.bincount(dest[dest >= 0], minlength=G).astype(np.int64)
        rows = dest.size if G == 1 else int(send.sum())
        S = self.num_slots
        # sorted by destination, then by the slot there (stable: pair order): a receiver knows every row's slot
        # from the per-slot counts of the agreement, and a slot's rows keep the order of the destination sort
        key = np.where(dest >= 0, dest * S + slot, -1)
        with trusted_indices():  # keys built here from checked ids: no range check to read back
            meta = routing_metadata(torch.from_numpy(key), G * S, num_rows=rows)
        gather = meta.gather_idx.numpy().astype(np.int64)
        slot_send = np.where(gather >= 0, slot.reshape(-1)[np.maximum(gather, 0)], -1) if gather.size else \
            np.zeros(0, np.int64)
        splits = tuple(int(v) for v in send)
        local_meta = slot_counts = rows_idx = None
        if G == 1 and plan.transfer is None:  # one rank: the pairs go straight to their slots (no dispatch sort)
            S = self.num_local
            w = self.experts.expert_tensors()[0]
            block_m = self.experts.block_m or row_tile(max(rows, 1) / S, w.dtype)
            with trusted_indices():
                local_meta = routing_metadata(torch.from_numpy(slot), S, block_m=block_m)
            r = 0 if self.replica_buffer is None else self.replica_buffer.slots
            slot_counts = torch.from_numpy(np.bincount(slot[slot >= 0], minlength=S + r).astype(np.int64))
            if self.expert_gpu.device.type == "cpu":  # only the CPU reference reads them
                rows_idx = local_rows(local_meta, all_routed=bool((slot >= 0).all()))
        return LayerSchedule(ids=ids, plan=plan, dest=dest, slot=slot, send_splits=splits,
                             recv_splits=splits if G == 1 else None, num_rows=rows, send_meta=meta,
                             slot_send=torch.from_numpy(slot_send), home=home, local_meta=local_meta,
                             slot_counts=slot_counts, local_rows=rows_idx,
                             send_slot_counts=np.bincount(key[key >= 0], minlength=G * S).reshape(G, S))

    def upload_schedule(self, sched: LayerSchedule) -> LayerSchedule:
        """``sched`` with its tensors on the layer's device (pinned memory and non-blocking copies on CUDA)."""
        dev = self.expert_gpu.device
        if sched.ids is None or sched.error is not None:
            return sched
        up = {"ids_dev": _pinned(torch.from_numpy(sched.ids), dev)}
        if sched.send_meta is not None:
            up["send_meta"] = _upload_meta(sched.send_meta, dev)
            up["slot_send"] = _pinned(sched.slot_send, dev)
        if sched.slot_recv is not None:
            up["slot_recv"] = _pinned(sched.slot_recv, dev)
        if sched.local_meta is not None:
            up["local_meta"] = _upload_meta(sched.local_meta, dev)
            up["slot_counts"] = _pinned(sched.slot_counts, dev)
            if sched.local_rows is not None:
                up["local_rows"] = LocalRows(*(_pinned(t, dev) for t in sched.local_rows.tensors()),
                                             all_routed=sched.local_rows.all_routed)
        t = sched.plan.transfer
        if t is not None:
            t = replace(t, slot_expert=_pinned(t.slot_expert, dev), send_local=_pinned(t.send_local, dev),
                        recv_slots=_pinned(t.recv_slots, dev))
            up["plan"] = replace(sched.plan, transfer=t)
        return replace(sched, **up)

    @staticmethod
    def agree_schedules(layers: list[ReplayBalancedMoE], schedules: list[LayerSchedule]) -> list[LayerSchedule]:
        """The one agreement of a micro-batch, for all ``layers`` of an EP group (a collective; host ints).

        Each rank sends every other rank one row: its status and error message (the first layer with an
        error), and per layer the pairs it sends that rank, whether it has ``LIVE`` rows, and the digest of
        the plan slice it follows (``LayerPlan.digest``). Returns the schedules with ``recv_splits`` and
        ``exchange_in_forward`` filled, or, when a rank rejected its input or the ranks follow different
        plan slices, every schedule carrying the same error on every rank (the first forward raises it:
        nothing hangs, no token moves).
        """
        first = next(lay for lay in layers if lay.world_size > 1)
        G, L = first.world_size, len(layers)
        bad = next((i for i, s in enumerate(schedules) if s.error is not None), None)
        base = 3 + _MSG_WORDS + 6 * L
        offs = np.concatenate([[0], np.cumsum([lay.num_slots for lay in layers])]) + base
        row = np.zeros(int(offs[-1]), np.int64)
        sends = np.zeros((G, int(offs[-1]) - base), np.int64)
        if bad is not None:
            err = schedules[bad].error
            row[0] = _REPLAY_BAD if isinstance(err, ReplayError) else _PLAN_BAD
            row[1] = bad
            row[2:3 + _MSG_WORDS] = _encode_message(str(err))
        else:
            for i, (lay, s) in enumerate(zip(layers, schedules)):
                digest = s.plan.digest if s.plan.digest is not None else \
                    _slice_row(lay.expert_gpu_host, None, 0, lay.layer_index)
                row[3 + _MSG_WORDS + 6 * i:3 + _MSG_WORDS + 6 * i + 5] = digest
                row[3 + _MSG_WORDS + 6 * i + 5] = int(s.live_rows)
                if s.send_slot_counts is not None:
                    sends[:, offs[i] - base:offs[i + 1] - base] = s.send_slot_counts
        meta = np.tile(row, (G, 1))
        meta[:, base:] = sends
        exchange = getattr(first.dispatcher, "agree_exchange", first.dispatcher.exchange)
        recv = exchange(torch.from_numpy(meta).to(first.expert_gpu.device)).cpu().numpy()
        error = _agreed_error(layers, recv, L)
        if error is not None:
            return [LayerSchedule(error=error, home=s.home) for s in schedules]
        out = []
        for i, s in enumerate(schedules):
            live = bool(recv[:, 3 + _MSG_WORDS + 6 * i + 5].any())
            counts = recv[:, offs[i]:offs[i + 1]]  # [source, slot]: the rows this rank receives
            if live or s.send_splits is None:
                out.append(replace(s, exchange_in_forward=live, recv_splits=None if live else (0,) * G))
                continue
            slots = np.repeat(np.tile(np.arange(counts.shape[1]), G), counts.reshape(-1))
            out.append(replace(s, recv_splits=tuple(int(v) for v in counts.sum(axis=1)),
                               slot_recv=torch.from_numpy(slots.astype(np.int64))))
        return out

    # ------------------------------------------------------------------ forward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [..., H]`` -> ``[..., H]``: the stages of the module docstring, in order.

        Inside :func:`relibra_moe.replay` the forward follows the layer's :class:`LayerSchedule` (built,
        checked and agreed before it): no device-to-host sync, no numpy, host ints for the splits. Live
        routing (no replay, or ``LIVE`` rows on some rank) has one sync point: the live ids are copied to the
        host once to place the pairs (and, on an EP group, the agreement's answer is read there)."""
        check_data_parallel(self)  # DDP: refuse a reducer over the experts, scale expert grads by 1 / D
        state = self.replay_state
        sched = None if state is None else state.schedule
        if sched is not None and sched.error is not None:
            raise copy.copy(sched.error)  # every rank holds the same error (agreed at replay entry)
        if sched is not None and sched.replayed:
            return self._forward_replayed(x, sched)
        try:
            x2 = self._tokens(x)
        except ReplayError as exc:  # may be bad on this rank only: agree raises it on every rank
            x2, pairs = None, RoutedPairs(None, None, None, None, exc)
        else:
            pairs = self.route_and_place(x2, state)
        send_splits, recv_splits = self.agree(pairs, x.device)
        sched = replace(pairs.sched, recv_splits=tuple(recv_splits))
        return self._stages(x, x2, pairs.route, sched)

    def _forward_replayed(self, x: torch.Tensor, sched: LayerSchedule) -> torch.Tensor:
        """Stages 1 and 4-6 following ``sched`` (stages 2-3 ran before the forward)."""
        prev = set_collective_stage(self.name, "route")
        try:
            x2 = self._tokens(x)
            if x2.shape[0] != sched.num_tokens:
                raise ReplayError(f"layer {self.name}: replayed ids cover {sched.num_tokens} tokens, the batch has "
                                  f"{x2.shape[0]}")
            if hasattr(self.router, "name") and self.router.name != self.name:
                self.router.name = self.name
            with trusted_replay(sched.ids, live_rows=False):
                route = self.router(x2, replay_ids=sched.ids_dev)
        except BaseException as exc:
            post_failure(self.dispatcher, self.name, "route", exc)
            if self.world_size > 1 and sched.local_meta is None:
                self._stand_in_dispatch(sched)
            raise
        finally:
            set_collective_stage(*prev)
        return self._stages(x, x2, route, sched)

    def _stand_in_dispatch(self, sched: LayerSchedule) -> None:
        """After a failure before this layer's first collective (posted already): join the dispatch the other
        ranks are waiting in with zero rows of the agreed splits, so no collective is left half done; they read
        the notice when it completes and raise, and the process group stays usable."""
        try:
            w = self.experts.expert_tensors()[0]
            rows = torch.zeros(sum(sched.send_splits), self.hidden, dtype=w.dtype, device=w.device)
            with torch.no_grad():
                self.dispatcher.dispatch(rows, sched.send_splits, sched.recv_splits)
        except Exception:  # noqa: BLE001 - best effort: the peers still have the notice and the deadline
            pass

    def _stages(self, x: torch.Tensor, x2: torch.Tensor, route: RouterOutput, sched: LayerSchedule) -> torch.Tensor:
        """Stages 4-6 (and the shared expert), the layer's collectives: a failure here is posted for the EP group
        (:func:`~relibra_moe.layers.dispatch.post_failure`) before it propagates."""
        stage = "dispatch"
        prev = set_collective_stage(self.name, stage)
        try:
            if sched.local_meta is not None:
                stage = "experts"
                with trusted_indices():
                    out = self._local_experts(x2, sched.local_meta, route.gates, sched.local_rows)
                    slot_recv = None
                if self.shared_expert is not None:
                    stage = "shared expert"
                    out = out + self.shared_expert(x2)
                self._record(route, sched, None)
                return out.to(x.dtype).reshape(x.shape)
            with trusted_indices():  # every index below was built (and checked) on the host
                x_recv, slot_recv = self.dispatch(x2, sched)
                stage = "experts"
                set_collective_stage(self.name, stage)
                y_recv = self.compute_experts(x_recv, slot_recv, sched.plan)
                stage = "combine"
                set_collective_stage(self.name, stage)
                out = self.combine(y_recv, sched, route.gates)
            if self.shared_expert is not None:
                stage = "shared expert"
                out = out + self.shared_expert(x2)
        except BaseException as exc:
            post_failure(self.dispatcher, self.name, stage, exc)
            raise
        finally:
            set_collective_stage(*prev)
        self._record(route, sched, slot_recv)
        return out.to(x.dtype).reshape(x.shape)

    def _tokens(self, x: torch.Tensor) -> torch.Tensor:
        """``x [..., H]`` as ``[T, H]`` (``ReplayError``, a ``ValueError``, for another hidden size or a
        non-float dtype: :meth:`forward` hands it to :meth:`agree`, which raises it on every rank)."""
        if x.dim() == 0 or x.shape[-1] != self.hidden:
            raise ReplayError(f"layer {self.name}: x has shape {tuple(x.shape)}, expected [..., hidden={self.hidden}]")
        if not x.is_floating_point():
            raise ReplayError(f"layer {self.name}: x has dtype {x.dtype}, expected a floating-point tensor")
        return x.reshape(-1, self.hidden)

    def route_and_place(self, x2: torch.Tensor, state: LayerReplay | None) -> RoutedPairs:
        """Stages 1-3 on this rank alone (the live path): route ``x2 [T, H]`` (live or replayed), check the
        plan slice, place every pair. The live ids come to the host once (the live path's sync point) and the
        pairs are placed there as for a schedule. A bad replay or plan is kept in ``error`` (not raised):
        :meth:`agree` raises it on every rank."""
        if hasattr(self.router, "name"):
            self.router.name = self.name
        try:
            if state is not None and state.error is not None:
                raise copy.copy(state.error)  # a fresh instance: tracebacks of repeated forwards do not pile up
            route = self.router(x2, replay_ids=state.ids if state is not None else None)
            plan = self.plan_slice(state)
        except (ReplayError, PlanError) as exc:
            return RoutedPairs(None, None, None, None, exc)
        sched = self.upload_schedule(self._place(route.ids.detach().cpu().numpy(), plan, self.expert_gpu_host))
        dev = route.ids.device
        return RoutedPairs(route, plan, torch.from_numpy(sched.dest).to(dev), torch.from_numpy(sched.slot).to(dev),
                           sched=sched)

    def agree(self, pairs: RoutedPairs, device: torch.device) -> tuple[list[int], list[int]]:
        """Stage 2 of the live path across the EP group: one exchange of every rank's pair counts, status and
        plan slice.

        Each rank sends every other rank one row of ``_AGREE_COLS`` int64: its pair count for that rank,
        its status (ok / bad replay data or input / bad plan), the digest of the plan slice it follows
        (``LayerPlan.digest``: micro-batch, layer and :func:`slice_digest`, or "no plan") and, when it
        found an error, the error's message. Then every rank raises the same error before any token
        moves:

        * a rank found an error (its ``x``, its replayed ids, its plan, or a check of
          :func:`relibra_moe.replay` deferred to here): ``ReplayError`` / ``PlanError`` naming the
          lowest such rank and its message;
        * the ranks follow different plan slices (another micro-batch, a plan on some ranks only,
          other homes): ``PlanError`` naming two ranks, what each follows and its digest.

        Returns ``(send_splits, recv_splits)``: pairs this rank sends to / receives from each rank, two
        lists of ``G`` ints. One rank: no exchange.
        """
        G = self.world_size
        error, pairs.error = pairs.error, None
        if G == 1 and error is None:
            send = list(pairs.sched.send_splits)
            return send, send
        row = np.zeros(_AGREE_COLS, np.int64)
        send = np.zeros(G, np.int64)
        if error is None:
            send[:] = pairs.sched.send_splits
            digest = pairs.plan.digest
            if digest is None:  # a LayerPlan built without one: every expert at its home, no plan
                digest = _slice_row(self.expert_gpu_host, None, 0, self.layer_index)
            row[2:7] = digest
        else:
            row[1] = _REPLAY_BAD if isinstance(error, ReplayError) else _PLAN_BAD
            row[7:] = _encode_message(str(error))
        meta = np.tile(row, (G, 1))
        meta[:, 0] = send
        exchange = getattr(self.dispatcher, "agree_exchange", self.dispatcher.exchange)
        recv_meta = exchange(torch.from_numpy(meta).to(device)).cpu().numpy()
        bad = np.flatnonzero(recv_meta[:, 1])
        if len(bad):
            other = int(bad[0])
            cls = ReplayError if int(recv_meta[other, 1]) == _REPLAY_BAD else PlanError
            what = "replay data" if cls is ReplayError else "plan"
            text = (f"layer {self.name}: rank {other} of the EP group rejected its {what}: "
                    f"{_decode_message(recv_meta[other, 7:])}")
            cause, error = error, None  # no frame -> error -> traceback -> frame cycle (it pins activations)
            raise cls(text) from cause
        text = _differing_slices(self.name, recv_meta[:, 2:7])
        if text is not None:
            raise PlanError(text)
        return send.tolist(), recv_meta[:, 0].tolist()

    def destinations(self, ids: torch.Tensor, plan: LayerPlan) -> tuple[torch.Tensor, torch.Tensor]:
        """Stage 3: destination rank and local slot of every pair, two int64 ``[T, k]`` (-1 for unrouted
        pairs), by :func:`host_destinations` (the ids are read on the host)."""
        dest, slot = host_destinations(ids.detach().cpu().numpy(), self.expert_gpu_host, plan.slot_table, plan.shares)
        return torch.from_numpy(dest).to(ids.device), torch.from_numpy(slot).to(ids.device)

    def dispatch(self, x2: torch.Tensor, sched: LayerSchedule) -> tuple[torch.Tensor, torch.Tensor]:
        """Stage 4: sort this rank's pairs by destination (stable in pair order; ``sched.send_meta``) and send
        them (all-to-all). Returns the received rows ``[sum(recv_splits), H]`` in the experts' dtype and their
        local slots (int64, same length; -1 for padding rows)."""
        x_send = permute(x2.to(self.experts.expert_tensors()[0].dtype), sched.send_meta)
        x_recv = self.dispatcher.dispatch(x_send, sched.send_splits, sched.recv_splits)
        slot_recv = sched.slot_recv  # from the agreement's per-slot counts (replay)
        if slot_recv is None:  # live routing: the slots travel with the rows
            slot_recv = self.dispatcher.dispatch_ids(sched.slot_send, sched.send_splits, sched.recv_splits)
        return x_recv, slot_recv

    def compute_experts(self, x_recv: torch.Tensor, slot_recv: torch.Tensor, plan: LayerPlan) -> torch.Tensor:
        """Stage 5: grouped expert MLP of the received rows over home experts and replica slots (the slots
        are filled from the plan's transfer first, a collective when it moves weights)."""
        transfer = plan.transfer
        self._calls += 1
        if plan.resident is not None and transfer is not None:
            resident = self.resident_replicas
            resident.slots_for(self.experts, self.replica_buffer.slots)
            return resident_experts_forward(self.experts, x_recv, slot_recv, resident, transfer, self.dispatcher,
                                            plan.resident, self.name)
        key = (id(self), self._calls)
        return experts_forward(self.experts, x_recv, slot_recv, self.replica_buffer if transfer else None,
                               transfer, self.dispatcher, key)

    def combine(self, y_recv: torch.Tensor, sched: LayerSchedule, gates: torch.Tensor) -> torch.Tensor:
        """Stage 6: send the expert outputs back (all-to-all) and sum each token's k outputs weighted by
        ``gates [T, k]``, in fp32; returns ``[T, H]``."""
        y_send = self.dispatcher.combine(y_recv, sched.send_splits, sched.recv_splits)
        return combine_pairs(y_send, sched.send_meta, gates)

    def _local_experts(self, x2: torch.Tensor, meta: RoutingMeta, gates: torch.Tensor,
                       rows: LocalRows | None = None) -> torch.Tensor:
        """One rank, no replicas: the home experts on the pairs sorted by slot (``meta``, from the schedule),
        summed with ``gates`` in fp32; ``[T, H]``. On the CPU reference backend, eager, with gated experts
        that ``torch._grouped_mm`` takes, the stage runs as plain torch ops over ``rows`` (the schedule's
        :class:`~relibra_moe.layers.experts.LocalRows`; :func:`~relibra_moe.layers.experts.reference_local_experts`):
        no custom-op calls and no loop over slots; else the kernel ops (Triton on CUDA)."""
        form = None
        if rows is not None and not use_triton(x2) and not torch.compiler.is_compiling():
            form = self._reference_form()
        if form is not None:
            return reference_local_experts(x2, rows, *form, gates)
        home = self.experts.expert_tensors()
        ys = self.experts.mlp(permute(x2.to(home[0].dtype), meta), meta, self.experts.slot_tensors(home, None))
        return combine_pairs(ys, meta, gates)

    def _reference_form(self) -> tuple | None:
        """``experts.gated_form()`` when ``torch._grouped_mm`` takes it (:func:`grouped_mm_fits`), else ``None``;
        cached while every expert tensor is the same object with the same storage, dtype, device, shape and strides
        (``relayout``, ``.to()`` and ``.data`` assignments change one of them; ``load_state_dict`` copies in place)."""
        home = self.experts.expert_tensors()
        key = tuple((id(w), w.data_ptr(), w.dtype, w.device, w.shape, w.stride()) for w in home)
        cache = self.__dict__.get("_form_cache")
        if cache is None or cache.key != key:
            form = self.experts.gated_form()
            cache = _FormCache(key, home, form if form is not None and grouped_mm_fits(form[0], form[1]) else None)
            self.__dict__["_form_cache"] = cache
        return cache.form

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> ReplayBalancedMoE:
        """``nn.Module._apply`` (``.to()``, ``.half()``, ...) that first drops :meth:`_reference_form`'s cache (its
        views would keep the old storage alive)."""
        self.__dict__.pop("_form_cache", None)
        return super()._apply(fn, recurse)

    def _record(self, route: RouterOutput, sched: LayerSchedule, slot_recv: torch.Tensor | None) -> None:
        """Keep the ``last_*`` attributes of the class docstring (host ints from the schedule, device counts)."""
        r = 0 if self.replica_buffer is None else self.replica_buffer.slots
        # plain attributes, set without nn.Module.__setattr__'s registration checks (hot path: every forward)
        self.__dict__.update(last_routing=route.ids.detach(), last_send_counts=np.asarray(sched.send_splits, np.int64),
                             last_load=int(sum(sched.recv_splits)))
        if slot_recv is None:
            self.__dict__["last_slot_counts"] = sched.slot_counts
            return
        self.__dict__["last_slot_counts"] = padded_counts(slot_recv, self.num_local + r)  # padding rows: slot -1


def padded_counts(ids: torch.Tensor, n: int) -> torch.Tensor:
    """int64 ``[n]`` on ``ids``' device: how often each value of ``[0, n)`` occurs in the int64 ``ids`` (any shape,
    values ``>= -1``); ``-1`` (a padding row, an unrouted pair) is not counted. Device ops only (a scatter into
    ``n + 1`` buckets, bucket 0 for ``-1``; no ``bincount``): no host sync."""
    flat = ids.detach().reshape(-1)
    counts = torch.zeros(n + 1, dtype=torch.int64, device=ids.device)
    counts.scatter_add_(0, flat + 1, torch.ones_like(flat))
    return counts[1:]


@dataclass(eq=False)
class _FormCache:
    """:meth:`ReplayBalancedMoE._reference_form`'s cache: the key, the expert tensors it was made of (their ids in
    the key stay theirs) and the form. A copy of the layer (``deepcopy``, pickling) starts without it."""

    key: tuple
    home: tuple
    form: tuple | None

    def __reduce__(self) -> tuple:  # copied (deepcopy) and pickled as None
        return (type(None), ())


_META_TENSORS = ("counts", "offsets", "gather_idx", "scatter_idx", "tile_slot", "tile_row", "num_dropped")


def _upload_meta(meta: RoutingMeta, device: torch.device) -> RoutingMeta:
    """``meta`` with its tensors on ``device`` (:func:`_pinned`)."""
    return replace(meta, **{f: _pinned(getattr(meta, f), device) for f in _META_TENSORS})


def _differing_slices(name: str, digests: np.ndarray) -> str | None:
    """The ``PlanError`` text when the ranks' ``LayerPlan.digest`` rows ``[G, 5]`` differ, else ``None``."""
    differ = np.flatnonzero((digests[:, 3:] != digests[:1, 3:]).any(axis=1))
    if not len(differ):
        return None
    a, b = 0, int(differ[0])
    return (f"layer {name}: the ranks of the EP group follow different plan slices: "
            f"rank {a} {_describe_slice(digests[a])}, rank {b} {_describe_slice(digests[b])}")


def _agreed_error(layers: list[ReplayBalancedMoE], recv: np.ndarray, L: int) -> ReplayError | PlanError | None:
    """The error every rank raises after :meth:`ReplayBalancedMoE.agree_schedules` (``recv``: the rows received
    from each rank), or ``None``."""
    bad = np.flatnonzero(recv[:, 0])
    if len(bad):
        other = int(bad[0])
        cls = ReplayError if int(recv[other, 0]) == _REPLAY_BAD else PlanError
        what = "replay data" if cls is ReplayError else "plan"
        at = int(recv[other, 1])
        name = layers[at].name if 0 <= at < L else layers[0].name
        return cls(f"layer {name}: rank {other} of the EP group rejected its {what}: "
                   f"{_decode_message(recv[other, 2:3 + _MSG_WORDS])}")
    for i, lay in enumerate(layers):
        text = _differing_slices(lay.name, recv[:, 3 + _MSG_WORDS + 6 * i:3 + _MSG_WORDS + 6 * i + 5])
        if text is not None:
            return PlanError(text)
    return None


def moe_layers(model: nn.Module) -> list[ReplayBalancedMoE]:
    """The model's ReplayBalancedMoE modules in module order (the plan's MoE layer order)."""
    return [m for m in model.modules() if isinstance(m, ReplayBalancedMoE)]

