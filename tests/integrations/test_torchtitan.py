"""torchtitan 0.3's MoE models with relibra's blocks: a tiny Qwen3 MoE and DeepSeek-V3 in fp32 give torchtitan's own
outputs and gradients, keep the state-dict keys and the Parameter objects, update ``tokens_per_expert_E`` as
torchtitan does, record and replay routing (replayed == live; changed ids route as told), and run expert-parallel on
2 gloo ranks equal to the one-rank model."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

pytest.importorskip("torchtitan", reason="torchtitan is not installed (pip install torchtitan --no-deps, spmd_types, "
                                         "tyro)")

from relibra_moe import RoutingRecorder, replay, swap_moe_blocks  # noqa: E402
from relibra_moe.integrations.torchtitan import TorchtitanReplayMoE  # noqa: E402
from relibra_moe.layers.testing import run_group  # noqa: E402

V, S, B = 64, 6, 2


class _CausalSDPA(nn.Module):
    """Causal SDPA in place of torchtitan's flex attention, whose backward has no CPU kernel (test only; the
    reference and the swapped model run the same attention)."""

    def forward(self, q, k, v, *, attention_masks=None, scale=None, enable_gqa=False, **_):
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
                                             scale=scale, enable_gqa=enable_gqa)
        return out.transpose(1, 2)


def _finish(model: nn.Module, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    model.init_states()
    for p in model.parameters():  # torchtitan initializes some weights to 0; fill every one for a real test
        with torch.no_grad():
            p.copy_(torch.randn_like(p) * 0.2)
    for layer in model.layers.values():
        layer.attention.inner_attention = _CausalSDPA()
    return model.float().train()


def qwen3_config(num_experts: int = 8, top_k: int = 2, enable_ep: bool | None = None):
    """A tiny Qwen3 MoE config (2 MoE layers); ``enable_ep`` not None: torchtitan's sharding config set as its
    trainer sets it (``update_from_config``: expert parallelism on or off, no sequence parallelism)."""
    from torchtitan.models.common import CosSinRoPE, Embedding, Linear
    from torchtitan.models.qwen3 import _EMBEDDING_INIT, _LINEAR_INIT, _build_qwen3_moe_layers, _qwen3_norm
    from torchtitan.models.qwen3.model import Qwen3Model
    from torchtitan.models.qwen3.sharding import set_qwen3_sharding_config

    dim, hd = 32, 8
    cfg = Qwen3Model.Config(
        vocab_size=V, dim=dim, norm=_qwen3_norm(dim),
        tok_embeddings=Embedding.Config(num_embeddings=V, embedding_dim=dim, param_init=_EMBEDDING_INIT),
        lm_head=Linear.Config(in_features=dim, out_features=V, param_init=_LINEAR_INIT),
        layers=_build_qwen3_moe_layers(n_layers=2, dim=dim, n_heads=4, n_kv_heads=2, head_dim=hd, moe_hidden_dim=16,
                                       num_experts=num_experts, top_k=top_k, attn_backend="flex",
                                       moe_comm_backend="standard",
                                       rope=CosSinRoPE.Config(dim=hd, max_seq_len=64, theta=1e6)))
    if enable_ep is not None:
        set_qwen3_sharding_config(cfg, enable_sp=False, enable_ep=enable_ep)
    return cfg


def qwen3_moe(seed: int = 0, num_experts: int = 8, top_k: int = 2, enable_ep: bool | None = None) -> nn.Module:
    return _finish(qwen3_config(num_experts, top_k, enable_ep).build(), seed)


def deepseek_v3(seed: int = 0) -> nn.Module:
    """A tiny DeepSeek-V3: MLA attention, a dense first layer, then MoE layers with a shared expert, sigmoid
    scores with the expert bias and node-limited groups, renormalized and scaled gates."""
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear
    from torchtitan.models.common.nn_modules import RMSNorm
    from torchtitan.models.deepseek_v3 import _EMBEDDING_INIT, _NORM_INIT, _build_dsv3_layers, _output_linear_init
    from torchtitan.models.deepseek_v3.model import DeepSeekV3Model

    dim, rope = 32, 8
    layers = _build_dsv3_layers(
        n_layers=3, n_dense_layers=1, dim=dim, n_heads=4, q_lora_rank=0, kv_lora_rank=16, qk_nope_head_dim=8,
        qk_rope_head_dim=rope, v_head_dim=8, mscale=0.7, dense_hidden_dim=48, moe_hidden_dim=16, num_experts=8,
        num_shared_experts=1, router_top_k=2, router_score_func="sigmoid", router_num_expert_groups=4,
        router_num_limited_groups=2, router_route_scale=2.5, router_route_norm=True, attn_backend="flex",
        moe_comm_backend="standard", non_blocking_capacity_factor=None,
        rope=ComplexRoPE.Config(dim=rope, max_seq_len=64, theta=10000.0))
    cfg = DeepSeekV3Model.Config(
        vocab_size=V, dim=dim, layers=layers, norm=RMSNorm.Config(normalized_shape=dim, param_init=_NORM_INIT),
        tok_embeddings=Embedding.Config(num_embeddings=V, embedding_dim=dim, param_init=_EMBEDDING_INIT),
        lm_head=Linear.Config(in_features=dim, out_features=V, param_init=_output_linear_init(dim)))
    model = _finish(cfg.build(), seed)
    for name, buf in model.named_buffers():  # a nonzero load-balancing bias, so the selection uses it
        if name.endswith("expert_bias_E"):
            buf.copy_(torch.randn(buf.shape, generator=torch.Generator().manual_seed(seed)) * 0.05)
    return model


def _run(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    pos = torch.arange(tokens.shape[1]).expand_as(tokens)
    return model(tokens, pos, None)


def _tokens(seed: int = 1) -> torch.Tensor:
    return torch.randint(0, V, (B, S), generator=torch.Generator().manual_seed(seed))


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _compare(build, atol: float) -> None:
    ref = build()
    ours = copy.deepcopy(ref)
    keys = list(ref.state_dict())
    params_before = {n: p for n, p in ours.named_parameters()}
    swap_moe_blocks(ours)
    blocks = [m for m in ours.modules() if isinstance(m, TorchtitanReplayMoE)]
    assert len(blocks) == sum(1 for layer in ref.layers.values() if layer.moe_enabled) > 0
    assert list(ours.state_dict()) == keys  # torchtitan's keys, same order
    for n, p in ours.named_parameters():  # the same Parameter objects: nothing copied
        assert p is params_before[n], n
    x = _tokens()
    out_ref, out = _run(ref, x), _run(ours, x)
    torch.testing.assert_close(out, out_ref, atol=atol, rtol=atol)
    (out_ref.square().mean()).backward()
    (out.square().mean()).backward()
    g_ref, g = _grads(ref), _grads(ours)
    assert set(g) == set(g_ref)
    for n in g_ref:
        torch.testing.assert_close(g[n], g_ref[n], atol=atol, rtol=atol, msg=n)
    # tokens_per_expert_E: what torchtitan counted, per layer
    for name, mod in ref.named_modules():
        if type(mod).__name__ == "MoE":
            mine = ours.get_submodule(name)
            assert mod.tokens_per_expert_E.sum() == B * S * mod.router.top_k
            torch.testing.assert_close(mine.tokens_per_expert_E, mod.tokens_per_expert_E, atol=0, rtol=0)


def test_qwen3_moe_matches_torchtitan():
    # torchtitan computes the expert GEMMs in bf16 (so do we, compute_dtype); tolerance at bf16 rounding
    _compare(qwen3_moe, atol=2e-2)


def test_deepseek_v3_matches_torchtitan():
    _compare(deepseek_v3, atol=2e-2)


def test_qwen3_moe_fp32_experts_equal_an_fp64_loop():
    """With compute_dtype None (the weights' fp32) the block computes torchtitan's formula without the bf16
    rounding: against a float64 loop over the experts (router, gates renormalized, SwiGLU experts)."""
    ref = qwen3_moe()
    ours = copy.deepcopy(ref)
    swap_moe_blocks(ours)
    block = ours.layers["0"].moe
    block.experts.compute_dtype = None
    x = torch.randn(B, S, 32)
    y = block(x).double()
    x = x.double()
    r = ref.layers["0"].moe.router
    scores = torch.softmax(x.reshape(-1, 32) @ r.gate.weight.double().T, dim=-1)
    w = ref.layers["0"].moe.routed_experts.inner_experts
    want = torch.zeros(B * S, 32, dtype=torch.float64)
    ids = block.last_routing
    for t in range(B * S):
        g = scores[t, ids[t]]
        g = g / (g.sum() + 1e-20)
        for j, e in enumerate(ids[t].tolist()):
            xe = x.reshape(-1, 32)[t]
            h = F.silu(w.w1_EFD[e].double() @ xe) * (w.w3_EFD[e].double() @ xe)
            want[t] += g[j] * (w.w2_EDF[e].double() @ h)
    torch.testing.assert_close(y.reshape(-1, 32), want, atol=1e-5, rtol=1e-5)
    assert torch.equal(ids.sort(dim=-1).values, torch.topk(scores, 2, dim=-1).indices.sort(dim=-1).values)


@pytest.mark.parametrize("build", [qwen3_moe, deepseek_v3], ids=["qwen3", "deepseek_v3"])
def test_record_and_replay(build):
    from relibra_moe.trace import RoutingTrace, TraceBatch

    model = build()
    swap_moe_blocks(model)
    blocks = [m for m in model.modules() if isinstance(m, TorchtitanReplayMoE)]
    x = _tokens()
    with torch.no_grad(), RoutingRecorder(model) as rec:
        live = _run(model, x)
    batch = rec.trace_batch()
    assert batch.num_sequences == B and batch.traces[0].layer_ids.tolist() == [blk.layer_id for blk in blocks]
    live_ids = [blk.last_routing.clone() for blk in blocks]
    for li, ids in enumerate(live_ids):
        np.testing.assert_array_equal(np.stack([t.experts[:, li] for t in batch.traces]), ids.reshape(B, S, -1))
    with torch.no_grad(), replay(model, batch):
        replayed = _run(model, x)
    torch.testing.assert_close(replayed, live, atol=0, rtol=0)
    # changed ids route as told: the first MoE layer now uses experts (e + 1) % E, and tokens_per_expert_E
    # (what torchtitan's bias update reads) counts the replayed routing
    traces = [t.experts.copy() for t in batch.traces]
    for t in traces:
        t[:, 0] = (t[:, 0] + 1) % 8
    moved = TraceBatch([RoutingTrace(t, batch.traces[0].layer_ids, 8, 2) for t in traces])
    for blk in blocks:
        blk.tokens_per_expert_E.zero_()
    with torch.no_grad(), replay(model, moved):
        other = _run(model, x)
    want = (live_ids[0] + 1) % 8
    torch.testing.assert_close(blocks[0].last_routing, want, atol=0, rtol=0)
    torch.testing.assert_close(blocks[0].tokens_per_expert_E, torch.bincount(want.reshape(-1), minlength=8).float())
    assert not torch.allclose(other, live)


def test_next_micro_batch_is_built_ahead():
    """The swapped torchtitan model gets replay's background build: with traces and a BatchPlan, entering
    micro-batch m builds m + 1's schedules in the background thread, the next replay takes them, and the outputs
    equal a fresh build's (the ids given as tensors) and the live forward's."""
    from relibra_moe.layers.replay import _PREFETCH
    from relibra_moe.plan import BatchPlan, Placement, ReplicaPlan, SamplePlacement

    model = qwen3_moe()
    swap_moe_blocks(model)
    x = _tokens()
    with torch.no_grad(), RoutingRecorder(model) as rec:
        live = _run(model, x)
    traces = rec.traces()
    M = len(traces)  # one sequence per micro-batch
    plan = BatchPlan(Placement(np.zeros((2, 8))), SamplePlacement(np.arange(M), np.zeros(M), M),
                     ReplicaPlan.empty(M, 2, 1, 0), num_gpus=1, gpus_per_node=1)
    outs = []
    for m in range(M):
        pending = model.__dict__.get(_PREFETCH)
        with torch.no_grad(), replay(model, traces, plan, micro_batch=m) as rows:
            assert rows == [m]
            if m:  # taken: built ahead for this micro-batch
                assert pending[0][2] == m and pending[1].done() and model.__dict__.get(_PREFETCH, (0, 0, -1))[0] != \
                    pending[0]
            if m + 1 < M:
                assert model.__dict__[_PREFETCH][0][2] == m + 1
            outs.append(_run(model, x[rows]))
    assert _PREFETCH not in model.__dict__
    for m, got in enumerate(outs):
        fresh_ids = [torch.as_tensor(traces[m].experts[:, li]) for li in range(2)]
        with torch.no_grad(), replay(model, fresh_ids):
            torch.testing.assert_close(got, _run(model, x[[m]]), atol=0, rtol=0)
        torch.testing.assert_close(got, live[[m]], atol=1e-5, rtol=1e-4)  # another batch: another GEMM order


def test_recorder_on_the_plain_torchtitan_model():
    ref = qwen3_moe()
    x = _tokens()
    with torch.no_grad(), RoutingRecorder(ref) as rec:
        _run(ref, x)
    batch = rec.trace_batch()
    ours = copy.deepcopy(ref)
    swap_moe_blocks(ours)
    with torch.no_grad():
        _run(ours, x)
    got = np.stack([t.experts for t in batch.traces])  # [B, S, L, k]
    want = torch.stack([blk.last_routing.reshape(B, S, -1) for blk in (ours.layers["0"].moe, ours.layers["1"].moe)],
                       dim=2).numpy()
    np.testing.assert_array_equal(np.sort(got, -1), np.sort(want, -1))


def _ep_worker(rank: int, world: int) -> None:
    """Rank g runs sample g of the batch on the 2-rank swapped model, after a relayout to a random placement and
    with a replica plan (each layer's hot expert replicated); the one-rank swapped model (itself checked against
    torchtitan above) on the whole batch is the reference. Expert GEMMs in fp32 (compute_dtype None) on both."""
    import torch.distributed as dist

    from relibra_moe.integrations.hf import full_state_dict
    from relibra_moe.layers.relayout import relayout
    from relibra_moe.layers.testing import hot_replica_plan

    singles = [dist.new_group([r]) for r in range(world)]  # a one-rank EP group for the reference
    ref = qwen3_moe()
    swap_moe_blocks(ref, ep_group=singles[rank])
    for blk in ref.modules():
        if isinstance(blk, TorchtitanReplayMoE):
            blk.experts.compute_dtype = None
    x = _tokens()
    with RoutingRecorder(ref) as rec:
        want = _run(ref, x)
    want.square().mean().backward()
    traces = rec.traces()
    counts = sum(t.expert_counts() for t in traces)  # [L, E]
    plan = hot_replica_plan(2, 8, world, world, counts.argmax(1), seed=1)

    model = qwen3_moe()
    swap_moe_blocks(model, replica_slots=1, gpus_per_node=world)
    blocks = [m for m in model.modules() if isinstance(m, TorchtitanReplayMoE)]
    assert blocks[0].experts.w1_EFD.shape[0] == 8 // world
    for blk in blocks:
        blk.experts.compute_dtype = None
    relayout(model, plan.placement)
    with replay(model, traces, plan, micro_batch=0) as rows:
        assert rows == [rank], rows
        got = _run(model, x[rows])
    torch.testing.assert_close(got, want[rows], atol=1e-5, rtol=1e-5)
    (got.square().sum() / want.numel()).backward()  # this rank's share of the reference loss
    ref_params = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        g, r = p.grad, ref_params[name].grad
        if ".inner_experts." in name:  # this rank's home experts' rows (replica gradients added back)
            home = torch.as_tensor(blocks[int(name.split(".")[1])].home_experts)
            r = r[home]
        else:
            dist.all_reduce(g)
        torch.testing.assert_close(g, r, atol=1e-5, rtol=1e-5, msg=name)
    assert blocks[0].replica_buffer.fills >= 2  # the replica slots were used (forward fill, backward refill)
    full = full_state_dict(model)
    reference = ref.state_dict()
    assert list(full) == list(reference)
    for k, v in reference.items():
        torch.testing.assert_close(full[k], v, atol=0, rtol=0, msg=k)


@pytest.mark.timeout(180)
def test_expert_parallel_two_ranks_with_replicas():
    run_group(_ep_worker, 2, backend="gloo", timeout_s=90)


def _resident_worker(rank: int, world: int) -> None:
    """The swapped torchtitan Qwen3-MoE on 2 ranks with a resident plan: each layer's hot expert replicated on the
    other rank in both of M = 2 micro-batches (micro-batch m of rank g replays sample g's recorded ids). Logits
    equal the one-rank swapped model's and, after the 2 backwards, every gradient is twice its (each micro-batch
    runs the same sample); each block fills its own slots once and returns their gradients once."""
    import torch.distributed as dist

    from relibra_moe.layers.relayout import relayout
    from relibra_moe.layers.testing import hot_replica_plan
    from relibra_moe.plan import ReplicaPlan

    singles = [dist.new_group([r]) for r in range(world)]
    ref = qwen3_moe()
    swap_moe_blocks(ref, ep_group=singles[rank])
    for blk in ref.modules():
        if isinstance(blk, TorchtitanReplayMoE):
            blk.experts.compute_dtype = None  # expert GEMMs in fp32 on both
    x = _tokens()
    with RoutingRecorder(ref) as rec:
        want = _run(ref, x)
    want.square().mean().backward()
    traces = rec.traces()
    one = hot_replica_plan(2, 8, world, world, sum(t.expert_counts() for t in traces).argmax(1), seed=2)
    idx = np.concatenate([one.replicas.split_index, one.replicas.split_index + [1, 0, 0, 0, 0]])
    plan = ReplicaPlan(np.repeat(one.replicas.replica_expert, 2, axis=0), idx,
                       np.tile(one.replicas.split_share, 2), one.replicas.scope)
    assert plan.resident
    model = qwen3_moe()
    swap_moe_blocks(model, replica_slots=1, gpus_per_node=world)
    blocks = [m for m in model.modules() if isinstance(m, TorchtitanReplayMoE)]
    for blk in blocks:
        blk.experts.compute_dtype = None
    relayout(model, one.placement)
    ids = torch.as_tensor(traces[rank].experts)  # [S, L, k]
    for m in range(2):
        with replay(model, ids, plan=plan, micro_batch=m):
            got = _run(model, x[rank:rank + 1])
        torch.testing.assert_close(got, want[rank:rank + 1], atol=1e-5, rtol=1e-5)
        (got.square().sum() / want.numel()).backward()
    assert [b.resident_replicas.buffer.fills for b in blocks] == [1, 1]
    assert [b.resident_replicas.returns for b in blocks] == [1, 1] and blocks[0].replica_buffer.fills == 0
    ref_params = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        g, r = p.grad, 2 * ref_params[name].grad
        if ".inner_experts." in name:  # this rank's home experts' rows (replica gradients added back once)
            r = r[torch.as_tensor(blocks[int(name.split(".")[1])].home_experts)]
        else:
            dist.all_reduce(g)
        torch.testing.assert_close(g, r, atol=1e-5, rtol=1e-5, msg=name)


@pytest.mark.timeout(180)
def test_expert_parallel_two_ranks_with_a_resident_plan():
    run_group(_resident_worker, 2, backend="gloo", timeout_s=90)


def _bias_hook_worker(rank: int, world: int) -> None:
    """torchtitan's own load-balancing hook (register_moe_load_balancing_hook, run before the optimizer step) reads
    the swapped blocks' tokens_per_expert_E: the expert-bias update equals the plain model's, and it zeroes them."""
    from torchtitan.components.optimizer import register_moe_load_balancing_hook
    from torchtitan.distributed.parallel_dims import ParallelDims

    class Hooks:  # the optimizer container's hook registry is all the hook needs
        def __init__(self) -> None:
            self.hooks: list = []

        def register_step_pre_hook(self, hook) -> None:
            self.hooks.append(hook)

    dims = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=1, ep=1, world_size=1)
    biases = []
    for swap in (False, True):
        model = deepseek_v3()
        if swap:
            swap_moe_blocks(model)
        hooks = Hooks()
        register_moe_load_balancing_hook(hooks, [model], dims)
        assert len(hooks.hooks) == 1
        before = [layer.moe.expert_bias_E.clone() for layer in model.layers.values() if layer.moe_enabled]
        _run(model, _tokens()).square().mean().backward()
        hooks.hooks[0]()
        moes = [layer.moe for layer in model.layers.values() if layer.moe_enabled]
        assert all(float(m.tokens_per_expert_E.abs().sum()) == 0 for m in moes)
        after = torch.stack([m.expert_bias_E for m in moes])
        assert not torch.equal(after, torch.stack(before))
        biases.append(after)
    torch.testing.assert_close(biases[1], biases[0], atol=0, rtol=0)


@pytest.mark.timeout(120)
def test_torchtitan_load_balancing_hook_reads_the_counts():
    run_group(_bias_hook_worker, 1, backend="gloo", timeout_s=60)


# ------------------------------------------------------------------ torchtitan's own parallelize, DCP, meta init
def _titan_dims(world: int, **degrees):
    """torchtitan's ParallelDims on CPU gloo (``partial_dtensor`` backend), meshes built."""
    import torch.testing._internal.distributed.fake_pg  # noqa: F401  (the "fake" backend of size-1 dimensions)
    import torchtitan.distributed.parallel_dims as pdm

    pdm.device_type = "cpu"  # torchtitan picks "cuda" at import; this process has none
    dims = pdm.ParallelDims(**{"dp_replicate": 1, "dp_shard": -1, "cp": 1, "tp": 1, "pp": 1, "ep": 1, **degrees},
                            world_size=world, spmd_backend="partial_dtensor")
    dims.build_mesh()
    return dims


def _titan_parallelize(model: nn.Module, dims, parallelize_fn=None) -> nn.Module:
    """torchtitan's Qwen3 parallelize_fn (or ``parallelize_fn``), unchanged, with fp32 FSDP; then FSDP's reduction as
    a plain sum (torchtitan sets the divide factor 1, which FSDP sends as PREMUL_SUM(1), an op gloo lacks)."""
    from torch.distributed.fsdp import FSDPModule
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.models.qwen3.parallelize import parallelize_qwen3

    par = ParallelismConfig(expert_parallel_degree=dims.ep, data_parallel_shard_degree=dims.dp_shard,
                            spmd_backend="partial_dtensor")
    training = TrainingConfig(mixed_precision_param="float32", mixed_precision_reduce="float32")
    (parallelize_fn or parallelize_qwen3)(model, parallel_dims=dims, training=training, parallelism=par,
                                          compile_config=CompileConfig(), ac_config=None, dump_folder="")
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_force_sum_reduction_for_comms(True)
    return model


def _fp32_experts(model: nn.Module) -> list[TorchtitanReplayMoE]:
    blocks = [m for m in model.modules() if isinstance(m, TorchtitanReplayMoE)]
    for blk in blocks:
        blk.experts.compute_dtype = None
    return blocks


def _parallelize_worker(rank: int, world: int) -> None:
    """torchtitan's parallelize_qwen3 (EP 2 from its own sharding config, FSDP over 2 ranks) on a swapped model:
    experts stay relibra's plain [E/2, ...] rows (not DTensors, not FSDP-managed), dense parameters become FSDP
    DTensors; rank g's sample gives the one-rank swapped model's output, and after the backward (FSDP sum over
    ranks) every dense gradient and every home expert row's gradient equals the one-rank model's. With ep = 1
    (one-rank blocks) FSDP shards every parameter, experts included, and the same holds."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    singles = [dist.new_group([r]) for r in range(world)]
    ref = qwen3_moe(enable_ep=True)
    swap_moe_blocks(ref, ep_group=singles[rank])
    _fp32_experts(ref)
    x = _tokens()
    want = _run(ref, x)
    want.square().mean().backward()

    dims = _titan_dims(world, ep=world)
    model = qwen3_moe(enable_ep=True)
    swap_moe_blocks(model, ep_group=dims.get_mesh("ep"))
    blocks = _fp32_experts(model)
    _titan_parallelize(model, dims)
    w1 = blocks[0].experts.w1_EFD
    assert type(w1) is nn.Parameter and w1.shape[0] == 8 // world  # relibra's rows, left alone
    assert isinstance(model.tok_embeddings.weight, DTensor)  # FSDP sharded the dense rest
    got = _run(model, x[rank:rank + 1])
    torch.testing.assert_close(got, want[rank:rank + 1], atol=1e-5, rtol=1e-5)
    (got.square().sum() / want.numel()).backward()
    ref_params = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        r = ref_params[name].grad
        if ".inner_experts." in name:
            r = r[torch.as_tensor(blocks[int(name.split(".")[1])].home_experts)]
            g = p.grad
        else:
            g = p.grad.full_tensor()
        torch.testing.assert_close(g, r, atol=1e-5, rtol=1e-5, msg=name)
    # clipping: the norm of the whole gradient (every expert row once), every gradient scaled alike
    from relibra_moe.integrations.torchtitan import clip_grad_norm_

    ref_norm = float(torch.sqrt(sum(p.grad.double().square().sum() for p in ref.parameters())))
    norm = clip_grad_norm_([model], ref_norm / 2)
    assert abs(float(norm) - ref_norm) <= 1e-5 * ref_norm, (float(norm), ref_norm)
    scale = (ref_norm / 2) / (float(norm) + 1e-6)
    expert_grad = blocks[0].experts.w1_EFD.grad
    want_expert = ref_params["layers.0.moe.routed_experts.inner_experts.w1_EFD"].grad[
        torch.as_tensor(blocks[0].home_experts)] * scale
    torch.testing.assert_close(expert_grad, want_expert, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(model.tok_embeddings.weight.grad.full_tensor(),
                               ref_params["tok_embeddings.weight"].grad * scale, atol=1e-6, rtol=1e-5)

    # ep = 1: one-rank blocks (all 8 experts), torchtitan's FSDP shards the experts too, as in the plain model
    plain_ep = qwen3_moe(enable_ep=False)
    swap_moe_blocks(plain_ep, ep_group=singles[rank])
    _fp32_experts(plain_ep)
    _titan_parallelize(plain_ep, _titan_dims(world, ep=1))
    assert isinstance(plain_ep.layers["0"].moe.experts.w1_EFD, DTensor)
    got = _run(plain_ep, x[rank:rank + 1])
    torch.testing.assert_close(got, want[rank:rank + 1], atol=1e-5, rtol=1e-5)
    (got.square().sum() / want.numel()).backward()
    for name, p in plain_ep.named_parameters():
        torch.testing.assert_close(p.grad.full_tensor(), ref_params[name].grad, atol=1e-5, rtol=1e-5, msg=name)

    # configurations the swapped blocks cannot run raise ValueError on every rank, naming the reason
    for degrees, swap_group, match in (({"ep": 2}, singles[rank], "EP group has 1 ranks, parallel_dims.ep=2"),
                                       ({"ep": 2, "tp": 2, "dp_shard": 1}, None, "parallel_dims.tp=2")):
        bad = qwen3_moe(enable_ep=degrees["ep"] > 1)
        swap_moe_blocks(bad, ep_group=swap_group)
        with pytest.raises(ValueError, match=match):
            _titan_parallelize(bad, _titan_dims(world, **degrees))


@pytest.mark.timeout(300)
def test_torchtitan_parallelize_on_a_swapped_model_two_ranks():
    run_group(_parallelize_worker, 2, backend="gloo", timeout_s=120)


def test_meta_device_build_then_init_weights_equals_the_eager_build():
    """torchtitan's order (build on meta, swap, to_empty, init_weights) gives the eager plain model's init: every
    parameter and buffer bit for bit under the same seed (the swapped block is a torchtitan Module, so init_states
    visits its children in torchtitan's order and re-zeroes expert_bias_E / tokens_per_expert_E), expert_gpu the
    static placement. (Replica slots need an EP group of two or more ranks: on one rank the ceiling E - E/G is 0.)"""
    cfg = qwen3_config(enable_ep=False)
    eager = cfg.build()
    torch.manual_seed(5)
    eager.init_weights()
    swap_moe_blocks(eager)
    with torch.device("meta"):
        model = cfg.build()
    swap_moe_blocks(model)
    model.to_empty(device="cpu")
    with torch.no_grad():
        for t in list(model.parameters()) + list(model.buffers()):
            t.fill_(float("nan") if t.is_floating_point() else -7)  # what to_empty may leave
    torch.manual_seed(5)
    model.init_weights()
    want = dict(eager.named_buffers()) | dict(eager.named_parameters())
    got = dict(model.named_buffers()) | dict(model.named_parameters())
    assert set(got) == set(want) and any(k.endswith("tokens_per_expert_E") for k in got)
    for k, v in want.items():
        torch.testing.assert_close(got[k], v, atol=0, rtol=0, equal_nan=False, msg=k)
    blk = model.layers["0"].moe
    assert blk.expert_gpu.tolist() == [0] * 8 and float(blk.expert_bias_E.abs().sum()) == 0
    assert blk.replica_buffer is None


@pytest.mark.parametrize("swap", [False, True], ids=["plain", "swapped"])
def test_recording_leaves_the_load_balancing_counts_alone(swap):
    """A recording forward in train mode leaves tokens_per_expert_E (torchtitan's bias-update input) unchanged;
    the same forward unrecorded adds the routed tokens (B * S * k per layer)."""
    model = qwen3_moe()
    if swap:
        swap_moe_blocks(model)
    moes = [layer.moe for layer in model.layers.values()]
    for m in moes:
        m.tokens_per_expert_E.copy_(torch.arange(8.0))
    with torch.no_grad(), RoutingRecorder(model) as rec:
        _run(model, _tokens())
    assert rec.trace_batch().num_sequences == B and model.training
    for m in moes:
        torch.testing.assert_close(m.tokens_per_expert_E, torch.arange(8.0), atol=0, rtol=0)
    with torch.no_grad():
        _run(model, _tokens())
    for m in moes:
        assert float(m.tokens_per_expert_E.sum()) == float(torch.arange(8.0).sum()) + B * S * 2


def _titan_adamw(model: nn.Module):
    """torchtitan's OptimizersContainer (one AdamW over every parameter, the for-loop implementation on CPU)."""
    from torchtitan.components.optimizer.optimizer import OptimizersContainer, ParamGroupConfig

    group = ParamGroupConfig(pattern=r".*", optimizer_name="AdamW", optimizer_kwargs={"lr": 1e-2})
    return OptimizersContainer.Config(param_groups=[group], implementation="for-loop").build(model_parts=[model])


def _titan_checkpointer(model: nn.Module, opt, folder: str):
    """torchtitan's own DCP CheckpointManager, saving every step into ``folder``."""
    from torchtitan.components.checkpointer.dcp import CheckpointManager

    return CheckpointManager.Config(enable=True, folder="ckpt", interval=1).build(
        dataloader=None, model_parts=[model], optimizers=opt, lr_schedulers=None, states={}, sd_adapter=None,
        base_folder=folder)


def _trained_titan_model(rank: int, world: int, seed: int, placement_seed: int, folder: str):
    """The swapped Qwen3 under torchtitan's parallelize (EP 2, FSDP) with torchtitan's AdamW after one step and
    torchtitan's CheckpointManager (built as its trainer builds it, before training: its ModelWrapper caches the
    state dict), the experts (and their AdamW state) then moved to a random placement."""
    from relibra_moe.layers.expert_sharding import install_sharded_checkpoints
    from relibra_moe.layers.relayout import relayout

    dims = _titan_dims(world, ep=world)
    model = qwen3_moe(seed, enable_ep=True)
    swap_moe_blocks(model, ep_group=dims.get_mesh("ep"))
    _titan_parallelize(model, dims)
    opt = _titan_adamw(model)
    install_sharded_checkpoints(model, opt)
    _run(model, _tokens(seed)[rank:rank + 1]).square().mean().backward()
    opt.step()
    opt.zero_grad()
    ckpt = _titan_checkpointer(model, opt, folder)
    rng = np.random.default_rng(placement_seed)
    relayout(model, np.stack([rng.permutation(np.arange(8) // (8 // world)) for _ in range(2)]), opt)
    return model, opt, ckpt


def _whole_state(model: nn.Module, opt) -> dict[str, torch.Tensor]:
    """Every parameter whole (dense DTensors gathered, expert rows gathered in logical order) and every expert's
    AdamW ``exp_avg`` whole (``<key>.exp_avg``). A collective."""
    from torch.distributed.tensor import DTensor

    from relibra_moe.layers.expert_sharding import expert_shards, gather_experts

    shards = expert_shards(model)
    params = dict(model.named_parameters())
    state = {p: st for o in opt.optimizers for p, st in o.state.items()}
    out = {}
    for name, p in params.items():
        if name in shards:
            out[name] = gather_experts(p, shards[name])
            out[name + ".exp_avg"] = gather_experts(state[p]["exp_avg"], shards[name])
        else:
            out[name] = p.full_tensor() if isinstance(p, DTensor) else p.detach().clone()
    return out


def _dcp_worker(rank: int, world: int, folder: str) -> None:
    """torchtitan's CheckpointManager, unchanged, saves the EP model (experts moved) and loads it into another EP
    model with other values and another placement: every expert row on every rank, every dense parameter and every
    expert's AdamW state come back; rank 0 also keeps the whole tensors for the one-process check."""
    import torch.distributed as dist

    model, opt, ckpt = _trained_titan_model(rank, world, seed=0, placement_seed=3, folder=folder)
    want = _whole_state(model, opt)
    assert ckpt.save(curr_step=1)
    if rank == 0:
        torch.save(want, f"{folder}/want.pt")

    other, other_opt, other_ckpt = _trained_titan_model(rank, world, seed=1, placement_seed=4, folder=folder)
    blocks = [m for m in other.modules() if isinstance(m, TorchtitanReplayMoE)]
    assert not np.array_equal(blocks[0].expert_gpu_host, [m for m in model.modules()
                                                           if isinstance(m, TorchtitanReplayMoE)][0].expert_gpu_host)
    assert other_ckpt.load(step=1)
    got = _whole_state(other, other_opt)
    for k, v in want.items():
        torch.testing.assert_close(got[k], v, atol=0, rtol=0, msg=k)
    # each rank's own rows: its home experts under its (new) placement
    state = {p: st for o in other_opt.optimizers for p, st in o.state.items()}
    for li, blk in enumerate(blocks):
        home = torch.as_tensor(blk.home_experts)
        for n in ("w1_EFD", "w3_EFD", "w2_EDF"):
            key = f"layers.{li}.moe.routed_experts.inner_experts.{n}"
            p = getattr(blk.experts, n)
            torch.testing.assert_close(p.detach(), want[key][home], atol=0, rtol=0, msg=key)
            torch.testing.assert_close(state[p]["exp_avg"], want[key + ".exp_avg"][home], atol=0, rtol=0, msg=key)
    dist.barrier()


@pytest.mark.timeout(400)
def test_torchtitan_dcp_checkpoint_holds_every_expert(tmp_path):
    """DCP (torchtitan's checkpoint format) of a 2-rank EP model: restored into another EP layout on 2 ranks, and
    into the plain one-process torchtitan model (whole [E, ...] experts, dcp.load without a process group)."""
    import torch.distributed.checkpoint as dcp

    run_group(_dcp_worker, 2, str(tmp_path), backend="gloo", timeout_s=150)
    want = torch.load(tmp_path / "want.pt")
    plain = qwen3_moe(seed=2)
    sd = plain.state_dict()
    dcp.load(sd, checkpoint_id=str(tmp_path / "ckpt" / "step-1"), no_dist=True)
    plain.load_state_dict(sd)
    for name, p in plain.named_parameters():
        torch.testing.assert_close(p.detach(), want[name], atol=0, rtol=0, msg=name)


def _expert_dp_worker(rank: int, world: int) -> None:
    """4 ranks, EP 2, FSDP over 4: ranks r and r + 2 hold the same experts (torchtitan's efsdp dimension). A training
    forward refuses to run until the expert-gradient reduction is registered; then rank r's sample gives the
    one-process output and, after clip_grad_norm_ (which sums the expert gradients over efsdp first), every dense
    and home-expert gradient equals the one-process model's and the norm is the one-process norm; a second
    reduction (the optimizer pre-step hook) changes nothing."""
    import torch.distributed as dist

    from relibra_moe.integrations.torchtitan import clip_grad_norm_, reduce_expert_grads, register_expert_grad_reduction

    singles = [dist.new_group([r]) for r in range(world)]
    x = torch.randint(0, V, (world, S), generator=torch.Generator().manual_seed(3))
    ref = qwen3_moe(enable_ep=True)
    swap_moe_blocks(ref, ep_group=singles[rank])
    _fp32_experts(ref)
    want = _run(ref, x)
    want.square().mean().backward()

    dims = _titan_dims(world, ep=2)
    model = qwen3_moe(enable_ep=True)
    swap_moe_blocks(model, ep_group=dims.get_mesh("ep"))
    blocks = _fp32_experts(model)
    _titan_parallelize(model, dims)
    with pytest.raises(ValueError, match="hold the same experts and nothing sums their gradients"):
        _run(model, x[rank:rank + 1])
    opt = _titan_adamw(model)
    register_expert_grad_reduction(opt, [model])
    got = _run(model, x[rank:rank + 1])
    torch.testing.assert_close(got, want[rank:rank + 1], atol=1e-5, rtol=1e-5)
    (got.square().sum() / want.numel()).backward()
    norm = clip_grad_norm_([model], 1e9)
    ref_norm = float(torch.sqrt(sum(p.grad.double().square().sum() for p in ref.parameters())))
    assert abs(float(norm) - ref_norm) <= 1e-5 * ref_norm, (float(norm), ref_norm)
    ref_params = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        r = ref_params[name].grad
        if ".inner_experts." in name:
            g = p.grad
            r = r[torch.as_tensor(blocks[int(name.split(".")[1])].home_experts)]
        else:
            g = p.grad.full_tensor()
        torch.testing.assert_close(g, r, atol=1e-5, rtol=1e-5, msg=name)
    before = blocks[0].experts.w1_EFD.grad.clone()
    reduce_expert_grads([model])
    assert torch.equal(blocks[0].experts.w1_EFD.grad, before)


@pytest.mark.timeout(400)
def test_torchtitan_parallelize_with_expert_data_parallel_four_ranks():
    run_group(_expert_dp_worker, 4, backend="gloo", timeout_s=200)
