"""FSDP2 + expert parallelism on a 2-D mesh (dp 2 x ep 2, 4 gloo processes) against the plain HF step.

Every rank builds the same tiny HF model, records its routing of a 4-sample batch, and runs the same
step twice: once as :func:`relibra_moe.integrations.fsdp.parallelize` prepares it (dense parameters
``fully_shard``-ed over the 4 ranks, experts homed by a relibra plan with replicas and a non-identity
placement on each EP group of 2, the plan's 2 micro-batches dealt over the 2 dp ranks, AdamW), and once
as the plain single-process HF model on the whole batch. Loss, gathered gradients and the gathered
parameters after AdamW must agree; a second step after a relayout to another placement (experts move
with their AdamW state) must agree too.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest

pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

from relibra_moe.layers.testing import hot_replica_plan, run_group  # noqa: E402

LENGTHS = (7, 5, 6, 4)  # tokens of the 4 samples (inputs of the shifted causal-LM forward)
LR = 0.01
# AdamW turns fp32 rounding of near-zero gradients into a few % of a step on single weights (1.06% measured on
# mixtral, 2026-12-07, 3 weights of 8192); per tensor the parameters agree to ADAMW_PARAM_NORM_RTOL (7e-5 there)
ADAMW_PARAM_ATOL = 3e-2 * LR
ADAMW_PARAM_NORM_RTOL = 1e-3


def two_micro_batch_plan(num_layers: int, num_experts: int, hot: np.ndarray, seed: int):
    """A plan for an EP group of 2 ranks (one node) and 4 samples in 2 micro-batches: a random balanced
    placement per layer (``seed``), in micro-batch m the hot expert ``hot[m, l]`` of each layer is
    replicated on the other rank and 40% of its tokens from every source go there. Sample ``2m + g``
    runs on rank g in micro-batch m."""
    from relibra_moe.plan import BatchPlan, ReplicaPlan, SamplePlacement

    parts = [hot_replica_plan(num_layers, num_experts, 2, 2, hot[m], seed) for m in range(2)]
    idx = [p.replicas.split_index.copy() for p in parts]
    idx[1][:, 0] = 1
    replicas = ReplicaPlan(np.concatenate([p.replicas.replica_expert for p in parts]), np.concatenate(idx),
                           np.concatenate([p.replicas.split_share for p in parts]), parts[0].replicas.scope)
    samples = SamplePlacement(np.array([0, 0, 1, 1]), np.array([0, 1, 0, 1]), 2)
    return BatchPlan(parts[0].placement, samples, replicas, num_gpus=2, gpus_per_node=2)


def batch_rows(seqs: list, index: list[int]):
    """Right-padded ``input_ids``, ``attention_mask`` and next-token ``labels`` (-100 at padding and at the
    last position) of samples ``index``; one placeholder token (no label) when ``index`` is empty."""
    if not index:
        return (torch.zeros(1, 1, dtype=torch.long), torch.ones(1, 1, dtype=torch.long),
                torch.full((1, 1), -100, dtype=torch.long))
    S = max(len(seqs[i]) for i in index)
    ids = torch.zeros(len(index), S, dtype=torch.long)
    mask = torch.zeros_like(ids)
    labels = torch.full_like(ids, -100)
    for b, i in enumerate(index):
        n = len(seqs[i])
        ids[b, :n], mask[b, :n] = seqs[i], 1
        labels[b, : n - 1] = seqs[i][1:]
    return ids, mask, labels


def lm_loss_sum(model, ids, mask, labels) -> torch.Tensor:
    """Summed next-token negative log-likelihood over the labelled positions (fp32)."""
    logits = model(ids, attention_mask=mask).logits.float()
    logp = torch.log_softmax(logits, dim=-1).gather(-1, labels.clamp_min(0)[..., None])[..., 0]
    return -(logp * (labels != -100)).sum()


def _setup(family: str, seed: int = 0):
    from relibra_moe.integrations.hf_tiny import tiny_model

    model = tiny_model(family, seed=seed, num_layers=3, num_experts=8, top_k=2)
    g = torch.Generator().manual_seed(seed + 7)
    seqs = [torch.randint(3, 97, (n,), generator=g) for n in LENGTHS]
    return model, seqs


def record(model, seqs):
    """The routing of the plain model on the batch (the "rollout" of the current weights)."""
    from relibra_moe.integrations.hf import RoutingRecorder

    ids, mask, _ = batch_rows(seqs, list(range(len(seqs))))
    with RoutingRecorder(model) as rec, torch.no_grad():
        model(ids, attention_mask=mask)
    batch = rec.trace_batch()
    assert [t.num_tokens for t in batch.traces] == [len(s) for s in seqs]
    return batch


def _hot(batch, rows: list[list[int]]) -> np.ndarray:
    """``[2, L]`` the most loaded expert of each layer among the samples of each micro-batch."""
    out = []
    for samples in rows:
        ex = np.concatenate([batch.traces[i].experts for i in samples])  # [T, L, k]
        out.append([int(np.bincount(ex[:, li].ravel(), minlength=8).argmax()) for li in range(ex.shape[1])])
    return np.array(out)


def _compare(name: str, got: dict, ref: dict, rtol: float, atol: float, norm_rtol: float | None = None) -> None:
    """Every tensor of ``got`` equals ``ref``'s elementwise (``rtol`` / ``atol``) and, with ``norm_rtol``, in norm:
    ``||got - ref|| <= norm_rtol ||ref||``."""
    assert set(got) == set(ref), (name, sorted(set(got) ^ set(ref)))
    for k, r in ref.items():
        err = float((got[k] - r).abs().max())
        assert torch.allclose(got[k], r, rtol=rtol, atol=atol), f"{name} {k}: max abs err {err:.3g}"
        if norm_rtol is not None:
            rel = float((got[k] - r).norm() / r.norm().clamp_min(1e-30))
            assert rel <= norm_rtol, f"{name} {k}: relative norm error {rel:.3g}"


def _train_worker(rank: int, world: int, family: str, checkpointing: bool, reduction: str, steps: int,
                  bf16: bool = False, hsdp: bool = False) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from relibra_moe.integrations.fsdp import expert_parameters, parallelize

    model, seqs = _setup(family)
    reference = copy.deepcopy(model).train()
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=LR, weight_decay=0.01)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "ep"))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else None
    par = parallelize(model.train(), mesh, replica_slots=1, gpus_per_node=2, reduction=reduction,
                      activation_checkpointing=checkpointing, mp_policy=mp, dense_mesh=mesh if hsdp else None)
    assert par.dp_size == par.ep_size == 2 and par.ep_rank == rank % 2 and par.dp_rank == rank // 2
    from torch.distributed.tensor import Replicate, Shard

    dense = model.model.embed_tokens.weight  # HSDP: replicated over dp, sharded over ep; else sharded over all
    assert tuple(dense.placements) == ((Replicate(), Shard(0)) if hsdp else (Shard(0),)), dense.placements
    layers = [m for m in model.modules() if hasattr(m, "home_experts")]
    calls = []
    for layer in layers:
        layer.register_forward_pre_hook(lambda mod, args: calls.append(args[0].dtype))
    # foreach: one fused update per param group (dense DTensors, plain experts), the CUDA default
    opt = torch.optim.AdamW(par.param_groups(weight_decay=0.01), lr=LR, foreach=True)
    denom = sum(n - 1 for n in LENGTHS)  # labelled tokens of the global batch
    for step in range(steps):
        batch = record(reference, seqs)  # each step replays the routing of the weights it trains
        hot = _hot(batch, [[0, 1], [2, 3]])
        plan = two_micro_batch_plan(len(layers), 8, hot, seed=11 + step)
        static = np.arange(8) // 4
        assert not (plan.placement.expert_gpu == static).all(axis=1).any(), "placement must move experts"
        assert (plan.replicas.replica_expert >= 0).any()
        moved = par.relayout(plan, opt)
        assert moved["experts_moved"] > 0
        if step:  # the second relayout moves experts that already have AdamW state
            assert all(len(opt.state[p]) for p in expert_parameters(model).values())
        opt.zero_grad(set_to_none=True)
        loss_sum = torch.zeros(())
        rounds = par.micro_batches(plan)
        assert rounds == [par.dp_rank]
        replica_rows = 0
        for m in rounds:
            mine = [int(i) for i in np.flatnonzero((plan.samples.micro_batch == m) &
                                                   (plan.samples.gpu == par.ep_rank))]
            ids, mask, labels = batch_rows(seqs, mine)
            calls.clear()
            with par.replay(batch, plan, m, attention_mask=mask) as rows:
                assert rows == mine
                loss = lm_loss_sum(model, ids, mask, labels) / denom
                if reduction == "mean":  # FSDP's mean divides by the mesh size: each rank's loss is scaled up
                    loss = loss * world
                loss.backward()
            # activation checkpointing recomputes every MoE layer in backward (under the same replay)
            assert len(calls) % len(layers) == 0 and (len(calls) > len(layers)) == checkpointing, len(calls)
            assert set(calls) == {torch.bfloat16 if bf16 else torch.float32}
            replica_rows += sum(int(layer.last_slot_counts[layer.num_local:].sum()) for layer in layers)
            loss_sum += loss.detach() / (world if reduction == "mean" else 1)
        par.reduce_expert_grads()
        every = torch.tensor([replica_rows])
        dist.all_reduce(every)
        assert int(every) > 0, "the replica slots should serve tokens"
        dist.all_reduce(loss_sum)
        norm = par.clip_grad_norm_(1e9)  # measures only: nothing is clipped
        grads = par.full_grads()
        opt.step()
        state = par.full_state_dict()

        ref_opt.zero_grad(set_to_none=True)
        rids, rmask, rlabels = batch_rows(seqs, list(range(len(seqs))))
        ref_loss = lm_loss_sum(reference, rids, rmask, rlabels) / denom
        ref_loss.backward()
        ref_loss = float(ref_loss.detach())
        ref_grads = {n: p.grad.detach().clone() for n, p in reference.named_parameters() if p.grad is not None}
        ref_opt.step()
        ref_norm = float(torch.sqrt(sum((g.double() ** 2).sum() for g in ref_grads.values())))
        assert ref_norm > 1e-3  # a real step
        assert abs(float(norm) - ref_norm) <= (3e-2 if bf16 else 1e-4) * ref_norm, (float(norm), ref_norm)
        if bf16:  # bf16 dense compute: loss and gradients within bf16 tolerances, parameters finite and moved
            assert abs(float(loss_sum) - ref_loss) <= 2e-2 * ref_loss, (float(loss_sum), ref_loss)
            for k, r in ref_grads.items():
                assert float((grads[k] - r).abs().max()) <= 6e-2 * float(r.abs().max()) + 1e-5, k
            ref_state = reference.state_dict()
            assert all(torch.isfinite(v).all() for v in state.values())
            assert (state["model.embed_tokens.weight"] != model_init_embed(family)).any()
            assert set(state) == set(ref_state)
            continue
        assert abs(float(loss_sum) - ref_loss) <= 1e-5 * max(1.0, ref_loss), (step, float(loss_sum), ref_loss)
        if step == 0:
            _compare("grad", grads, ref_grads, rtol=1e-4, atol=1e-6)
        else:  # after an AdamW step the models differ by amplified rounding: normwise per tensor
            for k, r in ref_grads.items():
                assert float((grads[k] - r).abs().max()) <= 1e-3 * float(r.abs().max()) + 1e-6, k
        _compare("param", state, reference.state_dict(), rtol=1e-4, atol=ADAMW_PARAM_ATOL,
                 norm_rtol=ADAMW_PARAM_NORM_RTOL)


def model_init_embed(family: str) -> torch.Tensor:
    return _setup(family)[0].model.embed_tokens.weight.detach()


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("family, checkpointing, reduction, hsdp", [
    ("qwen3_moe", False, "sum", False),
    ("mixtral", True, "mean", True),
])
def test_fsdp_ep_steps_equal_plain_hf(family, checkpointing, reduction, hsdp):
    """Two steps on the 2 x 2 mesh with a plan (replicas, non-identity placement), a relayout to another
    placement between them (AdamW state moves with the experts): loss, gathered gradients and gathered
    parameters equal the plain HF steps. Qwen3-MoE: dense parameters sharded over all 4 ranks, sum
    reduction. Mixtral: activation checkpointing (every MoE layer recomputed in backward under the same
    replay), FSDP's mean reduction, and HSDP (dense parameters replicated over dp, sharded over ep)."""
    run_group(_train_worker, 4, family, checkpointing, reduction, 2, False, hsdp, timeout_s=300)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_fsdp_ep_bf16_mixed_precision():
    """MixedPrecisionPolicy(bf16 params, fp32 reduce) with activation checkpointing: the dense layers run in
    bf16 (the MoE layers see bf16 hidden states), the experts in their fp32; one step's loss and
    gradients are within bf16 tolerances of the fp32 plain HF step (parameters after AdamW are not
    compared: AdamW's first step is about lr * sign(g), which bf16 noise flips for near-zero gradients)."""
    run_group(_train_worker, 4, "qwen3_moe", True, "sum", 1, True, timeout_s=300)


def _placeholder_and_errors_worker(rank: int, world: int) -> None:
    """One plan of a single micro-batch (dp rank 1 runs a placeholder round), then every bad input."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from relibra_moe.errors import PlanError
    from relibra_moe.integrations.fsdp import check_experts_not_sharded, check_mesh, parallelize
    from relibra_moe.integrations.hf import swap_moe_blocks
    from relibra_moe.integrations.hf_tiny import tiny_model

    model, seqs = _setup("qwen3_moe")
    seqs = seqs[:2]
    reference = copy.deepcopy(model).train()
    batch = record(reference, seqs)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "ep"))
    par = parallelize(model.train(), mesh, replica_slots=1, gpus_per_node=2, reduction="sum")
    L = len(batch.traces[0].layer_ids)
    plan = hot_replica_plan(L, 8, 2, 2, _hot(batch, [[0, 1]])[0], seed=5)  # M = 1: sample g on EP rank g
    par.relayout(plan)
    rounds = par.micro_batches(plan)
    assert rounds == ([0] if par.dp_rank == 0 else [None])
    denom = sum(len(s) - 1 for s in seqs)
    for m in rounds:
        mine = [] if m is None else [par.ep_rank]
        ids, mask, labels = batch_rows(seqs, mine)
        with par.replay(batch, plan, m, attention_mask=mask) as rows:
            assert rows == mine
            loss = lm_loss_sum(model, ids, mask, labels) / denom
            loss.backward()
        if m is None:  # a placeholder round: served by no expert
            assert all(layer.last_load == 0 for layer in model.modules() if hasattr(layer, "home_experts"))
    par.reduce_expert_grads()
    grads = par.full_grads()
    rids, rmask, rlabels = batch_rows(seqs, [0, 1])
    (lm_loss_sum(reference, rids, rmask, rlabels) / denom).backward()
    ref_grads = {n: p.grad for n, p in reference.named_parameters() if p.grad is not None}
    _compare("grad", grads, ref_grads, rtol=1e-4, atol=1e-6)
    # clipping to half the norm scales every gradient, dense and expert, by the same factor
    ref_norm = float(torch.sqrt(sum((g.double() ** 2).sum() for g in ref_grads.values())))
    norm = par.clip_grad_norm_(ref_norm / 2)
    assert abs(float(norm) - ref_norm) <= 1e-4 * ref_norm
    clipped = {n: g * (ref_norm / 2) / (ref_norm + 1e-6) for n, g in ref_grads.items()}
    _compare("clipped grad", par.full_grads(), clipped, rtol=3e-4, atol=1e-6)

    # a plan for another EP size
    other = hot_replica_plan(L, 8, 4, 2, np.zeros(L, np.int64), seed=0)
    for call in (lambda: par.micro_batches(other), lambda: par.relayout(other)):
        with pytest.raises(PlanError, match=r"num_gpus=4.*'ep' has size 2"):
            call()
    # dp ranks given different placements: every rank raises, nothing moves
    eg = np.stack([np.roll(np.arange(8) // 4, par.dp_rank)] * L)
    with pytest.raises(PlanError, match="dp rank . was given a different placement"):
        par.relayout(eg)
    # an EP size that does not divide the experts
    with pytest.raises(ValueError, match=r"'ep' has size 2, which does not divide num_experts=3"):
        check_mesh(mesh, 3)
    flat = mesh._flatten("all_ranks")
    with pytest.raises(ValueError, match="must be 2-D with dimensions"):
        check_mesh(flat, 8)
    six = tiny_model("olmoe", num_layers=2, num_experts=6)
    with pytest.raises(ValueError, match="'ep' has size 4, which does not divide num_experts=6"):
        parallelize(six, init_device_mesh("cpu", (1, 4), mesh_dim_names=("dp", "ep")))
    # FSDP applied to the expert parameters (double sharding)
    with pytest.raises(ValueError, match="fully_shard was already applied"):
        parallelize(model, mesh)
    double = swap_moe_blocks(tiny_model("qwen3_moe"), ep_group=mesh)  # a 2-D mesh: its "ep" dimension
    assert {(layer.rank, layer.world_size) for layer in double.modules() if hasattr(layer, "home_experts")} == \
        {(par.ep_rank, 2)}
    fully_shard(double, mesh=flat)
    with pytest.raises(ValueError, match=r"expert parameter 'model\.layers\.0\.mlp\.experts\.gate_up_proj' is a "
                                         r"DTensor"):
        check_experts_not_sharded(double)
    double.unshard()  # unsharded (plain tensors, as during a forward): still found through FSDP's state
    with pytest.raises(ValueError, match=r"'model\.layers\.0\.mlp\.experts\.gate_up_proj' is managed by "
                                         r"fully_shard on module '<root>'"):
        check_experts_not_sharded(double)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_fsdp_placeholder_round_and_bad_input():
    """A plan with one micro-batch on dp 2: dp rank 1 runs a placeholder round (no expert, no gradient) and
    the gradients equal the plain HF step on that micro-batch. Then each bad input raises its error on
    every rank: a plan for 4 EP ranks on an ep-2 mesh, dp ranks given different placements, an ep size
    that does not divide the experts (3 on ep 2; 6 on a 1 x 4 mesh), a non-2-D mesh, parallelize on an
    already sharded model, and FSDP applied to the expert parameters (a DTensor expert, by name)."""
    run_group(_placeholder_and_errors_worker, 4, timeout_s=300)


def _fsdp_trained(rank: int, seed: int, placement_seed: int):
    """A tiny Qwen3-MoE under ``parallelize`` on a 1 x 2 mesh (EP 2), AdamW after one step on rank g's sample,
    then its experts (and their AdamW state) moved to a random placement."""
    from torch.distributed.device_mesh import init_device_mesh

    from relibra_moe.integrations.fsdp import parallelize

    model, seqs = _setup("qwen3_moe", seed=seed)
    mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp", "ep"))
    par = parallelize(model.train(), mesh, reduction="sum")
    opt = torch.optim.AdamW(par.param_groups(), lr=LR)
    par.shard_checkpoints(opt)
    ids, mask, labels = batch_rows(seqs, [rank])
    lm_loss_sum(model, ids, mask, labels).backward()
    par.reduce_expert_grads()
    opt.step()
    rng = np.random.default_rng(placement_seed)
    L = sum(1 for m in model.modules() if hasattr(m, "home_experts"))
    par.relayout(np.stack([rng.permutation(np.arange(8) // 4) for _ in range(L)]), opt)
    return model, par, opt


def _fsdp_whole(model, par, opt) -> dict:
    """The plain HF state dict (``par.full_state_dict``) and every expert's whole AdamW ``exp_avg``."""
    from relibra_moe.layers.expert_sharding import expert_shards, gather_experts

    out = par.full_state_dict()
    params = dict(model.named_parameters())
    for key, shard in expert_shards(model).items():
        out[key + ".exp_avg"] = gather_experts(opt.state[params[key]]["exp_avg"], shard)
    return out


def _fsdp_dcp_worker(rank: int, world: int, folder: str) -> None:
    """torch's DCP through torch.distributed.checkpoint.state_dict (get_/set_model_state_dict, get_/set_optimizer_
    state_dict) on the FSDP2 + EP model: saved after a relayout, loaded into a model with other values and another
    placement, every expert row, dense parameter and expert AdamW state comes back on every rank."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    model, par, opt = _fsdp_trained(rank, seed=0, placement_seed=1)
    want = _fsdp_whole(model, par, opt)
    dcp.save({"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)},
             checkpoint_id=folder)
    if rank == 0:
        torch.save(want, f"{folder}/want.pt")
    other, other_par, other_opt = _fsdp_trained(rank, seed=1, placement_seed=2)
    sd = {"model": get_model_state_dict(other), "optim": get_optimizer_state_dict(other, other_opt)}
    dcp.load(sd, checkpoint_id=folder)
    set_model_state_dict(other, sd["model"])
    set_optimizer_state_dict(other, other_opt, sd["optim"])
    got = _fsdp_whole(other, other_par, other_opt)
    _compare("dcp", got, want, rtol=0, atol=0)


@pytest.mark.timeout(400)
def test_fsdp_dcp_checkpoint_holds_every_expert(tmp_path):
    """DCP of the FSDP2 + EP model (2 EP ranks, experts moved): every expert restored on every rank into another
    placement, AdamW state too, and into the plain single-process HF model."""
    import torch.distributed.checkpoint as dcp

    run_group(_fsdp_dcp_worker, 2, str(tmp_path), timeout_s=150)
    want = torch.load(tmp_path / "want.pt")
    plain, _ = _setup("qwen3_moe", seed=2)
    sd = plain.state_dict()
    dcp.load({"model": sd}, checkpoint_id=str(tmp_path), no_dist=True)
    plain.load_state_dict(sd)
    for name, p in plain.state_dict().items():
        torch.testing.assert_close(p, want[name], atol=0, rtol=0, msg=name)
