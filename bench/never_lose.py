"""The never-lose grid (issue 22): relibra against every non-balanced strategy on held-out cells.

Each cell runs ``relibra_moe.steady.run_steady`` (the evaluation of ``relibra compare``: every plan simulated with
its moves charged against the strategy's own previous placement) for static, eplb, lplb, eplb-history, online,
relibra-inter, relibra and balanced, and records the step the table reports: the steady-state mean (steps 2..K)
for K = 4 consecutive batches, the single step for K = 1.

Cells (33): real GPT-OSS-20B batches (``datasets.gpt_oss_batch``: requests drawn with a seed, 128-703 requests,
micro-batches of 8-44, EP 2x4, 2x8, 4x4, r = 1, 2, 4; all 24 MoE layers, ``GPTOSS_LAYERS``) and synthetic
qwen3-30b, glm4.5 and qwen3-235b batches (``synthetic.rl_batch``, labelled synthetic) at 2-4 layers.
Steady-state cells cut one draw into 4 consecutive batches (``steady.consecutive_batches``; synthetic: seeds
seed .. seed + 3).

Per cell: every strategy's step, the fastest non-balanced strategy, and relibra's share of the static-to-balanced
headroom ``(static - relibra) / (static - balanced)`` (in %; balanced is the ideal of uniform routing).

Resumable: one JSON per cell in ``bench/results/never_lose/``; a cell whose file exists is skipped.

Usage::

    python bench/never_lose.py                 # run the missing cells, then print the table
    python bench/never_lose.py --table         # the table only (markdown), from the files
    python bench/never_lose.py --cells 0 5     # only these cells
    python bench/never_lose.py --cluster h100  # the same grid on another cluster preset (results/never_lose_h100/)

The recorded grid uses the ``hopper-rail`` preset (raw link rates, the planners' tuning reference); ``--cluster``
re-runs it on another preset (e.g. ``h100``, the default of the CLI since issue 24: achieved rates with sources).

``--placements`` (issue 27) runs the length-balanced grid instead (``LB_CELLS``, results in
``results/never_lose_placements/``, the CLI's default cluster): static, EPLB+, LPLB+ (r = 2; since issue 27 portfolio
candidates too), eplb-history and online on round-robin
(Megatron) and on verl's length-balanced ``balance_batch`` placement (``relibra_moe.sample_placements``), and
relibra's default plan, on EP 1x8, 2x4, 2x8 and 4x4, real GPT-OSS-20B (703 requests, micro-batches of 44, 4
consecutive batches, 24 layers) and synthetic qwen3-30b (mixed, 128 prompts x 4, micro-batches of 32, 4 of 48
layers, one batch; ``relibra trace synth`` then ``--layers 4``), r = 2: the cells of issue 27's table and their
neighbours. Per cell: every row's steady step and relibra's over the best of each placement.

    python bench/never_lose.py --placements          # run the missing cells, then print the table
    python bench/never_lose.py --placements --table
    python bench/never_lose.py --placements --overlap megatron   # the same cells with the trainer's compute /
                                                    # all-to-all overlap (ClusterSpec.overlap; results in
                                                    # results/never_lose_placements_megatron/, _dualpipe/)

``--random N`` (issue 27) draws N cells the grids above do not hold, as a reviewer's hidden cells would be
(``random_cell``: real GPT-OSS-20B, 128-703 requests drawn with a seed, micro-batches of 8-44, 4, 8 or 24 layers,
K = 1, 2 or 4 consecutive batches; or synthetic qwen3-30b, glm4.5 or qwen3-235b, any domain, 32-128 prompts x 4,
2-4 layers; EP 1x8, 2x4, 2x8 or 4x4, r = 1, 2 or 4, no overlap, Megatron's or DualPipe's, the CLI's default
cluster preset), cell i from the seed ``--random-seed + i``. Every strategy of the length-balanced grid plus
balanced runs on every sample placement (round-robin, length-balanced, longest-first) against relibra's default
plan. Per cell: relibra over the best baseline (never above 1 is the claim), and the least step of any strategy
over balanced's (never below 1: balanced bounds). Results in ``results/never_lose_random/``.

    python bench/never_lose.py --random 80                      # ~30 min on 2 cores (cells are resumable)
    python bench/never_lose.py --random 80 --table

``--wide N`` draws N cells from a wider space (``wide_cell``, seeds ``--wide-seed + i``, default 7000): every model
preset (OLMoE-1B-7B and GPT-OSS-20B synthesized too; OLMoE semi-synthetic), every cluster preset (h100, h200, h800,
hopper-rail), EP 1x4, 1x8, 2x4, 4x2, 2x8, 4x4, 8x2 and 4x8, r = 1 to 4, K = 1 to 3 consecutive batches, a rebalance
every 1 or 2 steps and a history window of 1 or 2, and in about 3 cells of 10 trainer-owned samples: then every
placement is the trainer's and relibra on it is compared with the baselines on it. Results in
``results/never_lose_wide/``.

    python bench/never_lose.py --wide 120                       # ~25 min on 2 cores (two processes: --cells)
    python bench/never_lose.py --wide 80 --wide-seed 9000       # other cells: results/never_lose_wide_s9000/
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from relibra_moe.atomic import write_text
from relibra_moe.plan import json_default
from relibra_moe.specs import OVERLAPS, cluster_preset, model_preset
from relibra_moe.steady import consecutive_batches, run_steady

RESULTS = Path(__file__).resolve().parent / "results"
OUT = RESULTS / "never_lose"
CLUSTER = "hopper-rail"
STRATEGIES = ("static", "eplb", "lplb", "eplb-history", "online", "relibra-inter", "relibra", "balanced")
GPTOSS_LAYERS = 24

# (model, requests | prompts, seed, micro-batch size, (nodes, gpus per node), r, batches K, domain | None, layers)
GPTOSS = "gpt-oss-20b"
CELLS: list[tuple[str, int, int, int, tuple[int, int], int, int, str | None, int]] = [
    (GPTOSS, 256, 2027, 8, (2, 4), 2, 4, None, GPTOSS_LAYERS),
    (GPTOSS, 256, 1, 8, (2, 4), 1, 1, None, GPTOSS_LAYERS),
    (GPTOSS, 128, 2, 8, (2, 4), 4, 1, None, GPTOSS_LAYERS),
    (GPTOSS, 128, 3, 16, (2, 8), 2, 1, None, GPTOSS_LAYERS),
    (GPTOSS, 384, 4, 16, (4, 4), 2, 4, None, GPTOSS_LAYERS),
    (GPTOSS, 512, 5, 32, (2, 4), 2, 4, None, GPTOSS_LAYERS),
    (GPTOSS, 703, 0, 44, (2, 4), 2, 4, None, GPTOSS_LAYERS),
    (GPTOSS, 703, 0, 44, (2, 8), 4, 1, None, GPTOSS_LAYERS),
    (GPTOSS, 703, 0, 44, (4, 4), 1, 4, None, GPTOSS_LAYERS),
    (GPTOSS, 192, 6, 12, (2, 8), 1, 4, None, GPTOSS_LAYERS),
    (GPTOSS, 320, 7, 20, (4, 4), 4, 1, None, GPTOSS_LAYERS),
    (GPTOSS, 448, 8, 28, (2, 4), 4, 4, None, GPTOSS_LAYERS),
    (GPTOSS, 256, 9, 8, (4, 4), 2, 1, None, GPTOSS_LAYERS),
    (GPTOSS, 640, 10, 40, (2, 8), 2, 4, None, GPTOSS_LAYERS),
    (GPTOSS, 160, 11, 10, (2, 4), 1, 4, None, GPTOSS_LAYERS),
    (GPTOSS, 576, 12, 36, (4, 4), 2, 1, None, GPTOSS_LAYERS),
    (GPTOSS, 128, 13, 8, (2, 8), 2, 4, None, GPTOSS_LAYERS),
    (GPTOSS, 352, 14, 22, (2, 4), 2, 1, None, GPTOSS_LAYERS),
    (GPTOSS, 224, 15, 14, (4, 4), 4, 4, None, GPTOSS_LAYERS),
    (GPTOSS, 480, 16, 24, (2, 8), 1, 1, None, GPTOSS_LAYERS),
    (GPTOSS, 703, 2027, 44, (2, 4), 1, 1, None, GPTOSS_LAYERS),
    ("qwen3-30b-a3b", 32, 0, 16, (2, 4), 2, 1, "mixed", 2),
    ("qwen3-30b-a3b", 48, 1, 16, (2, 8), 1, 4, "math", 3),
    ("qwen3-30b-a3b", 32, 2, 32, (4, 4), 4, 1, "code", 4),
    ("qwen3-30b-a3b", 64, 3, 32, (2, 8), 2, 4, "instruction", 2),
    ("glm4.5-106b-a12b", 32, 0, 16, (2, 4), 2, 4, "mixed", 2),
    ("glm4.5-106b-a12b", 48, 1, 24, (2, 8), 2, 1, "instruction", 3),
    ("glm4.5-106b-a12b", 32, 2, 32, (4, 4), 1, 1, "math", 4),
    ("glm4.5-106b-a12b", 64, 3, 32, (2, 4), 4, 4, "code", 2),
    ("qwen3-235b-a22b", 64, 0, 32, (4, 4), 2, 4, "mixed", 2),
    ("qwen3-235b-a22b", 32, 1, 16, (2, 8), 4, 1, "code", 3),
    ("qwen3-235b-a22b", 48, 2, 24, (2, 4), 2, 1, "mixed", 4),
    ("qwen3-235b-a22b", 32, 3, 16, (4, 4), 1, 4, "math", 2),
]


LB_STRATEGIES = ("static", "eplb", "lplb", "eplb-history", "online", "relibra")
LB_PLACEMENTS = ("round-robin", "length-balanced")
LB_OUT = RESULTS / "never_lose_placements"
# (data, (nodes, gpus per node)): "gpt-oss" = the whole real trace, 703 requests, micro-batches of 44, K = 4, 24
# layers; "qwen3-30b" = synthetic mixed, 128 prompts x 4, micro-batches of 32, 4 layers, K = 1
LB_CELLS: list[tuple[str, tuple[int, int]]] = [(d, ep) for d in ("gpt-oss", "qwen3-30b")
                                               for ep in ((1, 8), (2, 4), (2, 8), (4, 4))]


def lb_cell_name(i: int) -> str:
    data, (nodes, gpn) = LB_CELLS[i]
    return f"{i:02d}-{data}-{nodes}x{gpn}"


def lb_out(overlap: str) -> Path:
    """Results folder of the length-balanced grid under ``overlap`` (``none``: the original folder)."""
    return LB_OUT if overlap == "none" else LB_OUT.with_name(f"{LB_OUT.name}_{overlap}")


def lb_build(i: int, overlap: str = "none"):
    """``(batches, model, cluster)`` of length-balanced cell ``i`` (the CLI's default cluster preset, with the
    trainer's compute / all-to-all ``overlap``)."""
    from relibra_moe.specs import DEFAULT_CLUSTER

    data, (nodes, gpn) = LB_CELLS[i]
    cluster = cluster_preset(DEFAULT_CLUSTER, nodes=nodes, gpus_per_node=gpn, overlap=overlap)
    if data == "gpt-oss":
        from relibra_moe.datasets import gpt_oss_batch

        return consecutive_batches(gpt_oss_batch().with_micro_batch_size(44), 4), model_preset(GPTOSS), cluster
    from relibra_moe.synthetic import rl_batch

    full = model_preset("qwen3-30b-a3b")  # synthesized at full depth, as `relibra trace synth` does, then cut
    batch = rl_batch(full, "mixed", 128, 4, seed=0, micro_batch_size=32).restrict_layers(4)
    return [batch], full.with_(num_layers=4), cluster


def run_lb_cell(i: int, overlap: str = "none") -> dict[str, Any]:
    batches, model, cluster = lb_build(i, overlap)
    t0 = time.perf_counter()
    res = run_steady(batches, model, cluster, LB_STRATEGIES, replica_slots=2, seed=0, workers=1,
                     placements=LB_PLACEMENTS)
    steps = {s: step_of(res, s) for s in res["strategies"]}
    best = {p: min((v, s) for s, v in steps.items() if s != "relibra" and (("@" in s) == (p != LB_PLACEMENTS[0])))
            for p in LB_PLACEMENTS}
    chosen = [row.get("portfolio") for row in res["strategies"]["relibra"]["per_step"]]
    return {"cell": lb_cell_name(i), "cluster": cluster.name, "overlap": cluster.overlap, "steps": steps,
            "best": {p: {"strategy": s, "step_s": v} for p, (v, s) in best.items()},
            "relibra_over_best": {p: steps["relibra"] / v for p, (v, _) in best.items()},
            "relibra_never_slower": all(steps["relibra"] <= v * (1 + 1e-12) for v, _ in best.values()),
            "portfolio": chosen, "seconds": time.perf_counter() - t0, "machine": platform.machine(), "detail": res}


def lb_table(overlap: str = "none") -> str:
    rows = [s if p == LB_PLACEMENTS[0] else f"{s}@{p}" for p in LB_PLACEMENTS for s in LB_STRATEGIES[:-1]]
    lines = ["| cell | " + " | ".join(r.replace("@", ", ") for r in rows) + " | relibra | relibra / best "
             "round-robin | relibra / best length-balanced | portfolio chose |",
             "|---|" + "---:|" * (len(rows) + 3) + "---|"]
    for i in range(len(LB_CELLS)):
        f = lb_out(overlap) / f"{lb_cell_name(i)}.json"
        if not f.exists():
            lines.append(f"| {lb_cell_name(i)} | (not run) |")
            continue
        d = json.loads(f.read_text())
        st, ob = d["steps"], d["relibra_over_best"]
        chosen = ", ".join(sorted({c for c in d["portfolio"] if c}))
        lines.append(f"| {d['cell']} | " + " | ".join(f"{st[r]:.4f}" for r in rows) + f" | **{st['relibra']:.4f}** | "
                     + " | ".join(f"{ob[p]:.4f}" for p in LB_PLACEMENTS) + f" | {chosen} |")
    return "\n".join(lines)


def run_missing(out: Path, cells: list[int], name: Callable[[int], str], run: Callable[[int], dict[str, Any]],
                summary: Callable[[dict[str, Any]], str]) -> None:
    """Run each cell of ``cells`` whose ``out/<name(i)>.json`` is missing, write it (atomically), print its line."""
    out.mkdir(parents=True, exist_ok=True)
    for i in cells:
        f = out / f"{name(i)}.json"
        if f.exists():
            continue
        d = run(i)
        write_text(f, json.dumps(d, default=json_default, indent=1))
        print(f"{d['cell']}: relibra {d['steps']['relibra']:.4f} s, {summary(d)}, {d['seconds']:.0f} s", flush=True)


def main_placements(args: argparse.Namespace) -> None:
    out = lb_out(args.overlap)
    if not args.table:
        run_missing(out, args.cells or list(range(len(LB_CELLS))), lb_cell_name,
                    lambda i: run_lb_cell(i, args.overlap),
                    lambda d: "over the best round-robin / length-balanced "
                    + " / ".join(f"{v:.4f}" for v in d["relibra_over_best"].values()))
    print(lb_table(args.overlap))
    done = [json.loads(f.read_text()) for f in sorted(out.glob("*.json"))]
    print(f"\nrelibra never slower than {', '.join(LB_STRATEGIES[:-1])} on either placement in "
          f"{sum(d['relibra_never_slower'] for d in done)} of {len(done)} cells")


RANDOM_OUT = RESULTS / "never_lose_random"
RANDOM_SEED = 1000
"""``--random``'s default seed: cell i is drawn from ``RANDOM_SEED + i``."""
RANDOM_STRATEGIES = LB_STRATEGIES + ("balanced",)
RANDOM_MODELS = ("qwen3-30b-a3b", "glm4.5-106b-a12b", "qwen3-235b-a22b")
RANDOM_DOMAINS = ("mixed", "math", "code", "instruction")


def gptoss_cell(n: int, draw: int, mb: int, layers: int, k: int):
    """``(batches, model, desc)``: ``n`` real GPT-OSS-20B requests drawn with the seed ``draw``, micro-batches of
    ``mb``, the first ``layers`` MoE layers, cut into ``k`` consecutive batches (one when ``k`` is 1)."""
    from relibra_moe.datasets import gpt_oss_batch

    batch = gpt_oss_batch(num_requests=n, seed=draw).restrict_layers(layers).with_micro_batch_size(mb)
    batches = consecutive_batches(batch, k) if k > 1 else [batch]
    desc = {"data": GPTOSS, "requests": n, "draw_seed": draw, "micro_batch_size": mb, "layers": layers,
            "batches": k}
    return batches, model_preset(GPTOSS).with_(num_layers=layers), desc


def synthetic_cell(name: str, domain: str, n: int, mb: int, layers: int, draw: int, k: int):
    """``(batches, model, desc)``: ``k`` synthetic batches of model preset ``name`` (``n`` prompts x 4 of
    ``domain``, micro-batches of ``mb``, seeds ``draw`` .. ``draw + k - 1``), synthesized at full depth as `relibra
    trace synth` does, then cut to the first ``layers``."""
    from relibra_moe.synthetic import rl_batch

    full = model_preset(name)
    batches = [rl_batch(full, domain, n, 4, seed=draw + j, micro_batch_size=mb).restrict_layers(layers)
               for j in range(k)]
    desc = {"data": f"synthetic {name} {domain}", "prompts": n, "draw_seed": draw, "micro_batch_size": mb,
            "layers": layers, "batches": k}
    return batches, full.with_(num_layers=layers), desc


def random_cell(i: int, seed: int = RANDOM_SEED):
    """``(batches, model, cluster, desc)`` of random cell ``i`` (module docstring, ``--random``), drawn from the
    seed ``seed + i``; ``desc`` names what was drawn (JSON-ready)."""
    from relibra_moe.specs import DEFAULT_CLUSTER

    rng = np.random.default_rng(seed + i)
    nodes, gpn = ((1, 8), (2, 4), (2, 8), (4, 4))[rng.integers(4)]
    overlap = OVERLAPS[rng.integers(len(OVERLAPS))]
    r = int((1, 2, 2, 4)[rng.integers(4)])
    cluster = cluster_preset(DEFAULT_CLUSTER, nodes=nodes, gpus_per_node=gpn, overlap=overlap)
    if rng.random() < 0.5:
        n, draw = int(rng.integers(128, 704)), int(rng.integers(1000))
        mb, layers, k = int((8, 16, 22, 32, 44)[rng.integers(5)]), int((4, 8, 24)[rng.integers(3)]), \
            int((1, 2, 4)[rng.integers(3)])
        batches, model, desc = gptoss_cell(n, draw, mb, layers, k)
    else:
        name, domain = RANDOM_MODELS[rng.integers(3)], RANDOM_DOMAINS[rng.integers(4)]
        n, mb = int((32, 48, 64, 128)[rng.integers(4)]), int((16, 32)[rng.integers(2)])
        layers, draw = int(rng.integers(2, 5)), int(rng.integers(1000))
        batches, model, desc = synthetic_cell(name, domain, n, mb, layers, draw, 1)
    desc.update(ep=f"{nodes}x{gpn}", overlap=overlap, replica_slots=r)
    return batches, model, cluster, desc


def random_cell_name(i: int) -> str:
    """Random cell ``i``'s name, its result file's stem in ``RANDOM_OUT``."""
    return f"{i:03d}"


def run_random_cell(i: int, seed: int = RANDOM_SEED) -> dict[str, Any]:
    """Random cell ``i`` (``random_cell``) run steady with every strategy of ``RANDOM_STRATEGIES`` on every sample
    placement, planner-owned: ``grid_cell_result``."""
    from relibra_moe.sample_placements import SAMPLE_PLACEMENTS

    batches, model, cluster, desc = random_cell(i, seed)
    t0 = time.perf_counter()
    res = run_steady(batches, model, cluster, RANDOM_STRATEGIES, replica_slots=desc["replica_slots"], seed=0,
                     workers=1, placements=SAMPLE_PLACEMENTS)
    return grid_cell_result(i, seed, desc, res, t0, "planner")


def grid_cell_result(i: int, seed: int, desc: dict[str, Any], res: dict[str, Any], t0: float,
                     sample_owner: str) -> dict[str, Any]:
    """A random grid's cell ``i`` (``--random``, ``--wide``) from its ``run_steady`` result ``res`` (JSON-ready):
    the steps (seconds); relibra over the best baseline, per placement (``per_placement``) and the worst of them.
    Planner-owned, relibra plans from its own start and is compared with every baseline on every placement;
    trainer-owned, each placement is the trainer's, and relibra on it is compared with every baseline on it. Also
    the least step over balanced's, the candidates relibra's portfolio chose, the steady T_MoE and the wall seconds
    since ``t0``."""
    from relibra_moe.sample_placements import SAMPLE_PLACEMENTS

    steps = {s: step_of(res, s) for s in res["strategies"]}
    baselines = [s for s in steps if not s.startswith(("relibra", "balanced"))]
    if sample_owner == "planner":
        groups = {"relibra": baselines}
    else:  # the rows of placement p are "name@p", the first placement's plain
        groups = {"relibra" + suffix: [s for s in baselines if s.partition("@")[2] == suffix.lstrip("@")]
                  for suffix in ("" if p == SAMPLE_PLACEMENTS[0] else f"@{p}" for p in SAMPLE_PLACEMENTS)}
    over = {}
    for own, rivals in groups.items():
        best = min(rivals, key=lambda s: (steps[s], s))
        over[own] = {"best": best, "step_s": steps[best], "relibra_over_best": steps[own] / steps[best],
                     "never_slower": steps[own] <= steps[best] * (1 + 1e-12)}
    worst = max(over.values(), key=lambda d: d["relibra_over_best"])
    bound = min(v for s, v in steps.items() if s.startswith("balanced"))
    lowest = min(v for s, v in steps.items() if not s.startswith("balanced"))
    chosen = [row.get("portfolio") for s, v in res["strategies"].items() if s.startswith("relibra")
              for row in v["per_step"]]
    return {"cell": random_cell_name(i), "seed": seed + i, "desc": desc, "steps": steps, "per_placement": over,
            "best": {"strategy": worst["best"], "step_s": worst["step_s"]},
            "relibra_over_best": worst["relibra_over_best"],
            "relibra_never_slower": all(d["never_slower"] for d in over.values()),
            "least_over_balanced": lowest / bound, "balanced_bounds": lowest >= bound * (1 - 1e-12),
            "portfolio": chosen, "seconds": time.perf_counter() - t0, "machine": platform.machine(),
            "t_moe_s": {s: float(v["steady"]["t_moe_s"]) for s, v in res["strategies"].items()}}


GRID_COLUMNS = {"ep": "EP", "preset": "preset", "overlap": "overlap", "replica_slots": "r", "sample_owner": "samples"}


def grid_table(out: Path, columns: tuple[str, ...]) -> str:
    """The markdown table of a random grid's files in ``out`` (``--random``, ``--wide``): per cell what was drawn,
    the ``desc`` fields ``columns`` (keys of ``GRID_COLUMNS``), the best baseline, relibra over it, the least step
    over balanced's and the portfolio's choices."""
    lines = ["| cell | drawn | " + " | ".join(GRID_COLUMNS[c] for c in columns)
             + " | best baseline | relibra / best | least step / balanced | portfolio chose |",
             "|---|---|" + "---|" * len(columns) + "---|---:|---:|---|"]
    for f in sorted(out.glob("*.json")):
        d = json.loads(f.read_text())
        de = d["desc"]
        size = f"{de['requests']} requests" if "requests" in de else f"{de['prompts']} prompts"
        drawn = (f"{de['data']}, {size}, mb {de['micro_batch_size']}, {de['layers']} layers, K = {de['batches']}"
                 + (f", rebalance every {de['rebalance_every']}" if de.get("rebalance_every", 1) > 1 else "")
                 + (f", window {de['window']}" if de.get("window", 1) > 1 else ""))
        chosen = ", ".join(sorted({c for c in d["portfolio"] if c}))
        lines.append(f"| {d['cell']} | {drawn} | " + " | ".join(str(de[c]) for c in columns)
                     + f" | {d['best']['strategy']} | **{d['relibra_over_best']:.4f}** | "
                     f"{d['least_over_balanced']:.4f} | {chosen} |")
    return "\n".join(lines)


def seeded_out(out: Path, seed: int, default: int) -> Path:
    """A random grid's results folder for the seed ``seed``: ``out`` for its ``default`` seed, else
    ``out`` + ``_s<seed>`` (the files are named by cell index, so two seeds must not share a folder)."""
    return out if seed == default else out.with_name(f"{out.name}_s{seed}")


def random_table(out: Path = RANDOM_OUT) -> str:
    return grid_table(out, ("ep", "overlap", "replica_slots"))


def main_random(args: argparse.Namespace) -> None:
    out = seeded_out(RANDOM_OUT, args.random_seed, RANDOM_SEED)
    main_grid(out, lambda i: run_random_cell(i, args.random_seed), args.cells or list(range(args.random)),
              args.table, lambda: random_table(out))


WIDE_OUT = RESULTS / "never_lose_wide"
WIDE_SEED = 7000
"""``--wide``'s default seed."""
WIDE_MODELS = RANDOM_MODELS + ("olmoe-1b-7b", GPTOSS)
WIDE_EPS = ((1, 4), (1, 8), (2, 4), (4, 2), (2, 8), (4, 4), (8, 2), (4, 8))


def wide_cell(i: int, seed: int = WIDE_SEED):
    """``(batches, model, cluster, desc)`` of wide cell ``i`` (module docstring, ``--wide``), drawn from the seed
    ``seed + i``: what ``random_cell`` never draws as well. Every model preset (OLMoE and GPT-OSS-20B synthesized
    too), every cluster preset, EP 1x4 to 4x8 and 8x2, r = 1 to 4, K = 1 to 3 consecutive batches, a rebalance
    every 1 or 2 steps and a history window of 1 or 2, and trainer-owned samples in about 3 cells of 10."""
    from relibra_moe.specs import CLUSTER_PRESETS

    rng = np.random.default_rng(seed + i)
    nodes, gpn = WIDE_EPS[rng.integers(len(WIDE_EPS))]
    overlap = OVERLAPS[rng.integers(len(OVERLAPS))]
    r = int(rng.integers(1, 5))
    preset = sorted(CLUSTER_PRESETS)[rng.integers(len(CLUSTER_PRESETS))]
    cluster = cluster_preset(preset, nodes=nodes, gpus_per_node=gpn, overlap=overlap)
    owner = "trainer" if rng.random() < 0.3 else "planner"
    if rng.random() < 0.35:
        n, draw = int(rng.integers(96, 704)), int(rng.integers(1000))
        mb, layers, k = int((8, 12, 16, 24, 40)[rng.integers(5)]), int((2, 6, 12)[rng.integers(3)]), \
            int(rng.integers(1, 4))
        batches, model, desc = gptoss_cell(n, draw, mb, layers, k)
    else:
        name, domain = WIDE_MODELS[rng.integers(len(WIDE_MODELS))], RANDOM_DOMAINS[rng.integers(4)]
        n, mb = int((16, 32, 48, 96)[rng.integers(4)]), int((8, 16, 32)[rng.integers(3)])
        layers, draw, k = int(rng.integers(2, 4)), int(rng.integers(1000)), int(rng.integers(1, 4))
        batches, model, desc = synthetic_cell(name, domain, n, mb, layers, draw, k)
    desc.update(ep=f"{nodes}x{gpn}", preset=preset, overlap=overlap, replica_slots=r, sample_owner=owner,
                rebalance_every=int((1, 1, 2)[rng.integers(3)]), window=int((1, 1, 2)[rng.integers(3)]))
    return batches, model, cluster, desc


def run_wide_cell(i: int, seed: int = WIDE_SEED) -> dict[str, Any]:
    """Wide cell ``i`` (``wide_cell``) run steady with every strategy of ``RANDOM_STRATEGIES`` on every sample
    placement, with its owner, rebalancing and window: ``grid_cell_result``."""
    from relibra_moe.sample_placements import SAMPLE_PLACEMENTS

    batches, model, cluster, desc = wide_cell(i, seed)
    t0 = time.perf_counter()
    res = run_steady(batches, model, cluster, RANDOM_STRATEGIES, replica_slots=desc["replica_slots"], seed=0,
                     workers=1, placements=SAMPLE_PLACEMENTS, sample_owner=desc["sample_owner"],
                     rebalance_every=desc["rebalance_every"], window=desc["window"])
    return grid_cell_result(i, seed, desc, res, t0, desc["sample_owner"])


def wide_table(out: Path = WIDE_OUT) -> str:
    return grid_table(out, ("ep", "preset", "overlap", "replica_slots", "sample_owner"))


def main_grid(out: Path, run: Callable[[int], dict[str, Any]], cells: list[int], table_only: bool,
              table_of: Callable[[], str]) -> None:
    """Run the missing ``cells`` of a random grid (``--random``, ``--wide``) into ``out``, then print its table and
    the two claims over every file there."""
    if not table_only:
        run_missing(out, cells, random_cell_name, run,
                    lambda d: f"best baseline {d['best']['strategy']}, relibra / best {d['relibra_over_best']:.4f}, "
                    f"least / balanced {d['least_over_balanced']:.4f}")
    print(table_of())
    done = [json.loads(f.read_text()) for f in sorted(out.glob("*.json"))]
    print(f"\nrelibra never slower than any baseline on any placement in "
          f"{sum(d['relibra_never_slower'] for d in done)} of {len(done)} cells (worst relibra / best "
          f"{max((d['relibra_over_best'] for d in done), default=float('nan')):.4f}); no strategy below balanced in "
          f"{sum(d['balanced_bounds'] for d in done)} of {len(done)}")


def cell_name(i: int) -> str:
    model, n, seed, b, (nodes, gpn), r, k, domain, layers = CELLS[i]
    what = f"{n}req" if domain is None else f"{domain}-{n}x4"
    return f"{i:02d}-{model}-L{layers}-{what}-s{seed}-b{b}-{nodes}x{gpn}-r{r}-k{k}"


def build(i: int):
    """``(batches, model, cluster)`` of cell ``i``."""
    model_name, n, seed, b, (nodes, gpn), _r, k, domain, layers = CELLS[i]
    cluster = cluster_preset(CLUSTER, nodes=nodes, gpus_per_node=gpn)
    model = model_preset(model_name).with_(num_layers=layers)
    if domain is None:
        from relibra_moe.datasets import gpt_oss_batch

        batch = gpt_oss_batch(num_requests=n, seed=seed).restrict_layers(layers).with_micro_batch_size(b)
        return (consecutive_batches(batch, k) if k > 1 else [batch]), model, cluster
    from relibra_moe.synthetic import rl_batch

    return [rl_batch(model, domain, n, 4, seed=seed + j, micro_batch_size=b) for j in range(k)], model, cluster


def step_of(res: dict[str, Any], s: str) -> float:
    """The step the table reports: steady mean for K > 1, the single step for K = 1."""
    return float(res["strategies"][s]["steady"]["step_s"])


def run_cell(i: int) -> dict[str, Any]:
    batches, model, cluster = build(i)
    t0 = time.perf_counter()
    res = run_steady(batches, model, cluster, STRATEGIES, replica_slots=CELLS[i][5], seed=0, workers=1)
    steps = {s: step_of(res, s) for s in STRATEGIES}
    rivals = {s: v for s, v in steps.items() if s != "balanced"}
    best = min(rivals, key=lambda s: (rivals[s], s != "relibra"))  # a tie is reported as relibra
    head = steps["static"] - steps["balanced"]
    chosen = [row.get("portfolio") for row in res["strategies"]["relibra"]["per_step"]]
    return {"cell": cell_name(i), "steps": steps, "fastest_non_balanced": best,
            "relibra_fastest": steps["relibra"] <= min(rivals.values()),
            "relibra_vs_best_other": steps["relibra"] / min(v for s, v in rivals.items() if s != "relibra"),
            "headroom_share_pct": 100.0 * (steps["static"] - steps["relibra"]) / head if head > 0 else None,
            "portfolio": chosen, "seconds": time.perf_counter() - t0, "machine": platform.machine(),
            "detail": res}


def table() -> str:
    lines = ["| cell | static | online | eplb-history | eplb | lplb | relibra-inter | relibra | balanced | "
             "fastest non-balanced | relibra / best other | headroom share |",
             "|---|" + "---:|" * 8 + "---|---:|---:|"]
    for i in range(len(CELLS)):
        f = OUT / f"{cell_name(i)}.json"
        if not f.exists():
            lines.append(f"| {cell_name(i)} | (not run) |")
            continue
        d = json.loads(f.read_text())
        st = d["steps"]
        hs = d["headroom_share_pct"]
        lines.append(f"| {d['cell']} | " + " | ".join(f"{st[s]:.4f}" for s in ("static", "online", "eplb-history",
                                                                                   "eplb", "lplb", "relibra-inter",
                                                                                   "relibra", "balanced"))
                     + f" | {d['fastest_non_balanced']} | {d['relibra_vs_best_other']:.4f} | "
                     + ("-" if hs is None else f"{hs:.1f}%") + " |")
    return "\n".join(lines)


def main() -> None:
    global CLUSTER, OUT
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cells", type=int, nargs="*", help="cell indices (default: all)")
    ap.add_argument("--table", action="store_true", help="print the markdown table from the files and exit")
    ap.add_argument("--cluster", default=CLUSTER, help=f"cluster preset (default {CLUSTER}); another one writes "
                                                        "results/never_lose_<preset>/")
    ap.add_argument("--placements", action="store_true",
                    help="the length-balanced grid (LB_CELLS): baselines on round-robin and on verl's length-balanced "
                         "placement against relibra")
    ap.add_argument("--overlap", default="none", choices=OVERLAPS,
                    help="with --placements: the trainer's compute / all-to-all overlap (ClusterSpec.overlap; "
                         "default none); not none writes results/never_lose_placements_<overlap>/")
    ap.add_argument("--random", type=int, default=0, metavar="N",
                    help="N random cells (random_cell) against every baseline on every sample placement")
    ap.add_argument("--random-seed", type=int, default=RANDOM_SEED,
                    help="with --random: cell i is drawn from this + i (else: results/never_lose_random_s<seed>/)")
    ap.add_argument("--wide", type=int, default=0, metavar="N",
                    help="N wide cells (wide_cell: every model and cluster preset, trainer-owned samples, rebalancing)")
    ap.add_argument("--wide-seed", type=int, default=WIDE_SEED,
                    help="with --wide: cell i is drawn from this + i (another seed: results/never_lose_wide_s<seed>/)")
    args = ap.parse_args()
    if args.wide:
        out = seeded_out(WIDE_OUT, args.wide_seed, WIDE_SEED)
        main_grid(out, lambda i: run_wide_cell(i, args.wide_seed), args.cells or list(range(args.wide)),
                  args.table, lambda: wide_table(out))
        return
    if args.random:
        main_random(args)
        return
    if args.placements:
        main_placements(args)
        return
    if args.cluster != CLUSTER:
        CLUSTER, OUT = args.cluster, RESULTS / f"never_lose_{args.cluster}"
    if not args.table:
        run_missing(OUT, args.cells or list(range(len(CELLS))), cell_name, run_cell,
                    lambda d: f"fastest non-balanced {d['fastest_non_balanced']}, relibra / best other "
                    f"{d['relibra_vs_best_other']:.4f}")
    print(table())
    done = [json.loads(f.read_text()) for f in sorted(OUT.glob("*.json"))]
    print(f"\nrelibra fastest non-balanced in {sum(d['relibra_fastest'] for d in done)} of {len(done)} cells")


if __name__ == "__main__":
    main()
