"""The layer-shared replica buffer (docs/method.md, "Replication").

Each rank holds ``r`` replica slots, allocated once per model and shared by all of its MoE layers.
Before layer ``l``'s expert compute the slots are filled with layer ``l``'s replicas (each home rank
pushes the weights of its replicated experts to the slot ranks, inside the node for node-scoped
plans); the layer uses them; layer ``l + 1`` refills them. In backward, layer ``l`` refills the slots
again (the backward of the grouped GEMM needs the weights), and the slot gradients are sent back to
the home ranks and added to the home experts' gradients. Memory: ``r`` experts per rank whatever the
number of layers (:func:`replica_buffer_bytes`: 18 MiB for Qwen3-30B-A3B, 72 MiB for Qwen3-235B-A22B
at r = 2 in bf16).

A :class:`ReplicaTransfer` is the part of one layer's replica plan (``replica_expert [G, r]`` of one
micro-batch) that one rank needs: which of its home experts it sends to whom, and which slots it
fills from whom. The order of the rows on the wire is fixed by the global plan, so sender and
receiver agree without extra metadata: a sender walks destinations ascending and their slots
ascending; a receiver walks sources ascending and its slots ascending.

Resident mode (:class:`ResidentReplicas`). A plan whose slots hold the same experts in every micro-batch
(``ReplicaPlan.resident``: EPLB-style redundant experts) runs resident instead: each layer keeps its own
``r`` slots (an unshared buffer of this class, allocated on first use: ``L x r`` experts per rank, e.g.
48 x 18 MiB = 864 MiB for Qwen3-30B-A3B at r = 2 in bf16, beside the model's shared buffer), filled once
per batch at the first micro-batch's forward; their gradients accumulate locally over the micro-batches
and go home once, in the backward that completes the batch (micro-batch ``M - 1``'s in the usual
gradient-accumulation order). This is what the simulator charges such a plan (``persistent``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..errors import PlanError, ReplayError
from ..specs import replica_buffer_bytes
from ..triton_kernels.replica_copy import add_slot_grads, copy_into_slots
from ..validate import check_int
from .dispatch import Dispatcher

__all__ = ["LayerSharedReplicaBuffer", "ReplicaTransfer", "ResidentKey", "ResidentReplicas", "in_backward",
           "replica_buffer_bytes"]


@dataclass(frozen=True)
class ReplicaTransfer:
    """One rank's view of one layer's replica slots for one micro-batch.

    Attributes:
        slot_expert: int64 ``[r]`` logical expert held in each of this rank's slots (-1 empty).
        send_local: int64 ``[n]`` local (home) expert indices to send, in wire order.
        send_splits: ``[G]`` experts sent to each rank.
        recv_slots: int64 ``[m]`` this rank's slot filled by each received expert, in wire order.
        recv_splits: ``[G]`` experts received from each rank.
        active: whether any rank of the group holds a replica in this layer (a global fact, so all
            ranks agree on whether to run the fill collective).
        intra_node: whether all traffic stays inside nodes (node-scoped plan).
    """

    slot_expert: torch.Tensor
    send_local: torch.Tensor
    send_splits: tuple[int, ...]
    recv_slots: torch.Tensor
    recv_splits: tuple[int, ...]
    active: bool
    intra_node: bool

    @classmethod
    def build(cls, replica_expert: np.ndarray, expert_gpu: np.ndarray, rank: int, gpus_per_node: int,
              scope: str = "node") -> ReplicaTransfer:
        """From one layer's ``replica_expert [G, r]`` and ``expert_gpu [E]`` (already validated)."""
        rep = np.asarray(replica_expert, dtype=np.int64)
        home = np.asarray(expert_gpu, dtype=np.int64)
        G, r = rep.shape
        local_index = np.zeros(home.shape[0], np.int64)
        for g in range(G):
            mine = np.flatnonzero(home == g)
            local_index[mine] = np.arange(len(mine))
        send_local, send_splits, recv_slots, recv_splits = [], [0] * G, [], [0] * G
        for g in range(G):  # destinations ascending, slots ascending
            for s in range(r):
                e = rep[g, s]
                if e >= 0 and home[e] == rank:
                    send_local.append(local_index[e])
                    send_splits[g] += 1
        for h in range(G):  # sources ascending, slots ascending
            for s in range(r):
                e = rep[rank, s]
                if e >= 0 and home[e] == h:
                    recv_slots.append(s)
                    recv_splits[h] += 1
        node = np.arange(G) // gpus_per_node
        filled = rep >= 0
        crosses = bool((node[home[np.where(filled, rep, 0)]] != node[:, None])[filled].any())
        return cls(slot_expert=torch.tensor(rep[rank]), send_local=torch.as_tensor(send_local, dtype=torch.int64),
                   send_splits=tuple(send_splits), recv_slots=torch.as_tensor(recv_slots, dtype=torch.int64),
                   recv_splits=tuple(recv_splits), active=bool(filled.any()),
                   intra_node=scope == "node" and not crosses)


class LayerSharedReplicaBuffer:
    """``r`` replica slots per rank, shared by every MoE layer of a model.

    An expert is an ordered set of per-expert tensors (see
    :class:`relibra_moe.layers.experts.GroupedExperts`); the buffer holds one ``[r, ...]`` tensor per
    member. The default set is SwiGLU's two weight matrices; :meth:`for_experts` sizes a buffer for any
    expert container (e.g. biased GPT-OSS experts: four tensors).

    Args:
        hidden: H. ffn: F (the expert width).
        slots: r.
        dtype, device: of the slot tensors (the experts' dtype and device).
        shapes: ``{name: per-expert shape}`` of the members, in order; default
            ``{"w_gate_up": (H, 2F), "w_down": (F, H)}``.

    Attributes:
        tensors: the slot tensors ``[r, *shape]`` in member order (also readable by name, e.g.
            ``buffer.w_gate_up`` ``[r, H, 2F]`` (gate columns first, then up) and ``buffer.w_down``
            ``[r, F, H]`` for the default set).
        names: the member names.
        filled_for: the key (layer name, micro-batch) the slots currently hold, or ``None``.
        fills: how many fills ran (forward and backward), for tests and benchmarks.
    """

    def __init__(self, hidden: int, ffn: int, slots: int, *, dtype: torch.dtype = torch.float32,
                 device: torch.device | str | None = None,
                 shapes: dict[str, tuple[int, ...]] | None = None) -> None:
        check_int("slots", slots, error=ValueError)
        if shapes is None:
            for field, value in (("hidden", hidden), ("ffn", ffn)):
                check_int(field, value, 1, error=ValueError)
        self.hidden, self.ffn, self.slots = hidden, ffn, slots
        if shapes is None:
            shapes = {"w_gate_up": (hidden, 2 * ffn), "w_down": (ffn, hidden)}
        if not shapes:
            raise ValueError("shapes is empty: an expert needs at least one tensor")
        self._slot_tensors: dict[str, torch.Tensor] = {
            name: torch.zeros((slots,) + tuple(int(d) for d in shape), dtype=dtype, device=device)
            for name, shape in shapes.items()}
        self.filled_for: object = None
        self.fills = 0

    @classmethod
    def for_experts(cls, experts, slots: int, *, hidden: int | None = None,
                    ffn: int | None = None) -> LayerSharedReplicaBuffer:
        """A buffer whose members match ``experts.expert_tensors()`` (names ``experts.tensor_names``,
        per-expert shapes, dtype, device). ``hidden`` / ``ffn`` are informational (repr)."""
        ts = experts.expert_tensors()
        shapes = {n: tuple(t.shape[1:]) for n, t in zip(experts.tensor_names, ts)}
        return cls(int(hidden or getattr(experts, "hidden", 0)), int(ffn or getattr(experts, "ffn", 0)), slots,
                   dtype=ts[0].dtype, device=ts[0].device, shapes=shapes)

    def __getattr__(self, name: str) -> torch.Tensor:
        tensors = self.__dict__.get("_slot_tensors")
        if tensors is not None and name in tensors:
            return tensors[name]
        raise AttributeError(f"{type(self).__name__} has no attribute {name!r}")

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self._slot_tensors)

    @property
    def tensors(self) -> tuple[torch.Tensor, ...]:
        return tuple(self._slot_tensors.values())

    @property
    def shapes(self) -> tuple[tuple[int, ...], ...]:
        """Per-expert shape of every member (the slot tensors without their leading ``r``)."""
        return tuple(tuple(t.shape[1:]) for t in self.tensors)

    @property
    def dtype(self) -> torch.dtype:
        return self.tensors[0].dtype

    @property
    def device(self) -> torch.device:
        return self.tensors[0].device

    @property
    def nbytes(self) -> int:
        """Bytes allocated on this rank (``r`` experts)."""
        return sum(t.numel() * t.element_size() for t in self.tensors)

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(hidden={self.hidden}, ffn={self.ffn}, slots={self.slots}, "
                f"members={dict(zip(self.names, self.shapes))}, dtype={self.dtype}, nbytes={self.nbytes})")

    def check_compatible(self, hidden: int, ffn: int, dtype: torch.dtype, device: torch.device) -> None:
        """Raise ``ValueError`` unless the buffer holds experts of this H, F, dtype and device."""
        if (hidden, ffn) != (self.hidden, self.ffn) or dtype != self.dtype or torch.device(device) != self.device:
            raise ValueError(f"{self!r} cannot hold experts of hidden={hidden}, ffn={ffn}, dtype={dtype}, "
                             f"device={device}")

    def check_experts(self, tensors: tuple[torch.Tensor, ...]) -> None:
        """Raise ``ValueError`` unless the slots can hold one expert of the stacked ``tensors``
        (same member count, per-expert shapes, dtype and device)."""
        shapes = tuple(tuple(t.shape[1:]) for t in tensors)
        if shapes != self.shapes or tensors[0].dtype != self.dtype or tensors[0].device != self.device:
            raise ValueError(f"{self!r} cannot hold experts with per-expert shapes {shapes}, dtype "
                             f"{tensors[0].dtype}, device {tensors[0].device}")

    @torch.no_grad()
    def fill(self, key: object, transfer: ReplicaTransfer, home: tuple[torch.Tensor, torch.Tensor],
             dispatcher: Dispatcher) -> None:
        """Fill the slots with one layer's replicas (a collective when ``transfer.active``).

        ``home``: this rank's home tensors (``[E_loc, *shape]`` per member, in member order). The slots are written
        through ``.data`` so autograd graphs that saved a view of the buffer (the layer's backward)
        do not see a version bump; the layer refills before it runs that backward.
        """
        if not transfer.active:
            self.filled_for = key
            return
        if transfer.slot_expert.numel() != self.slots:
            raise PlanError(f"the plan has {transfer.slot_expert.numel()} replica slots per rank, the buffer "
                            f"{self.slots}")
        if len(home) != len(self.tensors):
            raise ValueError(f"{self!r} holds {len(self.tensors)} tensors per expert, got {len(home)}")
        idx = transfer.send_local.to(home[0].device)
        send = torch.cat([w.detach().index_select(0, idx).reshape(len(idx), w[0].numel()).to(self.dtype)
                          for w in home], dim=1)
        recv = dispatcher.replica_exchange(send, transfer.send_splits, transfer.recv_splits, transfer.intra_node)
        slots = transfer.recv_slots.to(self.device)
        rows = torch.arange(len(slots), device=slots.device)
        col = 0
        for t in self.tensors:
            n = t[0].numel()
            copy_into_slots(recv[:, col:col + n].view((len(slots),) + tuple(t.shape[1:])), rows, t.data, slots)
            col += n
        self.filled_for = key
        self.fills += 1

    @torch.no_grad()
    def return_grads(self, transfer: ReplicaTransfer, slot_grads: tuple[torch.Tensor, torch.Tensor],
                     home_grads: tuple[torch.Tensor, torch.Tensor], dispatcher: Dispatcher) -> None:
        """Send slot gradients back to the home ranks and add them into ``home_grads`` in place.

        ``slot_grads``: this rank's slot gradients (``[r, *shape]`` per member); ``home_grads``: this
        rank's home gradients (``[E_loc, *shape]`` per member), both in member order. A collective when
        ``transfer.active``.
        """
        if not transfer.active:
            return
        slots = transfer.recv_slots.to(slot_grads[0].device)
        send = torch.cat([g.index_select(0, slots).reshape(len(slots), g[0].numel()).to(home_grads[0].dtype)
                          for g in slot_grads], dim=1)
        recv = dispatcher.replica_exchange(send, transfer.recv_splits, transfer.send_splits, transfer.intra_node)
        idx = transfer.send_local.to(home_grads[0].device)
        rows = torch.arange(len(idx), device=idx.device)
        col = 0
        for g in home_grads:
            n = g[0].numel()
            add_slot_grads(recv[:, col:col + n].view((len(idx),) + tuple(g.shape[1:])), rows, g, idx)
            col += n


def in_backward() -> bool:
    """Whether the calling thread runs inside an autograd backward (e.g. an activation-checkpoint recompute)."""
    return torch._C._current_graph_task_id() != -1


@dataclass(frozen=True, eq=False)
class ResidentKey:
    """What one forward of a resident plan asks the layer's slots to hold.

    Attributes:
        slots: the layer's ``replica_expert[m, l]`` ``[G, r]`` as bytes (the same in every micro-batch).
        home: the layer's homes ``expert_gpu [E]`` as bytes (a relayout refills).
        micro_batch: m of this forward. num_micro_batches: M of the plan.
    """

    slots: bytes
    home: bytes
    micro_batch: int
    num_micro_batches: int

    def same_slots(self, other: ResidentKey | None) -> bool:
        """Same replica slots and homes as ``other``: the slots ``other`` filled serve this forward."""
        return other is not None and other.slots == self.slots and other.home == self.home


class ResidentReplicas:
    """One layer's resident replica slots and their batch bookkeeping (see the module docstring).

    Attributes:
        buffer: the layer's own slots (a :class:`LayerSharedReplicaBuffer` used unshared), ``None`` before
            the first resident forward; ``buffer.fills`` counts its fills (one per layer per batch).
        key: the :class:`ResidentKey` the slots hold (``None``: nothing).
        generation: how many batches (fills) began; a backward checks it belongs to the current one.
        graphs: micro-batches of this batch whose forward kept an autograd graph (a backward is owed).
        done: micro-batches whose backward added its slot gradients to ``grads``.
        grads: the accumulated slot gradients ``[r, *shape]`` per member (``None`` before the first backward).
        returned: this batch's slot gradients went home. returns: how many times they did (one per batch).
    """

    def __init__(self) -> None:
        self.buffer: LayerSharedReplicaBuffer | None = None
        self.key: ResidentKey | None = None
        self.generation = 0
        self.returns = 0
        self._reset()

    def _reset(self) -> None:
        self.graphs: set[int] = set()
        self.done: set[int] = set()
        self.grads: list[torch.Tensor] | None = None
        self.returned = False

    def slots_for(self, experts, slots: int) -> LayerSharedReplicaBuffer:
        """The layer's buffer of ``slots`` slots for ``experts``, allocated (and emptied) when missing or
        when the experts changed shape, dtype or device."""
        buf = self.buffer
        try:
            if buf is not None and buf.slots == slots:
                buf.check_experts(experts.expert_tensors())
                return buf
        except ValueError:
            pass
        self.buffer = LayerSharedReplicaBuffer.for_experts(experts, slots)
        self.key = None
        return self.buffer

    @property
    def owed(self) -> bool:
        """Slot gradients of the current batch are owed to the homes (a backward ran or is due, none returned)."""
        return bool(self.graphs or self.done) and not self.returned

    def _counts(self) -> str:
        M = self.key.num_micro_batches if self.key is not None else 0
        return (f"the backward ran for {len(self.done)} of its {M} micro-batches {sorted(self.done)}, "
                f"{len(self.graphs)} forwards kept a graph {sorted(self.graphs)}")

    def stale_error(self, name: str) -> ReplayError | None:
        """The ``ReplayError`` of a new batch starting while the previous one's slot gradients are owed (a
        micro-batch's backward never ran), else ``None``. The stale batch is dropped with the error."""
        if not self.owed:
            return None
        err = ReplayError(f"layer {name}: a new batch starts (micro-batch 0 of a resident replica plan) but the "
                          f"previous batch's replica slot gradients never went home: {self._counts()}; run the "
                          "backward of every micro-batch (the stale slot gradients are dropped)")
        self.key = None
        self._reset()
        return err

    def prepare(self, name: str, key: ResidentKey, transfer: ReplicaTransfer, home: tuple[torch.Tensor, ...],
                dispatcher: Dispatcher, keeps_graph: bool) -> int:
        """Before one forward of a resident plan: fill the slots (a collective) when a batch begins, i.e. at
        micro-batch 0 outside a backward (an activation recompute does not refill), for other slots or homes,
        or after the batch's gradients went home (an optimizer step may have changed the homes since); note a
        kept graph. Every rank decides alike from host facts (no sync). A forward of micro-batch ``m > 0`` uses
        the slots its batch filled at micro-batch 0: home weights written within a batch are not seen before the
        next batch (the plan's resident semantics). Returns the batch (``generation``) the forward belongs to.
        ``ReplayError`` when the previous batch still owes its slot gradients."""
        recompute = in_backward()
        if not key.same_slots(self.key) or (not recompute and (key.micro_batch == 0 or self.returned)):
            err = self.stale_error(name)
            if err is not None:
                raise err
            self.buffer.fill(key, transfer, home, dispatcher)
            self.key = key
            self.generation += 1
            self._reset()
        if keeps_graph:
            self.graphs.add(key.micro_batch)
        return self.generation

    def accumulate(self, name: str, generation: int, micro_batch: int, grads: list[torch.Tensor]) -> bool:
        """Add one micro-batch's slot gradients (``[r, *shape]`` per member); returns whether the batch is
        complete (every micro-batch's backward ran: the gradients go home now). ``ReplayError`` for a backward of
        an earlier batch or a micro-batch's second backward."""
        if generation != self.generation or self.returned:
            raise ReplayError(f"layer {name}: the backward of micro-batch {micro_batch} belongs to a batch of the "
                              "resident replica plan whose slot gradients went home already or were dropped "
                              f"(batch {generation}, current {self.generation})")
        if micro_batch in self.done:
            raise self.twice_error(name, micro_batch)
        self.done.add(micro_batch)
        if self.grads is None:
            self.grads = [g.detach().clone() for g in grads]
        else:
            for acc, g in zip(self.grads, grads):
                acc.add_(g)
        return len(self.done) == self.key.num_micro_batches

    def twice_error(self, name: str, micro_batch: int) -> ReplayError:
        """The ``ReplayError`` of a micro-batch's second backward (its slot gradients would count twice)."""
        return ReplayError(f"layer {name}: the backward of micro-batch {micro_batch} ran twice in one batch of the "
                           f"resident replica plan ({self._counts()})")

    def send_home(self, transfer: ReplicaTransfer, home_grads: tuple[torch.Tensor, ...],
                  dispatcher: Dispatcher) -> None:
        """Return the accumulated slot gradients to the home ranks, added into ``home_grads`` in place (a
        collective); the batch is closed."""
        self.buffer.return_grads(transfer, tuple(self.grads), home_grads, dispatcher)
        self.grads = None
        self.returned = True
        self.returns += 1

    def check_complete(self, name: str, generation: int) -> None:
        """After the backward that ran the last micro-batch: ``ReplayError`` when the batch is still incomplete
        (a micro-batch's backward was skipped); the batch is dropped with the error."""
        if generation != self.generation or self.returned:
            return
        M = self.key.num_micro_batches
        text = (f"layer {name}: the backward of the last micro-batch ({M - 1}) of a resident replica plan ran, "
                f"but {self._counts()}: the replica slot gradients cannot go home complete; run the backward of "
                "every micro-batch")
        self.key = None
        self._reset()
        raise ReplayError(text)
