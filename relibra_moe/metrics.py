"""Load-imbalance metrics of the ReLibra paper's motivation and evaluation: arrays in, arrays out.

- expert skewness: ``max_e load[e] / mean_e load[e]`` (1 = perfectly even; at most E/k per token
  batch when every token picks k distinct experts), per micro-batch and layer;
- rank-level skew: ``max_g L_g / mean_g L_g`` over the GPUs' compute loads;
- hot-set intersection: ``|H_t ∩ H_{t+1}| / k`` where ``H_t`` is the set of the k most loaded experts
  of micro-batch t at a layer.

A metric of an all-zero load vector is undefined and comes out as NaN; the ``*_mean`` helpers skip
NaNs.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np

from .errors import TraceError
from .validate import check_count, is_int

__all__ = [
    "default_hot_k", "expert_skewness", "rank_skew", "gpu_loads", "hot_sets", "hot_set_intersection",
    "micro_batch_skew", "load_summary",
]


def _counts(name: str, value: Any, min_ndim: int = 1) -> np.ndarray:
    arr = np.asarray(value)
    if arr.dtype.kind not in "iuf":
        raise TraceError(f"{name} must be numeric, got dtype {arr.dtype}")
    if arr.ndim < min_ndim:
        raise TraceError(f"{name} must have rank >= {min_ndim}, got shape {arr.shape}")
    if arr.size and not np.all(np.isfinite(arr)):
        i = tuple(int(v) for v in np.argwhere(~np.isfinite(arr))[0])
        raise TraceError(f"{name}{list(i)} = {arr[i]}: loads must be finite")
    if arr.size and float(np.min(arr)) < 0:
        raise TraceError(f"{name} must be >= 0, got minimum {np.min(arr)}")
    return arr


@contextmanager
def _quiet() -> Iterator[None]:
    """Silence numpy's 'mean of empty slice' warning for all-NaN rows."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        yield


def default_hot_k(num_experts: int) -> int:
    """Hot-set size used by the reports: 8, or E // 4 when E < 32 (at least 1)."""
    return 8 if num_experts >= 32 else max(1, num_experts // 4)


def _ratio_max_mean(load: np.ndarray) -> np.ndarray:
    load = load.astype(np.float64)
    mean = load.mean(axis=-1)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(mean > 0, load.max(axis=-1) / np.where(mean > 0, mean, 1.0), np.nan)


def expert_skewness(counts: Any) -> np.ndarray:
    """Expert skewness ``max_e c[..., e] / mean_e c[..., e]``.

    Args:
        counts: ``[..., E]`` tokens per expert (e.g. ``[M, L, E]`` per micro-batch and layer).

    Returns:
        float64 ``[...]``; NaN where the load is all zero.
    """
    return _ratio_max_mean(_counts("counts", counts))


def micro_batch_skew(counts: Any) -> tuple[np.ndarray, np.ndarray]:
    """Expert skewness per micro-batch.

    Args:
        counts: ``[M, L, E]`` tokens of micro-batch m routed to expert e at layer l.

    Returns:
        ``(per_layer [M, L], per_micro_batch [M])``: the skew at every layer, and its mean over layers
        (NaN layers skipped).
    """
    c = _counts("counts", counts, 3)
    if c.ndim != 3:
        raise TraceError(f"counts must have shape [M, L, E], got {c.shape}")
    per_layer = expert_skewness(c)
    with _quiet():
        per_mb = np.nanmean(per_layer, axis=1)
    return per_layer, per_mb


def gpu_loads(expert_load: Any, home: Any, num_gpus: int) -> np.ndarray:
    """Compute load of every GPU: ``L_g = sum_{e homed on g} load[..., e]``.

    Args:
        expert_load: ``[..., E]`` tokens per expert (a ``[M, L, G_src, E]`` loads tensor summed over
            sources, or ``[M, L, E]``).
        home: int ``[E]`` (same placement everywhere) or ``[L, E]`` broadcastable against the leading
            axes of ``expert_load``: GPU of each expert in ``[0, num_gpus)``.
        num_gpus: G.

    Returns:
        ``[..., G]`` (dtype of ``expert_load``, promoted to at least int64 / float64).
    """
    load = _counts("expert_load", expert_load)
    check_count("num_gpus", num_gpus, error=TraceError)
    home = np.asarray(home)
    if home.dtype.kind not in "iu":
        raise TraceError(f"home must hold integer GPU ids, got dtype {home.dtype}")
    if home.shape[-1:] != load.shape[-1:]:
        raise TraceError(f"home has {home.shape[-1:]} experts, expert_load has {load.shape[-1]}")
    if home.size and (int(home.min()) < 0 or int(home.max()) >= num_gpus):
        raise TraceError(f"home ids must lie in [0, {num_gpus}), got range [{int(home.min())}, {int(home.max())}]")
    home = np.broadcast_to(home, load.shape)
    onehot = home[..., None] == np.arange(num_gpus)  # [..., E, G]
    out_dtype = np.float64 if load.dtype.kind == "f" else np.int64
    return np.einsum("...e,...eg->...g", load.astype(out_dtype), onehot.astype(out_dtype))


def rank_skew(gpu_load: Any) -> np.ndarray:
    """Rank-level skew ``max_g L_g / mean_g L_g``.

    Args:
        gpu_load: ``[..., G]`` compute load per GPU (see :func:`gpu_loads`).

    Returns:
        float64 ``[...]``; NaN where all loads are zero.
    """
    return _ratio_max_mean(_counts("gpu_load", gpu_load))


def hot_sets(counts: Any, k: int) -> np.ndarray:
    """Ids of the k most loaded experts.

    Args:
        counts: ``[..., E]``.
        k: hot-set size, ``1 <= k <= E``.

    Returns:
        int64 ``[..., k]``, heaviest first; ties go to the lower expert id.
    """
    c = _counts("counts", counts)
    e = c.shape[-1]
    if not is_int(k) or not 1 <= k <= e:
        raise TraceError(f"hot-set size k={k} must lie in [1, {e}]")
    order = np.argsort(-c, axis=-1, kind="stable")
    return order[..., :k].astype(np.int64)


def hot_set_intersection(counts: Any, k: int) -> np.ndarray:
    """Top-k hot-set intersection ratio between consecutive micro-batches.

    Args:
        counts: ``[M, L, E]`` tokens per micro-batch, layer and expert (M >= 2).
        k: hot-set size.

    Returns:
        float64 ``[M-1, L]``: ``|H_t ∩ H_{t+1}| / k`` at every layer for t = 0..M-2.
    """
    c = _counts("counts", counts, 3)
    if c.ndim != 3:
        raise TraceError(f"counts must have shape [M, L, E], got {c.shape}")
    if c.shape[0] < 2:
        raise TraceError(f"hot-set intersection needs at least 2 micro-batches, got {c.shape[0]}")
    hot = hot_sets(c, k)
    mask = np.zeros(c.shape, dtype=bool)
    np.put_along_axis(mask, hot, True, axis=-1)
    return (mask[:-1] & mask[1:]).sum(axis=-1) / float(k)


def load_summary(counts: Any, hot_k: int | None = None) -> dict[str, float]:
    """Headline statistics of per-micro-batch loads.

    Args:
        counts: ``[M, L, E]`` tokens per micro-batch, layer and expert.
        hot_k: hot-set size (default :func:`default_hot_k`).

    Returns:
        ``skew_mean``, ``skew_min``, ``skew_max`` (of the per-micro-batch layer-mean skew),
        ``intersection_mean`` (NaN when M < 2) and ``hot_k``.
    """
    c = _counts("counts", counts, 3)
    _, per_mb = micro_batch_skew(c)
    k = default_hot_k(c.shape[2]) if hot_k is None else int(hot_k)
    inter = hot_set_intersection(c, k) if c.shape[0] >= 2 else np.full((0, c.shape[1]), np.nan)
    with _quiet():
        return {
            "skew_mean": float(np.nanmean(per_mb)),
            "skew_min": float(np.nanmin(per_mb)),
            "skew_max": float(np.nanmax(per_mb)),
            "intersection_mean": float(np.nanmean(inter)) if inter.size else float("nan"),
            "hot_k": k,
        }
