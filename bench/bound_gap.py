"""How far relibra is from the bound on real routing, term by term, and how far the bound can be from the optimum.

GPT-OSS-20B real trace, EP 2 x 4, r = 2, all 24 layers. Two cases:

- ``held-out`` (default): 256 requests drawn with seed 1, micro-batches of 8, planned with seed 1, preset
  ``hopper-rail``: the held-out moves-free case of BENCHMARKS.md ("Options honoured";
  ``bench/replication.py --only quality --seed 1``).
- ``--requests 703 --micro-batch-size 44 --seed 0 --cluster h100``: the whole trace as one batch on the CLI's
  default preset (BENCHMARKS.md, "The bound on real routing").

Per plan (static, EPLB+, LPLB+ with r = 2, relibra with moves and replicas free, and with moves free but replicas
priced, the step simulator's charge of their push / pull): the sum of T_MoE with its forward
compute and communication terms (``evaluate.score_plan``), the simulated step, and "% of bound". The bound is the
``balanced`` strategy's (``evaluate.bound_terms`` over ``evaluate.bound_micro_batch``'s packings); the figures with
the batch's own micro-batches only (the packing the bound used before it covered verl's regrouping) and with any
packing are recorded beside it.

relibra's portfolio offers cross-node locality replicas (``planners.locality_replicas``: per node, the ``P x r``
slots hold copies of experts homed on other nodes that its samples route most to, the tokens split by the exact
LP between home and copy) resident for the whole batch and per micro-batch; the row prints the candidate it
chose. Beside it, relibra's chosen homes and samples with both versions rebuilt (the per-micro-batch one here
without the portfolio's cell relocation), and what no plan on relibra's homes and samples can beat
(``homes_floor``: each node holds its homed experts and ``P x r`` more per cell). Every valid lower bound is at
most the best valid plan, so relibra's "% of bound" against ANY proven bound is at most (best plan) / relibra.

    python bench/bound_gap.py                                                   # held-out, ~3 min on 2 cores
    python bench/bound_gap.py --requests 703 --micro-batch-size 44 --seed 0 --cluster h100 \
        --out bench/results/bound_gap_703.json
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
from common import JsonReport, environment

from relibra_moe.datasets import gpt_oss_batch
from relibra_moe.evaluate import bound_micro_batch, bound_terms, plan_loads, score_plan
from relibra_moe.plan import BatchPlan
from relibra_moe.planners.locality_replicas import locality_replicas
from relibra_moe.planners.strategies import plan_batch
from relibra_moe.sim import simulate_step
from relibra_moe.specs import ClusterSpec, cluster_preset, model_preset


def with_locality(plan: BatchPlan, batch, model, cluster: ClusterSpec, r: int, resident: bool) -> BatchPlan:
    """``plan``'s homes and samples with the library's locality replicas (``planners.locality_replicas``; the
    module docstring), validated by the caller."""
    x = plan_loads(plan, batch, cluster.num_gpus)
    reps = locality_replicas(x, plan.placement.expert_gpu, model, cluster, r, resident)
    stats = {**plan.stats.to_dict(), "strategy": "locality-replicas"}
    return BatchPlan(plan.placement, plan.samples, reps, cluster.num_gpus, cluster.gpus_per_node, stats)


def homes_floor(plan: BatchPlan, batch, model, cluster: ClusterSpec, r: int) -> tuple[float, float]:
    """``(comp, comm)`` seconds: a lower bound of Σ T_MoE's two terms over every plan with ``plan``'s homes and
    samples and ``r`` replica slots per GPU of any scope. Per cell a node holds its homed experts and at most
    ``P x r`` more, so its sources' pairs of the other experts (at least those beyond the ``P x r`` remote ones of
    most pairs) leave the node, each on the RDMA send of its source: ``max_g comm >= 2 x rdma seconds per pair x
    (the node's pairs that leave) / P``, the larger node; compute at least the cell's pairs over G."""
    G, P = cluster.num_gpus, cluster.gpus_per_node
    x = plan_loads(plan, batch, G).astype(float)  # [M, L, G, E]
    M, L, _, E = x.shape
    rates = cluster.rates(model)
    xn = x.reshape(M, L, cluster.nodes, P, E).sum(axis=3)  # [M, L, nodes, E]
    remote = (plan.placement.expert_gpu // P)[:, None, :] != np.arange(cluster.nodes)[None, :, None]  # [L, nodes, E]
    left = np.sort(np.where(remote[None], xn, 0.0), axis=-1)[..., : E - P * r].sum(axis=-1)  # [M, L, nodes]
    comm = 2.0 * rates.rdma_sec_per_pair * left.max(axis=-1) / P
    comp = x.sum(axis=(2, 3)) * rates.sec_per_pair / G
    return float(comp.sum()), float(comm.sum())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--micro-batch-size", type=int, default=8)
    ap.add_argument("--seed", type=int, default=1, help="seed of the draw and of the plans")
    ap.add_argument("--cluster", default="hopper-rail", help="cluster preset")
    ap.add_argument("--out", default="bench/results/bound_gap.json")
    args = ap.parse_args()
    model = model_preset("gpt-oss-20b")
    cluster = cluster_preset(args.cluster, nodes=2, gpus_per_node=4)
    full = args.requests >= 703
    batch = (gpt_oss_batch() if full else gpt_oss_batch(num_requests=args.requests, seed=args.seed)
             ).with_micro_batch_size(args.micro_batch_size)
    rep = JsonReport(Path(args.out), environment=environment(), requests=batch.num_sequences,
                     micro_batch_size=args.micro_batch_size, seed=args.seed, ep="2x4", replica_slots=2,
                     cluster=args.cluster, command="bench/bound_gap.py " + " ".join(
                         f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items()))
    bal = plan_batch(batch, model, cluster, "balanced", replica_slots=2, seed=args.seed)
    bound = score_plan(bal, batch, model, cluster)
    bstep = simulate_step(bal, batch, model, cluster)
    rep.set("bound", {"t_moe_s": bound.t_moe_s, "comp_fwd_s": bound.moe_fwd_comp_s, "comm_fwd_s": bound.moe_fwd_comm_s,
                      "step_s": bstep.step_s, "packings": len(bound_micro_batch(bal, batch)),
                      "t_moe_s_batch_packing_only": bound_terms(batch, model, cluster, 2,
                                                                micro_batch=batch.resolve_micro_batch()).t_moe_s,
                      "t_moe_s_any_packing": bound_terms(batch, model, cluster, 2).t_moe_s})
    plans = {}
    for name, strategy, r, kw in (("static", "static", 0, {}), ("eplb", "eplb", 2, {}), ("lplb", "lplb", 2, {}),
                                  ("relibra", "relibra", 2, {"migration": False, "price_replicas": False}),
                                  ("relibra, replicas priced", "relibra", 2, {"migration": False})):
        t0 = time.perf_counter()
        plans[name] = plan_batch(batch, model, cluster, strategy, replica_slots=r, seed=args.seed, **kw)
        solve = time.perf_counter() - t0
        print(f"{name}: planned in {solve:.0f} s", flush=True)
        rep.set("plans", name, {"solve_s": solve})
    for name in ("relibra", "relibra, replicas priced"):
        print(f"{name} chose {plans[name].stats.portfolio.chosen}", flush=True)
        rep.set("plans", name, {**rep.data["plans"][name], "chosen": plans[name].stats.portfolio.chosen})
    for resident in (True, False):
        q = with_locality(plans["relibra"], batch, model, cluster, 2, resident)
        q.validate(model, cluster, batch.num_sequences)
        plans["relibra's samples + locality replicas, " + ("resident" if resident else "per micro-batch")] = q
    for name, p in plans.items():
        s = score_plan(p, batch, model, cluster, bound_t_moe_s=bound.t_moe_s)
        st = simulate_step(p, batch, model, cluster, balanced=False)
        rep.set("plans", name, {**rep.data["plans"].get(name, {}), "t_moe_s": s.t_moe_s,
                                "comp_fwd_s": s.moe_fwd_comp_s, "comm_fwd_s": s.moe_fwd_comm_s,
                                "percent_of_bound": s.percent_of_bound, "step_s": st.step_s})
        print(f"{name:45s} T_MoE {s.t_moe_s:.4f} (comp {s.moe_fwd_comp_s:.4f}, comm {s.moe_fwd_comm_s:.4f}) "
              f"{s.percent_of_bound:5.1f}% of bound, step {st.step_s:.4f}", flush=True)
    comp_f, comm_f = homes_floor(plans["relibra"], batch, model, cluster, 2)
    rep.set("relibra_homes_floor", {"comp_fwd_s": comp_f, "comm_fwd_s": comm_f, "t_moe_s": comp_f + comm_f,
                                    "percent_of_bound": 100.0 * bound.t_moe_s / (comp_f + comm_f)})
    print(f"any plan on relibra's homes and samples (r = 2, any scope): T_MoE >= {comp_f + comm_f:.4f} (comp "
          f"{comp_f:.4f}, comm {comm_f:.4f}), at most {100 * bound.t_moe_s / (comp_f + comm_f):.1f}% of the bound")
    t = {k: v["t_moe_s"] for k, v in rep.data["plans"].items()}
    best = min(t.values())
    rep.set("relibra_vs_eplb", t["eplb"] / t["relibra"])
    rep.set("relibra_vs_lplb", t["lplb"] / t["relibra"])
    rep.set("ceiling_percent_of_any_bound", 100.0 * best / t["relibra"])
    print(f"bound {bound.t_moe_s:.4f} (comp {bound.moe_fwd_comp_s:.4f}, comm {bound.moe_fwd_comm_s:.4f}); relibra / "
          f"EPLB+ {t['eplb'] / t['relibra']:.3f}x, / LPLB+ {t['lplb'] / t['relibra']:.3f}x; no valid bound exceeds "
          f"{best:.4f}, so relibra is at most {100 * best / t['relibra']:.1f}% of any bound")


if __name__ == "__main__":
    main()
