"""LayerSharedReplicaBuffer: r slots per rank whatever the number of layers (a 48-layer model on two
ranks refills one buffer per layer, forward and backward, and matches the unreplicated run), the
paper's memory figures, and the wire order of ReplicaTransfer on a hand-built plan.

Resident mode (ResidentReplicas, issue 27): a plan with the same replicas in all M = 3 micro-batches on 2 ranks
(node scope) and 4 ranks as 2 nodes x 2 (global scope, cross-node replicas) equals a float64 dense loop, the model
without replicas and the per-layer mode, with exactly one fill and one gradient return per layer per batch (a
second batch refills; activation recompute neither refills nor counts twice; no host sync); a skipped or repeated
micro-batch backward raises ReplayError on every rank."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from relibra_moe.layers.moe import ReplayBalancedMoE
from relibra_moe.layers.replay import replay
from relibra_moe.layers.replica_buffer import LayerSharedReplicaBuffer, ReplicaTransfer, replica_buffer_bytes
from relibra_moe.layers.testing import kernel_backend, rank_device, run_group
from relibra_moe.plan import ReplicaPlan
from relibra_moe.specs import ModelSpec
from relibra_moe.triton_kernels.backend import force_backend

MIB = 1 << 20


def test_paper_memory_figures():
    assert replica_buffer_bytes("qwen3-30b-a3b", 2) == 18 * MIB
    assert replica_buffer_bytes("qwen3-235b-a22b", 2) == 72 * MIB
    assert replica_buffer_bytes("qwen3-30b-a3b", 2, dtype_bytes=4) == 36 * MIB
    assert replica_buffer_bytes("qwen3-30b-a3b", 0) == 0
    with pytest.raises(ValueError):
        replica_buffer_bytes("no-such-model", 2)
    for bad in (True, -1, 1.5):  # never reinterpreted as a slot count
        with pytest.raises(ValueError, match=f"replica_slots={bad!r} must be an int >= 0"):
            replica_buffer_bytes("qwen3-30b-a3b", bad)


def test_buffer_bytes_match_the_formula():
    buf = LayerSharedReplicaBuffer(64, 48, 3, dtype=torch.bfloat16)
    assert buf.nbytes == replica_buffer_bytes(ModelSpec("t", 64, 48, 8, 2, 48), 3) == 3 * 3 * 64 * 48 * 2


def test_48_layer_model_allocates_r_slots_once():
    buf = LayerSharedReplicaBuffer(8, 12, 2)
    model = torch.nn.ModuleList([ReplayBalancedMoE(8, 12, 4, 2, replica_buffer=buf) for _ in range(48)])
    assert all(layer.replica_buffer is buf for layer in model)
    slot_ptrs = {t.data_ptr() for layer in model for t in layer.replica_buffer.tensors}
    assert len(slot_ptrs) == 2  # one gate/up and one down tensor for the whole model
    assert buf.nbytes == 2 * 3 * 8 * 12 * 4
    # the slots are not module state: nothing per layer in the state dict
    sd = model.state_dict()
    assert not any(v.untyped_storage().data_ptr() in {t.untyped_storage().data_ptr() for t in buf.tensors}
                   for v in sd.values())
    assert not any(v.shape[:1] == (2,) and v.shape[1:] in buf.shapes for v in sd.values())
    assert sum(v.numel() for k, v in model.state_dict().items() if "experts" in k) == 48 * 4 * 3 * 8 * 12


def test_incompatible_buffer_is_rejected():
    buf = LayerSharedReplicaBuffer(8, 12, 2)
    with pytest.raises(ValueError, match="cannot hold"):
        ReplayBalancedMoE(8, 16, 4, 2, replica_buffer=buf)


def test_transfer_wire_order_hand_built():
    # 4 ranks, 2 per node, E = 8, expert e homed on e // 2, r = 2
    home = np.arange(8) // 2
    rep = np.array([[2, -1], [0, 1], [7, -1], [4, 5]])
    t0 = ReplicaTransfer.build(rep, home, rank=0, gpus_per_node=2)
    assert t0.send_local.tolist() == [0, 1] and t0.send_splits == (0, 2, 0, 0)
    assert t0.recv_slots.tolist() == [0] and t0.recv_splits == (0, 1, 0, 0)
    t1 = ReplicaTransfer.build(rep, home, rank=1, gpus_per_node=2)
    assert t1.send_local.tolist() == [0] and t1.send_splits == (1, 0, 0, 0)  # expert 2 = local row 0 of rank 1
    assert t1.recv_slots.tolist() == [0, 1] and t1.recv_splits == (2, 0, 0, 0)
    t3 = ReplicaTransfer.build(rep, home, rank=3, gpus_per_node=2)
    assert t3.send_local.tolist() == [1] and t3.send_splits == (0, 0, 1, 0)  # expert 7 = local row 1
    assert t3.recv_slots.tolist() == [0, 1] and t3.recv_splits == (0, 0, 2, 0)
    assert t0.active and t0.intra_node
    empty = ReplicaTransfer.build(np.full((4, 2), -1), home, rank=2, gpus_per_node=2)
    assert not empty.active and empty.send_local.numel() == 0


LAYERS = 48


def _worker_48(rank: int, world: int) -> None:
    """48 layers share one buffer (r = 1); every layer puts each rank's expert replica on the other rank."""
    torch.manual_seed(0)
    buf = LayerSharedReplicaBuffer(4, 4, 1)
    model = torch.nn.ModuleList([ReplayBalancedMoE(4, 4, 2, 1, replica_buffer=buf) for _ in range(LAYERS)])
    gen = torch.Generator(device=rank_device()).manual_seed(rank)
    with torch.no_grad():
        for layer in model:  # routers equal on both ranks, experts different
            layer.router.weight.copy_(torch.randn(2, 4, generator=torch.Generator(device=rank_device()).manual_seed(1)))
            layer.experts.w_gate_up.copy_(torch.randn(1, 4, 8, generator=gen) * 0.3)
            layer.experts.w_down.copy_(torch.randn(1, 4, 4, generator=gen) * 0.3)
    x = torch.randn(6, 4, generator=gen)
    ids = torch.tensor([[0], [1]] * 3)
    rep = np.zeros((1, LAYERS, 2, 1), np.int32)
    rep[0, :, 0, 0], rep[0, :, 1, 0] = 1, 0
    rows, shares = [], []
    for l in range(LAYERS):
        for j in range(2):
            for e in range(2):
                rows += [(0, l, j, e, 0), (0, l, j, e, 1)]
                shares += [0.5, 0.5]
    plan = ReplicaPlan(rep, np.array(rows), np.array(shares))
    ptrs = [t.data_ptr() for t in buf.tensors]

    def run(p):
        for layer in model:
            layer.zero_grad()
        xi = x.clone().requires_grad_()
        with replay(model, [ids] * LAYERS, plan=p, micro_batch=0):
            h = xi
            for layer in model:
                h = h + 0.5 * layer(h)
        h.square().sum().backward()
        return h.detach(), xi.grad, [t.grad.clone() for t in model.parameters()]

    with force_backend(kernel_backend()):
        ref = run(None)
        fills = buf.fills
        got = run(plan)
    assert buf.fills - fills == LAYERS + LAYERS - 1  # forward fill per layer + backward refill but the last
    assert [t.data_ptr() for t in buf.tensors] == ptrs and buf.nbytes == 1 * 3 * 4 * 4 * 4
    # per source, 3 pairs per expert split 1.5 / 1.5 -> 2 to the lower rank, 1 to the other (largest remainder)
    assert model[0].last_load == (8 if rank == 0 else 4)
    torch.testing.assert_close(got[0], ref[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got[1], ref[1], rtol=1e-5, atol=1e-6)
    for a, b in zip(got[2], ref[2]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.timeout(120)
def test_48_layers_share_one_buffer_on_two_ranks():
    run_group(_worker_48, 2, timeout_s=60)


def test_bad_buffer_sizes_are_named():
    for bad in (1.5, True, -1):
        with pytest.raises(ValueError, match=f"slots={bad!r} must be an int >= 0"):
            LayerSharedReplicaBuffer(8, 12, bad)
    with pytest.raises(ValueError, match="hidden=0 must be an int >= 1"):
        LayerSharedReplicaBuffer(0, 12, 1)


# --------------------------------------------------------------------------------------------- resident mode
#
# A resident plan (ReplicaPlan.resident: the same replicas in all M = 3 micro-batches) runs with each layer's own
# slots: filled once per batch (at micro-batch 0), slot gradients returned once (in the backward that completes
# the batch). Outputs and every gradient after the M backwards must equal a float64 dense loop written here, the
# same model without replicas, and the per-layer mode (each micro-batch as a one-micro-batch plan).

RH, RFF, RK, RL, RM = 8, 12, 2, 2, 3


def resident_plan(G: int, P: int, E: int, r: int, scope: str, seed: int) -> ReplicaPlan:
    """A valid resident plan on the static homes ``e // (E / G)``: per layer and rank ``r`` replicas of experts
    homed elsewhere (in the node for ``scope="node"``, on other nodes for ``"global"``), the same in every
    micro-batch; every source splits each replicated expert's pairs over its holders by random shares that
    differ per micro-batch."""
    from relibra_moe.plan import Placement
    from relibra_moe.specs import ClusterSpec

    rng = np.random.default_rng(seed)
    home = np.arange(E) // (E // G)
    rep = np.full((RL, G, r), -1, np.int32)
    for l in range(RL):
        for g in range(G):
            cand = [e for e in range(E) if home[e] != g and (home[e] // P == g // P) == (scope == "node")]
            chosen = rng.permutation(cand)[:r]
            rep[l, g, :len(chosen)] = chosen
    idx, share = [], []
    for m in range(RM):
        for l in range(RL):
            for e in np.unique(rep[l][rep[l] >= 0]):
                holders = [int(home[e])] + [g for g in range(G) if e in rep[l, g]]
                for j in range(G):
                    w = rng.integers(1, 4, len(holders)).astype(np.float64)
                    for h, v in zip(holders, w / w.sum()):
                        idx.append((m, l, j, int(e), h))
                        share.append(v)
    plan = ReplicaPlan(np.broadcast_to(rep, (RM, RL, G, r)).copy(), np.array(idx), np.array(share), scope)
    plan.validate(Placement(np.tile(home, (RL, 1))), ModelSpec("t", RH, RFF, E, RK, RL),
                  ClusterSpec(nodes=G // P, gpus_per_node=P))
    assert plan.resident
    return plan


def one_micro_batch(plan: ReplicaPlan, m: int) -> ReplicaPlan:
    """Micro-batch ``m`` of ``plan`` as a plan of its own (M = 1: not resident, the per-layer mode runs it)."""
    rows = plan.split_index[:, 0] == m
    idx = plan.split_index[rows].copy()
    idx[:, 0] = 0
    return ReplicaPlan(plan.replica_expert[m:m + 1], idx, plan.split_share[rows], plan.scope)


def _reference_moe(x, wr, w1, w2, ids):
    """float64 dense loop over experts: softmax gates of the given ids, renormalized; SwiGLU experts."""
    probs = torch.softmax(x @ wr.T, dim=-1)
    gates = probs.gather(1, ids)
    gates = gates / gates.sum(-1, keepdim=True)
    out = torch.zeros_like(x)
    for e in range(w1.shape[0]):
        t, j = torch.nonzero(ids == e, as_tuple=True)
        h = x[t] @ w1[e]
        a = torch.nn.functional.silu(h[:, :RFF]) * h[:, RFF:]
        out = out.index_add(0, t, gates[t, j, None] * (a @ w2[e]))
    return out


def _resident_case(G: int, E: int, seed: int):
    """Global data: per micro-batch the tokens of every rank (x, ids per layer, cotangent), float64 weights."""
    g = torch.Generator().manual_seed(seed)
    params = [(torch.randn(E, RH, generator=g, dtype=torch.float64) * 0.5,
               torch.randn(E, RH, 2 * RFF, generator=g, dtype=torch.float64) * RH ** -0.5,
               torch.randn(E, RFF, RH, generator=g, dtype=torch.float64) * RFF ** -0.5) for _ in range(RL)]
    tokens = [[2 + (j + m) % 4 for j in range(G)] for m in range(RM)]
    data = []
    for m in range(RM):
        n = sum(tokens[m])
        x = torch.randn(n, RH, generator=g, dtype=torch.float64)
        ids = [torch.stack([torch.randperm(E, generator=g)[:RK] for _ in range(n)]) for _ in range(RL)]
        data.append((x, ids, torch.randn(n, RH, generator=g, dtype=torch.float64)))
    return params, tokens, data


def _resident_reference(params, data):
    """float64 outputs per micro-batch, input grads per micro-batch and weight grads summed over the batch."""
    ref = [tuple(t.clone().requires_grad_() for t in p) for p in params]
    outs, xs = [], []
    for x, ids, cot in data:
        h = xr = x.clone().requires_grad_()
        for l in range(RL):
            h = h + _reference_moe(h, *ref[l], ids[l])
        (h * cot).sum().backward()
        outs.append(h.detach())
        xs.append(xr.grad)
    return outs, xs, [tuple(t.grad for t in p) for p in ref]


def _resident_model(G: int, P: int, E: int, r: int, params):
    buf = LayerSharedReplicaBuffer(RH, RFF, r)
    layers = torch.nn.ModuleList([ReplayBalancedMoE(RH, RFF, E, RK, gpus_per_node=P, replica_buffer=buf, layer_index=l)
                                  for l in range(RL)])
    with torch.no_grad():
        for (wr, w1, w2), layer in zip(params, layers):
            mine = layer.home_experts
            layer.router.weight.copy_(wr.float())
            layer.experts.w_gate_up.copy_(w1[mine].float())
            layer.experts.w_down.copy_(w2[mine].float())
    return layers, buf


def _forward(layers, h, ckpt: bool | None):
    from torch.utils.checkpoint import checkpoint

    for layer in layers:
        h = h + (layer(h) if ckpt is None else checkpoint(layer, h, use_reentrant=ckpt))
    return h


def _run_batch(layers, mine, plan_of, *, ckpt: bool | None = None, syncs: dict | None = None, skip=()):
    """The M micro-batches of this rank (``mine``: per m its x, ids, cotangent), each forward inside replay and
    its backward right after, inside the block (a recompute follows the same schedule); ``skip``: micro-batches
    whose backward is skipped. Returns the outputs and input grads per micro-batch."""
    from relibra_moe.layers.testing import SyncCounter

    outs, gxs = [], []
    for m, (x, ids, cot) in enumerate(mine):
        xr = x.clone().requires_grad_()
        plan, mb = plan_of(m)
        with replay(layers, ids, plan=plan, micro_batch=mb), SyncCounter() as counter:
            out = _forward(layers, xr, ckpt)
            if m not in skip:
                (out * cot).sum().backward()
        if syncs is not None:
            for name, n in counter.counts.items():
                syncs[name] = syncs.get(name, 0) + n
        outs.append(out.detach())
        gxs.append(xr.grad)
    return outs, gxs


def _check_resident(rank: int, G: int, P: int, scope: str, r: int, seed: int) -> None:
    import torch.distributed as dist

    E = 2 * G
    params, tokens, data = _resident_case(G, E, seed)
    plan = resident_plan(G, P, E, r, scope, seed)
    mine = []
    for m, (x, ids, cot) in enumerate(data):
        lo = sum(tokens[m][:rank])
        sl = slice(lo, lo + tokens[m][rank])
        mine.append((x[sl].float(), [i[sl] for i in ids], cot[sl].float()))
    ref_out, ref_gx, ref_gw = _resident_reference(params, data)
    layers, buf = _resident_model(G, P, E, r, params)

    def grads():
        gs = []
        for layer in layers:
            gr = layer.router.weight.grad.clone()
            dist.all_reduce(gr)  # the router's data-parallel gradient: summed over ranks
            gs += [gr, layer.experts.w_gate_up.grad.clone(), layer.experts.w_down.grad.clone()]
        layers.zero_grad()
        return gs

    def close(a, b, what):
        torch.testing.assert_close(a, b.to(a.dtype), rtol=1e-4, atol=1e-5, msg=lambda t: f"rank {rank} {what}: {t}")

    with force_backend(kernel_backend()):
        runs = {"none": _run_batch(layers, mine, lambda m: (None, None)) + (grads(),)}
        runs["per-layer"] = _run_batch(layers, mine, lambda m: (one_micro_batch(plan, m), 0)) + (grads(),)
        per_layer_fills, syncs = buf.fills, {}
        for batch in (1, 2):  # the second batch refills
            runs[f"resident {batch}"] = _run_batch(layers, mine, lambda m: (plan, m), syncs=syncs) + (grads(),)
            assert [lay.resident_replicas.buffer.fills for lay in layers] == [batch] * RL, rank
            assert [lay.resident_replicas.returns for lay in layers] == [batch] * RL, rank
        assert syncs == {}, (rank, syncs)  # the resident fill and return add no host sync
        for ckpt in (False, True):  # activation recompute (non-reentrant, reentrant): no refill, no double count
            runs[f"resident ckpt={ckpt}"] = _run_batch(layers, mine, lambda m: (plan, m), ckpt=ckpt) + (grads(),)
        assert [lay.resident_replicas.buffer.fills for lay in layers] == [4] * RL, rank
        assert [lay.resident_replicas.returns for lay in layers] == [4] * RL, rank
    assert per_layer_fills >= RM * (2 * RL - 1) and buf.fills == per_layer_fills  # per-layer: M fills per layer
    for name, (outs, gxs, gs) in runs.items():
        for m in range(RM):
            lo = sum(tokens[m][:rank])
            sl = slice(lo, lo + tokens[m][rank])
            close(outs[m], ref_out[m][sl], f"{name} output m={m}")
            close(gxs[m], ref_gx[m][sl], f"{name} input grad m={m}")
        for l, layer in enumerate(layers):
            mine_e = layer.home_experts
            wr, w1, w2 = ref_gw[l]
            close(gs[3 * l], wr, f"{name} layer {l} router grad")
            close(gs[3 * l + 1], w1[mine_e], f"{name} layer {l} w_gate_up grad")
            close(gs[3 * l + 2], w2[mine_e], f"{name} layer {l} w_down grad")
            torch.testing.assert_close(gs[3 * l + 1], runs["none"][2][3 * l + 1], rtol=1e-5, atol=1e-6)


def _resident_worker(rank: int, world: int, P: int, scope: str, r: int) -> None:
    _check_resident(rank, world, P, scope, r, seed=5)


@pytest.mark.timeout(240)
def test_resident_plan_two_ranks_matches_references():
    run_group(_resident_worker, 2, 2, "node", 1, timeout_s=60)


@pytest.mark.timeout(300)
def test_resident_plan_four_ranks_global_scope_matches_references():
    run_group(_resident_worker, 4, 2, "global", 2, timeout_s=60)


def _resident_errors_worker(rank: int, world: int) -> None:
    """A skipped backward raises ReplayError on every rank, naming the layer and the counts: (a) at the end of
    the last micro-batch's backward when an earlier one was skipped; (b) at the next batch's entry when the last
    one was skipped (agreed at replay entry, raised by the first forward). Each error drops the stale batch: the
    next batch runs clean. One backward of the summed losses (micro-batch M - 1's backward first) is fine. A
    micro-batch's second backward (``retain_graph``) would count its slot gradients twice: ReplayError."""
    from relibra_moe.errors import ReplayError

    G, E = world, 2 * world
    params, tokens, data = _resident_case(G, E, 7)
    plan = resident_plan(G, 2, E, 1, "node", 7)
    mine = []
    for m, (x, ids, cot) in enumerate(data):
        lo = sum(tokens[m][:rank])
        mine.append(tuple(t[lo:lo + tokens[m][rank]] for t in (x.float(), *ids, cot.float())))
    mine = [(x, list(ids), cot) for x, *ids, cot in mine]
    layers, _ = _resident_model(G, 2, E, 1, params)

    def grads():
        out = [p.grad.clone() for p in layers.parameters()]
        layers.zero_grad()
        return out

    with force_backend(kernel_backend()):
        _run_batch(layers, mine, lambda m: (None, None))
        ref = grads()
        with pytest.raises(ReplayError, match=r"layer moe\[1\]: the backward of the last micro-batch \(2\) of a "
                                              r"resident replica plan ran, but the backward ran for 2 of its 3 "
                                              r"micro-batches \[0, 2\]"):
            _run_batch(layers, mine, lambda m: (plan, m), skip=(1,))
        layers.zero_grad()
        _run_batch(layers, mine, lambda m: (plan, m), skip=(2,))  # nothing to notice until the next batch
        layers.zero_grad()
        with pytest.raises(ReplayError, match=r"layer moe\[0\]: rank 0 of the EP group rejected its replay data: "
                                              r"layer moe\[0\]: a new batch starts .* the backward ran for 2 of its 3 "
                                              r"micro-batches \[0, 1\]"):
            _run_batch(layers, mine, lambda m: (plan, m))
        layers.zero_grad()
        _run_batch(layers, mine, lambda m: (plan, m))  # the stale batches were dropped with their errors
        for a, b in zip(grads(), ref):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
        losses = []  # one backward over the batch: the slot gradients go home in micro-batch 0's backward
        for m, (x, ids, cot) in enumerate(mine):
            with replay(layers, ids, plan=plan, micro_batch=m):
                losses.append((_forward(layers, x, None) * cot).sum())
        sum(losses).backward()
        for a, b in zip(grads(), ref):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    assert [lay.resident_replicas.returns for lay in layers] == [2] * RL
    assert [lay.resident_replicas.buffer.fills for lay in layers] == [4] * RL  # the refused batch filled nothing
    x, ids, cot = mine[0]
    with force_backend(kernel_backend()), replay(layers, ids, plan=plan, micro_batch=0):
        loss = (_forward(layers, x.clone().requires_grad_(), None) * cot).sum()
        loss.backward(retain_graph=True)
        with pytest.raises(ReplayError, match=r"layer moe\[1\]: the backward of micro-batch 0 ran twice in one batch "
                                              r"of the resident replica plan \(the backward ran for 1 of its 3"):
            loss.backward()


@pytest.mark.timeout(240)
def test_resident_plan_skipped_backward_raises_on_every_rank():
    run_group(_resident_errors_worker, 2, timeout_s=30)
