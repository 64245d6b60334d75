"""Where ``ModelSpec`` and ``ClusterSpec`` fields come from outside the library: a Hugging Face
``config.json`` (or a transformers config object) and a ``torch.distributed`` process group / ``DeviceMesh``.

This module returns plain field values; :meth:`relibra_moe.specs.ModelSpec.from_hf_config` and
:meth:`relibra_moe.specs.ClusterSpec.from_process_group` build the specs from them.

One table, :data:`HF_FAMILIES`, says for every supported ``model_type`` which config keys hold the
expert width, the expert count and the shared experts, and which decoder layers are MoE layers (the
rule of the family's ``modeling_*.py`` in transformers 5.24):

============ ====================== ====================== ==================================================
model_type   expert width h'        experts E              MoE layers / shared experts
============ ====================== ====================== ==================================================
qwen3_moe    moe_intermediate_size  num_experts            i not in mlp_only_layers, (i+1) % decoder_sparse_step == 0
qwen2_moe    moe_intermediate_size  num_experts            as qwen3_moe; 1 shared of shared_expert_intermediate_size
qwen3_next   moe_intermediate_size  num_experts            as qwen2_moe (attention shape: its full-attention layers)
mixtral      intermediate_size      num_local_experts      every layer
olmoe        intermediate_size      num_experts            every layer
gpt_oss      intermediate_size      num_local_experts      every layer
deepseek_v3  moe_intermediate_size  n_routed_experts       i >= first_k_dense_replace; n_shared_experts of h'
glm4_moe     moe_intermediate_size  n_routed_experts       i >= first_k_dense_replace; n_shared_experts of h'
============ ====================== ====================== ==================================================

Every family: ``hidden_size``, ``num_experts_per_tok`` (k), ``num_hidden_layers``, ``num_attention_heads``,
``num_key_value_heads`` (default: the head count) and ``head_dim`` (default ``hidden_size //
num_attention_heads``; DeepSeek-V3's MLA: ``qk_nope_head_dim + qk_rope_head_dim``, the q/k width). A key
may also be spelled as transformers' ``attribute_map`` aliases it (``num_local_experts`` for
``num_experts`` and back). ``dtype`` / ``torch_dtype`` sets the bytes per element (bf16 / fp16: 2,
fp32: 4; absent: 2). A multimodal config's ``text_config`` is read when the outer ``model_type`` is not a
family.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .validate import is_int

__all__ = ["HF_FAMILIES", "HFFamilySpec", "model_fields_from_hf_config", "is_device_mesh", "ep_process_group",
           "group_topology"]

_ALIASES: dict[str, tuple[str, ...]] = {
    "num_experts": ("num_experts", "num_local_experts", "n_routed_experts"),
    "num_local_experts": ("num_local_experts", "num_experts"),
    "n_routed_experts": ("n_routed_experts",),
    "num_experts_per_tok": ("num_experts_per_tok", "experts_per_token"),
}

_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "torch.bfloat16": 2, "torch.float16": 2,
                "torch.float32": 4}


def _qwen_moe_layers(cfg: _ConfigReader, n: int) -> list[int]:
    only = set(cfg.layer_list("mlp_only_layers", n))
    step = cfg.int("decoder_sparse_step", 1)
    if step == 0:
        raise ValueError(f"{cfg.what}: field 'decoder_sparse_step' = 0 must be >= 1")
    return [i for i in range(n) if i not in only and (i + 1) % step == 0]


def _after_dense_layers(cfg: _ConfigReader, n: int) -> list[int]:
    return list(range(cfg.int("first_k_dense_replace", 0), n))


def _all_layers(cfg: _ConfigReader, n: int) -> list[int]:
    return list(range(n))


@dataclass(frozen=True)
class HFFamilySpec:
    """How one HF ``model_type`` spells the MoE fields of its config.

    Attributes:
        ffn_key: key of the routed expert's FFN width h'.
        experts_key: key of the routed expert count E.
        moe_layers: ``(reader, num_hidden_layers) -> [decoder indices of the MoE layers]``.
        shared_count_key: key of the shared-expert count, or ``None``.
        shared_ffn_key: key of the shared expert's width (``None``: h').
        shared_default: shared experts when ``shared_count_key`` is ``None`` (Qwen2-MoE: 1, gated).
    """

    ffn_key: str
    experts_key: str
    moe_layers: Callable[[_ConfigReader, int], list[int]]
    shared_count_key: str | None = None
    shared_ffn_key: str | None = None
    shared_default: int = 0


HF_FAMILIES: dict[str, HFFamilySpec] = {
    "qwen3_moe": HFFamilySpec("moe_intermediate_size", "num_experts", _qwen_moe_layers),
    "qwen2_moe": HFFamilySpec("moe_intermediate_size", "num_experts", _qwen_moe_layers,
                              shared_ffn_key="shared_expert_intermediate_size", shared_default=1),
    "qwen3_next": HFFamilySpec("moe_intermediate_size", "num_experts", _qwen_moe_layers,
                               shared_ffn_key="shared_expert_intermediate_size", shared_default=1),
    "mixtral": HFFamilySpec("intermediate_size", "num_local_experts", _all_layers),
    "olmoe": HFFamilySpec("intermediate_size", "num_experts", _all_layers),
    "gpt_oss": HFFamilySpec("intermediate_size", "num_local_experts", _all_layers),
    "deepseek_v3": HFFamilySpec("moe_intermediate_size", "n_routed_experts", _after_dense_layers,
                                shared_count_key="n_shared_experts"),
    "glm4_moe": HFFamilySpec("moe_intermediate_size", "n_routed_experts", _after_dense_layers,
                             shared_count_key="n_shared_experts"),
}


def _load(config: Any) -> tuple[Mapping[str, Any] | Any, str]:
    """``(config object or dict, what)``: a path to ``config.json`` (or its directory) is read as JSON."""
    if isinstance(config, (str, os.PathLike)):
        path = Path(config)
        if path.is_dir():
            path = path / "config.json"
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            raise ValueError(f"model config {str(path)!r}: no such file") from None
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(f"model config {str(path)!r} is not a readable JSON file ({exc})") from None
        if not isinstance(data, dict):
            raise ValueError(f"model config {str(path)!r} holds a JSON {type(data).__name__}, not an object")
        return data, f"model config {str(path)!r}"
    if isinstance(config, Mapping):
        return config, "model config"
    if hasattr(config, "to_dict") and hasattr(config, "model_type"):
        return config, f"{type(config).__name__}"
    raise ValueError(f"expected a transformers config object, a config dict or a config.json path, got "
                     f"{type(config).__name__}")


_MISSING = object()


class _ConfigReader:
    """Reads fields of a config (a mapping or a config object; aliases of :data:`_ALIASES` tried in order);
    ``what`` names the config in errors."""

    def __init__(self, cfg: Mapping[str, Any] | Any, what: str) -> None:
        self.cfg, self.what = cfg, what

    def get(self, key: str, default: Any = _MISSING) -> Any:
        """The value of ``key`` (``None`` counts as absent); ``default`` when absent, else ValueError naming it."""
        for k in _ALIASES.get(key, (key,)):
            v = self.cfg.get(k, _MISSING) if isinstance(self.cfg, Mapping) else getattr(self.cfg, k, _MISSING)
            if v is not _MISSING and v is not None:
                return v
        if default is _MISSING:
            raise ValueError(f"{self.what}: field {key!r} is missing")
        return default

    def layer_list(self, key: str, n: int) -> list[int]:
        """``get(key, [])`` as a list of decoder-layer indices in ``[0, n)``, else ValueError naming the field and
        the value (a string such as ``"0,1"``, a float or a bare int is not a list of layers)."""
        v = self.get(key, [])
        if not isinstance(v, (list, tuple)) or not all(is_int(i) and 0 <= i < n for i in v):
            raise ValueError(f"{self.what}: field {key!r} = {v!r} must be a list of decoder-layer indices in "
                             f"[0, {n}) (num_hidden_layers = {n})")
        return [int(i) for i in v]

    def int(self, key: str, default: Any = _MISSING) -> int:
        """``get(key, default)`` as an int >= 0 (bool is not one), else ValueError naming the field and value."""
        v = self.get(key, default)
        if not is_int(v) or v < 0:
            raise ValueError(f"{self.what}: field {key!r} = {v!r} is not an integer >= 0")
        return int(v)


def model_fields_from_hf_config(config: Any) -> dict[str, Any]:
    """The :class:`~relibra_moe.specs.ModelSpec` fields of an HF MoE model config.

    Args:
        config: a transformers ``PretrainedConfig``, a dict of ``config.json``, or a path to a
            ``config.json`` file (or to the directory holding one).

    Returns:
        ``name`` (``_name_or_path``'s last part, else the model_type), ``hidden``, ``ffn``,
        ``num_experts``, ``top_k``, ``num_layers`` (MoE layers only), ``dtype_bytes``, ``num_heads``,
        ``num_kv_heads``, ``head_dim``, ``shared_experts``, ``shared_ffn`` and ``moe_layer_ids`` (the decoder
        indices of the MoE layers, for traces; not a ModelSpec field).

    Raises:
        ValueError: an unreadable file, a ``model_type`` that is not a supported family (the message lists
            them), a missing or non-integer field (named), a model with no MoE layer.
    """
    cfg, what = _load(config)
    rd = _ConfigReader(cfg, what)
    get, gi = rd.get, rd.int
    model_type = get("model_type", "")
    if model_type not in HF_FAMILIES:
        text = get("text_config", None)
        if text is not None:
            return model_fields_from_hf_config(text)
        raise ValueError(f"{what}: model_type={model_type!r} is not a supported MoE family; supported: "
                         f"{', '.join(HF_FAMILIES)}")
    fam = HF_FAMILIES[model_type]
    n = gi("num_hidden_layers")
    moe_layers = fam.moe_layers(rd, n)
    if gi(fam.experts_key) == 0 or not moe_layers:
        raise ValueError(f"{what}: {model_type} with {fam.experts_key}={gi(fam.experts_key)} and "
                         f"num_hidden_layers={n} has no MoE layer")
    hidden, heads = gi("hidden_size"), gi("num_attention_heads")
    if model_type == "deepseek_v3":  # MLA: q / k heads of width nope + rope
        head_dim = gi("qk_nope_head_dim") + gi("qk_rope_head_dim")
    else:
        head_dim = gi("head_dim", hidden // max(heads, 1))
    ffn = gi(fam.ffn_key)
    shared = gi(fam.shared_count_key, 0) if fam.shared_count_key else fam.shared_default
    shared_ffn = gi(fam.shared_ffn_key) if fam.shared_ffn_key and shared else None
    dtype = get("dtype", None) or get("torch_dtype", None)
    dtype_bytes = 2 if dtype is None else _DTYPE_BYTES.get(str(dtype))
    if dtype_bytes is None:
        raise ValueError(f"{what}: field 'dtype' = {str(dtype)!r} is not one of {sorted(set(_DTYPE_BYTES))}")
    name = str(get("_name_or_path", "") or "").rstrip("/").rsplit("/", 1)[-1] or model_type
    return {"name": name, "hidden": hidden, "ffn": ffn, "num_experts": gi(fam.experts_key),
            "top_k": gi("num_experts_per_tok"), "num_layers": len(moe_layers), "dtype_bytes": dtype_bytes,
            "num_heads": heads, "num_kv_heads": gi("num_key_value_heads", heads), "head_dim": head_dim,
            "shared_experts": int(shared), "shared_ffn": shared_ffn if shared_ffn != ffn else None,
            "moe_layer_ids": moe_layers}


# ------------------------------------------------------------------------------------ process groups
def is_device_mesh(obj: object) -> bool:
    """Whether ``obj`` is a ``torch.distributed`` ``DeviceMesh``."""
    from torch.distributed.device_mesh import DeviceMesh

    return isinstance(obj, DeviceMesh)


def ep_process_group(ep_group: object, ep_dim: str = "ep") -> Any:
    """The expert-parallel ``ProcessGroup`` of ``ep_group``: a 1-D ``DeviceMesh`` (its group), a mesh with
    a dimension named ``ep_dim`` (that dimension's group for this rank), or a ``ProcessGroup`` / ``None``
    (returned as is). Raises ``ValueError`` for a multi-dimensional mesh without an ``ep_dim`` dimension."""
    if not is_device_mesh(ep_group):
        return ep_group
    if ep_group.ndim == 1:
        return ep_group.get_group()
    names = tuple(ep_group.mesh_dim_names or ())
    if ep_dim not in names:
        raise ValueError(f"the {ep_group.ndim}-D DeviceMesh has dimensions {names}, none named ep_dim={ep_dim!r}: "
                         "cannot tell which one is expert parallel")
    return ep_group[ep_dim].get_group()


def group_topology(group: object = None, gpus_per_node: int | None = None, *, agree: object = None) -> tuple[int, int]:
    """``(nodes, gpus_per_node)`` of an EP group (a ``ProcessGroup``, a ``DeviceMesh`` as for
    :func:`ep_process_group`, or ``None``: the world).

    A collective: every rank of the group calls it. One ``all_gather_object`` over the group carries each
    rank's arguments (``gpus_per_node`` and ``agree``, the caller's other arguments as text, compared) and
    host name, so ranks that disagree all raise, naming two ranks and what each passed, instead of some
    waiting in a collective the others skip. ``gpus_per_node`` given: checked to divide the group size.
    Otherwise the hosts must form equal, contiguous blocks in group-rank order (rank g on node g // P), which
    is the layout a ClusterSpec describes; ``torchrun`` places ranks that way.

    Raises:
        ValueError (on every rank alike): ``torch.distributed`` not initialized, ranks passing different
            arguments, ``gpus_per_node`` not dividing the group size, hosts with unequal rank counts or
            interleaved ranks.
    """
    import socket

    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError("ClusterSpec.from_process_group: torch.distributed is not initialized")
    group = ep_process_group(group)
    world = dist.get_world_size(group)
    gathered: list[Any] = [None] * world
    extra = agree if isinstance(agree, str) else repr(agree)
    dist.all_gather_object(gathered, (repr(gpus_per_node), extra, socket.gethostname()), group=group)
    args = [g[:2] for g in gathered]
    for r, a in enumerate(args):
        if a != args[0]:
            raise ValueError(f"ClusterSpec.from_process_group: group rank 0 passed gpus_per_node={args[0][0]}, "
                             f"{args[0][1]}; group rank {r} passed gpus_per_node={a[0]}, {a[1]}: every rank of the "
                             "group must pass the same arguments")
    hosts = [g[2] for g in gathered]
    if gpus_per_node is not None:
        if not is_int(gpus_per_node) or gpus_per_node <= 0 or world % gpus_per_node:
            raise ValueError(f"gpus_per_node={gpus_per_node!r} does not divide the group size {world}")
        return world // int(gpus_per_node), int(gpus_per_node)
    order = list(dict.fromkeys(hosts))
    per = world // len(order)
    expected = [h for h in order for _ in range(per)]
    if hosts != expected:
        counts = {h: hosts.count(h) for h in order}
        raise ValueError(f"the group's ranks are not equal contiguous blocks per host (ranks per host {counts}, "
                         f"host of each group rank {hosts}): pass gpus_per_node explicitly")
    return len(order), per
