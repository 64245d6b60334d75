"""Adversarial inputs on one rank of a 2-rank gloo EP group: every rank must raise the same named error
from the same forward's agreement (one exchange), naming the rank that found it, within seconds; a plan
slice followed by some ranks only (or another micro-batch) is a ``PlanError`` on every rank.

All cases run in one process group (the group is reused after each error, which also proves it stays
usable); the group's timeout is short so a hang fails the test, and each case is timed: a case that
finishes by timing out would take longer than the bound asserted here."""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from relibra_moe.layers.testing import hot_replica_plan, run_group

H, FF, E, K = 8, 8, 4, 2
CASE_SECONDS = 10.0  # the bound per case, generous for a contended 2-core box (the group times out at 3x)


def _two_mb_plan(num_layers: int, seed: int):
    """A 2-rank, 2-micro-batch plan: micro-batch m replicates expert ``m`` of every layer on its home's partner."""
    from relibra_moe.plan import BatchPlan, ReplicaPlan, SamplePlacement

    parts = [hot_replica_plan(num_layers, E, 2, 2, np.full(num_layers, m), seed) for m in range(2)]
    idx = [p.replicas.split_index.copy() for p in parts]
    idx[1][:, 0] = 1
    replicas = ReplicaPlan(np.concatenate([p.replicas.replica_expert for p in parts]), np.concatenate(idx),
                           np.concatenate([p.replicas.split_share for p in parts]), parts[0].replicas.scope)
    return BatchPlan(parts[0].placement, SamplePlacement(np.array([0, 0, 1, 1]), np.array([0, 1, 0, 1]), 2),
                     replicas, num_gpus=2, gpus_per_node=2)


def _model(num_layers: int, buf) -> nn.Module:
    from relibra_moe.layers.moe import ReplayBalancedMoE

    torch.manual_seed(0)
    return nn.Sequential(*[ReplayBalancedMoE(H, FF, E, K, layer_index=i, replica_buffer=buf)
                           for i in range(num_layers)])


def _worker(rank: int, world: int, out_dir: str) -> None:
    from relibra_moe.errors import PlanError, ReplayError
    from relibra_moe.layers.relayout import relayout
    from relibra_moe.layers.replica_buffer import LayerSharedReplicaBuffer

    buf = LayerSharedReplicaBuffer(H, FF, 1)
    model = _model(2, buf)
    plan = _two_mb_plan(2, seed=3)
    relayout(model, plan.placement)
    torch.manual_seed(1)
    x = torch.randn(6, H)
    ids = [torch.tensor([[0, 1], [1, 2], [2, 3], [3, 0], [0, 2], [1, 3]]) for _ in range(2)]
    one = rank == 1  # the rank with the bad input
    cases = {
        "x_hidden": lambda: model(torch.randn(6, H + 1) if one else x),
        "x_int_dtype": lambda: model(torch.ones(6, H, dtype=torch.int64) if one else x),
        "ids_3_layers": lambda: _run(model, ids + [ids[0]] if one else ids, x),
        "ids_out_of_range": lambda: _run(model, [ids[0], torch.full((6, 2), E) if one else ids[1]], x),
        "plan_3_layers": lambda: _run(model, ids, x, _two_mb_plan(3, seed=3) if one else plan, 0),
        "plan_on_rank0_only": lambda: _run(model, ids, x, None if one else plan, 0),
        "other_micro_batch": lambda: _run(model, ids, x, plan, 1 if one else 0),
        "traces_3_layers": lambda: _run_traces(model, 3 if one else 2),
        "relayout_ragged": lambda: _relayout(model, [[0, 1, 0, 1], [0]] if one else plan.placement),
        "mask_numpy": lambda: _run_traces(model, 2, np.ones((1, 6), np.int64) if one else torch.ones(1, 6)),
        "valid_plan": lambda: _run(model, ids, x, plan, 1),
        "valid_no_plan": lambda: _run(model, ids, x),
    }
    report = {}
    for name, fn in cases.items():
        t0 = time.perf_counter()
        try:
            out = fn()
            res = {"ok": out.detach().double().sum().item()}
        except (ReplayError, PlanError) as exc:
            res = {"cls": type(exc).__name__, "msg": str(exc)}
        res["secs"] = time.perf_counter() - t0
        report[name] = res
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(report))


def _run(model: nn.Module, ids, x: torch.Tensor, plan=None, micro_batch=None) -> torch.Tensor:
    from relibra_moe.layers.replay import replay

    with replay(model, ids, plan=plan, micro_batch=micro_batch):
        return model(x)


def _relayout(model: nn.Module, placement) -> torch.Tensor:
    from relibra_moe.layers.relayout import relayout

    relayout(model, placement)
    return torch.zeros(1)


def _run_traces(model: nn.Module, num_layers: int, attention_mask=None) -> torch.Tensor:
    """Replay one recorded sequence of 6 tokens; a rank whose routing is refused at entry gets no rows and
    runs the placeholder forward (one token), which raises with every rank."""
    from relibra_moe.layers.replay import replay
    from relibra_moe.trace import RoutingTrace

    tr = RoutingTrace(np.tile(np.array([0, 3], np.int16), (6, num_layers, 1)), np.arange(num_layers), E, K)
    with replay(model, [tr], attention_mask=attention_mask) as rows:
        x = torch.randn(6 if rows else 1, H)
        return model(x)


@pytest.fixture(scope="module")
def reports() -> list[dict]:
    with tempfile.TemporaryDirectory(prefix="relibra-adv-ranks-") as tmp:
        run_group(_worker, 2, tmp, timeout_s=3 * CASE_SECONDS)
        return [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case, cls, found", [
    ("x_hidden", "ReplayError", "x has shape (6, 9), expected [..., hidden=8]"),
    ("x_int_dtype", "ReplayError", "x has dtype torch.int64, expected a floating-point tensor"),
    ("ids_3_layers", "ReplayError", "replayed ids cover 3 MoE layers, the model has 2"),
    ("ids_out_of_range", "ReplayError", "replayed id [0, 0] = 4 is outside"),
    ("plan_3_layers", "PlanError", "the plan covers 3 MoE layers, the model has 2"),
    ("traces_3_layers", "ReplayError", "routing covers 3 MoE layers, the model has 2"),
])
def test_bad_input_on_one_rank_raises_the_same_error_on_every_rank(reports, case, cls, found):
    r0, r1 = reports[0][case], reports[1][case]
    assert r0.get("cls") == cls and r1.get("cls") == cls, (r0, r1)
    assert r0["msg"] == r1["msg"], (r0, r1)  # the same error, word for word
    assert "rank 1 of the EP group rejected" in r0["msg"] and found in r0["msg"], r0
    assert r0["secs"] < CASE_SECONDS and r1["secs"] < CASE_SECONDS, (r0, r1)


@pytest.mark.timeout(120)
def test_unreadable_arguments_on_one_rank_raise_on_every_rank(reports):
    """A ragged placement list given to relayout, and a numpy attention_mask given to replay, on rank 1 only:
    every rank raises the named error (through the agreement), none waits."""
    r0, r1 = reports[0]["relayout_ragged"], reports[1]["relayout_ragged"]
    assert r0.get("cls") == r1.get("cls") == "PlanError", (r0, r1)
    assert "rank 1 of the EP group rejected the placement" in r0["msg"], r0
    assert "placement could not be read as expert_gpu [L, E]" in r1["msg"], r1
    r0, r1 = reports[0]["mask_numpy"], reports[1]["mask_numpy"]
    assert r0.get("cls") == r1.get("cls") == "ReplayError" and r0["msg"] == r1["msg"], (r0, r1)
    assert "rank 1 of the EP group rejected its replay data: replay: attention_mask must be a torch.Tensor " \
        "[B, S], got ndarray" in r0["msg"], r0
    for case in ("relayout_ragged", "mask_numpy"):
        assert reports[0][case]["secs"] < CASE_SECONDS and reports[1][case]["secs"] < CASE_SECONDS


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case, rank1_follows", [
    ("plan_on_rank0_only", "rank 1 follows no plan"),
    ("other_micro_batch", "rank 1 follows micro-batch 1 of layer 0 of its plan"),
])
def test_ranks_following_different_plan_slices_raise_plan_error(reports, case, rank1_follows):
    r0, r1 = reports[0][case], reports[1][case]
    assert r0.get("cls") == "PlanError" and r0["msg"] == r1.get("msg"), (r0, r1)
    assert "follow different plan slices: rank 0 follows micro-batch 0 of layer 0 of its plan (digest " \
        in r0["msg"] and rank1_follows in r0["msg"], r0
    assert r0["secs"] < CASE_SECONDS and r1["secs"] < CASE_SECONDS, (r0, r1)


@pytest.mark.timeout(120)
def test_group_still_serves_valid_forwards_after_the_errors(reports):
    for case in ("valid_plan", "valid_no_plan"):
        r0, r1 = reports[0][case], reports[1][case]
        assert "ok" in r0 and "ok" in r1, (case, r0, r1)
    # a plan never changes the math: the same ids give the same outputs with and without it
    for r in reports:
        assert abs(r["valid_plan"]["ok"] - r["valid_no_plan"]["ok"]) < 1e-4, r


# ----------------------------------------------------------------------------- peers failing past the agreement


class _Boom:
    """The layer's dispatcher, except that ``dispatch`` raises (or, ``kill``, ends the process) on this rank."""

    def __init__(self, inner, kill: bool) -> None:
        self.inner, self.kill = inner, kill

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def dispatch(self, *args):
        if self.kill:
            import os

            os._exit(0)  # noqa: SLF001 - a rank that dies mid-dispatch
        raise RuntimeError("boom in dispatch")


def _failing_worker(rank: int, world: int, out_dir: str, case: str) -> None:
    from relibra_moe.layers.dispatch import set_collective_timeout
    from relibra_moe.layers.relayout import relayout
    from relibra_moe.layers.replica_buffer import LayerSharedReplicaBuffer

    set_collective_timeout(3 * CASE_SECONDS)
    buf = LayerSharedReplicaBuffer(H, FF, 1)
    model = _model(2, buf)
    plan = _two_mb_plan(2, seed=3)
    relayout(model, plan.placement)
    torch.manual_seed(1)
    x = torch.randn(6, H, requires_grad=True)
    ids = [torch.tensor([[0, 1], [1, 2], [2, 3], [3, 0], [0, 2], [1, 3]]) for _ in range(2)]
    _run(model, ids, x, plan, 0).sum().backward()  # warm (the first kernel call imports torch._dynamo: slow)
    if rank == 1:
        if case == "experts":
            def mlp(*args):
                raise RuntimeError("boom in expert compute")

            model[1].experts.mlp = mlp
        else:
            model[1].dispatcher = _Boom(model[1].dispatcher, kill=case == "killed")
    t0 = time.perf_counter()
    try:
        _run(model, ids, x, plan, 0).sum().backward()
        res = {"ok": True}
    except Exception as exc:  # noqa: BLE001 - the report names what was raised
        res = {"cls": type(exc).__name__, "msg": str(exc)}
    res["secs"] = time.perf_counter() - t0
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(res))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case, stage, text", [
    ("dispatch", "dispatch", "RuntimeError: boom in dispatch"),
    ("experts", "experts", "RuntimeError: boom in expert compute"),
])
def test_a_rank_failing_mid_forward_makes_the_other_raise_by_name(case, stage, text):
    """Rank 1 raises in layer 1's dispatch (or expert compute), past the micro-batch's agreement: it re-raises
    its own error, and rank 0, waiting in a collective, raises ReplayError naming the layer, the stage and
    rank 1 within seconds (not gloo's timeout text after the process group's timeout)."""
    with tempfile.TemporaryDirectory(prefix="relibra-adv-peer-") as tmp:
        run_group(_failing_worker, 2, tmp, case, timeout_s=6 * CASE_SECONDS)
        r0, r1 = (json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(2))
    assert r1.get("cls") == "RuntimeError" and text.split(": ")[1] in r1["msg"], r1
    assert r0.get("cls") == "ReplayError", r0
    assert f"layer moe[1]: rank 1 of the EP group stopped in stage '{stage}' ({text})" in r0["msg"], r0
    assert r0["secs"] < CASE_SECONDS, r0


@pytest.mark.timeout(300)
def test_a_killed_rank_gives_a_named_error():
    """Rank 1 dies inside layer 1's dispatch: rank 0 raises ReplayError naming the layer and the stage it waited
    in (gloo's connection error, or the deadline), within seconds."""
    with tempfile.TemporaryDirectory(prefix="relibra-adv-kill-") as tmp:
        run_group(_failing_worker, 2, tmp, "killed", timeout_s=6 * CASE_SECONDS)
        r0 = json.loads(Path(tmp, "rank0.json").read_text())
        assert not Path(tmp, "rank1.json").exists()
    assert r0.get("cls") == "ReplayError", r0
    assert r0["msg"].startswith("layer moe[1]: stage 'dispatch': a peer of the EP group"), r0
    assert "gloo" not in r0["msg"] and "pair.cc" not in r0["msg"], r0
    assert r0["secs"] < 3 * CASE_SECONDS, r0
