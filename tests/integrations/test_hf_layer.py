"""HFReplayMoE (relibra_moe/integrations/hf_layer.py) block by block against the plain HF block it was made from."""

from __future__ import annotations

import contextlib
import copy
import warnings

import pytest
import torch
from torch import nn

pytest.importorskip("transformers")

from relibra_moe.integrations.hf_families import family_of  # noqa: E402
from relibra_moe.integrations.hf_layer import LAYER_FAMILIES, HFReplayMoE, hf_replica_buffer  # noqa: E402
from relibra_moe.integrations.hf_tiny import tiny_model  # noqa: E402
from relibra_moe.layers.moe import ReplayBalancedMoE  # noqa: E402
from relibra_moe.layers.router import LIVE  # noqa: E402


def _block(fam: str) -> nn.Module:
    return next(m for m in tiny_model(fam).modules() if family_of(m) is not None)


def _x(seed: int = 0) -> torch.Tensor:
    return torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("fam", LAYER_FAMILIES)
def test_the_swapped_block_is_the_hf_block(fam):
    """Same output (GPT-OSS: and router scores), same state dict, HF's router instance kept."""
    hf = _block(fam)
    plain = copy.deepcopy(hf)
    router_cls = type(getattr(hf, family_of(hf).router_attr))
    sd = {k: v.clone() for k, v in plain.state_dict().items()}
    layer = HFReplayMoE(hf, layer_id=1, layer_index=0)
    assert isinstance(layer, ReplayBalancedMoE) and layer.world_size == 1
    assert isinstance(layer.router, router_cls)
    assert list(layer.state_dict()) == list(sd)
    for k, v in layer.state_dict().items():
        assert torch.equal(v, sd[k]), k
    x = _x()
    with torch.no_grad():
        ref, out = plain(x), layer(x)
    if fam == "gpt_oss":
        (ref, ref_scores), (out, scores) = ref, out
        assert scores.shape == ref_scores.shape == (10, 2)
        torch.testing.assert_close(scores, ref_scores)
        assert layer.router.last_gates is None  # cleared after the forward
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    counts = layer.last_expert_counts
    assert int(counts.sum()) == 10 * 2 and counts.shape == (8,)


def test_replayed_ids_are_followed_with_live_rows_routed_live():
    """The router's ``replay_ids``: the given ids, HF's gate rule on the live logits; a LIVE row takes the live
    top-k (float64 check of the gates: softmax of the logits at the ids, renormalized as Qwen3 does)."""
    layer = HFReplayMoE(_block("qwen3_moe"), 1, 0)
    x = _x()[0]
    ids = torch.tensor([[0, 1], [7, 6], [LIVE, LIVE], [2, 5], [3, 3 + 1]])
    with torch.no_grad():
        live = layer.router(x)
        out = layer.router(x, replay_ids=ids)
    assert torch.equal(out.ids[[0, 1, 3, 4]], ids[[0, 1, 3, 4]]) and torch.equal(out.ids[2], live.ids[2])
    p = torch.softmax(out.logits.double(), -1).gather(1, out.ids)
    torch.testing.assert_close(out.gates.double(), p / p.sum(-1, keepdim=True), rtol=1e-6, atol=1e-7)
    assert out.logits is out[0] and out.gates is out[1] and out.ids is out[2]


def _full_router_path(router: nn.Module, fam, x: torch.Tensor, rids: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """What the replayed router computed before it took the logits alone: HF's whole forward, its top-k for the
    LIVE rows, the family's gates from its logits at the merged ids."""
    logits, _, live = router(x)
    ids = torch.where(rids == LIVE, live.long(), rids)
    return logits, fam.gates(router, logits, ids), ids


_REPLAYED = [[0, 1], [7, 6], [2, 5], [3, 4], [1, -1], [-1, -1], [5, 0], [6, 7], [4, 2], [0, 3]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fam", LAYER_FAMILIES)
def test_replayed_router_computes_the_logits_alone_with_the_full_routers_gates_and_gradients(fam, dtype, monkeypatch):
    """With replayed ids the router runs HF's logits only (:func:`~relibra_moe.integrations.upstream_hf.router_logits`)
    and HF's whole forward only for LIVE rows: logits, gates, ids and the gradients of the input and of every router
    parameter are bit for bit those of the full router path, for every family, with padding (-1) and fully padded
    rows, with LIVE rows, with and without the host's trusted copy of the ids."""
    from relibra_moe.layers.router import trusted_replay

    hf = _block(fam).to(dtype)
    router = getattr(hf, family_of(hf).router_attr)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in router.parameters():  # HF's router starts at zero (GPT-OSS's bias too): random values
            p.copy_(torch.randn(p.shape, generator=g))
    plain = copy.deepcopy(router)
    layer = HFReplayMoE(hf, 1, 0)
    calls = []
    hf_forward = type(plain).forward
    monkeypatch.setattr(type(plain), "forward", lambda self, h: calls.append(self) or hf_forward(self, h))
    with_live = [row if t not in (2, 7) else [LIVE, LIVE] for t, row in enumerate(_REPLAYED)]
    for rows, trusted in ((_REPLAYED, True), (_REPLAYED, False), (with_live, True), (with_live, False)):
        rids = torch.tensor(rows)
        has_live = bool((rids == LIVE).any())
        x = torch.randn(10, 32, generator=g).to(dtype).requires_grad_()
        calls.clear()
        ctx = trusted_replay(rids.numpy(), live_rows=has_live) if trusted else contextlib.nullcontext()
        with ctx:
            out = layer.router(x, replay_ids=rids)
        assert [c is layer.router for c in calls] == ([True] if has_live else [])  # HF's top-k: LIVE rows only
        ref = _full_router_path(plain, layer.family, x, rids)
        for a, b in zip(out, ref, strict=True):
            assert a.dtype == b.dtype and torch.equal(a, b)
        assert bool((out.gates[rids == -1] == 0).all())
        wl, wg = torch.randn(out.logits.shape, generator=g), torch.randn(out.gates.shape, generator=g)
        grads = []
        for (logits, gates, _), mod in ((out, layer.router), (ref, plain)):
            loss = (logits.float() * wl).sum() + (gates.float() * wg).sum()
            grads.append(torch.autograd.grad(loss, [x, *mod.parameters()]))
        assert len(grads[0]) == (3 if fam == "gpt_oss" else 2)
        for a, b in zip(*grads, strict=True):
            assert torch.equal(a, b)


def test_the_replayed_layer_runs_hf_routers_forward_only_for_live_rows(monkeypatch):
    """Inside ``replay`` the schedule knows the rows: no LIVE row, HF's router forward (softmax, top-k) never runs
    and the layer is the plain HF block; a LIVE row (the live path) runs it once. Outputs match HF's block, and
    ``last_expert_counts`` counts each forward's pairs per expert."""
    from relibra_moe.layers.replay import replay

    hf = _block("qwen3_moe")
    plain = copy.deepcopy(hf)
    layer = HFReplayMoE(hf, 1, 0)
    calls = []
    hf_forward = type(plain.gate).forward
    monkeypatch.setattr(type(plain.gate), "forward", lambda self, h: calls.append(self) or hf_forward(self, h))
    x = _x()
    with torch.no_grad():
        ref = plain(x)
        ids = hf_forward(plain.gate, x.reshape(-1, 32))[2]  # the plain block's routing, replayed below
    assert layer.last_expert_counts is None  # no forward yet
    padded = ids.clone()
    padded[3, 1] = -1  # one pair served by no expert: another output, other counts
    for rids, n, want in ((ids, 0, ids), (torch.where(torch.arange(10)[:, None] == 4, LIVE, ids), 1, ids),
                          (padded, 0, padded)):
        calls.clear()
        with replay(layer, [rids]), torch.no_grad():
            out = layer(x)
        assert len(calls) == n and all(c is layer.router for c in calls)
        if want is ids:
            torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
        assert torch.equal(layer.last_routing, want)
        # counted when read, from this forward's ids (the cache of the previous forward's is not reused)
        assert layer.last_expert_counts.tolist() == torch.bincount(want[want >= 0], minlength=8).tolist()


@pytest.mark.parametrize("fam, names", [("qwen3_moe", {"w_gate_up": (3, 32, 32), "w_down": (3, 32, 16)}),
                                        ("gpt_oss", {"gate_up_proj": (3, 32, 32), "gate_up_proj_bias": (3, 32),
                                                     "down_proj": (3, 16, 32), "down_proj_bias": (3, 32)})])
def test_replica_buffer_has_the_experts_layout(fam, names):
    buf = hf_replica_buffer(_block(fam), 3)
    assert buf.slots == 3
    assert {n: tuple(getattr(buf, n).shape) for n in names} == names
    assert buf.dtype == torch.float32


def test_shared_experts_are_hf_outside_the_forward_and_refused_as_an_argument():
    hf = _block("qwen2_moe")
    shared = hf.shared_expert
    layer = HFReplayMoE(hf, 0, 0)
    assert layer.shared_expert is shared
    other = HFReplayMoE(_block("qwen3_moe"), 0, 0)  # no shared expert: the property refuses one
    assert other.shared_expert is None
    with pytest.raises(ValueError, match="HF block's own shared experts"):
        other.shared_expert = torch.relu
    assert "family=qwen2_moe, layer_id=0, E=8, k=2, rank=0/1" in repr(layer)


def test_a_block_of_no_layer_family_is_refused():
    with pytest.raises(ValueError, match="cannot run as a ReplayBalancedMoE"):
        HFReplayMoE(nn.Linear(2, 2), 0, 0)
    with pytest.raises(ValueError, match="not a layer family block"):
        hf_replica_buffer(nn.Linear(2, 2), 1)


def test_the_old_name_is_a_deprecated_alias():
    from relibra_moe.integrations import hf_layer

    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        assert hf_layer.HFReplayBalancedMoE is HFReplayMoE
    assert any(issubclass(x.category, DeprecationWarning) and "HFReplayMoE" in str(x.message) for x in w)
    with pytest.raises(AttributeError):
        hf_layer.NoSuchName  # noqa: B018


def _hf_resident_worker(rank: int, world: int) -> None:
    """The tiny Qwen3-MoE (3 MoE layers, 8 experts) swapped onto 2 ranks with a resident plan of 3 micro-batches
    (each layer's hot expert replicated on the other rank in every micro-batch; sample 2m + g runs micro-batch m on
    rank g): logits per micro-batch and, after the 3 backwards, every gradient (non-expert ones summed over the
    ranks, as data parallelism does; expert rows at their homes) equal the plain HF model's on the 6 sequences.
    Each block fills its own slots once and returns their gradients once; the model's shared buffer is unused."""
    import numpy as np
    import torch.distributed as dist

    from relibra_moe.integrations.hf import RoutingRecorder, moe_blocks, replay, swap_moe_blocks
    from relibra_moe.plan import BatchPlan, Placement, ReplicaPlan, SamplePlacement
    from relibra_moe.triton_kernels.backend import force_backend

    G, M, L, E = 2, 3, 3, 8
    ids = torch.arange(3, 3 + 6 * 8).reshape(6, 8) % 50 + 1
    with force_backend("torch"):
        plain = tiny_model("qwen3_moe", mlp_only_layers=[]).train()
        with RoutingRecorder(plain) as rec, torch.no_grad():
            plain(ids)
        traces = rec.traces()
        hot = sum(t.expert_counts() for t in traces).argmax(1)
        home = np.arange(E) // (E // G)
        rep = np.full((M, L, G, 1), -1, np.int32)
        idx, share = [], []
        for l in range(L):
            e, h = int(hot[l]), int(home[hot[l]])
            rep[:, l, 1 - h, 0] = e
            for m in range(M):
                for j in range(G):
                    idx += [(m, l, j, e, h), (m, l, j, e, 1 - h)]
                    share += [0.6, 0.4]
        plan = BatchPlan(Placement(np.tile(home, (L, 1))), SamplePlacement(np.repeat(np.arange(M), G),
                                                                           np.tile(np.arange(G), M), M),
                         ReplicaPlan(rep, np.array(idx), np.array(share)), num_gpus=G, gpus_per_node=G)
        assert plan.replicas.resident
        for s in range(6):
            plain(ids[s:s + 1]).logits.square().mean().backward()
        with torch.no_grad():
            ref = plain(ids).logits
        model = swap_moe_blocks(tiny_model("qwen3_moe", mlp_only_layers=[]), replica_slots=1, gpus_per_node=G).train()
        for m in range(M):
            with replay(model, traces, plan, micro_batch=m) as rows:
                assert rows == [2 * m + rank], rows
                logits = model(ids[rows]).logits
            torch.testing.assert_close(logits.detach(), ref[rows], rtol=1e-5, atol=1e-6)
            logits.square().mean().backward()
    blocks = [b for _, _, b in moe_blocks(model)]
    assert [b.resident_replicas.buffer.fills for b in blocks] == [1] * L
    assert [b.resident_replicas.returns for b in blocks] == [1] * L
    assert blocks[0].replica_buffer.fills == 0
    served = torch.tensor([sum(int(b.last_slot_counts[b.num_local:].sum()) for b in blocks)])
    dist.all_reduce(served)
    assert int(served) > 0  # the replica slots computed rows
    want = dict(plain.named_parameters())
    experts = {n for n, p in model.named_parameters() if ".experts." in n}
    for name, p in model.named_parameters():
        g = p.grad.clone()
        if name in experts:
            block = next(b for b in blocks if name.startswith(_prefix(model, b)))
            torch.testing.assert_close(g, want[name].grad[block.home_experts], rtol=1e-4, atol=1e-6, msg=name)
        else:
            dist.all_reduce(g)
            torch.testing.assert_close(g, want[name].grad, rtol=1e-4, atol=1e-6, msg=name)


def _prefix(model: nn.Module, block: nn.Module) -> str:
    return next(n for n, m in model.named_modules() if m is block) + "."


@pytest.mark.timeout(300)
def test_swapped_qwen3_moe_with_a_resident_plan_is_the_plain_model_on_two_ranks():
    from relibra_moe.layers.testing import run_group

    run_group(_hf_resident_worker, 2, timeout_s=60)
