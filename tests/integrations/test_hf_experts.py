"""``experts_implementation="relibra"``: registered in transformers' ExpertsInterface, loads through
``from_pretrained`` and gives the logits and gradients of ``"eager"`` for every supported family."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

from relibra_moe.integrations.hf_tiny import FAMILIES, tiny_model  # noqa: E402


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Each family's tiny model saved once: ``{family: path}``."""
    out = {}
    for fam in FAMILIES:
        path = tmp_path_factory.mktemp(fam)
        tiny_model(fam, seed=3).save_pretrained(path)
        out[fam] = path
    return out


def _inputs():
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(3, 97, (2, 9), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # left padding on one row
    return ids, mask


def test_registered():
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    import relibra_moe.integrations.hf_experts as hx

    assert hx.NAME == "relibra"
    assert ALL_EXPERTS_FUNCTIONS["relibra"] is hx.relibra_experts_forward
    hx.register()  # idempotent
    assert ALL_EXPERTS_FUNCTIONS["relibra"] is hx.relibra_experts_forward


@pytest.mark.parametrize("family", FAMILIES)
def test_relibra_equals_eager(family, saved):
    """Logits (fp32, <= 1e-5) and every parameter gradient of a loss equal the eager experts'."""
    from transformers import AutoModelForCausalLM

    import relibra_moe.integrations.hf_experts  # noqa: F401

    ids, mask = _inputs()
    out = {}
    for impl in ("eager", "relibra"):
        model = AutoModelForCausalLM.from_pretrained(saved[family], experts_implementation=impl, dtype=torch.float32)
        assert model.config._experts_implementation == impl
        logits = model(ids, attention_mask=mask).logits
        (logits.float().pow(2) * mask[..., None]).mean().backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        out[impl] = (logits.detach(), grads)
    ref, got = out["eager"], out["relibra"]
    err = float((got[0] - ref[0]).abs().max())
    assert err <= 1e-5, err
    assert set(got[1]) == set(ref[1]) and any(".experts." in n for n in ref[1])
    for n, g in ref[1].items():
        assert torch.allclose(got[1][n], g, rtol=1e-4, atol=1e-6), (n, float((got[1][n] - g).abs().max()))


def test_switch_on_loaded_model_and_generate():
    """``set_experts_implementation("relibra")`` on a built model: greedy generate is eager's."""
    import relibra_moe.integrations.hf_experts  # noqa: F401

    model = tiny_model("qwen3_moe", seed=1)
    ids, mask = _inputs()
    kw = dict(attention_mask=mask, max_new_tokens=4, do_sample=False)
    model.set_experts_implementation("eager")
    ref = model.generate(ids, **kw)
    model.set_experts_implementation("relibra")
    assert model.config._experts_implementation == "relibra"
    assert torch.equal(model.generate(ids, **kw), ref)


def test_sentinel_ids_and_hand_computed_expert():
    """Against a float64 loop over the pairs: HF's expert-parallel sentinel ids (>= num_experts) are served
    by no expert; each other pair adds ``w * down[e] @ (silu(gate) * up)``."""
    from relibra_moe.integrations.hf_experts import relibra_experts_forward

    experts = tiny_model("olmoe", seed=2).model.layers[0].mlp.experts
    E = experts.num_experts
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 32, generator=g)
    ids = torch.tensor([[0, 3], [E, 1], [2, E + 1], [7, 6], [5, 0]])
    w = torch.rand(5, 2, generator=g)
    experts._is_expert_parallel = True
    y = relibra_experts_forward(experts, x, ids, w)
    ref = torch.zeros(5, 32, dtype=torch.float64)
    W1, W2 = experts.gate_up_proj.detach().double(), experts.down_proj.detach().double()
    for t in range(5):
        for j in range(2):
            e = int(ids[t, j])
            if e >= E:
                continue
            gate, up = (W1[e] @ x[t].double()).chunk(2)
            ref[t] += float(w[t, j]) * (W2[e] @ (torch.nn.functional.silu(gate) * up))
    assert torch.allclose(y.double(), ref, atol=1e-5)


def test_unsupported_experts_raise():
    from relibra_moe.integrations.hf_experts import relibra_experts_forward

    experts = tiny_model("olmoe", seed=2).model.layers[0].mlp.experts
    x, ids, w = torch.randn(2, 32), torch.zeros(2, 2, dtype=torch.long), torch.ones(2, 2)
    experts.has_post_expert_norm = True
    with pytest.raises(ValueError, match="has_post_expert_norm=True"):
        relibra_experts_forward(experts, x, ids, w)
    experts.has_post_expert_norm, experts.has_gate = False, False
    with pytest.raises(ValueError, match="has_gate=False"):
        relibra_experts_forward(experts, x, ids, w)
