"""Top-k routers with routing replay.

Two scoring functions, as in the models the library targets:

- ``"softmax"`` (Qwen3-MoE, OLMoE, GPT-OSS style): ``p = softmax(logits)``, top-k of ``p``, gates are
  the selected probabilities, optionally renormalized to sum to 1 over the k choices.
- ``"sigmoid"`` (DeepSeek-V3 style): ``s = sigmoid(logits)``; the *selection* uses
  ``s + correction_bias`` restricted to the best ``topk_group`` of ``num_groups`` expert groups (a group
  scores the sum of its two best biased scores); the gates are the unbiased ``s`` of the selected
  experts, optionally renormalized, times ``routed_scaling_factor``.

Replay (docs/method.md, "Routing replay"): given recorded ids ``[T, k]`` the router uses them as the selection and
gathers the gate values from the live logits, so the router weight still gets gradients. ``-1`` in a
replayed row means "no expert" (padding): that pair gets gate 0 and is not dispatched. A row of
:data:`LIVE` (``-2``) marks a token the rollout never routed (e.g. the last completion token, which
``generate()`` returns but never feeds): the router computes its live top-k for that token. A replayed
batch that does not fit raises ``ReplayError`` naming the layer and the mismatch.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ..errors import ReplayError
from ..validate import is_int

SCORINGS = ("softmax", "sigmoid")

#: Replayed id of a token the rollout never routed: the whole row is ``LIVE`` and the router routes the
#: token live (its own top-k), as the plain model would.
LIVE = -2

_trusted = threading.local()


@contextlib.contextmanager
def trusted_replay(host_ids: np.ndarray, live_rows: bool) -> Iterator[None]:
    """Inside the block, :func:`check_replay_ids` and :func:`merge_live` trust replayed ids already checked
    on the host (``host_ids [T, k]``, the values the device tensor holds; ``live_rows``: whether a row is
    :data:`LIVE`): they check shapes only and read nothing from the device (no host sync), so routers
    need no change to run in the replayed layer's hot path. A router that does not route ``LIVE`` rows
    still gets its error, from the host copy."""
    prev = getattr(_trusted, "ids", None)
    _trusted.ids = (host_ids, bool(live_rows))
    try:
        yield
    finally:
        _trusted.ids = prev


@dataclass
class RouterOutput:
    """What a router returns for ``T`` tokens.

    Attributes:
        ids: int64 ``[T, k]`` logical expert ids, ``-1`` = not routed (only from replay padding).
        gates: ``[T, k]`` gate weights (fp32), differentiable w.r.t. the router weight; 0 where
            ``ids == -1``.
        logits: ``[T, E]`` raw router logits (fp32).
    """

    ids: torch.Tensor
    gates: torch.Tensor
    logits: torch.Tensor


def check_replay_ids(ids: torch.Tensor, num_tokens: int, top_k: int, num_experts: int,
                     layer: str = "moe", *, allow_live: bool = False) -> torch.Tensor:
    """Validate replayed ids for one layer and return them as int64 ``[T, k]`` on their device.

    Raises ``ReplayError`` naming ``layer`` when the token count or k differ from the batch, an id is
    outside ``[-1, E)`` (``[-2, E)`` with ``allow_live``: rows of :data:`LIVE` are routed live by the
    caller; a row mixing ``LIVE`` with other ids is an error), or a row repeats an expert.
    """
    if not isinstance(ids, torch.Tensor):
        ids = torch.as_tensor(ids)
    if ids.dtype.is_floating_point or ids.dtype == torch.bool:
        raise ReplayError(f"layer {layer}: replayed ids must be an integer tensor, got dtype {ids.dtype}")
    if ids.dim() != 2:
        raise ReplayError(f"layer {layer}: replayed ids must be [T, k], got shape {tuple(ids.shape)}")
    if ids.shape[0] != num_tokens:
        raise ReplayError(f"layer {layer}: replayed ids cover {ids.shape[0]} tokens, the batch has {num_tokens}")
    if ids.shape[1] != top_k:
        raise ReplayError(f"layer {layer}: replayed ids have k={ids.shape[1]}, the router has top_k={top_k}")
    ids = ids.long()
    trusted = getattr(_trusted, "ids", None)
    if trusted is not None and tuple(trusted[0].shape) == tuple(ids.shape):
        if trusted[1] and not allow_live:  # the message of the full check, from the host copy
            check_replay_ids(torch.from_numpy(trusted[0]), num_tokens, top_k, num_experts, layer)
        return ids
    if ids.numel():
        low = LIVE if allow_live else -1
        bad = (ids < low) | (ids >= num_experts)
        if bool(bad.any()):
            t, j = (int(v) for v in bad.nonzero()[0])
            hint = " (or -2: route live)" if allow_live else \
                " (-2 = route live is not supported by this router)" if int(ids[t, j]) == LIVE else ""
            raise ReplayError(f"layer {layer}: replayed id [{t}, {j}] = {int(ids[t, j])} is outside "
                              f"[-1, {num_experts}){hint}")
        live = ids == LIVE
        mixed = live.any(dim=1) & ~live.all(dim=1)
        if allow_live and bool(mixed.any()):
            t = int(mixed.nonzero()[0])
            raise ReplayError(f"layer {layer}: replayed row {t} = {ids[t].tolist()} mixes {LIVE} (route live) "
                              "with expert ids; a token is either replayed or routed live")
        srt = ids.sort(dim=1).values
        dup = (srt[:, 1:] == srt[:, :-1]) & (srt[:, 1:] >= 0)
        if bool(dup.any()):
            t = int(dup.any(dim=1).nonzero()[0])
            e = int(srt[t, 1:][dup[t]][0])
            raise ReplayError(f"layer {layer}: replayed row {t} = {ids[t].tolist()} repeats expert {e}")
    return ids


def merge_live(ids: torch.Tensor, select, *args) -> torch.Tensor:
    """``ids [T, k]`` with every :data:`LIVE` row replaced by the live top-k ``select(*args)`` ``[T, k]``
    (called only when such a row exists). The one rule for tokens the rollout never routed. Under
    :func:`trusted_replay` the host copy says whether a ``LIVE`` row exists (no host sync)."""
    trusted = getattr(_trusted, "ids", None)
    if trusted is not None and tuple(trusted[0].shape) == tuple(ids.shape):
        if not trusted[1]:
            return ids
        return torch.where(ids == LIVE, select(*args).to(ids.device, ids.dtype), ids)
    live = ids == LIVE
    if not bool(live.any()):
        return ids
    return torch.where(live, select(*args).to(ids.device, ids.dtype), ids)


class TopKRouter(nn.Module):
    """Linear router ``hidden -> num_experts`` followed by top-k selection (see the module docstring).

    Args:
        hidden: model hidden size H.
        num_experts: routed experts E.
        top_k: experts per token k.
        scoring: ``"softmax"`` or ``"sigmoid"``.
        renormalize: divide the k gates by their sum (Qwen3's ``norm_topk_prob``, DeepSeek's
            ``norm_topk_prob``).
        num_groups, topk_group: group-limited selection (sigmoid scoring only; ``num_groups`` must divide E).
        routed_scaling_factor: multiplies the gates (DeepSeek-V3 uses 2.5).
        correction_bias: give the sigmoid router an ``e_score_correction_bias`` buffer ``[E]``.
        name: used in ``ReplayError`` messages (the owning layer sets it).

    ``forward(x [T, H], replay_ids=None) -> RouterOutput``.
    """

    def __init__(self, hidden: int, num_experts: int, top_k: int, *, scoring: str = "softmax",
                 renormalize: bool = True, num_groups: int = 1, topk_group: int = 1,
                 routed_scaling_factor: float = 1.0, correction_bias: bool | None = None,
                 dtype: torch.dtype | None = None, device: torch.device | str | None = None,
                 name: str = "moe") -> None:
        super().__init__()
        if scoring not in SCORINGS:
            raise ValueError(f"scoring={scoring!r} is not one of {SCORINGS}")
        for field, value in (("hidden", hidden), ("num_experts", num_experts), ("top_k", top_k),
                             ("num_groups", num_groups), ("topk_group", topk_group)):
            if not is_int(value):
                raise ValueError(f"{field}={value!r} must be an integer")
        if hidden < 1:
            raise ValueError(f"hidden={hidden} must be >= 1")
        if not 0 < top_k <= num_experts:
            raise ValueError(f"top_k={top_k} must be in [1, num_experts={num_experts}]")
        if num_experts % num_groups:
            raise ValueError(f"num_groups={num_groups} does not divide num_experts={num_experts}")
        if not 0 < topk_group <= num_groups:
            raise ValueError(f"topk_group={topk_group} must be in [1, num_groups={num_groups}]")
        if num_groups > 1 and scoring != "sigmoid":
            raise ValueError("group-limited selection (num_groups > 1) needs scoring='sigmoid'")
        if num_groups > 1 and topk_group * (num_experts // num_groups) < top_k:
            raise ValueError(f"topk_group={topk_group} groups of {num_experts // num_groups} experts cannot "
                             f"hold top_k={top_k} choices")
        self.hidden, self.num_experts, self.top_k = hidden, num_experts, top_k
        self.scoring, self.renormalize = scoring, renormalize
        self.num_groups, self.topk_group = num_groups, topk_group
        self.routed_scaling_factor = float(routed_scaling_factor)
        self.name = name
        self.weight = nn.Parameter(torch.empty(num_experts, hidden, dtype=dtype, device=device))
        nn.init.normal_(self.weight, std=hidden ** -0.5)
        if correction_bias is None:
            correction_bias = scoring == "sigmoid"
        if correction_bias:
            self.register_buffer("e_score_correction_bias",
                                 torch.zeros(num_experts, dtype=torch.float32, device=device))
        else:
            self.e_score_correction_bias = None

    def extra_repr(self) -> str:
        return (f"hidden={self.hidden}, num_experts={self.num_experts}, top_k={self.top_k}, "
                f"scoring={self.scoring}, renormalize={self.renormalize}, num_groups={self.num_groups}, "
                f"topk_group={self.topk_group}")

    def scores(self, logits: torch.Tensor) -> torch.Tensor:
        """Per-expert gate scores ``[T, E]`` fp32 (softmax or sigmoid of the logits)."""
        if self.scoring == "softmax":
            return torch.softmax(logits, dim=-1)
        return torch.sigmoid(logits)

    def select(self, scores: torch.Tensor) -> torch.Tensor:
        """Live top-k selection ``[T, k]`` int64 from ``scores [T, E]`` (no gradient flows through it)."""
        with torch.no_grad():
            sel = scores.detach()
            if self.e_score_correction_bias is not None:
                sel = sel + self.e_score_correction_bias
            if self.num_groups > 1:
                T = sel.shape[0]
                grouped = sel.view(T, self.num_groups, -1)
                group_score = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(-1)  # [T, num_groups]
                keep = group_score.topk(self.topk_group, dim=-1).indices
                mask = torch.zeros_like(group_score, dtype=torch.bool).scatter_(1, keep, True)
                sel = sel.masked_fill(~mask.repeat_interleave(self.num_experts // self.num_groups, dim=1),
                                      float("-inf"))
            return sel.topk(self.top_k, dim=-1).indices

    def forward(self, x: torch.Tensor, replay_ids: torch.Tensor | None = None) -> RouterOutput:
        """Route ``x [T, H]``; with ``replay_ids [T, k]`` use them as the selection."""
        if x.dim() != 2 or x.shape[1] != self.hidden:
            raise ValueError(f"router {self.name}: x has shape {tuple(x.shape)}, expected [T, hidden={self.hidden}]")
        logits = F.linear(x.float(), self.weight.float())
        scores = self.scores(logits)
        if replay_ids is None:
            ids = self.select(scores)
            gates = scores.gather(1, ids)
            valid = None
        else:
            ids = check_replay_ids(replay_ids, x.shape[0], self.top_k, self.num_experts, self.name,
                                   allow_live=True).to(x.device)
            ids = merge_live(ids, self.select, scores)
            valid = ids >= 0
            gates = scores.gather(1, ids.clamp_min(0)) * valid
        if self.renormalize:
            denom = gates.sum(dim=-1, keepdim=True)
            if valid is not None:  # a fully padded row keeps its zeros
                denom = torch.where(denom > 0, denom, torch.ones_like(denom))
            gates = gates / denom
        if self.routed_scaling_factor != 1.0:
            gates = gates * self.routed_scaling_factor
        return RouterOutput(ids=ids, gates=gates, logits=logits)
