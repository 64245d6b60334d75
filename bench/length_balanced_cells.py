"""Issue 27's table: relibra against baselines on a length-balanced sample placement, before and after the change.

Four cells, each the steady step of ``relibra compare`` (``steady.run_steady``; the CLI's default cluster; r = 2;
static, eplb, eplb-history, online, relibra):

- ``qwen-1x8`` / ``qwen-2x8``: synthetic qwen3-30b-a3b, mixed, 128 prompts x 4, micro-batches of 32, synthesized at
  full depth then cut to 4 MoE layers (``relibra trace synth`` + ``compare --layers 4``), one batch; EP 1x8 / 2x8.
- ``gptoss-1x8`` / ``gptoss-2x4``: the real GPT-OSS-20B trace, 703 requests, micro-batches of 44, 4 consecutive
  batches, 24 layers; EP 1x8 / 2x4.

``--before`` runs what a user could run before the sample placements existed (works on the code before this
change too): every strategy planner-owned on round-robin, and trainer-owned (``sample_owner="both"``) with the
issue's ``--sample-gpu`` file, longest-first per micro-batch (computed here, the same rule as
``sample_placements.longest_first``). Without it: the baselines on round-robin, verl's length-balanced and
longest-first (``placements``), planner- and trainer-owned.

    python bench/length_balanced_cells.py qwen-1x8 gptoss-1x8 gptoss-2x4 qwen-2x8           # after
    git worktree add /tmp/base 56f851b && cd /tmp/base && PYTHONPATH=$PWD \\
        python /path/to/bench/length_balanced_cells.py --before qwen-1x8 ...                 # before

Writes ``bench/results/length_balanced_cells/{before,after}-<cell>.json`` (under the current directory's bench/).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from relibra_moe.atomic import write_text
from relibra_moe.specs import DEFAULT_CLUSTER, cluster_preset, model_preset
from relibra_moe.steady import consecutive_batches, run_steady

CELLS = ("qwen-1x8", "gptoss-1x8", "gptoss-2x4", "qwen-2x8")
STRATEGIES = ("static", "eplb", "eplb-history", "online", "relibra")


def longest_first_ranks(lengths: np.ndarray, micro_batch: np.ndarray, num_gpus: int) -> np.ndarray:
    """The issue's ``--sample-gpu`` file: per micro-batch, longest sample first onto the GPU with the fewest tokens."""
    out = np.zeros(len(lengths), np.int64)
    for m in np.unique(micro_batch):
        idx = np.flatnonzero(micro_batch == m)
        tokens = np.zeros(num_gpus)
        for n in idx[np.lexsort((idx, -lengths[idx]))]:
            g = int(np.argmin(tokens))
            out[n] = g
            tokens[g] += lengths[n]
    return out


def build(name: str):
    """``(batches, model, cluster)`` of a cell."""
    nodes, gpn = {"1x8": (1, 8), "2x4": (2, 4), "2x8": (2, 8), "4x4": (4, 4)}[name.split("-")[-1]]
    cluster = cluster_preset(DEFAULT_CLUSTER, nodes=nodes, gpus_per_node=gpn)
    if name.startswith("qwen"):
        from relibra_moe.synthetic import rl_batch

        full = model_preset("qwen3-30b-a3b")
        return ([rl_batch(full, "mixed", 128, 4, seed=0, micro_batch_size=32).restrict_layers(4)],
                full.with_(num_layers=4), cluster)
    from relibra_moe.datasets import gpt_oss_batch

    return consecutive_batches(gpt_oss_batch().with_micro_batch_size(44), 4), model_preset("gpt-oss-20b"), cluster


def run(name: str, before: bool) -> dict:
    batches, model, cluster = build(name)
    t0 = time.perf_counter()
    if before:
        ranks = [longest_first_ranks(np.asarray(b.lengths), b.resolve_micro_batch(), cluster.num_gpus) for b in batches]
        res = run_steady(batches, model, cluster, STRATEGIES, replica_slots=2, sample_owner="both", sample_gpu=ranks)
    else:
        res = run_steady(batches, model, cluster, STRATEGIES, replica_slots=2, sample_owner="both",
                         placements=("round-robin", "length-balanced", "longest-first"))
    out = {mode: {s: v["steady"]["step_s"] for s, v in res[key].items()}
           for mode, key in (("planner", "strategies"), ("trainer", "trainer"))}
    out.update({"cell": name, "cluster": cluster.name, "before": before, "seconds": time.perf_counter() - t0,
                "portfolio": [r.get("portfolio") for r in res["strategies"]["relibra"]["per_step"]]})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("cells", nargs="*", default=list(CELLS), choices=CELLS)
    ap.add_argument("--before", action="store_true", help="the trainer-owned longest-first runs of the issue")
    args = ap.parse_args()
    out_dir = Path("bench") / "results" / "length_balanced_cells"
    out_dir.mkdir(parents=True, exist_ok=True)
    for c in args.cells:
        d = run(c, args.before)
        write_text(out_dir / f"{'before' if args.before else 'after'}-{c}.json", json.dumps(d, indent=1))
        print(c, json.dumps({k: d[k] for k in ("planner", "trainer")}), flush=True)


if __name__ == "__main__":
    main()
