"""Megatron capture and replay: recorded -> planned -> replayed round trip, and bad input (gloo, 2 ranks).

The round trip runs a per-token model (two swapped Megatron MoE layers with residuals, no attention), so
a token's live routing does not depend on which micro-batch or rank it runs in: each sample's outputs
after planning (new expert homes, replicas, samples moved to other ranks and micro-batches) must equal
its outputs at recording time, and the replayed routing must be the recorded one.

MegatronReplayMoE against Megatron-core's own MoELayer (fp32, gloo, 2 and 4 processes).

On the same replayed routing (Megatron's RouterReplay), the relibra-backed layer, with a random expert
placement and a replica plan that splits a hot expert's tokens between its home and a replica, gives
Megatron's outputs and gradients: input, router (with its aux loss), shared expert and every expert.

A 2-layer Megatron GPTModel trained through relibra (swap, relayout, replay) against plain Megatron.

One training step, two micro-batches, full activation recompute, on gloo: the relibra model (experts
moved to a random placement, a hot expert per layer and micro-batch replicated with a 60/40 token split,
REPLAY_FORWARD / REPLAY_BACKWARD switched by the layers) gives the losses, gradients and Adam-updated
weights of the plain Megatron model replaying the same routing with the actions switched by hand.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from tests.megatron_cpu import HAVE_MEGATRON, MEGATRON_REASON

pytestmark = pytest.mark.skipif(not HAVE_MEGATRON, reason=MEGATRON_REASON)

E, K, H, F = 8, 2, 32, 16
LENGTHS = [[[3, 5], [4]], [[2], [6, 1]]]  # rank -> micro-batch -> sequence lengths


class TwoMoE(nn.Module):
    """``x [T, 1, H]`` -> ``x + moe0(x)`` -> ``h + moe1(h)``: per-token, two MoE layers."""

    def __init__(self, layers):
        super().__init__()
        self.layers = nn.ModuleList(layers)

    def forward(self, x):
        for layer in self.layers:
            x = x + layer(x)[0]
        return x


def sample_input(i: int, n: int) -> torch.Tensor:
    return torch.randn(n, 1, H, generator=torch.Generator().manual_seed(500 + i))


def build(seed: int = 0, **cfg_overrides):
    from relibra_moe.integrations import megatron as rm
    from tests import megatron_cpu as mc

    cfg = mc.moe_config(E, K, H, F, num_layers=2, **cfg_overrides)
    torch.manual_seed(seed)
    model = TwoMoE([mc.moe_layer(cfg, layer_number=1), mc.moe_layer(cfg, layer_number=2)])
    with torch.no_grad():  # distinct weights for every global expert (Megatron seeds each rank alike)
        for moe in model.layers:
            for i, e in enumerate(moe.local_expert_indices):
                g = torch.Generator().manual_seed(100 * moe.layer_number + e)
                for p in moe.experts.local_experts[i].parameters():
                    p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return model, rm


def _round_trip(rank: int, world: int) -> None:
    import torch.distributed as dist

    from relibra_moe.planners.strategies import plan_batch
    from relibra_moe.specs import ClusterSpec, ModelSpec
    from tests import megatron_cpu as mc

    mc.init_megatron(world)
    try:
        model, rm = build()
        rm.swap_moe_layers(model, replica_slots=1)
        # 1. record: this rank's micro-batches, sequences packed
        offset = sum(len(s) for mb in LENGTHS[:rank] for s in mb)
        recorded_out = {}
        with rm.MegatronRoutingRecorder(model) as rec, torch.no_grad():
            i = offset
            for mb in LENGTHS[rank]:
                x = torch.cat([sample_input(i + j, n) for j, n in enumerate(mb)])
                y = model(x)
                # independent check of layer 0's recording: top-k of the router's softmax on its input
                w = model.layers[0].router.weight
                want = torch.topk(torch.softmax(x[:, 0] @ w.t(), dim=-1), K).indices.sort(dim=1).values
                got = model.layers[0].router.router_replay.get_recorded_indices().sort(dim=1).values
                assert torch.equal(got, want)
                rec.record(mb)
                lo = 0
                for j, n in enumerate(mb):
                    recorded_out[i + j] = y[lo:lo + n]
                    lo += n
                i += len(mb)
        batch = rec.trace_batch()
        N = sum(len(mb) for r in LENGTHS for mb in r)
        assert batch.num_sequences == N and batch.num_layers == 2
        assert batch.layer_ids.tolist() == [0, 1]
        assert batch.lengths.tolist() == [n for r in LENGTHS for mb in r for n in mb]
        outs: list = [None] * world
        dist.all_gather_object(outs, recorded_out)
        recorded_out = {k: v for d in outs for k, v in d.items()}

        # 2. plan (every rank plans the same batch with the same seed: the same plan)
        spec = ModelSpec("tiny", H, F, E, K, 2)
        plan = plan_batch(batch.with_micro_batch_size(2), spec, ClusterSpec(nodes=1, gpus_per_node=world),
                          "relibra", replica_slots=1, seed=0)
        rm.relayout(model, plan)

        # 3. replay every micro-batch in the plan's sample placement; with the batch, each call builds the next
        # micro-batch's schedules in the background thread, and the next call takes them
        seen = []
        M = plan.num_micro_batches
        real_take, taken = rm._take_ahead, []
        rm._take_ahead = lambda *a: taken.append(real_take(*a)) or taken[-1]
        for m in range(M):
            samples, ids = rm.replay_data(batch, plan, m)
            seen += samples.tolist()
            if not len(samples):
                x = torch.zeros(0, 1, H)
            else:
                x = torch.cat([sample_input(int(i), int(batch.lengths[i])) for i in samples])
            if m == M - 1 and m > 0:  # verl-style: the framework hands Megatron the replay data, relibra the plan
                from megatron.core.transformer.moe.router_replay import RouterReplay

                RouterReplay.set_replay_data(ids)
                rm.replay_micro_batch(model, None, plan=plan, micro_batch=m)
            else:
                rm.replay_micro_batch(model, ids, plan=plan, micro_batch=m, batch=batch)
            with torch.no_grad():
                y = model(x)
            for layer, t in zip(model.layers, ids):
                assert torch.equal(layer.relibra.last_routing.sort(dim=1).values, t.sort(dim=1).values)
            lo = 0
            for i in samples:
                n = int(batch.lengths[i])
                torch.testing.assert_close(y[lo:lo + n], recorded_out[int(i)], rtol=1e-5, atol=1e-5)
                lo += n
        rm._take_ahead = real_take
        assert [t is not None for t in taken] == [False] + [True] * max(M - 2, 0), (M, taken)
        everyone: list = [None] * world
        dist.all_gather_object(everyone, seen)
        assert sorted(s for p in everyone for s in p) == list(range(N))  # every sample ran exactly once
        rm.stop_replay(model)
    finally:
        mc.destroy_megatron()


def test_recorded_planned_replayed_round_trip():
    from relibra_moe.layers.testing import run_group

    run_group(_round_trip, 2, timeout_s=180)


def _bad_input(rank: int, world: int) -> None:
    from relibra_moe.errors import PlanError, ReplayError
    from relibra_moe.layers.testing import hot_replica_plan
    from tests import megatron_cpu as mc

    mc.init_megatron(world)
    try:
        model, rm = build()
        rm.swap_moe_layers(model)
        T = 5
        x = torch.randn(T, 1, H)
        ok = [torch.stack([torch.randperm(E)[:K] for _ in range(T)]) for _ in range(2)]

        # a plan for another expert count / EP size / number of layers
        # (found by replay_micro_batch, raised by the next forward on every rank: it may be bad on one rank only)
        for plan, setting in ((hot_replica_plan(2, 16, world, world, np.zeros(2, int), 0), "num_moe_experts=8"),
                              (hot_replica_plan(2, E, 4, 4, np.zeros(2, int), 0), "expert_model_parallel_size=2"),
                              (hot_replica_plan(1, E, world, world, np.zeros(1, int), 0), "has 2")):
            rm.replay_micro_batch(model, ok, plan=plan, micro_batch=0)
            with pytest.raises(PlanError, match=f"rank 0 of the EP group rejected its plan: .*{setting}"):
                model(x)
            rm.stop_replay(model)
            with pytest.raises(PlanError, match=setting):
                rm.relayout(model, plan)
        # replay data for the wrong number of layers
        rm.replay_micro_batch(model, ok[:1])
        with pytest.raises(ReplayError, match="rank 0 of the EP group rejected its replay data: replay data covers 1 "
                                              "MoE layers, the model has 2"):
            model(x)
        rm.stop_replay(model)
        # ... on rank 1 only: rank 0 raises the same error, from the same forward
        rm.replay_micro_batch(model, ok[:1] if rank == 1 else ok)
        with pytest.raises(ReplayError, match="rank 1 of the EP group rejected its replay data: replay data covers 1 "
                                              "MoE layers"):
            model(x)
        rm.stop_replay(model)
        # a plan on rank 0 only (new homes, no replicas): the plan-slice digests differ, a PlanError on every rank
        from relibra_moe.plan import BatchPlan, ReplicaPlan

        hot = hot_replica_plan(2, E, world, world, np.zeros(2, int), 0)
        plan = BatchPlan(hot.placement, hot.samples, ReplicaPlan.empty(1, 2, world, 0), world, world)
        rm.relayout(model, plan)
        rm.replay_micro_batch(model, ok, plan=plan if rank == 0 else None, micro_batch=0)
        with pytest.raises(PlanError, match="follow different plan slices: rank 0 follows micro-batch 0 of layer 0 of "
                                            "its plan .* rank 1 follows no plan"):
            model(x)
        rm.stop_replay(model)
        rm.relayout(model, np.arange(E)[None].repeat(2, 0) // (E // world))  # back to the default homes
        # the wrong number of tokens on one rank only: every rank raises, nobody hangs
        bad = [t if rank == 0 else torch.cat([t, t[:1]]) for t in ok]
        rm.replay_micro_batch(model, bad)
        with pytest.raises(ReplayError, match="6 tokens, the batch has 5" if rank == 1 else "rank 1"):
            model(x)
        # -1 (no expert) has no meaning for Megatron's RouterReplay
        rm.replay_micro_batch(model, [torch.full((T, K), -1)] * 2)
        with pytest.raises(ReplayError, match="no padding id"):
            model(x)
        rm.stop_replay(model)
        # replay switched on without data
        rm.replay_micro_batch(model, None)
        with pytest.raises(ReplayError, match="no replay data was set"):
            model(x)
        rm.stop_replay(model)
        model(x)  # live routing works again after the errors

        # relayout refuses an optimizer that does not step the expert parameters; moves main_grad buffers
        with pytest.raises(ValueError, match="does not step the expert parameters"):
            rm.relayout(model, hot_replica_plan(2, E, world, world, np.zeros(2, int), 0),
                        torch.optim.Adam([nn.Parameter(torch.zeros(1))]))
        experts = [layer.relibra.experts for layer in model.layers]
        for ex in experts:
            for p in ex.parameters():
                p.main_grad = p.detach() * 2 + 1
        plan = hot_replica_plan(2, E, world, world, np.zeros(2, int), 1)
        assert rm.relayout(model, plan)["experts_moved"] > 0
        for layer, ex in zip(model.layers, experts):
            want = plan.placement.expert_gpu[layer.relibra.layer_index].tolist()
            assert layer.relibra.expert_gpu_host.tolist() == want
            for p in ex.parameters():
                assert p.grad is None
                torch.testing.assert_close(p.main_grad, p.detach() * 2 + 1)

        # a Megatron optimizer wrapper (FP32Optimizer-style: .optimizer steps the parameters themselves)
        class Wrapper:
            def __init__(self, optimizer):
                self.optimizer = optimizer

        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        for p in model.parameters():
            p.grad = torch.ones_like(p)
        opt.step()
        for ex in experts:
            for p in ex.parameters():
                opt.state[p]["exp_avg"].copy_(p.detach() * 5)
                p.grad.copy_(p.detach() - 1)
                p.main_grad.copy_(p.detach() * 2 + 1)  # a separate buffer: moves besides .grad
        plan = hot_replica_plan(2, E, world, world, np.zeros(2, int), 2)
        assert rm.relayout(model, plan, Wrapper(opt))["experts_moved"] > 0
        for ex in experts:
            for p in ex.parameters():
                torch.testing.assert_close(opt.state[p]["exp_avg"], p.detach() * 5)
                torch.testing.assert_close(p.grad, p.detach() - 1)
                torch.testing.assert_close(p.main_grad, p.detach() * 2 + 1)

        # relayout refuses Megatron's optimizers that step fp32 main copies, by name (they need CUDA: a stand-in)
        class DistributedOptimizer:
            def __init__(self, optimizer):
                self.optimizer = optimizer

        with pytest.raises(ValueError, match="relayout does not support Megatron's DistributedOptimizer"):
            rm.relayout(model, plan, DistributedOptimizer(opt))
        # replica slots over the ceiling E - E/G (the Planner's check)
        with pytest.raises(PlanError, match=r"replica_slots=5 is over the ceiling E - E/G = 4 \(E=8, G=2"):
            rm.swap_moe_layers(build()[0], replica_slots=5)

        # fused router (replay bypassed) and routing replay off: named settings
        from tests import megatron_cpu as mc2

        cfg = mc2.moe_config(E, K, H, F)
        moe = mc2.moe_layer(cfg)
        cfg.moe_router_fusion = True
        with pytest.raises(ReplayError, match="moe_router_fusion=True"):
            rm.MegatronReplayMoE(moe)
        cfg.moe_router_fusion = False
        cfg.moe_enable_routing_replay = False
        with pytest.raises(ReplayError, match="moe_enable_routing_replay=False"):
            rm.MegatronReplayMoE(moe)
        cfg.moe_enable_routing_replay = True
        cfg.moe_expert_capacity_factor = 1.0
        with pytest.raises(ValueError, match="moe_expert_capacity_factor=1.0"):
            rm.MegatronReplayMoE(moe)
    finally:
        mc.destroy_megatron()


def test_bad_input_names_the_setting():
    from relibra_moe.layers.testing import run_group

    run_group(_bad_input, 2, timeout_s=180)


def test_swap_without_megatron_layers_is_an_error():
    from relibra_moe.integrations import megatron as rm

    with pytest.raises(ValueError, match="no megatron.core MoELayer"):
        rm.swap_moe_layers(nn.Linear(2, 2))
    with pytest.raises(ValueError, match="swap_moe_layers"):
        rm.replay_micro_batch(nn.Linear(2, 2), None)



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


def _layer_vs_megatron(rank: int, world: int, gpus_per_node: int, seed: int, recompute: bool,
                       resident: bool = False) -> None:
    """``resident``: the plan's replicas as a resident plan of 2 micro-batches (the same data twice, each
    micro-batch's backward after its forward, on both sides): each layer's own slots filled once, gradients
    returned once."""
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    from relibra_moe.integrations import megatron as rm
    from relibra_moe.layers.replica_buffer import LayerSharedReplicaBuffer
    from relibra_moe.layers.testing import hot_replica_plan
    from relibra_moe.plan import BatchPlan, ReplicaPlan, SamplePlacement
    from tests import megatron_cpu as mc

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
        layer = rm.MegatronReplayMoE(twin, gpus_per_node=gpus_per_node, replica_buffer=buf, layer_index=0)
        hot = np.array([np.random.default_rng(seed).integers(E)])
        plan = hot_replica_plan(1, E, world, gpus_per_node, hot, seed)
        rm.relayout(layer, plan)
        M = 2 if resident else 1
        replicas = plan
        if resident:
            r = plan.replicas
            replicas = BatchPlan(plan.placement, SamplePlacement(np.repeat(np.arange(M), world),
                                                                 np.tile(np.arange(world), M), M),
                                 ReplicaPlan(np.repeat(r.replica_expert, M, axis=0), np.concatenate(
                                     [r.split_index, r.split_index + [1, 0, 0, 0, 0]]), np.tile(r.split_share, M),
                                     r.scope), num_gpus=world, gpus_per_node=gpus_per_node)
            assert replicas.replicas.resident
        assert layer.relibra.expert_gpu_host.tolist() == plan.placement.expert_gpu[0].tolist()

        gen = torch.Generator().manual_seed(seed * 10 + rank)
        x = torch.randn(S, B, H, generator=gen)
        w = torch.randn(S, B, H, generator=gen)
        ids = random_ids(S * B, seed * 10 + rank)

        x_ref = x.clone().requires_grad_(True)
        rr = ref.router.router_replay
        for _ in range(M):
            rr.set_target_indices(ids)
            rr.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
            out_ref, bias = ref(x_ref)
            if recompute:  # Megatron never switches it itself; the relibra layer does
                rr.set_router_replay_action(RouterReplayAction.REPLAY_BACKWARD)
            (out_ref * w).sum().backward()

        x_rl = x.clone().requires_grad_(True)
        for m in range(M):
            rm.replay_micro_batch(layer, [ids], plan=replicas, micro_batch=m)
            out, bias_rl = layer(x_rl)
            assert layer.moe_layer_recompute == recompute and len(layer._recompute) == int(recompute)
            (out * w).sum().backward()
            assert not layer._recompute and not layer.router.router_replay.replay_backward_list
        if resident:
            res = layer.relibra.resident_replicas
            assert (res.buffer.fills, res.returns, buf.fills) == (1, 1, 0)

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


def test_layer_with_a_resident_plan_matches_megatron_moe_layer_2_ranks_moe_recompute():
    """A resident plan of 2 micro-batches under Megatron's selective recompute of the MoE layer: the recompute
    neither refills the slots nor counts a micro-batch twice."""
    from relibra_moe.layers.testing import run_group

    run_group(_layer_vs_megatron, 2, 2, 1, True, True, timeout_s=120)


@pytest.mark.slow
def test_layer_matches_megatron_moe_layer_4_ranks_2_nodes_moe_recompute():
    """4 ranks as 2 nodes x 2, with Megatron's selective recompute of the MoE layer."""
    from relibra_moe.layers.testing import run_group

    run_group(_layer_vs_megatron, 4, 2, 3, True, timeout_s=180)



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
    import torch.distributed as dist
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    from relibra_moe.integrations import megatron as rm
    from tests import megatron_cpu as mc

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


# ---------------------------------------------------------------------------------------------- checkpoints


def expert_truth(layer_number: int, e: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Expert ``e`` of MoE layer ``layer_number``:
    Megatron's ``linear_fc1.weight [2F, H]``, ``linear_fc2.weight [H, F]``."""
    g = torch.Generator().manual_seed(100 * layer_number + e)
    return torch.randn(2 * F, H, generator=g) * 0.3, torch.randn(H, F, generator=g) * 0.3


def held_experts(model, optimizer=None) -> dict:
    """``{(layer_number, e): (fc1, fc2)}`` of this rank's experts in Megatron's layout (relibra or plain layers);
    with ``optimizer`` (a torch optimizer) their ``exp_avg`` instead of the weights."""
    from relibra_moe.integrations import megatron as rm

    def t(p: torch.Tensor) -> torch.Tensor:
        return (optimizer.state[p]["exp_avg"] if optimizer is not None else p).detach()

    out = {}
    for moe in rm.megatron_moe_layers(model):
        if isinstance(moe, rm.MegatronReplayMoE):
            ex = moe.relibra.experts
            for i, e in enumerate(moe.relibra.home_experts.tolist()):
                out[(moe.layer_number, e)] = (t(ex.w_gate_up)[i].t(), t(ex.w_down)[i].t())
        else:
            for i, e in enumerate(moe.local_expert_indices):
                m = moe.experts.local_experts[i]
                out[(moe.layer_number, e)] = (t(m.linear_fc1.weight), t(m.linear_fc2.weight))
    return out


def assert_restored(model, what: str, optimizer=None, scale: float = 1.0) -> None:
    """Every expert this rank holds equals its truth (``scale`` x: Adam's exp_avg of grad 2 w is 0.2 w), and the
    ranks together hold all 16 (layer, expert) pairs."""
    import torch.distributed as dist

    held = held_experts(model, optimizer)
    for (layer, e), (fc1, fc2) in held.items():
        want1, want2 = expert_truth(layer, e)
        torch.testing.assert_close(fc1, want1 * scale, msg=f"{what}: layer {layer} expert {e} linear_fc1")
        torch.testing.assert_close(fc2, want2 * scale, msg=f"{what}: layer {layer} expert {e} linear_fc2")
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, sorted(held))
    assert sorted(set().union(*map(set, every))) == [(l, e) for l in (1, 2) for e in range(E)], what


def fresh_gpt(cfg, seed: int, relibra: bool, replica_slots: int = 0):
    """A GPT model whose experts are zero (and dense weights from ``seed``): nothing to find but what is loaded."""
    from relibra_moe.integrations import megatron as rm

    torch.manual_seed(seed)
    model = gpt_model(cfg)
    with torch.no_grad():
        for moe in rm.megatron_moe_layers(model):
            for p in moe.experts.parameters():
                p.zero_()
    if relibra:
        rm.swap_moe_layers(model, replica_slots=replica_slots)
    return model


def adam_with_state(model, mc):
    """The optimizer Megatron's get_megatron_optimizer builds for fp32 without the distributed optimizer: a
    ChainedOptimizer of FP32Optimizers over Adam, one for the dense parameters and one for the experts, after one
    step (lr 0: the weights stay) on grads 2 w: exp_avg = 0.2 w. Returns (the experts' Adam, the chained optimizer).
    (Megatron groups by ``allreduce``, which is True for experts at EP 1: its chain then differs between EP 2 and
    EP 1; grouping by name keeps one chain, so the state can be checked across EP sizes.)"""
    from megatron.core.optimizer.optimizer import ChainedOptimizer

    adams = [torch.optim.Adam([{"params": [p for n, p in model.named_parameters() if (".experts." in n) == expert],
                                "wd_mult": 1.0, "lr_mult": 1.0, "is_expert_parallel": expert,
                                "is_decoupled_lr": False}], lr=0.0)
             for expert in (False, True)]
    for p in model.parameters():
        p.grad = 2 * p.detach()
    for adam in adams:
        adam.step()
    return adams[1], ChainedOptimizer([mc.fp32_optimizer(adam) for adam in adams])


def save_checkpoint(model, path: str, optimizer=None) -> None:
    from megatron.core import dist_checkpointing

    sd = {"model": model.sharded_state_dict()}
    if optimizer is not None:
        sd["optimizer"] = optimizer.sharded_state_dict(sd["model"])
    dist_checkpointing.save(sd, path)


def load_checkpoint(model, path: str, optimizer=None) -> None:
    """Megatron's resume: the model's (and optimizer's) sharded state dict -> dist_checkpointing.load ->
    strict load_state_dict."""
    from megatron.core import dist_checkpointing

    model_sd = model.sharded_state_dict()
    sd = {"model": model_sd}
    if optimizer is not None:
        sd["optimizer"] = optimizer.sharded_state_dict(model_sd, is_loading=True)
    state = dist_checkpointing.load(sd, path)
    model.load_state_dict(state["model"])
    if optimizer is not None:
        optimizer.load_state_dict(state["optimizer"])


def _checkpoints(rank: int, world: int, root: str) -> None:
    import os

    import torch.distributed as dist

    from relibra_moe.errors import PlanError
    from relibra_moe.integrations import megatron as rm
    from tests import megatron_cpu as mc

    paths = {name: os.path.join(root, name) for name in ("plain", "relibra")}
    if rank == 0:
        for p in paths.values():
            os.makedirs(p)
    dist.barrier()
    mc.init_megatron(world)
    try:
        cfg = mc.moe_config(E, K, H, F, num_layers=L)
        torch.manual_seed(0)
        src = gpt_model(cfg)
        with torch.no_grad():
            for moe in rm.megatron_moe_layers(src):
                for i, e in enumerate(moe.local_expert_indices):
                    fc1, fc2 = expert_truth(moe.layer_number, e)
                    moe.experts.local_experts[i].linear_fc1.weight.copy_(fc1)
                    moe.experts.local_experts[i].linear_fc2.weight.copy_(fc2)
        dense = {n: p.detach().clone() for n, p in src.named_parameters() if ".experts." not in n}
        save_checkpoint(src, paths["plain"])

        # a plain Megatron checkpoint into a relibra model whose experts moved (read by logical id)
        model = fresh_gpt(cfg, 1, relibra=True, replica_slots=1)
        assert all(p.allreduce is False for layer in rm.megatron_moe_layers(model)  # Megatron's marker at EP 2
                   for p in layer.relibra.experts.parameters())
        rm.relayout(model, two_micro_batch_plan(world, world, 3))
        load_checkpoint(model, paths["plain"])
        assert_restored(model, "plain checkpoint -> relibra EP 2 after a relayout")
        for n, p in model.named_parameters():
            if "relibra" not in n:
                torch.testing.assert_close(p.detach(), dense[n], msg=n)

        # relibra checkpoint after another relayout (optimizer state moved with it), Megatron's FP32Optimizer
        adam, opt = adam_with_state(model, mc)
        rm.relayout(model, two_micro_batch_plan(world, world, 4), opt)  # moves the state in the expert optimizer
        assert_restored(model, "relibra after relayout (Adam exp_avg)", adam, 0.2)
        sd = model.sharded_state_dict()
        fc1 = [v for k, v in sd.items() if k.endswith("layers.0.mlp.relibra.experts.w_gate_up")][0]
        assert fc1.key == "decoder.layers.mlp.experts.experts.linear_fc1.weight"  # plain Megatron's key
        save_checkpoint(model, paths["relibra"], opt)
        # the checkpoint's tensors: plain Megatron's keys and global shapes (no replica slot), plus the optimizer's
        from megatron.core import dist_checkpointing

        def tensors(path):
            return {k: tuple(v.global_shape) for k, v in dist_checkpointing.load_tensors_metadata(path).items()}

        plain, ours = tensors(paths["plain"]), tensors(paths["relibra"])
        assert {k: v for k, v in ours.items() if not k.startswith("chained_")} == plain
        assert ours["decoder.layers.mlp.experts.experts.linear_fc1.weight"] == (L, E, 2 * F, H)

        for what, relibra in (("relibra EP 2", True), ("plain EP 2", False)):
            target = fresh_gpt(cfg, 2, relibra=relibra)
            target_adam, target_opt = adam_with_state(target, mc)
            load_checkpoint(target, paths["relibra"], target_opt)
            assert_restored(target, f"relibra checkpoint -> {what}")
            assert_restored(target, f"relibra checkpoint -> {what} (Adam exp_avg)", target_adam, 0.2)
        mc.destroy_megatron()

        mc.init_megatron(1)  # the same 2 processes as EP 1 (expert data parallel 2): every rank holds all 16
        cfg = mc.moe_config(E, K, H, F, num_layers=L, expert_model_parallel_size=1)
        with pytest.raises(PlanError, match=r"replica_slots=1 is over the ceiling E - E/G = 0 \(E=8, G=1"):
            rm.swap_moe_layers(gpt_model(cfg), replica_slots=1)  # as Planner: nothing to replicate at EP 1
        for what, relibra in (("relibra EP 1", True), ("plain EP 1", False)):
            target = fresh_gpt(cfg, 3, relibra=relibra)
            assert all(p.allreduce for n, p in target.named_parameters() if ".experts." in n)  # as Megatron at EP 1
            target_adam, target_opt = adam_with_state(target, mc)
            load_checkpoint(target, paths["relibra"], target_opt)
            assert_restored(target, f"relibra checkpoint -> {what}")
            assert_restored(target, f"relibra checkpoint -> {what} (Adam exp_avg)", target_adam, 0.2)
            assert len(held_experts(target)) == 2 * E
    finally:
        mc.destroy_megatron()


def test_dist_checkpointing_keeps_every_expert_and_cross_loads_with_plain_megatron(tmp_path):
    """After relayouts on 2 EP ranks, dist_checkpointing save + load restores 16/16 (layer, expert) weights and
    their Adam state (Megatron's FP32Optimizer) into EP 2 and EP 1, relibra and plain Megatron models; a plain
    Megatron checkpoint loads into a relibra model."""
    from relibra_moe.layers.testing import run_group

    run_group(_checkpoints, 2, str(tmp_path), timeout_s=240)


# ---------------------------------------------------------------------------------------------- RouterReplay flows


def _router_replay_sequences(rank: int, world: int) -> None:
    """RouterReplay driven as verl's Megatron backend and SkyRL drive it (global actions, set_replay_data)."""
    from megatron.core.transformer.moe.router_replay import RouterReplay
    from megatron.core.transformer.moe.router_replay import RouterReplayAction as A

    from relibra_moe.errors import ReplayError
    from tests import megatron_cpu as mc

    mc.init_megatron(world)
    try:
        ref, rm = build()  # plain Megatron twin: the reference
        model, _ = build()
        rm.swap_moe_layers(model)
        # the framework's view: RouterReplay's global instances are the policy's routers
        RouterReplay.global_router_replay_instances[:] = [layer.router.router_replay for layer in model.layers]
        T = 6
        xs = [torch.randn(T, 1, H, generator=torch.Generator().manual_seed(10 * rank + m)) for m in range(3)]

        def reference(x):
            """Plain Megatron recording live routing: its output and its recorded ids per layer."""
            for layer in ref.layers:
                layer.router.router_replay.clear_indices()
                layer.router.router_replay.set_router_replay_action(A.RECORD)
            with torch.no_grad():
                y = ref(x)
            return y, [layer.router.router_replay.get_recorded_indices().sort(dim=1).values for layer in ref.layers]

        def recorded():
            return [t.sort(dim=1).values for t in RouterReplay.get_recorded_data()]

        # record / replay / record, as a framework runs log-prob, training and log-prob forwards: no stop_replay
        RouterReplay.set_global_router_replay_action(A.RECORD)
        with torch.no_grad():
            y = model(xs[0])
        want_y, want_ids = reference(xs[0])
        torch.testing.assert_close(y, want_y, rtol=1e-5, atol=1e-5)
        assert all(torch.equal(a, b) for a, b in zip(recorded(), want_ids))
        ids = [random_ids(T, 70 + 10 * rank + l) for l in range(2)]
        RouterReplay.set_replay_data(ids)
        rm.replay_micro_batch(model, None)
        with torch.no_grad():
            model(xs[1])
        for layer, t in zip(model.layers, ids):
            assert torch.equal(layer.relibra.last_routing.sort(dim=1).values, t.sort(dim=1).values)
        RouterReplay.set_global_router_replay_action(A.RECORD)  # the user's action: record (replay data still set)
        with torch.no_grad():
            y = model(xs[2])
        want_y, want_ids = reference(xs[2])
        torch.testing.assert_close(y, want_y, rtol=1e-5, atol=1e-5)
        assert all(torch.equal(a, b) for a, b in zip(recorded(), want_ids))
        assert not any(layer._replaying for layer in model.layers)

        # stale ids: micro-batch b's forward without set_replay_data (and without clear_global_indices) would
        # replay micro-batch a's ids: a ReplayError on every rank, naming the rank that found it
        RouterReplay.clear_global_indices()
        RouterReplay.set_replay_data([random_ids(T, 80 + 10 * rank + l) for l in range(2)])
        rm.replay_micro_batch(model, None)
        with torch.no_grad():
            model(xs[0])
        rm.replay_micro_batch(model, None)
        with pytest.raises(ReplayError, match=r"rank 0 of the EP group rejected its replay data: layer moe\[0\]: this "
                                              r"micro-batch would replay the ids the previous micro-batch replayed "
                                              r"\(6 tokens"):
            model(xs[1])
        if rank == 0:  # on rank 1 only: rank 0 sets its data, both raise
            RouterReplay.set_replay_data([random_ids(T, 90 + l) for l in range(2)])
        rm.replay_micro_batch(model, None)
        with pytest.raises(ReplayError, match="rank 1 of the EP group rejected its replay data: .*would replay the ids "
                                              "the previous micro-batch replayed"):
            model(xs[1])
        # fresh data for the next micro-batch: replays it
        RouterReplay.set_replay_data([random_ids(T, 95 + rank + l) for l in range(2)])
        rm.replay_micro_batch(model, None)
        with torch.no_grad():
            model(xs[1])
    finally:
        mc.destroy_megatron()


def test_router_replay_record_replay_record_and_stale_ids():
    """The record / replay / record sequence without stop_replay records live routing (as plain Megatron); a
    forward that would replay another micro-batch's ids raises a named ReplayError on every rank."""
    from relibra_moe.layers.testing import run_group

    run_group(_router_replay_sequences, 2, timeout_s=120)


def _scheduled_no_sync(rank: int, world: int, recompute: bool) -> None:
    """replay_micro_batch with ids builds, checks and agrees every layer's schedule (one exchange for the
    micro-batch): the relibra layer's forward and backward then read nothing back from the device (SyncCounter
    0, only Megatron's own router counted aside), and the outputs and gradients are plain Megatron's on the same
    replayed routing. A -1 id is named by replay_micro_batch on every rank."""
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    from relibra_moe.errors import ReplayError
    from relibra_moe.integrations import megatron as rm
    from relibra_moe.layers.testing import SyncCounter
    from tests import megatron_cpu as mc

    mc.init_megatron(world)
    try:
        extra = dict(recompute_granularity="selective", recompute_modules=["moe"]) if recompute else {}
        cfg = mc.moe_config(E, K, H, F, **extra)
        torch.manual_seed(0)
        ref = mc.moe_layer(cfg)
        seed_experts(ref, 7)
        twin = mc.moe_layer(cfg)
        twin.load_state_dict(ref.state_dict())
        layer = rm.MegatronReplayMoE(twin, layer_index=0)
        gen = torch.Generator().manual_seed(70 + rank)
        x, w = torch.randn(S, B, H, generator=gen), torch.randn(S, B, H, generator=gen)
        ids = random_ids(S * B, 70 + rank)
        # the same counter around plain Megatron's router alone: what the relibra layer may not add to
        rr = ref.router.router_replay
        rr.set_target_indices(ids)
        rr.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
        with SyncCounter() as router_syncs:
            probs, _ = ref.router(x.clone())
            probs.sum().backward()
        ref.zero_grad()
        rr.clear_indices()
        x_ref = x.clone().requires_grad_(True)
        rr.set_target_indices(ids)
        rr.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
        out_ref, _ = ref(x_ref)
        if recompute:
            rr.set_router_replay_action(RouterReplayAction.REPLAY_BACKWARD)
        (out_ref * w).sum().backward()
        rr.clear_indices()
        x_rl = x.clone().requires_grad_(True)
        rm.replay_micro_batch(layer, [ids])
        assert layer._scheduled is not None and layer._scheduled.schedule.replayed
        with SyncCounter() as syncs:
            out, _ = layer(x_rl)
            (out * w).sum().backward()
        assert layer._scheduled is None and not layer._recompute
        assert syncs.counts == router_syncs.counts, (syncs.counts, router_syncs.counts)
        torch.testing.assert_close(out, out_ref, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(x_rl.grad, x_ref.grad, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(layer.router.weight.grad, ref.router.weight.grad, rtol=1e-5, atol=1e-5)
        fc1 = torch.stack([e.linear_fc1.weight.grad for e in ref.experts.local_experts])  # [E_loc, 2F, H]
        got = global_expert_grads(layer.relibra.experts.w_gate_up.grad.transpose(1, 2), layer.relibra.home_experts)
        torch.testing.assert_close(got, global_expert_grads(fc1, ref.local_expert_indices), rtol=1e-5, atol=1e-5)
        assert torch.equal(layer.relibra.last_routing, ids)

        bad = ids.clone()
        if rank == world - 1:
            bad[1, 0] = -1
        try:
            rm.replay_micro_batch(layer, [bad])
            layer(x.clone())
        except ReplayError as exc:
            assert "has -1 (no expert)" in str(exc) and f"rank {world - 1}" in str(exc) or world == 1, str(exc)
        else:
            raise AssertionError("a -1 id was replayed")
        rm.stop_replay(layer)
    finally:
        mc.destroy_megatron()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world,recompute", [(1, False), (2, True)])
def test_scheduled_replay_makes_no_host_sync_and_matches_megatron(world, recompute):
    from relibra_moe.layers.testing import run_group

    run_group(_scheduled_no_sync, world, recompute, timeout_s=120)
