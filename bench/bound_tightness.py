"""Could the bound of the held-out moves-free GPT-OSS case be tightened by node-level coverage, and is relibra's
sample split the best its relocation proxy allows?

The case of ``bench/bound_gap.py`` (GPT-OSS-20B, 256 requests drawn with seed 1, micro-batches of 8, EP 2 x 4,
r = 2, ``hopper-rail``, relibra planned with seed 1, moves and replicas free). Communication terms, forward
seconds (dispatch + combine) summed over the micro-batches and layers:

- ``present``: the bound's communication (``evaluate.bound_terms`` over ``bound_micro_batch``'s packings).
- ``node_any_24``: per micro-batch of relibra's plan, the least over every split of its samples between the 2
  nodes (enumerated) of the larger node's pairs outside the ``S x P`` = 24 experts that cover most of them, on
  ``P`` RDMA sends: what node-level coverage bounds when each node may hold any 24 experts per cell.
- ``node_own_homes_mean`` / ``_max``: the same with each node holding its 16 experts homed by relibra's plan and
  the 8 remote ones its samples route to most (mean / larger of the two nodes): what node-level coverage bounds
  even when told relibra's homes. A valid bound must also minimise over the homes, so it is at most these.
- ``worst_sample_own_homes``: per micro-batch the largest over its samples of the least over the nodes of the
  sample's pairs outside that node's homes and its own 8 best others, on one RDMA send.
- ``relocation_proxy_found`` / ``_enumerated``: ``locality_replicas._rdma_proxy`` (each node copying its 8 remote
  experts of most tokens, the largest per-GPU cross-node send or receive) of relibra's cells as planned, and the
  least over every choice of the 4 cells of each micro-batch that run on node 0 (70, enumerated).
- ``slot_search``: on 64 cells (every 4th micro-batch, every 3rd layer), Σ T_MoE of relibra's split LP
  (``locality_split``) on its own slots, and after 80 random moves per cell (a slot gets another expert, two
  slots of a node swap, or a slot gets a second copy of one of its node's copies), each kept when the exact LP
  scores it lower (seed 0).
- ``lp_relaxation``: on the same 64 cells, relibra's T_MoE (its plan as scored), the bound's per-cell terms on
  relibra's micro-batches (compute over G, the larger of the worst sample's and the micro-batch's spread
  communication), and the linear relaxation of choosing the cell's experts and split together on relibra's own
  samples: GPU g holds a fraction ``z[g, e]`` in [0, 1] of each expert, ``sum_e z[g, e] <= E/G + r`` (homes free,
  per cell), the pairs of source j and expert e served on g at most ``x[j, e] z[g, e]``, the cost model's
  ``max_g comp + 2 max_g dispatch`` on the resulting flow (cvxpy + HiGHS). Every plan on relibra's samples is a
  point of it, so it bounds those plans only (another sample placement may do better).
- ``homes_aware``: the whole batch's Σ T_MoE from the bound's per-sample terms when a sample's local pairs are
  limited by relibra's homes (``_homes_aware``): an upper limit on what any tightening of the bound that keeps its
  per-sample form but knows the homes could reach, since such a bound takes the least over homes.

    python bench/bound_tightness.py          # ~2 min on 2 cores; bench/results/bound_tightness.json
"""

from __future__ import annotations

import argparse
import itertools
from pathlib import Path

import cvxpy as cp
import numpy as np
from common import JsonReport, environment
from scipy.optimize import linear_sum_assignment
from slot_swaps import cell_cost

from relibra_moe.cost import cost_from_flow
from relibra_moe.datasets import gpt_oss_batch
from relibra_moe.evaluate import _link_seconds, bound_micro_batch, bound_terms, plan_flow, plan_loads
from relibra_moe.planners.locality_replicas import _rdma_proxy, locality_split, node_left
from relibra_moe.planners.strategies import plan_batch
from relibra_moe.specs import cluster_preset, model_preset


def _homes_aware(counts: np.ndarray, mb: np.ndarray, homes: np.ndarray, model, cluster, r: int) -> float:
    """Seconds: the bound's Σ T_MoE (compute over G, twice the larger of the worst sample's and the spread link
    seconds per cell) if each sample's local pairs were limited by relibra's homes ``[L, E]``: on its GPU at most one
    GPU's E/G homes plus its r largest others, on its node the node's homes plus its ``P r`` largest others; per
    cell the samples go one to a GPU (least total link seconds, ``linear_sum_assignment``). Not a bound (it fixes
    the homes); every bound of this kind takes the least over homes and assignments, so it is at most this."""
    G, P = cluster.num_gpus, cluster.gpus_per_node
    sec = cluster.rates(model).sec_per_pair
    node = np.arange(G) // P
    total = 0.0
    for m in range(int(mb.max()) + 1):
        idx = np.flatnonzero(mb == m)
        for layer in range(counts.shape[1]):
            xs = counts[idx, layer]  # [n, E]
            off_gpu = np.stack([node_left(xs, homes[layer] != g, r) for g in range(G)], axis=1)  # [n, G]
            off_node = np.stack([node_left(xs, node[homes[layer]] != node[g], P * r) for g in range(G)], axis=1)
            link = _link_seconds(off_gpu, off_node, cluster, model)
            rows, cols = linear_sum_assignment(link)
            spread = _link_seconds(off_gpu[rows, cols].sum(), off_node[rows, cols].sum(), cluster, model) / G
            total += xs.sum() * sec / G + 2.0 * max(link[rows, cols].max(), spread)
    return total


def _lp_relaxation(model, cluster, r: int) -> tuple[cp.Problem, cp.Parameter]:
    """The cell LP of the module docstring (``lp_relaxation``), its loads a parameter ``[G * E]`` (row ``j E + e``);
    its value is in token units (``slot_swaps.cell_cost``, the MILP's objective)."""
    G, E = cluster.num_gpus, model.num_experts
    xp = cp.Parameter(G * E, nonneg=True)
    y = cp.Variable((G * E, G), nonneg=True)  # row j * E + e: x[j, e]'s pairs served on each GPU
    z = cp.Variable((G, E), nonneg=True)
    cons = [cp.sum(y, axis=1) == xp, cp.sum(z, axis=1) <= E // G + r, z <= 1,
            y <= cp.multiply(cp.reshape(xp, (G * E, 1), order="C") @ np.ones((1, G)), cp.vstack([z.T] * G))]
    objective, terms = cell_cost(y, G, E, model, cluster)
    return cp.Problem(cp.Minimize(objective), cons + terms), xp


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="bench/results/bound_tightness.json")
    args = ap.parse_args()
    model = model_preset("gpt-oss-20b")
    cluster = cluster_preset("hopper-rail", nodes=2, gpus_per_node=4)
    batch = gpt_oss_batch(num_requests=256, seed=1).with_micro_batch_size(8)
    P, r = cluster.gpus_per_node, 2
    per_node = (model.num_experts // cluster.num_gpus + r) * P  # 24 experts a node holds in a cell
    homed = model.num_experts // cluster.nodes  # 16 of them its homes
    rep = JsonReport(Path(args.out), environment=environment(), command="bench/bound_tightness.py")
    bal = plan_batch(batch, model, cluster, "balanced", replica_slots=r, seed=1)
    plan = plan_batch(batch, model, cluster, "relibra", replica_slots=r, seed=1, migration=False,
                      price_replicas=False)
    counts = np.asarray(batch.sample_expert_counts(), dtype=np.float64)  # [N, L, E]
    sec = 2.0 * cluster.rates(model).rdma_sec_per_pair
    hn = plan.placement.expert_gpu // P  # [L, E] home node
    mb = np.asarray(plan.samples.micro_batch)
    terms = {"present": bound_terms(batch, model, cluster, r, micro_batch=bound_micro_batch(bal, batch)).comm.sum()}
    any24 = own_mean = own_max = 0.0
    for m in range(int(mb.max()) + 1):
        idx = np.flatnonzero(mb == m)
        b_any, b_mean, b_max = (np.full(counts.shape[1], np.inf) for _ in range(3))
        for bits in range(2 ** len(idx)):
            side = (bits >> np.arange(len(idx))) & 1
            a, b = counts[idx[side == 0]].sum(0), counts[idx[side == 1]].sum(0)  # [L, E]
            b_any = np.minimum(b_any, np.maximum(node_left(a, True, per_node), node_left(b, True, per_node)))
            la, lb = node_left(a, hn != 0, per_node - homed), node_left(b, hn != 1, per_node - homed)
            b_mean, b_max = np.minimum(b_mean, (la + lb) / 2), np.minimum(b_max, np.maximum(la, lb))
        any24, own_mean, own_max = any24 + b_any.sum(), own_mean + b_mean.sum(), own_max + b_max.sum()
    terms.update(node_any_24=sec * any24 / P, node_own_homes_mean=sec * own_mean / P,
                 node_own_homes_max=sec * own_max / P)
    f = np.stack([node_left(counts, (hn != n)[None], per_node - homed) for n in range(cluster.nodes)], -1).min(-1)
    terms["worst_sample_own_homes"] = sec * sum(f[mb == m].max(0).sum() for m in range(int(mb.max()) + 1))
    x = plan_loads(plan, batch, cluster.num_gpus).astype(float)  # [M, L, G, E]
    node = np.arange(cluster.num_gpus) // P
    home = (plan.placement.expert_gpu[:, :, None] == np.arange(cluster.num_gpus)).astype(float)
    found = enumerated = 0.0
    for m in range(x.shape[0]):
        found += _rdma_proxy(x[m], node[plan.placement.expert_gpu], home, node, P * r)
        best = np.inf
        for first in itertools.combinations(range(cluster.num_gpus), P):  # the cells that run on node 0
            to = np.empty(cluster.num_gpus, np.int64)  # cell g runs on GPU to[g]
            to[list(first)] = np.arange(P)
            to[[g for g in range(cluster.num_gpus) if g not in first]] = np.arange(P, cluster.num_gpus)
            xc = np.empty_like(x[m])
            xc[:, to] = x[m]
            best = min(best, _rdma_proxy(xc, node[plan.placement.expert_gpu], home, node, P * r))
        enumerated += best
    terms.update(relocation_proxy_found=sec * found, relocation_proxy_enumerated=sec * enumerated)
    rng = np.random.default_rng(0)
    G, E, reps = cluster.num_gpus, model.num_experts, plan.replicas.replica_expert
    eg = plan.placement.expert_gpu
    before = after = 0.0
    for m, layer in itertools.product(range(0, x.shape[0], 4), range(0, x.shape[1], 3)):
        cur = reps[m, layer].copy()
        t = locality_split(x[m, layer], eg[layer], cur, model, cluster).t_moe
        before += t
        for _ in range(80):
            new, g, s = cur.copy(), int(rng.integers(G)), int(rng.integers(r))
            kind, n = int(rng.integers(3)), g // P
            if kind == 0:
                e = int(rng.integers(E))
            elif kind == 1:
                h, s2 = n * P + int(rng.integers(P)), int(rng.integers(r))
                new[g, s], new[h, s2] = cur[h, s2], cur[g, s]
                e = None
            else:
                held = cur[n * P:(n + 1) * P].ravel()
                if not (held >= 0).any():
                    continue
                e = int(rng.choice(held[held >= 0]))
            if e is not None:
                if eg[layer, e] == g or (cur[g] == e).any():
                    continue
                new[g, s] = e
            if any(e_ >= 0 and (eg[layer, e_] == k or (new[k] == e_).sum() > 1) for k in range(G) for e_ in new[k]):
                continue  # a copy on its home or twice on one GPU
            t2 = locality_split(x[m, layer], eg[layer], new, model, cluster).t_moe
            if t2 < t - 1e-12:
                t, cur = t2, new
        after += t
    rep.set("slot_search", {"cells": 64, "t_moe_s_before": before, "t_moe_s_after": after,
                            "gain": 1.0 - after / before})
    prob, xp = _lp_relaxation(model, cluster, r)
    cost = cost_from_flow(plan_flow(plan, x), model, cluster)
    rates = cluster.rates(model)
    lp = {"cells": 64, "relibra_t_moe_s": 0.0, "bound_t_moe_s": 0.0, "lp_relaxation_t_moe_s": 0.0}
    for m, layer in itertools.product(range(0, x.shape[0], 4), range(0, x.shape[1], 3)):
        xp.value = x[m, layer].reshape(-1)
        prob.solve(solver="HIGHS")
        idx = np.flatnonzero(mb == m)  # the bound's terms of this one micro-batch
        cell = bound_terms(batch.subset(idx), model, cluster, r, micro_batch=np.zeros(len(idx), np.int64))
        lp["relibra_t_moe_s"] += float(cost.t_moe[m, layer])
        lp["bound_t_moe_s"] += float(cell.comp[layer] + cell.comm[layer])
        lp["lp_relaxation_t_moe_s"] += float(prob.value) * rates.sec_per_pair
    lp.update(bound_percent=100 * lp["bound_t_moe_s"] / lp["relibra_t_moe_s"],
              lp_relaxation_percent=100 * lp["lp_relaxation_t_moe_s"] / lp["relibra_t_moe_s"])
    rep.set("lp_relaxation", lp)
    aware = _homes_aware(counts, mb, plan.placement.expert_gpu, model, cluster, r)
    relibra_t = float(cost.t_moe.sum())
    rep.set("homes_aware", {"t_moe_s": aware, "relibra_t_moe_s": relibra_t, "relibra_percent": 100 * aware / relibra_t})
    print(f"homes-aware per-sample terms on relibra's homes, one sample a GPU: {aware:.6f} s, relibra {relibra_t:.6f} "
          f"s ({100 * aware / relibra_t:.1f}%)")
    print(f"on 64 cells relibra {lp['relibra_t_moe_s']:.6f} s: at {lp['bound_percent']:.1f}% of the bound's cell "
          f"terms, at {lp['lp_relaxation_percent']:.1f}% of the LP relaxation on its own samples")
    print(f"slot search on 64 cells: T_MoE {before:.6f} -> {after:.6f} s ({100 * (1 - after / before):.1f}% lower)")
    for k, v in terms.items():
        rep.set("comm_fwd_s", k, float(v))
        print(f"{k:30s} {v:.4f} s")


if __name__ == "__main__":
    main()
