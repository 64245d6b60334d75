"""Numba inner loops of the planners: incremental cost-model state and simulated annealing.

Everything here works on float64 token counts (integers stored exactly, so incremental updates are
exact). The cost terms are ``relibra_moe.cost_terms``'s (compute, dispatch, comm, T_MoE), called per GPU, the same
functions ``cost.cost_from_flow`` applies to arrays; the incremental states and the LSE smoothing are this
module's own forms, pinned to ``cost.py`` term by term by ``tests/test_cost_terms.py``. The per-GPU state of one MoE
layer (one micro-batch) is five vectors ``[G]``:

- ``load[g]``  tokens computed on GPU g (sum of the flow column g),
- ``nvtx[j]`` / ``nvrx[g]``  NVLink-carried tokens sent by j / received by g (link classes nv, cr),
- ``rdtx[j]`` / ``rdrx[g]``  RDMA-carried tokens (link classes sr, cr).

Constants: ``cc`` seconds of compute per (token, expert) pair, ``tnv`` / ``trd`` seconds per token on
NVLink / RDMA (token bytes over the bandwidth), ``nvm`` / ``rdm`` float64 ``[G, G]`` masks of the
links that carry a source -> target token.

The objective of one layer is ``T_MoE`` (exact: max) or its LSE-smoothed version with the layer's
scale ``s = cc * total_tokens / G`` (the mean per-GPU compute time), exactly as ``cost.py``.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit

from ..cost_terms import comm_seconds, compute_seconds, dispatch_seconds, t_moe_seconds

# exp(-40) ~ 4e-18: terms further below the max than this contribute nothing at float64 precision
_SKIP = 40.0


@njit(cache=True, inline="always")
def _lse4(a, b, c, d, inv):
    """LSE of four values with ``inv = beta / scale``."""
    m = max(max(a, b), max(c, d))
    s = 0.0
    for v in (a, b, c, d):
        z = (v - m) * inv
        if z > -_SKIP:
            s += math.exp(z)
    return m + math.log(s) / inv


@njit(cache=True)
def layer_objective(load, nvtx, nvrx, rdtx, rdrx, cc, tnv, trd, beta, smooth, buf, ns=1, cap=0.0, pen=0.0):
    """T_MoE (seconds) of one layer from its per-GPU state; ``buf`` is a float64 scratch ``[G]``.

    smooth: True for the LSE-smoothed value (cost.py's ``t_moe_smooth``), False for the exact one.
    ns: compute model. 1: the cost model's ``cc max_g load[g]``. ``ns > 1`` (the GPUs per node): the
    replication-aware proxy ``cc max_n mean_{g in node n} load[g]`` (nodes are the blocks of ``ns``
    consecutive GPUs), what the compute term becomes once intra-node replicas level each node.
    cap, pen: with ``pen > 0`` the compute term gains ``pen * max(0, cmax - (1 + cap) * mean)``, cmax being
    the (per-GPU or per-node) maximum and mean the mean GPU compute: a soft cap on the compute skew.
    """
    G = load.shape[0]
    total = 0.0
    for g in range(G):
        total += load[g]
    scale = cc * total / G
    if scale <= 0.0:
        scale = 1.0
    inv = beta / scale
    cmax = -1e300
    if ns > 1:
        nn = G // ns
        for n in range(nn):
            v = 0.0
            for g in range(n * ns, n * ns + ns):
                v += load[g]
            buf[n] = compute_seconds(v, cc) / ns
            if buf[n] > cmax:
                cmax = buf[n]
    else:
        nn = G
        for g in range(G):
            buf[g] = compute_seconds(load[g], cc)
            if buf[g] > cmax:
                cmax = buf[g]
    over = 0.0
    if pen > 0.0:
        over = pen * max(0.0, cmax - (1.0 + cap) * cc * total / G)
    if not smooth:
        mm = -1e300
        for g in range(G):
            t = dispatch_seconds(nvtx[g], nvrx[g], rdtx[g], rdrx[g], tnv, trd)
            if t > mm:
                mm = t
        return t_moe_seconds(cmax + over, comm_seconds(mm))
    s = 0.0
    for g in range(nn):
        z = (buf[g] - cmax) * inv
        if z > -_SKIP:
            s += math.exp(z)
    comp = cmax + math.log(s) / inv + over
    mm = -1e300
    for g in range(G):
        a = nvtx[g] * tnv
        b = nvrx[g] * tnv
        c = rdtx[g] * trd
        d = rdrx[g] * trd
        # cheap upper part first: LSE4 >= max, and the LSE over GPUs only needs the terms near the max
        buf[g] = comm_seconds(_lse4(a, b, c, d, inv))
        if buf[g] > mm:
            mm = buf[g]
    s = 0.0
    for g in range(G):
        z = (buf[g] - mm) * inv
        if z > -_SKIP:
            s += math.exp(z)
    return comp + mm + math.log(s) / inv  # t_moe_seconds(comp, comm LSE), summed in recorded order


@njit(cache=True)
def init_state(x, expert_gpu, nvm, rdm, st):
    """Fill ``st [5, G]`` (load, nvtx, nvrx, rdtx, rdrx) from loads ``x [G, E]`` and homes ``[E]``."""
    G, E = x.shape
    st[:, :] = 0.0
    for j in range(G):
        for e in range(E):
            v = x[j, e]
            if v == 0.0:
                continue
            g = expert_gpu[e]
            st[0, g] += v
            st[1, j] += v * nvm[j, g]
            st[2, g] += v * nvm[j, g]
            st[3, j] += v * rdm[j, g]
            st[4, g] += v * rdm[j, g]


@njit(cache=True)
def _move_expert(x, e, src, dst, nvm, rdm, out):
    """Move expert e's pairs (column ``x[:, e]``) from GPU src to GPU dst in the state ``out [5, G]``, in place."""
    for j in range(x.shape[0]):
        v = x[j, e]
        if v == 0.0:
            continue
        out[0, src] -= v
        out[0, dst] += v
        out[1, j] += v * (nvm[j, dst] - nvm[j, src])
        out[2, src] -= v * nvm[j, src]
        out[2, dst] += v * nvm[j, dst]
        out[3, j] += v * (rdm[j, dst] - rdm[j, src])
        out[4, src] -= v * rdm[j, src]
        out[4, dst] += v * rdm[j, dst]


@njit(cache=True)
def swap_state(x, a, ga, b, gb, nvm, rdm, st, out):
    """State ``out [5, G]`` after swapping experts a (on GPU ga) and b (on gb), from ``st``: O(G). Exact: the
    counts are integers in float64, so the order of the updates does not change a bit.

    x: ``[G, E]`` loads of the layer (one micro-batch or the aggregate).
    """
    out[:, :] = st[:, :]
    _move_expert(x, a, ga, gb, nvm, rdm, out)
    _move_expert(x, b, gb, ga, nvm, rdm, out)


@njit(cache=True)
def swap_objective_exact(x, a, ga, b, gb, nvm, rdm, st, cc, tnv, trd, dj, ns=1, cap=0.0, pen=0.0):
    """Exact T_MoE of one layer after swapping experts a (on ga) and b (on gb), without building the new
    state (two O(G) passes, no copy); ``dj`` is a float64 scratch ``[G]``. Equals
    ``layer_objective(swap_state(...), smooth=False, ns=ns, cap=cap, pen=pen)``."""
    G = x.shape[0]
    sd = 0.0
    nva = 0.0
    nvb = 0.0
    rda = 0.0
    rdb = 0.0
    for j in range(G):
        d = x[j, b] - x[j, a]
        dj[j] = d
        sd += d
        nva += d * nvm[j, ga]
        nvb += d * nvm[j, gb]
        rda += d * rdm[j, ga]
        rdb += d * rdm[j, gb]
    cmax = -1e300
    mm = -1e300
    nsum = 0.0
    tot = 0.0
    for g in range(G):
        ld = st[0, g]
        nrx = st[2, g]
        rrx = st[4, g]
        if g == ga:
            ld += sd
            nrx += nva
            rrx += rda
        elif g == gb:
            ld -= sd
            nrx -= nvb
            rrx -= rdb
        d = dj[g]
        ntx = st[1, g] + d * (nvm[g, ga] - nvm[g, gb])
        rtx = st[3, g] + d * (rdm[g, ga] - rdm[g, gb])
        tot += ld
        if ns > 1:
            nsum += ld
            if (g + 1) % ns == 0:
                if nsum / ns > cmax:
                    cmax = nsum / ns
                nsum = 0.0
        elif ld > cmax:
            cmax = ld
        t = dispatch_seconds(ntx, nrx, rtx, rrx, tnv, trd)
        if t > mm:
            mm = t
    over = 0.0
    if pen > 0.0:
        over = pen * max(0.0, cmax - (1.0 + cap) * tot / G)
    return t_moe_seconds(compute_seconds(cmax + over, cc), comm_seconds(mm))


@njit(cache=True)
def anneal_experts(x, expert_gpu0, nvm, rdm, cc, tnv, trd, beta, smooth, t0_frac, eps_frac, iters, seed, ns=1,
                   cap=0.0, pen=0.0):
    """Swap simulated annealing of expert homes for one layer (Algorithm 1's inner loop).

    Args:
        x: float64 ``[M, G, E]`` loads per micro-batch (M = 1 for the batch-aggregated objective).
        expert_gpu0: int64 ``[E]`` starting homes (e.g. LPT); the GPU expert counts never change.
        smooth: anneal on the LSE-smoothed objective (True) or the exact one.
        t0_frac, eps_frac: start / end temperature as fractions of the starting objective; the
            temperature decays geometrically over ``iters`` proposals.
        seed: numba RNG seed.
        ns, cap, pen: compute model of ``layer_objective`` (ns 1: per GPU; GPUs per node: per-node mean;
            pen > 0: soft cap ``cap`` on the compute skew).

    Returns:
        (best expert_gpu int64 [E], best objective, starting objective): the objective is the sum
        over the M micro-batches of the (smoothed or exact) T_MoE in seconds.
    """
    M, G, E = x.shape
    np.random.seed(seed)
    eg = expert_gpu0.copy()
    st = np.zeros((M, 5, G))
    tmp = np.zeros((M, 5, G))
    buf = np.zeros(G)
    objm = np.zeros(M)
    tobj = np.zeros(M)
    cur = 0.0
    for m in range(M):
        init_state(x[m], eg, nvm, rdm, st[m])
        objm[m] = layer_objective(st[m, 0], st[m, 1], st[m, 2], st[m, 3], st[m, 4], cc, tnv, trd, beta, smooth,
                                  buf, ns, cap, pen)
        cur += objm[m]
    start = cur
    best = cur
    best_eg = eg.copy()
    if G < 2 or iters <= 0 or cur <= 0.0:
        return best_eg, best, start
    temp = t0_frac * cur
    t_end = eps_frac * cur
    gamma = (t_end / temp) ** (1.0 / iters)
    for _ in range(iters):
        a = np.random.randint(E)
        b = np.random.randint(E)
        while eg[b] == eg[a]:
            b = np.random.randint(E)
        ga = eg[a]
        gb = eg[b]
        new = 0.0
        for m in range(M):
            if smooth:
                swap_state(x[m], a, ga, b, gb, nvm, rdm, st[m], tmp[m])
                tobj[m] = layer_objective(tmp[m, 0], tmp[m, 1], tmp[m, 2], tmp[m, 3], tmp[m, 4], cc, tnv, trd,
                                          beta, smooth, buf, ns, cap, pen)
            else:
                tobj[m] = swap_objective_exact(x[m], a, ga, b, gb, nvm, rdm, st[m], cc, tnv, trd, buf, ns, cap, pen)
            new += tobj[m]
        delta = new - cur
        if delta <= 0.0 or np.random.random() < math.exp(-delta / temp):
            eg[a] = gb
            eg[b] = ga
            if smooth:
                st[:, :, :] = tmp[:, :, :]
            else:
                for m in range(M):
                    swap_state(x[m], a, ga, b, gb, nvm, rdm, st[m], tmp[m])
                    st[m, :, :] = tmp[m]
            objm[:] = tobj[:]
            cur = new
            if cur < best:
                best = cur
                best_eg[:] = eg[:]
        temp *= gamma
    return best_eg, best, start


@njit(cache=True)
def _add_sample(cf, n, j, nvm, rdm, st, sign):
    """Add (sign=1) or remove (sign=-1) sample n, running on source GPU j, to the state ``st [L, 5, G]``.

    cf: ``[N, L, G]`` tokens of each sample per layer per target GPU (under the frozen homes).
    """
    L = cf.shape[1]
    G = cf.shape[2]
    for l in range(L):
        tx_nv = 0.0
        tx_rd = 0.0
        for g in range(G):
            v = sign * cf[n, l, g]
            if v == 0.0:
                continue
            st[l, 0, g] += v
            st[l, 2, g] += v * nvm[j, g]
            st[l, 4, g] += v * rdm[j, g]
            tx_nv += v * nvm[j, g]
            tx_rd += v * rdm[j, g]
        st[l, 1, j] += tx_nv
        st[l, 3, j] += tx_rd


@njit(cache=True)
def mb_objective(st, cc, tnv, trd, beta, smooth, buf):
    """Sum over layers of T_MoE for one micro-batch's state ``st [L, 5, G]``."""
    tot = 0.0
    for l in range(st.shape[0]):
        tot += layer_objective(st[l, 0], st[l, 1], st[l, 2], st[l, 3], st[l, 4], cc, tnv, trd, beta, smooth, buf)
    return tot


@njit(cache=True)
def sample_states(cf, mb, gpu, M, nvm, rdm):
    """float64 ``[M, L, 5, G]`` state of every micro-batch and layer for a sample placement."""
    N, L, G = cf.shape
    st = np.zeros((M, L, 5, G))
    for n in range(N):
        _add_sample(cf, n, gpu[n], nvm, rdm, st[mb[n]], 1.0)
    return st


@njit(cache=True)
def rows_objective_exact(st, cf, n_plus, n_minus, j1, j2, nvm, rdm, cc, tnv, trd, dbuf):
    """Exact sum over layers of T_MoE of one micro-batch after a row change, without copying the state.

    The change: source row j1 of the flow gains ``D = cf[n_plus] - cf[n_minus]`` (a missing sample is -1),
    and, if ``j2 >= 0``, row j2 loses D (a move inside the micro-batch: GPU loads unchanged).
    st: ``[L, 5, G]`` state of the micro-batch; dbuf: float64 scratch ``[G]``. O(L G), two passes per layer.
    """
    L = st.shape[0]
    G = st.shape[2]
    tot = 0.0
    for l in range(L):
        t1n = 0.0
        t1r = 0.0
        t2n = 0.0
        t2r = 0.0
        for g in range(G):
            d = 0.0
            if n_plus >= 0:
                d += cf[n_plus, l, g]
            if n_minus >= 0:
                d -= cf[n_minus, l, g]
            dbuf[g] = d
            t1n += d * nvm[j1, g]
            t1r += d * rdm[j1, g]
            if j2 >= 0:
                t2n += d * nvm[j2, g]
                t2r += d * rdm[j2, g]
        cmax = -1e300
        mm = -1e300
        for g in range(G):
            d = dbuf[g]
            ld = st[l, 0, g]
            nrx = st[l, 2, g] + d * nvm[j1, g]
            rrx = st[l, 4, g] + d * rdm[j1, g]
            if j2 >= 0:
                nrx -= d * nvm[j2, g]
                rrx -= d * rdm[j2, g]
            else:
                ld += d
            ntx = st[l, 1, g]
            rtx = st[l, 3, g]
            if g == j1:
                ntx += t1n
                rtx += t1r
            if g == j2:
                ntx -= t2n
                rtx -= t2r
            if ld > cmax:
                cmax = ld
            t = dispatch_seconds(ntx, nrx, rtx, rrx, tnv, trd)
            if t > mm:
                mm = t
        tot += t_moe_seconds(compute_seconds(cmax, cc), comm_seconds(mm))
    return tot


@njit(cache=True)
def _row_max(row, ja, da, jb, db):
    """``max_g row[g]`` after ``row[ja] += da`` and (``jb >= 0``) ``row[jb] += db``, without changing ``row``."""
    out = -1e300
    for g in range(row.shape[0]):
        v = row[g]
        if g == ja:
            v += da
        if g == jb:
            v += db
        if v > out:
            out = v
    return out


@njit(cache=True)
def anneal_samples(cf, tok1, tok2, mb0, gpu0, M, nvm, rdm, cc, tnv, trd, beta, smooth, repack, cap1, cap2,
                   token_cap, t0_frac, eps_frac, iters, seed, swap_only, att, att_w):
    """Simulated annealing of where samples run, experts frozen.

    Moves: swap the GPUs of two samples of one micro-batch; move one sample to another GPU of its
    micro-batch; with ``repack``, swap two samples of different micro-batches (their (micro-batch,
    GPU) slots), and with ``token_cap > 0`` also move one sample to another micro-batch whose tokens stay
    within ``token_cap``. A move is allowed only if every touched (micro-batch, GPU) cell keeps its
    attention work (sum of tokens ``tok1``, sum of squares ``tok2``) within ``cap1`` / ``cap2`` or does
    not increase it. ``swap_only``: a drawn move becomes the swap of its kind (in / across micro-batches), so
    every (micro-batch, GPU) cell keeps its number of samples (the random stream of the default is unchanged).

    Args:
        cf: float64 ``[N, L, G]`` tokens of sample n in layer l routed to experts homed on GPU g.
        tok1, tok2: float64 ``[N]`` tokens and tokens squared of each sample.
        mb0, gpu0: int64 ``[N]`` starting micro-batch and GPU of each sample.
        M: number of micro-batches.
        att, att_w: float64 ``[N]`` seconds of each sample's local stage (one layer) and the weight of each
            micro-batch's slowest GPU's sum of them in the objective (``att_w`` 0: not charged).

    Returns:
        (micro_batch int64 [N], gpu int64 [N], best objective, starting objective), the objective
        being the sum over micro-batches and layers of the (smoothed or exact) T_MoE in seconds (plus
        ``att_w x max_g`` local seconds per micro-batch).
    """
    N, L, G = cf.shape
    np.random.seed(seed)
    mb = mb0.copy()
    gpu = gpu0.copy()
    st = sample_states(cf, mb, gpu, M, nvm, rdm)
    buf = np.zeros(G)
    objm = np.zeros(M)
    wa = np.zeros((M, G))
    charge = att_w > 0.0
    if charge:
        for n in range(N):
            wa[mb[n], gpu[n]] += att[n]
    cur = 0.0
    for m in range(M):
        objm[m] = mb_objective(st[m], cc, tnv, trd, beta, smooth, buf)
        if charge:
            objm[m] += att_w * _row_max(wa[m], -1, 0.0, -1, 0.0)
        cur += objm[m]
    start = cur
    best = cur
    best_mb = mb.copy()
    best_gpu = gpu.copy()
    # attention work per cell and micro-batch token totals
    w1 = np.zeros((M, G))
    w2 = np.zeros((M, G))
    mtok = np.zeros(M)
    count = np.zeros(M, np.int64)
    for n in range(N):
        w1[mb[n], gpu[n]] += tok1[n]
        w2[mb[n], gpu[n]] += tok2[n]
        mtok[mb[n]] += tok1[n]
        count[mb[n]] += 1
    # members of each micro-batch (slot lists kept compact)
    members = np.full((M, N), -1, np.int64)
    where = np.zeros(N, np.int64)
    fill = np.zeros(M, np.int64)
    for n in range(N):
        members[mb[n], fill[mb[n]]] = n
        where[n] = fill[mb[n]]
        fill[mb[n]] += 1
    if N < 2 or iters <= 0 or cur <= 0.0:
        return best_mb, best_gpu, best, start
    temp = t0_frac * cur
    t_end = eps_frac * cur
    gamma = (t_end / temp) ** (1.0 / iters)
    ta = np.zeros((L, 5, G))
    tb = np.zeros((L, 5, G))
    for _ in range(iters):
        temp *= gamma
        n1 = np.random.randint(N)
        m1 = mb[n1]
        j1 = gpu[n1]
        kind = np.random.randint(4) if repack else np.random.randint(2)
        # kinds: 0 swap in micro-batch, 1 move in micro-batch, 2 swap across, 3 move across (token_cap)
        if swap_only and (kind == 1 or kind == 3):
            kind -= 1
        n2 = -1
        m2 = m1
        j2 = j1
        if kind == 0:
            if count[m1] < 2:
                continue
            n2 = members[m1, np.random.randint(count[m1])]
            j2 = gpu[n2]
            if j2 == j1:
                continue
        elif kind == 1:
            j2 = np.random.randint(G)
            if j2 == j1:
                continue
        elif kind == 2:
            n2 = np.random.randint(N)
            m2 = mb[n2]
            j2 = gpu[n2]
            if m2 == m1:
                continue
        else:
            if token_cap <= 0.0 or count[m1] < 2:
                continue
            m2 = np.random.randint(M)
            j2 = np.random.randint(G)
            if m2 == m1 or mtok[m2] + tok1[n1] > token_cap:
                continue
        # attention caps on the touched cells
        d1 = tok1[n1] - (tok1[n2] if n2 >= 0 else 0.0)
        d2 = tok2[n1] - (tok2[n2] if n2 >= 0 else 0.0)
        # cell (m1, j1) loses d, cell (m2, j2) gains d
        a1 = w1[m1, j1] - d1
        a2 = w2[m1, j1] - d2
        b1 = w1[m2, j2] + d1
        b2 = w2[m2, j2] + d2
        if (a1 > cap1 and a1 > w1[m1, j1]) or (a2 > cap2 and a2 > w2[m1, j1]):
            continue
        if (b1 > cap1 and b1 > w1[m2, j2]) or (b2 > cap2 and b2 > w2[m2, j2]):
            continue
        if smooth:
            ta[:, :, :] = st[m1]
            _add_sample(cf, n1, j1, nvm, rdm, ta, -1.0)
            if n2 >= 0:
                _add_sample(cf, n2, j1, nvm, rdm, ta, 1.0)
            if m2 == m1:
                _add_sample(cf, n1, j2, nvm, rdm, ta, 1.0)
                if n2 >= 0:
                    _add_sample(cf, n2, j2, nvm, rdm, ta, -1.0)
                o1 = mb_objective(ta, cc, tnv, trd, beta, smooth, buf)
                o2 = 0.0
            else:
                tb[:, :, :] = st[m2]
                _add_sample(cf, n1, j2, nvm, rdm, tb, 1.0)
                if n2 >= 0:
                    _add_sample(cf, n2, j2, nvm, rdm, tb, -1.0)
                o1 = mb_objective(ta, cc, tnv, trd, beta, smooth, buf)
                o2 = mb_objective(tb, cc, tnv, trd, beta, smooth, buf)
        elif m2 == m1:
            # row j1: + cf[n2] - cf[n1], row j2: the opposite
            o1 = rows_objective_exact(st[m1], cf, n2, n1, j1, j2, nvm, rdm, cc, tnv, trd, buf)
            o2 = 0.0
        else:
            o1 = rows_objective_exact(st[m1], cf, n2, n1, j1, -1, nvm, rdm, cc, tnv, trd, buf)
            o2 = rows_objective_exact(st[m2], cf, n1, n2, j2, -1, nvm, rdm, cc, tnv, trd, buf)
        da = 0.0
        if charge:  # cell (m1, j1) loses da, cell (m2, j2) gains it
            da = att[n1] - (att[n2] if n2 >= 0 else 0.0)
            if m2 == m1:
                o1 += att_w * _row_max(wa[m1], j1, -da, j2, da)
            else:
                o1 += att_w * _row_max(wa[m1], j1, -da, -1, 0.0)
                o2 += att_w * _row_max(wa[m2], j2, da, -1, 0.0)
        if m2 == m1:
            new = cur - objm[m1] + o1
        else:
            new = cur - objm[m1] - objm[m2] + o1 + o2
        delta = new - cur
        if not (delta <= 0.0 or np.random.random() < math.exp(-delta / temp)):
            continue
        if smooth:
            st[m1, :, :, :] = ta
            if m2 != m1:
                st[m2, :, :, :] = tb
        else:
            _add_sample(cf, n1, j1, nvm, rdm, st[m1], -1.0)
            _add_sample(cf, n1, j2, nvm, rdm, st[m2], 1.0)
            if n2 >= 0:
                _add_sample(cf, n2, j2, nvm, rdm, st[m2], -1.0)
                _add_sample(cf, n2, j1, nvm, rdm, st[m1], 1.0)
        objm[m1] = o1
        if m2 != m1:
            objm[m2] = o2
        if charge:
            wa[m1, j1] -= da
            wa[m2, j2] += da
        w1[m1, j1] = a1
        w2[m1, j1] = a2
        w1[m2, j2] = b1
        w2[m2, j2] = b2
        gpu[n1] = j2
        mb[n1] = m2
        if n2 >= 0:
            gpu[n2] = j1
            mb[n2] = m1
            if m2 != m1:
                members[m1, where[n1]] = n2
                members[m2, where[n2]] = n1
                w = where[n1]
                where[n1] = where[n2]
                where[n2] = w
                mtok[m1] += tok1[n2] - tok1[n1]
                mtok[m2] += tok1[n1] - tok1[n2]
        elif m2 != m1:
            # relocation across micro-batches: compact m1's list, append to m2's
            last = members[m1, count[m1] - 1]
            members[m1, where[n1]] = last
            where[last] = where[n1]
            members[m1, count[m1] - 1] = -1
            count[m1] -= 1
            members[m2, count[m2]] = n1
            where[n1] = count[m2]
            count[m2] += 1
            mtok[m1] -= tok1[n1]
            mtok[m2] += tok1[n1]
        cur = new
        if cur < best - 1e-15 * abs(best):
            best = cur
            best_mb[:] = mb[:]
            best_gpu[:] = gpu[:]
    return best_mb, best_gpu, best, start


@njit(cache=True)
def sample_flows(counts, expert_gpu, num_gpus):
    """float64 ``[N, L, G]``: tokens of sample n in layer l routed to experts homed on GPU g.

    counts: int64 ``[N, L, E]``; expert_gpu: int64 ``[L, E]`` (any placement).
    """
    N, L, E = counts.shape
    out = np.zeros((N, L, num_gpus))
    for n in range(N):
        for l in range(L):
            for e in range(E):
                out[n, l, expert_gpu[l, e]] += counts[n, l, e]
    return out


@njit(cache=True)
def batch_objective_exact(x, expert_gpu, nvm, rdm, cc, tnv, trd, ns=1, cap=0.0, pen=0.0):
    """Exact batch cost of one layer (sum over micro-batches of T_MoE, seconds); x ``[M, G, E]``.

    ns, cap, pen: compute model of ``layer_objective`` (1, 0, 0: the exact cost model)."""
    M, G, E = x.shape
    st = np.zeros((5, G))
    buf = np.zeros(G)
    tot = 0.0
    for m in range(M):
        init_state(x[m], expert_gpu, nvm, rdm, st)
        tot += layer_objective(st[0], st[1], st[2], st[3], st[4], cc, tnv, trd, 1.0, False, buf, ns, cap, pen)
    return tot
