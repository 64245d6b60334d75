"""Moves charged over a horizon (``PlanOptions.move_horizon``): what relibra gains over a run, and what the step that
moves costs.

By default relibra charges a move of its experts all of its re-layout on the batch that makes it, so a move that
pays back only on later batches is never made (a myopic plan: on wide cell 092, GPT-OSS-20B at EP 1 x 8, it stays
on the static homes batch after batch). With ``move_horizon=H`` the migration pricing and the portfolio charge
``1 / H`` of the re-layout; the simulator still charges all of it to the step that moves.

Cells: the wide never-lose draw (``never_lose.wide_cell``, seed ``--seed + i``, default 7000: every model and
cluster preset, EP 1x4 to 4x8, r = 1-4, overlap or not, about 3 cells of 10 trainer-owned), each cut into
``--batches`` K consecutive batches (default 4) instead of the 1-3 it draws. Per cell, once: every baseline of
``never_lose.LB_STRATEGIES`` on every sample placement (the trainer's, per placement, where it owns the samples);
then relibra with each horizon of ``--horizons`` (default 1, 2, 4, 8), the samples its own (or the trainer's, per
placement). Per cell and H, relibra over the best baseline, by two figures:

- ``run``: the K steps summed, the first (from the static placement) included: what a run of K batches takes;
- ``steady``: the mean of steps 2..K (``steady.summarize``), the never-lose grids' figure.

With trainer-owned samples each placement is compared with the baselines on it, and the worst placement counts.
Resumable: one JSON per cell in ``bench/results/move_horizon/`` (``_s<seed>`` and ``_k<K>`` for other draws).

    python bench/move_horizon.py --cells 0 1 2 ... 39   # run these cells (two processes: split the list)
    python bench/move_horizon.py --table                 # the table and the summary from the files

A horizon H is judged fairly only over a run of more than H batches after the move; K = 4 cannot show what H = 8
pays back. ``--long`` runs longer chains instead (``LONG_CELLS``, results in ``results/move_horizon_long/``): the
real GPT-OSS-20B trace, all 703 requests in the order of a draw with seed 0 (so each batch is a sample of the same
mix of prompts, as an RL step's is), in micro-batches of 8, cut into ``LONG_BATCHES`` = 8 consecutive batches, the
first 6 MoE layers, r = 2, h100, planner-owned, on EP 1 x 8 and 2 x 4 without overlap, with Megatron's and with
DualPipe's.

    python bench/move_horizon.py --long --cells 0 1 2   # and 3 4 5 in a second process
    python bench/move_horizon.py --long --table
    python bench/move_horizon.py --long --seed 1 --cells 0 1 2 3   # another draw: move_horizon_long_s1/
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path
from typing import Any

import numpy as np
from never_lose import LB_STRATEGIES, RESULTS, WIDE_SEED, gptoss_cell, synthetic_cell, wide_cell

from relibra_moe.atomic import write_text
from relibra_moe.plan import json_default

OUT = RESULTS / "move_horizon"
HORIZONS = (1, 2, 4, 8)
BATCHES = 4
BASELINES = tuple(s for s in LB_STRATEGIES if s != "relibra")


LONG_OUT = RESULTS / "move_horizon_long"
LONG_BATCHES = 8
LONG_CELLS = tuple((ep, overlap) for ep in ((1, 8), (2, 4)) for overlap in ("none", "megatron", "dualpipe"))


def long_cell(i: int, draw: int = 0):
    """``(batches, model, cluster, desc)`` of ``LONG_CELLS[i]`` (module docstring, ``--long``), the requests in the
    order of a draw with seed ``draw``."""
    from relibra_moe.specs import cluster_preset

    (nodes, gpn), overlap = LONG_CELLS[i]
    seq, model, desc = gptoss_cell(703, draw, 8, 6, LONG_BATCHES)
    desc = dict(desc, ep=f"{nodes}x{gpn}", preset="h100", overlap=overlap, replica_slots=2, sample_owner="planner",
                rebalance_every=1, window=1)
    return seq, model, cluster_preset("h100", nodes=nodes, gpus_per_node=gpn, overlap=overlap), desc


def out_dir(seed: int, batches: int) -> Path:
    """The results folder of a draw: ``OUT``, with ``_s<seed>`` / ``_k<K>`` for a non-default seed / K."""
    name = OUT.name + (f"_s{seed}" if seed != WIDE_SEED else "") + (f"_k{batches}" if batches != BATCHES else "")
    return OUT.with_name(name)


def cell_batches(i: int, seed: int, batches: int):
    """``(batches, model, cluster, desc)``: wide cell ``i`` redrawn with ``batches`` consecutive batches."""
    _, _, cluster, desc = wide_cell(i, seed)
    if "requests" in desc:  # real GPT-OSS-20B requests
        seq, model, _ = gptoss_cell(desc["requests"], desc["draw_seed"], desc["micro_batch_size"], desc["layers"],
                                    batches)
    else:  # desc["data"] is "synthetic <model preset> <domain>"
        _, name, domain = desc["data"].split()
        seq, model, _ = synthetic_cell(name, domain, desc["prompts"], desc["micro_batch_size"], desc["layers"],
                                       desc["draw_seed"], batches)
    desc = dict(desc, batches=batches)
    return seq, model, cluster, desc


def figures(steps: list[float]) -> dict[str, float]:
    """``run`` (the steps summed) and ``steady`` (mean of steps 2..K; the one step when K = 1), seconds."""
    return {"run": float(sum(steps)), "steady": float(np.mean(steps[1:] or steps[:1]))}


def run_cell(i: int, seed: int, batches: int, horizons: tuple[int, ...], long: bool = False) -> dict[str, Any]:
    """One cell (module docstring; ``long``: ``LONG_CELLS[i]``): the baselines' and relibra's per-step seconds and
    the ratios."""
    from relibra_moe.sample_placements import SAMPLE_PLACEMENTS
    from relibra_moe.steady import run_steady

    seq, model, cluster, desc = long_cell(i, seed) if long else cell_batches(i, seed, batches)
    kw = dict(replica_slots=desc["replica_slots"], seed=0, workers=1, placements=SAMPLE_PLACEMENTS,
              sample_owner=desc["sample_owner"], rebalance_every=desc["rebalance_every"], window=desc["window"])
    t0 = time.perf_counter()
    base = run_steady(seq, model, cluster, BASELINES, **kw)["strategies"]
    steps = {s: [r["step_s"] for r in v["per_step"]] for s, v in base.items()}
    relibra: dict[str, dict[str, list[float]]] = {}
    moved: dict[str, dict[str, list[int]]] = {}
    for h in horizons:
        res = run_steady(seq, model, cluster, ("relibra",), move_horizon=h, **kw)["strategies"]
        relibra[str(h)] = {s: [r["step_s"] for r in v["per_step"]] for s, v in res.items()}
        moved[str(h)] = {s: [int(r["experts_moved"]) for r in v["per_step"]] for s, v in res.items()}
    over: dict[str, dict[str, float]] = {}
    for h, rows in relibra.items():
        worst = {"run": 0.0, "steady": 0.0}
        for own, own_steps in rows.items():  # "relibra" or, trainer-owned, "relibra@placement"
            suffix = own.partition("@")[2]
            rivals = [s for s in steps if s.partition("@")[2] == suffix] if desc["sample_owner"] == "trainer" \
                else list(steps)
            mine = figures(own_steps)
            for k in worst:
                best = min(figures(steps[s])[k] for s in rivals)
                worst[k] = max(worst[k], mine[k] / best)
        over[h] = worst
    first = str(horizons[0])
    gain = {h: {k: float(np.mean([figures(relibra[h][s])[k] / figures(relibra[first][s])[k] for s in relibra[h]]))
                for k in ("run", "steady")} for h in relibra}
    return {"cell": f"{i:03d}", "seed": seed if long else seed + i, "desc": desc, "baselines": steps,
            "relibra": relibra,
            "experts_moved": moved, "over_best": over, "over_first_horizon": gain,
            "seconds": time.perf_counter() - t0, "machine": platform.machine()}


def table(out: Path) -> str:
    """Markdown: per cell, relibra over the best baseline (run / steady) at each horizon, then the summary."""
    cells = [json.loads(f.read_text()) for f in sorted(out.glob("*.json"))]
    if not cells:
        return f"no results in {out}"
    hs = list(cells[0]["over_best"])
    lines = ["| cell | drawn | " + " | ".join(f"H = {h} run / steady" for h in hs) + " |",
             "|---|---|" + "---:|" * len(hs)]
    for d in cells:
        de = d["desc"]
        size = f"{de['requests']} requests" if "requests" in de else f"{de['prompts']} prompts"
        drawn = (f"{de['data']}, {size}, {de['layers']} layers, EP {de['ep']}, {de['preset']}, {de['overlap']}, "
                 f"r = {de['replica_slots']}, {de['sample_owner']}")
        lines.append(f"| {d['cell']} | {drawn} | " + " | ".join(
            f"{d['over_best'][h]['run']:.4f} / {d['over_best'][h]['steady']:.4f}" for h in hs) + " |")
    lines.append("")
    for h in hs:
        run = np.array([d["over_best"][h]["run"] for d in cells])
        steady = np.array([d["over_best"][h]["steady"] for d in cells])
        g = np.array([d["over_first_horizon"][h]["run"] for d in cells])
        lines.append(f"- H = {h}: relibra / best baseline over the run: median {np.median(run):.4f}, worst "
                     f"{run.max():.4f}, never slower in {int((run <= 1 + 1e-12).sum())} of {len(cells)}; steady: "
                     f"median {np.median(steady):.4f}, worst {steady.max():.4f}, never slower in "
                     f"{int((steady <= 1 + 1e-12).sum())}; run over H = {hs[0]}'s: median {np.median(g):.4f}, "
                     f"best {g.min():.4f}, worst {g.max():.4f}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cells", type=int, nargs="*", default=[], help="wide cell indices to run")
    ap.add_argument("--seed", type=int, default=None,
                    help=f"the wide draw's seed (default {WIDE_SEED}); with --long, the requests' draw (default 0)")
    ap.add_argument("--batches", type=int, default=BATCHES, help="consecutive batches K (default %(default)s)")
    ap.add_argument("--horizons", default=",".join(map(str, HORIZONS)),
                    help="comma-separated move horizons, the first the reference (default %(default)s)")
    ap.add_argument("--long", action="store_true", help="the long real-trace chains (LONG_CELLS) instead")
    ap.add_argument("--table", action="store_true", help="print the table from the files and exit")
    args = ap.parse_args()
    seed = (0 if args.long else WIDE_SEED) if args.seed is None else args.seed
    out = (LONG_OUT if not seed else LONG_OUT.with_name(f"{LONG_OUT.name}_s{seed}")) if args.long \
        else out_dir(seed, args.batches)
    if not args.table:
        horizons = tuple(int(h) for h in args.horizons.split(","))
        out.mkdir(parents=True, exist_ok=True)
        for i in args.cells:
            f = out / f"{i:03d}.json"
            if f.exists():
                continue
            d = run_cell(i, seed, args.batches, horizons, args.long)
            write_text(f, json.dumps(d, indent=1, default=json_default))
            print(f"cell {i:03d}: " + ", ".join(f"H={h} {v['run']:.4f}/{v['steady']:.4f}"
                                                for h, v in d["over_best"].items())
                  + f" ({d['seconds']:.0f} s)", flush=True)
    print(table(out))


if __name__ == "__main__":
    main()
