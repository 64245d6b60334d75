"""Steady-state benchmark: consecutive RL batches, each planned from the last plan, every strategy charged for
its moves (relibra_moe.steady).

Scenarios (issue 14):
- ``qwen3-235b-drift``: qwen3-235b-a22b, EP32 = 4 x 8, r = 2, K batches of 256 prompts x 4 responses
  (32 micro-batches of 32) with a drifting domain mix (``steady.drifting_batches``, drift 0.25 turn per
  batch; synthetic, labelled so), 4 of the 94 MoE layers (as the demo: the 2 shared cores);
- ``qwen3-235b-mixed``: the same model and cluster, K synthetic ``mixed`` batches (``synthetic.rl_batch``
  domain "mixed", seed + k: a stationary mix whose micro-batches switch domain);
- ``gptoss-ep8``: the real GPT-OSS-20B trace (703 requests, arrival = file order), micro-batches of 44,
  cut into K consecutive batches (``steady.consecutive_batches``), EP8 = 2 x 4, r = 2, all 24 layers.

Strategies: static, eplb (EPLB+, oracle loads, re-planned per batch), lplb, eplb-history (previous batch, every
batch; and ``eplb-history/n2w2``: a window of 2 batches every 2 batches), online, relibra-inter, relibra.
Figures per strategy: first step, steady state (mean of steps 2..K) of the sum of T_MoE (moves free) and of
the simulated step (moves, replica and reorder traffic charged), experts moved per step, rank skew, solve s;
relibra's steady throughput over each strategy's.

Usage::

    python bench/steady.py                         # all scenarios, writes bench/results/steady.json
    python bench/steady.py --scenarios gptoss-ep8 --batches 8
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

from relibra_moe.plan import json_default
from relibra_moe.specs import cluster_preset, model_preset
from relibra_moe.steady import consecutive_batches, drifting_batches, plan_steady, run_steady, steady_table, summarize

STRATEGIES = ("static", "eplb", "lplb", "eplb-history", "online", "relibra-inter", "relibra")
SCENARIOS = ("qwen3-235b-drift", "qwen3-235b-mixed", "gptoss-ep8")


def build(name: str, num_batches: int, seed: int):
    """``(batches, model, cluster)`` of a scenario."""
    if name.startswith("qwen3-235b"):
        model = model_preset("qwen3-235b-a22b").with_(num_layers=4)
        cluster = cluster_preset("hopper-rail", nodes=4, gpus_per_node=8)
        if name.endswith("drift"):
            return drifting_batches(model, num_batches, 256, micro_batch_size=32, drift=0.25, seed=seed), model, cluster
        from relibra_moe.synthetic import rl_batch

        return [rl_batch(model, "mixed", 256, 4, seed=seed + k, micro_batch_size=32) for k in range(num_batches)], \
            model, cluster
    from relibra_moe.datasets import gpt_oss_batch

    model = model_preset("gpt-oss-20b")
    cluster = cluster_preset("hopper-rail", nodes=2, gpus_per_node=4)
    return consecutive_batches(gpt_oss_batch(seed=seed).with_micro_batch_size(44), num_batches), model, cluster


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--scenarios", nargs="*", choices=SCENARIOS, default=None)
    ap.add_argument("--batches", type=int, default=4, help="K consecutive batches per scenario (default 4)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--out", default=None, help="JSON path (default bench/results/steady.json)")
    args = ap.parse_args()
    from rich.console import Console

    console = Console(width=170)
    out_path = Path(args.out or Path(__file__).parent / "results" / "steady.json")
    report = {"machine": platform.platform(), "python": platform.python_version(), "batches": args.batches,
              "seed": args.seed, "workers": args.workers, "scenarios": {}}
    for name in args.scenarios or SCENARIOS:
        t0 = time.perf_counter()
        batches, model, cluster = build(name, args.batches, args.seed)
        res = run_steady(batches, model, cluster, STRATEGIES, replica_slots=2, seed=args.seed, workers=args.workers)
        _, rows = plan_steady(batches, model, cluster, "eplb-history", replica_slots=2, seed=args.seed,
                              workers=args.workers, rebalance_every=2, window=2)
        res["strategies"]["eplb-history/n2w2"] = {"per_step": rows, **summarize(rows)}
        ref = res["strategies"]["relibra"]["steady"]["tokens_per_s"]
        res["speedup"]["eplb-history/n2w2"] = ref / res["strategies"]["eplb-history/n2w2"]["steady"]["tokens_per_s"]
        res["layers_total"] = model_preset(model.name).num_layers
        res["wall_s"] = time.perf_counter() - t0
        res["source"] = batches[0].source
        console.print(steady_table(res, title=f"{name}: {res['num_batches']} consecutive batches, "
                                              f"{model.num_layers} MoE layers, r = 2 ({res['wall_s']:.0f} s)"))
        report["scenarios"][name] = res
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(report, indent=1, default=json_default))
    console.print(f"wrote {out_path}")


if __name__ == "__main__":
    main()
