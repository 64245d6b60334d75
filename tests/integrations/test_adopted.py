"""What the swapped blocks share (relibra_moe/integrations/adopted.py): the router tuple, the home-row slice and
the adoption of a block's submodules."""

from __future__ import annotations

import torch
from torch import nn

from relibra_moe.integrations.adopted import AdoptedBlockMoE, RouterTuple, keep_home_rows


def test_router_tuple_reads_as_a_router_output():
    a, b, c = torch.zeros(2, 4), torch.ones(2, 2), torch.tensor([[0, 1], [2, 3]])
    t = RouterTuple((a, b, c))
    assert t.logits is a and t.gates is b and t.ids is c and tuple(t) == (a, b, c)


def test_keep_home_rows_keeps_this_ranks_experts():
    ex = nn.Module()
    ex.w = nn.Parameter(torch.arange(8.0).repeat_interleave(3).view(8, 3))
    ex.b = nn.Parameter(torch.arange(8.0), requires_grad=False)
    keep_home_rows(ex, ("w", "b"), rank=2, num_experts=8, world=4)
    assert ex.w[:, 0].tolist() == [4.0, 5.0] and ex.b.tolist() == [4.0, 5.0] and not ex.b.requires_grad
    one = nn.Module()
    one.w = p = nn.Parameter(torch.zeros(8, 1))
    keep_home_rows(one, ("w",), rank=0, num_experts=8, world=1)
    assert one.w is p  # one rank: untouched


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(4, 8, bias=False)
        self.extra = nn.Linear(4, 4)
        self.register_buffer("kept", torch.ones(8))
        self.register_buffer("scratch", torch.zeros(8), persistent=False)


class _Layer(AdoptedBlockMoE):
    framework = "test"


def test_adopt_takes_the_blocks_children_and_buffers_under_their_names():
    block = _Block()
    layer = _Layer(4, 2, 8, 2, router=nn.Linear(4, 8), shared_expert=None)
    layer.adopt(block, buffers=True)
    assert list(dict(layer.named_children())) == ["gate", "extra"]
    assert layer.gate is block.gate and layer.kept is block.kept
    assert list(layer._buffers) == ["kept", "scratch", "expert_gpu"]
    assert set(layer.state_dict()) == {"gate.weight", "extra.weight", "extra.bias", "kept"}
    assert layer.shared_expert is None
    layer.layer_id = 3
    assert "test, layer_id=3, E=8, k=2, rank=0/1" in layer.extra_repr()


def test_deprecated_names_warn_and_give_the_new_object():
    import warnings

    import pytest

    from relibra_moe.integrations.adopted import deprecated_names

    getattr_ = deprecated_names("pkg.mod", {"Old": "New"}, {"New": int})
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        assert getattr_("Old") is int
    assert [str(x.message) for x in w] == ["pkg.mod.Old is deprecated: use New"]
    assert w[0].category is DeprecationWarning
    with pytest.raises(AttributeError, match="'pkg.mod' has no attribute 'Other'"):
        getattr_("Other")
