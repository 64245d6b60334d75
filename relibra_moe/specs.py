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

import json
import os
from dataclasses import dataclass, replace
from functools import cached_property
from typing import Any

import numpy as np

from .atomic import write_json
from .errors import PlanError
from .spec_sources import group_topology, model_fields_from_hf_config
from .validate import check_count, check_int, check_range, is_int, is_number

LOC, NV, SR, CR = 0, 1, 2, 3
LINK_NAMES = ("loc", "nv", "sr", "cr")

DISPATCHERS = ("alltoall", "deepep")
"""How the token dispatch moves tokens: Megatron's all-to-all (one copy per (token, expert) pair) or DeepEP's
normal kernels (one RDMA copy per (token, remote node), NVLink forwarding, one copy per (token, GPU))."""
GEMM_RATE_BAND = (300e12, 600e12)
"""Expert-GEMM FLOP/s (forward + backward, bf16, H100-class) plausible at shapes nobody has measured (GLM-4.5's
4096 x 1408, Qwen3-235B's 4096 x 1536): the low and high ends the paper table and ``relibra compare --rate-band``
report beside the presets' 413 TFLOP/s (docs/method.md, "Rates": sources and reasoning)."""
OVERLAPS = ("none", "megatron", "dualpipe")
"""How the trainer hides the MoE all-to-all behind compute (``ClusterSpec.overlap``; ``timing.layer_step_seconds``
has the rules, docs/method.md "Overlap" their sources)."""


#: Largest value of each ModelSpec size field (above any released MoE model by orders of magnitude; a config
#: with hidden_size 10^12 is a damaged or hostile file, whose sizes would overflow the cost model's byte counts).
MODEL_LIMITS: dict[str, int] = {"hidden": 1 << 20, "ffn": 1 << 20, "head_dim": 1 << 16, "num_heads": 1 << 14,
                                "num_kv_heads": 1 << 14, "num_experts": 1 << 16, "num_layers": 1 << 14,
                                "dtype_bytes": 8, "shared_experts": 1 << 10, "shared_ffn": 1 << 20}


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
            check_count(f"ModelSpec.{f}", getattr(self, f), error=ValueError)
        check_count("ModelSpec.shared_experts", self.shared_experts, 0, error=ValueError)
        if self.shared_ffn is not None and (not is_int(self.shared_ffn) or self.shared_ffn <= 0):
            raise ValueError(f"ModelSpec.shared_ffn must be a positive int or None, got {self.shared_ffn!r}")
        for f, hi in MODEL_LIMITS.items():
            if getattr(self, f) is not None:
                check_int(f"ModelSpec.{f}", getattr(self, f), 0, hi, error=ValueError)
        if self.top_k > self.num_experts:
            raise ValueError(f"ModelSpec.top_k={self.top_k} exceeds num_experts={self.num_experts}")
        if self.num_kv_heads > self.num_heads or self.num_heads % self.num_kv_heads:
            raise ValueError(f"ModelSpec.num_kv_heads={self.num_kv_heads} must divide num_heads={self.num_heads} "
                             "(grouped-query attention: each KV head serves num_heads / num_kv_heads query heads)")

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
class Rates:
    """The effective rates of one (model, cluster), as the cost model and ``timing`` charge them
    (``ClusterSpec.rates``). Units: FLOP/s, bytes/s, copies, seconds.

    Attributes:
        expert_flops: expert-GEMM FLOP/s (``F``).
        attention_flops: attention FLOP/s (``F_attn``).
        nvlink_bw, rdma_bw: bytes/s per GPU per direction the dispatcher achieves (``B_nv``, ``B_rdma``).
        nvlink_copies, rdma_copies: token copies the dispatcher puts on NVLink / RDMA per (token, expert) pair
            that crosses that link (1 for ``alltoall``; below 1 for ``deepep``, see ``dispatch_copies_per_pair``).
        sec_per_pair: compute seconds of one (token, expert) pair, ``6 h h' / F``.
        nvlink_sec_per_pair, rdma_sec_per_pair: dispatch seconds of one pair on the link,
            ``h x dtype_bytes x copies / B``.
        nvlink_latency, rdma_latency: seconds one message pays on the link before its bytes flow (``alpha`` of
            the alpha-beta model ``alpha + bytes / B``; ``timing.message_latency`` charges them).
    """

    expert_flops: float
    attention_flops: float
    nvlink_bw: float
    rdma_bw: float
    nvlink_copies: float
    rdma_copies: float
    sec_per_pair: float
    nvlink_sec_per_pair: float
    rdma_sec_per_pair: float
    nvlink_latency: float = 0.0
    rdma_latency: float = 0.0


def _hit_probability(num_experts: int, top_k: int, group: float) -> float:
    """Probability that a token's ``top_k`` distinct experts (drawn uniformly from ``num_experts``) include at
    least one of ``group`` given experts: ``1 - prod_{i<k} (E - m - i) / (E - i)``."""
    miss = 1.0
    for i in range(top_k):
        miss *= max(num_experts - group - i, 0.0) / (num_experts - i)
    return 1.0 - miss


def dispatch_copies_per_pair(model: ModelSpec, cluster: ClusterSpec) -> tuple[float, float]:
    """``(nvlink_copies, rdma_copies)``: token copies per (token, expert) pair on NVLink / RDMA.

    ``alltoall`` (Megatron): ``(1, 1)``, every pair is a copy. ``deepep`` (DeepEP normal kernels): a token goes once
    to every remote node that holds one of its experts (RDMA, to the GPU of its own rail there) and once to every
    GPU that holds one (NVLink, from the source inside its node, from the rail GPU in a remote node). With the
    token's k experts uniform over E and spread evenly (E / N per node, E / G per GPU), a pair lands on a given
    node with probability 1 / N and the token reaches that node with probability ``q(E / N)``
    (``_hit_probability``), so ``rdma_copies = q(E / N) N / k`` and ``nvlink_copies = q(E / G) G / k``: the
    expected copies of the token-level count (``dispatch_traffic``) per pair. Exact in expectation over uniform
    routing (tests/test_specs.py enumerates it); skewed routing and co-located hot experts dedup more.
    """
    if cluster.dispatcher == "alltoall":
        return 1.0, 1.0
    E, k = model.num_experts, model.top_k
    G, N = cluster.num_gpus, cluster.nodes
    nv = _hit_probability(E, k, E / G) * G / k
    rdma = _hit_probability(E, k, E / N) * N / k if N > 1 else 1.0
    return float(nv), float(rdma)


def dispatch_traffic(src_gpu: np.ndarray, target_gpus: np.ndarray, cluster: ClusterSpec) -> dict[str, np.ndarray]:
    """Token copies each GPU sends and receives on NVLink and RDMA for one dispatch, counted token by token.

    Args:
        src_gpu: int ``[T]`` GPU whose attention produced each token.
        target_gpus: int ``[T, k]`` GPU serving each of the token's k (token, expert) pairs.
        cluster: the fabric and its ``dispatcher``.

    Returns:
        ``{"nvlink_tx", "nvlink_rx", "rdma_tx", "rdma_rx"}``, float64 ``[G]`` copies (multiply by the token bytes).
        ``alltoall``: every pair with target g is one copy, counted on the links of class (j, g) at j's tx and
        g's rx (nv: NVLink; sr: RDMA; cr: both), as the cost model counts it. ``deepep``: one NVLink copy from j
        to every distinct other target GPU in j's node; one RDMA copy from j to the rail-``rail(j)`` GPU r of every
        other node holding a target, then one NVLink copy from r to every distinct target GPU there other than r.
    """
    src = np.asarray(src_gpu, dtype=np.int64).reshape(-1)
    tg = np.asarray(target_gpus, dtype=np.int64)
    if tg.ndim != 2 or tg.shape[0] != src.shape[0]:
        raise PlanError(f"target_gpus has shape {tg.shape}, expected [{src.shape[0]}, k] for {src.shape[0]} tokens")
    G, P = cluster.num_gpus, cluster.gpus_per_node
    for name, a in (("src_gpu", src), ("target_gpus", tg)):
        if a.size and (a.min() < 0 or a.max() >= G):
            raise PlanError(f"{name} holds GPU {int(a[(a < 0) | (a >= G)].flat[0])}, outside [0, {G})")
    out = {k: np.zeros(G) for k in ("nvlink_tx", "nvlink_rx", "rdma_tx", "rdma_rx")}
    cls = cluster.link_classes
    for j, row in zip(src.tolist(), tg.tolist()):
        if cluster.dispatcher == "alltoall":
            for g in row:
                c = cls[j, g]
                if c in (NV, CR):
                    out["nvlink_tx"][j] += 1
                    out["nvlink_rx"][g] += 1
                if c in (SR, CR):
                    out["rdma_tx"][j] += 1
                    out["rdma_rx"][g] += 1
            continue
        for g in sorted(set(row)):
            if g == j:
                continue
            if g // P == j // P:
                out["nvlink_tx"][j] += 1
                out["nvlink_rx"][g] += 1
            else:
                r = (g // P) * P + j % P
                if g != r:
                    out["nvlink_tx"][r] += 1
                    out["nvlink_rx"][g] += 1
        for n in sorted({g // P for g in row} - {j // P}):
            out["rdma_tx"][j] += 1
            out["rdma_rx"][n * P + j % P] += 1
    return out


#: Accepted rates (FLOP/s, bytes/s) and latencies (seconds) of a ClusterSpec, wherever they come from (presets,
#: profiles, flags): wide enough for hand-computed test clusters (a FLOP/s of 192), narrow enough that no time
#: the cost model derives from them overflows or vanishes (5e-324 FLOP/s would make every GEMM take infinity).
RATE_RANGE = (1e-6, 1e20)
LATENCY_RANGE = (0.0, 1e6)


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
        dispatcher: how the token dispatch moves tokens (``DISPATCHERS``): ``alltoall`` (Megatron's all-to-all
            dispatcher: one copy per (token, expert) pair) or ``deepep`` (DeepEP normal kernels: one RDMA copy per
            (token, remote node), forwarded over NVLink to each target GPU, one copy per (token, GPU)).
            ``nvlink_bw`` / ``rdma_bw`` are the bandwidths that dispatcher achieves (docs/method.md, "Rates").
        gemm_curve: measured expert-GEMM throughput ``((rows_per_expert, FLOP/s), ...)`` sorted by rows (empty when
            not measured); ``expert_flops_at`` interpolates it. The planners' cost model charges ``flops`` (the rate
            at the profile's rows per expert, see :meth:`rates`); the simulator charges the curve
            (``timing.expert_compute_seconds``).
        nvlink_latency, rdma_latency: seconds one message pays on NVLink / RDMA before its bytes flow (``alpha``
            of ``alpha + bytes / B``; 0: bandwidth only, as ``hopper-rail``). See ``timing.message_latency``.
        overlap: how the trainer overlaps the EP all-to-all with compute (``OVERLAPS``): ``none`` (back to back),
            ``megatron`` (Megatron-LM's ``overlap_moe_expert_parallel_comm``: one micro-batch's forward beside
            another's backward on a compute and a communication stream) or ``dualpipe`` (DeepSeek-V3's full
            overlap). It sits beside ``dispatcher``: both describe the runtime's EP communication, and every
            consumer of step time (the simulator, the planners' objective, the portfolio) already receives the
            cluster. ``timing.layer_step_seconds`` has the rules.
    """

    nodes: int
    gpus_per_node: int
    nvlink_bw: float = 450e9
    rdma_bw: float = 50e9
    flops: float = 700e12
    attn_flops: float | None = None
    name: str = "custom"
    dispatcher: str = "alltoall"
    gemm_curve: tuple[tuple[float, float], ...] = ()
    nvlink_latency: float = 0.0
    rdma_latency: float = 0.0
    overlap: str = "none"

    def __post_init__(self) -> None:
        for f in ("nodes", "gpus_per_node"):
            check_count(f"ClusterSpec.{f}", getattr(self, f), error=ValueError)
        for f in ("nvlink_bw", "rdma_bw", "flops", "attn_flops"):
            v = getattr(self, f)
            if f == "attn_flops" and v is None:
                continue
            unit = "FLOP/s" if "flops" in f else "bytes/s"
            if not is_number(v) or not np.isfinite(v) or not v > 0:
                raise ValueError(f"ClusterSpec.{f} must be a finite number > 0, got {v!r}")
            check_range(f"ClusterSpec.{f}", v, *RATE_RANGE, what="a rate", unit=unit, error=ValueError)
        for f in ("nvlink_latency", "rdma_latency"):
            v = getattr(self, f)
            if not is_number(v) or not np.isfinite(v) or v < 0:
                raise ValueError(f"ClusterSpec.{f} must be a finite number >= 0 (seconds), got {v!r}")
            check_range(f"ClusterSpec.{f}", v, *LATENCY_RANGE, what="a latency", unit="seconds", error=ValueError)
        if self.dispatcher not in DISPATCHERS:
            raise ValueError(f"ClusterSpec.dispatcher must be one of {list(DISPATCHERS)}, got {self.dispatcher!r}")
        if self.overlap not in OVERLAPS:
            raise ValueError(f"ClusterSpec.overlap must be one of {list(OVERLAPS)}, got {self.overlap!r}")
        curve = tuple((float(r), float(f)) for r, f in self.gemm_curve)
        for r, f in curve:
            if not (np.isfinite(r) and r > 0 and np.isfinite(f) and RATE_RANGE[0] <= f <= RATE_RANGE[1]):
                raise ValueError(f"ClusterSpec.gemm_curve point ({r}, {f}) must hold a finite rows > 0 and "
                                 f"FLOP/s in [{RATE_RANGE[0]:g}, {RATE_RANGE[1]:g}]")
        if any(b[0] <= a[0] for a, b in zip(curve, curve[1:])):
            raise ValueError(f"ClusterSpec.gemm_curve must be sorted by strictly increasing rows, got "
                             f"{[r for r, _ in curve]}")
        object.__setattr__(self, "gemm_curve", curve)

    def expert_flops_at(self, rows_per_expert: float | np.ndarray) -> float | np.ndarray:
        """Expert-GEMM FLOP/s with ``rows_per_expert`` rows per expert (a number, or an array of any shape: an
        array of the same shape back): the measured ``gemm_curve`` interpolated linearly in log(rows) and held
        constant beyond its ends; ``flops`` when there is no curve."""
        scalar = np.ndim(rows_per_expert) == 0
        r = np.maximum(np.asarray(rows_per_expert, dtype=np.float64), 1e-12)
        if not self.gemm_curve:
            out = np.full(r.shape, float(self.flops))
        else:
            rows = np.log([p[0] for p in self.gemm_curve])
            fl = [p[1] for p in self.gemm_curve]
            out = np.interp(np.log(r), rows, fl)
        return float(out) if scalar else out

    def rates(self, model: ModelSpec) -> Rates:
        """The effective rates the cost model, the planners and ``timing`` charge for ``model`` on this cluster:
        the one accessor of the rates (a cluster profile overrides them by building the ClusterSpec)."""
        nv_copies, rdma_copies = dispatch_copies_per_pair(model, self)
        return Rates(expert_flops=float(self.flops), attention_flops=float(self.attention_flops),
                     nvlink_bw=float(self.nvlink_bw), rdma_bw=float(self.rdma_bw),
                     nvlink_copies=nv_copies, rdma_copies=rdma_copies,
                     sec_per_pair=model.flops_per_token_expert / float(self.flops),
                     nvlink_sec_per_pair=model.token_bytes * nv_copies / float(self.nvlink_bw),
                     rdma_sec_per_pair=model.token_bytes * rdma_copies / float(self.rdma_bw),
                     nvlink_latency=float(self.nvlink_latency), rdma_latency=float(self.rdma_latency))

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
        node, rail = self.node_of(g), self.rail_of(g)
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
        ``gpus_per_node`` given), on the links of ``fabric`` (:func:`cluster_preset`). A collective: every rank of the
        group calls it, with the same arguments (ranks that differ all raise ValueError naming two of them; see
        :func:`relibra_moe.spec_sources.group_topology`)."""
        nodes, per_node = group_topology(group, gpus_per_node, agree=f"fabric={fabric!r}")
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

# Every rate below cites its source in docs/method.md ("Rates"); bandwidths are bytes/s per GPU per direction.
# "links" maps a dispatcher to the (NVLink, RDMA) bandwidth it achieves; "latency" is the (NVLink, RDMA) seconds one
# message pays before its bytes flow (alpha of alpha + bytes / B).
_HOPPER_LATENCY = (4e-6, 12.5e-6)
_H100_LIKE = dict(flops=413e12, attn_flops=520e12,
                  links={"alltoall": (370e9, 48e9), "deepep": (370e9, 43e9)}, latency=_HOPPER_LATENCY)
CLUSTER_PRESETS: dict[str, dict[str, Any]] = {
    # raw link rates of the paper's cluster (the project's first preset): NVLink 900 GB/s bidirectional (450 per
    # direction), 8 x 400 Gb/s rail-optimized RDMA per node (50 GB/s per GPU), 700 TFLOP/s (71% of dense bf16 peak)
    # (and no per-message latency, so its plans and figures stay those recorded before latency was modelled)
    "hopper-rail": dict(flops=700e12, attn_flops=None, links={"alltoall": (450e9, 50e9), "deepep": (450e9, 50e9)},
                        latency=(0.0, 0.0)),
    # H100 SXM, NVLink 4, one CX-7 400 Gb/s NIC per GPU on its rail: achieved rates from public measurements
    "h100": _H100_LIKE,
    # H200 SXM: the H100's tensor cores, NVLink 4 and NICs (more and faster HBM); no separate public MoE figures
    "h200": _H100_LIKE,
    # H800: the H100's tensor cores, NVLink cut to 400 GB/s bidirectional (DeepEP: ~160 GB/s achievable)
    "h800": dict(flops=413e12, attn_flops=520e12, links={"alltoall": (160e9, 48e9), "deepep": (153e9, 43e9)},
                 latency=_HOPPER_LATENCY),
}

DEFAULT_CLUSTER = "h100"
"""The preset ``relibra`` commands and ``cluster_preset`` use by default: the paper's cluster class (Hopper, NVLink
900 GB/s, 8 x 400 Gb/s rails) at the rates public kernels achieve on it (docs/method.md, "Rates");
``hopper-rail`` (the raw link rates) stays available by name."""


def cluster_preset(name: str = DEFAULT_CLUSTER, nodes: int = 1, gpus_per_node: int = 8,
                   dispatcher: str = "alltoall", overlap: str = "none") -> ClusterSpec:
    """A ClusterSpec from a named fabric; ``nodes`` x ``gpus_per_node`` sizes the EP group.

    Known fabrics (``CLUSTER_PRESETS``): ``h100`` (default), ``h200``, ``h800`` (achieved rates of public
    measurements) and ``hopper-rail`` (the raw link rates of the paper's cluster). ``dispatcher`` (``DISPATCHERS``)
    picks the token traffic and the bandwidths that dispatcher achieves; ``overlap`` (``OVERLAPS``) the trainer's
    compute / all-to-all overlap.
    """
    if name not in CLUSTER_PRESETS:
        raise ValueError(f"unknown cluster preset {name!r}; known: {sorted(CLUSTER_PRESETS)}")
    if dispatcher not in DISPATCHERS:
        raise ValueError(f"dispatcher must be one of {list(DISPATCHERS)}, got {dispatcher!r}")
    p = CLUSTER_PRESETS[name]
    nv, rdma = p["links"][dispatcher]
    nv_alpha, rdma_alpha = p["latency"]
    return ClusterSpec(nodes=nodes, gpus_per_node=gpus_per_node, name=name, nvlink_bw=nv, rdma_bw=rdma,
                       flops=p["flops"], attn_flops=p["attn_flops"], dispatcher=dispatcher,
                       nvlink_latency=nv_alpha, rdma_latency=rdma_alpha, overlap=overlap)


#: ``measurements["device_kind"]`` of a profile ``relibra calibrate --device cpu`` wrote: a functional check whose
#: rates are the CPU's, which ``cluster_from_profile`` refuses unless ``allow_cpu_profile=True``.
CPU_PROFILE = "cpu (not a GPU profile)"
PROFILE_FORMAT = "relibra-cluster-profile"
PROFILE_VERSION = 1
_PROFILE_RATES = ("flops", "attn_flops", "nvlink_bw", "rdma_bw")
_PROFILE_LATENCIES = ("nvlink_latency", "rdma_latency")
"""Optional profile fields (seconds per message): a profile written before latency was modelled has none and
means alpha = 0 (bandwidth only), as it was charged when written."""


def cluster_profile(cluster: ClusterSpec, source: str, measurements: dict[str, Any] | None = None) -> dict[str, Any]:
    """The JSON-able cluster profile of ``cluster`` (``relibra calibrate`` writes it; ``load_cluster_profile``
    reads it): its rates, dispatcher, GPUs per node and GEMM curve, where they came from (``source``) and the raw
    ``measurements``. The EP group size (nodes) is not part of a profile: the run picks it."""
    return {"format": PROFILE_FORMAT, "version": PROFILE_VERSION, "name": cluster.name, "source": source,
            "dispatcher": cluster.dispatcher, "gpus_per_node": cluster.gpus_per_node,
            "flops": float(cluster.flops), "attn_flops": float(cluster.attention_flops),
            "nvlink_bw": float(cluster.nvlink_bw), "rdma_bw": float(cluster.rdma_bw),
            "nvlink_latency": float(cluster.nvlink_latency), "rdma_latency": float(cluster.rdma_latency),
            "gemm_curve": [[float(r), float(f)] for r, f in cluster.gemm_curve],
            "measurements": measurements or {}}


def cluster_from_profile(profile: dict[str, Any], nodes: int, gpus_per_node: int | None = None,
                         where: str = "cluster profile", *, allow_cpu_profile: bool = False) -> ClusterSpec:
    """The ClusterSpec of a profile dict (see ``cluster_profile``) with ``nodes`` nodes.

    ``gpus_per_node`` (optional) must match the profile's: its NVLink rate was measured inside such a node.
    A CPU profile (``calibrate --device cpu``) is refused unless ``allow_cpu_profile``. Every rate and latency
    must lie in :data:`RATE_RANGE` / :data:`LATENCY_RANGE`.
    Raises PlanError naming the field and value for a malformed profile.
    """
    if not isinstance(profile, dict) or profile.get("format") != PROFILE_FORMAT:
        got = profile.get("format") if isinstance(profile, dict) else type(profile).__name__
        raise PlanError(f"{where}: format is {got!r}, expected {PROFILE_FORMAT!r}")
    if profile.get("version") != PROFILE_VERSION:
        raise PlanError(f"{where}: version is {profile.get('version')!r}, expected {PROFILE_VERSION}")
    missing = [k for k in (*_PROFILE_RATES, "dispatcher", "gpus_per_node") if k not in profile]
    if missing:
        raise PlanError(f"{where}: missing field(s) {missing}")
    meas = profile.get("measurements")
    if isinstance(meas, dict) and meas.get("device_kind") == CPU_PROFILE and not allow_cpu_profile:
        raise PlanError(f"{where}: measured on the CPU by `relibra calibrate --device cpu` (a functional check), not "
                        "a GPU profile; calibrate on the GPU box, or pass allow_cpu_profile=True to use it anyway")
    gpn = profile["gpus_per_node"]
    if gpus_per_node is not None and gpn != gpus_per_node:
        raise PlanError(f"{where}: gpus_per_node is {gpn!r} in the profile, the run asks for {gpus_per_node}")
    try:
        return ClusterSpec(nodes=nodes, gpus_per_node=gpn, name=str(profile.get("name", "profile")),
                           dispatcher=profile["dispatcher"],
                           gemm_curve=tuple(tuple(p) for p in profile.get("gemm_curve", ())),
                           **{k: profile[k] for k in _PROFILE_RATES},
                           **{k: profile[k] for k in _PROFILE_LATENCIES if k in profile})
    except (ValueError, TypeError) as e:
        raise PlanError(f"{where}: {e}") from None


def save_cluster_profile(path: str | os.PathLike, profile: dict[str, Any]) -> None:
    """Write a profile dict as JSON (sorted keys, so the file is byte-stable)."""
    write_json(path, profile, error=PlanError, indent=1, sort_keys=True)


def load_cluster_profile(path: str | os.PathLike, nodes: int, gpus_per_node: int | None = None, *,
                         allow_cpu_profile: bool = False) -> ClusterSpec:
    """The ClusterSpec of the cluster profile file ``path`` with ``nodes`` nodes (PlanError for a bad file; see
    :func:`cluster_from_profile`)."""
    try:
        with open(path, encoding="utf-8") as f:
            profile = json.load(f)
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise PlanError(f"cluster profile {os.fspath(path)!r}: {e}") from None
    except RecursionError:
        raise PlanError(f"cluster profile {os.fspath(path)!r}: the JSON nests deeper than Python follows") from None
    return cluster_from_profile(profile, nodes, gpus_per_node, where=f"cluster profile {os.fspath(path)!r}",
                                allow_cpu_profile=allow_cpu_profile)


def model_preset(name: str) -> ModelSpec:
    """The ModelSpec of a named model (see ``MODEL_PRESETS``)."""
    try:
        return MODEL_PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown model preset {name!r}; known: {sorted(MODEL_PRESETS)}") from None


def replica_buffer_bytes(model: ModelSpec | str, replica_slots: int = 2, dtype_bytes: int | None = None) -> int:
    """Bytes per GPU of the layer-shared (SwiGLU, bias-free) replica buffer: ``r x 3 x h x h' x dtype_bytes``
    (r slots of one expert), whatever the number of layers.

    ``model`` is a ``ModelSpec`` or a preset name; ``dtype_bytes`` overrides the model's. E.g. 18 MiB for
    ``"qwen3-30b-a3b"`` and 72 MiB for ``"qwen3-235b-a22b"`` at r = 2 in bf16.

    Raises:
        ValueError: an unknown preset, or ``replica_slots`` not an int >= 0 (naming the value).
    """
    spec = model_preset(model) if isinstance(model, str) else model
    if dtype_bytes is not None:
        spec = spec.with_(dtype_bytes=dtype_bytes)
    return check_int("replica_slots", replica_slots, error=ValueError) * spec.expert_bytes
