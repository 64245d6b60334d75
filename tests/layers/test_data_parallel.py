"""Expert parallelism under DistributedDataParallel: 2 gloo ranks, tiny Qwen3-MoE, fp32, default aux loss.

The reference is the plain HF model in each process on the whole batch: loss = mean over ranks of each
rank's mean loss (what DDP's gradient averaging computes). The swapped model (experts sharded over both
ranks, relayout to a permuted placement, a replica of each layer's hot expert with a 60/40 token split)
is wrapped in DDP as a user does; every gradient (dense ones after DDP's all-reduce, expert rows at their
homes) must equal the reference, so must the global-norm clip. Without the expert gradient scaling the
expert gradients come out exactly 2x, and without the ignore list DDP would broadcast rank 0's experts.
A DDP wrapper around a new container is refused by name on every rank.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from relibra_moe.layers.testing import hot_replica_plan, kernel_backend, run_group  # noqa: E402

IDS = [[5, 6, 7, 9, 11, 13, 17, 4], [3, 4, 5, 6, 7, 8, 21, 30]]
MAX_NORM = 0.05


def _loss(model, ids):
    out = model(input_ids=ids, labels=ids, output_router_logits=True)
    return out.loss


class _Container(torch.nn.Module):
    """A user's own wrapper around the swapped model (it carries no ignore list)."""

    def __init__(self, model):
        super().__init__()
        self.inner = model

    def forward(self, ids):
        return _loss(self.inner, ids)


def _worker(rank: int, world_size: int, out_dir: str) -> None:
    from torch.nn.parallel import DistributedDataParallel as DDP

    from relibra_moe.errors import ReplayError
    from relibra_moe.integrations.hf import RoutingRecorder, moe_blocks, replay, swap_moe_blocks
    from relibra_moe.integrations.hf_tiny import tiny_model
    from relibra_moe.layers.data_parallel import clip_grad_norm_
    from relibra_moe.layers.relayout import relayout
    from relibra_moe.triton_kernels.backend import force_backend

    ids = torch.tensor(IDS)
    report: dict = {}
    with force_backend(kernel_backend()):
        ref = tiny_model("qwen3_moe", seed=7).train()
        assert ref.config.router_aux_loss_coef > 0
        with RoutingRecorder(ref) as rec:
            ref_losses = [_loss(ref, ids[r:r + 1]) for r in range(world_size)]
        (sum(ref_losses) / world_size).backward()
        traces = rec.traces()
        counts = sum(t.expert_counts() for t in traces)
        plan = hot_replica_plan(len(traces[0].layer_ids), 8, 2, 2, counts.argmax(1), seed=3)

        model = swap_moe_blocks(tiny_model("qwen3_moe", seed=7), replica_slots=1, gpus_per_node=2).train()
        report["ignored"] = sorted(model._ddp_params_and_buffers_to_ignore)
        relayout(model, plan.placement)
        ddp = DDP(model)
        with replay(model, traces, plan, micro_batch=0) as rows:
            assert rows == [rank]
            loss = _loss(ddp, ids[rows])
        loss.backward()
        report["loss_err"] = abs(float(loss) - float(ref_losses[rank])) / abs(float(ref_losses[rank]))

        ref_grads = dict(ref.named_parameters())
        home = {name: torch.as_tensor(b.home_experts) for _, name, b in moe_blocks(model)}

        def grad_errors() -> dict:
            errs = {}
            for name, p in model.named_parameters():
                r = ref_grads[name].grad
                if ".experts." in name:
                    r = r[home[name.split(".experts.")[0]]]
                errs[name] = float((p.grad - r).abs().max()) / (float(r.abs().max()) + 1e-12)
            return errs

        report["grad_err"] = grad_errors()
        report["expert_scale"] = max(float(b.dp_grad_scale) for _, _, b in moe_blocks(model))
        total_ref = torch.nn.utils.clip_grad_norm_(ref.parameters(), MAX_NORM)
        total = clip_grad_norm_(ddp, MAX_NORM)
        report["norm"] = [float(total), float(total_ref)]
        report["clipped_grad_err"] = max(grad_errors().values())
        inf = float("inf")  # the max-norm: a max over the EP group, nothing clipped (max_norm = inf)
        report["inf_norm"] = [float(clip_grad_norm_(ddp, inf, norm_type=inf)),
                              float(torch.nn.utils.clip_grad_norm_(ref.parameters(), inf, norm_type=inf))]

        # a DDP wrapper around a new container manages the experts: refused by name on every rank
        other = swap_moe_blocks(tiny_model("qwen3_moe", seed=7)).train()
        wrapped = DDP(_Container(other))
        try:
            wrapped(ids[rank:rank + 1])
            report["refused"] = "not refused"
        except ReplayError as exc:
            report["refused"] = str(exc)
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(report))


@pytest.mark.timeout(180)
def test_ddp_wrapped_swapped_model_equals_single_process_reference():
    with tempfile.TemporaryDirectory(prefix="relibra-ddp-") as tmp:
        run_group(_worker, 2, tmp, timeout_s=60)
        reports = [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(2)]
    for rep in reports:
        assert "model.layers.0.mlp.experts.gate_up_proj" in rep["ignored"]
        assert "model.layers.2.mlp.experts.down_proj" in rep["ignored"]
        assert rep["loss_err"] <= 1e-6, rep["loss_err"]
        assert len(rep["grad_err"]) > 20
        worst = max(rep["grad_err"], key=rep["grad_err"].get)
        assert rep["grad_err"][worst] <= 1e-5, (worst, rep["grad_err"][worst])
        assert rep["expert_scale"] == 0.5
        total, total_ref = rep["norm"]
        assert total_ref > 2 * MAX_NORM  # the clip is active
        assert abs(total - total_ref) <= 1e-5 * total_ref, rep["norm"]
        assert rep["clipped_grad_err"] <= 1e-5
        assert abs(rep["inf_norm"][0] - rep["inf_norm"][1]) <= 1e-5 * rep["inf_norm"][1], rep["inf_norm"]
        assert "DistributedDataParallel manages the expert parameters ['inner.model.layers.0.mlp.experts." \
            in rep["refused"], rep["refused"]
        assert "mark_experts_for_ddp(wrapper)" in rep["refused"]
