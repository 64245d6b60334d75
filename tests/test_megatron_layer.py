"""RelibraMoELayer against Megatron-core's own MoELayer (fp32, gloo, 2 and 4 processes).

On the same replayed routing (Megatron's RouterReplay), the relibra-backed layer, with a random expert
placement and a replica plan that splits a hot expert's tokens between its home and a replica, gives
Megatron's outputs and gradients: input, router (with its aux loss), shared expert and every expert.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from megatron_cpu import HAVE_MEGATRON, MEGATRON_REASON

pytestmark = pytest.mark.skipif(not HAVE_MEGATRON, reason=MEGATRON_REASON)

E, K, H, F, S, B = 8, 2, 32, 16, 6, 2


def seed_experts(moe, seed: int) -> None:
    """Distinct weights for every global expert (Megatron seeds each rank alike)."""
    with torch.no_grad():
        for i, e in enumerate(moe.local_expert_indices):
            g = torch.Generator().manual_seed(seed * 1000 + e)
            for p in moe.experts.local_experts[i].parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)


def random_ids(T: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]).long()


def global_expert_grads(local: torch.Tensor, expert_ids) -> torch.Tensor:
    """All ranks' per-expert tensors ``[E_loc, ...]`` -> ``[E, ...]`` in logical expert order."""
    import torch.distributed as dist

    G = dist.get_world_size()
    parts = [torch.empty_like(local) for _ in range(G)]
    dist.all_gather(parts, local.contiguous())
    ids = [torch.empty(len(expert_ids), dtype=torch.int64) for _ in range(G)]
    dist.all_gather(ids, torch.as_tensor(np.asarray(expert_ids), dtype=torch.int64))
    out = torch.empty((E,) + tuple(local.shape[1:]), dtype=local.dtype)
    out[torch.cat(ids)] = torch.cat(parts)
    return out


def _layer_vs_megatron(rank: int, world: int, gpus_per_node: int, seed: int, recompute: bool) -> None:
    import megatron_cpu as mc
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    from relibra_moe.integrations import megatron as rm
    from relibra_moe.layers.replica_buffer import LayerSharedReplicaBuffer
    from relibra_moe.layers.testing import hot_replica_plan

    mc.init_megatron(world)
    try:
        extra = dict(recompute_granularity="selective", recompute_modules=["moe"]) if recompute else {}
        cfg = mc.moe_config(E, K, H, F, shared=F, **extra)
        torch.manual_seed(0)
        ref = mc.moe_layer(cfg)
        seed_experts(ref, seed)
        twin = mc.moe_layer(cfg)
        twin.load_state_dict(ref.state_dict())
        buf = LayerSharedReplicaBuffer(H, F, 1)
        layer = rm.RelibraMoELayer(twin, gpus_per_node=gpus_per_node, replica_buffer=buf, layer_index=0)
        hot = np.array([np.random.default_rng(seed).integers(E)])
        plan = hot_replica_plan(1, E, world, gpus_per_node, hot, seed)
        rm.relayout(layer, plan)
        assert layer.relibra.expert_gpu_host.tolist() == plan.placement.expert_gpu[0].tolist()

        gen = torch.Generator().manual_seed(seed * 10 + rank)
        x = torch.randn(S, B, H, generator=gen)
        w = torch.randn(S, B, H, generator=gen)
        ids = random_ids(S * B, seed * 10 + rank)

        x_ref = x.clone().requires_grad_(True)
        rr = ref.router.router_replay
        rr.set_target_indices(ids)
        rr.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
        out_ref, bias = ref(x_ref)
        if recompute:  # Megatron never switches it itself; the relibra layer does
            rr.set_router_replay_action(RouterReplayAction.REPLAY_BACKWARD)
        (out_ref * w).sum().backward()

        x_rl = x.clone().requires_grad_(True)
        rm.replay_micro_batch(layer, [ids], plan=plan, micro_batch=0)
        out, bias_rl = layer(x_rl)
        assert layer.moe_layer_recompute == recompute and len(layer._recompute) == int(recompute)
        (out * w).sum().backward()
        assert not layer._recompute and not layer.router.router_replay.replay_backward_list

        assert bias is None and bias_rl is None
        torch.testing.assert_close(out, out_ref, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(x_rl.grad, x_ref.grad, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(layer.router.weight.grad, ref.router.weight.grad, rtol=1e-5, atol=1e-5)
        for (n, p), (_, q) in zip(layer.shared_experts.named_parameters(), ref.shared_experts.named_parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-5, msg=n)
        fc1 = torch.stack([e.linear_fc1.weight.grad for e in ref.experts.local_experts])  # [E_loc, 2F, H]
        fc2 = torch.stack([e.linear_fc2.weight.grad for e in ref.experts.local_experts])  # [E_loc, H, F]
        ref_g1 = global_expert_grads(fc1, ref.local_expert_indices)
        ref_g2 = global_expert_grads(fc2, ref.local_expert_indices)
        home = layer.relibra.home_experts
        ex = layer.relibra.experts
        got_g1 = global_expert_grads(ex.w_gate_up.grad.transpose(1, 2), home)
        got_g2 = global_expert_grads(ex.w_down.grad.transpose(1, 2), home)
        torch.testing.assert_close(got_g1, ref_g1, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got_g2, ref_g2, rtol=1e-5, atol=1e-5)
        # the plan was followed: the hot expert's replica slot computed pairs on its partner rank
        import torch.distributed as dist

        slot = torch.tensor([int(layer.relibra.last_slot_counts[-1])])
        dist.all_reduce(slot)
        assert int(slot) > 0
        # routing was the replayed one
        assert torch.equal(layer.relibra.last_routing.sort(dim=1).values, ids.sort(dim=1).values)
    finally:
        mc.destroy_megatron()


def test_layer_matches_megatron_moe_layer_2_ranks():
    from relibra_moe.layers.testing import run_group

    run_group(_layer_vs_megatron, 2, 2, 1, False, timeout_s=120)


@pytest.mark.slow
def test_layer_matches_megatron_moe_layer_4_ranks_2_nodes_moe_recompute():
    """4 ranks as 2 nodes x 2, with Megatron's selective recompute of the MoE layer."""
    from relibra_moe.layers.testing import run_group

    run_group(_layer_vs_megatron, 4, 2, 3, True, timeout_s=180)
