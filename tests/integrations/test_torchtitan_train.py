"""relibra_moe.integrations.torchtitan_train: a torchtitan train spec from ``replay_model_spec`` run in torchtitan's
trainer order on 2 gloo ranks (meta build, parallelize_fn, to_empty, init_weights, optimizer,
post_optimizer_build_fn)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

pytest.importorskip("torchtitan", reason="torchtitan is not installed (pip install torchtitan --no-deps, spmd_types, "
                                         "tyro)")

from relibra_moe.integrations.torchtitan import TorchtitanReplayMoE  # noqa: E402
from relibra_moe.layers.testing import run_group  # noqa: E402

from .test_torchtitan import (  # noqa: E402
    _CausalSDPA,
    _run,
    _titan_adamw,
    _titan_dims,
    _titan_parallelize,
    _tokens,
    qwen3_config,
)


def _train_spec_worker(rank: int, world: int) -> None:
    """The swap happens inside parallelize_fn, on the meta model, with torchtitan's ep mesh as the EP group; after
    to_empty + init_weights the experts are this rank's plain rows, the counters zero, the placement static, the
    replica slots real; post_optimizer_build_fn registers torchtitan's bias-update hook, the expert-gradient reduction
    and the DCP hooks; a forward runs."""
    from torchtitan.components.optimizer import register_moe_load_balancing_hook
    from torchtitan.models.qwen3.parallelize import parallelize_qwen3
    from torchtitan.protocols.model_spec import ModelSpec

    from relibra_moe.integrations.torchtitan_train import replay_model_spec

    dims = _titan_dims(world, ep=world)
    spec = replay_model_spec(ModelSpec(name="qwen3", flavor="tiny", model=qwen3_config(enable_ep=True),
                                       parallelize_fn=parallelize_qwen3, pipelining_fn=None, state_dict_adapter=None,
                                       post_optimizer_build_fn=register_moe_load_balancing_hook), replica_slots=1)
    with torch.device("meta"):
        model = spec.model.build()
    _titan_parallelize(model, dims, spec.parallelize_fn)
    model.to_empty(device="cpu")
    model.init_weights()
    blk = model.layers["1"].moe
    assert isinstance(blk, TorchtitanReplayMoE) and (blk.rank, blk.world_size) == (rank, world)
    assert type(blk.experts.w1_EFD) is nn.Parameter and blk.experts.w1_EFD.shape[0] == 8 // world
    assert torch.isfinite(blk.experts.w1_EFD).all() and float(blk.experts.w1_EFD.std()) > 0
    assert blk.expert_gpu.tolist() == [0] * 4 + [1] * 4 and float(blk.tokens_per_expert_E.abs().sum()) == 0
    assert blk.replica_buffer.device == torch.device("cpu")
    opt = _titan_adamw(model)
    spec.post_optimizer_build_fn(opt, [model], dims)
    assert opt.optimizers[0]._sharded_state_hooks  # the DCP hooks
    assert len(opt._optimizer_step_pre_hooks) == 2  # torchtitan's bias update, relibra's expert-gradient reduction
    assert blk._expert_grads_reduced
    for layer in model.layers.values():
        layer.attention.inner_attention = _CausalSDPA()
    assert torch.isfinite(_run(model, _tokens()[rank:rank + 1])).all()


@pytest.mark.timeout(300)
def test_replay_model_spec_in_torchtitans_order_two_ranks():
    run_group(_train_spec_worker, 2, backend="gloo", timeout_s=120)
