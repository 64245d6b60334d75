"""Model and cluster descriptions used by the cost model, the planners and the simulator.

``ModelSpec`` holds the MoE dimensions that drive compute and traffic; ``ClusterSpec`` the fabric.
Presets carry the paper's models (the ReLibra paper's evaluation setup) and two real models whose routing traces ship in
``../shared/traces``. Every figure was checked against the model's public ``config.json``.

Link classes on a rail-optimized fabric (GPU i of every node is on rail i):

===== ==== =======================================================================
code  name meaning
===== ==== =======================================================================
0     loc  same GPU: no traffic
1     nv   same node, other GPU: NVLink
2     sr   other node, same rail: GPUDirect RDMA
3     cr   other node, other rail: NVLink hop to the same-rail GPU, then RDMA
===== ==== =======================================================================
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cached_property
from typing import Any

import numpy as np

from .spec_sources import group_topology, model_fields_from_hf_config
from .validate import is_int

LOC, NV, SR, CR = 0, 1, 2, 3
LINK_NAMES = ("loc", "nv", "sr", "cr")


@dataclass(frozen=True)
class ModelSpec:
    """The MoE part of a model.

    Attributes:
        name: preset name.
        hidden: model hidden size h (elements).
        ffn: expert FFN width h' (elements); an expert is a SwiGLU MLP with 3 matrices h x h'.
        num_experts: routed experts per MoE layer E.
        top_k: experts per token k.
        num_layers: MoE layers L.
        dtype_bytes: bytes per activation / weight element (2 for bf16).
        num_heads, num_kv_heads, head_dim: attention shape (for the step-time simulator).
        shared_experts: always-on shared experts per layer (computed locally; no routing).
        shared_ffn: FFN width of one shared expert (defaults to ``ffn``).
    """

    name: str
    hidden: int
    ffn: int
    num_experts: int
    top_k: int
    num_layers: int
    dtype_bytes: int = 2
    num_heads: int = 32
    num_kv_heads: int = 8
    head_dim: int = 128
    shared_experts: int = 0
    shared_ffn: int | None = None

    def __post_init__(self) -> None:
        for f in ("hidden", "ffn", "num_experts", "top_k", "num_layers", "dtype_bytes", "num_heads", "num_kv_heads",
                  "head_dim"):
            if not is_int(v := getattr(self, f)) or v <= 0:
                raise ValueError(f"ModelSpec.{f} must be a positive int, got {v!r}")
        if not is_int(self.shared_experts) or self.shared_experts < 0:
            raise ValueError(f"ModelSpec.shared_experts must be an int >= 0, got {self.shared_experts!r}")
        if self.shared_ffn is not None and (not is_int(self.shared_ffn) or self.shared_ffn <= 0):
            raise ValueError(f"ModelSpec.shared_ffn must be a positive int or None, got {self.shared_ffn!r}")
        if self.top_k > self.num_experts:
            raise ValueError(f"ModelSpec.top_k={self.top_k} exceeds num_experts={self.num_experts}")

    @property
    def token_bytes(self) -> int:
        """Bytes one token's hidden state occupies on the wire (h x dtype bytes)."""
        return self.hidden * self.dtype_bytes

    @property
    def flops_per_token_expert(self) -> float:
        """Forward FLOPs of one (token, expert) pair: 3 GEMMs of h x h' at 2 FLOPs per MAC."""
        return 6.0 * self.hidden * self.ffn

    @property
    def expert_params(self) -> int:
        """Parameters of one routed expert (gate, up and down projections)."""
        return 3 * self.hidden * self.ffn

    @property
    def expert_bytes(self) -> int:
        """Bytes of one routed expert's weights in the model dtype."""
        return self.expert_params * self.dtype_bytes

    def with_(self, **changes: Any) -> ModelSpec:
        """A copy with the given fields changed (validated again)."""
        return replace(self, **changes)

    @classmethod
    def from_hf_config(cls, config: Any, **overrides: Any) -> ModelSpec:
        """The ModelSpec of a Hugging Face MoE model: ``config`` is a transformers config object, a
        ``config.json`` dict, or the path of a ``config.json`` (or of its directory). Every family of
        :data:`relibra_moe.spec_sources.HF_FAMILIES` (the table of keys there); ``overrides`` set fields
        (e.g. ``name``, ``dtype_bytes``). ValueError naming the file and the field for a bad config."""
        fields = model_fields_from_hf_config(config)
        fields.pop("moe_layer_ids")
        fields.update(overrides)
        return cls(**fields)


@dataclass(frozen=True)
class ClusterSpec:
    """An expert-parallel group on a rail-optimized cluster.

    Attributes:
        nodes: number of nodes.
        gpus_per_node: GPUs per node P; the EP group has G = nodes x P GPUs, GPU g is on node g // P
            and rail g % P.
        nvlink_bw: NVLink bytes/s per GPU per direction (effective).
        rdma_bw: RDMA bytes/s per GPU per direction (one NIC per GPU on its rail).
        flops: effective dense FLOP/s of one GPU for the expert GEMMs (bf16).
        attn_flops: effective FLOP/s for attention (defaults to ``flops``).
        name: preset name.
    """

    nodes: int
    gpus_per_node: int
    nvlink_bw: float = 450e9
    rdma_bw: float = 50e9
    flops: float = 700e12
    attn_flops: float | None = None
    name: str = "custom"

    def __post_init__(self) -> None:
        for f in ("nodes", "gpus_per_node"):
            if not is_int(v := getattr(self, f)) or v <= 0:
                raise ValueError(f"ClusterSpec.{f} must be a positive int, got {v!r}")
        for f in ("nvlink_bw", "rdma_bw", "flops", "attn_flops"):
            v = getattr(self, f)
            if f == "attn_flops" and v is None:
                continue
            if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, float, np.integer, np.floating)) \
                    or not np.isfinite(v) or not v > 0:
                raise ValueError(f"ClusterSpec.{f} must be a finite number > 0, got {v!r}")

    @property
    def num_gpus(self) -> int:
        """G = nodes x gpus_per_node."""
        return self.nodes * self.gpus_per_node

    @property
    def attention_flops(self) -> float:
        """FLOP/s for attention: ``attn_flops``, else ``flops``."""
        return self.attn_flops if self.attn_flops is not None else self.flops

    def node_of(self, gpu: int | np.ndarray) -> int | np.ndarray:
        """Node of GPU id(s) ``gpu`` (``gpu // P``)."""
        return gpu // self.gpus_per_node

    def rail_of(self, gpu: int | np.ndarray) -> int | np.ndarray:
        """Rail of GPU id(s) ``gpu`` (``gpu % P``: its index inside the node)."""
        return gpu % self.gpus_per_node

    @cached_property
    def link_classes(self) -> np.ndarray:
        """int8 ``[G, G]``: link class (LOC, NV, SR, CR) from source GPU j (row) to target g (column)."""
        g = np.arange(self.num_gpus)
        node = g // self.gpus_per_node
        rail = g % self.gpus_per_node
        same_node = node[:, None] == node[None, :]
        same_rail = rail[:, None] == rail[None, :]
        out = np.where(same_node, NV, np.where(same_rail, SR, CR)).astype(np.int8)
        np.fill_diagonal(out, LOC)
        out.setflags(write=False)
        return out

    def link_class(self, src: int, dst: int) -> str:
        """Name of the link class between two GPUs: 'loc', 'nv', 'sr' or 'cr'."""
        return LINK_NAMES[int(self.link_classes[src, dst])]

    def with_(self, **changes: Any) -> ClusterSpec:
        """A copy with the given fields changed (validated again)."""
        return replace(self, **changes)

    @classmethod
    def from_process_group(cls, group: Any = None, *, fabric: str = "hopper-rail",
                           gpus_per_node: int | None = None) -> ClusterSpec:
        """The ClusterSpec of an EP group: a ``ProcessGroup``, a ``DeviceMesh`` (1-D, or its ``"ep"``
        dimension) or ``None`` (the world), sized ``nodes x gpus_per_node`` from the ranks' hosts (or
        ``gpus_per_node`` given), on the links of ``fabric`` (:func:`cluster_preset`). A collective without
        ``gpus_per_node``: every rank of the group calls it (see :func:`relibra_moe.spec_sources.group_topology`)."""
        nodes, per_node = group_topology(group, gpus_per_node)
        return cluster_preset(fabric, nodes=nodes, gpus_per_node=per_node)


# Checked against the public config.json of each model (hidden_size, moe_intermediate_size /
# intermediate_size, num_experts / n_routed_experts, num_experts_per_tok, MoE layer count).
MODEL_PRESETS: dict[str, ModelSpec] = {
    # Qwen/Qwen3-30B-A3B: 48 layers, all MoE; 32 q heads, 4 kv heads, head_dim 128.
    "qwen3-30b-a3b": ModelSpec("qwen3-30b-a3b", 2048, 768, 128, 8, 48,
                               num_heads=32, num_kv_heads=4, head_dim=128),
    # zai-org/GLM-4.5-Air: 46 layers, first_k_dense_replace=1 -> 45 MoE layers; 96 q heads, 8 kv,
    # head_dim 128; one shared expert of width 1408.
    "glm4.5-106b-a12b": ModelSpec("glm4.5-106b-a12b", 4096, 1408, 128, 8, 45,
                                  num_heads=96, num_kv_heads=8, head_dim=128, shared_experts=1),
    # Qwen/Qwen3-235B-A22B: 94 layers, all MoE; 64 q heads, 4 kv heads, head_dim 128.
    "qwen3-235b-a22b": ModelSpec("qwen3-235b-a22b", 4096, 1536, 128, 8, 94,
                                 num_heads=64, num_kv_heads=4, head_dim=128),
    # openai/gpt-oss-20b: 24 layers, 32 experts top-4, hidden 2880, intermediate 2880;
    # 64 q heads, 8 kv heads, head_dim 64.
    "gpt-oss-20b": ModelSpec("gpt-oss-20b", 2880, 2880, 32, 4, 24,
                             num_heads=64, num_kv_heads=8, head_dim=64),
    # allenai/OLMoE-1B-7B-0924: 16 layers, 64 experts top-8, hidden 2048, intermediate 1024;
    # 16 heads (MHA), head_dim 128.
    "olmoe-1b-7b": ModelSpec("olmoe-1b-7b", 2048, 1024, 64, 8, 16,
                             num_heads=16, num_kv_heads=16, head_dim=128),
}

# hopper-rail: 8 GPUs per node, NVLink 900 GB/s bidirectional (450 GB/s per direction effective),
# 8 x 400 Gb/s rail-optimized RDMA per node (50 GB/s per GPU per direction), 700 TFLOP/s bf16.
_HOPPER = dict(nvlink_bw=450e9, rdma_bw=50e9, flops=700e12)


def cluster_preset(name: str = "hopper-rail", nodes: int = 1, gpus_per_node: int = 8) -> ClusterSpec:
    """A ClusterSpec from a named fabric; ``nodes`` x ``gpus_per_node`` sizes the EP group.

    Known fabrics: ``hopper-rail`` (the paper's cluster, the ReLibra paper's evaluation setup).
    """
    if name != "hopper-rail":
        raise ValueError(f"unknown cluster preset {name!r}; known: ['hopper-rail']")
    return ClusterSpec(nodes=nodes, gpus_per_node=gpus_per_node, name=name, **_HOPPER)


def model_preset(name: str) -> ModelSpec:
    """The ModelSpec of a named model (see ``MODEL_PRESETS``)."""
    try:
        return MODEL_PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown model preset {name!r}; known: {sorted(MODEL_PRESETS)}") from None


def replica_buffer_bytes(model: ModelSpec, replica_slots: int) -> int:
    """Bytes per GPU of the layer-shared replica buffer: r slots of one expert, whatever L is."""
    return replica_slots * model.expert_bytes
