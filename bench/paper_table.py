"""The ReLibra paper's evaluation, side by side with the simulator under a calibrated preset (issue 24).

The paper's setting (docs/method.md, /work/shared/RELIBRA.md section 8): Qwen3-30B-A3B at EP16 (2 x 8), GLM4.5-106B-A12B
and Qwen3-235B-A22B at EP32 (4 x 8); a global batch of 1024 samples (256 prompts x 4 responses) in 32 micro-batches
of 32; reasoning and mixed domains; Megatron's all-to-all dispatcher. Here the batches are SYNTHETIC
(``relibra_moe.synthetic.rl_batch``: ``math`` stands for reasoning), only the first ``--layers`` MoE layers are planned
and simulated (default 4, to stay tractable on a 2-core CPU; every figure is a ratio or a per-layer time, which the
layer count does not scale), and the step is ``relibra_moe.sim.simulate_step`` (moves, replica and reorder traffic
charged). Each (model, domain, dispatcher) cell plans static, relibra-inter (+ reorder: reorder and sample locality),
relibra (+ replication, r = 2), EPLB+ (r = 2), LPLB+ and Balanced, and is written to
``bench/results/paper_table/<model>_<domain>_<dispatcher>.json``; a cell already there is skipped (resumable).

    python bench/paper_table.py                          # every cell, h100 preset, both dispatchers
    python bench/paper_table.py --cluster-profile P.json # a calibrated profile (its dispatcher only)
    python bench/paper_table.py --table                  # print the table of the cells written so far
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results" / "paper_table"
MODELS = (("qwen3-30b-a3b", 2), ("glm4.5-106b-a12b", 4), ("qwen3-235b-a22b", 4))
"""(model preset, nodes of 8 GPUs): the paper's EP16 / EP32 / EP32."""
DOMAINS = (("reasoning", "math"), ("mixed", "mixed"))
"""(paper's name, synthetic domain)."""
STRATEGIES = ("static", "relibra-inter", "relibra", "eplb", "lplb", "balanced")
REPLICA_SLOTS = {"relibra": 2, "eplb": 2}

PAPER = {
    "speedup_vs_static": "1.21-1.58x (Megatron-LM)",
    "speedup_vs_eplb_lplb": "1.06-1.21x",
    "percent_of_balanced_throughput": "90-94%",
    "ablation_qwen3_235b": {"reasoning": {"reorder": 1.12, "total": 1.46},
                            "mixed": {"reorder": 1.15, "total": 1.39}},
    "push_fwd_ms": "1-3 (attention fwd 3-6)",
    "pull_bwd_ms": "2-5 (attention bwd 5-16)",
}
"""The paper's figures (RELIBRA.md section 7-8): the ablation is reported for Qwen3-235B only."""


def cell_path(model: str, domain: str, dispatcher: str, tag: str) -> Path:
    return RESULTS / f"{model}_{domain}_{dispatcher}{tag}.json"


def run_cell(model_name: str, nodes: int, domain: tuple[str, str], cluster: Any, layers: int, prompts: int,
             seed: int) -> dict[str, Any]:
    """Plan and simulate every strategy of one cell; the JSON-ready result."""
    from relibra_moe.planners.strategies import plan_batch
    from relibra_moe.sim import simulate_step
    from relibra_moe.specs import model_preset
    from relibra_moe.synthetic import rl_batch

    full = model_preset(model_name)
    batch = rl_batch(full, domain[1], prompts, 4, seed=seed, micro_batch_size=32).restrict_layers(layers)
    model = full.with_(num_layers=batch.num_layers)
    out: dict[str, Any] = {"model": model_name, "domain": domain[0], "synthetic_domain": domain[1],
                           "nodes": nodes, "gpus_per_node": cluster.gpus_per_node, "layers": layers,
                           "layers_total": full.num_layers, "samples": batch.num_sequences,
                           "tokens": int(batch.num_tokens), "micro_batches": int(batch.micro_batch.max()) + 1,
                           "cluster": {"name": cluster.name, "dispatcher": cluster.dispatcher,
                                       "flops": cluster.flops, "attn_flops": cluster.attention_flops,
                                       "nvlink_bw": cluster.nvlink_bw, "rdma_bw": cluster.rdma_bw},
                           "strategies": {}}
    cells = (int(batch.micro_batch.max()) + 1) * layers
    for s in STRATEGIES:
        t0 = time.perf_counter()
        plan = plan_batch(batch, model, cluster, s, replica_slots=REPLICA_SLOTS.get(s, 0), seed=seed)
        solve = time.perf_counter() - t0
        step = simulate_step(plan, batch, model, cluster)
        d = step.to_dict()
        d.pop("micro_batch_s")
        d.update(solve_s=solve, push_ms_per_cell=1e3 * step.replica_push_s / cells,
                 pull_ms_per_cell=1e3 * step.replica_pull_s / cells,
                 attention_fwd_ms_per_cell=1e3 * step.attention_fwd_s / cells,
                 attention_bwd_ms_per_cell=1e3 * step.attention_bwd_s / cells,
                 moe_comm_over_comp_fwd=step.moe_fwd_comm_s / max(step.moe_fwd_comp_s, 1e-30))
        out["strategies"][s] = d
        print(f"  {s:14s} step {step.step_s:.4f} s  solve {solve:.1f} s", flush=True)
    return out


def ratios(cell: dict[str, Any]) -> dict[str, float]:
    """Speedups (step-time ratios) of a cell: the ablation, over EPLB+ / LPLB+, % of Balanced."""
    st = {k: v["step_s"] for k, v in cell["strategies"].items()}
    return {"reorder": st["static"] / st["relibra-inter"], "total": st["static"] / st["relibra"],
            "replication_gain": st["relibra-inter"] / st["relibra"], "vs_eplb": st["eplb"] / st["relibra"],
            "vs_lplb": st["lplb"] / st["relibra"], "pct_balanced": 100 * st["balanced"] / st["relibra"]}


def table(tag: str) -> str:
    """Markdown tables of the cells written so far (per dispatcher), with the paper's figures beside them."""
    lines = []
    for disp in ("alltoall", "deepep"):
        rows = []
        for model, _ in MODELS:
            for dom, _ in DOMAINS:
                p = cell_path(model, dom, disp, tag)
                if not p.exists():
                    continue
                c = json.loads(p.read_text())
                r = ratios(c)
                s = c["strategies"]
                rel, sta = s["relibra"], s["static"]
                rows.append(f"| {model} EP{c['nodes'] * c['gpus_per_node']} | {dom} | {r['reorder']:.2f}x | "
                            f"{r['total']:.2f}x | {r['vs_eplb']:.2f}x | {r['vs_lplb']:.2f}x | "
                            f"{r['pct_balanced']:.0f}% | {rel['push_ms_per_cell']:.2f} / "
                            f"{rel['attention_fwd_ms_per_cell']:.2f} | {rel['pull_ms_per_cell']:.2f} / "
                            f"{rel['attention_bwd_ms_per_cell']:.2f} | {sta['moe_comm_over_comp_fwd']:.2f} |")
        if not rows:
            continue
        lines.append(f"\n{disp} dispatcher ({'Megatron all-to-all' if disp == 'alltoall' else 'DeepEP normal'}):\n")
        lines.append("| model | domain | + reorder | + replication (total) | vs EPLB+ | vs LPLB+ | % of Balanced | "
                     "push / attn fwd ms | pull / attn bwd ms | static comm/comp fwd |")
        lines.append("|---|---|---|---|---|---|---|---|---|---|")
        lines += rows
    a = PAPER["ablation_qwen3_235b"]
    lines.append(f"\npaper: Qwen3-235B + reorder {a['reasoning']['reorder']:.2f}x / {a['mixed']['reorder']:.2f}x, "
                 f"total "
                 f"{a['reasoning']['total']:.2f}x / {a['mixed']['total']:.2f}x (reasoning / mixed); over Megatron "
                 f"{PAPER['speedup_vs_static']}; over EPLB+/LPLB+ {PAPER['speedup_vs_eplb_lplb']}; "
                 f"{PAPER['percent_of_balanced_throughput']} of Balanced; push {PAPER['push_fwd_ms']} ms; "
                 f"pull {PAPER['pull_bwd_ms']} ms")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cluster", default="h100", help="cluster preset (default h100)")
    ap.add_argument("--cluster-profile", default=None, help="cluster profile JSON (relibra calibrate)")
    ap.add_argument("--dispatchers", default="alltoall,deepep", help="dispatchers to run (preset only)")
    ap.add_argument("--layers", type=int, default=4, help="MoE layers planned and simulated (default 4)")
    ap.add_argument("--prompts", type=int, default=256, help="prompts (x 4 responses; default 256 = 1024 samples)")
    ap.add_argument("--models", default=",".join(m for m, _ in MODELS), help="models to run")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tag", default="", help="suffix of the result files (another preset / profile)")
    ap.add_argument("--table", action="store_true", help="only print the table of the cells written so far")
    args = ap.parse_args(argv)
    if args.table:
        print(table(args.tag))
        return 0
    from relibra_moe.specs import cluster_preset, load_cluster_profile

    RESULTS.mkdir(parents=True, exist_ok=True)
    wanted = args.models.split(",")
    for model, nodes in MODELS:
        if model not in wanted:
            continue
        dispatchers = args.dispatchers.split(",")
        for dom in DOMAINS:
            for disp in dispatchers:
                if args.cluster_profile:
                    cluster = load_cluster_profile(args.cluster_profile, nodes, 8)
                    disp = cluster.dispatcher
                else:
                    cluster = cluster_preset(args.cluster, nodes=nodes, gpus_per_node=8, dispatcher=disp)
                path = cell_path(model, dom[0], disp, args.tag)
                if path.exists():
                    print(f"{path.name}: done, skipped")
                    continue
                print(f"{path.name}: running", flush=True)
                t0 = time.perf_counter()
                res = run_cell(model, nodes, dom, cluster, args.layers, args.prompts, args.seed)
                res.update(wall_s=time.perf_counter() - t0, date="2026-12-02", python=platform.python_version(),
                           machine="2-core CPU box shared with other jobs", command=" ".join(sys.argv),
                           paper=PAPER, ratios=ratios(res))
                path.write_text(json.dumps(res, indent=1))
    print(table(args.tag))
    return 0


if __name__ == "__main__":
    sys.exit(main())
