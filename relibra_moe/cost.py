"""The ReLibra cost model of one MoE layer (docs/method.md, "Cost model"), exact and LSE-smoothed, vectorized.

Notation: G GPUs in the EP group, E experts. ``x[j, e]`` counts the tokens whose attention runs on GPU j
and that are routed to expert e (one count per (token, expert) pair). A plan decides which GPU serves
each of those pairs: without replicas the expert's home GPU, with replicas a share ``y[j, e, g]`` of
them on GPU g. Everything below follows from the flow matrix

    F[j, g] = sum_e x[j, e] * y[j, e, g]          tokens sent from source j to target g

- compute: ``L_g = sum_j F[j, g]``; ``comp_g = 6 h h' L_g / F_flops`` seconds (forward GEMMs).
- dispatch traffic by link class of (j, g) (``specs.ClusterSpec.link_classes``):
  NVLink carries {nv, cr}, RDMA carries {sr, cr} (a cross-rail token is counted on both, at its
  source and at its target, literally as the paper's formulas do):
  ``nvlink_tx[j] = sum_{g: nv|cr} F[j, g]``, ``nvlink_rx[g] = sum_{j: nv|cr} F[j, g]``, and the
  same for RDMA with {sr, cr}. A pair on a link moves ``h x dtype_bytes x copies`` bytes, ``copies`` from the
  cluster's dispatcher (``specs.dispatch_copies_per_pair``: 1 for Megatron's all-to-all, the expected
  per-node / per-GPU deduplication of DeepEP below 1). All rates come from ``ClusterSpec.rates``.
- ``dispatch_g = max(nvlink_tx/B_nv, nvlink_rx/B_nv, rdma_tx/B_rdma, rdma_rx/B_rdma)``. The combine
  mirrors the dispatch (tx and rx swapped), so it costs the same: ``comm_g = 2 dispatch_g``.
- ``T_MoE = max_g comp_g + max_g comm_g``.

The smoothed objective replaces every max by ``LSE_beta(z) = (s / beta) log sum exp(beta z / s)``
where ``s`` is the layer's mean per-GPU compute time (no plan changes it: the token count is fixed), so
``beta`` is dimensionless (beta = 20: a GPU 5% of the mean below the maximum still weighs e^-1).
LSE is an upper bound of max and exceeds it by at most ``s log(n) / beta``.

All functions broadcast over leading dimensions (layers, micro-batches).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .cost_terms import comm_seconds, compute_seconds, dispatch_seconds, link_masks, t_moe_seconds
from .errors import PlanError
from .specs import ClusterSpec, ModelSpec

DEFAULT_BETA = 20.0


@dataclass(frozen=True)
class MoECost:
    """Per-GPU cost of MoE layers. Leading dims ``[...]`` are those of the input (e.g. ``[M, L]``).

    Attributes:
        load: ``[..., G]`` tokens computed on each GPU (L_g).
        comp: ``[..., G]`` seconds of expert compute (forward).
        comm: ``[..., G]`` seconds of dispatch + combine.
        nvlink_tx, nvlink_rx, rdma_tx, rdma_rx: ``[..., G]`` dispatch bytes per GPU and direction.
        t_moe: ``[...]`` seconds, ``max_g comp + max_g comm``.
        t_moe_smooth: ``[...]`` seconds, the LSE-smoothed T_MoE (>= t_moe).
    """

    load: np.ndarray
    comp: np.ndarray
    comm: np.ndarray
    nvlink_tx: np.ndarray
    nvlink_rx: np.ndarray
    rdma_tx: np.ndarray
    rdma_rx: np.ndarray
    t_moe: np.ndarray
    t_moe_smooth: np.ndarray

    @property
    def rank_skew(self) -> np.ndarray:
        """``[...]`` max GPU load / mean GPU load (1 when the layer has no tokens)."""
        mean = self.load.mean(axis=-1)
        return np.where(mean > 0, self.load.max(axis=-1) / np.where(mean > 0, mean, 1), 1.0)


def smooth_max(z: np.ndarray, beta: float, scale: np.ndarray | float, axis: int = -1) -> np.ndarray:
    """``(scale / beta) log sum exp(beta z / scale)`` along ``axis``, computed stably.

    ``scale`` broadcasts against ``z`` with ``axis`` removed; it must be > 0.
    """
    z = np.asarray(z, dtype=np.float64)
    scale = np.asarray(scale, dtype=np.float64)
    m = z.max(axis=axis)
    zz = np.moveaxis(z, axis, -1)
    t = np.exp(beta * (zz - m[..., None]) / scale[..., None])
    return m + scale / beta * np.log(t.sum(axis=-1))


def expert_onehot(expert_gpu: np.ndarray, num_gpus: int) -> np.ndarray:
    """float64 ``[..., E, G]`` one-hot of the home GPU of every expert (``expert_gpu`` is ``[..., E]``)."""
    expert_gpu = np.asarray(expert_gpu)
    if expert_gpu.dtype.kind not in "iu":
        if expert_gpu.dtype.kind != "f" or not np.all(expert_gpu == np.round(expert_gpu)):
            # a fractional home would match no GPU and its tokens would vanish from the cost
            raise PlanError(f"expert_gpu must hold integer GPU ids, got dtype {expert_gpu.dtype} "
                            f"(values {expert_gpu.ravel()[:8].tolist()})")
    if expert_gpu.size and (expert_gpu.min() < 0 or expert_gpu.max() >= num_gpus):
        bad = expert_gpu[(expert_gpu < 0) | (expert_gpu >= num_gpus)].flat[0]
        raise PlanError(f"expert_gpu holds GPU {int(bad)}, outside [0, {num_gpus})")
    return (expert_gpu[..., None] == np.arange(num_gpus)).astype(np.float64)


def flow_matrix(x: np.ndarray, expert_gpu: np.ndarray | None = None,
                shares: np.ndarray | None = None) -> np.ndarray:
    """Tokens sent from source GPU j to target GPU g, ``F[..., j, g]``.

    Args:
        x: ``[..., G, E]`` tokens per (source GPU, expert).
        expert_gpu: ``[..., E]`` home GPU of each expert (broadcast against x's leading dims);
            used when ``shares`` is None.
        shares: ``[..., G, E, G]`` share of x[j, e] served on each GPU (rows sum to 1; not checked
            here, ``plan.ReplicaPlan.validate`` does); replaces ``expert_gpu`` when given.

    Returns:
        float64 ``[..., G, G]`` tokens (pairs) from source j to target g.
    """
    x = np.asarray(x, dtype=np.float64)
    num_gpus = x.shape[-2]
    if shares is not None:
        shares = np.asarray(shares, dtype=np.float64)
        if shares.shape[-3:] != x.shape[-2:] + (num_gpus,):
            raise PlanError(f"shares has shape {shares.shape}, expected [..., {num_gpus}, "
                            f"{x.shape[-1]}, {num_gpus}] to match x {x.shape}")
        return np.einsum("...je,...jeg->...jg", x, shares)
    if expert_gpu is None:
        raise PlanError("flow_matrix needs expert_gpu or shares (both are None)")
    return x @ expert_onehot(expert_gpu, num_gpus)


def _link_terms(flow: np.ndarray, model: ModelSpec, cluster: ClusterSpec) -> tuple[np.ndarray, ...]:
    """``(load, nvlink_tx, nvlink_rx, rdma_tx, rdma_rx, comp, terms)`` of a float64 flow ``[..., G, G]``: tokens
    served, bytes per link direction, compute seconds ``[..., G]`` and the four link seconds ``[..., G, 4]``
    (``cost_terms``: which links carry a pair, the compute term). A link's seconds are its bytes over the bandwidth
    here, pairs times ``Rates.*_sec_per_pair`` in the kernels: equal up to rounding, and this order is the one the
    recorded plans were made with (``tests/test_cost_terms.py`` pins the two to each other)."""
    num_gpus = cluster.num_gpus
    if flow.shape[-2:] != (num_gpus, num_gpus):
        raise PlanError(f"flow has shape {flow.shape}, expected [..., {num_gpus}, {num_gpus}] for "
                        f"{cluster.nodes} x {cluster.gpus_per_node} GPUs")
    nv_mask, rdma_mask = link_masks(cluster.link_classes)
    rates = cluster.rates(model)
    tb = float(model.token_bytes)
    nv_b, rdma_b = tb * rates.nvlink_copies, tb * rates.rdma_copies
    load = flow.sum(axis=-2)
    nv_tx, nv_rx = (flow * nv_mask).sum(axis=-1), (flow * nv_mask).sum(axis=-2)  # pairs
    rd_tx, rd_rx = (flow * rdma_mask).sum(axis=-1), (flow * rdma_mask).sum(axis=-2)
    comp = compute_seconds.py_func(load, rates.sec_per_pair)
    nvlink_tx, nvlink_rx, rdma_tx, rdma_rx = nv_tx * nv_b, nv_rx * nv_b, rd_tx * rdma_b, rd_rx * rdma_b
    terms = np.stack([nvlink_tx / rates.nvlink_bw, nvlink_rx / rates.nvlink_bw,
                      rdma_tx / rates.rdma_bw, rdma_rx / rates.rdma_bw], axis=-1)
    return load, nvlink_tx, nvlink_rx, rdma_tx, rdma_rx, comp, terms


def _comm(terms: np.ndarray) -> np.ndarray:
    """``[..., G]`` dispatch + combine seconds from the four link seconds ``terms [..., G, 4]``
    (``cost_terms.dispatch_seconds`` at unit rates, then ``comm_seconds``)."""
    return comm_seconds.py_func(dispatch_seconds.py_func(terms[..., 0], terms[..., 1], terms[..., 2], terms[..., 3],
                                                         1.0, 1.0))


def peak_comp_comm(flow: np.ndarray, model: ModelSpec, cluster: ClusterSpec) -> tuple[float, float]:
    """``(max_g comp, max_g comm)`` seconds of one flow ``[G, G]``: :func:`cost_from_flow`'s ``comp.max()`` and
    ``comm.max()`` without its smoothed terms."""
    _, _, _, _, _, comp, terms = _link_terms(np.asarray(flow, dtype=np.float64), model, cluster)
    return float(comp.max()), float(_comm(terms).max())


def cost_from_flow(flow: np.ndarray, model: ModelSpec, cluster: ClusterSpec,
                   beta: float = DEFAULT_BETA) -> MoECost:
    """The cost model of docs/method.md, "Cost model" from a flow matrix ``[..., G, G]`` (tokens j -> g).

    Args:
        flow: ``[..., G, G]`` tokens sent from source GPU j to target GPU g (see :func:`flow_matrix`).
        model, cluster: token bytes and FLOPs per token; bandwidths (bytes/s), FLOP/s, link classes.
        beta: LSE sharpness for ``t_moe_smooth``.

    Returns:
        :class:`MoECost` with leading dims ``[...]``; times in seconds, traffic in bytes.
    """
    flow = np.asarray(flow, dtype=np.float64)
    load, nvlink_tx, nvlink_rx, rdma_tx, rdma_rx, comp, terms = _link_terms(flow, model, cluster)
    comm = _comm(terms)
    t_moe = t_moe_seconds.py_func(comp.max(axis=-1), comm.max(axis=-1))

    mean_comp = comp.mean(axis=-1)
    scale = np.where(mean_comp > 0, mean_comp, 1.0)
    comm_smooth = comm_seconds.py_func(smooth_max(terms, beta, scale[..., None], axis=-1))
    t_smooth = t_moe_seconds.py_func(smooth_max(comp, beta, scale), smooth_max(comm_smooth, beta, scale))
    return MoECost(load=load, comp=comp, comm=comm, nvlink_tx=nvlink_tx, nvlink_rx=nvlink_rx,
                   rdma_tx=rdma_tx, rdma_rx=rdma_rx, t_moe=t_moe, t_moe_smooth=t_smooth)


def moe_cost(x: np.ndarray, expert_gpu: np.ndarray | None, model: ModelSpec, cluster: ClusterSpec,
             shares: np.ndarray | None = None, beta: float = DEFAULT_BETA) -> MoECost:
    """Cost of MoE layers for loads ``x [..., G, E]`` under a placement (and optional replica shares).

    Args:
        x: tokens per (source GPU, expert), e.g. ``[G, E]``, ``[L, G, E]`` or ``[M, L, G, E]``.
        expert_gpu: home GPU of each expert, ``[E]`` or ``[L, E]`` (broadcast over leading dims).
        model, cluster: the specs; ``G`` must equal ``cluster.num_gpus`` and ``E`` the model's experts.
        shares: optional ``[..., G, E, G]`` fraction of x[j, e] served on GPU g (see ``plan``).
        beta: LSE sharpness for ``t_moe_smooth`` (dimensionless, see the module docstring).

    Returns:
        :class:`MoECost` with leading dims those of ``x`` without ``[G, E]``; seconds and bytes.

    Raises:
        PlanError: wrong shapes, a negative or non-finite load, a home GPU outside ``[0, G)``.
    """
    x = np.asarray(x)
    if x.dtype.kind not in "iuf":
        raise PlanError(f"x must be numeric token counts, got dtype {x.dtype}")
    if x.ndim < 2 or x.shape[-2] != cluster.num_gpus:
        raise PlanError(f"x has shape {x.shape}, expected [..., {cluster.num_gpus} GPUs, "
                        f"{model.num_experts} experts]")
    if x.shape[-1] != model.num_experts:
        raise PlanError(f"x has {x.shape[-1]} experts, model {model.name} has {model.num_experts}")
    if x.size and not (np.all(np.isfinite(x)) and x.min() >= 0):
        bad = tuple(int(i) for i in np.argwhere(~np.isfinite(x) | (x < 0))[0])
        raise PlanError(f"x{list(bad)} = {x[bad]}: token counts must be finite and >= 0")
    return cost_from_flow(flow_matrix(x, expert_gpu, shares), model, cluster, beta)
