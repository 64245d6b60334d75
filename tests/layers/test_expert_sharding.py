"""The expert-sharding description (relibra_moe.layers.expert_sharding): which logical experts each rank's rows
hold, and a DCP round trip through it on 2 gloo ranks after the experts moved, into another placement and into
a whole ``[E, ...]`` tensor (the plain model's layout)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from relibra_moe.errors import PlanError
from relibra_moe.layers.expert_sharding import (
    expert_shards,
    gather_experts,
    local_experts,
    placement_keys,
    sharded_optimizer_state,
    sharded_state_dict,
)
from relibra_moe.layers.moe import ReplayBalancedMoE
from relibra_moe.layers.testing import run_group

E, H, F = 8, 6, 4


def expert_value(name: str, e: int, shape: tuple[int, ...]) -> torch.Tensor:
    """A tensor that names its logical expert and its tensor: ``e + 0.01 * arange`` (+100 for w_down)."""
    base = 100.0 if name == "w_down" else 0.0
    return base + e + 0.01 * torch.arange(int(np.prod(shape)), dtype=torch.float32).view(shape)


def fill_by_logical_id(layer: ReplayBalancedMoE) -> None:
    with torch.no_grad():
        for name, t in zip(layer.experts.tensor_names, layer.experts.expert_tensors()):
            for i, e in enumerate(layer.home_experts):
                t[i] = expert_value(name, int(e), tuple(t.shape[1:]))


def test_one_rank_shards_are_the_whole_tensor_in_logical_order():
    model = torch.nn.Sequential(ReplayBalancedMoE(H, F, E, 2))
    shards = expert_shards(model)
    assert sorted(shards) == ["0.experts.w_down", "0.experts.w_gate_up"]
    s = shards["0.experts.w_gate_up"]
    assert s.layer == "0" and s.num_experts == E and s.world_size == 1
    assert s.expert_ids.tolist() == list(range(E))
    assert placement_keys(model) == {"0.expert_gpu": "0"}
    w = model[0].experts.w_gate_up
    assert torch.equal(gather_experts(w, s), w.detach())
    assert torch.equal(local_experts(w.detach(), s), w.detach())
    # sharded_state_dict leaves one-rank entries as plain tensors
    sd = sharded_state_dict(model)
    assert isinstance(sd["0.experts.w_gate_up"], torch.Tensor)


def test_wrong_shapes_are_named():
    model = ReplayBalancedMoE(H, F, E, 2)
    s = expert_shards(model)["experts.w_down"]
    with pytest.raises(PlanError, match="experts.w_down.*8 rows"):
        local_experts(torch.zeros(3, 2), s)
    with pytest.raises(PlanError, match="does not hold the 8 home experts"):
        gather_experts(torch.zeros(3, 2), s)


def _placement(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).permutation(np.arange(E) // (E // 2)).astype(np.int64)


def _dcp_worker(rank: int, world: int, path: str) -> None:
    import torch.distributed.checkpoint as dcp

    torch.manual_seed(rank)
    model = torch.nn.Sequential(ReplayBalancedMoE(H, F, E, 2), ReplayBalancedMoE(H, F, E, 2))
    for i, layer in enumerate(model):
        layer.set_placement_row(_placement(10 + i))  # experts moved away from the contiguous layout
        fill_by_logical_id(layer)
    shards = expert_shards(model)
    assert shards["1.experts.w_down"].expert_ids.tolist() == np.flatnonzero(_placement(11) == rank).tolist()
    for key, s in shards.items():  # whole tensors in logical order on every rank
        full = gather_experts(model.state_dict()[key], s)
        name = key.rsplit(".", 1)[1]
        for e in range(E):
            assert torch.equal(full[e], expert_value(name, e, tuple(full.shape[1:])))
    dcp.save(sharded_state_dict(model), checkpoint_id=path)

    # load into another placement: each rank reads the rows of ITS experts
    fresh = torch.nn.Sequential(ReplayBalancedMoE(H, F, E, 2), ReplayBalancedMoE(H, F, E, 2))
    for i, layer in enumerate(fresh):
        layer.set_placement_row(_placement(20 + i))
    target = sharded_state_dict(fresh)
    for key in placement_keys(fresh):
        del target[key]  # keep the new placement
    dcp.load(target, checkpoint_id=path)
    for layer in fresh:
        for name, t in zip(layer.experts.tensor_names, layer.experts.expert_tensors()):
            for i, e in enumerate(layer.home_experts):
                assert torch.equal(t[i], expert_value(name, int(e), tuple(t.shape[1:]))), (rank, name, e)

    # optimizer state: exp_avg rows follow the same description
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    fqn = {id(p): n for n, p in model.named_parameters()}
    state = {fqn[id(p)]: st for p, st in opt.state.items()}
    sharded = sharded_optimizer_state(model, state)
    st = sharded["0.experts.w_gate_up"]["exp_avg"]
    assert tuple(st.size()) == (E,) + tuple(model[0].experts.w_gate_up.shape[1:])
    assert len(st.local_shards()) == E // 2
    assert torch.is_tensor(sharded["0.experts.w_gate_up"]["step"])


def test_dcp_round_trip_after_relayout_into_other_placements_and_whole_tensors(tmp_path):
    import torch.distributed.checkpoint as dcp

    path = str(tmp_path / "ckpt")
    run_group(_dcp_worker, 2, path, timeout_s=60)
    # the plain layout: whole [E, ...] tensors, read without a process group
    plain = torch.nn.Sequential(ReplayBalancedMoE(H, F, E, 2), ReplayBalancedMoE(H, F, E, 2))
    sd = {k: v for k, v in plain.state_dict().items() if "experts" in k}
    dcp.load(sd, checkpoint_id=path, no_dist=True)
    for key, t in sd.items():
        name = key.rsplit(".", 1)[1]
        for e in range(E):
            assert torch.equal(t[e], expert_value(name, e, tuple(t.shape[1:]))), (key, e)


def test_local_rows_and_the_load_hook_on_one_rank():
    """local_rows: a whole [E, ...] tensor gives the home rows, local rows pass through, another row count is a
    PlanError naming the key; with the hooks installed a one-rank layer's state_dict stays plain tensors and
    load_state_dict still takes them."""
    from relibra_moe.layers.expert_sharding import install_sharded_checkpoints, local_rows

    model = torch.nn.Sequential(ReplayBalancedMoE(H, F, E, 2))
    install_sharded_checkpoints(model)
    install_sharded_checkpoints(model)  # idempotent
    assert len(model[0]._sharded_state_dict_hooks) == 2
    s = expert_shards(model)["0.experts.w_down"]
    whole = torch.randn((E,) + tuple(model[0].experts.w_down.shape[1:]))
    assert torch.equal(local_rows(whole, s), whole)
    with pytest.raises(PlanError, match="0.experts.w_down.*8 rows"):
        local_rows(torch.zeros(3, 2), s)
    sd = model.state_dict()
    assert all(type(v) is torch.Tensor for v in sd.values())
    sd["0.experts.w_down"] = whole
    model.load_state_dict(sd)
    assert torch.equal(model[0].experts.w_down.detach(), whole)


def _optimizer_worker(rank: int, world: int) -> None:
    """gather_optimizer_state puts every expert's Adam state at its logical row; local_optimizer_state gives another
    placement's rows back; ranks with different state raise PlanError on both ranks."""
    from relibra_moe.layers.expert_sharding import gather_optimizer_state, local_optimizer_state

    def stepped(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        model = torch.nn.Sequential(ReplayBalancedMoE(H, F, E, 2))
        model[0].set_placement_row(_placement(seed))
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        layer = model[0]
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        for name, t in zip(layer.experts.tensor_names, layer.experts.expert_tensors()):
            for i, e in enumerate(layer.home_experts):
                t.grad[i] = expert_value(name, int(e), tuple(t.shape[1:]))
        opt.step()
        return model, opt

    model, opt = stepped(10)
    whole = gather_optimizer_state(model, opt)
    names = dict(zip(model[0].experts.expert_tensors(), model[0].experts.tensor_names))
    params = list(model.parameters())
    for i, p in enumerate(params):
        if p in names:
            avg = whole["state"][i]["exp_avg"]
            assert avg.shape == (E,) + tuple(p.shape[1:])
            for e in range(E):  # Adam's first step: exp_avg = (1 - beta1) * grad
                torch.testing.assert_close(avg[e], 0.1 * expert_value(names[p], e, tuple(p.shape[1:])))
            assert whole["state"][i]["step"] == opt.state_dict()["state"][i]["step"]
    other, other_opt = stepped(20)  # another placement
    other_opt.load_state_dict(local_optimizer_state(other, other_opt, whole))
    layer = other[0]
    for name, t in zip(layer.experts.tensor_names, layer.experts.expert_tensors()):
        for i, e in enumerate(layer.home_experts):
            want = 0.1 * expert_value(name, int(e), tuple(t.shape[1:]))
            torch.testing.assert_close(other_opt.state[t]["exp_avg"][i], want)
    bad = {**whole, "state": {k: {**v, "exp_avg": v["exp_avg"][:3]} if v["exp_avg"].shape[0] == E else v
                              for k, v in whole["state"].items()}}
    with pytest.raises(PlanError, match="neither the whole"):
        local_optimizer_state(other, other_opt, bad)
    fresh = torch.nn.Sequential(ReplayBalancedMoE(H, F, E, 2))
    fresh_opt = torch.optim.Adam(fresh.parameters(), lr=1e-3)
    if rank == 0:  # rank 0 has stepped, rank 1 has no state: both raise, neither waits in a gather
        fresh_opt = opt
        fresh = model
    with pytest.raises(PlanError, match="holds other expert optimizer state"):
        gather_optimizer_state(fresh, fresh_opt)


def test_optimizer_state_whole_in_logical_order_and_back_into_another_placement():
    run_group(_optimizer_worker, 2, timeout_s=60)
