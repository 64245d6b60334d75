"""Routing replay through ReplayBalancedMoE and relibra_moe.replay (single process), plus one small run
through the Triton interpreter."""

from __future__ import annotations

import gc
import weakref

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from relibra_moe.errors import PlanError, ReplayError
from relibra_moe.layers.moe import ReplayBalancedMoE, materialize_counts
from relibra_moe.layers.replay import replay
from relibra_moe.plan import BatchPlan, Placement, ReplicaPlan, SamplePlacement
from relibra_moe.triton_kernels.backend import force_backend


def _stack(n: int, **kw) -> torch.nn.ModuleList:
    torch.manual_seed(0)
    return torch.nn.ModuleList([ReplayBalancedMoE(8, 12, 6, 2, **kw) for _ in range(n)])


def _layer_with_an_unrouted_token() -> tuple[ReplayBalancedMoE, torch.Tensor, torch.Tensor]:
    """One layer, an input ``x [2, 5, 8]`` and its live routing ``ids [10, 2]`` with token 3 left unrouted (-1)."""
    layer = _stack(1)[0]
    x = torch.randn(2, 5, 8)
    with torch.no_grad():
        layer(x)
    ids = layer.last_routing.clone()
    ids[3] = -1
    return layer, x, ids


def _run(layers, x):
    h = x
    for layer in layers:
        h = h + layer(h)
    return h


@pytest.mark.parametrize("router", ["softmax", {"scoring": "sigmoid", "num_groups": 2, "topk_group": 1}])
def test_recorded_ids_replayed_give_identical_outputs_and_router_grads(router):
    layers = _stack(3, router=router)
    x = torch.randn(2, 5, 8)  # any leading shape
    with torch.no_grad():
        live = _run(layers, x)
    recorded = [layer.last_routing.clone() for layer in layers]
    xr = x.clone().requires_grad_()
    with replay(layers, recorded):
        out = _run(layers, xr)
    assert torch.equal(out.detach(), live)
    out.square().sum().backward()
    for layer in layers:
        assert layer.router.weight.grad is not None and layer.router.weight.grad.abs().sum() > 0
        assert layer.experts.w_gate_up.grad.abs().sum() > 0
    assert xr.grad.abs().sum() > 0


def test_replay_accepts_trace_layout_tensor():
    layers = _stack(2)
    x = torch.randn(7, 8)
    ids = torch.stack([torch.stack([torch.randperm(6)[:2] for _ in range(7)]) for _ in range(2)], dim=1)  # [T, L, k]
    with replay(layers, ids.to(torch.int16)):
        _run(layers, x)
    for l, layer in enumerate(layers):
        assert torch.equal(layer.last_routing, ids[:, l].long())
        assert layer.layer_index == l


def test_replay_changes_the_routing():
    layers = _stack(1)
    x = torch.randn(4, 8)
    forced = torch.tensor([[5, 4]] * 4)
    with replay(layers, [forced]):
        out = layers[0](x)
    w = layers[0]
    p = torch.softmax(x @ w.router.weight.T, -1)[:, [5, 4]]
    g = p / p.sum(-1, keepdim=True)
    ref = torch.zeros_like(x)
    for j, e in enumerate((5, 4)):
        h = x @ w.experts.w_gate_up[e]
        ref += g[:, j:j + 1] * ((F.silu(h[:, :12]) * h[:, 12:]) @ w.experts.w_down[e])
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    assert w.last_slot_counts.tolist() == [0, 0, 0, 0, 4, 4]


def test_replay_context_is_restored_and_live_routing_resumes():
    layers = _stack(1)
    x = torch.randn(3, 8)
    with replay(layers, [torch.tensor([[0, 1]] * 3)]):
        layers[0](x)
    layers[0](x)
    assert layers[0].replay_state is None


def test_replay_errors():
    layers = _stack(2)
    x = torch.randn(4, 8)
    with pytest.raises(ReplayError, match="cover 1 MoE layers, the model has 2"):
        with replay(layers, [None]):
            pass
    with pytest.raises(ReplayError, match=r"\[T, L, k\]"):
        with replay(layers, torch.zeros(4, 2, dtype=torch.long)):
            pass
    with pytest.raises(ReplayError, match="moe\\[1\\].*cover 3 tokens"):
        with replay(layers, [None, torch.tensor([[0, 1]] * 3)]):
            _run(layers, x)
    plan = ReplicaPlan.empty(1, 3, 1, 0)
    with pytest.raises(PlanError, match="covers 3 MoE layers"):
        with replay(layers, None, plan=plan):
            pass
    two = ReplicaPlan.empty(2, 2, 1, 0)
    with pytest.raises(PlanError, match="pass micro_batch"):
        with replay(layers, None, plan=two):
            pass
    bp = BatchPlan(Placement(np.zeros((2, 6))), SamplePlacement(np.zeros(1), np.zeros(1)),
                   ReplicaPlan.empty(1, 2, 1, 0), num_gpus=1, gpus_per_node=1)
    with replay(layers, None, plan=bp, micro_batch=0):
        _run(layers, x)  # a trivial plan on one rank is plain routing


def test_replay_of_traces_on_plain_layers():
    """Traces replay on any model of ReplayBalancedMoE layers (trace layer l -> MoE layer l): the rows of the
    selected sequences, right-padded with -1, give the same output as the same ids laid out by hand; a plan
    selects the samples of its micro-batch."""
    from relibra_moe.trace import RoutingTrace, TraceBatch

    layers = _stack(2)
    rng = np.random.default_rng(0)

    def trace(n: int) -> RoutingTrace:
        return RoutingTrace(np.stack([np.stack([rng.permutation(6)[:2] for _ in range(2)]) for _ in range(n)]),
                            [0, 1], 6, 2)

    traces = [trace(3), trace(2), trace(4)]
    batch = TraceBatch(traces, np.array([0, 1, 0]))
    x = torch.randn(2, 4, 8)  # sequences 0 and 2 of micro-batch 0, right-padded to 4 tokens
    with torch.no_grad(), replay(layers, batch, micro_batch=0) as rows:
        assert rows == [0, 2]
        out = _run(layers, x.reshape(-1, 8))
        assert layers[1].last_routing[3].tolist() == [-1, -1]  # padding of sequence 0
    by_hand = torch.full((2, 4, 2, 2), -1, dtype=torch.int64)
    by_hand[0, :3] = torch.as_tensor(traces[0].experts, dtype=torch.int64)
    by_hand[1] = torch.as_tensor(traces[2].experts, dtype=torch.int64)
    with torch.no_grad(), replay(layers, by_hand.reshape(8, 2, 2)) as rows:
        assert rows is None
        assert torch.equal(_run(layers, x.reshape(-1, 8)), out)
    plan = BatchPlan(Placement(np.zeros((2, 6))), SamplePlacement(np.array([1, 0, 1]), np.zeros(3)),
                     ReplicaPlan.empty(2, 2, 1, 0), num_gpus=1, gpus_per_node=1)
    with replay(layers, batch, plan, micro_batch=1) as rows:
        assert rows == [0, 2]
    with pytest.raises(ReplayError, match="routing covers 1 MoE layers, the model has 2"):
        with replay(layers, RoutingTrace(traces[0].experts[:, :1], [0], 6, 2)):
            pass
    with pytest.raises(ReplayError, match="E=8, k=2; the model has E=6, k=2"):
        with replay(layers, RoutingTrace(traces[0].experts, [0, 1], 8, 2)):
            pass
    with pytest.raises(ReplayError, match="plan must be a BatchPlan"):
        with replay(layers, batch, ReplicaPlan.empty(1, 2, 1, 0), micro_batch=0):
            pass
    with pytest.raises(ReplayError, match="Linear has no MoE layer that replays.*swap_moe_blocks"):
        with replay(torch.nn.Linear(2, 2), batch):
            pass


def test_materialize_counts_largest_remainder():
    shares = np.array([[0.5, 0.5, 0.0], [0.2, 0.3, 0.5], [0.0, 0.0, 1.0], [1 / 3, 1 / 3, 1 / 3]])
    out = materialize_counts(np.array([5, 7, 4, 2]), shares)
    # 5 * (.5, .5) -> 2.5, 2.5 -> tie to the lower index; 7 * (.2, .3, .5) = 1.4, 2.1, 3.5 -> 1, 2, 4
    assert out.tolist() == [[3, 2, 0], [1, 2, 4], [0, 0, 4], [1, 1, 0]]
    rng = np.random.default_rng(0)
    for _ in range(200):
        s = rng.dirichlet(np.ones(4), size=6) * (rng.random((6, 4)) < 0.7)
        s[:, 0] += 1e-3
        n = rng.integers(0, 1000, 6)
        c = materialize_counts(n, s.astype(np.float32))
        assert (c.sum(1) == n).all() and (c[s == 0] == 0).all()
        assert (np.abs(c - n[:, None] * s / s.sum(1, keepdims=True)) < 1 + 1e-9).all()


@pytest.mark.timeout(120)
def test_triton_interpreter_path_matches_torch_reference():
    """One small layer through the Triton kernels in the CPU interpreter vs the torch reference path."""
    torch.manual_seed(3)
    layer = ReplayBalancedMoE(16, 16, 4, 2, block_m=16)
    x = torch.randn(10, 16)
    ids = torch.stack([torch.randperm(4)[:2] for _ in range(10)])
    outs, grads = [], []
    for backend in ("torch", "triton"):
        layer.zero_grad()
        xb = x.clone().requires_grad_()
        with force_backend(backend), replay(layer, [ids]):
            out = layer(xb)
            out.square().sum().backward()
        outs.append(out.detach())
        grads.append([xb.grad, layer.experts.w_gate_up.grad.clone(), layer.experts.w_down.grad.clone(),
                      layer.router.weight.grad.clone()])
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=1e-5)
    for a, b in zip(grads[1], grads[0]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.timeout(120)
def test_experts_with_replica_slots_through_the_interpreter():
    """Home experts + replica slots (ExpertWeights, no concatenation) in Triton's interpreter and in the
    torch reference equal a per-row loop; gradients reach both the home and the slot tensors."""
    from relibra_moe.layers.experts import GroupedSwiGLUExperts

    torch.manual_seed(4)
    ex = GroupedSwiGLUExperts(16, 16, 3, block_m=16)
    slots = (torch.randn(2, 16, 32) * 0.25, torch.randn(2, 16, 16) * 0.25)
    x = torch.randn(21, 16)
    slot_ids = torch.randint(0, 5, (21,))
    w1_all = torch.cat([ex.w_gate_up.detach(), slots[0]])
    w2_all = torch.cat([ex.w_down.detach(), slots[1]])
    ref = torch.stack([(F.silu(x[i] @ w1_all[s, :, :16]) * (x[i] @ w1_all[s, :, 16:])) @ w2_all[s]
                       for i, s in enumerate(slot_ids.tolist())])
    results = []
    for backend in ("torch", "triton"):
        xs = x.clone().requires_grad_()
        w1 = ex.w_gate_up.detach().clone().requires_grad_()
        w2 = ex.w_down.detach().clone().requires_grad_()
        sl = tuple(t.clone().requires_grad_() for t in slots)
        with force_backend(backend):
            y = ex.compute(xs, slot_ids, w1, w2, sl)
            y.square().sum().backward()
        torch.testing.assert_close(y.detach(), ref, rtol=1e-4, atol=1e-5)
        results.append([xs.grad, w1.grad, w2.grad, sl[0].grad, sl[1].grad])
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    used = set(slot_ids.tolist())
    assert all(results[0][3][s].abs().sum() > 0 for s in (0, 1) if s + 3 in used)


def _doc_example(doc: str) -> str:
    """The first ``::`` code block of a docstring, dedented."""
    import inspect
    import textwrap

    block = inspect.cleandoc(doc).split("::\n", 1)[1]
    lines = []
    for line in block.splitlines()[1:]:
        if line.strip() and not line.startswith(" " * 4):
            break
        lines.append(line)
    return textwrap.dedent("\n".join(lines))


@pytest.mark.parametrize("where", ["class", "module"])
def test_docstring_training_loop_runs_and_trains(where):
    """The minimal training loops of the ReplayBalancedMoE docstrings run as written and update the weights."""
    import relibra_moe.layers.moe as moe_mod

    doc = moe_mod.ReplayBalancedMoE.__doc__ if where == "class" else moe_mod.__doc__
    code = _doc_example(doc)
    assert "opt.step()" in code and "replay(moe" in code
    torch.manual_seed(0)
    env: dict = {}
    exec(compile(code, f"<ReplayBalancedMoE {where} docstring>", "exec"), env)
    moe = env["moe"]
    assert env["step"] == 2
    # the replayed routing is the recorded one, and the router was trained through the gates
    recorded = env["ids"] if "ids" in env else env["recorded"]
    assert recorded.shape == (32, 2)
    assert torch.equal(moe.last_routing, recorded)
    assert all(p.grad is None for p in moe.parameters())  # zero_grad ran after the last step
    state = env["opt"].state[moe.router.weight]
    assert int(state["step"]) == 3 and float(state["exp_avg"].abs().sum()) > 0


def test_bad_replay_input_is_named():
    layer = ReplayBalancedMoE(8, 8, 4, 2, layer_index=0)
    x = torch.randn(5, 8)
    # ids given as numpy / lists are checked like tensors (not an AttributeError)
    with replay(layer, [np.array([[0, 1]] * 5)]):
        ref = layer(x)
    with replay(layer, [torch.tensor([[0, 1]] * 5)]):
        assert torch.equal(layer(x), ref)
    with pytest.raises(ReplayError, match=r"replayed id \[0, 1\] = 4 is outside \[-1, 4\)"):
        with replay(layer, [[[0, 4]] * 5]):
            layer(x)
    with pytest.raises(ReplayError, match="got int"):
        with replay(layer, 7):
            pass
    with pytest.raises(ReplayError, match="cover 5 tokens"):  # a numpy [T, L, k] is the trace layout too
        with replay(layer, np.zeros((5, 1, 2), np.int64) + np.array([0, 1])):
            layer(torch.randn(4, 8))
    with pytest.raises(ValueError, match="dtype torch.int64"):
        layer(torch.ones(5, 8, dtype=torch.int64))
    plan = BatchPlan(Placement(np.zeros((1, 4))), SamplePlacement(np.zeros(1), np.zeros(1)),
                     ReplicaPlan.empty(2, 1, 1, 0), num_gpus=1, gpus_per_node=1)
    for bad in (1.5, True):  # never truncated / reinterpreted as an index
        with pytest.raises(PlanError, match=f"micro_batch={bad!r}"):
            with replay(layer, None, plan=plan, micro_batch=bad):
                pass
    wide = BatchPlan(Placement(np.zeros((1, 8))), SamplePlacement(np.zeros(1), np.zeros(1)),
                     ReplicaPlan.empty(1, 1, 1, 0), num_gpus=1, gpus_per_node=1)
    with pytest.raises(PlanError, match=r"expert_gpu shape \(1, 8\).*num_experts=4"):
        with replay(layer, None, plan=wide):
            pass
    other = BatchPlan(Placement(np.array([[0, 0, 1, 1]])), SamplePlacement(np.zeros(1), np.zeros(1)),
                      ReplicaPlan.empty(1, 1, 2, 0), num_gpus=2, gpus_per_node=2)
    with pytest.raises(PlanError, match="num_gpus=2.*has 1 ranks"):
        with replay(layer, None, plan=other):
            pass


def test_failed_forward_does_not_pin_its_activations():
    """A forward that raises ReplayError leaves no frame <-> traceback cycle: its input (and everything the
    frame held) is freed as soon as the caller drops the exception, without waiting for the garbage collector."""
    layer = ReplayBalancedMoE(8, 8, 4, 2, layer_index=0)
    gc.collect()
    gc.disable()
    try:
        x = torch.randn(5, 8)
        alive = weakref.ref(x)
        with pytest.raises(ReplayError, match="cover 4 tokens"):
            with replay(layer, [torch.tensor([[0, 1]] * 4)]):
                layer(x)
        del x
        assert alive() is None
    finally:
        gc.enable()


@pytest.mark.parametrize("kwargs, match", [
    (dict(hidden=0), "hidden=0"), (dict(ffn=-1), "ffn=-1"), (dict(num_experts=0), "num_experts=0"),
    (dict(top_k=2.0), "top_k=2.0"), (dict(block_m=0), "block_m=0"), (dict(gpus_per_node=0), "gpus_per_node=0"),
    (dict(layer_index=-1), "layer_index=-1"), (dict(router=3), "router=3"), (dict(top_k=5), "top_k=5"),
])
def test_constructor_rejects_bad_arguments(kwargs, match):
    args = dict(hidden=8, ffn=8, num_experts=4, top_k=2) | kwargs
    with pytest.raises(ValueError, match=match):
        ReplayBalancedMoE(args.pop("hidden"), args.pop("ffn"), args.pop("num_experts"), args.pop("top_k"), **args)


def test_materialize_counts_rejects_bad_input():
    ones = np.ones((2, 2))
    with pytest.raises(PlanError, match="non-negative integers.*minimum -1"):
        materialize_counts(np.array([3, -1]), ones)  # was split as if it were a count
    with pytest.raises(PlanError, match="dtype float64"):
        materialize_counts(np.array([2.5, 1.0]), ones)  # was truncated to 2
    with pytest.raises(PlanError, match=r"shares has shape \(3, 2\), expected \[E=2, G\]"):
        materialize_counts(np.array([3, 1]), np.ones((3, 2)))
    with pytest.raises(PlanError, match=r"shares of expert 0 = \[nan, 1.0\]"):
        materialize_counts(np.array([3, 1]), np.array([[np.nan, 1], [1, 1]]))
    with pytest.raises(PlanError, match=r"shares of expert 1 = \[2.0, -1.0\]"):
        materialize_counts(np.array([3, 1]), np.array([[1, 1], [2, -1]]))


# ----------------------------------------------------------------------------- no host sync in the hot path


def test_replayed_forward_and_backward_make_no_host_sync():
    """Inside replay the layer follows its schedule: SyncCounter sees nothing in forward or backward (the live
    forward of the same layers does sync, so the counter is watching), and the outputs and gradients are the
    live forward's with the same routing."""
    from relibra_moe.layers.testing import SyncCounter

    layers = _stack(3, router={"scoring": "sigmoid", "num_groups": 2, "topk_group": 1})
    x = torch.randn(2, 5, 8)
    xl = x.clone().requires_grad_()
    with torch.no_grad():
        _run(layers, x)  # first use: each layer reads its homes to the host once (kept until they change)
    with SyncCounter() as live_syncs:
        live = _run(layers, xl)
    live.square().sum().backward()
    # live routing's one sync point per layer: the live ids come to the host (numpy views of host tensors aside)
    assert live_syncs.counts == {"Tensor.cpu": 3, "Tensor.numpy": 6}, live_syncs.counts
    g_live = [p.grad.clone() for p in layers.parameters()]
    layers.zero_grad()
    recorded = [layer.last_routing.clone() for layer in layers]
    recorded[1][3] = -1  # a padded token (no expert)
    xr = x.clone().requires_grad_()
    with replay(layers, recorded):
        with SyncCounter() as syncs:
            out = _run(layers, xr)
            out.square().sum().backward()
    assert syncs.counts == {}, syncs.counts
    with torch.no_grad(), replay(layers, [recorded[0], None, recorded[2]]):
        ref = _run(layers, x)  # layer 1 live: the padded token is routed there
    assert not torch.equal(out.detach(), ref)
    recorded[1] = layers[1].last_routing.clone()
    layers.zero_grad()
    xr.grad = None
    with replay(layers, recorded):
        out = _run(layers, xr)
    out.square().sum().backward()
    torch.testing.assert_close(out.detach(), live.detach(), rtol=0, atol=0)
    for p, g in zip(layers.parameters(), g_live):
        torch.testing.assert_close(p.grad, g, rtol=1e-6, atol=1e-7)
    assert torch.equal(layers[0].last_slot_counts.cpu(), torch.bincount(recorded[0].view(-1), minlength=6))


def test_cpu_reference_replayed_layer_runs_the_fused_expert_stage(monkeypatch):
    """On the CPU reference backend the one-rank replayed layer runs its expert stage as plain torch ops
    (reference_local_experts: no kernel op, no loop over slots), with no host sync, and gives the float64 layer's
    outputs and gradients (float64 runs the kernel ops: torch._grouped_mm has no float64 kernel); a padded token
    included."""
    import copy

    import relibra_moe.layers.moe as moe_mod
    from relibra_moe.layers.testing import SyncCounter

    calls = []
    real = moe_mod.reference_local_experts
    monkeypatch.setattr(moe_mod, "reference_local_experts", lambda *a: calls.append(a[0].dtype) or real(*a))
    layer, x, ids = _layer_with_an_unrouted_token()
    results = []
    for lay in (layer, copy.deepcopy(layer).double()):
        xr = x.to(lay.router.weight.dtype).clone().requires_grad_()
        with force_backend("torch"), replay(lay, [ids]):
            with SyncCounter() as syncs:
                out = lay(xr)
                out.square().sum().backward()
        assert syncs.counts == {}, syncs.counts
        results.append([out.detach().double(), xr.grad.double()] + [p.grad.double() for p in lay.parameters()])
    assert calls == [torch.float32]
    assert torch.equal(results[0][0][0, 3], torch.zeros(8, dtype=torch.float64))  # the padded token
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def _no_sync_worker(rank: int, world: int) -> None:
    from relibra_moe.layers.relayout import relayout
    from relibra_moe.layers.replica_buffer import LayerSharedReplicaBuffer
    from relibra_moe.layers.testing import SyncCounter, hot_replica_plan

    E, L = 4, 2
    torch.manual_seed(0)
    buf = LayerSharedReplicaBuffer(8, 12, 1)
    layers = torch.nn.ModuleList([ReplayBalancedMoE(8, 12, E, 2, layer_index=i, replica_buffer=buf, gpus_per_node=2)
                                  for i in range(L)])
    plan = hot_replica_plan(L, E, 2, 2, np.zeros(L, np.int64), seed=4)
    relayout(layers, plan.placement)
    torch.manual_seed(1 + rank)
    x = torch.randn(6, 8)
    ids = [torch.stack([torch.randperm(E)[:2] for _ in range(6)]) for _ in range(L)]
    ids[0] = torch.stack([torch.zeros(6, dtype=torch.long), torch.randint(1, E, (6,))], dim=1)  # expert 0 is hot
    results = []
    for p in (plan, None):
        layers.zero_grad()
        xr = x.clone().requires_grad_()
        with replay(layers, ids, plan=p, micro_batch=0 if p is not None else None):
            with SyncCounter() as syncs:
                out = _run(layers, xr)
                out.square().sum().backward()
        assert syncs.counts == {}, (rank, p is not None, syncs.counts)
        results.append((out.detach(), xr.grad, [q.grad.clone() for q in layers.parameters()]))
    assert buf.fills >= 2 * L - 1
    (o1, gx1, gp1), (o0, gx0, gp0) = results
    torch.testing.assert_close(o1, o0, rtol=1e-5, atol=1e-6)  # a plan never changes the math
    torch.testing.assert_close(gx1, gx0, rtol=1e-5, atol=1e-6)
    for a, b in zip(gp1, gp0):  # replica gradients are summed at home: another fp32 order
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.timeout(180)
def test_replayed_layers_on_two_ranks_with_replicas_make_no_host_sync():
    from relibra_moe.layers.testing import run_group

    run_group(_no_sync_worker, 2)


def test_single_rank_replayed_layer_compiles_with_fullgraph():
    """torch.compile(fullgraph=True) traces the replayed layer (schedule, router, kernel ops) in one graph,
    forward and backward, with the eager outputs and gradients. The "eager" backend checks the capture
    (dynamo) without Inductor's code generation, which is slow on a shared CPU."""
    layer, x, ids = _layer_with_an_unrouted_token()
    grads = []
    for compiled in (False, True):
        torch._dynamo.reset()
        layer.zero_grad()
        xr = x.clone().requires_grad_()
        fn = torch.compile(layer, fullgraph=True, backend="eager") if compiled else layer
        with replay(layer, [ids]):
            out = fn(xr)
        out.square().sum().backward()
        grads.append([out.detach(), xr.grad] + [p.grad.clone() for p in layer.parameters()])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_next_micro_batch_is_built_ahead_and_schedules_refresh_in_place():
    """With traces and a BatchPlan, entering micro-batch m starts building m + 1 in the background thread; the next
    replay takes it (same outputs as a fresh build; a relayout in between drops it). LayerSchedule.copy_ refreshes
    an uploaded one-rank schedule with another micro-batch's, and refuses other shapes by name."""
    from relibra_moe.layers.replay import _PREFETCH
    from relibra_moe.trace import RoutingTrace

    layers = _stack(2)
    for i, layer in enumerate(layers):
        layer.layer_index = i
    g = np.random.default_rng(0)
    traces = [RoutingTrace(np.stack([np.stack([g.permutation(6)[:2] for _ in range(2)]) for _ in range(5)]),
                           np.arange(2), 6, 2) for _ in range(2)]
    plan = BatchPlan(Placement(np.zeros((2, 6))), SamplePlacement(np.array([0, 1]), np.zeros(2), 2),
                     ReplicaPlan.empty(2, 2, 1, 0), num_gpus=1, gpus_per_node=1)
    x = torch.randn(5, 8)
    outs = []
    with replay(layers, traces, plan, micro_batch=0) as rows:
        assert rows == [0]
        assert layers.__dict__[_PREFETCH][0][2] == 1  # micro-batch 1 is being built
        outs.append(_run(layers, x))
        sched0 = [layer.replay_state.schedule for layer in layers]
    pending = layers.__dict__[_PREFETCH][1]
    with replay(layers, traces, plan, micro_batch=1) as rows:
        assert rows == [1] and pending.done() and _PREFETCH not in layers.__dict__
        outs.append(_run(layers, x))
        sched1 = [layer.replay_state.schedule for layer in layers]
    with torch.no_grad(), replay(layers, [torch.as_tensor(traces[1].experts[:, i]) for i in range(2)]):
        torch.testing.assert_close(_run(layers, x), outs[1].detach(), rtol=0, atol=0)  # the prefetched build
    assert not torch.equal(outs[0], outs[1])
    sched0[0].copy_(sched1[0])
    assert np.array_equal(sched0[0].ids, sched1[0].ids) and torch.equal(sched0[0].ids_dev, sched1[0].ids_dev)
    with replay(layers, [torch.tensor([[0, 1]] * 3)] * 2):
        short = layers[0].replay_state.schedule
    with pytest.raises(ReplayError, match="same shapes"):
        sched0[0].copy_(short)


def test_collective_timeout_is_checked():
    from relibra_moe.layers.dispatch import DEFAULT_COLLECTIVE_TIMEOUT_S, collective_timeout, set_collective_timeout

    assert collective_timeout() == DEFAULT_COLLECTIVE_TIMEOUT_S
    set_collective_timeout(5)
    try:
        assert collective_timeout() == 5.0
        for bad in (0, -1, float("nan"), "10", True):
            with pytest.raises(ValueError, match=r"collective timeout \(s\)=.* must be a finite number > 0"):
                set_collective_timeout(bad)
    finally:
        set_collective_timeout(None)


def test_layout_ids_honours_the_trace_start():
    """A trace whose routing starts at token s (a response-only dump, slime's routed_experts_start_len): row i
    lands on the sequence's (s + i)-th token; the first s tokens are unrouted (LIVE, -1 or an error as asked)."""
    from relibra_moe.layers.replay import LIVE, layout_ids
    from relibra_moe.trace import RoutingTrace

    ids = np.array([[[1, 2]], [[3, 4]], [[5, 6]]])  # 3 rows, one layer, top-2
    tr = RoutingTrace(ids, [0], 8, 2, start=2)
    mask = torch.tensor([[0, 1, 1, 1, 1, 1, 1]])  # left padding, 6 tokens: 2 unrouted, 3 routed, 1 unrouted
    out = layout_ids([tr], 0, mask).numpy()
    assert out.tolist() == [[-1, -1], [LIVE, LIVE], [LIVE, LIVE], [1, 2], [3, 4], [5, 6], [LIVE, LIVE]]
    assert layout_ids([tr], 0, mask, unrouted="none").numpy().tolist() == \
        [[-1, -1], [-1, -1], [-1, -1], [1, 2], [3, 4], [5, 6], [-1, -1]]
    with pytest.raises(ReplayError, match="starts routing at token 2"):
        layout_ids([tr], 0, mask, unrouted="error")
    with pytest.raises(ReplayError, match="3 routed tokens from token 2, its attention_mask row has 4 ones"):
        layout_ids([tr], 0, torch.tensor([[0, 0, 0, 1, 1, 1, 1]]))
    no_mask = layout_ids([tr, RoutingTrace(ids[:1], [0], 8, 2)], 0).numpy().reshape(2, 5, 2)
    assert no_mask[0].tolist() == [[LIVE, LIVE], [LIVE, LIVE], [1, 2], [3, 4], [5, 6]]
    assert no_mask[1].tolist() == [[1, 2], [-1, -1], [-1, -1], [-1, -1], [-1, -1]]
    with pytest.raises(ReplayError, match="must be a torch.Tensor"):
        layout_ids([tr], 0, mask.numpy())
