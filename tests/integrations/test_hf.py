"""Hugging Face integration on tiny random models of every supported family (no downloads).

Per family: the swapped model is the HF model (logits <= 1e-5, identical greedy ``generate()``, identical
``state_dict``); the recorder's ids from ``generate()`` (prefill + decode, left padding, batch 3) equal the
ids of one teacher-forced forward over the generated sequences (0 mismatches, fp32); replaying them gives
the live logits and gradients; the aux loss survives the swap; ``save_pretrained`` round-trips.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from relibra_moe.errors import ReplayError  # noqa: E402
from relibra_moe.integrations.hf import (  # noqa: E402
    ReplayMoEBlock,
    RoutingRecorder,
    full_state_dict,
    moe_blocks,
    moe_layer_ids,
    replay,
    swap_moe_blocks,
)
from relibra_moe.integrations.hf_layer import HFReplayBalancedMoE  # noqa: E402
from relibra_moe.integrations.hf_tiny import FAMILIES, tiny_model  # noqa: E402
from relibra_moe.layers.moe import ReplayBalancedMoE  # noqa: E402
from relibra_moe.trace import RoutingTrace, TraceBatch  # noqa: E402

PROMPTS = torch.tensor([[0, 0, 5, 6, 7, 9], [3, 4, 5, 6, 7, 8], [0, 0, 0, 11, 12, 13]])
MASK = (PROMPTS != 0).long()
NEW = 5
# decoder indices of the MoE layers of the tiny configs (qwen3_moe: layer 1 is dense via mlp_only_layers;
# deepseek_v3: first_k_dense_replace = 1)
EXPECTED_LAYERS = {"qwen3_moe": [0, 2], "deepseek_v3": [1, 2]}
HAS_AUX = [f for f in FAMILIES if f != "deepseek_v3"]  # DeepSeek-V3 in transformers has no aux loss
SWAPPED = (ReplayMoEBlock, HFReplayBalancedMoE)


@pytest.fixture(autouse=True)
def _torch_kernels(request):
    """The layer's ops through their torch references (the Triton interpreter is slow; the kernels have
    their own tests); ``test_swap_through_triton_kernels`` runs the interpreter once end to end."""
    from relibra_moe.triton_kernels.backend import force_backend

    if "triton" in request.node.name:
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
    from relibra_moe.integrations.hf_layer import HFReplayBalancedMoE, HFReplicaBuffer

    model = tiny_model("gpt_oss")
    with torch.no_grad():
        ref = model(PROMPTS, attention_mask=MASK).logits
    swap_moe_blocks(model, replica_slots=2)
    blocks = [b for _, _, b in moe_blocks(model)]
    assert all(isinstance(b, HFReplayBalancedMoE) for b in blocks)
    buf = blocks[0].replica_buffer
    assert isinstance(buf, HFReplicaBuffer) and all(b.replica_buffer is buf for b in blocks)
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


def test_local_backend_is_the_hf_model():
    model = tiny_model("deepseek_v3")
    with torch.no_grad():
        ref = model(PROMPTS, attention_mask=MASK).logits
    swap_moe_blocks(model, backend="local")
    assert all(isinstance(b, ReplayMoEBlock) for _, _, b in moe_blocks(model))
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
