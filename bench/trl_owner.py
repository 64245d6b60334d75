"""A TRL GRPO run on 2 gloo ranks (CPU): plain ``GRPOTrainer`` vs ``ReplayGRPOTrainer`` with trainer-owned and
with planner-owned samples.

Setup: the tiny random Qwen3-MoE of ``relibra_moe.integrations.hf_tiny`` (8 experts, top-2, hidden 32, 2 MoE
layers), the character tokenizer of ``examples/trl_grpo.py``, 16 prompts x 4 generations sampled at
temperature 1 (seed 0), ``max_completion_length=16``, 4 prompts x 4 generations per rank per step in 2
micro-steps of 8 (``per_device_train_batch_size=8``, ``gradient_accumulation_steps=2``), AdamW, ``--steps``
steps. ReplayGRPOTrainer: strategy "relibra", 1 replica slot, the default cluster (``ClusterSpec(1, 2)``).

Figures per mode: wall seconds per step (TRL's ``step_time``: generation, rewards, forwards and backwards,
relibra's recording, planning wait, relayout and sample exchange; mean over steps 2..N, step 1 warms up), and
for the relibra modes the telemetry of ``log_history``: the plan's modelled step, the static layout's and
the best baseline's (simulator, default cluster; the tiny model's steps are microseconds), planning seconds,
the first micro-step's wait for the plan and the share of steps whose plan was ready before (hidden).

Usage::

    python bench/trl_owner.py                      # writes bench/results/trl_owner.json
    python bench/trl_owner.py --steps 6
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

# This folder holds kernels.py, which would shadow the `kernels` package transformers probes for (and that file
# sets TRITON_INTERPRET=1 for the kernel benchmarks): keep it off the import path.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

import numpy as np  # noqa: E402

from relibra_moe.atomic import write_text  # noqa: E402
from relibra_moe.layers.testing import run_group  # noqa: E402

MODES = ("plain", "trainer", "planner")
FIELDS = ("step_s", "static_step_s", "best_baseline_step_s", "speedup_vs_static", "speedup_vs_best_baseline",
          "planning_s", "planning_wait_s", "planning_hidden", "experts_moved", "replicas")


def _worker(rank: int, world: int, out_dir: str, mode: str, steps: int) -> None:
    import torch
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from relibra_moe.integrations.hf_tiny import tiny_model
    from relibra_moe.integrations.trl import ReplayGRPOTrainer

    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
                       "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29541"})
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
    from trl_grpo import char_tokenizer, reward_e

    torch.manual_seed(0)
    prompts = [w + s for w in ("hello", "moe", "tree", "see") for s in ("", " bee", " green", " deep keep")]
    args = GRPOConfig(output_dir=out_dir, per_device_train_batch_size=8, gradient_accumulation_steps=2,
                      num_generations=4, max_completion_length=16, max_steps=steps, learning_rate=1e-3,
                      logging_steps=1, report_to="none", use_cpu=True, bf16=False, save_strategy="no", seed=0,
                      disable_tqdm=True)
    common = {"model": tiny_model("qwen3_moe", seed=0).train(), "reward_funcs": reward_e, "args": args,
              "train_dataset": Dataset.from_dict({"prompt": prompts}), "processing_class": char_tokenizer()}
    if mode == "plain":
        trainer = GRPOTrainer(**common)
    else:
        trainer = ReplayGRPOTrainer(**common, replica_slots=1, sample_owner=mode)
    t0 = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - t0
    logs = [h for h in trainer.state.log_history if "step_time" in h]
    from relibra_moe.triton_kernels.backend import INTERPRET

    assert not INTERPRET, "the Triton interpreter is on: the figures would time it, not the CPU reference"
    rep = {"step_time": [h["step_time"] for h in logs], "train_s": wall,
           "telemetry": {f: [h.get(f"relibra/{f}") for h in logs] for f in FIELDS}}
    if rank == 0:
        write_text(Path(out_dir, f"{mode}.json"), json.dumps(rep))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "trl_owner.json"))
    a = ap.parse_args()
    res: dict = {"machine": platform.platform(), "cpus": os.cpu_count(), "steps": a.steps, "modes": {}}
    with tempfile.TemporaryDirectory(prefix="relibra-bench-trl-") as tmp:
        for mode in MODES:
            run_group(_worker, 2, tmp, mode, a.steps, timeout_s=300)
            rep = json.loads(Path(tmp, f"{mode}.json").read_text())
            row = {"wall_step_s": float(np.mean(rep["step_time"][1:])), "step_time": rep["step_time"]}
            if mode != "plain":
                row.update({f: float(np.mean(v)) for f, v in rep["telemetry"].items() if None not in v})
            res["modes"][mode] = row
            print(mode, json.dumps({k: v for k, v in row.items() if k != "step_time"}), flush=True)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    write_text(Path(a.out), json.dumps(res, indent=2))
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
