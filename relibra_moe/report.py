"""Tables (rich) and PNG plots (matplotlib, Agg backend) for the demo and the benchmark reports.

Every function takes plain numbers (dicts of floats, numpy arrays), so a JSON report can be re-plotted
without re-running the planners.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from .atomic import atomic_write

if TYPE_CHECKING:
    from rich.table import Table

STRATEGY_COLORS = {
    "static": "#7f7f7f", "eplb": "#1f77b4", "lplb": "#17becf", "relibra-inter": "#ff7f0e",
    "relibra": "#d62728", "balanced": "#2ca02c",
}


def _pyplot():
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def _color(name: str) -> str | None:
    return STRATEGY_COLORS.get(name.replace("+repack", ""))


def _save_figure(fig: Any, path: str | Path) -> Path:
    """``fig`` written to ``path`` (format from its suffix, png by default) through ``atomic_write``."""
    path = Path(path)
    with atomic_write(path, "wb") as f:
        fig.savefig(f, dpi=110, format=path.suffix[1:] or "png")
    return path


def plot_gpu_loads(path: str | Path, loads: Mapping[str, np.ndarray], gpus_per_node: int, title: str) -> Path:
    """Grouped bars of per-GPU load (``loads[name]`` is ``[G]`` (token, expert) pairs) with the mean line.

    Node boundaries are drawn as dotted vertical lines.
    """
    plt = _pyplot()
    names = list(loads)
    G = len(next(iter(loads.values())))
    fig, ax = plt.subplots(figsize=(max(6.0, 0.32 * G * max(1, len(names))), 3.6))
    width = 0.8 / max(1, len(names))
    for i, name in enumerate(names):
        v = np.asarray(loads[name], dtype=float)
        ax.bar(np.arange(G) + (i - (len(names) - 1) / 2) * width, v, width, label=name, color=_color(name))
    mean = float(np.mean(np.asarray(loads[names[0]], dtype=float)))
    ax.axhline(mean, color="k", lw=0.8, ls="--", label="mean")
    for b in range(gpus_per_node, G, gpus_per_node):
        ax.axvline(b - 0.5, color="k", lw=0.6, ls=":")
    ax.set_xlabel("GPU")
    ax.set_ylabel("(token, expert) pairs computed")
    ax.set_title(title, fontsize=10)
    ax.set_xticks(np.arange(G))
    ax.tick_params(axis="x", labelsize=7)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = _save_figure(fig, path)
    plt.close(fig)
    return path


def plot_rank_skew(path: str | Path, skew: Mapping[str, np.ndarray], title: str) -> Path:
    """One line per strategy: rank skew (max GPU load / mean, mean over layers) of each micro-batch."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7.0, 3.6))
    for name, v in skew.items():
        v = np.asarray(v, dtype=float)
        ax.plot(np.arange(len(v)), v, marker="o", ms=3, lw=1.2, label=name, color=_color(name))
    ax.axhline(1.0, color="k", lw=0.6, ls=":")
    ax.set_xlabel("micro-batch")
    ax.set_ylabel("rank skew (max / mean GPU load)")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8, ncol=3)
    fig.tight_layout()
    path = _save_figure(fig, path)
    plt.close(fig)
    return path


def plot_throughput(path: str | Path, scenarios: Sequence[str], relative: Mapping[str, Sequence[float]],
                    title: str) -> Path:
    """Grouped bars: throughput relative to static, per scenario (x) and strategy (colour).

    ``relative[strategy][i]`` belongs to ``scenarios[i]``; NaN means not run.
    """
    plt = _pyplot()
    names = list(relative)
    n = len(scenarios)
    fig, ax = plt.subplots(figsize=(min(18.0, max(7.0, 1.0 * n)), 4.6))
    width = 0.8 / max(1, len(names))
    for i, name in enumerate(names):
        v = np.asarray(relative[name], dtype=float)
        ax.bar(np.arange(n) + (i - (len(names) - 1) / 2) * width, v, width, label=name, color=_color(name),
               hatch="//" if "+repack" in name else None, edgecolor="white" if "+repack" in name else None)
    ax.axhline(1.0, color="k", lw=0.6, ls=":")
    ax.set_xticks(np.arange(n))
    ax.set_xticklabels(scenarios, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("throughput / static")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8, ncol=min(5, max(1, len(names))), loc="upper left")
    ax.set_ylim(0, max(1.5, float(np.nanmax([np.nanmax(np.asarray(v, float)) for v in relative.values()])) * 1.3))
    fig.tight_layout()
    path = _save_figure(fig, path)
    plt.close(fig)
    return path


def scenario_table(scenario: Mapping[str, Any]) -> Table:
    """A rich Table of one demo scenario: per strategy throughput, relative figures, skew, solve time."""
    from rich.table import Table

    sc = scenario
    t = Table(title=f"{sc['name']} -- {sc['data']} -- {sc['model']} EP{sc['num_gpus']} = {sc['nodes']} x "
                    f"{sc['gpus_per_node']}, {sc['num_sequences']} sequences, {sc['num_micro_batches']} micro-batches, "
                    f"{sc['layers_simulated']}/{sc['layers_total']} MoE layers, r = {sc['replica_slots']}",
              title_justify="left")
    t.add_column("strategy")
    t.add_column("tokens/s", justify="right")
    t.add_column("vs static", justify="right")
    t.add_column("% of bound", justify="right")
    t.add_column("rank skew", justify="right")
    t.add_column("step s", justify="right")
    t.add_column("ΣT_MoE s", justify="right")
    t.add_column("ΣT_MoE % bound", justify="right")
    t.add_column("reorder", justify="right")
    t.add_column("replica", justify="right")
    t.add_column("solve s", justify="right")
    for name, r in scenario["strategies"].items():
        bd = r["breakdown"]
        style = "bold" if name.startswith("relibra") and "inter" not in name else None
        pct, pct_moe = r["percent_of_bound_throughput"], r.get("percent_of_bound", float("nan"))
        t.add_row(name, f"{r['tokens_per_s']:,.0f}", f"{r['speedup_vs_static']:.3f}x",
                  f"{pct:.1f}%" if np.isfinite(pct) else "-", f"{r['rank_skew_mean']:.3f}", f"{r['step_s']:.3f}",
                  f"{r['t_moe_s']:.3f}", f"{pct_moe:.1f}%" if np.isfinite(pct_moe) else "-",
                  f"{100 * bd['reorder'] / r['step_s']:.1f}%", f"{100 * bd['replica_exposed'] / r['step_s']:.1f}%",
                  f"{r['solve_s']:.2f}", style=style)
    t.caption = (f"batch: {sc['num_tokens']:,} tokens; expert skew {sc['expert_skew_mean']:.2f} (max/mean per "
                 f"micro-batch), top-{sc['hot_k']} hot-set intersection {sc['intersection_mean']:.2f}. "
                 "tokens/s and step: simulated step incl. reorder and exposed replica traffic (their shares of "
                 "the step in 'reorder' / 'replica'); ΣT_MoE: forward cost model only.")
    t.caption_justify = "left"
    return t


def overlap_table(scenario: Mapping[str, Any]) -> Table:
    """A rich Table of one demo scenario's steps under each overlap it ran (``by_overlap`` of every strategy):
    step seconds, throughput relative to static and % of the bound, side by side."""
    from rich.table import Table

    rows = scenario["strategies"]
    overlaps = list(next(iter(rows.values()))["by_overlap"])
    t = Table(title=f"{scenario['name']}: with and without the trainer's compute / all-to-all overlap",
              title_justify="left")
    t.add_column("strategy")
    for ov in overlaps:
        for col in ("step s", "vs static", "% of bound"):
            t.add_column(f"{col} ({ov})", justify="right")
    for name, r in rows.items():
        cells = []
        for ov in overlaps:
            o = r["by_overlap"][ov]
            pct = o["percent_of_bound_throughput"]
            cells += [f"{o['step_s']:.3f}", f"{o['speedup_vs_static']:.3f}x", f"{pct:.1f}%" if np.isfinite(pct)
                      else "-"]
        t.add_row(name, *cells, style="bold" if name == "relibra" else None)
    return t


def ablation_table(ablation: Mapping[str, Any]) -> Table:
    """A rich Table like the paper's Table 4: static -> +reorder -> +replication, per scenario."""
    from rich.table import Table

    t = Table(title="Ablation (like the paper's Table 4): throughput relative to static", title_justify="left")
    t.add_column("scenario")
    for step in ablation["steps"]:
        t.add_column(step, justify="right")
    for row in ablation["rows"]:
        t.add_row(row["scenario"], *[f"{v:.3f}x" for v in row["speedup"]])
    return t
