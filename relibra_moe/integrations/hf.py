"""Hugging Face integration: record routing during ``generate()``, swap in replay-balanced MoE blocks,
and replay recorded routing (with a replica plan) in the training step.

Three calls (see docs/hf.md)::

    with RoutingRecorder(model) as rec:                       # rollout
        out = model.generate(prompts, attention_mask=mask, max_new_tokens=N)
    batch = rec.trace_batch()                                 # one RoutingTrace per sequence

    swap_moe_blocks(model)                                    # once, before training
    with replay(model, batch, plan, micro_batch=m):           # per micro-batch
        loss = model(input_ids, attention_mask=...).loss

``replay`` is :func:`relibra_moe.replay` (:mod:`relibra_moe.layers.replay`); the swapped blocks are its
replay targets, and trace input is laid out as the forward's batch rows (:func:`layout_ids`).

Supported block families (transformers 5.x): Qwen3-MoE, Qwen2-MoE, Mixtral, OLMoE, DeepSeek-V3, GPT-OSS
and Qwen3-Next; their differences live in :mod:`relibra_moe.integrations.hf_families`.

Recorded trace rows are the tokens the engine *fed* to the model, in order, with padding removed: the
prompt and every generated token but the last one (which is returned, never fed). That is exactly the
input of the usual shifted causal-LM training forward (``input_ids = seq[:-1]``, ``labels = seq[1:]``).
A trainer that feeds the whole sequence (TRL: prompt + completion up to its EOS) trims the traces with
``rec.traces(lengths=attention_mask.sum(1))`` (this also drops the pad steps ``generate()`` runs after a
sequence's EOS); the one token never fed during the rollout is routed live by ``replay`` (its
``unrouted`` rule), so every token is served as in the plain model.
"""

from __future__ import annotations

import re
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import nn

from ..errors import PlanError, ReplayError
from ..layers.data_parallel import mark_experts_for_ddp
from ..layers.dispatch import ep_process_group
from ..layers.expert_sharding import expert_shards, gather_experts, local_experts
from ..layers.replay import LayerReplay, layout_ids, replay
from ..layers.router import merge_live
from ..layers.upstream_torch import restore_modules, snapshot_modules
from ..plan import check_replica_slots
from ..validate import check_int
from .adopted import deprecated_names
from .hf_families import FAMILIES, SUPPORTED_BLOCKS, Family, family_of
from .hf_layer import LAYER_FAMILIES, HFReplayMoE, hf_replica_buffer
from .torchtitan import TITAN_FAMILY, TorchtitanReplayMoE, is_titan_moe, keep_load_balance_counts, titan_replica_buffer

if TYPE_CHECKING:
    from ..trace import TraceBatch

__all__ = ["RoutingRecorder", "swap_moe_blocks", "replay", "full_state_dict", "load_full_state_dict",
           "checkpoint_state_dict", "HFLocalReplayMoE", "moe_blocks",
           "moe_layer_ids", "layout_ids", "SUPPORTED_BLOCKS"]

_LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.")


# ----------------------------------------------------------------------------------------- discovery
def moe_blocks(model: nn.Module) -> list[tuple[int, str, nn.Module]]:
    """Every MoE block of ``model`` (HF or swapped) as ``(decoder layer index, module name, module)``,
    ordered by layer index.

    Raises ``ValueError`` listing the supported block classes when the model has none.
    """
    found = []
    for name, mod in model.named_modules():
        if _is_swapped(mod) or family_of(mod) is not None or is_titan_moe(mod):
            m = _LAYER_RE.search(name + ".")
            if m is None:
                raise ValueError(f"MoE block {name!r} is not under a 'layers.<i>' module: cannot tell its layer id")
            found.append((int(m.group(1)), name, mod))
    if not found:
        kinds = sorted({type(m).__name__ for m in model.modules() if "moe" in type(m).__name__.lower()
                        or "mlp" in type(m).__name__.lower()})
        raise ValueError(f"{type(model).__name__} has no supported MoE block (found {kinds}); supported block "
                         f"classes: {', '.join(SUPPORTED_BLOCKS)} (families: "
                         f"{', '.join(f.name for f in FAMILIES.values())}), and torchtitan's MoE")
    found.sort(key=lambda t: t[0])
    return found


def moe_layer_ids(model: nn.Module) -> np.ndarray:
    """int32 ``[L]``: the decoder layer index of every MoE layer of ``model``."""
    return np.array([i for i, _, _ in moe_blocks(model)], dtype=np.int32)


def _is_swapped(mod: nn.Module) -> bool:
    """A block made by :func:`swap_moe_blocks` (checked without importing the layer and its kernels)."""
    return bool(getattr(type(mod), "swapped_moe_block", False))


def _family(block: nn.Module) -> Family:
    """The family of an MoE block: a swapped block's own, HF's by class name, or torchtitan's."""
    return block.family if _is_swapped(block) else (family_of(block) or TITAN_FAMILY)


def num_experts_top_k(block: nn.Module) -> tuple[int, int]:
    fam = _family(block)
    router = getattr(block, fam.router_attr)
    return int(router.num_experts), int(router.top_k)


# ------------------------------------------------------------------------------------------ recorder
class RoutingRecorder:
    """Record every token's top-k expert ids at every MoE layer while the model runs (``generate()``).

    Use as a context manager (or ``attach()`` / ``detach()``)::

        with RoutingRecorder(model) as rec:
            out = model.generate(ids, attention_mask=mask, max_new_tokens=16)
        traces = rec.traces()          # list[RoutingTrace], one per sequence
        batch = rec.trace_batch()      # TraceBatch of the same

    Each forward call of the decoder is a *step* with input ``[B, S]``; a step whose attention mask
    covers only its own tokens (no past) starts new sequences (a prefill), later steps append to them
    (decode). Positions where the 2-D ``attention_mask`` is 0 (left or right padding) are dropped. The
    ids are kept on the model's device during recording and copied to the host once, at export.

    Trace rows are therefore the fed tokens (prompt + generated tokens but the last), logical expert ids
    in the engine's order, ``layer_ids`` = decoder indices of the MoE layers only, ``start`` = 0.

    Greedy and sampled decoding (also ``num_return_sequences``) are supported. Beam search reorders the
    cache between steps, so its rows would not follow one sequence: the first reordering of a recorded
    generation's cache raises ``ReplayError`` instead of recording wrong rows.
    """

    def __init__(self, model: nn.Module, *, source: str = "") -> None:
        self.model = model
        self.source = source or f"hf:{type(model).__name__}"
        blocks = moe_blocks(model)
        self.layer_ids = np.array([i for i, _, _ in blocks], dtype=np.int32)
        self._blocks = [b for _, _, b in blocks]
        self.num_experts, self.top_k = num_experts_top_k(self._blocks[0])
        self._handles: list[Any] = []
        self._sessions: list[list[dict[str, Any]]] = []  # per prefill: list of steps
        self._step: dict[str, Any] | None = None

    # -- hooks
    def _decoder(self) -> nn.Module:
        base = getattr(self.model, "model", None)
        return base if isinstance(base, nn.Module) and hasattr(base, "layers") else self.model

    def attach(self) -> RoutingRecorder:
        """Install the hooks (idempotent)."""
        if self._handles:
            return self
        self._handles.append(self._decoder().register_forward_pre_hook(self._on_step, with_kwargs=True))
        for li, block in enumerate(self._blocks):
            self._handles.append(block.register_forward_pre_hook(self._block_pre(li)))
            if hasattr(block, "tokens_per_expert_E"):  # torchtitan's load-balancing counters: not the rollout's
                self._handles.extend(keep_load_balance_counts(block))
            if isinstance(block, HFLocalReplayMoE):
                self._handles.append(block.add_routing_observer(self._on_ids(li)))
            else:  # HF or torchtitan block, or a swapped layer (its router returns the ids it used)
                fam = _family(block)
                router = getattr(block, fam.router_attr)
                self._handles.append(router.register_forward_hook(self._router_hook(li, fam.router_ids_at)))
        return self

    def detach(self) -> None:
        """Remove the hooks; the recorded data stays."""
        for h in self._handles:
            h.remove()
        self._handles = []
        self._step = None

    def __enter__(self) -> RoutingRecorder:
        return self.attach()

    def __exit__(self, *exc: Any) -> None:
        self.detach()

    def clear(self) -> None:
        """Forget everything recorded so far."""
        self._sessions = []
        self._step = None

    def _on_step(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        emb = kwargs.get("inputs_embeds")
        ref = ids if ids is not None else emb
        if ref is None:
            raise ReplayError("RoutingRecorder: a decoder call without input_ids or inputs_embeds")
        B, S = int(ref.shape[0]), int(ref.shape[1])
        mask = kwargs.get("attention_mask")
        if mask is not None and (not torch.is_tensor(mask) or mask.dim() != 2):
            raise ReplayError(f"RoutingRecorder needs a 2-D attention_mask [B, S_total] (or none), got "
                              f"{type(mask).__name__} {tuple(getattr(mask, 'shape', ()))}")
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        self._watch_cache(cache)
        if mask is None:
            past = int(cache.get_seq_length()) if cache is not None and hasattr(cache, "get_seq_length") else 0
            keep = torch.ones(B, S, dtype=torch.bool, device=ref.device)
        else:
            past = int(mask.shape[1]) - S
            keep = mask[:, -S:].bool()
        if past < 0:
            raise ReplayError(f"RoutingRecorder: attention_mask covers {int(mask.shape[1])} positions, fewer "
                              f"than the {S} input tokens")
        if past == 0 or not self._sessions:
            self._sessions.append([])
        elif int(self._sessions[-1][0]["keep"].shape[0]) != B:
            raise ReplayError(f"RoutingRecorder: a decode step with batch {B} follows a prefill with batch "
                              f"{int(self._sessions[-1][0]['keep'].shape[0])}")
        self._step = {"B": B, "S": S, "keep": keep, "ids": [None] * len(self._blocks)}
        self._sessions[-1].append(self._step)

    def _watch_cache(self, cache: Any) -> None:
        """Make a reordering of ``cache`` (beam search) raise while this recorder is attached."""
        if cache is None or not callable(getattr(cache, "reorder_cache", None)):
            return
        if getattr(cache, "_relibra_watched", False):
            return
        original = cache.reorder_cache
        recorder = weakref.ref(self)

        def reorder_cache(beam_idx: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            rec = recorder()
            idx = torch.as_tensor(beam_idx)
            moved = not torch.equal(idx.cpu(), torch.arange(idx.numel()).view(idx.shape))
            if rec is not None and rec._handles and moved:
                raise ReplayError("RoutingRecorder: generate() reordered the KV cache between decode steps (beam "
                                  "search, num_beams > 1), so recorded rows would not follow one sequence; record "
                                  "the rollout with greedy or sampled decoding")
            return original(beam_idx, *args, **kwargs)

        cache.reorder_cache = reorder_cache
        cache._relibra_watched = True

    def _block_pre(self, li: int):
        def hook(module: nn.Module, args: tuple) -> None:
            if self._step is None:  # a block run outside a decoder call (e.g. unit tests): own step
                x = args[0]
                B, S = (int(x.shape[0]), int(x.shape[1])) if x.dim() == 3 else (1, int(x.shape[0]))
                self._sessions.append([])
                self._step = {"B": B, "S": S, "keep": torch.ones(B, S, dtype=torch.bool, device=x.device),
                              "ids": [None] * len(self._blocks), "standalone": True}
                self._sessions[-1].append(self._step)
        return hook

    def _on_ids(self, li: int):
        def observe(ids: torch.Tensor) -> None:
            step = self._step
            if step is None:
                return
            if ids.shape[0] != step["B"] * step["S"]:
                raise ReplayError(f"RoutingRecorder: layer {int(self.layer_ids[li])} routed {ids.shape[0]} tokens, "
                                  f"the step has B*S = {step['B']}*{step['S']}")
            step["ids"][li] = ids.detach().reshape(step["B"], step["S"], -1)
            if step.get("standalone"):
                self._step = None
        return observe

    def _router_hook(self, li: int, ids_at: int = 2):
        observe = self._on_ids(li)

        def hook(module: nn.Module, args: tuple, output: Any) -> None:
            observe(output[ids_at].reshape(-1, output[ids_at].shape[-1]))
        return hook

    # -- export
    def sequences(self, lengths: Any = None) -> list[np.ndarray]:
        """The recorded ids of every sequence: one int ``[S_n, L, k]`` array each (padding removed).

        ``lengths``: optional int ``[N]``, the tokens the training forward feeds for each recorded sequence
        (a trainer that feeds the whole sequence: prompt + completion up to and including its EOS, e.g.
        the ones of its ``attention_mask``). Each sequence is trimmed to its first ``lengths[n]`` rows,
        which drops the pad steps ``generate()`` runs after a sequence's EOS while others continue. The
        forward may feed one token more than was recorded (the last generated token is returned, never
        fed): that token is left to :func:`replay`'s ``unrouted`` rule (routed live by default). A length
        below 1 or more than one past the recorded rows raises ``ReplayError``.
        """
        out: list[np.ndarray] = []
        dtype = np.int16 if self.num_experts <= np.iinfo(np.int16).max else np.int32
        for session in self._sessions:
            steps = [s for s in session if all(x is not None for x in s["ids"])]
            missing = [s for s in session if any(x is None for x in s["ids"])]
            if missing:
                li = [i for i, x in enumerate(missing[0]["ids"]) if x is None]
                raise ReplayError(f"RoutingRecorder: MoE layers {self.layer_ids[li].tolist()} recorded nothing in "
                                  "a step (did the forward fail part-way?)")
            if not steps:
                continue
            ids = torch.cat([torch.stack(s["ids"], dim=2) for s in steps], dim=1).cpu()  # [B, S_tot, L, k]
            keep = torch.cat([s["keep"] for s in steps], dim=1).cpu()                     # [B, S_tot]
            for b in range(ids.shape[0]):
                out.append(ids[b][keep[b]].numpy().astype(dtype))
        if lengths is None:
            return out
        want = np.asarray(lengths)
        if want.ndim != 1 or want.shape[0] != len(out) or not (np.issubdtype(want.dtype, np.integer) or want.size == 0):
            raise ReplayError(f"RoutingRecorder: lengths must be integers [N={len(out)}] (one per recorded "
                              f"sequence), got dtype {want.dtype} shape {tuple(want.shape)}")
        for n, (seq, m) in enumerate(zip(out, want.tolist())):
            if not 1 <= m <= len(seq) + 1:
                raise ReplayError(f"RoutingRecorder: lengths[{n}] = {m}, sequence {n} recorded {len(seq)} fed "
                                  f"tokens; a training forward feeds between 1 and {len(seq) + 1} of them")
        return [seq[:m] for seq, m in zip(out, want.tolist())]

    def traces(self, lengths: Any = None) -> list:
        """One :class:`relibra_moe.trace.RoutingTrace` per recorded sequence, in recording order
        (``lengths``: trim as in :meth:`sequences`)."""
        from ..trace import RoutingTrace

        return [RoutingTrace(seq, self.layer_ids, self.num_experts, self.top_k, 0, self.source)
                for seq in self.sequences(lengths)]

    def trace_batch(self, micro_batch: np.ndarray | None = None, *, lengths: Any = None) -> TraceBatch:
        """All recorded sequences as a :class:`relibra_moe.trace.TraceBatch` (``micro_batch``: int32 ``[N]``
        micro-batch of each sequence, or ``None``; ``lengths``: trim as in :meth:`sequences`)."""
        from ..trace import TraceBatch

        return TraceBatch(self.traces(lengths), micro_batch, source=self.source)


# ------------------------------------------------------------------------------------- swapped block
class HFLocalReplayMoE(nn.Module):
    """An HF MoE block that follows replayed routing, computed in this process (all experts local).

    The single-process back end of :func:`swap_moe_blocks` (``backend="local"``): HF's eager expert
    loop, numerically the HF block.

    It keeps HF's own submodules under their HF names (the router instance, so ``output_router_logits``
    hooks and the aux loss keep working; the fused ``experts`` parameters; shared experts and their
    gate), so ``state_dict()`` keys and values are those of the original block.

    ``forward(hidden [B, S, H])`` returns what the HF block returns (GPT-OSS: ``(hidden, router_scores)``).
    Without replay it routes live and is numerically the HF block. Under :func:`replay` the ids come
    from the trace and the gate values are recomputed from the live logits with the family's gate
    function (so the router gets gradients); ``-1`` ids (padding) are served by no expert, ``LIVE`` rows
    (tokens the rollout never routed) are routed live.

    Experts run as a loop over the experts that have tokens, in ascending id order (HF's eager order).

    Attributes:
        family: the :class:`~relibra_moe.integrations.hf_families.Family`.
        layer_id: decoder layer index.
        last_expert_counts: int64 ``[E]`` tokens per expert in the last forward (valid ids only).
    """

    swapped_moe_block = True  # marks the blocks swap_moe_blocks makes

    def __init__(self, block: nn.Module, layer_id: int) -> None:
        super().__init__()
        fam = family_of(block)
        if fam is None:
            raise ValueError(f"{type(block).__name__} is not a supported MoE block; supported: "
                             f"{', '.join(SUPPORTED_BLOCKS)}")
        self.family: Family = fam
        self.layer_id = int(layer_id)
        self.hf_class = type(block).__name__
        for name, child in block.named_children():
            self.add_module(name, child)
        for name, buf in block.named_buffers(recurse=False):
            self.register_buffer(name, buf)
        for name, p in block.named_parameters(recurse=False):
            self.register_parameter(name, p)
        if fam.jitter:
            self.jitter_noise = float(getattr(block, "jitter_noise", 0.0))
        router = getattr(self, fam.router_attr)
        self.num_experts, self.top_k = int(router.num_experts), int(router.top_k)
        self.replay_state: LayerReplay | None = None  # set by relibra_moe.replay
        self._observers: dict[int, Any] = {}
        self._next_observer = 0
        self.last_expert_counts: torch.Tensor | None = None

    def extra_repr(self) -> str:
        return f"family={self.family.name}, layer_id={self.layer_id}, E={self.num_experts}, k={self.top_k}"

    def prepare_replay(self, ids: torch.Tensor | None = None, plan: Any = None,
                       micro_batch: int | None = None) -> LayerReplay:
        """What the block follows inside :func:`relibra_moe.replay`: the replayed ``ids [T, k]`` (checked
        here, ``ReplayError``; ``None``: live routing). Every expert is local, so a plan may only be one
        of a single GPU (all experts home; it is not needed further)."""
        if plan is not None:
            from ..plan import BatchPlan

            G = plan.num_gpus if isinstance(plan, BatchPlan) else int(plan.replica_expert.shape[2])
            if G != 1:
                raise ReplayError(f"replay: a plan for {G} GPUs needs ReplayBalancedMoE layers; layer "
                                  f"{self.layer_id} runs on the single-process 'local' backend")
        if ids is not None:
            from ..layers.router import check_replay_ids

            ids = torch.as_tensor(ids)
            ids = check_replay_ids(ids, int(ids.shape[0]) if ids.dim() else 0, self.top_k, self.num_experts,
                                   f"{self.layer_id}", allow_live=True)
        return LayerReplay(ids=ids)

    # -- routing observers (the recorder uses them)
    def add_routing_observer(self, fn: Callable[[torch.Tensor], None]) -> Any:
        """Call ``fn(ids [T, k])`` with the ids every forward uses; returns a handle with ``remove()``."""
        key = self._next_observer
        self._next_observer += 1
        self._observers[key] = fn
        block = self

        class _Handle:
            def remove(self) -> None:
                block._observers.pop(key, None)

        return _Handle()

    # -- forward
    def route(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(logits [T, E], gates [T, k], ids [T, k] int64)`` for ``hidden [B, S, H]``."""
        fam = self.family
        router = getattr(self, fam.router_attr)
        H = hidden.shape[-1]
        x = hidden if fam.router_input_3d else hidden.reshape(-1, H)
        logits, gates, ids = router(x)
        state = self.replay_state
        if state is not None and state.ids is not None:
            rids = state.ids
            T = logits.shape[0]
            if rids.shape[0] != T:
                raise ReplayError(f"layer {self.layer_id}: replayed routing covers {rids.shape[0]} tokens "
                                  f"({state.desc}), the forward has {T} tokens (hidden {tuple(hidden.shape)})")
            live_ids = ids
            ids = merge_live(rids.to(logits.device), lambda: live_ids)  # never-routed tokens: live top-k
            gates = fam.gates(router, logits, ids)
        return logits, gates, ids.long()

    def forward(self, hidden_states: torch.Tensor):
        fam = self.family
        if fam.jitter and self.training and self.jitter_noise > 0:
            hidden_states = hidden_states * torch.empty_like(hidden_states).uniform_(
                1.0 - self.jitter_noise, 1.0 + self.jitter_noise)
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])
        logits, gates, ids = self.route(hidden_states)
        for fn in list(self._observers.values()):
            fn(ids)
        valid = ids >= 0
        with torch.no_grad():
            self.last_expert_counts = torch.bincount(ids[valid], minlength=self.num_experts)
        out = self.local_experts(x, ids, gates)
        if fam.shared is not None:
            shared_name, gate_name = fam.shared
            sh = getattr(self, shared_name)(x)
            if gate_name is not None:
                sh = torch.sigmoid(getattr(self, gate_name)(x)) * sh
            out = out + sh
        out = out.reshape(shape)
        return (out, gates) if fam.returns_scores else out

    def local_experts(self, x: torch.Tensor, ids: torch.Tensor, gates: torch.Tensor) -> torch.Tensor:
        """Routed experts on this process, all experts local: ``x [T, H]`` -> ``[T, H]``.

        Experts run in ascending id order and their outputs are added per token in that order (as HF's
        eager path does), so without replay the block is numerically the HF block.
        """
        out = torch.zeros_like(x)
        with torch.no_grad():
            flat = ids.reshape(-1)
            hit = torch.unique(flat[flat >= 0]).tolist()
        experts = self.experts
        for e in hit:
            token_idx, pos = torch.where(ids == e)
            y = self.family.expert(experts, e, x[token_idx]) * gates[token_idx, pos, None]
            out.index_add_(0, token_idx, y.to(out.dtype))
        return out


# ------------------------------------------------------------------------------------------- swap
BACKENDS = ("auto", "layer", "local")


def swap_moe_blocks(model: nn.Module, *, ep_group: Any = None, replica_slots: int = 0,
                    gpus_per_node: int | None = None, backend: str = "auto", dispatcher: Any = "auto") -> nn.Module:
    """Replace every supported MoE block of ``model`` by a replay-capable block, in place.

    The new blocks adopt the HF block's submodules (same objects, same names, same order), so
    ``state_dict()``, ``save_pretrained()`` and reloading (into the plain HF class, or into a swapped
    model) round-trip unchanged on one rank, and ``output_router_logits`` / the aux loss keep working
    (HF's router instance is kept, with its hooks).

    Args:
        model: an HF ``*ForCausalLM`` (or its base model) of a supported family.
        ep_group: ``torch.distributed`` process group of expert parallelism (``None``: the world when
            ``torch.distributed`` is initialized, else one rank), or a ``DeviceMesh`` (1-D, or with an
            ``"ep"`` dimension: that dimension's group; see ``docs/fsdp.md``). With G ranks every rank keeps only
            its E/G home experts (static placement ``e // (E/G)``) under the HF parameter names.
        replica_slots: r replica slots per rank, one :class:`~relibra_moe.integrations.hf_layer.HFReplicaBuffer`
            shared by all MoE layers of the model.
        gpus_per_node: ranks per node of the EP group (replicas stay inside a node).
        backend: ``"layer"``: :class:`~relibra_moe.integrations.hf_layer.HFReplayMoE` (a
            ``ReplayBalancedMoE``: expert parallelism, replica plans, relayout; every family, GPT-OSS
            included: its expert biases travel with the experts); ``"local"``: :class:`HFLocalReplayMoE`
            (one process, HF's eager expert loop); ``"auto"``: ``"layer"``.
        dispatcher: passed to ``ReplayBalancedMoE`` (``"auto"``, ``"alltoall"``, ``"deepep"`` or an object).

    Swap after moving the model to its final device and dtype: the replica buffer is allocated here.

    With an EP group of several ranks the expert parameters are listed in
    ``_ddp_params_and_buffers_to_ignore`` of the model and its submodules down to the blocks
    (:func:`relibra_moe.layers.data_parallel.mark_experts_for_ddp`), so ``DistributedDataParallel`` (also
    through accelerate / the HF ``Trainer``) leaves them alone; under DDP the layers scale their expert
    gradients by 1 / world size like DDP's averaging of the dense ones (docs/hf.md, "Several ranks: DDP,
    accelerate").

    Returns:
        ``model`` (modified in place). Already swapped blocks are left as they are.

    Raises:
        ValueError: the model has no supported MoE block (the message lists the supported classes), or
            the ``"local"`` backend with an EP group of more than one rank or replica slots.
    """
    ep_group = ep_process_group(ep_group)  # a DeviceMesh (1-D, or with an "ep" dimension) -> its process group
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is not one of {BACKENDS}")
    check_int("replica_slots", replica_slots, error=ValueError)
    todo = [(index, layer_id, name, block) for index, (layer_id, name, block) in enumerate(moe_blocks(model))
            if not _is_swapped(block)]
    kinds = _check_swap(todo, backend, replica_slots, gpus_per_node, _group_size(ep_group))
    saved = _snapshot(model, todo)
    try:
        buffer = None
        for (index, layer_id, name, block), kind in zip(todo, kinds, strict=True):
            if kind == "titan":  # torchtitan: always the layer (see integrations/torchtitan.py)
                if replica_slots and buffer is None:
                    buffer = titan_replica_buffer(block, replica_slots)
                new = TorchtitanReplayMoE(block, layer_id, index, ep_group=ep_group, gpus_per_node=gpus_per_node,
                                          replica_buffer=buffer, dispatcher=dispatcher)
            elif kind == "layer":
                if replica_slots and buffer is None:
                    buffer = hf_replica_buffer(block, replica_slots)
                new = HFReplayMoE(block, layer_id, index, ep_group=ep_group, gpus_per_node=gpus_per_node,
                                  replica_buffer=buffer, dispatcher=dispatcher)
                new.train(block.training)
            else:
                new = HFLocalReplayMoE(block, layer_id)
                new.train(block.training)
            model.set_submodule(name, new)
        mark_experts_for_ddp(model)  # DDP / accelerate must never average experts sharded by expert parallelism
    except BaseException:
        _restore(model, saved)  # a failure part way leaves the model as it was: a retry starts clean
        raise
    return model


def _check_swap(todo: list[tuple[int, int, str, nn.Module]], backend: str, replica_slots: int,
                gpus_per_node: int | None, world: int) -> list[str]:
    """What each block to swap becomes (``"titan"``, ``"layer"``, ``"local"``), after every check that can fail
    for any block ran, before the first block changes: the backend for its family, the EP group size dividing
    E and divided by ``gpus_per_node``, and ``replica_slots`` at most the ceiling ``E - E/G``
    (:func:`relibra_moe.plan.check_replica_slots`, the Planner's), so no buffer is allocated for nothing.
    ValueError naming the block and the value."""
    if gpus_per_node is not None:
        check_int("gpus_per_node", gpus_per_node, 1, error=ValueError)
        if world % gpus_per_node:
            raise ValueError(f"gpus_per_node={gpus_per_node} does not divide the EP group size {world}")
    kinds = []
    for _, _, name, block in todo:
        if is_titan_moe(block):
            if backend == "local":
                raise ValueError(f"torchtitan's MoE ({name}) runs as a ReplayBalancedMoE only; use backend='layer'")
            if getattr(block.router, "_debug_force_load_balance", False):
                raise ValueError(f"{name}: torchtitan's _debug_force_load_balance routing is not supported by the "
                                 "swapped block")
            kinds.append("titan")
            router = block.router
        else:
            fam = family_of(block)
            use_layer = backend == "layer" or (backend == "auto" and fam.name in LAYER_FAMILIES)
            if use_layer and fam.name not in LAYER_FAMILIES:
                raise ValueError(f"{fam.name} ({type(block).__name__}) cannot run as a ReplayBalancedMoE; use "
                                 f"backend='local'. Layer families: {', '.join(LAYER_FAMILIES)}")
            if not use_layer:
                if world > 1 or replica_slots:
                    raise ValueError(f"the single-process 'local' backend ({fam.name}, {type(block).__name__}) runs "
                                     f"no EP group ({world} ranks) and no replica slots (replica_slots="
                                     f"{replica_slots}); use backend='layer'")
                kinds.append("local")
                continue
            kinds.append("layer")
            router = getattr(block, fam.router_attr)
        E = int(router.num_experts)
        if E % world:
            raise ValueError(f"{name}: num_experts={E} is not divisible by the EP group size {world}")
        check_replica_slots(replica_slots, E, world, field=f"{name}: replica_slots")
    return kinds


def _snapshot(model: nn.Module, todo: list[tuple[int, int, str, nn.Module]]) -> list[Any]:
    """What :func:`_restore` needs to undo a swap: each block's place in ``model`` and, for every module in
    it, its class and its attribute, parameter, buffer and child tables (references, nothing copied)."""
    state = snapshot_modules([model, *(mod for _, _, _, block in todo for mod in block.modules())])
    return [[(name, block) for _, _, name, block in todo], state]


def _restore(model: nn.Module, saved: list[Any]) -> None:
    places, state = saved
    restore_modules(state)
    for name, block in places:
        model.set_submodule(name, block)


def check_replay_trainer_args(model: Any, *, strategy: Any, replica_slots: Any, planner: Any,
                              planner_options: Any, gpus_per_node: Any, cluster: Any) -> None:
    """The checks of ``ReplayGRPOTrainer``'s own arguments, run before TRL loads anything: ``strategy`` a
    planner strategy, ``replica_slots`` an int >= 0 at most the ceiling ``E - E/G`` (:func:`plan.check_replica_slots`;
    G from ``torch.distributed`` or ``WORLD_SIZE``, the loosest group G = E on one process, where the trainer plans
    no replicas; E from ``model`` when it is a module, else :data:`specs.MODEL_LIMITS`' expert bound),
    ``planner_options`` known :class:`~relibra_moe.planners.options.PlanOptions` that apply to ``strategy``,
    ``planner`` a :class:`~relibra_moe.planners.service.Planner` or None, ``gpus_per_node`` an int >= 1 or None,
    ``cluster`` a ClusterSpec or None. ReplayError naming the argument and the value."""
    import os

    import torch.distributed as dist

    from ..planners.options import PlanOptions
    from ..planners.service import Planner
    from ..planners.strategies import check_strategy
    from ..specs import MODEL_LIMITS, ClusterSpec
    from ..validate import check_optional_int

    what = "ReplayGRPOTrainer"
    try:
        check_strategy(strategy)
        if planner_options is not None and not isinstance(planner_options, dict):
            raise ReplayError(f"planner_options={planner_options!r} must be a dict of plan options or None")
        PlanOptions.from_kwargs(**(planner_options or {})).check_for(strategy)
    except (ReplayError, ValueError, TypeError) as exc:
        raise ReplayError(f"{what}: {exc}") from None
    if planner is not None and not isinstance(planner, Planner):
        raise ReplayError(f"{what}: planner={planner!r} must be a relibra_moe.Planner or None")
    if cluster is not None and not isinstance(cluster, ClusterSpec):
        raise ReplayError(f"{what}: cluster={cluster!r} must be a relibra_moe.ClusterSpec or None")
    check_optional_int(f"{what}: gpus_per_node", gpus_per_node, 1, error=ReplayError)
    slots = check_int(f"{what}: replica_slots", replica_slots, error=ReplayError)
    blocks = moe_blocks(model) if isinstance(model, nn.Module) else []
    E = num_experts_top_k(blocks[0][2])[0] if blocks else MODEL_LIMITS["num_experts"]
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else \
        int(os.environ.get("WORLD_SIZE", "1") or 1)
    G = world if world > 1 and E % world == 0 else E
    try:
        check_replica_slots(slots, E, G, field=f"{what}: replica_slots")
    except PlanError as exc:
        raise ReplayError(str(exc)) from None


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's ``state_dict()`` with every expert parameter whole ``[E, ...]`` in logical expert order.

    With an EP group of G ranks each rank holds only its home experts' rows (in its current placement,
    after any ``relayout``); this all-gathers them over each layer's group
    (:func:`~relibra_moe.layers.expert_sharding.gather_experts`, one collective per expert tensor, in
    module order) and puts row e back at position e, so the result is the plain HF state dict on every
    rank (``save_pretrained`` from one rank, ``load_state_dict`` into the HF class). A collective when
    G > 1: every rank of the group must call it; a plain ``state_dict()`` copy otherwise.
    """
    sd = dict(model.state_dict())
    params = model.state_dict(keep_vars=True)  # the parameters: state_dict() may hold ShardedTensors (DCP hooks)
    for key, shard in expert_shards(model).items():
        if key in sd and shard.world_size > 1:
            sd[key] = gather_experts(params[key], shard)
    return sd


def load_full_state_dict(model: nn.Module, state_dict: dict[str, torch.Tensor], strict: bool = True) -> Any:
    """Load a whole state dict (``full_state_dict``'s or the plain HF model's: experts ``[E, ...]`` in logical
    order) into a swapped model: each rank keeps the rows of its current home experts
    (:func:`~relibra_moe.layers.expert_sharding.local_experts`; restore a placement first, with
    :func:`relibra_moe.relayout`, if the homes must be those of a saved run). Works on any EP size that
    divides E; no collective. Returns ``load_state_dict``'s result (``strict`` as there).
    """
    sd = dict(state_dict)
    for key, shard in expert_shards(model).items():
        if key in sd:
            sd[key] = local_experts(sd[key], shard)
    return model.load_state_dict(sd, strict=strict)


def checkpoint_state_dict(model: nn.Module, saved: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A ``save_pretrained`` file's tensors under the model's own ``state_dict()`` keys.

    transformers 5 saves fused expert tensors in the checkpoint layout (one ``experts.{e}.gate_proj.weight``
    per expert, ...) through the model's weight-conversion mapping and converts back only in
    ``from_pretrained``; a plain ``load_state_dict`` of the file (the ``Trainer``'s resume) misses every
    expert tensor. This applies the same mapping forwards with transformers' own transforms (the
    inverse of ``transformers.core_model_loading.revert_weight_conversion``), so the result loads with
    :func:`load_full_state_dict`.
    """
    from copy import deepcopy

    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import (
        PrefixChange,
        WeightConverter,
        WeightRenaming,
        apply_converters,
        apply_renamings,
        dot_natural_key,
    )

    conversions = getattr(model, "_weight_conversions", None)
    if conversions is None:  # as revert_weight_conversion: a model not made by from_pretrained has no prefix change
        conversions = [c for c in get_model_conversion_mapping(model, add_legacy=False)
                       if not isinstance(c, PrefixChange)]
    renamings = [c for c in conversions if isinstance(c, WeightRenaming)]
    converters = [c for c in conversions if isinstance(c, WeightConverter)]
    by_pattern = {p: c for c in converters for p in c.source_patterns}
    out: dict[str, torch.Tensor] = {}
    pending: dict[str, Any] = {}
    for key, tensor in sorted(saved.items(), key=lambda kv: dot_natural_key(kv[0])):
        renamed = apply_renamings(key, renamings)
        target, pattern = apply_converters(renamed, converters)
        if pattern is None:
            out[renamed] = tensor
        else:
            pending.setdefault(target, deepcopy(by_pattern[pattern])).add_tensor(target, key, pattern, tensor)
    for first, converter in pending.items():
        for name, value in converter.convert(first, model=model, config=model.config).items():
            out[name] = value[0] if isinstance(value, list) else value
    return out


def _group_size(ep_group: Any) -> int:
    import torch.distributed as dist

    if ep_group is None and not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size(ep_group)


#: Deprecated names (the swapped blocks are named ``<Framework>ReplayMoE``): still importable, with a warning.
DEPRECATED_NAMES = {"ReplayMoEBlock": "HFLocalReplayMoE"}
__getattr__ = deprecated_names(__name__, DEPRECATED_NAMES, globals())
