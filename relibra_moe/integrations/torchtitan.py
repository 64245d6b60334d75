"""torchtitan 0.3 MoE models (Qwen3 MoE, DeepSeek-V3, any model built on ``torchtitan.models.common.moe.MoE``)
with relibra's replay-balanced layer.

:func:`relibra_moe.swap_moe_blocks`, :class:`relibra_moe.RoutingRecorder` and :func:`relibra_moe.replay` find
torchtitan's ``MoE`` blocks (``layers.<i>.moe``) beside the Hugging Face ones; this module holds what differs.
:class:`TorchtitanReplayMoE` is a :class:`~relibra_moe.layers.moe.ReplayBalancedMoE` made of torchtitan's own
submodules, under torchtitan's names, so ``model.state_dict()`` keys are unchanged by the swap:

- ``router`` is torchtitan's ``TokenChoiceTopKRouter`` *instance* (class switched to a subclass): live routing
  is torchtitan's own (softmax / sigmoid scores, the ``expert_bias_E`` load-balancing bias in the selection,
  node-limited groups, ``route_norm``, ``route_scale``); with replayed ids the gates are torchtitan's gate
  values of those ids from the live scores: ``scores[id]`` (no bias), ``/ (sum + 1e-20)`` when
  ``route_norm``, ``* route_scale``; a ``-1`` id gets 0;
- ``routed_experts.inner_experts`` is torchtitan's ``GroupedExperts`` instance: its parameters ``w1_EFD [E, F, D]``,
  ``w3_EFD [E, F, D]``, ``w2_EDF [E, D, F]`` are the layer's per-expert tensors as they are (the same
  ``Parameter`` objects, no copy on one rank; the grouped GEMMs read transposed views). Like torchtitan it
  computes the GEMMs in bf16 (``compute_dtype``; ``None``: the weights' dtype) and returns the input's dtype.
  With an EP group of G ranks each rank keeps the rows of its E/G home experts (new, smaller parameters;
  ``relibra_moe.integrations.hf.full_state_dict`` gathers them back in expert order);
- ``shared_experts`` (DeepSeek-V3) is applied to every token and added, as torchtitan does;
- the buffers ``expert_bias_E`` (persistent) and ``tokens_per_expert_E`` stay on the block under their names;
  in training mode every forward adds the routed ids' per-expert token counts (the replayed ids under
  replay: the routing the step used) to ``tokens_per_expert_E``, which torchtitan's load-balancing hook reads
  and zeroes in its optimizer pre-step (``register_moe_load_balancing_hook``).

The routed output is the gate-weighted sum of the k expert outputs in fp32 (torchtitan also weights in
fp32), cast to the input's dtype.

In torchtitan's training path the block is also a torchtitan ``Module`` (its class gains torchtitan's ``Module`` as
a base at the swap): ``init_states`` / ``init_weights`` after a meta-device build re-zero its buffers
(:meth:`TorchtitanReplayMoE._init_self_buffers`), torchtitan's ``parallelize`` reaches it
(:meth:`TorchtitanReplayMoE.parallelize`: relibra's expert rows stay out of torchtitan's EP and FSDP), and under
EP its ``state_dict()`` gives the experts as DCP ShardedTensors at their logical offsets
(:func:`relibra_moe.layers.expert_sharding.install_sharded_state_dict`), so torchtitan's ``CheckpointManager``
saves and restores every expert. :func:`keep_load_balance_counts` keeps a recorded forward out of
``tokens_per_expert_E``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..layers.dispatch import ep_process_group, get_dispatcher
from ..layers.expert_sharding import install_sharded_state_dict
from ..layers.experts import GroupedExperts, slot_view
from ..layers.moe import ReplayBalancedMoE
from ..layers.replica_buffer import LayerSharedReplicaBuffer
from ..layers.router import check_replay_ids
from ..triton_kernels.grouped_gemm import grouped_mm
from ..triton_kernels.routing import RoutingMeta
from .adopted import AdoptedBlockMoE, RouterTuple, keep_home_rows
from .hf_families import Family
from .upstream_torchtitan import as_grouped_experts, as_titan_module, forces_load_balance, replay_router

__all__ = ["TorchtitanReplayMoE", "TITAN_FAMILY", "clip_grad_norm_", "is_titan_moe", "keep_load_balance_counts",
           "parallel_dims_error", "reduce_expert_grads", "register_expert_grad_reduction", "titan_gates",
           "titan_replica_buffer"]

TITAN_EXPERT_TENSORS = ("w1_EFD", "w3_EFD", "w2_EDF")


def is_titan_moe(module: nn.Module) -> bool:
    """Whether ``module`` is torchtitan's ``MoE`` block (checked by class, without importing torchtitan)."""
    cls = type(module)
    return cls.__name__ == "MoE" and cls.__module__.startswith("torchtitan.")


def titan_gates(router: nn.Module, scores: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """torchtitan's gate values of given ids: ``scores [T, E]`` (after softmax / sigmoid, fp32), ``ids [T, k]``
    (``-1``: none, gate 0) -> ``[T, k]``: ``scores[id]``, renormalized (``+ 1e-20``) when ``route_norm``, times
    ``route_scale``."""
    valid = ids >= 0
    g = scores.gather(1, ids.clamp_min(0)) * valid
    if router.route_norm:
        g = g / (g.sum(dim=-1, keepdim=True) + 1e-20)
    return g * router.route_scale


def _titan_expert(experts: nn.Module, e: int, x: torch.Tensor) -> torch.Tensor:
    """One torchtitan expert in the weights' dtype: ``w2 (silu(w1 x) * w3 x)``, ``x [R, D] -> [R, D]``."""
    return F.linear(F.silu(F.linear(x, experts.w1_EFD[e])) * F.linear(x, experts.w3_EFD[e]), experts.w2_EDF[e])


#: The recorder's view of an unswapped torchtitan block: its router returns ``(topk_scores [B, L, K],
#: topk_expert_ids [B, L, K], scores [B, L, E])``, so the ids are item 1.
TITAN_FAMILY = Family("torchtitan", "MoE", "router", titan_gates, _titan_expert, router_ids_at=1)
#: A swapped block's: its router returns ``(scores, gates, ids)`` like the HF layer's, ids at item 2.
SWAPPED_TITAN_FAMILY = Family("torchtitan", "MoE", "router", titan_gates, _titan_expert)


class _TitanRouterMixin:
    """Adds ``replay_ids`` to torchtitan's router; ``x [T, D]`` in, ``(scores [T, E], gates [T, k], ids [T, k])``
    out (a ``RouterOutput``-like tuple). The block sets ``block_expert_bias`` (its ``expert_bias_E``) before a
    forward."""

    name: str = "moe"
    block_expert_bias: torch.Tensor | None = None

    def forward(self, x: torch.Tensor, replay_ids: torch.Tensor | None = None, **_: Any) -> RouterTuple:
        topk_scores, topk_ids, scores = super().forward(x.unsqueeze(0), self.block_expert_bias)
        scores, gates, ids = scores[0], topk_scores[0], topk_ids[0]
        if replay_ids is not None:
            ids = check_replay_ids(replay_ids.to(scores.device), scores.shape[0], self.top_k, self.num_experts,
                                   self.name)
            gates = titan_gates(self, scores, ids)
        return RouterTuple((scores, gates, ids.long()))


class _TitanExpertsMixin(GroupedExperts):
    """torchtitan's ``GroupedExperts`` as the layer's experts: ``w1_EFD``, ``w3_EFD``, ``w2_EDF`` (each applied as
    ``x @ W.T``: transposed views, no copy), GEMMs in ``compute_dtype`` as torchtitan computes them."""

    tensor_names = TITAN_EXPERT_TENSORS
    block_m: int | None = None
    #: dtype of the GEMM inputs (torchtitan's GroupedExperts casts rows and weights to bf16); None: the weights'.
    compute_dtype: torch.dtype | None = torch.bfloat16

    @property
    def num_local(self) -> int:
        return int(self.w1_EFD.shape[0])

    def _dtype(self, like: torch.Tensor) -> torch.dtype:
        return self.compute_dtype if self.compute_dtype is not None else like.dtype

    def slot_tensors(self, home: Sequence[torch.Tensor], slots: Sequence[torch.Tensor] | None) -> list:
        dt = self._dtype(home[0])
        home = [h.to(dt) for h in home]
        slots = None if slots is None else [s.to(dt) for s in slots]
        return [slot_view(h, None if slots is None else s, transpose=True)
                for h, s in zip(home, slots or [None] * len(home), strict=True)]

    def mlp(self, xs: torch.Tensor, meta: RoutingMeta, tensors: Sequence) -> torch.Tensor:
        w1, w3, w2 = tensors
        xs = xs.to(self._dtype(self.w1_EFD))
        h = F.silu(grouped_mm(xs, w1, meta)) * grouped_mm(xs, w3, meta)
        return grouped_mm(h, w2, meta)


def titan_replica_buffer(block: nn.Module, slots: int) -> LayerSharedReplicaBuffer:
    """A layer-shared replica buffer of ``slots`` slots for torchtitan experts (members ``w1_EFD [F, D]``,
    ``w3_EFD [F, D]``, ``w2_EDF [D, F]``), in the experts' dtype and device."""
    experts = block.routed_experts.inner_experts
    w1 = experts.w1_EFD
    shapes = {n: tuple(getattr(experts, n).shape[1:]) for n in TITAN_EXPERT_TENSORS}
    return LayerSharedReplicaBuffer(int(w1.shape[2]), int(w1.shape[1]), slots, dtype=w1.dtype, device=w1.device,
                                    shapes=shapes)


class TorchtitanReplayMoE(AdoptedBlockMoE):
    """torchtitan's ``MoE`` block running as a :class:`ReplayBalancedMoE` (see the module docstring).

    Args:
        block: torchtitan's ``MoE`` (its submodules and buffers are adopted, not copied).
        layer_id: decoder layer index (for traces). layer_index: index among the model's MoE layers.
        ep_group, gpus_per_node, replica_buffer, dispatcher: as for ``ReplayBalancedMoE``.

    ``forward(x [B, L, D]) -> [B, L, D]``.
    """

    framework = "torchtitan"
    family = SWAPPED_TITAN_FAMILY
    _parallelized = False  # set by parallelize (torchtitan's Module declares the same flag)
    _expert_dp_groups: tuple = ()  # set by parallelize: groups of ranks holding the same experts
    _expert_grads_reduced = False  # set by register_expert_grad_reduction
    experts_path = "routed_experts.inner_experts"  # where full_state_dict finds the expert parameters

    def __init__(self, block: nn.Module, layer_id: int, layer_index: int, *, ep_group: Any = None,
                 gpus_per_node: int | None = None, replica_buffer: LayerSharedReplicaBuffer | None = None,
                 dispatcher: Any = "auto") -> None:
        if not is_titan_moe(block):
            raise ValueError(f"{type(block).__module__}.{type(block).__name__} is not torchtitan's MoE block")
        router, experts = block.router, block.routed_experts.inner_experts
        if forces_load_balance(router):
            raise ValueError("torchtitan's _debug_force_load_balance routing is not supported by the swapped block")
        E, k = int(router.num_experts), int(router.top_k)
        hidden, ffn = int(experts.w1_EFD.shape[2]), int(experts.w1_EFD.shape[1])
        ep_group = ep_process_group(ep_group)  # a DeviceMesh (1-D, or its "ep" dimension) -> its process group
        if isinstance(dispatcher, str):
            dispatcher = get_dispatcher(ep_group, gpus_per_node, dispatcher)
        G, rank = dispatcher.world_size, dispatcher.rank
        if E % G:
            raise ValueError(f"num_experts={E} is not divisible by the EP group size {G}")
        replay_router(router, _TitanRouterMixin)
        as_grouped_experts(experts, _TitanExpertsMixin)
        keep_home_rows(experts, TITAN_EXPERT_TENSORS, rank, E, G)
        super().__init__(hidden, ffn, E, k, ep_group=ep_group, gpus_per_node=gpus_per_node,
                         replica_buffer=replica_buffer, router=router, shared_expert=None, layer_index=layer_index,
                         dispatcher=dispatcher, experts=experts, router_attr="router")
        self.layer_id = int(layer_id)
        self.load_balance_coeff = block.load_balance_coeff
        self.adopt(block, buffers=True)  # torchtitan's submodules and buffers under their names, in their order
        if "expert_bias_E" not in self._buffers:
            self.expert_bias_E = None
        self.train(block.training)
        install_sharded_state_dict(self)  # under EP, state_dict() describes every expert to DCP
        as_titan_module(self)  # a torchtitan Module: init_states, parallelize

    @property
    def experts(self) -> nn.Module:
        """torchtitan's ``GroupedExperts`` (``routed_experts.inner_experts``), the layer's experts."""
        mods = self._modules
        return mods["routed_experts"].inner_experts if "routed_experts" in mods else mods["experts"]

    # ------------------------------------------------------------ torchtitan's Module protocol
    def _init_self_buffers(self, *, buffer_device: torch.device | None = None) -> None:
        """torchtitan's buffer init (``init_states`` / ``init_weights`` after ``to_empty``): ``tokens_per_expert_E``
        and ``expert_bias_E`` zeroed as torchtitan's ``MoE`` does, ``expert_gpu`` back to the static placement
        ``e // E_loc`` (the experts' rows are freshly initialized too), and replica slots allocated beside the
        experts when the block was swapped on the meta device."""
        device = self.experts.w1_EFD.device if buffer_device is None else torch.device(buffer_device)
        with torch.no_grad():
            self.tokens_per_expert_E = torch.zeros(self.num_experts, dtype=torch.float32, device=device)
            if self.load_balance_coeff is not None:
                self.expert_bias_E = torch.zeros(self.num_experts, dtype=torch.float32, device=device)
            self.expert_gpu = torch.arange(self.num_experts, dtype=torch.int64, device=device) // self.num_local
        rb = self.replica_buffer
        if rb is not None and rb.device != self.experts.w1_EFD.device:  # scratch slots: allocate, no values
            rb._slot_tensors = {n: torch.zeros_like(t, device=self.experts.w1_EFD.device)
                                for n, t in rb._slot_tensors.items()}

    def parallelize(self, parallel_dims: Any) -> None:
        """torchtitan's ``Module.parallelize`` for the swapped block (``model.parallelize`` in torchtitan's
        ``parallelize_fn`` calls it), so torchtitan's parallelization runs unchanged on a swapped model.

        The router and shared experts are parallelized the torchtitan way. The routed experts are relibra's:
        with an EP group of G > 1 ranks (which must be ``parallel_dims``' ``ep`` mesh: swap with
        ``ep_group=parallel_dims.get_mesh("ep")``) they are neither distributed by torchtitan's expert parallelism
        nor sharded by its FSDP (the ``routed_experts`` module gets a ``fully_shard`` that ignores its
        parameters, so the decoder layer's ``fully_shard`` skips it); with G = 1 torchtitan's FSDP shards them as
        in the plain model. A configuration the block cannot run raises ``ValueError`` on every rank (see
        :func:`parallel_dims_error`).
        """
        import torch.distributed as dist

        if self._parallelized:
            raise ValueError(f"{self.name}: TorchtitanReplayMoE has already been parallelized")
        error = parallel_dims_error(self, parallel_dims)
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            errors: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(errors, error)  # a wrong group on one rank must stop every rank
            bad = [r for r, e in enumerate(errors) if e]
            error = f"rank {bad[0]}: {errors[bad[0]]}" if bad else None
        if error:
            raise ValueError(error)
        self._parallelized = True
        for name in ("router", "shared_experts"):
            if self._modules.get(name) is not None:
                _parallelize_titan(self._modules[name], parallel_dims)
        if self.world_size > 1:
            from torch.distributed.fsdp import fully_shard

            self._expert_dp_groups = _expert_dp_groups(parallel_dims)
            experts = self._modules["routed_experts"]
            fully_shard(experts, mesh=parallel_dims.world_mesh, ignored_params=set(experts.parameters()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._expert_dp_groups and not self._expert_grads_reduced \
                and self.training and torch.is_grad_enabled():
            raise ValueError(f"{self.name}: {len(self._expert_dp_groups)} mesh dimension(s) of ranks hold the same "
                             "experts and nothing sums their gradients: register_expert_grad_reduction(optimizers, "
                             "model_parts) (replay_model_spec does)")
        self.router.block_expert_bias = self._buffers.get("expert_bias_E")
        out = super().forward(x)
        ids = self.last_routing
        if self.training:
            with torch.no_grad():
                flat = ids[ids >= 0].reshape(-1)
                self.tokens_per_expert_E.add_(torch.bincount(flat, minlength=self.num_experts).to(
                    self.tokens_per_expert_E.dtype))
        shared = self._modules.get("shared_experts")
        if shared is not None:
            out = out + shared(x)
        return out


def parallel_dims_error(block: TorchtitanReplayMoE, parallel_dims: Any) -> str | None:
    """Why ``block`` cannot run under torchtitan's ``parallel_dims`` (``None``: it can).

    Supported: the ``partial_dtensor`` SPMD backend; FSDP / HSDP; expert parallelism over ``parallel_dims``'
    ``ep`` mesh (the block's EP group, ``ep`` ranks; with ``dp_replicate * dp_shard * cp > ep`` several ranks hold
    the same experts and :func:`register_expert_grad_reduction` sums their gradients); with ``ep = 1`` the block's
    group must have one rank (FSDP then shards its experts like the plain model's). Not supported: tensor /
    sequence parallelism and context parallelism.
    """
    import torch.distributed as dist

    d = parallel_dims
    if d.spmd_backend != "partial_dtensor":
        return (f"{block.name}: parallelism.spmd_backend={d.spmd_backend!r}: relibra's swapped MoE blocks run under "
                "spmd_backend='partial_dtensor' only")
    for field in ("tp", "cp"):
        if getattr(d, field) > 1:
            return f"{block.name}: parallel_dims.{field}={getattr(d, field)}: the swapped MoE blocks support no " \
                   f"{'tensor' if field == 'tp' else 'context'} parallelism"
    G = block.world_size
    if G != d.ep:
        return (f"{block.name}: the block's EP group has {G} ranks, parallel_dims.ep={d.ep}: swap with "
                "ep_group=parallel_dims.get_mesh('ep') (ep > 1) or a one-rank group (ep = 1)")
    if G > 1:
        want = dist.get_process_group_ranks(d.get_mesh("ep").get_group())
        have = dist.get_process_group_ranks(block.ep_group) if block.ep_group is not None else list(range(G))
        if list(want) != list(have):
            return (f"{block.name}: the block's EP group holds ranks {have}, parallel_dims' ep mesh {want}: swap "
                    "with ep_group=parallel_dims.get_mesh('ep')")
    return None


def _expert_dp_groups(parallel_dims: Any) -> list[Any]:
    """The process groups over which ranks hold the same experts (torchtitan's ``dp_replicate`` and ``efsdp`` mesh
    dimensions, those of more than one rank): an expert gradient is summed over each."""
    out = []
    for dim in ("dp_replicate", "efsdp"):
        mesh = parallel_dims.get_optional_mesh(dim)
        if mesh is not None and mesh.size() > 1:
            out.append(mesh.get_group())
    return out


def _swapped_blocks(model_parts: nn.Module | list[nn.Module]) -> list[TorchtitanReplayMoE]:
    parts = [model_parts] if isinstance(model_parts, nn.Module) else list(model_parts)
    return [m for part in parts for m in part.modules() if isinstance(m, TorchtitanReplayMoE)]


@torch.no_grad()
def reduce_expert_grads(model_parts: nn.Module | list[nn.Module]) -> None:
    """Sum every expert gradient over the ranks that hold the same experts (``dp_replicate * dp_shard * cp / ep`` of
    them; torchtitan's FSDP would do it for its own experts, it does not see relibra's). Once per optimizer step,
    after the last backward: a gradient already reduced and not changed since is left alone, so calling it from
    :func:`clip_grad_norm_` and again from the optimizer pre-step hook (:func:`register_expert_grad_reduction`)
    reduces once. A collective over those groups (nothing when there are none)."""
    import torch.distributed as dist

    for blk in _swapped_blocks(model_parts):
        groups = blk._expert_dp_groups
        for p in blk.experts.expert_tensors() if groups else ():
            g = p.grad
            if g is None or getattr(g, "_relibra_reduced_at", None) == g._version:
                continue
            for group in groups:
                dist.all_reduce(g, group=group)
            g._relibra_reduced_at = g._version


def register_expert_grad_reduction(optimizers: Any, model_parts: nn.Module | list[nn.Module]) -> None:
    """Run :func:`reduce_expert_grads` before every step of ``optimizers`` (torchtitan's ``OptimizersContainer`` or a
    torch optimizer: ``register_step_pre_hook``); needed when ranks hold the same experts
    (``dp_replicate * dp_shard * cp > ep``), which a training forward otherwise refuses. ``replay_model_spec``
    registers it."""
    optimizers.register_step_pre_hook(lambda *args, **kwargs: reduce_expert_grads(model_parts))
    for blk in _swapped_blocks(model_parts):
        blk._expert_grads_reduced = True


def _parallelize_titan(module: nn.Module, parallel_dims: Any) -> None:
    """torchtitan's ``parallelize`` on ``module`` if it is a torchtitan Module, else on its children."""
    from torchtitan.protocols.module import Module

    if isinstance(module, Module):
        module.parallelize(parallel_dims)
    else:
        for child in module.children():
            _parallelize_titan(child, parallel_dims)


def keep_load_balance_counts(block: nn.Module) -> list[Any]:
    """Hooks that restore ``block.tokens_per_expert_E`` after each forward (torchtitan's ``MoE`` or a swapped
    block): a recording forward (:class:`relibra_moe.RoutingRecorder`) leaves torchtitan's load-balancing
    counters as they were, whatever the mode. Returns the hook handles (``remove()`` them to stop)."""
    saved: list[torch.Tensor] = []

    def pre(module: nn.Module, args: Any) -> None:
        counts = getattr(module, "tokens_per_expert_E", None)
        saved[:] = [counts.detach().clone()] if isinstance(counts, torch.Tensor) else []

    def post(module: nn.Module, args: Any, out: Any) -> None:
        if saved:
            with torch.no_grad():
                module.tokens_per_expert_E.copy_(saved.pop())

    return [block.register_forward_pre_hook(pre), block.register_forward_hook(post)]


@torch.no_grad()
def clip_grad_norm_(model_parts: nn.Module | list[nn.Module], max_norm: float, *, pp_mesh: Any = None,
                    foreach: bool | None = None) -> torch.Tensor:
    """torchtitan's gradient clipping for models with swapped blocks under EP: scale every gradient by
    ``min(1, max_norm / (norm + 1e-6))`` (``torch.nn.utils.clip_grads_with_norm_``), ``norm`` the 2-norm of the
    whole model's gradient: FSDP's DTensor gradients as torchtitan reduces them, every EP-sharded expert row once
    (a sum of squares all-reduced over its EP group), then over ``pp_mesh``'s stages. Returns ``norm`` (fp32, the
    same on every rank). torchtitan's own ``clip_grad_norm_(..., ep_enabled=True)`` asserts that every parameter is
    a DTensor, which relibra's expert rows are not. A collective.
    """
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    reduce_expert_grads(model_parts)  # ranks holding the same experts first agree on their gradients
    parts = [model_parts] if isinstance(model_parts, nn.Module) else list(model_parts)
    sharded, groups = {}, []
    for part in parts:
        for blk in part.modules():
            if isinstance(blk, ReplayBalancedMoE) and blk.world_size > 1:
                sharded.update((id(p), blk.ep_group) for p in blk.experts.expert_tensors())
                groups.append(blk.ep_group)
    params = [p for part in parts for p in part.parameters() if p.grad is not None]
    dense = [p for p in params if id(p) not in sharded]
    experts = [p for p in params if id(p) in sharded]
    norm = torch.nn.utils.get_total_norm([p.grad for p in dense], 2.0, False, foreach) if dense else torch.zeros(())
    if isinstance(norm, DTensor):
        norm = norm.full_tensor()
    total = norm.float().square().reshape(())
    if experts:
        sq = sum(p.grad.detach().float().square().sum() for p in experts).to(total.device)
        dist.all_reduce(sq, group=groups[0])  # one EP group for every block (parallel_dims_error checks it)
        total = total + sq
    if pp_mesh is not None:
        dist.all_reduce(total, group=pp_mesh.get_group())
    norm = total.sqrt()
    for group in (dense, experts):  # separately: foreach cannot mix DTensor and Tensor gradients
        if group:
            torch.nn.utils.clip_grads_with_norm_(group, max_norm, norm, foreach)
    for p in experts:  # scaled in place after the reduction: still reduced (the pre-step hook must not sum again)
        if hasattr(p.grad, "_relibra_reduced_at"):
            p.grad._relibra_reduced_at = p.grad._version
    return norm
