"""What the in-node slot swaps of the locality replicas give, and how far the per-cell optimum is.

Held-out GPT-OSS-20B batch (256 requests drawn with seed 1, micro-batches of 8, EP 2 x 4, r = 2, preset
``hopper-rail``), relibra planned with moves and replicas free (the plan ``bench/bound_gap.py`` scores). On its
homes and cells, every (micro-batch, layer) cell's slots are chosen per cell (``locality_slots``) by the greedy
alone (``max_passes=0``) and with the swaps (the default), and each is split by the exact LP
(``locality_split``): the sums of T_MoE over the batch. On ``--sample`` cells drawn with seed 0 also:

- an exact-LP hill climb over the same in-node swaps (first improvement, every candidate scored by the LP);
- a MILP over the copies and the split together (cvxpy + HiGHS, ``--milp-seconds`` per cell; its incumbent is
  a plan, so the per-cell optimum is at most that; ``status`` says whether HiGHS proved it optimal);
- with ``--free-samples K``, on the first K of those cells a MILP with everything free per cell: the micro-batch's
  samples on any GPUs, any ``E/G + r`` experts a GPU (homes too), any split (``milp_free_samples``), beside the
  bound's terms of that cell and HiGHS' dual bound.

    python bench/slot_swaps.py                      # ~3 min on 2 cores with the MILP on 8 cells
    python bench/slot_swaps.py --sample 24 --milp-seconds 60
    python bench/slot_swaps.py --free-samples 5 --out bench/results/slot_swaps_free.json   # ~9 min
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import cvxpy as cp
import numpy as np
from common import JsonReport, environment

from relibra_moe.cost_terms import link_masks
from relibra_moe.datasets import gpt_oss_batch
from relibra_moe.evaluate import bound_terms, plan_loads
from relibra_moe.planners.locality_replicas import locality_slots, locality_split, slot_swap_moves
from relibra_moe.planners.strategies import plan_batch
from relibra_moe.specs import cluster_preset, model_preset


def swaps(rep: np.ndarray, home: np.ndarray, node: np.ndarray):
    """Every in-node exchange of two slots' experts that leaves a valid slot set (``slot_swap_moves``)."""
    for a, sa, b, sb in slot_swap_moves(rep, home.astype(np.int64), node):
        out = rep.copy()
        out[a, sa], out[b, sb] = rep[b, sb], rep[a, sa]
        yield out


def cell_cost(y: cp.Variable, G: int, E: int, model, cluster) -> tuple[cp.Expression, list]:
    """``(objective, constraints)``: one cell's ``max_g comp + 2 max_g dispatch`` (``t_moe_seconds`` of
    ``comm_seconds``) of the flows ``y [G * E, G]`` (row ``j E + e``: source j's pairs of expert e served on each
    GPU), in token units (seconds over ``rates.sec_per_pair``: HiGHS' tolerances are absolute), with the epigraph
    constraints of its two maxima."""
    rates = cluster.rates(model)
    nvm, rdm = link_masks(cluster.link_classes)
    flow = cp.vstack([cp.sum(y[j * E:(j + 1) * E, :], axis=0) for j in range(G)])
    c, d = cp.Variable(), cp.Variable()
    cons = [cp.sum(flow, axis=0) <= c]
    for mask, sec in ((nvm, rates.nvlink_sec_per_pair), (rdm, rates.rdma_sec_per_pair)):
        w = sec / rates.sec_per_pair
        cons += [cp.sum(cp.multiply(flow, mask), axis=1) * w <= d, cp.sum(cp.multiply(flow, mask), axis=0) * w <= d]
    return c + 2 * d, cons


def milp(xc: np.ndarray, home: np.ndarray, r: int, model, cluster, seconds: float) -> tuple[float, str]:
    """``(T_MoE seconds, status)``: copies (any r experts per GPU, not its homes) and split of one cell together."""
    G, E = xc.shape
    rates = cluster.rates(model)
    y = cp.Variable((G * E, G), nonneg=True)  # row j * E + e: x[j, e]'s tokens served on each GPU
    z = cp.Variable((G, E), boolean=True)
    held = np.zeros((G, E))
    held[home, np.arange(E)] = 1
    cap = np.repeat(xc.reshape(-1, 1), G, axis=1)
    cons = [cp.sum(y, axis=1) == xc.reshape(-1), cp.sum(z, axis=1) <= r, z <= 1 - held,
            y <= cp.multiply(cap, np.tile(held.T, (G, 1))) + cp.multiply(cap, cp.vstack([z.T] * G))]
    objective, terms = cell_cost(y, G, E, model, cluster)
    prob = cp.Problem(cp.Minimize(objective), cons + terms)
    prob.solve(solver="HIGHS", time_limit=seconds)
    return float(prob.value) * rates.sec_per_pair, str(prob.status)


def milp_free_samples(xs: np.ndarray, r: int, model, cluster, seconds: float) -> tuple[float, float | None, str]:
    """``(T_MoE seconds, HiGHS' dual bound in seconds or None, status)`` of one cell with everything free: the
    micro-batch's samples (counts ``xs [n, E]``) on any GPUs (several may share one), any ``E/G + r`` experts on each
    GPU (homes free per cell), any split. The first (longest) sample sits on GPU 0: node and rail relabellings
    (the same permutation of rails in every node) keep every link class, so that loses no plan. The incumbent is a
    plan of the cell's samples, so every plan of them costs at least the optimum, which is at most the incumbent."""
    G, E = cluster.num_gpus, model.num_experts
    rates = cluster.rates(model)
    xs = xs[np.argsort(-xs.sum(axis=1), kind="stable")]
    a = cp.Variable((xs.shape[0], G), boolean=True)  # sample s runs on GPU g
    z = cp.Variable((G, E), boolean=True)  # GPU g holds expert e
    y = cp.Variable((G * E, G), nonneg=True)  # row j * E + e: source j's pairs of expert e served on each GPU
    cap = np.tile(xs.sum(axis=0), G)[:, None] * np.ones((1, G))  # expert e's pairs in the cell
    cons = [cp.sum(a, axis=1) == 1, a[0, 0] == 1, cp.sum(z, axis=1) <= E // G + r,
            cp.sum(y, axis=1) == cp.reshape(a.T @ xs, (G * E,), order="C"),
            y <= cp.multiply(cap, cp.vstack([z.T] * G))]
    objective, terms = cell_cost(y, G, E, model, cluster)
    prob = cp.Problem(cp.Minimize(objective), cons + terms)
    prob.solve(solver="HIGHS", time_limit=seconds)
    dual = getattr(prob.solver_stats.extra_stats, "mip_dual_bound", None)
    return (float(prob.value) * rates.sec_per_pair, None if dual is None else float(dual) * rates.sec_per_pair,
            str(prob.status))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sample", type=int, default=8, help="cells for the exact-LP hill climb and the MILP")
    ap.add_argument("--milp-seconds", type=float, default=60.0)
    ap.add_argument("--free-samples", type=int, default=0,
                    help="cells for the MILP with the samples' GPUs and the homes free too (--milp-seconds each)")
    ap.add_argument("--out", default="bench/results/slot_swaps.json")
    args = ap.parse_args()
    model = model_preset("gpt-oss-20b")
    cluster = cluster_preset("hopper-rail", nodes=2, gpus_per_node=4)
    batch = gpt_oss_batch(num_requests=256, seed=1).with_micro_batch_size(8)
    rep_json = JsonReport(Path(args.out), environment=environment(), command="bench/slot_swaps.py " + " ".join(
        f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items()))
    plan = plan_batch(batch, model, cluster, "relibra", replica_slots=2, seed=1, migration=False,
                      price_replicas=False)
    x = plan_loads(plan, batch, cluster.num_gpus).astype(np.float64)
    homes = plan.placement.expert_gpu
    M, L = x.shape[:2]
    r, node = 2, np.arange(cluster.num_gpus) // cluster.gpus_per_node
    t = np.zeros((2, M, L))
    t0 = time.perf_counter()
    for m in range(M):
        for layer in range(L):
            for k, passes in enumerate((0, None)):
                kw = {} if passes is None else {"max_passes": passes}
                slots = locality_slots(x[m, layer][None], homes[layer], model, cluster, r, **kw)
                t[k, m, layer] = locality_split(x[m, layer], homes[layer], slots, model, cluster).t_moe
    worse = int((t[1] > t[0] * (1 + 1e-9)).sum())
    rep_json.set("chosen", plan.stats.portfolio.chosen)
    rep_json.set("batch", {"cells": M * L, "greedy_t_moe_s": t[0].sum(), "swaps_t_moe_s": t[1].sum(),
                           "swaps_over_greedy": t[1].sum() / t[0].sum(), "cells_worse": worse,
                           "seconds": time.perf_counter() - t0})
    print(f"relibra chose {plan.stats.portfolio.chosen}; per-cell slots on its homes and cells, {M * L} cells: greedy "
          f"{t[0].sum():.5f} s, swaps {t[1].sum():.5f} s ({t[1].sum() / t[0].sum():.4f}x; {worse} cells worse)",
          flush=True)
    rng = np.random.default_rng(0)
    cells = sorted({(int(a), int(b)) for a, b in zip(rng.integers(0, M, 4 * args.sample),
                                                      rng.integers(0, L, 4 * args.sample))})[: args.sample]
    rows = []
    for m, layer in cells:
        xc, home = x[m, layer], homes[layer]

        def lp(slots, xc=xc, home=home):
            return locality_split(xc, home, slots, model, cluster).t_moe

        cur = locality_slots(xc[None], home, model, cluster, r, max_passes=0)
        best, improved = lp(cur), True
        while improved:
            improved = False
            for cand in swaps(cur, home, node):
                v = lp(cand)
                if v < best * (1 - 1e-12):
                    cur, best, improved = cand, v, True
        opt, status = milp(xc, home, r, model, cluster, args.milp_seconds)
        rows.append({"cell": [m, layer], "greedy": t[0, m, layer], "swaps": t[1, m, layer], "lp_climb": best,
                     "milp": opt, "milp_status": status})
        print(f"cell ({m}, {layer}): greedy {t[0, m, layer] * 1e3:.4f} ms, swaps {t[1, m, layer] * 1e3:.4f}, "
              f"LP climb {best * 1e3:.4f}, MILP {opt * 1e3:.4f} ({status})", flush=True)
    tot = {k: sum(row[k] for row in rows) for k in ("greedy", "swaps", "lp_climb", "milp")}
    rep_json.set("sample", {"cells": rows, "totals": tot, **{f"{k}_over_greedy": v / tot["greedy"]
                                                           for k, v in tot.items()}})
    print("sample: " + ", ".join(f"{k} {v / tot['greedy']:.4f}x" for k, v in tot.items()))
    if not args.free_samples:
        return
    counts = np.asarray(batch.sample_expert_counts(), dtype=np.float64)  # [N, L, E]
    bound = bound_terms(batch, model, cluster, r, micro_batch=plan.samples.micro_batch)
    free = []
    for m, layer in cells[: args.free_samples]:
        idx = np.flatnonzero(plan.samples.micro_batch == m)
        opt, dual, status = milp_free_samples(counts[idx, layer], r, model, cluster, args.milp_seconds)
        cell = bound_terms(batch.subset(idx), model, cluster, r, micro_batch=np.zeros(len(idx), np.int64))
        cell_bound = float(cell.comp[layer] + cell.comm[layer])
        free.append({"cell": [m, layer], "relibra": t[1, m, layer], "milp": opt, "milp_dual_bound": dual,
                     "bound_cell_terms": cell_bound, "status": status})
        print(f"cell ({m}, {layer}), samples free: relibra {t[1, m, layer] * 1e3:.4f} ms, MILP {opt * 1e3:.4f} "
              f"({status}; dual bound {dual * 1e3 if dual is not None else float('nan'):.4f}), the bound's cell terms "
              f"{cell_bound * 1e3:.4f}", flush=True)
    rep_json.set("free_samples", {"cells": free, "bound_t_moe_s": float(bound.t_moe_s),
                                  "milp_over_relibra": sum(f["milp"] for f in free) / sum(f["relibra"] for f in free)})


if __name__ == "__main__":
    main()
