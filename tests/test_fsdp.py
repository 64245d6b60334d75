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
ADAMW_PARAM_ATOL = 1e-2 * LR  # AdamW turns fp32 rounding of near-zero gradients into up to ~1% of a step


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
    assert [t.num_tokens for t in batch.traces] == list(LENGTHS)
    return batch


def _hot(batch, rows: list[list[int]]) -> np.ndarray:
    """``[2, L]`` the most loaded expert of each layer among the samples of each micro-batch."""
    out = []
    for samples in rows:
        ex = np.concatenate([batch.traces[i].experts for i in samples])  # [T, L, k]
        out.append([int(np.bincount(ex[:, li].ravel(), minlength=8).argmax()) for li in range(ex.shape[1])])
    return np.array(out)


def _compare(name: str, got: dict, ref: dict, rtol: float, atol: float) -> None:
    assert set(got) == set(ref), (name, sorted(set(got) ^ set(ref)))
    for k, r in ref.items():
        err = float((got[k] - r).abs().max())
        assert torch.allclose(got[k], r, rtol=rtol, atol=atol), f"{name} {k}: max abs err {err:.3g}"


def _train_worker(rank: int, world: int, family: str, checkpointing: bool, reduction: str, steps: int) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from relibra_moe.integrations.fsdp import expert_parameters, parallelize

    model, seqs = _setup(family)
    reference = copy.deepcopy(model).train()
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=LR, weight_decay=0.01)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "ep"))
    par = parallelize(model.train(), mesh, replica_slots=1, gpus_per_node=2, reduction=reduction,
                      activation_checkpointing=checkpointing)
    assert par.dp_size == par.ep_size == 2 and par.ep_rank == rank % 2 and par.dp_rank == rank // 2
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    denom = sum(n - 1 for n in LENGTHS)  # labelled tokens of the global batch
    for step in range(steps):
        batch = record(reference, seqs)  # each step replays the routing of the weights it trains
        hot = _hot(batch, [[0, 1], [2, 3]])
        plan = two_micro_batch_plan(len(batch.traces[0].layer_ids), 8, hot, seed=11 + step)
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
        calls = []
        for m in rounds:
            mine = [int(i) for i in np.flatnonzero((plan.samples.micro_batch == m) &
                                                   (plan.samples.gpu == par.ep_rank))]
            ids, mask, labels = batch_rows(seqs, mine)
            with par.replay(batch, plan, m, attention_mask=mask) as rows:
                assert rows == mine
                loss = lm_loss_sum(model, ids, mask, labels) / denom
                if reduction == "mean":  # FSDP's mean divides by the mesh size: each rank's loss is scaled up
                    loss = loss * world
                loss.backward()
                calls.append(sum(layer.last_load for layer in par.model.modules() if hasattr(layer, "last_load")))
            loss_sum += loss.detach() / (world if reduction == "mean" else 1)
        par.reduce_expert_grads()
        dist.all_reduce(loss_sum)
        grads = par.full_grads()
        opt.step()
        state = par.full_state_dict()

        ref_opt.zero_grad(set_to_none=True)
        rids, rmask, rlabels = batch_rows(seqs, list(range(len(seqs))))
        ref_loss = lm_loss_sum(reference, rids, rmask, rlabels) / denom
        ref_loss_value = float(ref_loss.detach())
        ref_loss.backward()
        ref_grads = {n: p.grad.detach().clone() for n, p in reference.named_parameters() if p.grad is not None}
        ref_opt.step()
        assert abs(float(loss_sum) - ref_loss_value) <= 1e-5 * max(1.0, ref_loss_value), (step, float(loss_sum),
                                                                                         ref_loss_value)
        if step == 0:
            _compare("grad", grads, ref_grads, rtol=1e-4, atol=1e-6)
        else:  # after an AdamW step the models differ by amplified rounding: normwise per tensor
            for k, r in ref_grads.items():
                assert float((grads[k] - r).abs().max()) <= 1e-3 * float(r.abs().max()) + 1e-6, k
        _compare("param", state, reference.state_dict(), rtol=1e-4, atol=ADAMW_PARAM_ATOL)
        assert float(torch.sqrt(sum((g ** 2).sum() for g in ref_grads.values()))) > 1e-3  # a real step


@pytest.mark.timeout(900)
@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_fsdp_ep_step_equals_plain_hf(family):
    """One step with a plan (replicas, non-identity placement), then a relayout to another placement and
    a second step (AdamW state moved with the experts): both equal the plain HF steps."""
    run_group(_train_worker, 4, family, False, "sum", 2, timeout_s=300)
