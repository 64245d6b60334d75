"""TopKRouter: softmax and DeepSeek-V3 sigmoid/group-limited selection against hand-written loops;
replay uses the given ids, takes gates from the live logits (router gradients flow), and rejects bad
ids with ReplayError naming the layer and the mismatch."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from relibra_moe.errors import ReplayError
from relibra_moe.layers.router import TopKRouter, check_replay_ids


def _loop_softmax_topk(x: np.ndarray, w: np.ndarray, k: int, renorm: bool):
    """float64 per-token loop: softmax, pick the k largest (stable ties by index), gates."""
    ids, gates = [], []
    for row in x @ w.T:
        p = np.exp(row - row.max())
        p /= p.sum()
        order = sorted(range(len(p)), key=lambda e: (-p[e], e))[:k]
        g = p[order]
        if renorm:
            g = g / g.sum()
        ids.append(order)
        gates.append(g)
    return np.array(ids), np.array(gates)


def _loop_deepseek(x, w, bias, k, num_groups, topk_group, renorm, scale):
    """float64 loop of DeepSeek-V3's noaux_tc selection."""
    E = w.shape[0]
    per = E // num_groups
    ids, gates = [], []
    for row in x @ w.T:
        s = 1.0 / (1.0 + np.exp(-row))
        b = s + bias
        gscore = [sum(sorted(b[g * per:(g + 1) * per])[-2:]) for g in range(num_groups)]
        keep = sorted(range(num_groups), key=lambda g: -gscore[g])[:topk_group]
        cand = [e for e in range(E) if e // per in keep]
        order = sorted(cand, key=lambda e: -b[e])[:k]
        g = s[order]
        if renorm:
            g = g / g.sum()
        ids.append(order)
        gates.append(g * scale)
    return np.array(ids), np.array(gates)


@given(seed=st.integers(0, 2**16), T=st.integers(1, 12), E=st.sampled_from([4, 8, 16]), k=st.integers(1, 4),
       renorm=st.booleans())
def test_softmax_router_matches_loop(seed, T, E, k, renorm):
    torch.manual_seed(seed)
    r = TopKRouter(6, E, k, renormalize=renorm)
    x = torch.randn(T, 6)
    out = r(x)
    ids, gates = _loop_softmax_topk(x.double().numpy(), r.weight.detach().double().numpy(), k, renorm)
    assert out.ids.shape == (T, k) and out.gates.shape == (T, k)
    # same set per row (top-k order among equal probabilities is irrelevant for the layer)
    assert [set(a) for a in out.ids.tolist()] == [set(a) for a in ids.tolist()]
    got = {(t, int(e)): float(g) for t in range(T) for e, g in zip(out.ids[t], out.gates[t].detach())}
    want = {(t, int(e)): float(g) for t in range(T) for e, g in zip(ids[t], gates[t])}
    for key, v in want.items():
        assert math.isclose(got[key], v, rel_tol=1e-5, abs_tol=1e-7)


@given(seed=st.integers(0, 2**16), renorm=st.booleans())
def test_sigmoid_group_limited_matches_loop(seed, renorm):
    torch.manual_seed(seed)
    E, k, num_groups, topk_group = 16, 4, 4, 2
    r = TopKRouter(6, E, k, scoring="sigmoid", renormalize=renorm, num_groups=num_groups, topk_group=topk_group,
                   routed_scaling_factor=2.5)
    with torch.no_grad():
        r.e_score_correction_bias.copy_(torch.randn(E) * 0.3)
    x = torch.randn(9, 6)
    out = r(x)
    ids, gates = _loop_deepseek(x.double().numpy(), r.weight.detach().double().numpy(),
                                r.e_score_correction_bias.double().numpy(), k, num_groups, topk_group, renorm, 2.5)
    for t in range(9):
        assert set(out.ids[t].tolist()) == set(ids[t].tolist())
        got = dict(zip(out.ids[t].tolist(), out.gates[t].tolist()))
        for e, g in zip(ids[t], gates[t]):
            assert math.isclose(got[int(e)], g, rel_tol=1e-5)
        # group limit: the chosen experts span at most topk_group groups
        assert len({e // (E // num_groups) for e in out.ids[t].tolist()}) <= topk_group


def test_bias_changes_selection_not_gates():
    torch.manual_seed(0)
    r = TopKRouter(4, 8, 2, scoring="sigmoid", renormalize=False)
    x = torch.randn(5, 4)
    with torch.no_grad():
        r.e_score_correction_bias.fill_(0.0)
        r.e_score_correction_bias[7] = 100.0  # expert 7 always selected
    out = r(x)
    assert (out.ids == 7).any(dim=1).all()
    s = torch.sigmoid(x @ r.weight.T)
    torch.testing.assert_close(out.gates, s.gather(1, out.ids))


def test_replay_uses_ids_and_gates_from_live_logits():
    torch.manual_seed(1)
    r = TopKRouter(6, 8, 2)
    x = torch.randn(7, 6)
    ids = torch.tensor([[7, 0], [1, 2], [3, 4], [5, 6], [0, 7], [2, 4], [6, 1]])
    out = r(x, replay_ids=ids)
    assert torch.equal(out.ids, ids)
    p = torch.softmax(x @ r.weight.T, dim=-1).gather(1, ids)
    torch.testing.assert_close(out.gates, p / p.sum(-1, keepdim=True))
    out.gates[:, 0].sum().backward()
    assert r.weight.grad is not None and r.weight.grad.abs().sum() > 0


def test_replay_of_live_ids_is_identical():
    torch.manual_seed(2)
    r = TopKRouter(6, 8, 3, renormalize=False)
    x = torch.randn(11, 6)
    live = r(x)
    again = r(x, replay_ids=live.ids.to(torch.int16))
    assert torch.equal(again.ids, live.ids)
    assert torch.equal(again.gates, live.gates)


def test_replay_padding_gets_zero_gate():
    r = TopKRouter(4, 6, 2)
    x = torch.randn(3, 4)
    out = r(x, replay_ids=torch.tensor([[1, -1], [-1, -1], [2, 3]]))
    out.gates = out.gates.detach()
    assert out.gates[0, 1] == 0 and float(out.gates[0, 0]) == pytest.approx(1.0)
    assert torch.equal(out.gates[1], torch.zeros(2))


@pytest.mark.parametrize("ids,match", [
    (torch.zeros(4, 2, dtype=torch.long) + torch.tensor([0, 1]), "cover 4 tokens, the batch has 5"),
    (torch.zeros(5, 3, dtype=torch.long) + torch.tensor([0, 1, 2]), "k=3, the router has top_k=2"),
    (torch.tensor([[0, 1]] * 4 + [[0, 8]]), r"\[4, 1\] = 8 is outside \[-1, 8\)"),
    (torch.tensor([[0, 1]] * 4 + [[-3, 1]]), "is outside"),
    (torch.tensor([[0, 1]] * 4 + [[-2, 1]]), r"row 4 = \[-2, 1\] mixes -2 \(route live\)"),  # -2 = LIVE
    (torch.tensor([[0, 1]] * 3 + [[3, 3]] + [[0, 1]]), "row 3 .* repeats expert 3"),
    (torch.zeros(5, 2), "integer"),
    (torch.zeros(10, dtype=torch.long), r"\[T, k\]"),
])
def test_bad_replay_raises_naming_layer(ids, match):
    r = TopKRouter(4, 8, 2, name="moe[7]")
    with pytest.raises(ReplayError, match=match) as info:
        r(torch.randn(5, 4), replay_ids=ids)
    assert "moe[7]" in str(info.value)


def test_duplicate_padding_is_not_a_duplicate():
    assert check_replay_ids(torch.tensor([[-1, -1, 2]]), 1, 3, 4).tolist() == [[-1, -1, 2]]


def test_constructor_rejects_bad_config():
    with pytest.raises(ValueError):
        TopKRouter(4, 8, 9)
    with pytest.raises(ValueError):
        TopKRouter(4, 8, 2, num_groups=3, scoring="sigmoid")
    with pytest.raises(ValueError):
        TopKRouter(4, 8, 2, num_groups=2, topk_group=1, scoring="softmax")


def test_bad_sizes_and_inputs_are_named():
    with pytest.raises(ValueError, match="top_k=2.0 must be an integer"):
        TopKRouter(8, 4, 2.0)
    with pytest.raises(ValueError, match="hidden=0"):
        TopKRouter(0, 4, 2)
    r = TopKRouter(8, 4, 2, name="moe[3]")
    with pytest.raises(ValueError, match=r"moe\[3\]: x has shape \(3, 7\), expected \[T, hidden=8\]"):
        r(torch.randn(3, 7))
