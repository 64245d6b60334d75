"""The real routing data of ``../shared/traces`` as library objects (never copied into the repository).

- :func:`gpt_oss_batch`: GPT-OSS-20B per-token top-4 ids of 703 greedy-decoded requests (24 MoE
  layers, 32 experts) as a :class:`~relibra_moe.trace.TraceBatch`, with request metadata.
- :func:`olmoe_domain_counts`: OLMoE-1B-7B (and Mixtral) expert counts per text domain, as arrays.

The folder is ``$RELIBRA_TRACES`` when set, else ``<repository>/../shared/traces`` (next to the
checkout this package was imported from), else ``<cwd>/../shared/traces``. When none exists,
:class:`TracesNotFoundError` (both a ``TraceError`` and a ``FileNotFoundError``) says where it looked.
"""

from __future__ import annotations

import json
import os
from functools import lru_cache
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from .errors import TraceError
from .trace import RoutingTrace, TraceBatch, as_int_array, check_ids
from .validate import check_count

__all__ = [
    "TracesNotFoundError", "traces_dir", "gpt_oss_requests", "gpt_oss_domains", "gpt_oss_batch", "DomainCounts",
    "olmoe_domain_counts",
]

GPT_OSS_SOURCE = ("real routing: openai/gpt-oss-20b, greedy decode tokens, HF router hooks "
                  "(AmanPriyanshu/GPT-OSS-MoE-ExpertFingerprinting @72b368f, Apache-2.0)")
GPT_OSS_NUM_EXPERTS = 32
GPT_OSS_TOP_K = 4
GPT_OSS_NUM_LAYERS = 24


class TracesNotFoundError(TraceError, FileNotFoundError):
    """The real-trace folder (or a file in it) is missing; the message lists the paths tried."""


def _candidates() -> list[Path]:
    env = os.environ.get("RELIBRA_TRACES")
    if env:
        return [Path(env)]
    repo = Path(__file__).resolve().parents[1]
    out = [repo.parent / "shared" / "traces", Path.cwd().resolve().parent / "shared" / "traces"]
    return list(dict.fromkeys(out))


def traces_dir(required: str | None = None) -> Path:
    """The folder holding the real traces.

    Args:
        required: a relative path that must exist inside it (e.g. ``"gpt-oss-20b/topk_ids.npz"``).

    Raises:
        TracesNotFoundError: no candidate folder has it; the message lists every place tried.
    """
    tried = _candidates()
    for d in tried:
        if d.is_dir() and (required is None or (d / required).exists()):
            return d
    what = f"{required} under " if required else ""
    hint = "set RELIBRA_TRACES to the folder" if not os.environ.get("RELIBRA_TRACES") else "check RELIBRA_TRACES"
    raise TracesNotFoundError(f"real routing traces not found: looked for {what}"
                              f"{', '.join(str(p) for p in tried)} ({hint})")


# --------------------------------------------------------------------------------------- GPT-OSS
@lru_cache(maxsize=2)
def _gpt_oss_all(root: str) -> tuple[TraceBatch, tuple[dict[str, Any], ...]]:
    d = Path(root) / "gpt-oss-20b"
    with np.load(d / "topk_ids.npz", allow_pickle=False) as f:
        ids, offsets = f["topk_ids"], f["offsets"].astype(np.int64)
    requests = tuple(json.loads((d / "requests.json").read_text()))
    n = offsets.size - 1
    if len(requests) != n or ids.shape[1:] != (GPT_OSS_NUM_LAYERS, GPT_OSS_TOP_K) or offsets[-1] != ids.shape[0]:
        raise TraceError(f"{d}: topk_ids {ids.shape} / offsets {offsets.shape} / {len(requests)} requests disagree")

    def where(t: int) -> str:
        i = int(np.searchsorted(offsets, t, side="right")) - 1
        return f"{d / 'topk_ids.npz'}: request {i}, row {t - int(offsets[i])}"

    ids = as_int_array(f"{d / 'topk_ids.npz'}: topk_ids", ids)
    check_ids(ids, GPT_OSS_NUM_EXPERTS, where)  # on the stored values: a narrowing cast could wrap into range
    experts = ids.astype(np.int16)
    experts.setflags(write=False)
    layer_ids = np.arange(GPT_OSS_NUM_LAYERS, dtype=np.int32)
    layer_ids.setflags(write=False)
    traces = [RoutingTrace._trusted(experts[offsets[i]:offsets[i + 1]], layer_ids, GPT_OSS_NUM_EXPERTS,
                                    GPT_OSS_TOP_K, int(requests[i]["n_prompt_tokens"]), GPT_OSS_SOURCE)
              for i in range(n)]
    info = {
        "request": np.arange(n, dtype=np.int64),
        "domain": np.array([r["domain"] for r in requests]),
        "dataset": np.array([r["dataset"] for r in requests]),
        "category": np.array([r["category"] for r in requests]),
        "repetition": np.array([bool(r["repetition"]) for r in requests]),
        "finished": np.array([bool(r["finished"]) for r in requests]),
    }
    batch = TraceBatch(traces, source=GPT_OSS_SOURCE, sample_info=info)
    batch.sample_expert_counts()  # cached once; subsets slice it
    return batch, requests


def gpt_oss_requests() -> list[dict[str, Any]]:
    """The metadata of the 703 GPT-OSS-20B requests, in file order (copies of ``requests.json`` rows)."""
    _, requests = _gpt_oss_all(str(traces_dir("gpt-oss-20b/topk_ids.npz")))
    return [dict(r) for r in requests]


def gpt_oss_domains() -> list[str]:
    """The distinct request domains, sorted."""
    return sorted({r["domain"] for r in gpt_oss_requests()})


def gpt_oss_batch(num_requests: int | None = None, seed: int = 0, domains: str | list[str] | None = None,
                  drop_repetition: bool = False) -> TraceBatch:
    """GPT-OSS-20B real routing as a TraceBatch (decode tokens only; layer ids 0..23, E = 32, k = 4).

    Args:
        num_requests: draw this many requests (without replacement) with ``seed``, kept in the drawn
            order; None = every eligible request in file order.
        seed: seed of the draw.
        domains: keep only requests of these domains (see :func:`gpt_oss_domains`).
        drop_repetition: drop requests whose greedy decoding fell into a loop (they inflate skew).

    Returns:
        A batch without micro-batch assignment; ``sample_info`` holds ``request`` (index in the
        file), ``domain``, ``dataset``, ``category``, ``repetition``, ``finished`` per sample;
        ``starts`` are the prompt lengths.

    Raises:
        TracesNotFoundError: the data folder is absent. TraceError: unknown domain, no request left,
        more requests asked than eligible.
    """
    full, _ = _gpt_oss_all(str(traces_dir("gpt-oss-20b/topk_ids.npz")))
    keep = np.ones(full.num_sequences, dtype=bool)
    what = []
    if domains is not None:
        wanted = [domains] if isinstance(domains, str) else list(domains)
        known = set(full.sample_info["domain"].tolist())
        unknown = sorted(set(wanted) - known)
        if unknown:
            raise TraceError(f"unknown GPT-OSS domain(s) {unknown}; known: {sorted(known)}")
        keep &= np.isin(full.sample_info["domain"], wanted)
        what.append(f"domains {sorted(set(wanted))}")
    if drop_repetition:
        keep &= ~full.sample_info["repetition"]
        what.append("repetition loops dropped")
    eligible = np.flatnonzero(keep)
    if eligible.size == 0:
        raise TraceError(f"no GPT-OSS request left after filtering ({', '.join(what)})")
    if num_requests is not None:
        check_count("num_requests", num_requests, error=TraceError)
        if num_requests > eligible.size:
            raise TraceError(f"num_requests={num_requests} exceeds the {eligible.size} eligible GPT-OSS requests")
        eligible = np.random.default_rng(seed).choice(eligible, size=int(num_requests), replace=False)
        what.append(f"{num_requests} requests drawn with seed {seed}")
    batch = full.subset(eligible)
    batch.source = GPT_OSS_SOURCE + (f"; {', '.join(what)}" if what else "; all 703 requests")
    return batch


# ------------------------------------------------------------------------------------------ OLMoE
class DomainCounts(NamedTuple):
    """Expert counts per text domain (aggregates over ~209k teacher-forced tokens per domain)."""

    counts: np.ndarray    #: int64 ``[D, layers, E]`` (or ``[D, pairs, E, E]`` for cross-layer keys)
    domains: list[str]    #: the D domain names
    layers: np.ndarray    #: int64 ``[layers]`` global layer indices (``[pairs, 2]`` for cross-layer keys)


def olmoe_domain_counts(key: str = "olmoe__expert_counts") -> DomainCounts:
    """One array of ``olmoe/domain_counts.npz`` with its domain names and layers.

    Args:
        key: ``olmoe__expert_counts`` (OLMoE-1B-7B, top-8, ``[6, 3, 64]``), ``mistral__expert_counts``
            (Mixtral-8x7B, top-2), the ``*_top1`` and ``*__crosslayer`` variants, or
            ``olmoe_sft__expert_counts`` / ``olmoe_dpo__expert_counts``.
    """
    d = traces_dir("olmoe/domain_counts.npz") / "olmoe"
    meta = json.loads((d / "domain_counts.json").read_text())
    with np.load(d / "domain_counts.npz", allow_pickle=False) as f:
        if key not in f.files:
            raise TraceError(f"{d / 'domain_counts.npz'}: no array {key!r}; known: {sorted(f.files)}")
        counts = f[key].astype(np.int64)
    domains = list(meta.get(key, []))
    if len(domains) != counts.shape[0]:
        raise TraceError(f"{d}: {key} has {counts.shape[0]} domains but the json names {len(domains)}")
    layers = np.asarray(meta["crosslayer_pairs"] if "crosslayer" in key else meta["layers"], dtype=np.int64)
    return DomainCounts(counts, domains, layers)
