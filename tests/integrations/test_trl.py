"""ReplayGRPOTrainer (TRL 1.16) on 2 gloo ranks equals a single-process plain GRPOTrainer step.

Setup: a tiny random Qwen3-MoE (8 experts, top-2, hidden 32; 2 MoE layers and one dense) with a character
tokenizer built with ``tokenizers``, 4 prompts x 2 generations, ``max_completion_length=4``, 2 micro-steps
per rank (``gradient_accumulation_steps=2``), AdamW, ``max_grad_norm=0.1`` (the clip is active), fp32, the
router aux loss at the model's default coefficient; with and without activation checkpointing.

Identity of inputs: both runs build the model from the same seed and read the same 8 prompts in the same
order (TRL's ``RepeatSampler`` with the same seed; rank r's rows are global rows 4r..4r+3, checked
through the prompts each run reports). Completions are fed, not sampled: a logits processor forces the
token table ``FORCED`` (row g's completion, ending in EOS or truncated at 4 tokens), so both runs train
on the same tokens and rewards. TRL shuffles each rank's rows into micro-batches at random; the
reference (one process, ``per_device_train_batch_size=2``, 4 micro-steps) is given exactly the 2-rank
run's micro-batches (rank 0 m0, rank 1 m0, rank 0 m1, rank 1 m1), which makes its per-micro-batch aux loss
and loss normalization the same as DDP's average over ranks.

Checked: the step's loss, every gradient after the global-norm clip (expert rows at their plan homes),
and every parameter after the optimizer step (the full state dict), plus that the plan placed replicas
and that the replayed ids equal the ids the rollout routed.
"""

from __future__ import annotations

import functools
import json
import os
import tempfile
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("trl")

from relibra_moe.layers.testing import run_group  # noqa: E402

PROMPTS = ["abc", "hello", "moe", "xyzzy"]
EOS, PAD = 2, 0
# completion of global row g (4 prompts x 2 generations): rank 0's rows (0-3) all end by step 3, rank 1 runs
# to max_completion_length (rows 4 and 7 are truncated): generation must not deadlock in the EP collectives
FORCED = [[5, 6, EOS], [7, EOS], [11, EOS], [12, 13, EOS], [15, 16, 17, 18], [19, EOS],
          [20, 21, 22, EOS], [23, 24, 25, 26]]
CHARS = "abcdefghijklmnopqrstuvwxyz"
def _slow_cluster():
    """A cluster whose expert compute is slow next to its links: at this toy size the planner replicates."""
    from relibra_moe.specs import ClusterSpec

    return ClusterSpec(nodes=1, gpus_per_node=2, flops=1e6, attn_flops=1e6)


def _tokenizer():
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": PAD, "<s>": 1, "</s>": EOS, "<unk>": 3}
    vocab.update({c: i + 4 for i, c in enumerate(CHARS)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>")


def _reward(completions, **kwargs):
    return [float(len(c)) + 0.5 * c.count("f") for c in completions]


def _config(out_dir: str, gc: bool, per_device: int, accumulation: int):
    from trl import GRPOConfig

    return GRPOConfig(output_dir=out_dir, per_device_train_batch_size=per_device,
                      gradient_accumulation_steps=accumulation, num_generations=2, max_completion_length=4,
                      max_steps=1, learning_rate=1e-2, max_grad_norm=0.1, logging_steps=1, report_to="none",
                      use_cpu=True, bf16=False, gradient_checkpointing=gc, save_strategy="no", seed=0,
                      disable_tqdm=True, dataloader_num_workers=0)


class _Force:
    """Logits processor: row b emits ``rows[b]`` (then EOS), whatever the model prefers."""

    def __init__(self, rows):
        self.rows, self.start = rows, None

    def __call__(self, input_ids, scores):
        if self.start is None:
            self.start = input_ids.shape[1]
        t = input_ids.shape[1] - self.start
        out = torch.full_like(scores, float("-inf"))
        for b, row in enumerate(self.rows):
            out[b, row[t] if t < len(row) else EOS] = 0.0
        return out


class _Probe:
    """Test mixin: forced completions, the prompts / losses / clipped grads each run saw."""

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        from transformers import LogitsProcessorList

        offset = self.accelerator.process_index * len(prompt_ids)
        self.seen_prompts = {offset + i: list(p) for i, p in enumerate(prompt_ids)}
        model = self.model
        model.generate = functools.partial(model.generate, logits_processor=LogitsProcessorList(
            [_Force(FORCED[offset:offset + len(prompt_ids)])]))
        try:
            return super()._generate_single_turn(prompt_ids, images, multimodal_fields, num_generations,
                                                 has_tool_images)
        finally:
            del model.generate

    def _calculate_rewards(self, *args, **kwargs):
        self.plan_started_before_rewards = getattr(self, "_plan_future", None) is not None
        return super()._calculate_rewards(*args, **kwargs)

    def training_step(self, model, inputs, num_items_in_batch=None):
        loss = super().training_step(model, inputs, num_items_in_batch)
        self.losses.append(float(loss))
        return loss


def _grads_callback(store: dict):
    from transformers import TrainerCallback

    class Grab(TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
            m = getattr(model, "module", model)
            store.update({n: p.grad.detach().clone() for n, p in m.named_parameters() if p.grad is not None})

    return Grab()


def _model():
    from relibra_moe.integrations.hf_tiny import tiny_model

    model = tiny_model("qwen3_moe", seed=11).train()
    assert model.config.router_aux_loss_coef > 0
    return model


def _dataset():
    from datasets import Dataset

    return Dataset.from_dict({"prompt": PROMPTS})


def _env(rank: int, world: int) -> None:
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
                       "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29533"})


def _replay_worker(rank: int, world: int, out_dir: str) -> None:
    from relibra_moe.integrations.hf import RoutingRecorder, full_state_dict, moe_blocks
    from relibra_moe.integrations.trl import ReplayGRPOTrainer
    from relibra_moe.triton_kernels.backend import force_backend

    _env(rank, world)

    class Trainer(_Probe, ReplayGRPOTrainer):
        pass

    with force_backend("torch"):
        for gc in (False, True):  # without checkpointing: the default planner-owned samples; with: trainer-owned
            grads: dict = {}
            trainer = Trainer(model=_model(), reward_funcs=_reward, args=_config(out_dir, gc, 2, 2),
                              train_dataset=_dataset(), processing_class=_tokenizer(), replica_slots=1,
                              cluster=_slow_cluster(), planner_options={"migration": False},
                              callbacks=[_grads_callback(grads)], **({"sample_owner": "trainer"} if gc else {}))
            trainer.losses = []
            rollout = RoutingRecorder(trainer.model)  # the ids every forward used, rollout and training
            with rollout:
                trainer.train()
            plan, batch = trainer.last_plan, trainer.last_batch
            homes = {name: b.home_experts.tolist() for _, name, b in moe_blocks(trainer.model)}
            state = {k: v.tolist() for k, v in full_state_dict(trainer.model).items()}
            if not gc:  # save_model writes the whole experts: the checkpoint loads into the plain HF class
                trainer.save_model(str(Path(out_dir, "saved")))
                if rank == 0:
                    from transformers import AutoModelForCausalLM

                    loaded = AutoModelForCausalLM.from_pretrained(str(Path(out_dir, "saved"))).state_dict()
                    assert set(loaded) == set(state)
                    for k, v in loaded.items():
                        assert torch.equal(v, torch.tensor(state[k])), k
            norms = [h["grad_norm"] for h in trainer.state.log_history if "grad_norm" in h]
            from relibra_moe.plan import Placement

            static = Placement.static(plan.num_layers, plan.num_experts, world).expert_gpu
            logged = [h for h in trainer.state.log_history if "loss" in h]
            rep = {"losses": trainer.losses, "prompts": trainer.seen_prompts, "homes": homes, "grad_norm": norms,
                   "replicas": int((plan.replicas.replica_expert >= 0).sum()),
                   "moved": int((plan.placement.expert_gpu != static).sum()),
                   "plan_started_before_rewards": trainer.plan_started_before_rewards,
                   "telemetry": {k: v for k, v in logged[0].items() if k.startswith("relibra/")},
                   "sample_owner": plan.stats.sample_owner,
                   "micro": {int(m): [int(n) for n in range(batch.num_sequences)
                                      if plan.samples.micro_batch[n] == m and plan.samples.gpu[n] == rank]
                             for m in range(2)},
                   "grads": {k: v.tolist() for k, v in grads.items()}, "state": state}
            # rollout routing (trimmed as replayed) vs what the training forwards used for the same rows
            seqs = rollout.sequences()
            n_gen = len(batch.traces) // world
            rec = seqs[:n_gen]
            local = batch.traces[rank * n_gen:(rank + 1) * n_gen]
            rep["rollout_match"] = all((a.experts == b[:a.num_tokens]).all() for a, b in zip(local, rec))
            Path(out_dir, f"replay{int(gc)}_rank{rank}.json").write_text(json.dumps(rep))


class _Reorder:
    """Test mixin: the generation batch's micro-batches become ``self.order`` (lists of global rows, here the
    2-rank run's micro-batches) instead of TRL's random split."""

    def _generate_and_score_completions(self, inputs):
        out = super()._generate_and_score_completions(inputs)
        out["row"] = torch.arange(out["prompt_ids"].shape[0])
        return out

    def _prepare_inputs(self, generation_batch):
        inputs = super()._prepare_inputs(generation_batch)
        if self._step == 0:  # the generation step
            whole = {k: (torch.cat([b[k] for b in self._buffered_inputs]) if v.dim() else v)
                     for k, v in self._buffered_inputs[0].items() if isinstance(v, torch.Tensor)}
            pos = {int(r): i for i, r in enumerate(whole["row"])}
            self._buffered_inputs = [{k: (v[[pos[r] for r in rows]] if v.dim() else v) for k, v in whole.items()}
                                     for rows in self.order]
            inputs = self._buffered_inputs[0]
        return inputs


def _reference_worker(rank: int, world: int, out_dir: str) -> None:
    """One process: the plain GRPOTrainer (checkpointing off and on) and, with TRL's default checkpointing,
    ReplayGRPOTrainer on one rank (replay without a plan), each on the 2-rank run's micro-batches."""
    from trl import GRPOTrainer

    from relibra_moe.integrations.trl import ReplayGRPOTrainer

    _env(0, 1)

    class Reference(_Probe, _Reorder, GRPOTrainer):
        pass

    class Single(_Probe, ReplayGRPOTrainer, _Reorder, GRPOTrainer):  # MRO: _Reorder between the two trainers,
        pass                                                          # so the split is reordered before planning

    for cls, gc in ((Reference, False), (Reference, True), (Single, True)):
        micro = [json.loads(Path(out_dir, f"replay{int(gc)}_rank{r}.json").read_text())["micro"] for r in range(2)]
        grads: dict = {}
        trainer = cls(model=_model(), reward_funcs=_reward, args=_config(out_dir, gc, 2, 4),
                      train_dataset=_dataset(), processing_class=_tokenizer(), callbacks=[_grads_callback(grads)])
        trainer.losses = []
        trainer.order = [micro[0]["0"], micro[1]["0"], micro[0]["1"], micro[1]["1"]]
        trainer.train()
        rep = {"losses": trainer.losses, "prompts": trainer.seen_prompts,
               "grad_norm": [h["grad_norm"] for h in trainer.state.log_history if "grad_norm" in h],
               "grads": {k: v.tolist() for k, v in grads.items()},
               "state": {k: v.tolist() for k, v in trainer.model.state_dict().items()}}
        name = "reference" if cls is Reference else "single"
        Path(out_dir, f"{name}{int(gc)}.json").write_text(json.dumps(rep))


@pytest.mark.timeout(900)
def test_replay_grpo_two_ranks_equals_single_process_grpo():
    with tempfile.TemporaryDirectory(prefix="relibra-trl-") as tmp:
        run_group(_replay_worker, 2, tmp, timeout_s=90)
        run_group(_reference_worker, 1, tmp, timeout_s=90)
        for gc in (0, 1):
            reps = [json.loads(Path(tmp, f"replay{gc}_rank{r}.json").read_text()) for r in range(2)]
            ref = json.loads(Path(tmp, f"reference{gc}.json").read_text())
            _compare(reps, ref, gc)
        # one process: ReplayGRPOTrainer (replay, live routing of never-fed tokens, no plan) = GRPOTrainer
        single = json.loads(Path(tmp, "single1.json").read_text())
        ref = json.loads(Path(tmp, "reference1.json").read_text())
        assert single["prompts"] == ref["prompts"]
        assert abs(sum(single["losses"]) - sum(ref["losses"])) <= 1e-5 * max(1.0, abs(sum(ref["losses"])))
        for name, g in ref["grads"].items():
            want, got = torch.tensor(g), torch.tensor(single["grads"][name])
            assert float((got - want).abs().max()) <= 1e-4 * (float(want.abs().max()) + 1e-12), name
        for name, v in ref["state"].items():
            _check_adamw_step(torch.tensor(single["state"][name]), torch.tensor(v), ref["grads"].get(name), name)


def _check_adamw_step(got: torch.Tensor, want: torch.Tensor, grad: list | None, what: str, lr: float = 1e-2) -> None:
    """Weights after one AdamW step equal the reference's to 2e-5 (0.2% of a step), except where the reference
    gradient is ~0 (|g| < 1e-6): the first step moves a weight by lr * g / (|g| + eps), so there the fp32
    summation-order noise of g (agreeing to 1e-4 of the largest gradient) may move it anywhere within one step."""
    allowed = torch.full_like(want, 2e-5)
    if grad is not None:
        allowed = torch.where(torch.tensor(grad).abs() < 1e-6, torch.full_like(want, 2 * lr + 2e-5), allowed)
    excess = (got - want).abs() - allowed - 1e-5 * want.abs()
    assert float(excess.max()) <= 0, (what, float((got - want).abs().max()), int((excess > 0).sum()))


def _compare(reps, ref, gc):
    prompts = {**reps[0]["prompts"], **reps[1]["prompts"]}
    assert prompts == ref["prompts"], "the two runs did not see the same prompts in the same rows"
    assert len(prompts) == 8
    from relibra_moe.integrations.trl import TELEMETRY

    for rep in reps:
        assert rep["replicas"] > 0 and rep["sample_owner"] == ("trainer" if gc else None), rep["replicas"]
        assert rep["rollout_match"]
    # planner-owned: the plan moved samples between ranks (rank r generated global rows 4r .. 4r+3), each rank
    # still trains 2 per micro-step; trainer-owned: every rank trains the rows it generated
    # planner-owned: rank 0 plans while TRL computes the rewards (overlapped); trainer-owned: after TRL's split
    assert [rep["plan_started_before_rewards"] for rep in reps] == [not gc, False]
    trained = {r: sorted(n for m in ("0", "1") for n in reps[r]["micro"][m]) for r in range(2)}
    assert all(len(reps[r]["micro"][m]) == 2 for r in range(2) for m in ("0", "1"))
    assert (trained == {0: [0, 1, 2, 3], 1: [4, 5, 6, 7]}) == bool(gc), trained
    for rep in reps:
        # the step's plan telemetry is in log_history (so in W&B / TensorBoard), the same on every rank
        tel = rep["telemetry"]
        assert set(tel) == {f"relibra/{k}" for k in TELEMETRY}, sorted(tel)
        assert tel == reps[0]["telemetry"]
        assert tel["relibra/replicas"] == rep["replicas"] and tel["relibra/experts_moved"] == rep["moved"]
        assert tel["relibra/experts_proposed"] >= tel["relibra/experts_moved"] >= 0
        assert tel["relibra/step_s"] > 0 and tel["relibra/planning_s"] > 0 and tel["relibra/fallbacks"] == 0
        assert tel["relibra/speedup_vs_static"] == pytest.approx(tel["relibra/static_step_s"] / tel["relibra/step_s"])
        assert tel["relibra/best_baseline_step_s"] <= tel["relibra/static_step_s"]
        assert tel["relibra/planning_hidden"] in (0.0, 1.0) and (tel["relibra/planning_hidden"] == 0.0 or not gc)
    # loss of the step: DDP's mean over ranks of each rank's micro-step sum = the reference's sum
    loss = (sum(reps[0]["losses"]) + sum(reps[1]["losses"])) / 2
    assert abs(loss - sum(ref["losses"])) <= 1e-5 * max(1.0, abs(sum(ref["losses"]))), (gc, loss, ref["losses"])
    # the Trainer's max_grad_norm clip is active and saw the global norm (expert norms summed over the ranks)
    assert len(ref["grad_norm"]) == 1 and ref["grad_norm"][0] > 2 * 0.1
    for rep in reps:
        assert abs(rep["grad_norm"][0] - ref["grad_norm"][0]) <= 1e-5 * ref["grad_norm"][0], (rep["grad_norm"], ref)
    rg, rs = ref["grads"], ref["state"]
    checked = 0
    for r, rep in enumerate(reps):
        assert set(rep["grads"]) == set(rg)
        for name, g in rep["grads"].items():
            want = torch.tensor(rg[name])
            if ".experts." in name:
                want = want[rep["homes"][name.split(".experts.")[0]]]
            got = torch.tensor(g)
            err = float((got - want).abs().max()) / (float(want.abs().max()) + 1e-12)
            assert err <= 1e-4, (gc, r, name, err)
            checked += 1
        for name, v in rep["state"].items():
            _check_adamw_step(torch.tensor(v), torch.tensor(rs[name]), rg.get(name), f"gc={gc} rank {r} {name}")
    assert checked >= 2 * 20


def test_bad_planning_options_are_named_before_trl_loads_anything():
    from relibra_moe.errors import ReplayError
    from relibra_moe.integrations.trl import ReplayGRPOTrainer

    with pytest.raises(ReplayError, match=r"unrouted='skip' is not one of \('live', 'none', 'error'\)"):
        ReplayGRPOTrainer(model="never-loaded", unrouted="skip")
    with pytest.raises(ReplayError, match=r"replica_slots=-1 must be an int >= 0"):
        ReplayGRPOTrainer(model="never-loaded", replica_slots=-1)


def test_model_spec_reads_the_config_with_the_experts_dtype():
    """model_spec = ModelSpec.from_hf_config of the swapped model's config (hand-checked fields) with the bytes of
    the experts it holds; a config whose MoE layer count differs from the swapped blocks' is a named ValueError."""
    from relibra_moe import swap_moe_blocks
    from relibra_moe.integrations.trl import model_spec

    model = _model()
    swap_moe_blocks(model)
    cfg = model.config
    assert (cfg.num_hidden_layers, cfg.mlp_only_layers) == (3, [1])  # decoder layer 1 is dense: 2 MoE layers
    spec = model_spec(model, name="tiny")
    assert (spec.name, spec.hidden, spec.ffn, spec.num_experts, spec.top_k, spec.num_layers, spec.dtype_bytes) == (
        "tiny", cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts, cfg.num_experts_per_tok, 2, 4)
    cfg.num_hidden_layers += 1  # a fourth MoE layer the model does not have
    with pytest.raises(ValueError, match=r"3 MoE layers, the model 2 swapped MoE blocks"):
        model_spec(model)


# ------------------------------------------------------------------------------------- checkpoints and resume
def _resume_config(out_dir: str):
    from trl import GRPOConfig

    return GRPOConfig(output_dir=out_dir, per_device_train_batch_size=2, gradient_accumulation_steps=2,
                      num_generations=2, max_completion_length=4, max_steps=4, learning_rate=1e-2, max_grad_norm=0.1,
                      logging_steps=1, report_to="none", use_cpu=True, bf16=False, gradient_checkpointing=False,
                      save_strategy="steps", save_steps=2, seed=0, disable_tqdm=True, dataloader_num_workers=0)


def _resume_worker(rank: int, world: int, out_dir: str) -> None:
    """Run A: 4 steps, saved at steps 2 and 4 (strategy "eplb": the experts move). Run B: a fresh trainer resumed
    from A's step-2 checkpoint runs steps 3-4. Each reports its micro-step losses, prompts, homes, the whole
    parameters and the whole optimizer state after step 4."""
    from relibra_moe.integrations.hf import full_state_dict
    from relibra_moe.integrations.trl import ReplayGRPOTrainer
    from relibra_moe.layers.expert_sharding import gather_optimizer_state
    from relibra_moe.layers.moe import moe_layers
    from relibra_moe.triton_kernels.backend import force_backend

    _env(rank, world)

    class Trainer(_Probe, ReplayGRPOTrainer):
        pass

    # 16 prompts: 4 steps of 2 ranks x 2 prompts x 2 generations, one epoch (TRL's RepeatSampler does not restore
    # its generator on resume: a resume past an epoch boundary would see the first epoch's order again)
    prompts = [a + b for a in PROMPTS for b in ("", "e", "ee", "f")]
    from datasets import Dataset

    with force_backend("torch"):
        for run, resume in (("a", None), ("b", str(Path(out_dir, "a", "checkpoint-2")))):
            trainer = Trainer(model=_model(), reward_funcs=_reward, args=_resume_config(str(Path(out_dir, run))),
                              train_dataset=Dataset.from_dict({"prompt": prompts}), processing_class=_tokenizer(),
                              replica_slots=1, strategy="eplb", cluster=_slow_cluster())
            trainer.losses = []
            trainer.train(resume_from_checkpoint=resume)
            opt = gather_optimizer_state(trainer.model, trainer.optimizer)
            rep = {"losses": trainer.losses, "prompts": trainer.seen_prompts,
                   "homes": [layer.expert_gpu_host.tolist() for layer in moe_layers(trainer.model)],
                   "state": {k: v.tolist() for k, v in full_state_dict(trainer.model).items()},
                   "opt": {f"{i}.{k}": v.tolist() for i, e in opt["state"].items() for k, v in e.items()},
                   "loss_log": [h["loss"] for h in trainer.state.log_history if "loss" in h],
                   "log": trainer.state.log_history}
            Path(out_dir, f"resume_{run}_rank{rank}.json").write_text(json.dumps(rep))


@pytest.mark.timeout(600)
def test_resume_after_experts_moved_equals_the_uninterrupted_run():
    """2 ranks save at step 2 (experts moved by "eplb") and resume: steps 3-4 equal the uninterrupted run's
    (losses, every parameter, every optimizer state tensor, the homes), and the step-2 checkpoint holds every
    expert's AdamW state in logical order (each rank's rows of its own optimizer)."""
    from relibra_moe.plan import Placement

    with tempfile.TemporaryDirectory(prefix="relibra-trl-resume-") as tmp:
        run_group(_resume_worker, 2, tmp, timeout_s=120)
        a = [json.loads(Path(tmp, f"resume_a_rank{r}.json").read_text()) for r in range(2)]
        b = [json.loads(Path(tmp, f"resume_b_rank{r}.json").read_text()) for r in range(2)]
        saved = json.loads(Path(tmp, "a", "checkpoint-2", "relibra_placement.json").read_text())
        static = Placement.static(2, 8, 2).expert_gpu.tolist()
        assert saved["world_size"] == 2 and saved["expert_gpu"] != static, "the experts did not move by step 2"
        for r in range(2):
            assert len(a[r]["losses"]) == 8 and len(b[r]["losses"]) == 4  # 2 micro-steps per step
            assert b[r]["losses"] == a[r]["losses"][4:], r
            assert b[r]["loss_log"] == a[r]["loss_log"]  # the log of steps 1-2 comes back from the checkpoint
            assert b[r]["prompts"] == a[r]["prompts"]
            assert b[r]["homes"] == a[r]["homes"]
            assert b[r]["state"] == a[r]["state"]
            assert set(b[r]["opt"]) == set(a[r]["opt"]) and len(a[r]["opt"]) > 0
            for k, v in a[r]["opt"].items():
                assert b[r]["opt"][k] == v, k
        # the step-2 optimizer.pt holds every expert's state, whole [E, ...]
        opt = torch.load(Path(tmp, "a", "checkpoint-2", "optimizer.pt"), weights_only=True)
        shapes = {tuple(v.shape) for e in opt["state"].values() for k, v in e.items() if k == "exp_avg"}
        assert {(8, 32, 32), (8, 32, 16)} <= shapes, shapes  # gate_up_proj, down_proj of 8 experts (4 per rank)
        # another EP size: one rank loads the 2-rank checkpoint, every expert's weights and state at its row
        run_group(_load_on_one_rank_worker, 1, str(Path(tmp, "a", "checkpoint-2")), timeout_s=120)


def _load_on_one_rank_worker(rank: int, world: int, checkpoint: str) -> None:
    from relibra_moe.integrations.hf import checkpoint_state_dict, full_state_dict
    from relibra_moe.integrations.trl import ReplayGRPOTrainer, _read_safetensors
    from relibra_moe.layers.expert_sharding import gather_optimizer_state

    _env(0, 1)
    trainer = ReplayGRPOTrainer(model=_model(), reward_funcs=_reward, args=_resume_config(str(Path(checkpoint).parent)),
                                train_dataset=_dataset(), processing_class=_tokenizer())
    trainer.create_optimizer_and_scheduler(4)
    trainer._load_from_checkpoint(checkpoint)  # what train(resume_from_checkpoint=...) runs first
    trainer._load_optimizer_and_scheduler(checkpoint)
    saved = checkpoint_state_dict(trainer.model, _read_safetensors(checkpoint))
    full = full_state_dict(trainer.model)
    assert set(full) == set(saved) and all(torch.equal(full[k], saved[k]) for k in full)
    whole = torch.load(Path(checkpoint, "optimizer.pt"), weights_only=True)["state"]
    mine = gather_optimizer_state(trainer.model, trainer.optimizer)["state"]
    assert set(mine) == set(whole)
    for i, entry in whole.items():
        for k, v in entry.items():
            assert torch.equal(torch.as_tensor(mine[i][k]), torch.as_tensor(v)), (i, k)


def _save_on_rank0_worker(rank: int, world: int, out_dir: str) -> None:
    """Rank 0 calls save_model alone while rank 1 waits at a barrier: rank 0 gets the named error, then joins."""
    import time

    import torch.distributed as dist

    from relibra_moe.errors import ReplayError
    from relibra_moe.integrations.trl import ReplayGRPOTrainer

    _env(rank, world)
    trainer = ReplayGRPOTrainer(model=_model(), reward_funcs=_reward, args=_config(out_dir, False, 2, 2),
                                train_dataset=_dataset(), processing_class=_tokenizer(), replica_slots=1,
                                save_timeout_s=3)
    start = time.monotonic()
    message = ""
    if rank == 0:
        try:
            trainer.save_model(str(Path(out_dir, "alone")))
        except ReplayError as exc:
            message = str(exc)
    dist.barrier()
    elapsed = time.monotonic() - start
    trainer.save_model(str(Path(out_dir, "both")))  # called on every rank afterwards: works
    Path(out_dir, f"alone{rank}.json").write_text(json.dumps({"message": message, "elapsed": elapsed}))


@pytest.mark.timeout(300)
def test_save_model_on_rank0_only_fails_by_name_without_hanging():
    with tempfile.TemporaryDirectory(prefix="relibra-trl-save-") as tmp:
        run_group(_save_on_rank0_worker, 2, tmp, timeout_s=60)
        reps = [json.loads(Path(tmp, f"alone{r}.json").read_text()) for r in range(2)]
        assert "ReplayGRPOTrainer.save_model: ranks [1] did not call it within save_timeout_s=3 s" in reps[0]["message"]
        assert reps[0]["elapsed"] < 10 and reps[1]["elapsed"] < 10, reps
        assert not Path(tmp, "alone", "model.safetensors").exists()
        assert Path(tmp, "both", "model.safetensors").is_file()
        assert Path(tmp, "both", "relibra_placement.json").is_file()


# ------------------------------------------------------------------------------------- replay semantics
ITER_LR = 3e-2  # the learning rate of _iterations_worker's runs


def _iterations_worker(rank: int, world: int, out_dir: str) -> None:
    """One process, num_iterations=2 (two optimizer steps on one generation batch): plain GRPOTrainer, and
    ReplayGRPOTrainer with replay_routing "refresh" and "rollout". Reports the micro-step losses, the final state
    and, per training forward of the first MoE layer, the ids it replayed (None: routed live)."""
    from trl import GRPOConfig, GRPOTrainer

    from relibra_moe.integrations.hf import moe_blocks
    from relibra_moe.integrations.trl import ReplayGRPOTrainer

    _env(0, 1)

    class Plain(_Probe, GRPOTrainer):
        pass

    class Replay(_Probe, ReplayGRPOTrainer):
        pass

    for name in ("plain", "refresh", "rollout"):
        args = GRPOConfig(output_dir=out_dir, per_device_train_batch_size=2, gradient_accumulation_steps=2,
                          num_generations=2, max_completion_length=4, max_steps=2, num_iterations=2,
                          learning_rate=ITER_LR, logging_steps=1, report_to="none", use_cpu=True, bf16=False,
                          gradient_checkpointing=False, save_strategy="no", seed=0, disable_tqdm=True)
        extra = {} if name == "plain" else {"replay_routing": name}
        cls = Plain if name == "plain" else Replay
        trainer = cls(model=_model(), reward_funcs=_reward, args=args, train_dataset=_dataset(),
                      processing_class=_tokenizer(), **extra)
        trainer.losses = []
        seen: list = []
        if name != "plain":
            block = moe_blocks(trainer.model)[0][2]

            def grab(module, inputs, block=block, seen=seen):
                if torch.is_grad_enabled():  # training forwards (generation and log-prob forwards run without)
                    state = block.replay_state
                    seen.append(None if state is None or state.ids is None else state.ids.tolist())

            block.register_forward_pre_hook(grab)
        trainer.train()
        rep = {"losses": trainer.losses, "ids": seen,
               "state": {k: v.tolist() for k, v in trainer.model.state_dict().items()}}
        Path(out_dir, f"iter_{name}.json").write_text(json.dumps(rep))


@pytest.mark.timeout(900)
def test_replay_routing_refresh_is_plain_trl_and_rollout_replays_the_rollout():
    """replay_routing="refresh": the second optimizer step on a generation batch routes live, so both steps equal
    plain GRPOTrainer; "rollout": the second step replays the same recorded ids as the first (the rollout's
    routing, also after the policy moved), so its step-1 losses equal plain TRL's and its result differs."""
    with tempfile.TemporaryDirectory(prefix="relibra-trl-iter-") as tmp:
        run_group(_iterations_worker, 1, tmp, timeout_s=300)
        plain, refresh, rollout = (json.loads(Path(tmp, f"iter_{n}.json").read_text())
                                   for n in ("plain", "refresh", "rollout"))
        assert len(plain["losses"]) == 4  # 2 optimizer steps x 2 micro-steps
        torch.testing.assert_close(torch.tensor(refresh["losses"]), torch.tensor(plain["losses"]), rtol=1e-5,
                                   atol=1e-6)
        for k, v in plain["state"].items():  # AdamW amplifies fp32 rounding of near-zero gradients on single weights
            got, want = torch.tensor(refresh["state"][k]), torch.tensor(v)  # (0.23% of a step measured, 2026-12-07)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-2 * ITER_LR, msg=k)
            assert float((got - want).norm()) <= 1e-3 * float(want.norm()), k
        assert [i is None for i in refresh["ids"]] == [False, False, True, True]
        assert all(i is not None for i in rollout["ids"]) and rollout["ids"][2:] == rollout["ids"][:2]
        torch.testing.assert_close(torch.tensor(rollout["losses"][:2]), torch.tensor(plain["losses"][:2]),
                                   rtol=1e-5, atol=1e-6)
        diff = max(float((torch.tensor(rollout["state"][k]) - torch.tensor(v)).abs().max())
                   for k, v in plain["state"].items())
        assert diff > 1e-3, diff  # the stale routing changed the second step
