"""Swapped HF blocks under expert parallelism with a replica plan: 2 gloo ranks (one node of 2).

For a sigmoid/group-limited router with shared experts (DeepSeek-V3), a gated shared expert (Qwen2-MoE)
and fp32 gates (Mixtral): the swapped model on 2 ranks, after relayout to a permuted placement and with
a replica of a hot expert whose tokens are split between home and replica, gives the plain HF model's
logits and gradients (every parameter; expert rows at their home ranks) under replay of the HF routing.
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
