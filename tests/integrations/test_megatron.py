"""Megatron capture and replay: recorded -> planned -> replayed round trip, and bad input (gloo, 2 ranks).

The round trip runs a per-token model (two swapped Megatron MoE layers with residuals, no attention), so
a token's live routing does not depend on which micro-batch or rank it runs in: each sample's outputs
after planning (new expert homes, replicas, samples moved to other ranks and micro-batches) must equal
its outputs at recording time, and the replayed routing must be the recorded one.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from megatron_cpu import HAVE_MEGATRON, MEGATRON_REASON
from torch import nn

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
    import megatron_cpu as mc

    from relibra_moe.integrations import megatron as rm

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
    import megatron_cpu as mc
    import torch.distributed as dist

    from relibra_moe.planners.strategies import plan_batch
    from relibra_moe.specs import ClusterSpec, ModelSpec

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

        # 3. replay every micro-batch in the plan's sample placement
        seen = []
        for m in range(plan.num_micro_batches):
            samples, ids = rm.replay_data(batch, plan, m)
            seen += samples.tolist()
            if not len(samples):
                x = torch.zeros(0, 1, H)
            else:
                x = torch.cat([sample_input(int(i), int(batch.lengths[i])) for i in samples])
            if m % 2:  # verl-style: the framework hands Megatron the replay data, relibra the plan
                from megatron.core.transformer.moe.router_replay import RouterReplay

                RouterReplay.set_replay_data(ids)
                rm.replay_micro_batch(model, None, plan=plan, micro_batch=m)
            else:
                rm.replay_micro_batch(model, ids, plan=plan, micro_batch=m)
            with torch.no_grad():
                y = model(x)
            for layer, t in zip(model.layers, ids):
                assert torch.equal(layer.relibra.last_routing.sort(dim=1).values, t.sort(dim=1).values)
            lo = 0
            for i in samples:
                n = int(batch.lengths[i])
                torch.testing.assert_close(y[lo:lo + n], recorded_out[int(i)], rtol=1e-5, atol=1e-5)
                lo += n
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
    import megatron_cpu as mc

    from relibra_moe.errors import PlanError, ReplayError
    from relibra_moe.layers.testing import hot_replica_plan

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

        # fused router (replay bypassed) and routing replay off: named settings
        import megatron_cpu as mc2

        cfg = mc2.moe_config(E, K, H, F)
        moe = mc2.moe_layer(cfg)
        cfg.moe_router_fusion = True
        with pytest.raises(ReplayError, match="moe_router_fusion=True"):
            rm.RelibraMoELayer(moe)
        cfg.moe_router_fusion = False
        cfg.moe_enable_routing_replay = False
        with pytest.raises(ReplayError, match="moe_enable_routing_replay=False"):
            rm.RelibraMoELayer(moe)
        cfg.moe_enable_routing_replay = True
        cfg.moe_expert_capacity_factor = 1.0
        with pytest.raises(ValueError, match="moe_expert_capacity_factor=1.0"):
            rm.RelibraMoELayer(moe)
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
