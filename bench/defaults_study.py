"""Planner defaults re-checked under the calibrated preset (issue 24): relibra with one option changed at a time.

For each scenario (SYNTHETIC ``rl_batch`` mixed batches, the first ``--layers`` MoE layers) and each cluster preset
(``h100``, the calibrated default, and ``hopper-rail``, the raw rates the defaults were chosen under), plan relibra
with its defaults and with one option changed: expert-move pricing off (``migration=False``), replica pricing off
(``price_replicas=False``), the sample placement's attention tolerance (``tol``, how much attention imbalance
locality may buy) at 0 and 0.2 instead of 0.05, and r = 1 / 4 replica slots instead of 2; report the simulated
step (moves from the static placement, replica and reorder traffic charged) relative to the default's.
Writes ``bench/results/defaults_study.json`` (resumable per (preset, scenario, variant)).

    python bench/defaults_study.py
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

OUT = Path(__file__).resolve().parent / "results" / "defaults_study.json"
SCENARIOS = (("qwen3-30b-a3b", 2), ("qwen3-235b-a22b", 4))
PRESETS = ("h100", "hopper-rail")
VARIANTS = {"default": {}, "migration off": {"migration": False}, "replica pricing off": {"price_replicas": False},
            "tol 0": {"tol": 0.0}, "tol 0.2": {"tol": 0.2}, "r = 1": {"replica_slots": 1},
            "r = 4": {"replica_slots": 4}}


def main() -> int:
    from relibra_moe.planners.strategies import plan_batch
    from relibra_moe.sim import simulate_step
    from relibra_moe.specs import cluster_preset, model_preset
    from relibra_moe.synthetic import rl_batch

    layers, prompts = 4, 128
    res = json.loads(OUT.read_text()) if OUT.exists() else {
        "command": "python bench/defaults_study.py", "date": "2026-12-02", "layers": layers,
        "samples": prompts * 4, "micro_batch_size": 32, "data": "synthetic mixed (relibra_moe.synthetic)",
        "machine": "2-core CPU box shared with other jobs", "runs": {}}
    for name, nodes in SCENARIOS:
        full = model_preset(name)
        batch = rl_batch(full, "mixed", prompts, 4, seed=0, micro_batch_size=32).restrict_layers(layers)
        model = full.with_(num_layers=layers)
        for preset in PRESETS:
            cluster = cluster_preset(preset, nodes=nodes, gpus_per_node=8)
            for var, opts in VARIANTS.items():
                key = f"{preset} | {name} EP{nodes * 8} | {var}"
                if key in res["runs"]:
                    continue
                kw = {"replica_slots": 2, **opts}
                t0 = time.perf_counter()
                plan = plan_batch(batch, model, cluster, "relibra", seed=0, **kw)
                solve = time.perf_counter() - t0
                step = simulate_step(plan, batch, model, cluster)
                res["runs"][key] = {"step_s": step.step_s, "t_moe_s": step.t_moe_s,
                                    "reorder_s": step.reorder_s, "replica_exposed_s": step.replica_exposed_s,
                                    "experts_moved": step.experts_moved, "solve_s": solve}
                print(f"{key}: step {step.step_s:.4f} s (solve {solve:.1f} s)", flush=True)
                OUT.write_text(json.dumps(res, indent=1))
    for preset in PRESETS:
        for name, nodes in SCENARIOS:
            base = res["runs"][f"{preset} | {name} EP{nodes * 8} | default"]["step_s"]
            cells = [f"{var} {res['runs'][f'{preset} | {name} EP{nodes * 8} | {var}']['step_s'] / base:.3f}"
                     for var in VARIANTS if var != "default"]
            print(f"{preset} {name}: default {base:.4f} s; " + ", ".join(cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
