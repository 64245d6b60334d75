"""ModelSpec.from_hf_config (every supported family, from transformers' own config classes filled with each
model's public config.json values, and from a config.json file) and ClusterSpec.from_process_group on gloo."""

from __future__ import annotations

import json
import socket

import pytest

from relibra_moe.layers.testing import run_group
from relibra_moe.spec_sources import HF_FAMILIES, model_fields_from_hf_config
from relibra_moe.specs import ClusterSpec, ModelSpec, model_preset

transformers = pytest.importorskip("transformers")

# Public config.json values of each model (the fields ModelSpec reads; other fields keep transformers' defaults).
PUBLIC = {
    "qwen3-30b-a3b": ("Qwen3MoeConfig", dict(
        hidden_size=2048, moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8, num_hidden_layers=48,
        num_attention_heads=32, num_key_value_heads=4, head_dim=128, decoder_sparse_step=1, mlp_only_layers=[])),
    "qwen3-235b-a22b": ("Qwen3MoeConfig", dict(
        hidden_size=4096, moe_intermediate_size=1536, num_experts=128, num_experts_per_tok=8, num_hidden_layers=94,
        num_attention_heads=64, num_key_value_heads=4, head_dim=128)),
    "glm4.5-106b-a12b": ("Glm4MoeConfig", dict(
        hidden_size=4096, moe_intermediate_size=1408, n_routed_experts=128, num_experts_per_tok=8,
        num_hidden_layers=46, first_k_dense_replace=1, n_shared_experts=1, num_attention_heads=96,
        num_key_value_heads=8, head_dim=128)),
    "gpt-oss-20b": ("GptOssConfig", dict(
        hidden_size=2880, intermediate_size=2880, num_local_experts=32, num_experts_per_tok=4, num_hidden_layers=24,
        num_attention_heads=64, num_key_value_heads=8, head_dim=64)),
    "olmoe-1b-7b": ("OlmoeConfig", dict(
        hidden_size=2048, intermediate_size=1024, num_experts=64, num_experts_per_tok=8, num_hidden_layers=16,
        num_attention_heads=16, num_key_value_heads=16)),
}

# Families without a preset: the public config of one model each and the spec its values give by hand.
NO_PRESET = {
    # mistralai/Mixtral-8x7B-v0.1
    "mixtral": ("MixtralConfig", dict(hidden_size=4096, intermediate_size=14336, num_local_experts=8,
                                      num_experts_per_tok=2, num_hidden_layers=32, num_attention_heads=32,
                                      num_key_value_heads=8),
                dict(hidden=4096, ffn=14336, num_experts=8, top_k=2, num_layers=32, num_heads=32, num_kv_heads=8,
                     head_dim=128)),
    # Qwen/Qwen1.5-MoE-A2.7B: 24 layers, 60 experts top-4, one gated shared expert of width 5632
    "qwen2_moe": ("Qwen2MoeConfig", dict(hidden_size=2048, moe_intermediate_size=1408, num_experts=60,
                                         num_experts_per_tok=4, num_hidden_layers=24, num_attention_heads=16,
                                         num_key_value_heads=16, shared_expert_intermediate_size=5632),
                  dict(hidden=2048, ffn=1408, num_experts=60, top_k=4, num_layers=24, num_heads=16, num_kv_heads=16,
                       head_dim=128, shared_experts=1, shared_ffn=5632)),
    # deepseek-ai/DeepSeek-V3: 61 layers, the first 3 dense; MLA q/k head 128 + 64
    "deepseek_v3": ("DeepseekV3Config", dict(hidden_size=7168, moe_intermediate_size=2048, n_routed_experts=256,
                                             num_experts_per_tok=8, num_hidden_layers=61, first_k_dense_replace=3,
                                             n_shared_experts=1, num_attention_heads=128, num_key_value_heads=128,
                                             qk_nope_head_dim=128, qk_rope_head_dim=64),
                    dict(hidden=7168, ffn=2048, num_experts=256, top_k=8, num_layers=58, num_heads=128,
                         num_kv_heads=128, head_dim=192, shared_experts=1)),
    # Qwen/Qwen3-Next-80B-A3B: 48 layers, 512 experts top-10, a gated shared expert of width 512
    "qwen3_next": ("Qwen3NextConfig", dict(hidden_size=2048, moe_intermediate_size=512, num_experts=512,
                                           num_experts_per_tok=10, num_hidden_layers=48, num_attention_heads=16,
                                           num_key_value_heads=2, head_dim=256, shared_expert_intermediate_size=512),
                   dict(hidden=2048, ffn=512, num_experts=512, top_k=10, num_layers=48, num_heads=16, num_kv_heads=2,
                        head_dim=256, shared_experts=1)),
}


@pytest.mark.parametrize("preset", sorted(PUBLIC))
def test_presets_from_their_hf_config(preset, tmp_path):
    cls, values = PUBLIC[preset]
    config = getattr(transformers, cls)(**values, dtype="bfloat16")
    assert ModelSpec.from_hf_config(config, name=preset) == model_preset(preset)
    # the same from config.json, as save_pretrained writes it (the directory or the file)
    config.save_pretrained(tmp_path)
    assert ModelSpec.from_hf_config(tmp_path, name=preset) == model_preset(preset)
    assert ModelSpec.from_hf_config(str(tmp_path / "config.json"), name=preset) == model_preset(preset)


@pytest.mark.parametrize("family", sorted(NO_PRESET))
def test_families_without_preset(family, tmp_path):
    cls, values, expected = NO_PRESET[family]
    config = getattr(transformers, cls)(**values)
    assert ModelSpec.from_hf_config(config) == ModelSpec(name=family, **expected)
    config.save_pretrained(tmp_path)
    assert ModelSpec.from_hf_config(tmp_path / "config.json") == ModelSpec(name=family, **expected)


def test_every_family_of_the_table_is_tested():
    tested = {getattr(transformers, cls)().model_type for cls, *_ in list(PUBLIC.values()) + list(NO_PRESET.values())}
    assert tested == set(HF_FAMILIES)


def test_moe_layer_rules():
    # Qwen: mlp_only_layers and decoder_sparse_step as modeling_qwen3_moe decides them
    c = transformers.Qwen3MoeConfig(num_hidden_layers=8, decoder_sparse_step=2, mlp_only_layers=[3])
    assert model_fields_from_hf_config(c)["moe_layer_ids"] == [1, 5, 7]
    d = transformers.DeepseekV3Config(num_hidden_layers=5, first_k_dense_replace=2)
    assert model_fields_from_hf_config(d)["moe_layer_ids"] == [2, 3, 4]
    # fp32 checkpoints: 4 bytes; name from _name_or_path
    spec = ModelSpec.from_hf_config({**transformers.OlmoeConfig().to_dict(), "dtype": "float32",
                                     "_name_or_path": "allenai/OLMoE-1B-7B-0924"})
    assert (spec.dtype_bytes, spec.name) == (4, "OLMoE-1B-7B-0924")


def test_bad_configs_name_the_file_and_field(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "llama", "hidden_size": 8}))
    with pytest.raises(ValueError, match=r"config.json'.*model_type='llama' is not a supported MoE family"):
        ModelSpec.from_hf_config(path)
    d = transformers.MixtralConfig().to_dict()
    del d["num_local_experts"]
    path.write_text(json.dumps(d))
    with pytest.raises(ValueError, match=r"config.json'.*field 'num_local_experts' is missing"):
        ModelSpec.from_hf_config(path)
    d = transformers.MixtralConfig().to_dict()
    d["hidden_size"] = 4096.5
    path.write_text(json.dumps(d))
    with pytest.raises(ValueError, match=r"field 'hidden_size' = 4096.5 is not an integer"):
        ModelSpec.from_hf_config(path)
    with pytest.raises(ValueError, match="no such file"):
        ModelSpec.from_hf_config(tmp_path / "missing.json")
    path.write_text("{not json")
    with pytest.raises(ValueError, match="not a readable JSON file"):
        ModelSpec.from_hf_config(path)


# ------------------------------------------------------------------------------------------ clusters
def _cluster_worker(rank: int, world: int) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    c = ClusterSpec.from_process_group()
    assert (c.nodes, c.gpus_per_node, c.name) == (1, world, "hopper-rail")
    c = ClusterSpec.from_process_group(gpus_per_node=2)
    assert (c.nodes, c.gpus_per_node) == (world // 2, 2)
    mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "ep"))
    c = ClusterSpec.from_process_group(mesh)
    assert (c.nodes, c.gpus_per_node) == (1, 2)  # the "ep" dimension's group
    with pytest.raises(ValueError, match=r"gpus_per_node=3 does not divide the group size 4"):
        ClusterSpec.from_process_group(gpus_per_node=3)
    # ranks passing different arguments: every rank raises (one all_gather of the arguments), none waits
    with pytest.raises(ValueError, match=r"group rank 0 passed gpus_per_node=None, fabric='hopper-rail'; group "
                                         r"rank 1 passed gpus_per_node=2.*must pass the same arguments"):
        ClusterSpec.from_process_group(gpus_per_node=None if rank == 0 else 2)
    with pytest.raises(ValueError, match=r"group rank 3 passed gpus_per_node=None, fabric='h100'"):
        ClusterSpec.from_process_group(fabric="h100" if rank == 3 else "hopper-rail")
    real = socket.gethostname
    try:
        socket.gethostname = lambda: f"node{rank // 2}"  # ranks 0,1 on node0, 2,3 on node1
        c = ClusterSpec.from_process_group()
        assert (c.nodes, c.gpus_per_node) == (2, 2)
        socket.gethostname = lambda: f"node{rank % 2}"  # interleaved: not a rail layout; every rank raises
        with pytest.raises(ValueError, match="not equal contiguous blocks per host"):
            ClusterSpec.from_process_group()
    finally:
        socket.gethostname = real
    dist.barrier()


def test_cluster_from_process_group_gloo():
    run_group(_cluster_worker, 4, backend="gloo", timeout_s=30)


def test_cluster_without_process_group():
    with pytest.raises(ValueError, match="torch.distributed is not initialized"):
        ClusterSpec.from_process_group()
