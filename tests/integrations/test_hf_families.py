"""Swapped HF blocks under expert parallelism with a replica plan: 2 gloo ranks (one node of 2).

For a sigmoid/group-limited router with shared experts (DeepSeek-V3), a gated shared expert (Qwen2-MoE)
and fp32 gates (Mixtral): the swapped model on 2 ranks, after relayout to a permuted placement and with
a replica of a hot expert whose tokens are split between home and replica, gives the plain HF model's
logits and gradients (every parameter; expert rows at their home ranks) under replay of the HF routing.

GPT-OSS (four per-expert tensors: interleaved gate/up weights, their biases, down weights and biases)
under expert parallelism with replica slots, against the single-process HF model.

On 2 gloo ranks (2 logical nodes of 1 GPU, a global-scope plan: replicas on the other node) and on 4
(2 nodes x 2, a node-scoped plan): the swapped model, after relayout to a permuted placement and with a
replica of every layer's hottest expert (its tokens split 60/40 between home and replica), gives the HF
model's logits and the gradients of every parameter (expert rows, biases included, at their home ranks)
under replay of the HF routing (fp32, rtol 1e-5). ``state_dict()`` keeps HF's names and
``full_state_dict`` gathers HF's values before and after relayout; relayout of the experts, their
gradients and AdamW state (biases included) followed by the inverse relayout is bitwise the identity.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import torch.distributed as dist  # noqa: E402

from relibra_moe.layers.testing import hot_replica_plan, kernel_backend, rank_device, run_group  # noqa: E402

FAMILIES = ("deepseek_v3", "qwen2_moe", "mixtral")
IDS = [[5, 6, 7, 9, 11, 13, 17], [3, 4, 5, 6, 7, 8, 0]]
MASK = [[1] * 7, [1] * 6 + [0]]


def _worker(rank: int, world_size: int, out_dir: str) -> None:
    from relibra_moe.integrations.hf import RoutingRecorder, moe_blocks, replay, swap_moe_blocks
    from relibra_moe.integrations.hf_tiny import tiny_model
    from relibra_moe.layers.relayout import relayout
    from relibra_moe.triton_kernels.backend import force_backend

    ids, mask = torch.tensor(IDS), torch.tensor(MASK)
    report = {}
    dev = rank_device()
    with force_backend(kernel_backend()):
        for fam in FAMILIES:
            with torch.device("cpu"):  # tiny_model draws from a CPU generator
                ref = tiny_model(fam, seed=5).to(dev).train()
            with RoutingRecorder(ref) as rec:
                out_ref = ref(ids, attention_mask=mask).logits
            (out_ref[mask.bool()].square().mean()).backward()
            traces = rec.traces()
            counts = sum(t.expert_counts() for t in traces)  # [L, E]
            plan = hot_replica_plan(len(traces[0].layer_ids), 8, 2, 2, counts.argmax(1), seed=1)

            with torch.device("cpu"):
                hf = tiny_model(fam, seed=5).to(dev)
            model = swap_moe_blocks(hf, replica_slots=1, gpus_per_node=2).train()
            relayout(model, plan.placement)
            row = [rank]
            with replay(model, traces, plan, micro_batch=0) as rows:
                assert rows == row, rows
                x, m = ids[row], mask[row]
                n = int(m.sum())
                out = model(x[:, :n], attention_mask=m[:, :n]).logits
            # the same loss split over ranks: sum of squares over all valid logits / their count
            loss = out.square().sum() / (mask.sum() * out.shape[-1])
            loss.backward()
            logit_err = float((out[0] - out_ref[rank, :n]).detach().abs().max())
            grad_err, names = 0.0, 0
            ref_grads = dict(ref.named_parameters())
            home = {name: torch.as_tensor(b.home_experts) for _, name, b in moe_blocks(model)}
            for name, p in model.named_parameters():
                g = p.grad if p.grad is not None else torch.zeros_like(p)
                r = ref_grads[name].grad
                if ".experts." in name:
                    r = r[home[name.split(".experts.")[0]]]
                else:
                    dist.all_reduce(g)
                grad_err = max(grad_err, float((g - r).abs().max()) / (float(r.abs().max()) + 1e-12))
                names += 1
            fills = moe_blocks(model)[0][2].replica_buffer.fills
            report[fam] = {"logit_err": logit_err, "grad_err": grad_err, "params": names, "fills": fills}
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(report))


@pytest.mark.timeout(300)
def test_swapped_blocks_follow_a_replica_plan_on_two_ranks():
    with tempfile.TemporaryDirectory(prefix="relibra-hf-ep-") as tmp:
        run_group(_worker, 2, tmp, timeout_s=120)
        reports = [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(2)]
    for rep in reports:
        assert set(rep) == set(FAMILIES)
        for fam, r in rep.items():
            assert r["logit_err"] <= 1e-5, (fam, r)
            assert r["grad_err"] <= 1e-4, (fam, r)
            assert r["fills"] >= 2, (fam, r)  # forward fill + backward refill of the shared buffer


def _bad_rank_worker(rank: int, world_size: int, out_dir: str) -> None:
    """Rank 1 brings bad replay data (found by the layer, and by replay() before the forward); every rank
    must raise ReplayError from the same forward, and the group must stay usable afterwards."""
    from relibra_moe.errors import ReplayError
    from relibra_moe.integrations.hf import replay, swap_moe_blocks
    from relibra_moe.integrations.hf_tiny import tiny_model
    from relibra_moe.layers.moe import ReplayBalancedMoE
    from relibra_moe.trace import RoutingTrace

    report = {}
    torch.manual_seed(0)
    from relibra_moe.layers.replay import replay as replay_layer

    layer = ReplayBalancedMoE(8, 8, 4, 2, layer_index=0)
    x = torch.randn(4, 8)
    ids = torch.tensor([[0, 3]] * (4 if rank == 0 else 3))  # rank 1: 3 rows for 4 tokens
    try:
        with replay_layer(layer, [ids]):
            layer(x)
        report["layer"] = "no error"
    except ReplayError as exc:
        report["layer"] = str(exc)
    with replay_layer(layer, [torch.tensor([[0, 3]] * 4)]):
        report["layer_after"] = float(layer(x).abs().sum())  # the group still works
    from relibra_moe.errors import PlanError
    from relibra_moe.plan import ReplicaPlan

    plan = ReplicaPlan.empty(2, 1, 2, 0)
    try:
        with replay_layer(layer, None, plan=plan, micro_batch=0 if rank == 0 else 2):  # rank 1: no micro-batch 2
            layer(x)
        report["plan"] = "no error"
    except PlanError as exc:
        report["plan"] = str(exc)

    with torch.device("cpu"):
        hf = tiny_model("qwen3_moe", seed=1).to(rank_device())
    model = swap_moe_blocks(hf)
    n_moe = len([m for m in model.modules() if isinstance(m, ReplayBalancedMoE)])
    tr = RoutingTrace(np.tile(np.array([1, 6], np.int16), (4, n_moe, 1)),
                      [b.layer_id for b in model.modules() if isinstance(b, ReplayBalancedMoE)], 8, 2)
    mask = torch.tensor([[1, 1, 1, 1]] if rank == 0 else [[0, 1, 1, 1]])  # rank 1: 3 ones for 4 tokens
    try:
        with replay(model, [tr], attention_mask=mask), torch.no_grad():
            model(torch.tensor([[3, 4, 5, 6]]), attention_mask=mask)
        report["hf"] = "no error"
    except ReplayError as exc:
        report["hf"] = str(exc)
    # the HF layers agree on the plan slice too: a plan on rank 0 only is a PlanError on every rank
    ids = [torch.tensor([[1, 6]] * 4)] * n_moe
    try:
        with replay(model, ids, plan=ReplicaPlan.empty(1, n_moe, 2, 0) if rank == 0 else None), torch.no_grad():
            model(torch.tensor([[3, 4, 5, 6]]))
        report["hf_plan"] = "no error"
    except PlanError as exc:
        report["hf_plan"] = str(exc)
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(report))


@pytest.mark.timeout(120)
def test_bad_replay_data_on_one_rank_raises_on_every_rank():
    with tempfile.TemporaryDirectory(prefix="relibra-hf-bad-") as tmp:
        run_group(_bad_rank_worker, 2, tmp, timeout_s=30)
        r0, r1 = (json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(2))
    assert "rank 1 of the EP group rejected its replay data" in r0["layer"], r0
    assert "cover 3 tokens, the batch has 4" in r1["layer"], r1
    assert r0["layer_after"] > 0 and r1["layer_after"] > 0
    assert "rank 1 of the EP group rejected its plan" in r0["plan"], r0
    assert "micro_batch=2 is outside [0, 2)" in r1["plan"], r1
    assert "rank 1 of the EP group rejected its replay data" in r0["hf"], r0
    assert "attention_mask row has 3 ones" in r1["hf"], r1
    assert r0["hf_plan"] == r1["hf_plan"], (r0, r1)
    assert "follow different plan slices: rank 0 follows micro-batch 0 of layer 0 of its plan" in r0["hf_plan"] \
        and "rank 1 follows no plan" in r0["hf_plan"], r0


OSS_IDS = [[5, 6, 7, 9, 11, 13, 17], [3, 4, 5, 6, 7, 8, 0], [21, 22, 23, 24, 25, 26, 27], [30, 31, 32, 33, 3, 0, 0]]
OSS_MASK = [[1] * 7, [1] * 6 + [0], [1] * 7, [1] * 5 + [0] * 2]
E = 8
EXPERT_NAMES = ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")


def _expert_state(model, opt) -> list[torch.Tensor]:
    from relibra_moe.integrations.hf import moe_blocks

    out = []
    for _, _, block in moe_blocks(model):
        for p in block.experts.expert_tensors():
            st = opt.state[p]
            out += [p.detach().clone(), p.grad.clone(), st["exp_avg"].clone(), st["exp_avg_sq"].clone()]
    return out


def _oss_worker(rank: int, world: int, P: int) -> None:
    from relibra_moe.integrations.hf import RoutingRecorder, full_state_dict, moe_blocks, replay, swap_moe_blocks
    from relibra_moe.integrations.hf_tiny import tiny_model
    from relibra_moe.layers.relayout import relayout
    from relibra_moe.plan import Placement
    from relibra_moe.triton_kernels.backend import force_backend

    ids, mask = torch.tensor(OSS_IDS[:world]), torch.tensor(OSS_MASK[:world])
    dev = rank_device()
    with force_backend(kernel_backend()):
        with torch.device("cpu"):  # tiny_model draws from a CPU generator
            ref = tiny_model("gpt_oss", seed=5).to(dev).train()
        ref_sd = {k: v.detach().clone() for k, v in ref.state_dict().items()}
        with RoutingRecorder(ref) as rec:
            out_ref = ref(ids, attention_mask=mask).logits
        out_ref[mask.bool()].square().mean().backward()
        traces = rec.traces()
        counts = sum(t.expert_counts() for t in traces)  # [L, E]
        L = len(traces[0].layer_ids)
        plan = hot_replica_plan(L, E, world, P, counts.argmax(1), seed=1 + world)

        with torch.device("cpu"):
            hf = tiny_model("gpt_oss", seed=5).to(dev)
        model = swap_moe_blocks(hf, replica_slots=1, gpus_per_node=P).train()
        blocks = [b for _, _, b in moe_blocks(model)]
        assert all(b.world_size == world and b.experts.tensor_names == EXPERT_NAMES for b in blocks)
        assert blocks[0].replica_buffer.names == EXPERT_NAMES
        for b in blocks:  # this rank's rows only, under HF's names
            assert b.experts.gate_up_proj_bias.shape == (E // world, 32)
        assert list(model.state_dict()) == list(ref_sd)
        for stage in ("swapped", "relaid out"):
            if stage == "relaid out":
                relayout(model, plan.placement)
            full = full_state_dict(model)
            assert list(full) == list(ref_sd)
            for k, v in ref_sd.items():
                assert torch.equal(full[k], v), (stage, k)

        with replay(model, traces, plan, micro_batch=0) as rows:
            assert rows == [rank], rows
            n = int(mask[rank].sum())
            out = model(ids[rank:rank + 1, :n], attention_mask=mask[rank:rank + 1, :n]).logits
        # the reference loss split over ranks: sum of squares over all valid logits / their count
        (out.square().sum() / (mask.sum() * out.shape[-1])).backward()
        torch.testing.assert_close(out[0].detach(), out_ref[rank, :n].detach(), rtol=1e-5, atol=1e-6)
        ref_params = dict(ref.named_parameters())
        home = {name: torch.as_tensor(b.home_experts) for _, name, b in moe_blocks(model)}
        checked = 0
        for name, p in model.named_parameters():
            g = p.grad
            assert g is not None, name
            r = ref_params[name].grad
            if ".experts." in name:
                r = r[home[name.split(".experts.")[0]]]
            else:
                g = g.clone()
                dist.all_reduce(g)
            torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-5 * float(r.abs().max()), msg=name)
            checked += ".experts." in name
        assert checked == 4 * L
        buf = blocks[0].replica_buffer
        assert buf.fills >= 2 * L - 1  # forward fills + backward refills (the last layer still holds its own)
        # the hot experts' replica rows did compute: tokens landed in the replica slot of its holder
        holders = {l: int(np.flatnonzero(plan.replicas.replica_expert[0, l, :, 0] >= 0)[0]) for l in range(L)}
        for l, b in enumerate(blocks):
            if holders[l] == rank:
                assert b.last_slot_counts[E // world] > 0, (l, b.last_slot_counts)

        # frozen biases: the weights' gradients (replica add-back included) are unchanged, the biases get none
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        for name, p in model.named_parameters():
            p.grad = None
            p.requires_grad_(not name.endswith("_bias"))
        with replay(model, traces, plan, micro_batch=0):
            out = model(ids[rank:rank + 1, :n], attention_mask=mask[rank:rank + 1, :n]).logits
        (out.square().sum() / (mask.sum() * out.shape[-1])).backward()
        for name, p in model.named_parameters():
            if name.endswith("_bias"):
                assert p.grad is None, name
                p.requires_grad_(True)
            elif ".experts." in name:
                torch.testing.assert_close(p.grad, grads[name], rtol=1e-6, atol=1e-7, msg=name)
            p.grad = grads[name]  # the full gradients again, for the optimizer state below

        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        opt.step()
        before = _expert_state(model, opt)
        full_before = full_state_dict(model)
        info = relayout(model, Placement.static(L, E, world), opt)
        assert info["experts_moved"] > 0
        full_after = full_state_dict(model)
        for k in full_before:
            assert torch.equal(full_before[k], full_after[k]), k
        relayout(model, plan.placement, opt)
        after = _expert_state(model, opt)
        assert len(before) == len(after) == 4 * 4 * L
        for a, b in zip(before, after):
            assert torch.equal(a, b)  # relayout + inverse: weights, biases, grads, exp_avg, exp_avg_sq


@pytest.mark.timeout(180)
@pytest.mark.parametrize("world, gpus_per_node", [(2, 1), (4, 2)])
def test_gpt_oss_ep_replicas_match_hf(world, gpus_per_node):
    run_group(_oss_worker, world, gpus_per_node, timeout_s=90)
