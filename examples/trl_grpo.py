"""A TRL GRPO script trained with ReLibra: ``GRPOTrainer`` -> ``ReplayGRPOTrainer``, nothing else changes.

A tiny random Qwen3-MoE (8 experts, top-2) with a character tokenizer, both built here (nothing is
downloaded), learns for a few steps to write short completions rich in the letter "e". The two lines
that differ from the plain TRL script are marked ``# relibra``.

Run on one process, or with expert parallelism over several (the experts are split over the ranks, the
plan's replicas placed per micro-batch, accelerate's DDP handled)::

    python examples/trl_grpo.py
    torchrun --nproc-per-node 2 examples/trl_grpo.py          # or: accelerate launch --num_processes 2 ...

Each rank prints the plan of every generation batch (replicas placed, experts moved) and the logged loss.
"""

from __future__ import annotations

import argparse
import tempfile

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
    """Print the plan of each generation batch (rank, replicas placed, samples, sample owner)."""

    def __init__(self) -> None:
        self.trainer: ReplayGRPOTrainer | None = None

    def on_step_end(self, args, state, control, **kwargs):
        t = self.trainer
        plan = t.last_plan
        reps = int((plan.replicas.replica_expert >= 0).sum()) if plan is not None else 0
        print(f"rank {t.rank}/{t.world} step {state.global_step}: {t.last_batch.num_sequences} samples, "
              f"replicas placed {reps}, plan {'none (one rank)' if plan is None else plan.stats.get('sample_owner')}",
              flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--replica-slots", type=int, default=1)
    a = ap.parse_args()
    torch.manual_seed(0)
    dataset = Dataset.from_dict({"prompt": ["hello", "moe", "tree", "see", "bee", "green", "deep", "keep"]})
    show = ShowPlan()
    with tempfile.TemporaryDirectory(prefix="relibra-trl-") as out:
        args = GRPOConfig(output_dir=out, per_device_train_batch_size=4, gradient_accumulation_steps=2,
                          num_generations=4, max_completion_length=8, max_steps=a.steps, learning_rate=1e-3,
                          logging_steps=1, report_to="none", use_cpu=True, bf16=False, save_strategy="no",
                          disable_tqdm=True)
        trainer = ReplayGRPOTrainer(  # relibra (was: GRPOTrainer); replica_slots is a ReLibra option
            model=tiny_model("qwen3_moe", seed=0).train(), reward_funcs=reward_e, args=args,
            train_dataset=dataset, processing_class=char_tokenizer(), callbacks=[show],
            replica_slots=a.replica_slots)
        show.trainer = trainer
        trainer.train()
        losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        print(f"rank {trainer.rank}: losses {[round(x, 4) for x in losses]}", flush=True)


if __name__ == "__main__":
    main()
