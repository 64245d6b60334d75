"""A 2-layer Megatron GPTModel trained through relibra (swap, relayout, replay) against plain Megatron.

One training step, two micro-batches, full activation recompute, on gloo: the relibra model (experts
moved to a random placement, a hot expert per layer and micro-batch replicated with a 60/40 token split,
REPLAY_FORWARD / REPLAY_BACKWARD switched by the layers) gives the losses, gradients and Adam-updated
weights of the plain Megatron model replaying the same routing with the actions switched by hand.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from megatron_cpu import HAVE_MEGATRON, MEGATRON_REASON

pytestmark = pytest.mark.skipif(not HAVE_MEGATRON, reason=MEGATRON_REASON)

E, K, H, F, L, V, S = 8, 2, 32, 16, 2, 64, 8


def two_micro_batch_plan(num_gpus: int, gpus_per_node: int, seed: int):
    """A random balanced placement per layer; in each of 2 micro-batches a random hot expert per layer is
    replicated on its home's partner rank (home ^ 1), every source sending it 60% home and 40% there.
    Sample ``m * G + g`` runs on GPU g in micro-batch m."""
    from relibra_moe.plan import BatchPlan, Placement, ReplicaPlan, SamplePlacement

    G, M = num_gpus, 2
    rng = np.random.default_rng(seed)
    eg = np.stack([rng.permutation(np.arange(E) // (E // G)) for _ in range(L)])
    rep = np.full((M, L, G, 1), -1, np.int32)
    idx, share = [], []
    for m in range(M):
        for l in range(L):
            e = int(rng.integers(E))
            home = int(eg[l, e])
            rep[m, l, home ^ 1, 0] = e
            for j in range(G):
                idx += [(m, l, j, e, home), (m, l, j, e, home ^ 1)]
                share += [0.6, 0.4]
    samples = SamplePlacement(np.repeat(np.arange(M), G), np.tile(np.arange(G), M), M)
    return BatchPlan(Placement(eg), samples, ReplicaPlan(rep, np.array(idx), np.array(share), "node"),
                     num_gpus=G, gpus_per_node=gpus_per_node)


def gpt_model(config):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    spec = get_gpt_layer_local_spec(num_experts=E, moe_grouped_gemm=False)
    return GPTModel(config, spec, vocab_size=V, max_sequence_length=S, position_embedding_type="learned_absolute")


def _gpt_step(rank: int, world: int, gpus_per_node: int, seed: int) -> None:
    import megatron_cpu as mc
    import torch.distributed as dist
    from megatron.core.transformer.moe.router_replay import RouterReplayAction
    from test_megatron_layer import global_expert_grads, random_ids

    from relibra_moe.integrations import megatron as rm

    mc.init_megatron(world)
    try:
        cfg = mc.moe_config(E, K, H, F, num_layers=L, recompute_granularity="full", recompute_method="uniform",
                            recompute_num_layers=1)
        torch.manual_seed(0)
        ref = gpt_model(cfg)
        with torch.no_grad():  # distinct weights for every global expert
            for moe in rm.megatron_moe_layers(ref):
                for i, e in enumerate(moe.local_expert_indices):
                    g = torch.Generator().manual_seed(1000 * (moe.layer_number + seed) + e)
                    for p in moe.experts.local_experts[i].parameters():
                        p.copy_(torch.randn(p.shape, generator=g) * 0.3)
        model = gpt_model(cfg)
        model.load_state_dict(ref.state_dict())
        layers = rm.swap_moe_layers(model, replica_slots=1, gpus_per_node=gpus_per_node)
        assert [type(lay.router).__name__ for lay in layers] == ["TopKRouter"] * L
        plan = two_micro_batch_plan(world, gpus_per_node, seed)
        opt_ref = torch.optim.Adam(ref.parameters(), lr=1e-2)
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        moved = rm.relayout(model, plan, opt)
        assert moved["experts_moved"] > 0

        gen = torch.Generator().manual_seed(seed * 100 + rank)
        tokens = [torch.randint(0, V, (1, S), generator=gen) for _ in range(2)]
        labels = [torch.randint(0, V, (1, S), generator=gen) for _ in range(2)]
        pos = torch.arange(S)[None]
        causal = torch.triu(torch.ones(1, 1, S, S), diagonal=1).bool()  # True = masked (Megatron)
        ids = [[random_ids(S, seed * 1000 + 10 * rank + 2 * m + l) for l in range(L)] for m in range(2)]

        ref_routers = [moe.router.router_replay for moe in rm.megatron_moe_layers(ref)]
        ref_losses, losses = [], []
        for m in range(2):
            for rr, t in zip(ref_routers, ids[m]):
                rr.set_target_indices(t)
                rr.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
            loss = ref(tokens[m], pos, causal, labels=labels[m]).float().mean()
            for rr in ref_routers:  # Megatron never switches it itself; the recompute pops in forward order
                rr.set_router_replay_action(RouterReplayAction.REPLAY_BACKWARD)
            loss.backward()
            ref_losses.append(loss.detach())

            rm.replay_micro_batch(model, ids[m], plan=plan, micro_batch=m)
            loss = model(tokens[m], pos, causal, labels=labels[m]).float().mean()
            loss.backward()
            losses.append(loss.detach())
        torch.testing.assert_close(torch.stack(losses), torch.stack(ref_losses), rtol=1e-5, atol=1e-6)
        for layer in layers:  # every queued recompute was consumed
            assert not layer._recompute and not layer.router.router_replay.replay_backward_list

        expert_names = ("relibra.experts.",)
        dense = {n: p for n, p in model.named_parameters() if not any(s in n for s in expert_names)}
        dense_ref = {n: p for n, p in ref.named_parameters() if ".experts." not in n}
        assert sorted(dense) == sorted(dense_ref)
        for n in dense:
            torch.testing.assert_close(dense[n].grad, dense_ref[n].grad, rtol=1e-4, atol=1e-5, msg=n)
        for layer, moe in zip(layers, rm.megatron_moe_layers(ref)):
            fc1 = torch.stack([e.linear_fc1.weight.grad for e in moe.experts.local_experts])
            got = global_expert_grads(layer.relibra.experts.w_gate_up.grad.transpose(1, 2), layer.relibra.home_experts)
            torch.testing.assert_close(got, global_expert_grads(fc1, moe.local_expert_indices), rtol=1e-4, atol=1e-5)
            slot = torch.tensor([int(layer.relibra.last_slot_counts[-1])])
            dist.all_reduce(slot)
            assert int(slot) > 0  # the replica slot computed pairs in the last micro-batch

        # the step: data-parallel mean of the dense grads (experts are sharded: complete at home), Adam
        for p in list(dense.values()) + list(dense_ref.values()):
            dist.all_reduce(p.grad)
            p.grad /= world
        opt.step()
        opt_ref.step()
        for n in dense:
            torch.testing.assert_close(dense[n], dense_ref[n], rtol=1e-4, atol=1e-5, msg=n)
        for layer, moe in zip(layers, rm.megatron_moe_layers(ref)):
            fc2 = torch.stack([e.linear_fc2.weight for e in moe.experts.local_experts]).detach()
            got = global_expert_grads(layer.relibra.experts.w_down.detach().transpose(1, 2), layer.relibra.home_experts)
            torch.testing.assert_close(got, global_expert_grads(fc2, moe.local_expert_indices), rtol=1e-4, atol=1e-5)
        # expert_state_dict gives the experts back in Megatron's layout
        sd = rm.expert_state_dict(layers[0])
        e0 = int(sd["global_expert_ids"][0])
        assert torch.equal(sd["local_experts.0.linear_fc2.weight"],
                           layers[0].relibra.experts.w_down[0].detach().t())
        assert e0 == int(layers[0].relibra.home_experts[0])
    finally:
        mc.destroy_megatron()


@pytest.mark.slow
def test_gpt_model_step_with_recompute_matches_megatron():
    from relibra_moe.layers.testing import run_group

    run_group(_gpt_step, 2, 2, 5, timeout_s=240)
