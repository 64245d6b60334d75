"""report: the tables show the report's numbers as the hand-formatted strings, the plots draw the given numbers
(bars, node boundaries, lines) and write a PNG."""

from __future__ import annotations

import numpy as np
import pytest

import relibra_moe.report as report

SCENARIO = {
    "name": "qwen/mixed", "data": "real", "model": "qwen3-30b-a3b", "num_gpus": 8, "nodes": 2, "gpus_per_node": 4,
    "num_sequences": 64, "num_micro_batches": 4, "layers_simulated": 6, "layers_total": 48, "replica_slots": 2,
    "num_tokens": 123456, "expert_skew_mean": 2.5, "hot_k": 8, "intersection_mean": 0.75,
    "strategies": {
        "static": {"tokens_per_s": 1000.0, "speedup_vs_static": 1.0, "percent_of_bound_throughput": 50.0,
                   "rank_skew_mean": 1.8, "step_s": 2.0, "t_moe_s": 1.0, "percent_of_bound": float("nan"),
                   "breakdown": {"reorder": 0.0, "replica_exposed": 0.0}, "solve_s": 0.01},
        "relibra": {"tokens_per_s": 1500.5, "speedup_vs_static": 1.5, "percent_of_bound_throughput": 75.25,
                    "rank_skew_mean": 1.1, "step_s": 4.0 / 3.0, "t_moe_s": 0.5, "percent_of_bound": 90.0,
                    "breakdown": {"reorder": 0.1, "replica_exposed": 0.02}, "solve_s": 3.456},
    },
}


def _cells(table) -> list[list[str]]:
    return [list(row) for row in zip(*[list(c.cells) for c in table.columns])]


def test_scenario_table_rows_by_hand():
    t = report.scenario_table(SCENARIO)
    rows = _cells(t)
    assert rows[0] == ["static", "1,000", "1.000x", "50.0%", "1.800", "2.000", "1.000", "-", "0.0%", "0.0%", "0.01"]
    # relibra: reorder share 100 x 0.1 / (4/3) = 7.5 %, replica 100 x 0.02 / (4/3) = 1.5 %
    assert rows[1] == ["relibra", "1,500", "1.500x", "75.2%", "1.100", "1.333", "0.500", "90.0%", "7.5%", "1.5%",
                       "3.46"]
    assert "EP8 = 2 x 4" in t.title and "6/48 MoE layers" in t.title and "r = 2" in t.title
    assert "123,456 tokens" in t.caption


def test_ablation_table_by_hand():
    t = report.ablation_table({"steps": ["static", "+reorder", "+replication"],
                               "rows": [{"scenario": "a", "speedup": [1.0, 1.2345, 1.5]}]})
    assert _cells(t) == [["a", "1.000x", "1.234x", "1.500x"]]
    assert [c.header for c in t.columns] == ["scenario", "static", "+reorder", "+replication"]


def test_overlap_table_by_hand():
    sc = {"name": "qwen/mixed", "strategies": {
        "static": {"by_overlap": {"none": {"step_s": 2.0, "speedup_vs_static": 1.0,
                                           "percent_of_bound_throughput": 50.0},
                                  "megatron": {"step_s": 1.25, "speedup_vs_static": 1.0,
                                               "percent_of_bound_throughput": float("nan")}}},
        "relibra": {"by_overlap": {"none": {"step_s": 4.0 / 3.0, "speedup_vs_static": 1.5,
                                            "percent_of_bound_throughput": 75.25},
                                   "megatron": {"step_s": 1.0, "speedup_vs_static": 1.25,
                                                "percent_of_bound_throughput": 80.0}}}}}
    t = report.overlap_table(sc)
    assert [c.header for c in t.columns] == ["strategy", "step s (none)", "vs static (none)", "% of bound (none)",
                                             "step s (megatron)", "vs static (megatron)", "% of bound (megatron)"]
    assert _cells(t) == [["static", "2.000", "1.000x", "50.0%", "1.250", "1.000x", "-"],
                         ["relibra", "1.333", "1.500x", "75.2%", "1.000", "1.250x", "80.0%"]]
    assert "qwen/mixed" in t.title


@pytest.fixture
def drawn(monkeypatch):
    """Capture each figure before it is saved (and save it as the module does)."""
    figs = []
    save = report._save_figure

    def capture(fig, path):
        figs.append(fig)
        return save(fig, path)

    monkeypatch.setattr(report, "_save_figure", capture)
    return figs


def test_gpu_loads_plot_draws_the_loads_and_node_boundaries(tmp_path, drawn):
    loads = {"static": np.array([4.0, 1, 1, 2, 3, 1, 1, 3]), "relibra": np.array([2.0, 2, 2, 2, 2, 2, 2, 2])}
    path = report.plot_gpu_loads(tmp_path / "loads.png", loads, gpus_per_node=4, title="t")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    ax = drawn[0].axes[0]
    heights = [p.get_height() for p in ax.patches]
    assert heights == loads["static"].tolist() + loads["relibra"].tolist()
    lines = ax.get_lines()
    assert [ln.get_ydata()[0] for ln in lines if ln.get_linestyle() == "--"] == [2.0]  # mean of the first
    assert [ln.get_xdata()[0] for ln in lines if ln.get_linestyle() == ":"] == [3.5]  # one boundary, 2 nodes


def test_rank_skew_and_throughput_plots(tmp_path, drawn):
    report.plot_rank_skew(tmp_path / "skew.png", {"static": [1.5, 2.0], "relibra": [1.1, 1.05]}, "skew")
    ax = drawn[0].axes[0]
    got = {ln.get_label(): ln.get_ydata().tolist() for ln in ax.get_lines() if not ln.get_label().startswith("_")}
    assert got == {"static": [1.5, 2.0], "relibra": [1.1, 1.05]}
    report.plot_throughput(tmp_path / "tp.svg", ["a", "b"], {"relibra": [1.2, float("nan")]}, "tp")
    assert (tmp_path / "tp.svg").read_text().lstrip().startswith("<?xml")  # the suffix picks the format
    ax = drawn[1].axes[0]
    assert ax.get_ylim()[1] == pytest.approx(1.56)  # max(1.5, 1.3 x 1.2 = 1.56): the NaN is not run
    assert [t.get_text() for t in ax.get_xticklabels()] == ["a", "b"]
