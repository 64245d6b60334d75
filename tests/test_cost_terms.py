"""cost_terms: every reader of the MoE cell's cost, pinned term by term on random cells.

A reader is a place that evaluates the cost model: ``cost.py`` (numpy), the numba kernels of
``planners._kernels`` (fresh state, incremental swap, sample rows, batch), ``planners.split`` (token units, the
exact LP, the heuristic split) and ``planners.replicate`` (the greedy loop, the replica pricing's terms). Each
exposes some of the terms (per-GPU loads and link pairs, max compute, max comm, T_MoE, the LSE-smoothed T_MoE);
every exposed term must equal a float64 loop written out here, independently of ``cost_terms``. A change to a
term made in one reader only (or in ``cost_terms`` only) therefore fails ``test_every_reader_matches_the_
reference``; ``test_a_term_changed_in_one_reader_is_caught`` shows the check catches a change of any single
(reader, term) pair. The step-level compositions of ``timing.py`` are pinned at the end.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from relibra_moe import cost_terms, timing
from relibra_moe.cost import moe_cost, peak_comp_comm
from relibra_moe.planners import _kernels as K
from relibra_moe.planners.reorder import cluster_constants
from relibra_moe.planners.replicate import CellResult, cell_step_terms, greedy_cell, replicate_cell_greedy
from relibra_moe.planners.split import (
    aggregates,
    cell_weights,
    fast_split,
    home_flows,
    solve_split_lp,
    split_cost,
    t_units,
)
from relibra_moe.specs import ClusterSpec, ModelSpec

RTOL = 1e-12
SMOOTH_RTOL = 1e-9  # the kernels skip LSE terms below exp(-40) of the max
BETA = 20.0


class Cell:
    """One random cell: loads ``x [G, E]`` (integer counts in float64), homes ``[E]``, its model and cluster."""

    def __init__(self, x, homes, model, cluster):
        self.x, self.homes, self.model, self.cluster = x, homes, model, cluster
        self.G, self.E, self.P = x.shape[0], x.shape[1], cluster.gpus_per_node

    def __repr__(self) -> str:
        return (f"Cell(x={self.x.tolist()}, homes={self.homes.tolist()}, {self.model.hidden}x{self.model.ffn} "
                f"k={self.model.top_k}, {self.cluster.nodes}x{self.P} {self.cluster.dispatcher})")


@st.composite
def cells(draw) -> Cell:
    nodes = draw(st.integers(1, 3))
    per_node = draw(st.integers(1, 4))
    G = nodes * per_node
    E = G * draw(st.integers(1, 3))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    x = rng.integers(0, draw(st.sampled_from([1, 5, 100])) + 1, (G, E)).astype(np.float64)
    homes = rng.permutation(np.repeat(np.arange(G), E // G)).astype(np.int64)
    model = ModelSpec("t", hidden=int(rng.integers(8, 512)), ffn=int(rng.integers(8, 512)), num_experts=E,
                      top_k=int(rng.integers(1, min(E, 4) + 1)), num_layers=1, dtype_bytes=2)
    cluster = ClusterSpec(nodes=nodes, gpus_per_node=per_node, nvlink_bw=float(rng.uniform(1e9, 1e12)),
                          rdma_bw=float(rng.uniform(1e8, 1e11)), flops=float(rng.uniform(1e12, 1e15)),
                          dispatcher=draw(st.sampled_from(["alltoall", "deepep"])))
    return Cell(x, homes, model, cluster)


def _lse(values, scale):
    m = max(values)
    return m + scale / BETA * math.log(sum(math.exp(BETA * (v - m) / scale) for v in values))


def reference(c: Cell) -> dict:
    """Every term by float64 loops over (source, expert), from the link rules of docs/method.md."""
    r = c.cluster.rates(c.model)
    load = np.zeros(c.G)
    link = np.zeros((4, c.G))  # NVLink tx, rx, RDMA tx, rx pairs
    for j in range(c.G):
        for e in range(c.E):
            g, v = int(c.homes[e]), c.x[j, e]
            same_node, same_rail = j // c.P == g // c.P, j % c.P == g % c.P
            load[g] += v
            if j != g and (same_node or not same_rail):  # nv, or cr (the NVLink hop)
                link[0, j] += v
                link[1, g] += v
            if not same_node:  # sr or cr
                link[2, j] += v
                link[3, g] += v
    comp = [load[g] * r.sec_per_pair for g in range(c.G)]
    secs = [[link[0, g] * r.nvlink_sec_per_pair, link[1, g] * r.nvlink_sec_per_pair,
             link[2, g] * r.rdma_sec_per_pair, link[3, g] * r.rdma_sec_per_pair] for g in range(c.G)]
    comm = [2.0 * max(s) for s in secs]
    scale = sum(comp) / c.G if sum(comp) > 0 else 1.0
    smooth = _lse(comp, scale) + _lse([2.0 * _lse(s, scale) for s in secs], scale)
    return {"load": load, "link": link, "compute": max(comp), "comm": max(comm), "t_moe": max(comp) + max(comm),
            "smooth": smooth}


def read_cost_py(c: Cell) -> dict:
    r = c.cluster.rates(c.model)
    cost = moe_cost(c.x, c.homes, c.model, c.cluster)
    tb = c.model.token_bytes
    link = np.stack([cost.nvlink_tx / (tb * r.nvlink_copies), cost.nvlink_rx / (tb * r.nvlink_copies),
                     cost.rdma_tx / (tb * r.rdma_copies), cost.rdma_rx / (tb * r.rdma_copies)])
    flow = c.x @ (c.homes[:, None] == np.arange(c.G)).astype(float)
    peak_comp, peak_comm = peak_comp_comm(flow, c.model, c.cluster)
    assert (peak_comp, peak_comm) == (cost.comp.max(), cost.comm.max())
    return {"load": cost.load, "link": link, "compute": float(cost.comp.max()), "comm": float(cost.comm.max()),
            "t_moe": float(cost.t_moe), "smooth": float(cost.t_moe_smooth)}


def _objective_terms(objective) -> dict:
    """compute / comm / t_moe of a kernel objective ``objective(cc, tnv, trd)`` (a rate of 0 drops its term)."""
    return {"compute": objective(1, 0), "comm": objective(0, 1), "t_moe": objective(1, 1)}


def read_kernel_state(c: Cell) -> dict:
    nvm, rdm, cc, tnv, trd = cluster_constants(c.model, c.cluster)
    s = np.zeros((5, c.G))
    K.init_state(c.x, c.homes, nvm, rdm, s)
    buf = np.zeros(c.G)

    def obj(a, b, smooth=False):
        return K.layer_objective(s[0], s[1], s[2], s[3], s[4], a * cc, b * tnv, b * trd, BETA, smooth, buf)

    return {"load": s[0].copy(), "link": s[1:].copy(), **_objective_terms(obj), "smooth": obj(1, 1, True)}


def read_kernel_swap(c: Cell) -> dict:
    """swap_state / swap_objective_exact from the homes with two experts of different GPUs exchanged."""
    if c.G < 2:
        return {}
    nvm, rdm, cc, tnv, trd = cluster_constants(c.model, c.cluster)
    a, b = 0, int(np.flatnonzero(c.homes != c.homes[0])[0])
    start = c.homes.copy()
    start[[a, b]] = c.homes[[b, a]]
    s, out = np.zeros((5, c.G)), np.zeros((5, c.G))
    K.init_state(c.x, start, nvm, rdm, s)
    K.swap_state(c.x, a, start[a], b, start[b], nvm, rdm, s, out)
    return {"load": out[0], "link": out[1:], **_objective_terms(
        lambda p, q: K.swap_objective_exact(c.x, a, start[a], b, start[b], nvm, rdm, s, p * cc, q * tnv, q * trd,
                                              np.zeros(c.G)))}


def _samples(c: Cell):
    """Each source GPU's row as one sample: ``cf [N = G, L = 1, G]`` and the kernels' constants."""
    nvm, rdm, cc, tnv, trd = cluster_constants(c.model, c.cluster)
    return K.sample_flows(c.x.astype(np.int64)[:, None, :], c.homes[None, :], c.G), nvm, rdm, cc, tnv, trd


def read_kernel_rows_move(c: Cell) -> dict:
    """sample_states / rows_objective_exact after the annealer's move into a micro-batch (sample 0, held in
    another micro-batch, arrives on GPU 0), and mb_objective of the result."""
    cf, nvm, rdm, cc, tnv, trd = _samples(c)
    gpu, mb, buf = np.arange(c.G), np.zeros(c.G, np.int64), np.zeros(c.G)
    mb[0] = 1
    s = K.sample_states(cf, mb, gpu, 2, nvm, rdm)[0]
    terms = _objective_terms(lambda p, q: K.rows_objective_exact(s, cf, 0, -1, 0, -1, nvm, rdm, p * cc, q * tnv,
                                                                  q * trd, buf))
    s = K.sample_states(cf, np.zeros(c.G, np.int64), gpu, 1, nvm, rdm)[0]
    return {"load": s[0, 0], "link": s[0, 1:], **terms, "smooth": K.mb_objective(s, cc, tnv, trd, BETA, True, buf)}


def read_kernel_rows_swap(c: Cell) -> dict:
    """rows_objective_exact after the annealer's swap inside a micro-batch (samples 0 and 1 trade GPUs 1 and 0)."""
    if c.G < 2:
        return {}
    cf, nvm, rdm, cc, tnv, trd = _samples(c)
    gpu = np.arange(c.G)
    gpu[[0, 1]] = 1, 0
    s = K.sample_states(cf, np.zeros(c.G, np.int64), gpu, 1, nvm, rdm)[0]
    buf = np.zeros(c.G)
    return _objective_terms(lambda p, q: K.rows_objective_exact(s, cf, 1, 0, 1, 0, nvm, rdm, p * cc, q * tnv,
                                                                 q * trd, buf))


def read_kernel_batch(c: Cell) -> dict:
    nvm, rdm, cc, tnv, trd = cluster_constants(c.model, c.cluster)
    return _objective_terms(lambda p, q: K.batch_objective_exact(c.x[None], c.homes, nvm, rdm, p * cc, q * tnv,
                                                                 q * trd))


def read_split_units(c: Cell) -> dict:
    """split's token units (aggregates, t_units, cell_weights) times the seconds of one pair."""
    w = cell_weights(c.model, c.cluster)
    hold = np.full((c.E, c.P), -1, np.int64)
    hold[:, 0] = c.homes
    agg = aggregates(c.x, hold, home_flows(c.x, c.P), c.cluster.link_classes.astype(np.int64))
    no_load = agg.copy()
    no_load[0] = 0.0
    return {"load": agg[0], "link": agg[1:], "compute": t_units(agg, 0.0, 0.0) * w.sec_per_token,
            "comm": t_units(no_load, w.w_nv, w.w_rdma) * w.sec_per_token,
            "t_moe": t_units(agg, w.w_nv, w.w_rdma) * w.sec_per_token}


def _no_replicas(c: Cell) -> np.ndarray:
    return np.full((c.G, 1), -1)


def read_greedy_cell(c: Cell) -> dict:
    """replicate.greedy_cell's T (token units) without replica slots."""
    w = cell_weights(c.model, c.cluster)
    scale = max(c.x.sum() / c.G, 1e-12)
    cls = c.cluster.link_classes.astype(np.int64)
    return {"t_moe": greedy_cell(c.x / scale, c.homes, c.P, 0, cls, w.w_nv, w.w_rdma, 1, False, 0)[3] * scale
            * w.sec_per_token}


def read_cell_step_terms(c: Cell) -> dict:
    """The replica pricing's ``(max comp, max comm)`` of a cell without replicas."""
    none = CellResult(_no_replicas(c), np.zeros((0, 3), np.int32), np.zeros(0), 0.0)
    comp, comm, _ = cell_step_terms(c.x, c.homes, none, c.model, c.cluster)
    return {"compute": comp, "comm": comm}


READERS_T_MOE = {
    "split.split_cost": lambda c: split_cost(c.x, c.homes, np.zeros((0, 3)), np.zeros(0), c.model, c.cluster),
    "split.fast_split": lambda c: fast_split(c.x, c.homes, _no_replicas(c), c.model, c.cluster).t_moe,
    "split.solve_split_lp": lambda c: solve_split_lp(c.x, c.homes, _no_replicas(c), c.model, c.cluster).t_moe,
    "replicate.replicate_cell_greedy": lambda c: replicate_cell_greedy(c.x, c.homes, c.model, c.cluster, 0).t_moe,
}
"""Readers that give T_MoE only (the split solvers and the greedy, here without replicas)."""


READERS = {"cost.py": read_cost_py, "_kernels.layer_objective": read_kernel_state,
           "_kernels.swap": read_kernel_swap, "_kernels.rows (move)": read_kernel_rows_move,
           "_kernels.rows (swap)": read_kernel_rows_swap,
           "_kernels.batch_objective_exact": read_kernel_batch, "split.t_units": read_split_units,
           "replicate.greedy_cell": read_greedy_cell, "replicate.cell_step_terms": read_cell_step_terms,
           **{name: (lambda c, f=f: {"t_moe": f(c)}) for name, f in READERS_T_MOE.items()}}


def mismatches(c: Cell, readers: dict) -> list[tuple[str, str]]:
    """``(reader, term)`` pairs whose value differs from :func:`reference` beyond the tolerance."""
    ref = reference(c)
    out = []
    for name, read in readers.items():
        for term, got in read(c).items():
            rtol = SMOOTH_RTOL if term == "smooth" else RTOL
            scale = max(np.max(np.abs(ref[term])), 1e-300)  # relative to the term's largest value
            if not np.allclose(got, ref[term], rtol=0, atol=rtol * scale):
                out.append((name, term))
    return out


STALE_HINT = ("a reader disagrees with the reference. If only cost_terms.py changed, numba's cache of the kernel "
              "modules may predate it (numba does not follow a called function): remove "
              "relibra_moe/planners/__pycache__/*.nbi and run again")


@settings(max_examples=40, deadline=None)
@given(cells())
def test_every_reader_matches_the_reference(c):
    bad = mismatches(c, READERS)
    assert not bad, f"{STALE_HINT}: {bad}"


def test_every_term_is_read_by_numpy_and_numba():
    c = Cell(np.arange(16, dtype=float).reshape(4, 4), np.arange(4), ModelSpec("t", 8, 8, 4, 2, 1),
             ClusterSpec(nodes=2, gpus_per_node=2))
    read = {name: set(f(c)) for name, f in READERS.items()}
    for term in ("load", "link", "compute", "comm", "t_moe", "smooth"):
        assert term in read["cost.py"]
        assert any(term in terms for name, terms in read.items() if name != "cost.py"), term
    assert set(cost_terms.TERMS) <= {"link", "compute", "dispatch", "comm", "t_moe", "smooth"}


@pytest.mark.parametrize("reader", sorted(READERS))
def test_a_term_changed_in_one_reader_is_caught(reader):
    """Perturb every term of one reader in turn (1e-9 relative, the smallest edit a formula change makes): the check
    names exactly that (reader, term), so a change made in one place and not the other cannot pass."""
    c = Cell(np.array([[5.0, 0, 3, 1, 0, 2], [0, 4, 1, 0, 6, 0], [2, 2, 0, 7, 1, 0]]), np.array([0, 1, 2, 0, 1, 2]),
             ModelSpec("t", 64, 32, 6, 2, 1), ClusterSpec(nodes=3, gpus_per_node=1, nvlink_bw=1e11, rdma_bw=1e10))
    c2 = Cell(np.tile(c.x, (2, 1))[:4, :4] + 1, np.array([0, 1, 2, 3]), ModelSpec("t", 64, 32, 4, 2, 1),
              ClusterSpec(nodes=2, gpus_per_node=2, nvlink_bw=1e11, rdma_bw=1e10))
    for cell in (c, c2):
        assert mismatches(cell, READERS) == []
        for term in READERS[reader](cell):
            def perturbed(cc, term=term):
                out = READERS[reader](cc)
                out[term] = np.asarray(out[term]) * (1 + 1e-9) + (1e-9 if not np.any(out[term]) else 0.0)
                return out

            assert mismatches(cell, {**READERS, reader: perturbed}) == [(reader, term)]


def test_cost_terms_by_hand():
    assert cost_terms.on_nvlink(1) and cost_terms.on_nvlink(3) and not cost_terms.on_nvlink(2)
    assert cost_terms.on_rdma(2) and cost_terms.on_rdma(3) and not cost_terms.on_rdma(0)
    nvm, rdm = cost_terms.link_masks(ClusterSpec(nodes=2, gpus_per_node=2).link_classes)
    # GPU 0: 1 same node (nv), 2 same rail (sr), 3 cross rail (cr)
    np.testing.assert_array_equal(nvm[0], [0, 1, 0, 1])
    np.testing.assert_array_equal(rdm[0], [0, 0, 1, 1])
    assert cost_terms.dispatch_seconds(1.0, 2.0, 3.0, 0.5, 10.0, 4.0) == 20.0
    assert cost_terms.comm_seconds(3.0) == 6.0
    assert cost_terms.t_moe_seconds(1.0, 2.0) == 3.0
    assert cost_terms.compute_seconds(4.0, 0.5) == 2.0


# ---- the step-level terms of timing.py: each composition equals its parts ----

@settings(max_examples=60, deadline=None)
@given(st.floats(0, 10), st.floats(0, 10), st.floats(0, 10), st.floats(0, 10), st.sampled_from(timing.REPLICA_FETCHES),
       st.sampled_from(timing.OVERLAPS))
def test_timing_compositions_agree(a, c, m, push, fetch, overlap):
    fwd, bwd = timing.moe_forward_seconds(c, m), timing.moe_backward_seconds(c, m)
    assert fwd == cost_terms.t_moe_seconds(c, m)
    assert timing.moe_step_seconds(c, m) == pytest.approx(fwd + bwd, rel=RTOL, abs=1e-300)
    assert timing.layer_step_seconds(a, c, m, "none") == pytest.approx(a + timing.attention_backward(a) + fwd + bwd,
                                                                       rel=RTOL, abs=1e-300)
    want = (fwd + bwd + max(0.0, push - timing.replica_push_overlap(a, m, fetch))
            + max(0.0, push - timing.attention_backward(a)))
    assert timing.cell_step_seconds(c, m, push, a, fetch) == pytest.approx(want, rel=RTOL, abs=1e-300)
    # under the trainer's overlap: the simulator's cell (layer_step_seconds, local stage included) plus the same
    # exposed transfers, less the local stage
    exposed = want - fwd - bwd
    local = a + timing.attention_backward(a)
    assert timing.cell_step_seconds(c, m, push, a, fetch, overlap) + local == pytest.approx(
        timing.layer_step_seconds(a, c, m, overlap) + exposed, rel=RTOL, abs=1e-9)
    assert timing.STEP_COMP_WEIGHT == timing.moe_step_seconds(1.0, 0.0) / timing.moe_step_seconds(0.0, 1.0)
