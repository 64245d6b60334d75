"""Hugging Face integration on tiny random models of every supported family (no downloads).

Per family: the swapped model is the HF model (logits <= 1e-5, identical greedy ``generate()``, identical
``state_dict``); the recorder's ids from ``generate()`` (prefill + decode, left padding, batch 3) equal the
ids of one teacher-forced forward over the generated sequences (0 mismatches, fp32); replaying them gives
the live logits and gradients; the aux loss survives the swap; ``save_pretrained`` round-trips.

Recorder + replay for trainers that feed the whole sequence (prompt + completion, TRL style).

A greedy rollout of two left-padded prompts in which sequence 0 stops at its EOS after 2 tokens while
sequence 1 runs 5 (generate() keeps feeding sequence 0 pad tokens). The training forward feeds
``[prompt | completion up to EOS]`` with TRL's masks. The traces trimmed to the mask (``lengths``) have
no post-EOS rows, and the one never-fed last token is routed live: loss (with the router aux loss at
its default coefficient) and every gradient equal the plain HF model's. Serving that token by no
expert (``unrouted="none"``, the old behaviour) visibly changes the router gradient.

RoutingRecorder details: bf16, padding, sessions, swapped models, and replay's id layout.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from relibra_moe.errors import ReplayError  # noqa: E402
from relibra_moe.integrations.hf import (  # noqa: E402
    HFLocalReplayMoE,
    RoutingRecorder,
    checkpoint_state_dict,
    full_state_dict,
    layout_ids,
    load_full_state_dict,
    moe_blocks,
    moe_layer_ids,
    replay,
    swap_moe_blocks,
)
from relibra_moe.integrations.hf_layer import HFReplayMoE  # noqa: E402
from relibra_moe.integrations.hf_tiny import FAMILIES, tiny_model  # noqa: E402
from relibra_moe.layers.moe import ReplayBalancedMoE  # noqa: E402
from relibra_moe.layers.router import LIVE, TopKRouter, check_replay_ids  # noqa: E402
from relibra_moe.trace import RoutingTrace, TraceBatch  # noqa: E402
from relibra_moe.triton_kernels.backend import force_backend  # noqa: E402

PROMPTS = torch.tensor([[0, 0, 5, 6, 7, 9], [3, 4, 5, 6, 7, 8], [0, 0, 0, 11, 12, 13]])
MASK = (PROMPTS != 0).long()
NEW = 5
# decoder indices of the MoE layers of the tiny configs (qwen3_moe: layer 1 is dense via mlp_only_layers;
# deepseek_v3: first_k_dense_replace = 1)
EXPECTED_LAYERS = {"qwen3_moe": [0, 2], "deepseek_v3": [1, 2]}
HAS_AUX = [f for f in FAMILIES if f != "deepseek_v3"]  # DeepSeek-V3 in transformers has no aux loss
SWAPPED = (HFLocalReplayMoE, HFReplayMoE)


#: Tests that run the layer's ops on the default backend (the Triton interpreter on CPU) end to end.
DEFAULT_BACKEND_TESTS = frozenset({
    "test_swap_through_triton_kernels",
    "test_full_sequence_replay_equals_plain_model_with_aux_loss",
    "test_trim_lengths_are_checked",
    "test_live_rows_route_live_and_mixed_rows_are_rejected",
})


@pytest.fixture(autouse=True)
def _torch_kernels(request):
    """The layer's ops through their torch references (the Triton interpreter is slow; the kernels have
    their own tests), except in :data:`DEFAULT_BACKEND_TESTS`."""
    if request.node.originalname in DEFAULT_BACKEND_TESTS:
        yield
        return
    with force_backend("torch"):
        yield


def _replay_state(block):
    return None if block.replay_state is None else block.replay_state.ids


def _teacher_inputs(gen: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Shifted causal-LM inputs of the generated batch: ids [B, S-1], mask, position ids."""
    full = gen[:, :-1]
    mask = torch.cat([MASK, torch.ones(len(gen), full.shape[1] - MASK.shape[1], dtype=MASK.dtype)], dim=1)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    return full, mask, pos


@pytest.fixture(scope="module", params=FAMILIES)
def rollout(request):
    """(family, HF model, generated ids, recorder) with the recorder on during generate()."""
    fam = request.param
    model = tiny_model(fam)
    with RoutingRecorder(model) as rec, torch.no_grad():
        gen = model.generate(PROMPTS, attention_mask=MASK, max_new_tokens=NEW, do_sample=False)
    return fam, model, gen, rec


def test_recorder_equals_teacher_forced_forward(rollout):
    fam, model, gen, rec = rollout
    traces = rec.traces()
    assert len(traces) == len(PROMPTS)
    want_layers = EXPECTED_LAYERS.get(fam, [0, 1, 2])
    for b, tr in enumerate(traces):
        assert isinstance(tr, RoutingTrace)
        # fed tokens: the unpadded prompt and every generated token but the last
        assert tr.num_tokens == int(MASK[b].sum()) + NEW - 1
        assert tr.layer_ids.tolist() == want_layers
        assert tr.top_k == 2 and tr.num_experts == 8 and tr.start == 0
    full, mask, pos = _teacher_inputs(gen)
    with RoutingRecorder(model) as tf, torch.no_grad():
        model(full, attention_mask=mask, position_ids=pos)
    # an independent teacher-forced reading: the routers' own top-k on that forward, via HF's own hooks
    mismatches = sum(int((a.experts != b.experts).sum()) for a, b in zip(traces, tf.traces()))
    assert mismatches == 0
    # and via output_router_logits, which needs no recorder at all (the router's logits -> top-k)
    if fam not in ("deepseek_v3", "gpt_oss"):
        with torch.no_grad():
            out = model(full, attention_mask=mask, position_ids=pos, output_router_logits=True)
        for li, logits in enumerate(out.router_logits):
            ids = torch.topk(torch.softmax(logits.float(), -1), 2, dim=-1).indices.reshape(len(gen), -1, 2)
            for b, tr in enumerate(traces):
                np.testing.assert_array_equal(ids[b][mask[b].bool()].numpy(), tr.experts[:, li])
    batch = rec.trace_batch()
    assert isinstance(batch, TraceBatch) and batch.num_sequences == len(PROMPTS)


def test_swap_is_the_hf_model(rollout):
    fam, model, gen, _ = rollout
    swapped = tiny_model(fam)
    ref_sd = {k: v.clone() for k, v in swapped.state_dict().items()}
    with torch.no_grad():
        ref = swapped(PROMPTS, attention_mask=MASK).logits
    swap_moe_blocks(swapped)
    blocks = [m for m in swapped.modules() if isinstance(m, SWAPPED)]
    assert [b.layer_id for b in blocks] == EXPECTED_LAYERS.get(fam, [0, 1, 2])
    # every family (GPT-OSS included) runs as the library's ReplayBalancedMoE layer
    assert all(isinstance(b, ReplayBalancedMoE) for b in blocks)
    sd = swapped.state_dict()
    assert list(sd) == list(ref_sd)
    for k in sd:
        assert torch.equal(sd[k], ref_sd[k]), k
    with torch.no_grad():
        out = swapped(PROMPTS, attention_mask=MASK).logits
        g = swapped.generate(PROMPTS, attention_mask=MASK, max_new_tokens=NEW, do_sample=False)
    assert (out - ref).abs().max().item() <= 1e-5
    assert torch.equal(g, gen)
    if fam in ("qwen2_moe", "qwen3_next"):  # HF attribute access still works outside forward
        assert swapped.model.layers[0].mlp.shared_expert is swapped.model.layers[0].mlp.get_submodule("shared_expert")
    # swapping twice is a no-op
    assert swap_moe_blocks(swapped) is swapped
    assert sum(isinstance(m, SWAPPED) for m in swapped.modules()) == len(blocks)


def _loss_and_grads(model, full, mask, pos, labels, aux: bool):
    model.zero_grad(set_to_none=True)
    kw = dict(attention_mask=mask, position_ids=pos, labels=labels)
    if aux:
        kw["output_router_logits"] = True
    out = model(full, **kw)
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out, grads


def test_replay_gives_live_logits_and_gradients(rollout):
    fam, _, gen, rec = rollout
    model = swap_moe_blocks(tiny_model(fam)).train()
    full, mask, pos = _teacher_inputs(gen)
    # HF shifts labels inside: the logit at t is scored against labels[t + 1]; padding positions t must not
    # count (their hidden states differ: replay sends padding rows to no expert)
    labels = full.masked_fill(mask == 0, -100)
    labels[:, 1:] = labels[:, 1:].masked_fill(mask[:, :-1] == 0, -100)
    aux = fam in HAS_AUX
    live, g_live = _loss_and_grads(model, full, mask, pos, labels, aux)
    with replay(model, rec.trace_batch(), attention_mask=mask) as rows:
        assert rows == [0, 1, 2]
        rep, g_rep = _loss_and_grads(model, full, mask, pos, labels, aux)
    keep = mask.bool()
    assert (live.logits[keep] - rep.logits[keep]).abs().max().item() <= 1e-5
    assert abs(live.loss.item() - rep.loss.item()) <= 1e-6
    assert set(g_live) == set(g_rep)
    routers = [n for n in g_live if n.endswith(("mlp.gate.weight", "mlp.router.weight"))]
    assert routers, "the router must get gradients under replay"
    for n in g_live:
        torch.testing.assert_close(g_rep[n], g_live[n], rtol=1e-4, atol=1e-6, msg=n)
    # the replay state is gone after the context
    assert all(_replay_state(b) is None for _, _, b in moe_blocks(model))


@pytest.mark.parametrize("fam", HAS_AUX)
def test_aux_loss_after_swap(fam):
    model = tiny_model(fam, router_aux_loss_coef=0.1)
    labels = PROMPTS.masked_fill(MASK == 0, -100)
    ref = model(PROMPTS, attention_mask=MASK, labels=labels, output_router_logits=True)
    assert ref.aux_loss is not None
    swap_moe_blocks(model)
    out = model(PROMPTS, attention_mask=MASK, labels=labels, output_router_logits=True)
    assert len(out.router_logits) == len(moe_layer_ids(model))
    torch.testing.assert_close(out.aux_loss, ref.aux_loss, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(out.loss, ref.loss, rtol=1e-6, atol=1e-7)
    # the aux loss alone still trains the router
    model.zero_grad()
    out.aux_loss.backward()
    router = model.model.layers[0].mlp.get_submodule("router" if fam == "gpt_oss" else "gate")
    assert router.weight.grad is not None and router.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("fam", ["qwen3_moe", "gpt_oss", "deepseek_v3"])
def test_save_pretrained_round_trip(fam, tmp_path):
    import transformers as tr

    model = swap_moe_blocks(tiny_model(fam, seed=3))
    model.save_pretrained(tmp_path)
    plain = tr.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert not any(isinstance(m, SWAPPED) for m in plain.modules())
    sd, psd = model.state_dict(), plain.state_dict()
    assert set(sd) == set(psd)
    full = full_state_dict(model)  # one rank: the plain state dict
    assert list(full) == list(sd) and all(torch.equal(full[k], sd[k]) for k in sd)
    for k in sd:
        assert torch.equal(sd[k], psd[k]), k
    with torch.no_grad():
        a = model(PROMPTS, attention_mask=MASK).logits
        b = plain(PROMPTS, attention_mask=MASK).logits
    assert (a - b).abs().max().item() <= 1e-5
    # a swapped model loads an HF state dict strictly
    other = swap_moe_blocks(tiny_model(fam, seed=4))
    other.load_state_dict(psd, strict=True)
    with torch.no_grad():
        c = other(PROMPTS, attention_mask=MASK).logits
    assert (a - c).abs().max().item() <= 1e-5
    # the saved file's own tensors (transformers' checkpoint layout: one tensor per expert) under the model's keys,
    # as a Trainer resume reads them; a plain load_state_dict of the file would miss every expert tensor
    from safetensors.torch import load_file

    saved = load_file(str(tmp_path / "model.safetensors"))
    assert any(".experts.0." in k for k in saved) or fam == "gpt_oss"
    converted = checkpoint_state_dict(other, saved)
    assert set(converted) == set(sd) and all(torch.equal(converted[k], sd[k]) for k in sd)
    fresh = swap_moe_blocks(tiny_model(fam, seed=5))
    assert not load_full_state_dict(fresh, converted).missing_keys
    assert all(torch.equal(v, sd[k]) for k, v in fresh.state_dict().items())


def test_unsupported_family_lists_supported():
    import transformers as tr

    cfg = tr.LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=16, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2)
    llama = tr.LlamaForCausalLM(cfg)
    with pytest.raises(ValueError, match="Qwen3MoeSparseMoeBlock") as err:
        swap_moe_blocks(llama)
    for cls in ("MixtralSparseMoeBlock", "DeepseekV3MoE", "GptOssMLP", "Qwen3NextSparseMoeBlock"):
        assert cls in str(err.value)


def test_replay_errors_and_nesting():
    model = tiny_model("qwen3_moe")
    tr0 = RoutingTrace(np.zeros((4, 2, 2), np.int16) + np.array([0, 1], np.int16), [0, 2], 8, 2)
    with pytest.raises(ReplayError, match="swap_moe_blocks"):
        with replay(model, [tr0]):
            pass
    swap_moe_blocks(model)
    bad_layers = RoutingTrace(tr0.experts, [0, 1], 8, 2)
    with pytest.raises(ReplayError, match=r"layer_ids \[0, 1\].*\[0, 2\]"):
        with replay(model, [bad_layers]):
            pass
    bad_e = RoutingTrace(tr0.experts, [0, 2], 16, 2)
    with pytest.raises(ReplayError, match="E=16"):
        with replay(model, bad_e):
            pass
    with pytest.raises(ReplayError, match="micro-batch assignment"):
        with replay(model, [tr0], micro_batch=0):
            pass
    with pytest.raises(ReplayError, match="cover 4 tokens.*5"):
        with replay(model, tr0), torch.no_grad():
            model(torch.tensor([[3, 4, 5, 6, 7]]))
    with pytest.raises(ReplayError, match="attention_mask row has 3 ones"):
        with replay(model, tr0, attention_mask=torch.tensor([[0, 1, 1, 1]])):
            pass
    # nested contexts restore the outer routing
    tr1 = RoutingTrace(np.tile(np.array([5, 6], np.int16), (4, 2, 1)), [0, 2], 8, 2)
    block = model.model.layers[0].mlp
    with replay(model, tr0):
        with replay(model, tr1):
            assert block.replay_state.ids[:, 0].tolist() == [5] * 4
        assert block.replay_state.ids[:, 0].tolist() == [0] * 4
    assert block.replay_state is None


@pytest.mark.parametrize("backend", ["layer", "local"])
def test_replayed_routing_is_followed(backend):
    """Arbitrary replayed ids (with -1 padding) give HF's expert math on those ids (float64 reference)."""
    model = swap_moe_blocks(tiny_model("qwen2_moe"), backend=backend)
    block = model.model.layers[1].mlp
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 6, 32, generator=g)
    ids = torch.stack([torch.randperm(8, generator=g)[:2] for _ in range(6)])
    ids[2, 1] = -1
    ids[4] = -1
    tr = RoutingTrace(np.stack([ids.numpy()] * 3, axis=1), [0, 1, 2], 8, 2)
    with replay(model, tr), torch.no_grad():
        y = block(x)
    # independent reference: softmax probs of the live logits at the replayed ids (no renormalization for
    # this config), each expert's SwiGLU, plus the sigmoid-gated shared expert
    xf = x[0].double()
    block = block.double()  # the reference runs in float64 on the same weights
    probs = torch.softmax(xf @ block.gate.weight.T, dim=-1)
    ref = torch.zeros_like(xf)
    for t in range(6):
        for j in range(2):
            e = int(ids[t, j])
            if e < 0:
                continue
            w1 = block.experts.gate_up_proj[e]
            gate, up = (xf[t] @ w1.T).chunk(2)
            h = torch.nn.functional.silu(gate) * up
            ref[t] += probs[t, e] * (h @ block.experts.down_proj[e].T)
    sh = block.get_submodule("shared_expert")
    shared = sh.down_proj(torch.nn.functional.silu(sh.gate_proj(xf)) * sh.up_proj(xf))
    ref += torch.sigmoid(block.shared_expert_gate(xf)) * shared
    torch.testing.assert_close(y[0].double(), ref, rtol=1e-5, atol=1e-6)
    assert block.last_expert_counts.tolist() == np.bincount(ids[ids >= 0].numpy(), minlength=8).tolist()


def test_gpt_oss_runs_as_the_layer_with_replica_slots():
    """GPT-OSS swaps into the layer (four per-expert tensors) with a replica buffer sized for them; the
    single-process 'local' backend takes no replica slots."""
    from relibra_moe.integrations.hf_layer import HFReplayMoE, HFReplicaBuffer, hf_replica_buffer

    model = tiny_model("gpt_oss")
    with torch.no_grad():
        ref = model(PROMPTS, attention_mask=MASK).logits
    # one rank homes all E experts: the ceiling E - E/G of replica slots is 0 (plan.max_replica_slots)
    with pytest.raises(ValueError, match=r"replica_slots=2 is over the ceiling E - E/G = 0 \(E=8, G=1"):
        swap_moe_blocks(model, replica_slots=2)
    buf = hf_replica_buffer(moe_blocks(model)[0][2], 2)  # the buffer a 2-rank swap would allocate
    swap_moe_blocks(model)
    blocks = [b for _, _, b in moe_blocks(model)]
    assert all(isinstance(b, HFReplayMoE) for b in blocks)
    assert isinstance(buf, HFReplicaBuffer)
    assert buf.names == ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")
    assert buf.shapes == ((32, 32), (32,), (16, 32), (32,))  # H=32, 2I=32 interleaved, I=16
    assert buf.nbytes == 2 * 4 * (32 * 32 + 32 + 16 * 32 + 32)
    with torch.no_grad():
        out = model(PROMPTS, attention_mask=MASK).logits
    assert (out - ref).abs().max().item() <= 1e-5
    with pytest.raises(ValueError, match="replica_slots=1"):
        swap_moe_blocks(tiny_model("gpt_oss"), replica_slots=1, backend="local")
    with pytest.raises(ValueError, match="backend="):
        swap_moe_blocks(tiny_model("gpt_oss"), backend="fast")


def test_a_failed_swap_leaves_the_model_untouched_and_a_retry_works(monkeypatch):
    """A block that fails to swap part way (the second of the model's MoE blocks) leaves every block, router,
    expert class and parameter as it was; the forward is the plain model's, and a retry swaps cleanly."""
    import relibra_moe.integrations.hf as hf_mod

    model = tiny_model("qwen3_moe")
    with torch.no_grad():
        ref = model(PROMPTS, attention_mask=MASK).logits
    before = [(name, b, type(b), {n: type(m) for n, m in b.named_modules()}) for _, name, b in moe_blocks(model)]
    params = {n: p for n, p in model.named_parameters()}
    real = hf_mod.HFReplayMoE
    calls = [0]

    def fail_second(*args, **kwargs):
        calls[0] += 1
        if calls[0] == 2:
            raise RuntimeError("injected failure in the second block")
        return real(*args, **kwargs)

    monkeypatch.setattr(hf_mod, "HFReplayMoE", fail_second)
    with pytest.raises(RuntimeError, match="injected"):
        swap_moe_blocks(model)
    assert calls[0] == 2 and len(before) >= 2
    after = [(name, b, type(b), {n: type(m) for n, m in b.named_modules()}) for _, name, b in moe_blocks(model)]
    assert after == before  # block 0 was swapped, then put back with its router and experts' own classes
    assert {n: p for n, p in model.named_parameters()} == params
    with torch.no_grad():
        assert torch.equal(model(PROMPTS, attention_mask=MASK).logits, ref)
    monkeypatch.setattr(hf_mod, "HFReplayMoE", real)
    swap_moe_blocks(model)
    assert all(isinstance(b, real) for _, _, b in moe_blocks(model))
    with torch.no_grad():
        assert (model(PROMPTS, attention_mask=MASK).logits - ref).abs().max().item() <= 1e-5


def test_bad_swap_arguments_change_no_block():
    model = tiny_model("qwen3_moe")
    blocks = [b for _, _, b in moe_blocks(model)]
    for kwargs, msg in (({"gpus_per_node": 3}, "gpus_per_node=3 does not divide the EP group size 1"),
                        ({"gpus_per_node": 0}, "gpus_per_node=0 must be an int >= 1"),
                        ({"replica_slots": 100000}, "replica_slots=100000 is over the ceiling E - E/G = 0")):
        with pytest.raises(ValueError, match=msg):
            swap_moe_blocks(model, **kwargs)
        assert [b for _, _, b in moe_blocks(model)] == blocks
        assert all(type(b).__name__ == "Qwen3MoeSparseMoeBlock" for b in blocks)


def test_local_backend_is_the_hf_model():
    model = tiny_model("deepseek_v3")
    with torch.no_grad():
        ref = model(PROMPTS, attention_mask=MASK).logits
    swap_moe_blocks(model, backend="local")
    assert all(isinstance(b, HFLocalReplayMoE) for _, _, b in moe_blocks(model))
    with torch.no_grad():
        out = model(PROMPTS, attention_mask=MASK).logits
    assert (out - ref).abs().max().item() <= 1e-5


def test_swap_through_triton_kernels():
    """The swapped Qwen3-MoE through the Triton kernels (interpreter on CPU): HF logits and generate()."""
    from relibra_moe.triton_kernels.backend import INTERPRET

    if not INTERPRET:
        pytest.skip("TRITON_INTERPRET=1 was not set before triton was imported")
    model = tiny_model("qwen3_moe")
    with torch.no_grad():
        ref = model(PROMPTS, attention_mask=MASK).logits
        gen = model.generate(PROMPTS, attention_mask=MASK, max_new_tokens=2, do_sample=False)
    swap_moe_blocks(model)
    with torch.no_grad():
        out = model(PROMPTS, attention_mask=MASK).logits
        g = model.generate(PROMPTS, attention_mask=MASK, max_new_tokens=2, do_sample=False)
    assert (out - ref).abs().max().item() <= 1e-5
    assert torch.equal(g, gen)


def test_activation_checkpointing_under_replay():
    """HF activation checkpointing recomputes the swapped blocks in backward: run inside replay, the
    recomputation replays the same routing and the gradients are those without checkpointing."""

    def grads(checkpointing: bool):
        model = tiny_model("qwen2_moe")
        with RoutingRecorder(model) as rec, torch.no_grad():
            model(PROMPTS[1:])
        swap_moe_blocks(model).train()
        if checkpointing:
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        calls, block = [], model.model.layers[0].mlp
        forward = block.forward

        def counted(*args, **kwargs):  # (module hooks do not run in the recomputation)
            calls.append(1)
            return forward(*args, **kwargs)

        block.forward = counted
        with replay(model, rec.traces()):
            model(PROMPTS[1:], labels=PROMPTS[1:]).loss.backward()
        assert (len(calls) > 1) == checkpointing  # recomputed in backward
        return {n: p.grad for n, p in model.named_parameters()}

    plain, ckpt = grads(False), grads(True)
    for n in plain:
        torch.testing.assert_close(ckpt[n], plain[n], rtol=1e-6, atol=1e-8, msg=n)


def test_bad_swap_and_replay_arguments_are_named():
    from relibra_moe.plan import BatchPlan, Placement, ReplicaPlan, SamplePlacement

    model = tiny_model("qwen3_moe")
    for bad in (1.5, True, "2", -1):
        with pytest.raises(ValueError, match=f"replica_slots={bad!r} must be an int >= 0"):
            swap_moe_blocks(model, replica_slots=bad)
    swap_moe_blocks(model)
    tr0 = RoutingTrace(np.zeros((4, 2, 2), np.int16) + np.array([0, 1], np.int16), [0, 2], 8, 2)
    tr_k3 = RoutingTrace(np.zeros((4, 2, 3), np.int16) + np.array([0, 1, 2], np.int16), [0, 2], 8, 3)
    with pytest.raises(ReplayError, match=r"trace 1 has E=8, k=3"):
        with replay(model, [tr0, tr_k3]):
            pass
    with pytest.raises(ReplayError, match="plan must be a BatchPlan.*got ReplicaPlan"):
        with replay(model, [tr0], ReplicaPlan.empty(1, 2, 1, 0), micro_batch=0):
            pass
    plan = BatchPlan(Placement(np.zeros((2, 8))), SamplePlacement(np.zeros(1), np.zeros(1)),
                     ReplicaPlan.empty(1, 2, 1, 0), num_gpus=1, gpus_per_node=1)
    with pytest.raises(ReplayError, match=r"rank=3 is outside the plan's \[0, num_gpus=1\)"):
        with replay(model, [tr0], plan, micro_batch=0, rank=3):
            pass
    with replay(model, [tr0], plan, micro_batch=0) as rows:  # the valid plan selects the one sample
        assert rows == [0]



FULL_PROMPTS = torch.tensor([[0, 0, 5, 6, 7], [8, 9, 10, 11, 12]])
EOS = 84  # the second token greedy decoding of seed 3 gives sequence 0 (not in sequence 1's completion)


def _rollout():
    model = tiny_model("qwen3_moe", seed=3)
    mask = (FULL_PROMPTS != 0).long()
    with RoutingRecorder(model) as rec, torch.no_grad():
        out = model.generate(FULL_PROMPTS, attention_mask=mask, max_new_tokens=NEW, do_sample=False, eos_token_id=EOS)
    comp = out[:, FULL_PROMPTS.shape[1]:]
    is_eos = comp == EOS
    end = torch.where(is_eos.any(1), is_eos.int().argmax(1), torch.full((2,), comp.shape[1]))
    comp_mask = (torch.arange(comp.shape[1])[None] <= end[:, None]).long()  # TRL: up to and including EOS
    comp = comp.masked_fill(comp_mask == 0, 0)
    ids = torch.cat([FULL_PROMPTS, comp], 1)
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



REC_PROMPTS = torch.tensor([[0, 0, 5, 6, 7, 9], [3, 4, 5, 6, 7, 8]])
REC_MASK = (REC_PROMPTS != 0).long()


@pytest.mark.parametrize("fam", ["qwen3_moe", "deepseek_v3"])
def test_bf16_recorded_sets_equal_teacher_forced(fam):
    """In bf16 near-ties may reorder a row between decode and a full forward: compare per-token sets."""
    model = tiny_model(fam).to(torch.bfloat16)
    with RoutingRecorder(model) as rec, torch.no_grad():
        gen = model.generate(REC_PROMPTS, attention_mask=REC_MASK, max_new_tokens=4, do_sample=False)
    full = gen[:, :-1]
    mask = torch.cat([REC_MASK, torch.ones(2, full.shape[1] - 6, dtype=REC_MASK.dtype)], 1)
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
        model.generate(REC_PROMPTS, attention_mask=REC_MASK, max_new_tokens=3, do_sample=False)
        model.generate(REC_PROMPTS[1:], max_new_tokens=2, do_sample=False)  # no mask, batch 1
        # a right-padded plain forward: its own session, padding dropped
        model(torch.tensor([[7, 8, 9, 0]]), attention_mask=torch.tensor([[1, 1, 1, 0]]))
    rec.detach()
    with torch.no_grad():
        model(REC_PROMPTS)  # not recorded
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
            model.generate(REC_PROMPTS, attention_mask=REC_MASK, max_new_tokens=4, do_sample=False, num_beams=2)
        # greedy still fine
        gen = model.generate(REC_PROMPTS, attention_mask=REC_MASK, max_new_tokens=3, do_sample=False)
    assert [len(s) for s in rec.sequences()[-2:]] == [int(REC_MASK[b].sum()) + gen.shape[1] - 7 for b in range(2)]
    with torch.no_grad():  # not recording: beam search runs as usual
        out = model.generate(REC_PROMPTS, attention_mask=REC_MASK, max_new_tokens=4, do_sample=False, num_beams=2)
    assert out.shape == (2, 10)


def test_recorder_rejects_4d_mask():
    model = tiny_model("qwen3_moe")
    with RoutingRecorder(model), pytest.raises(ReplayError, match="2-D attention_mask"), torch.no_grad():
        model(REC_PROMPTS, attention_mask=torch.ones(2, 1, 6, 6, dtype=torch.bool))


@pytest.mark.parametrize("fam", ["qwen2_moe", "gpt_oss"])
def test_recorder_on_swapped_model_records_the_ids_used(fam):
    """On a swapped model (layer-backed, or GPT-OSS's local block) the recorder sees what the layer ran:
    live ids without replay, the replayed ids under replay."""
    model = tiny_model(fam)
    with RoutingRecorder(model) as ref, torch.no_grad():
        model(REC_PROMPTS, attention_mask=REC_MASK)
    swap_moe_blocks(model)
    with RoutingRecorder(model) as live, torch.no_grad():
        model(REC_PROMPTS, attention_mask=REC_MASK)
    for a, b in zip(ref.sequences(), live.sequences()):
        np.testing.assert_array_equal(a, b)
    g = np.random.default_rng(0)
    forced = [RoutingTrace(np.stack([[g.permutation(8)[:2] for _ in range(3)] for _ in range(n)]), [0, 1, 2], 8, 2)
              for n in (4, 6)]
    with replay(model, forced, attention_mask=REC_MASK), RoutingRecorder(model) as rec, torch.no_grad():
        model(REC_PROMPTS, attention_mask=REC_MASK)
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


# ----------------------------------------------------------------------------- no host sync in the swapped blocks


def _block_syncs(blocks) -> tuple[dict, list]:
    """Forward hooks that count, with one SyncCounter per call, what each block's forward waits for."""
    from relibra_moe.layers.testing import SyncCounter

    seen: dict[str, int] = {}
    hooks = []
    for b in blocks:
        def pre(mod, args):
            mod.__dict__["_sync_counter"] = SyncCounter().__enter__()

        def post(mod, args, out):
            c = mod.__dict__.pop("_sync_counter")
            c.__exit__(None, None, None)
            for k, v in c.counts.items():
                seen[k] = seen.get(k, 0) + v

        hooks += [b.register_forward_pre_hook(pre), b.register_forward_hook(post)]
    return seen, hooks


def _loss_syncs(model, ids) -> tuple[torch.Tensor, dict]:
    from relibra_moe.layers.testing import SyncCounter

    with SyncCounter() as syncs:
        logits = model(ids).logits
        logits.square().mean().backward()
    return logits.detach(), syncs.counts


def test_replayed_hf_model_makes_no_host_sync_in_its_moe_blocks():
    """The swapped tiny Qwen3-MoE inside replay: its MoE blocks' forwards wait for nothing, and the whole model's
    forward + backward waits exactly where the plain HF model's does (attention and loss: the same counts);
    logits and gradients are the plain model's."""
    with force_backend("torch"):
        plain = tiny_model("qwen3_moe", mlp_only_layers=[]).train()
        ids = torch.tensor([[3, 4, 5, 6, 7, 8, 9, 10], [11, 12, 13, 14, 15, 16, 17, 18]])
        ref, plain_syncs = _loss_syncs(plain, ids)
        with RoutingRecorder(plain) as rec, torch.no_grad():
            plain(ids)
        model = swap_moe_blocks(tiny_model("qwen3_moe", mlp_only_layers=[])).train()
        blocks = [b for _, _, b in moe_blocks(model)]
        seen, hooks = _block_syncs(blocks)
        with replay(model, rec.traces()):
            out, syncs = _loss_syncs(model, ids)
        for h in hooks:
            h.remove()
    assert seen == {} and len(blocks) == 3, seen
    assert syncs == plain_syncs, (syncs, plain_syncs)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    grads = dict(plain.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, grads[name].grad, rtol=1e-4, atol=1e-6, msg=name)


def _hf_no_sync_worker(rank: int, world: int) -> None:
    from relibra_moe.layers.relayout import relayout
    from relibra_moe.layers.testing import hot_replica_plan

    ids = torch.tensor([[3, 4, 5, 6, 7, 8, 9, 10], [11, 12, 13, 14, 15, 16, 17, 18]])
    with force_backend("torch"):
        plain = tiny_model("qwen3_moe", mlp_only_layers=[]).train()
        with RoutingRecorder(plain) as rec, torch.no_grad():
            ref_all = plain(ids).logits
        traces = rec.traces()
        counts = sum(t.expert_counts() for t in traces)
        plan = hot_replica_plan(3, 8, 2, 2, counts.argmax(1), seed=3)
        ref, plain_syncs = _loss_syncs(plain, ids[rank:rank + 1])
        model = swap_moe_blocks(tiny_model("qwen3_moe", mlp_only_layers=[]), replica_slots=1,
                                gpus_per_node=2).train()
        relayout(model, plan.placement)
        blocks = [b for _, _, b in moe_blocks(model)]
        seen, hooks = _block_syncs(blocks)
        with replay(model, traces, plan, micro_batch=0) as rows:
            assert rows == [rank], rows
            out, syncs = _loss_syncs(model, ids[rank:rank + 1])
        for h in hooks:
            h.remove()
    assert seen == {}, (rank, seen)
    assert syncs == plain_syncs, (rank, syncs, plain_syncs)
    torch.testing.assert_close(out, ref_all[rank:rank + 1], rtol=1e-5, atol=1e-6)
    assert blocks[0].replica_buffer.fills >= 1
    assert sum(int(b.last_slot_counts[b.num_local:].sum()) for b in blocks) > 0  # replica slots computed rows


@pytest.mark.timeout(300)
def test_replayed_hf_model_on_two_ranks_with_replicas_makes_no_host_sync():
    from relibra_moe.layers.testing import run_group

    run_group(_hf_no_sync_worker, 2)
