"""RoutingRecorder details: bf16, padding, sessions, swapped models, and replay's id layout."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from relibra_moe.errors import ReplayError  # noqa: E402
from relibra_moe.integrations.hf import RoutingRecorder, layout_ids, replay, swap_moe_blocks  # noqa: E402
from relibra_moe.integrations.hf_tiny import tiny_model  # noqa: E402
from relibra_moe.trace import RoutingTrace  # noqa: E402
from relibra_moe.triton_kernels.backend import force_backend  # noqa: E402

PROMPTS = torch.tensor([[0, 0, 5, 6, 7, 9], [3, 4, 5, 6, 7, 8]])
MASK = (PROMPTS != 0).long()


@pytest.fixture(autouse=True)
def _torch_kernels():
    with force_backend("torch"):
        yield


@pytest.mark.parametrize("fam", ["qwen3_moe", "deepseek_v3"])
def test_bf16_recorded_sets_equal_teacher_forced(fam):
    """In bf16 near-ties may reorder a row between decode and a full forward: compare per-token sets."""
    model = tiny_model(fam).to(torch.bfloat16)
    with RoutingRecorder(model) as rec, torch.no_grad():
        gen = model.generate(PROMPTS, attention_mask=MASK, max_new_tokens=4, do_sample=False)
    full = gen[:, :-1]
    mask = torch.cat([MASK, torch.ones(2, full.shape[1] - 6, dtype=MASK.dtype)], 1)
    with RoutingRecorder(model) as tf, torch.no_grad():
        model(full, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0))
    for a, b in zip(rec.sequences(), tf.sequences()):
        assert a.dtype == np.int16
        np.testing.assert_array_equal(np.sort(a, axis=-1), np.sort(b, axis=-1))


def test_sessions_padding_and_detach():
    model = tiny_model("olmoe")
    rec = RoutingRecorder(model)
    assert rec.attach() is rec.attach()  # idempotent
    with torch.no_grad():
        model.generate(PROMPTS, attention_mask=MASK, max_new_tokens=3, do_sample=False)
        model.generate(PROMPTS[1:], max_new_tokens=2, do_sample=False)  # no mask, batch 1
        # a right-padded plain forward: its own session, padding dropped
        model(torch.tensor([[7, 8, 9, 0]]), attention_mask=torch.tensor([[1, 1, 1, 0]]))
    rec.detach()
    with torch.no_grad():
        model(PROMPTS)  # not recorded
    lengths = [t.num_tokens for t in rec.traces()]
    assert lengths == [4 + 2, 6 + 2, 6 + 1, 3]
    assert rec.trace_batch().num_sequences == 4
    rec.clear()
    assert rec.sequences() == []


def test_recorder_rejects_beam_search_and_leaves_it_alone_when_detached():
    """Beam search reorders the cache between steps: under the recorder that is an error, not wrong rows."""
    model = tiny_model("qwen3_moe")
    with RoutingRecorder(model) as rec, torch.no_grad():
        with pytest.raises(ReplayError, match="reordered the KV cache.*beam search"):
            model.generate(PROMPTS, attention_mask=MASK, max_new_tokens=4, do_sample=False, num_beams=2)
        gen = model.generate(PROMPTS, attention_mask=MASK, max_new_tokens=3, do_sample=False)  # greedy still fine
    assert [len(s) for s in rec.sequences()[-2:]] == [int(MASK[b].sum()) + gen.shape[1] - 7 for b in range(2)]
    with torch.no_grad():  # not recording: beam search runs as usual
        out = model.generate(PROMPTS, attention_mask=MASK, max_new_tokens=4, do_sample=False, num_beams=2)
    assert out.shape == (2, 10)


def test_recorder_rejects_4d_mask():
    model = tiny_model("qwen3_moe")
    with RoutingRecorder(model), pytest.raises(ReplayError, match="2-D attention_mask"), torch.no_grad():
        model(PROMPTS, attention_mask=torch.ones(2, 1, 6, 6, dtype=torch.bool))


@pytest.mark.parametrize("fam", ["qwen2_moe", "gpt_oss"])
def test_recorder_on_swapped_model_records_the_ids_used(fam):
    """On a swapped model (layer-backed, or GPT-OSS's local block) the recorder sees what the layer ran:
    live ids without replay, the replayed ids under replay."""
    model = tiny_model(fam)
    with RoutingRecorder(model) as ref, torch.no_grad():
        model(PROMPTS, attention_mask=MASK)
    swap_moe_blocks(model)
    with RoutingRecorder(model) as live, torch.no_grad():
        model(PROMPTS, attention_mask=MASK)
    for a, b in zip(ref.sequences(), live.sequences()):
        np.testing.assert_array_equal(a, b)
    g = np.random.default_rng(0)
    forced = [RoutingTrace(np.stack([[g.permutation(8)[:2] for _ in range(3)] for _ in range(n)]), [0, 1, 2], 8, 2)
              for n in (4, 6)]
    with replay(model, forced, attention_mask=MASK), RoutingRecorder(model) as rec, torch.no_grad():
        model(PROMPTS, attention_mask=MASK)
    for want, got in zip(forced, rec.traces()):
        np.testing.assert_array_equal(got.experts, want.experts)


@given(lengths=st.lists(st.integers(1, 6), min_size=1, max_size=4), left=st.booleans(), extra=st.integers(0, 2))
def test_layout_ids_places_rows_at_mask_positions(lengths, left, extra):
    S = max(lengths) + extra
    traces, mask = [], torch.zeros(len(lengths), S, dtype=torch.long)
    for b, n in enumerate(lengths):
        ids = (np.arange(n * 2 * 2).reshape(n, 2, 2) + 100 * b) % 8
        ids[..., 1] = (ids[..., 0] + 1) % 8  # distinct in a row
        traces.append(RoutingTrace(ids, [0, 1], 8, 2))
        if left:
            mask[b, S - n:] = 1
        else:
            mask[b, :n] = 1
    for li in range(2):
        out = layout_ids(traces, li, mask).reshape(len(lengths), S, 2)
        for b, tr in enumerate(traces):
            np.testing.assert_array_equal(out[b][mask[b].bool()].numpy(), tr.experts[:, li])
            assert (out[b][~mask[b].bool()] == -1).all()
        if not left and extra == 0:  # right padding to the longest: the mask is optional
            np.testing.assert_array_equal(layout_ids(traces, li).numpy(), out.reshape(-1, 2).numpy())


def test_replay_placeholder_when_no_sample_selected():
    from relibra_moe.trace import TraceBatch

    model = swap_moe_blocks(tiny_model("qwen3_moe"))
    tr = RoutingTrace(np.tile(np.array([1, 2], np.int16), (3, 2, 1)), [0, 2], 8, 2)
    batch = TraceBatch([tr, tr], micro_batch=[0, 0])
    with replay(model, batch, micro_batch=1) as rows, torch.no_grad():
        assert rows == []
        model(torch.tensor([[0]]))  # the placeholder forward: served by no expert
    assert all(int(b.last_expert_counts.sum()) == 0 for b in (model.model.layers[0].mlp, model.model.layers[2].mlp))
