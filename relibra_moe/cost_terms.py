"""The terms of one MoE cell's cost, each written once (docs/method.md, "Where each equation lives").

Every term is a numba ``njit`` function of plain arithmetic: the planners' kernels (``planners._kernels``,
``planners.split``, ``planners.replicate``) call the compiled function per GPU inside their loops, and the
numpy paths (``cost.py``) call the very same source on arrays through its ``.py_func`` (``np.maximum`` and the
comparisons broadcast). So there is one text per term; ``tests/test_cost_terms.py`` checks every reader against
it on random cells, term by term, including the readers that keep an incremental or smoothed form of their own.

Units: a *pair* is one (token, expert) assignment. ``sec_per_pair`` is the compute seconds of one pair
(``Rates.sec_per_pair`` = ``6 h h' / F``), ``nv_sec`` / ``rdma_sec`` the seconds one pair occupies an NVLink /
RDMA direction (``Rates.nvlink_sec_per_pair``: token bytes x the dispatcher's copies per pair / bandwidth). The
token-unit readers (``planners.split``) pass the same terms divided by ``sec_per_pair``.

The step-level terms (attention, the overlap rule, the replica fetch window, transfers, expert moves) are in
``timing.py``, each once, and read by the simulator and the planners alike.
"""

from __future__ import annotations

import numpy as np
from numba import njit
from numba.extending import overload

from .specs import CR, NV, SR

__all__ = ["on_nvlink", "on_rdma", "link_masks", "compute_seconds", "dispatch_seconds", "comm_seconds",
           "t_moe_seconds", "TERMS"]


@njit(cache=True)
def on_nvlink(link_class):
    """Whether a pair whose (source, target) has ``link_class`` (``specs.LOC / NV / SR / CR``) rides NVLink: the
    same node (nv), or across rails (cr: the NVLink hop to the rail GPU, then RDMA). Counted at the source's tx
    and the target's rx. Scalar or integer array."""
    return (link_class == NV) | (link_class == CR)


@njit(cache=True)
def on_rdma(link_class):
    """Whether such a pair rides RDMA: another node on the same rail (sr) or across rails (cr)."""
    return (link_class == SR) | (link_class == CR)


def link_masks(link_classes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """float64 ``(nvm [G, G], rdm [G, G])``: 1 where a source -> target pair rides NVLink / RDMA
    (:func:`on_nvlink`, :func:`on_rdma` of ``ClusterSpec.link_classes``)."""
    cls = np.asarray(link_classes)
    return on_nvlink.py_func(cls).astype(np.float64), on_rdma.py_func(cls).astype(np.float64)


@njit(cache=True)
def compute_seconds(pairs, sec_per_pair):
    """Forward expert-GEMM seconds of a GPU that serves ``pairs`` pairs: ``pairs x sec_per_pair``."""
    return pairs * sec_per_pair


def maximum(a, b):
    """Elementwise ``max(a, b)`` of arrays or scalars: ``np.maximum`` in numpy; in numba code, the scalar ``max``
    (``_maximum_scalar``: no NaN branch, so the kernels' loops stay as fast as with a plain ``max``)."""
    return np.maximum(a, b)


@overload(maximum, jit_options={"cache": True})
def _maximum_scalar(a, b):
    return lambda a, b: max(a, b)


@njit(cache=True)
def dispatch_seconds(nv_tx, nv_rx, rdma_tx, rdma_rx, nv_sec, rdma_sec):
    """Dispatch seconds of a GPU from the pairs it sends and receives on each link: the slowest of its four link
    directions, ``max(nv_tx nv_sec, nv_rx nv_sec, rdma_tx rdma_sec, rdma_rx rdma_sec)``."""
    return maximum(maximum(nv_tx * nv_sec, nv_rx * nv_sec), maximum(rdma_tx * rdma_sec, rdma_rx * rdma_sec))


@njit(cache=True)
def comm_seconds(dispatch):
    """All-to-all seconds of a GPU in one pass: the dispatch plus the combine, its mirror image (tx and rx
    swapped, the same time): ``2 x dispatch``."""
    return 2.0 * dispatch


@njit(cache=True)
def t_moe_seconds(comp_max, comm_max):
    """T_MoE of a cell, the forward MoE time: ``max_g comp + max_g comm`` (the arguments are the two maxima, or
    their LSE-smoothed values)."""
    return comp_max + comm_max


TERMS = ("link", "compute", "dispatch", "comm", "t_moe", "smooth")
"""The terms ``tests/test_cost_terms.py`` checks every reader on: which links carry a pair, compute seconds,
dispatch seconds per GPU, dispatch + combine, T_MoE, and the LSE-smoothed T_MoE (``cost.smooth_max`` in numpy,
``planners._kernels.layer_objective`` in numba, two forms of one formula)."""
