"""A TRL GRPO script trained with ReLibra: ``GRPOTrainer`` -> ``ReplayGRPOTrainer``, nothing else changes.

A tiny random Qwen3-MoE (8 experts, top-2) with a character tokenizer, both built here (nothing is
downloaded), learns for a few steps to write short completions rich in the letter "e". The two lines
that differ from the plain TRL script are marked ``# relibra``.

Run on one process, or with expert parallelism over several (the experts are split over the ranks, the
samples placed by the plan, its replicas placed per micro-batch, accelerate's DDP handled)::

    python examples/trl_grpo.py
    torchrun --nproc-per-node 2 examples/trl_grpo.py
    accelerate launch --multi_gpu --num_processes 2 examples/trl_grpo.py   # also on CPU: without --multi_gpu
                                                                          # accelerate starts ONE process there
    torchrun --nproc-per-node 2 examples/trl_grpo.py --steps 4 --save-steps 2 --resume   # save, then resume

The main process prints what relibra does, then each step's plan telemetry (``log_history``'s ``relibra/*``
fields: experts moved, replicas, modelled step against static, planning seconds) and the losses.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch
from datasets import Dataset
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, TrainerCallback
from trl import GRPOConfig

from relibra_moe.integrations.hf_tiny import tiny_model
from relibra_moe.integrations.trl import ReplayGRPOTrainer  # relibra (was: from trl import GRPOTrainer)

CHARS = "abcdefghijklmnopqrstuvwxyz "


def char_tokenizer() -> PreTrainedTokenizerFast:
    """One token per character (ids 4..), with <pad> = 0, <s> = 1, </s> = 2 as the tiny model expects."""
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3} | {c: i + 4 for i, c in enumerate(CHARS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>")


def reward_e(completions: list[str], **kwargs) -> list[float]:
    """The share of letters "e" in each completion."""
    return [c.count("e") / max(len(c), 1) for c in completions]


class ShowPlan(TrainerCallback):
    """Print each logged step's plan telemetry (the ``relibra/*`` fields of ``log_history``) on the main process."""

    def on_log(self, args, state, control, logs=None, **kwargs):
        fields = {k.removeprefix("relibra/"): v for k, v in (logs or {}).items() if k.startswith("relibra/")}
        if fields and state.is_world_process_zero:
            print(f"step {state.global_step}: experts moved {fields['experts_moved']:.0f}, replicas "
                  f"{fields['replicas']:.0f}, modelled step {fields['step_s']:.3g} s (static "
                  f"{fields['static_step_s']:.3g} s, x{fields['speedup_vs_static']:.3f}), planning "
                  f"{fields['planning_s']:.3f} s (hidden: {fields['planning_hidden']:.0f})", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--replica-slots", type=int, default=1)
    ap.add_argument("--save-steps", type=int, default=0, help="save a checkpoint every N steps (0: never)")
    ap.add_argument("--resume", action="store_true", help="then train again from the first checkpoint")
    ap.add_argument("--output-dir", default=None, help="default: a temporary directory (with --save-steps: "
                    f"{Path(tempfile.gettempdir(), 'relibra-trl-example')}, one folder for every rank)")
    a = ap.parse_args()
    torch.manual_seed(0)
    dataset = Dataset.from_dict({"prompt": ["hello", "moe", "tree", "see", "bee", "green", "deep", "keep"] * 4})
    with tempfile.TemporaryDirectory(prefix="relibra-trl-") as tmp:  # per process: fine while nothing is saved
        out = a.output_dir or (str(Path(tempfile.gettempdir(), "relibra-trl-example")) if a.save_steps else tmp)
        args = GRPOConfig(output_dir=out, per_device_train_batch_size=4, gradient_accumulation_steps=2,
                          num_generations=4, max_completion_length=8, max_steps=a.steps, learning_rate=1e-3,
                          logging_steps=1, report_to="none", use_cpu=True, bf16=False, disable_tqdm=True,
                          save_strategy="steps" if a.save_steps else "no", save_steps=a.save_steps or 500)

        def run(resume: str | None) -> ReplayGRPOTrainer:
            trainer = ReplayGRPOTrainer(  # relibra (was: GRPOTrainer); replica_slots is a ReLibra option
                model=tiny_model("qwen3_moe", seed=0).train(), reward_funcs=reward_e, args=args,
                train_dataset=dataset, processing_class=char_tokenizer(), callbacks=[ShowPlan()],
                replica_slots=a.replica_slots)
            trainer.train(resume_from_checkpoint=resume)
            return trainer

        trainer = run(None)
        losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        if trainer.accelerator.is_main_process:
            print(f"losses {[round(x, 4) for x in losses]}", flush=True)
        if a.resume and a.save_steps:
            first = f"{out}/checkpoint-{a.save_steps}"
            again = [h["loss"] for h in run(first).state.log_history if "loss" in h]
            if trainer.accelerator.is_main_process:
                print(f"resumed from {first}: losses {[round(x, 4) for x in again]} (the same as above)", flush=True)


if __name__ == "__main__":
    main()
