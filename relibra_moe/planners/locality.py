"""Where samples run, with experts frozen (docs/method.md, "Locality"; RoutePack-style repacking).

Data-parallel attention lets any sample run its attention on any GPU of the EP group; that GPU is the
source of the sample's tokens in the cost model. With the expert homes fixed, this module anneals

(a) within each micro-batch, which GPU runs each sample (swap two samples' GPUs, or move one sample to
    another GPU), and
(b) with ``repack=True``, also which micro-batch holds each sample (swap two samples of different
    micro-batches; with ``token_cap`` also move a sample to a micro-batch whose tokens stay within it).
    Every micro-batch keeps its number of samples unless ``token_cap`` is given.

Attention work constraint: no (micro-batch, GPU) cell may end above the cap in either measure,
sum of tokens or sum of squared tokens of its samples (linear and quadratic attention cost), unless the
move lowers that cell's work. The cap is ``(1 + tol)`` times the mean over cells, or the largest single
sample when that is larger (a sample cannot be split).

The objective is the sum over micro-batches and layers of T_MoE (exact by default, or LSE-smoothed as
``cost.py`` defines it), with ``comp_weight`` on the compute term (the step's 3 comp + 2 comm, halved, under the
planners' step objective); with ``charge_attention`` it also charges each micro-batch's slowest GPU's local stage
(``timing.local_stage``: attention, quadratic in the sample's length, + shared experts) over the L layers at
``comp_weight``, the step's ``A_fwd + A_bwd`` halved like the MoE terms. The result is kept only if its exact
objective is lower than the start's.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..cost import cost_from_flow
from ..errors import PlanError
from ..specs import ClusterSpec, ModelSpec
from ..timing import local_stage
from ..validate import check_index_range
from . import _kernels
from .params import LocalityParams, params_or_fields
from .reorder import cluster_constants


def sample_flows(counts: np.ndarray, expert_gpu: np.ndarray, num_gpus: int) -> np.ndarray:
    """float64 ``[N, L, G]``: tokens of sample n in layer l routed to experts homed on GPU g."""
    counts = np.ascontiguousarray(counts, dtype=np.int64)
    N, L, E = counts.shape
    eg = np.ascontiguousarray(expert_gpu, dtype=np.int64)
    if eg.shape != (L, E):
        raise PlanError(f"expert_gpu has shape {eg.shape}, expected [L={L}, E={E}]")
    if eg.size and (eg.min() < 0 or eg.max() >= num_gpus):
        raise PlanError(f"expert_gpu holds GPU {int(eg.max())}, outside [0, {num_gpus})")
    return _kernels.sample_flows(counts, eg, int(num_gpus))


def flows_from_samples(cf: np.ndarray, micro_batch: np.ndarray, sample_gpu: np.ndarray, num_micro_batches: int,
                       num_gpus: int) -> np.ndarray:
    """float64 ``[M, L, G, G]`` flow (tokens from source j to home GPU g) from per-sample flows ``cf [N, L, G]``."""
    N, L, G = cf.shape
    out = np.zeros((num_micro_batches, L, num_gpus, G))
    for n in range(N):
        out[micro_batch[n], :, sample_gpu[n]] += cf[n]
    return out


def sample_local_seconds(lengths: np.ndarray, model: ModelSpec, cluster: ClusterSpec) -> np.ndarray:
    """float64 ``[N]``: seconds of one layer's local stage (attention + shared experts) of each sample alone,
    ``timing.local_stage`` with every sample in a cell of its own (the stage is a sum over a cell's samples)."""
    n = len(lengths)
    return local_stage(lengths, np.arange(n), np.zeros(n, np.int64), n, model, cluster)[:, 0]


def attention_weight(model: ModelSpec, comp_weight: float, charge_attention: bool) -> float:
    """Weight of a micro-batch's slowest local stage (seconds, one layer) in the locality objective:
    ``L x comp_weight`` when charged (``comp_weight`` = ``timing.STEP_COMP_WEIGHT`` is ``(A_fwd + A_bwd) / 2`` per
    ``A_fwd``, as ``3 comp / 2``), else 0."""
    return float(model.num_layers * comp_weight) if charge_attention else 0.0


def _exact_total(cf, mb, sg, M, model, cluster, comp_weight: float = 1.0, att: np.ndarray | None = None,
                 att_w: float = 0.0) -> float:
    """Sum over cells of ``comp_weight x max_g comp + max_g comm`` (seconds; 1: the sum of T_MoE), plus
    ``att_w x max_g`` of each micro-batch's local seconds ``att [N]`` summed per GPU when ``att_w > 0``."""
    c = cost_from_flow(flows_from_samples(cf, mb, sg, M, cluster.num_gpus), model, cluster)
    total = float((comp_weight * c.comp.max(axis=-1, initial=0.0) + c.comm.max(axis=-1, initial=0.0)).sum())
    if att_w > 0.0 and att is not None:
        cell = np.zeros((M, cluster.num_gpus))
        np.add.at(cell, (np.asarray(mb, np.int64), np.asarray(sg, np.int64)), att)
        total += att_w * float(cell.max(axis=1, initial=0.0).sum())
    return total


def attention_caps(lengths: np.ndarray, num_cells: int, tol: float) -> tuple[float, float]:
    """``(cap on sum tokens, cap on sum tokens^2)`` per (micro-batch, GPU) cell (see the module docstring)."""
    t = np.asarray(lengths, dtype=np.float64)
    cap1 = max((1.0 + tol) * t.sum() / num_cells, float(t.max(initial=0.0)))
    cap2 = max((1.0 + tol) * (t * t).sum() / num_cells, float((t * t).max(initial=0.0)))
    return cap1, cap2


def anneal_locality(counts: np.ndarray, lengths: np.ndarray, micro_batch: np.ndarray, sample_gpu: np.ndarray,
                    expert_gpu: np.ndarray, model: ModelSpec, cluster: ClusterSpec,
                    params: LocalityParams | None = None, *, num_micro_batches: int | None = None, seed: int = 0,
                    **param_fields: Any
                    ) -> tuple[np.ndarray, np.ndarray, dict]:
    """Anneal sample -> GPU (and with ``repack`` sample -> micro-batch) for frozen expert homes.

    Args:
        counts: ``[N, L, E]`` tokens of each sample per layer and expert.
        lengths: ``[N]`` tokens per sample (attention work).
        micro_batch, sample_gpu: ``[N]`` starting placement.
        expert_gpu: ``[L, E]`` frozen homes.
        params: the annealing parameters (``params.LocalityParams``: ``repack``, ``token_cap`` (with repack,
            micro-batches may change their sample counts while their tokens stay at most ``token_cap``),
            ``tol`` (attention-work tolerance over the mean, see the module docstring), ``iters`` (None:
            ``LocalityParams.iters_for``), ``smooth`` (the LSE-smoothed objective; default exact: the sum over
            M x L cells has no plateaus, and the exact evaluation is ~2.5x cheaper at the same result),
            ``keep_cell_sizes`` (swaps only, so every (micro-batch, GPU) cell keeps its number of samples, what a
            trainer with a fixed per-rank micro-batch size needs; ``sample_order``), ``comp_weight`` (1 anneals
            the sum of T_MoE, ``timing.STEP_COMP_WEIGHT`` the step's 3 comp + 2 comm, halved),
            ``charge_attention`` (also each micro-batch's slowest local stage, module docstring)); or give its
            fields as keywords (``param_fields``).
        num_micro_batches: M (default: ``micro_batch.max() + 1``).
        seed: RNG seed (same inputs and seed -> same result).

    Returns:
        (micro_batch int64 [N], sample_gpu int64 [N], info) with info ``objective_start`` / ``objective``
        = the exact objective (seconds) before / after.
    """
    p = params_or_fields(LocalityParams, params, param_fields)
    counts = np.asarray(counts)
    if counts.ndim != 3 or counts.shape[1:] != (model.num_layers, model.num_experts):
        raise PlanError(f"counts has shape {counts.shape}, expected [N, L={model.num_layers}, "
                        f"E={model.num_experts}]")
    N = counts.shape[0]
    G = cluster.num_gpus
    lengths = np.asarray(lengths, dtype=np.float64)
    if lengths.shape != (N,):
        raise PlanError(f"lengths has shape {lengths.shape}, expected [N={N}]")
    if p.token_cap is not None and p.token_cap < lengths.max(initial=0):
        raise PlanError(f"token_cap={p.token_cap} is below the longest sample ({int(lengths.max())} tokens)")
    mb0 = np.asarray(micro_batch, dtype=np.int64)
    sg0 = np.asarray(sample_gpu, dtype=np.int64)
    M = int(num_micro_batches if num_micro_batches is not None else (mb0.max() + 1 if N else 0))
    if mb0.shape != (N,) or sg0.shape != (N,):
        raise PlanError(f"micro_batch {mb0.shape} and sample_gpu {sg0.shape} must both be [N={N}]")
    check_index_range("micro_batch", mb0, 0, M)
    check_index_range("sample_gpu", sg0, 0, G)
    expert_gpu = np.asarray(expert_gpu, dtype=np.int64)
    if expert_gpu.shape != (model.num_layers, model.num_experts):
        raise PlanError(f"expert_gpu has shape {expert_gpu.shape}, expected [L={model.num_layers}, "
                        f"E={model.num_experts}]")
    check_index_range("expert_gpu", expert_gpu, 0, G)
    cf = sample_flows(counts, expert_gpu, G)
    att = sample_local_seconds(lengths, model, cluster)
    att_w = attention_weight(model, p.comp_weight, p.charge_attention)
    start = _exact_total(cf, mb0, sg0, M, model, cluster, p.comp_weight, att, att_w)
    info = {"objective_start": start, "objective": start, "repack": bool(p.repack)}
    if N < 2:
        return mb0.copy(), sg0.copy(), info
    iters = p.iters_for(N, model.num_layers, G)
    cap1, cap2 = attention_caps(lengths, M * G, p.tol)
    nvm, rdm, cc, tnv, trd = cluster_constants(model, cluster, p.comp_weight)
    mb, sg, _, _ = _kernels.anneal_samples(
        cf, lengths, lengths * lengths, mb0, sg0, M, nvm, rdm, cc, tnv, trd, float(p.beta), bool(p.smooth),
        bool(p.repack), cap1, cap2, float(p.token_cap or 0), float(p.t0_frac), float(p.eps_frac), int(iters),
        int(seed) & 0x7FFFFFFF, bool(p.keep_cell_sizes), att, att_w)
    obj = _exact_total(cf, mb, sg, M, model, cluster, p.comp_weight, att, att_w)
    if obj < start:
        info["objective"] = obj
        return mb, sg, info
    return mb0.copy(), sg0.copy(), info
