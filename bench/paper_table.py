"""The ReLibra paper's evaluation, side by side with the simulator: both dispatchers, with and without the trainer's
compute / all-to-all overlap, at the ends of the GEMM-rate band, against length-balanced baselines and the bound.

The paper's setting (docs/method.md, /work/shared/RELIBRA.md section 8): Qwen3-30B-A3B at EP16 (2 x 8), GLM4.5-106B-A12B
and Qwen3-235B-A22B at EP32 (4 x 8); a global batch of 1024 samples (256 prompts x 4 responses) in 32 micro-batches
of 32; reasoning and mixed domains. Here the batches are SYNTHETIC (``relibra_moe.synthetic.rl_batch``: ``math``
stands for reasoning), only the first ``--layers`` MoE layers are planned and simulated (default 4, to stay tractable
on a 2-core CPU; every figure is a ratio or a per-layer time, which the layer count does not scale), and the step is
``relibra_moe.sim.simulate_step`` (moves, replica and reorder traffic charged).

Each cell (model, domain, dispatcher, overlap, expert-GEMM rate) plans static, relibra-inter (+ reorder),
relibra (+ replication, r = 2; relibra's default plan, whose locality starts from verl's length-balanced placement),
EPLB+ (r = 2), LPLB+ (r = 2 where it reads it), online (r = 2) and the bound (``balanced``, r = 2) on the round-robin
sample placement (Megatron's order), and static, EPLB+, LPLB+ and online again on the two placements a length-aware
trainer already has (``PlanOptions.sample_placement``, ``relibra_moe.sample_placements``): ``length-balanced``
(verl's ``balance_batch``, on by default) and ``longest-first`` (per micro-batch, longest sample first onto the GPU
with the fewest tokens: token-budget packers). The same option as ``relibra compare --placements``. "Best
length-balanced baseline" is the fastest of these eight rows. The rate is the preset's (413 TFLOP/s) or an end of
``specs.GEMM_RATE_BAND`` (300 / 600). One JSON per cell in
``bench/results/paper_table/<model>_<domain>_<dispatcher>_<overlap>_r<TFLOP/s>.json``; a cell already there is
skipped (resumable).

    python bench/paper_table.py                     # every cell: h100, both dispatchers, none + megatron, 3 rates
    python bench/paper_table.py --overlaps none,megatron,dualpipe --rates 413
    python bench/paper_table.py --table             # print the tables of the cells written so far
    python bench/paper_table.py --rebound           # re-plan only the bound (balanced) of the written cells
    python bench/paper_table.py --replan relibra --models glm4.5-106b-a12b --domains mixed --rates 413
                                                    # re-plan only relibra's rows of those written cells
    python bench/paper_table.py --cluster-profile P.json --models qwen3-235b-a22b   # a `relibra calibrate` profile:
                                                    # its dispatcher and rate (measured at the model's shape)
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
import time
from pathlib import Path
from typing import Any

from relibra_moe.atomic import write_text

RESULTS = Path(__file__).resolve().parent / "results" / "paper_table"
MODELS = (("qwen3-30b-a3b", 2), ("glm4.5-106b-a12b", 4), ("qwen3-235b-a22b", 4))
"""(model preset, nodes of 8 GPUs): the paper's EP16 / EP32 / EP32."""
DOMAINS = (("reasoning", "math"), ("mixed", "mixed"))
"""(paper's name, synthetic domain)."""
STRATEGIES = ("static", "relibra-inter", "relibra", "eplb", "lplb", "online", "balanced")
LENGTH_BALANCED = ("static", "eplb", "lplb", "online")
"""The baselines planned again on each of ``LB_PLACEMENTS``."""
LB_PLACEMENTS = ("length-balanced", "longest-first")
"""The length-aware sample placements (``PlanOptions.sample_placement``) the baselines run on: rows
``"strategy@placement"`` of a cell's ``length_balanced_strategies``."""
REPLICA_SLOTS = 2

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


def cell_path(model: str, domain: str, dispatcher: str, overlap: str, rate: float) -> Path:
    return RESULTS / f"{model}_{domain}_{dispatcher}_{overlap}_r{rate / 1e12:.0f}.json"


def _row(plan: Any, step: Any, solve: float, cells: int) -> dict[str, Any]:
    d = step.to_dict()
    d.pop("micro_batch_s")
    d.update(solve_s=solve, push_ms_per_cell=1e3 * step.replica_push_s / cells,
             pull_ms_per_cell=1e3 * step.replica_pull_s / cells,
             attention_fwd_ms_per_cell=1e3 * step.attention_fwd_s / cells,
             attention_bwd_ms_per_cell=1e3 * step.attention_bwd_s / cells,
             moe_comm_over_comp_fwd=step.moe_fwd_comm_s / max(step.moe_fwd_comp_s, 1e-30),
             experts_moved=step.experts_moved)
    if plan.stats.portfolio is not None:
        d["portfolio"] = plan.stats.portfolio.chosen
        d["portfolio_step_s"] = plan.stats.portfolio.step_s
    return d


def cell_batch(model_name: str, domain: tuple[str, str], layers: int, prompts: int, seed: int) -> tuple[Any, Any]:
    """The synthetic batch of a cell and its model (restricted to ``layers``)."""
    from relibra_moe.specs import model_preset
    from relibra_moe.synthetic import rl_batch

    full = model_preset(model_name)
    batch = rl_batch(full, domain[1], prompts, 4, seed=seed, micro_batch_size=32).restrict_layers(layers)
    return batch, full.with_(num_layers=batch.num_layers)


def run_rows(batch: Any, model: Any, cluster: Any, runs: list[tuple[str, dict[str, str]]], seed: int,
             out: dict[str, Any]) -> None:
    """Plan and simulate each ``(strategy, plan_batch keywords)`` of ``runs`` into ``out``'s rows."""
    from relibra_moe.planners.options import REPLICA_STRATEGIES
    from relibra_moe.planners.strategies import plan_batch
    from relibra_moe.sim import simulate_step

    cells = (int(batch.micro_batch.max()) + 1) * batch.num_layers
    for s, kw in runs:
        t0 = time.perf_counter()
        r = REPLICA_SLOTS if s in REPLICA_STRATEGIES else 0
        plan = plan_batch(batch, model, cluster, s, replica_slots=r, seed=seed, **kw)
        solve = time.perf_counter() - t0
        step = simulate_step(plan, batch, model, cluster)
        key, row = ("length_balanced_strategies", f"{s}@{kw['sample_placement']}") if kw else ("strategies", s)
        out[key][row] = _row(plan, step, solve, cells)
        print(f"  {row:30s} step {step.step_s:.4f} s  solve {solve:.1f} s", flush=True)


def run_cell(model_name: str, nodes: int, domain: tuple[str, str], cluster: Any, layers: int, prompts: int,
             seed: int) -> dict[str, Any]:
    """Plan and simulate every strategy of one cell (and the length-balanced baselines); the JSON-ready result."""
    from relibra_moe.sample_placements import PLACEMENT_USERS

    batch, model = cell_batch(model_name, domain, layers, prompts, seed)
    full_layers = model_preset_layers(model_name)
    out: dict[str, Any] = {"model": model_name, "domain": domain[0], "synthetic_domain": domain[1],
                           "nodes": nodes, "gpus_per_node": cluster.gpus_per_node, "layers": layers,
                           "layers_total": full_layers, "samples": batch.num_sequences,
                           "tokens": int(batch.num_tokens), "micro_batches": int(batch.micro_batch.max()) + 1,
                           "cluster": {"name": cluster.name, "dispatcher": cluster.dispatcher,
                                       "overlap": cluster.overlap, "flops": cluster.flops,
                                       "attn_flops": cluster.attention_flops, "nvlink_bw": cluster.nvlink_bw,
                                       "rdma_bw": cluster.rdma_bw},
                           "length_balanced": {p: PLACEMENT_USERS[p] for p in LB_PLACEMENTS},
                           "strategies": {}, "length_balanced_strategies": {}}
    runs = [(s, {}) for s in STRATEGIES] + [(s, {"sample_placement": p}) for p in LB_PLACEMENTS
                                            for s in LENGTH_BALANCED]
    run_rows(batch, model, cluster, runs, seed, out)
    return out


def model_preset_layers(model_name: str) -> int:
    """The preset's number of MoE layers (a cell plans only the first ``--layers``)."""
    from relibra_moe.specs import model_preset

    return model_preset(model_name).num_layers


def replan_cell(path: Path, cluster: Any, layers: int, prompts: int, seed: int, rows: tuple[str, ...]) -> None:
    """Re-plan and re-simulate only the strategies ``rows`` of a written cell, in place, with its ratios: ``balanced``
    after the bound's definition changed (it now covers plans that regroup micro-batches, docs/method.md "The
    bound"), ``relibra`` after its portfolio gained candidates (EPLB+ / LPLB+, issue 27), while every other row's
    plan did not change."""
    cell = json.loads(path.read_text())
    dom = next(d for d in DOMAINS if d[0] == cell["domain"])
    batch, model = cell_batch(cell["model"], dom, layers, prompts, seed)
    run_rows(batch, model, cluster, [(r, {}) for r in rows], seed, cell)
    today = datetime.date.today().isoformat()
    cell.update(ratios=ratios(cell), **{f"replanned_{r}": today for r in rows if r != "balanced"})
    if "balanced" in rows:
        cell["rebound_date"] = today
    write_text(path, json.dumps(cell, indent=1))


def ratios(cell: dict[str, Any]) -> dict[str, Any]:
    """Speedups (step-time ratios) of a cell: the ablation, over EPLB+ / LPLB+ / online, over the best
    length-balanced baseline, and % of the bound."""
    st = {k: v["step_s"] for k, v in cell["strategies"].items()}
    lb = {k: v["step_s"] for k, v in cell["length_balanced_strategies"].items()}
    best_lb = min(lb, key=lb.get)
    return {"reorder": st["static"] / st["relibra-inter"], "total": st["static"] / st["relibra"],
            "reorder_over_length_balanced": lb["static@length-balanced"] / st["relibra-inter"],
            "replication_gain": st["relibra-inter"] / st["relibra"], "vs_eplb": st["eplb"] / st["relibra"],
            "vs_lplb": st["lplb"] / st["relibra"], "vs_online": st["online"] / st["relibra"],
            "vs_best_length_balanced": lb[best_lb] / st["relibra"], "best_length_balanced": best_lb,
            "pct_bound": 100 * st["balanced"] / st["relibra"]}


def _cells(dispatchers: tuple[str, ...], overlaps: tuple[str, ...], rates: tuple[float, ...]):
    for model, _ in MODELS:
        for dom, _ in DOMAINS:
            for disp in dispatchers:
                for ov in overlaps:
                    for rate in rates:
                        p = cell_path(model, dom, disp, ov, rate)
                        if p.exists():
                            yield model, dom, disp, ov, rate, json.loads(p.read_text())


def table(dispatchers=("alltoall", "deepep"), overlaps=("none", "megatron", "dualpipe"),
          rates=(300e12, 413e12, 600e12)) -> str:
    """Markdown tables of the cells written so far: per dispatcher and overlap at the preset's rate, then the rate
    band, then the levers on Qwen3-235B."""
    lines = []
    have = list(_cells(dispatchers, overlaps, rates))
    for disp in dispatchers:
        for ov in overlaps:
            rows = []
            for model, dom, d, o, rate, c in have:
                if (d, o, rate) != (disp, ov, 413e12):
                    continue
                r = ratios(c)
                s = c["strategies"]
                rel, sta = s["relibra"], s["static"]
                rows.append(f"| {model} EP{c['nodes'] * c['gpus_per_node']} | {dom} | {r['reorder']:.2f}x | "
                            f"{r['total']:.2f}x | {r['vs_eplb']:.2f}x | {r['vs_lplb']:.2f}x | {r['vs_online']:.2f}x | "
                            f"**{r['vs_best_length_balanced']:.2f}x** ({r['best_length_balanced']}) | "
                            f"{r['pct_bound']:.0f}% | {rel['push_ms_per_cell']:.2f} / "
                            f"{rel['attention_fwd_ms_per_cell']:.2f} | {sta['moe_comm_over_comp_fwd']:.2f} |")
            if not rows:
                continue
            name = "Megatron all-to-all" if disp == "alltoall" else "DeepEP normal"
            lines.append(f"\n{disp} dispatcher ({name}), overlap `{ov}`, 413 TFLOP/s:\n")
            lines.append("| model | domain | + reorder | + replication (total) | vs EPLB+ | vs LPLB+ | vs online | "
                         "vs best length-balanced baseline | % of bound | push / attn fwd ms | static comm/comp fwd |")
            lines.append("|---|---|---|---|---|---|---|---|---|---|---|")
            lines += rows
    band = {}
    for model, dom, disp, ov, rate, c in have:
        band.setdefault((model, dom, disp, ov), {})[rate] = ratios(c)
    if band:
        lines.append("\nThe GEMM-rate band (relibra's ratios at 300 / 413 / 600 TFLOP/s expert GEMMs):\n")
        lines.append("| model | domain | dispatcher | overlap | total vs static | vs best length-balanced | "
                     "% of bound |")
        lines.append("|---|---|---|---|---|---|---|")
        for (model, dom, disp, ov), rr in band.items():
            if len(rr) < 2:
                continue
            lines.append(f"| {model} | {dom} | {disp} | {ov} | {_band(rr, 'total', 'x')} | "
                         f"{_band(rr, 'vs_best_length_balanced', 'x')} | {_band(rr, 'pct_bound', '%')} |")
    lines.append(levers(have))
    return "\n".join(lines)


def _band(rr: dict[float, dict[str, Any]], key: str, unit: str) -> str:
    """``a / b / c`` of ``key`` over the rates of ``rr`` (ascending)."""
    return " / ".join(f"{rr[k][key]:.2f}x" if unit == "x" else f"{rr[k][key]:.0f}%" for k in sorted(rr))


def levers(have: list) -> str:
    """Qwen3-235B at the preset's rate: relibra's step against the bound, term by term, and what each lever gives."""
    out = ["\nQwen3-235B EP32, 413 TFLOP/s: relibra's step and the bound, term by term (seconds, 4 layers), and the "
           "levers (step ratios):\n",
           "| domain | dispatcher | overlap | attention rel / bound | MoE comp fwd rel / bound | MoE comm fwd rel / "
           "bound | step rel / bound | reorder (over static) | reorder (over static, length-balanced) | + replication "
           "| best LB baseline / relibra | portfolio chose |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for model, dom, disp, ov, rate, c in have:
        if model != "qwen3-235b-a22b" or rate != 413e12:
            continue
        s = c["strategies"]
        rel, bnd = s["relibra"], s["balanced"]
        r = ratios(c)
        out.append(f"| {dom} | {disp} | {ov} | {rel['breakdown']['attention_fwd']:.3f} / "
                   f"{bnd['breakdown']['attention_fwd']:.3f} | {rel['breakdown']['moe_fwd_comp']:.3f} / "
                   f"{bnd['breakdown']['moe_fwd_comp']:.3f} | {rel['breakdown']['moe_fwd_comm']:.3f} / "
                   f"{bnd['breakdown']['moe_fwd_comm']:.3f} | {rel['step_s']:.3f} / {bnd['step_s']:.3f} | "
                   f"{r['reorder']:.3f}x | {r['reorder_over_length_balanced']:.3f}x | {r['replication_gain']:.3f}x | "
                   f"{r['vs_best_length_balanced']:.3f}x | {rel.get('portfolio', '-')} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cluster", default="h100", help="cluster preset (default h100)")
    ap.add_argument("--cluster-profile", default=None,
                    help="cluster profile JSON (relibra calibrate --model M): its dispatcher and GEMM rate replace "
                         "--dispatchers and --rates")
    ap.add_argument("--dispatchers", default="alltoall,deepep", help="dispatchers to run")
    ap.add_argument("--overlaps", default="none,megatron", help="overlap rules to run (none, megatron, dualpipe)")
    ap.add_argument("--rates", default="300,413,600", help="expert-GEMM rates, TFLOP/s (default: band ends, preset)")
    ap.add_argument("--layers", type=int, default=4, help="MoE layers planned and simulated (default 4)")
    ap.add_argument("--prompts", type=int, default=256, help="prompts (x 4 responses; default 256 = 1024 samples)")
    ap.add_argument("--models", default=",".join(m for m, _ in MODELS), help="models to run")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--table", action="store_true", help="only print the tables of the cells written so far")
    ap.add_argument("--domains", default=",".join(d for d, _ in DOMAINS), help="domains to run (reasoning, mixed)")
    ap.add_argument("--replan", default=None,
                    help="re-plan only these strategies (comma-separated rows) of the cells written so far, in place")
    ap.add_argument("--rebound", action="store_true",
                    help="re-plan only the bound (balanced) of the cells written so far, in place")
    args = ap.parse_args(argv)
    dispatchers = tuple(args.dispatchers.split(","))
    overlaps = tuple(args.overlaps.split(","))
    rates = tuple(float(r) * 1e12 for r in args.rates.split(","))
    replan = ("balanced",) if args.rebound else tuple(args.replan.split(",")) if args.replan else ()
    if args.table:
        print(table())
        return 0
    from relibra_moe.specs import cluster_preset, load_cluster_profile

    RESULTS.mkdir(parents=True, exist_ok=True)
    wanted = args.models.split(",")
    for model, nodes in MODELS:
        if model not in wanted:
            continue
        profile = None if args.cluster_profile is None else load_cluster_profile(args.cluster_profile, nodes, 8)
        for dom in (d for d in DOMAINS if d[0] in args.domains.split(",")):
            for disp in (profile.dispatcher,) if profile else dispatchers:
                for ov in overlaps:
                    for rate in (profile.flops,) if profile else rates:
                        cluster = (profile.with_(overlap=ov) if profile else
                                   cluster_preset(args.cluster, nodes=nodes, gpus_per_node=8, dispatcher=disp,
                                                  overlap=ov).with_(flops=rate))
                        path = cell_path(model, dom[0], disp, ov, rate)
                        if path.exists():
                            if replan:
                                print(f"{path.name}: {', '.join(replan)} again", flush=True)
                                replan_cell(path, cluster, args.layers, args.prompts, args.seed, replan)
                            else:
                                print(f"{path.name}: done, skipped")
                            continue
                        if replan:
                            continue
                        print(f"{path.name}: running", flush=True)
                        t0 = time.perf_counter()
                        res = run_cell(model, nodes, dom, cluster, args.layers, args.prompts, args.seed)
                        res.update(wall_s=time.perf_counter() - t0, date="2026-12-02",
                                   python=platform.python_version(), machine="2-core CPU box shared with other jobs",
                                   command=" ".join(sys.argv), paper=PAPER, ratios=ratios(res))
                        write_text(path, json.dumps(res, indent=1))
    print(table())
    return 0


if __name__ == "__main__":
    sys.exit(main())
