"""One ReLibra training step of a tiny Megatron-core GPT MoE model on CPU, checked against Megatron's plain step.

The processes (``--world``, 2 by default) form Megatron's expert-parallel group (EP = DP = world, TP = PP = 1).
On every rank:

1. setup: build a 2-layer ``GPTModel`` (8 experts top-2, full activation recompute) and an identical plain
   copy, the reference; ``swap_moe_layers`` turns the policy's Megatron ``MoELayer`` s into relibra layers
   (Megatron's router, aux loss and process groups kept; one replica slot per rank);
2. record: a forward without gradients (as RL frameworks compute log-probabilities) under
   ``MegatronRoutingRecorder``, two micro-batches of sequences per rank; ``trace_batch()`` gathers every
   rank's routing into one ``TraceBatch``;
3. plan: ``plan_batch(..., "relibra", replica_slots=1)`` (expert placement, sample placement, replicas and
   token splits per micro-batch);
4. train: ``relayout`` moves the experts (with their Adam state) to the plan's homes; for each micro-batch,
   the rank runs the samples the plan puts on it: ``replay_data`` -> ``replay_micro_batch`` -> forward ->
   backward (the layers switch REPLAY_FORWARD / REPLAY_BACKWARD for the recompute themselves); then the
   dense gradients are averaged over the data-parallel ranks and Adam steps.

The reference runs the same samples on the same ranks through plain Megatron (its own token dispatcher and
experts, live routing). Checked: the losses, and every parameter after the step (experts gathered in logical
order), within fp32 tolerance; the replica slots computed tokens. Megatron's CUDA-only calls are replaced by
the test suite's CPU patches (``tests/megatron_cpu.py``); the library itself patches nothing.

Run: ``python examples/megatron_step.py --check`` (needs ``pip install 'relibra-moe[megatron]'``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
E, K, H, F, L, V, S, B = 8, 2, 32, 16, 2, 64, 8, 2  # experts, top-k, hidden, expert FFN, layers, vocab, seq, batch
PARAM_TOL = 1e-3  # parameters after one Adam step at lr 1e-2 (a sign flip of a ~0 gradient moves a weight by ~lr)


def gpt_model(config):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    spec = get_gpt_layer_local_spec(num_experts=E, moe_grouped_gemm=False)
    return GPTModel(config, spec, vocab_size=V, max_sequence_length=S, position_embedding_type="learned_absolute")


def gathered_experts(tensor: torch.Tensor, expert_ids) -> torch.Tensor:
    """Every rank's per-expert rows ``[E_loc, ...]`` -> ``[E, ...]`` in logical expert order."""
    world = dist.get_world_size()
    parts = [torch.empty_like(tensor) for _ in range(world)]
    dist.all_gather(parts, tensor.contiguous())
    ids = [torch.empty(len(expert_ids), dtype=torch.int64) for _ in range(world)]
    dist.all_gather(ids, torch.as_tensor(np.asarray(expert_ids), dtype=torch.int64))
    out = torch.empty((E,) + tuple(tensor.shape[1:]), dtype=tensor.dtype)
    out[torch.cat(ids)] = torch.cat(parts)
    return out


def step(rank: int, world: int, out_dir: str) -> None:
    sys.path.insert(0, str(ROOT / "tests"))
    import megatron_cpu as mc

    from relibra_moe.integrations import megatron as rm
    from relibra_moe.planners.strategies import plan_batch
    from relibra_moe.specs import ClusterSpec, ModelSpec

    mc.init_megatron(world)
    try:
        cfg = mc.moe_config(E, K, H, F, num_layers=L, recompute_granularity="full", recompute_method="uniform",
                            recompute_num_layers=1)
        torch.manual_seed(0)
        policy = gpt_model(cfg)
        with torch.no_grad():  # distinct weights for every global expert (Megatron seeds each rank alike)
            for moe in rm.megatron_moe_layers(policy):
                for i, e in enumerate(moe.local_expert_indices):
                    g = torch.Generator().manual_seed(100 * moe.layer_number + e)
                    for p in moe.experts.local_experts[i].parameters():
                        p.copy_(torch.randn(p.shape, generator=g) * 0.3)
        reference = gpt_model(cfg)
        reference.load_state_dict(policy.state_dict())
        ref_moe = rm.megatron_moe_layers(reference)

        # 1. setup (once)
        layers = rm.swap_moe_layers(policy, replica_slots=1, gpus_per_node=world)

        # 2. record: this rank's sequences, two micro-batches of a [B, S] batch each
        gen = torch.Generator().manual_seed(10 + rank)
        mine = [torch.randint(0, V, (B, S + 1), generator=gen) for _ in range(2)]  # tokens + next-token labels
        pos = torch.arange(S)[None]
        causal = torch.triu(torch.ones(1, 1, S, S), diagonal=1).bool()  # True = masked (Megatron's convention)
        with rm.MegatronRoutingRecorder(policy) as rec, torch.no_grad():
            for seqs in mine:
                policy(seqs[:, :-1], pos, causal)
                rec.record([S] * B, layout="sbh")
        batch = rec.trace_batch()
        every: list = [None] * world
        dist.all_gather_object(every, torch.cat(mine))  # the trainer's copy of every sample (rank-major)
        sequences = torch.cat(every)

        # 3. plan (every rank plans the same batch with the same seed: the same plan)
        plan = plan_batch(batch, ModelSpec("tiny-gpt", H, F, E, K, L), ClusterSpec(nodes=1, gpus_per_node=world),
                          "relibra", replica_slots=1, seed=0)

        # 4. train
        opt = torch.optim.Adam(policy.parameters(), lr=1e-2)
        opt_ref = torch.optim.Adam(reference.parameters(), lr=1e-2)
        moved = rm.relayout(policy, plan, opt)
        losses, ref_losses, replica_pairs = [], [], 0
        for m in range(plan.num_micro_batches):
            samples, ids = rm.replay_data(batch, plan, m, layout="sbh")
            if not len(samples):
                raise SystemExit(f"rank {rank} has no sample in micro-batch {m}: the example needs one per rank")
            seqs = sequences[torch.as_tensor(samples)]
            rm.replay_micro_batch(policy, ids, plan=plan, micro_batch=m)
            loss = policy(seqs[:, :-1], pos, causal, labels=seqs[:, 1:]).float().mean()
            loss.backward()
            losses.append(float(loss))
            replica_pairs += sum(int(layer.relibra.last_slot_counts[-1]) for layer in layers)

            loss_ref = reference(seqs[:, :-1], pos, causal, labels=seqs[:, 1:]).float().mean()
            loss_ref.backward()
            ref_losses.append(float(loss_ref))
        for model in (policy, reference):  # data-parallel mean of the dense grads; experts are complete at home
            for n, p in model.named_parameters():
                if ".experts." not in n:
                    dist.all_reduce(p.grad)
                    p.grad /= world

        def expert_diff(grad: bool) -> float:
            """Max abs difference of every expert's weights (``grad``: their gradients), gathered over the ranks."""
            def t(w: torch.Tensor) -> torch.Tensor:
                return (w.grad if grad else w).detach()

            worst = 0.0
            for layer, moe in zip(layers, ref_moe):
                home = layer.relibra.home_experts
                got1 = gathered_experts(t(layer.relibra.experts.w_gate_up).transpose(1, 2), home)
                got2 = gathered_experts(t(layer.relibra.experts.w_down).transpose(1, 2), home)
                want1 = gathered_experts(torch.stack([t(e.linear_fc1.weight) for e in moe.experts.local_experts]),
                                         moe.local_expert_indices)
                want2 = gathered_experts(torch.stack([t(e.linear_fc2.weight) for e in moe.experts.local_experts]),
                                         moe.local_expert_indices)
                worst = max(worst, float((got1 - want1).abs().max()), float((got2 - want2).abs().max()))
            return worst

        def dense_diff(grad: bool) -> float:
            ref = dict(reference.named_parameters())
            return max(float(((p.grad - ref[n].grad) if grad else (p - ref[n])).abs().max())
                       for n, p in policy.named_parameters() if ".experts." not in n)

        # the math: losses and gradients equal Megatron's; after Adam's first step (lr 1e-2) the parameters agree
        # to PARAM_TOL: Adam's normalised update turns rounding noise in near-zero gradients into update noise
        diffs = {"loss": max(abs(a - b) for a, b in zip(losses, ref_losses)),
                 "dense_grad": dense_diff(True), "experts_grad": expert_diff(True)}
        opt.step()
        opt_ref.step()
        params = {"dense": dense_diff(False), "experts": expert_diff(False)}
        pairs = torch.tensor([replica_pairs])
        dist.all_reduce(pairs)
        result = {"rank": rank, "losses": losses, "reference_losses": ref_losses, "max_abs_diff": diffs,
                  "max_abs_param_diff_after_adam": params,
                  "experts_moved": moved["experts_moved"], "replica_slot_pairs_all_ranks": int(pairs),
                  "samples_per_micro_batch": [int(((plan.samples.micro_batch == m) & (plan.samples.gpu == rank)).sum())
                                              for m in range(plan.num_micro_batches)]}
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(result, f)
    finally:
        mc.destroy_megatron()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=2, help="processes (the expert-parallel group)")
    ap.add_argument("--check", action="store_true", help="exit non-zero unless the step equals Megatron's")
    ap.add_argument("--tol", type=float, default=1e-4, help="max abs difference allowed by --check")
    args = ap.parse_args(argv)
    os.environ.setdefault("TRITON_INTERPRET", "1")  # relibra's Triton kernels run in the CPU interpreter
    from relibra_moe.layers.testing import run_group

    with tempfile.TemporaryDirectory(prefix="relibra_megatron_") as d:
        run_group(step, args.world, d, timeout_s=300)
        results = [json.loads(Path(d, f"rank{r}.json").read_text()) for r in range(args.world)]
    print(json.dumps(results, indent=1))
    worst = max(v for r in results for v in r["max_abs_diff"].values())
    worst_param = max(v for r in results for v in r["max_abs_param_diff_after_adam"].values())
    ok = worst <= args.tol and worst_param <= PARAM_TOL and results[0]["replica_slot_pairs_all_ranks"] > 0
    print(f"max abs difference vs Megatron's plain step: loss and gradients {worst:.2e}, parameters after Adam "
          f"{worst_param:.2e} ({'ok' if ok else 'FAILED'})")
    return 0 if ok or not args.check else 1


if __name__ == "__main__":
    sys.exit(main())
