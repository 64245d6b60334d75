"""Recorder + replay for trainers that feed the whole sequence (prompt + completion, TRL style).

A greedy rollout of two left-padded prompts in which sequence 0 stops at its EOS after 2 tokens while
sequence 1 runs 5 (generate() keeps feeding sequence 0 pad tokens). The training forward feeds
``[prompt | completion up to EOS]`` with TRL's masks. The traces trimmed to the mask (``lengths``) have
no post-EOS rows, and the one never-fed last token is routed live: loss (with the router aux loss at
its default coefficient) and every gradient equal the plain HF model's. Serving that token by no
expert (``unrouted="none"``, the old behaviour) visibly changes the router gradient.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from relibra_moe.errors import ReplayError  # noqa: E402
from relibra_moe.integrations.hf import RoutingRecorder, replay, swap_moe_blocks  # noqa: E402
from relibra_moe.integrations.hf_tiny import tiny_model  # noqa: E402
from relibra_moe.layers.router import LIVE, TopKRouter, check_replay_ids  # noqa: E402

PROMPTS = torch.tensor([[0, 0, 5, 6, 7], [8, 9, 10, 11, 12]])
EOS = 84  # the second token greedy decoding of seed 3 gives sequence 0 (not in sequence 1's completion)
NEW = 5


def _rollout():
    model = tiny_model("qwen3_moe", seed=3)
    mask = (PROMPTS != 0).long()
    with RoutingRecorder(model) as rec, torch.no_grad():
        out = model.generate(PROMPTS, attention_mask=mask, max_new_tokens=NEW, do_sample=False, eos_token_id=EOS)
    comp = out[:, PROMPTS.shape[1]:]
    is_eos = comp == EOS
    end = torch.where(is_eos.any(1), is_eos.int().argmax(1), torch.full((2,), comp.shape[1]))
    comp_mask = (torch.arange(comp.shape[1])[None] <= end[:, None]).long()  # TRL: up to and including EOS
    comp = comp.masked_fill(comp_mask == 0, 0)
    ids = torch.cat([PROMPTS, comp], 1)
    attn = torch.cat([mask, comp_mask], 1)
    return model, rec, ids, attn


def _loss(model, ids, attn):
    labels = ids.masked_fill(attn == 0, -100)
    out = model(input_ids=ids, attention_mask=attn, labels=labels, output_router_logits=True)
    assert out.aux_loss is not None and model.config.router_aux_loss_coef > 0
    out.loss.backward()
    return float(out.loss.detach()), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("backend", ["layer", "local"])
def test_full_sequence_replay_equals_plain_model_with_aux_loss(backend):
    model, rec, ids, attn = _rollout()
    assert attn.sum(1).tolist() == [3 + 2, 5 + 5]
    raw = rec.sequences()
    assert [len(s) for s in raw] == [3 + NEW - 1, 5 + NEW - 1]  # seq 0 kept 2 post-EOS pad rows
    lengths = attn.sum(1)
    traces = rec.traces(lengths=lengths)
    assert [t.num_tokens for t in traces] == [5, 9]  # seq 0: no pad rows; seq 1: last token never fed
    np.testing.assert_array_equal(traces[0].experts, raw[0][:5])

    plain = copy.deepcopy(model).train()
    swapped = swap_moe_blocks(copy.deepcopy(model), backend=backend).train()
    loss_ref, g_ref = _loss(plain, ids, attn)
    with replay(swapped, traces, attention_mask=attn), RoutingRecorder(swapped) as seen:
        loss, g = _loss(swapped, ids, attn)
    assert abs(loss - loss_ref) <= 1e-6 * abs(loss_ref)
    assert set(g) == set(g_ref)
    for n in g_ref:
        torch.testing.assert_close(g[n], g_ref[n], rtol=1e-5, atol=1e-7, msg=n)
    # every fed token was served: recorded rows replayed, the never-fed last token routed live
    with RoutingRecorder(plain) as live, torch.no_grad():
        plain(input_ids=ids, attention_mask=attn)
    for a, b in zip(seen.sequences(), live.sequences()):
        np.testing.assert_array_equal(a, b)
        assert (a >= 0).all()

    # the old rule (never-fed token served by no expert) gives a different router gradient
    old = swap_moe_blocks(copy.deepcopy(model), backend=backend).train()
    with replay(old, traces, attention_mask=attn, unrouted="none"):
        _, g_old = _loss(old, ids, attn)
    router = [n for n in g_ref if n.endswith("mlp.gate.weight")]
    rel = max(float((g_old[n] - g_ref[n]).abs().max() / g_ref[n].abs().max()) for n in router)
    assert rel > 1e-4, rel  # 100x the tolerance the live rule meets above
    with pytest.raises(ReplayError, match="10 ones.*unrouted='error'"):
        with replay(old, traces, attention_mask=attn, unrouted="error"):
            pass


def test_trim_lengths_are_checked():
    _, rec, _, _ = _rollout()
    with pytest.raises(ReplayError, match=r"lengths\[1\] = 11, sequence 1 recorded 9 fed tokens"):
        rec.traces(lengths=[5, 11])
    with pytest.raises(ReplayError, match=r"lengths must be integers \[N=2\]"):
        rec.traces(lengths=[5])
    with pytest.raises(ReplayError, match=r"unrouted='x' is not one of"):
        with replay(swap_moe_blocks(tiny_model("qwen3_moe")), rec.traces(), unrouted="x"):
            pass


def test_live_rows_route_live_and_mixed_rows_are_rejected():
    torch.manual_seed(0)
    router = TopKRouter(8, 6, 2)
    x = torch.randn(4, 8)
    live = router(x)
    ids = live.ids.clone()
    ids[1] = torch.tensor([5, 4]) if live.ids[1].tolist() != [5, 4] else torch.tensor([0, 1])
    ids[2] = LIVE
    out = router(x, replay_ids=ids)
    assert out.ids[2].tolist() == live.ids[2].tolist() and out.ids[1].tolist() == ids[1].tolist()
    torch.testing.assert_close(out.gates[2], live.gates[2])
    with pytest.raises(ReplayError, match=r"row 0 = \[-2, 3\] mixes -2"):
        check_replay_ids(torch.tensor([[LIVE, 3]]), 1, 2, 6, allow_live=True)
    with pytest.raises(ReplayError, match=r"outside \[-1, 6\) \(-2 = route live is not supported"):
        check_replay_ids(torch.tensor([[LIVE, LIVE]]), 1, 2, 6)
