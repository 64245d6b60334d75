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
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..errors import PlanError
from ..specs import replica_buffer_bytes
from ..triton_kernels.replica_copy import add_slot_grads, copy_into_slots
from ..validate import check_int
from .dispatch import Dispatcher

__all__ = ["LayerSharedReplicaBuffer", "ReplicaTransfer", "replica_buffer_bytes"]


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
