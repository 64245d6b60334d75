"""Synthetic RL global batches (GRPO groups, domain hot sets, long-tailed lengths). SYNTHETIC, never real.

A batch has ``num_prompts`` prompts with ``responses_per_prompt`` responses each; sample ``i`` is
response ``i % R`` of prompt ``i // R`` (a GRPO group is contiguous). Each sample is the prompt plus
one response, so the responses of a prompt share the prompt's rows exactly, and their response rows
come from the prompt's expert distribution with a small per-response perturbation: they share most
of their routing.

Generative model, per MoE layer l (all in log space, then softmax over the E experts):

- a model-wide popularity ``g[l]`` shared by every domain;
- a domain profile ``d[domain, l]``: a few strongly hot experts plus a broad random component, with a
  per-layer sharpness, so every domain has its own hot set at every layer;
- a prompt component (what this problem is about) and a small response component.

A sample's expert probabilities ``p`` become inclusion rates ``q = min(1, k p)`` (water-filled so
``sum q = k`` and no expert is chosen twice by a token), and its counts are ``S q`` rounded by largest
remainder: ``counts[n, l, e] <= S_n`` and ``sum_e counts[n, l, e] = k S_n`` exactly. Planning only
needs these counts (``TraceBatch.sample_expert_counts``), so a Qwen3-235B batch of 1024 samples
builds in seconds. Per-token ids are produced on demand by an exact construction consistent with the
counts (expert e repeated ``counts[e]`` times, token t takes entries ``c, c+S, ..., c+(k-1)S`` of one
column c, which are distinct because every count is <= S; the experts' layout order, each token's column
and its rotation are drawn from the seed, by a compiled kernel, ``_fill_ids``).

Domain ``mixed`` interleaves math, code and instruction: consecutive blocks of ``micro_batch_size``
samples (32 by default) come from different domains, in a seeded order.

Calibration (the skew and drift of docs/method.md, "The problem"; ``tests/test_synthetic.py``): on
``qwen3-30b-a3b`` with 256 prompts x 4 responses in 32 micro-batches of 32, ``mixed`` gives a mean
expert skew per micro-batch within 5-15 and a mean top-8 hot-set intersection between consecutive
micro-batches below 0.5.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from numba import njit

from .errors import TraceError
from .specs import ModelSpec, model_preset
from .trace import TraceBatch, ids_dtype, positive_int
from .validate import check_count

__all__ = ["DOMAINS", "BASE_DOMAINS", "DomainStyle", "STYLES", "rl_batch", "domain_sequence"]

BASE_DOMAINS = ("math", "code", "instruction")
DOMAINS = BASE_DOMAINS + ("mixed",)
MAX_LEN = 8192
DEFAULT_BLOCK = 32


@dataclass(frozen=True)
class DomainStyle:
    """Knobs of one domain (log-normal lengths in tokens; log-space scales of the routing components)."""

    prompt_median: float      # median prompt length
    response_median: float    # median response length
    response_sigma: float     # log-space spread of response lengths (per response)
    group_sigma: float        # log-space spread shared by a prompt's responses (problem difficulty)
    hot_experts: int          # strongly hot experts per layer
    hot_boost: float          # their log-space boost
    domain_sigma: float       # broad domain component
    focus_sigma: float        # log-normal spread of a prompt's focus (scales the domain component)
    prompt_hot: int           # experts per layer a prompt strongly prefers (its own hot set)
    prompt_hot_boost: float   # their log-space boost
    prompt_sigma: float       # broad per-prompt component
    response_sigma_r: float   # per-response component (small: a group shares most routing)


# Reasoning answers are long and focused, code is long, instruction following is short and broad.
STYLES: dict[str, DomainStyle] = {
    # prompt/response medians, response/group sigmas | domain: hot, boost, broad, focus | prompt: hot, boost, broad
    # | response noise
    "math": DomainStyle(160, 1400, 0.75, 0.45, 3, 2.2, 0.4, 0.4, 4, 3.0, 0.5, 0.25),
    "code": DomainStyle(320, 1200, 0.75, 0.45, 3, 2.0, 0.4, 0.4, 4, 3.0, 0.5, 0.25),
    "instruction": DomainStyle(220, 450, 0.8, 0.4, 3, 1.7, 0.35, 0.4, 4, 3.0, 0.55, 0.3),
}
MODEL_SIGMA = 0.5       # model-wide popularity shared by all domains (broad part)
MODEL_HOT = 3           # experts per layer hot in every domain
MODEL_HOT_BOOST = 2.2   # their log-space boost


def _stable_seed(*parts: object) -> int:
    return zlib.crc32("|".join(str(p) for p in parts).encode())


def _model(model: ModelSpec | str) -> ModelSpec:
    if isinstance(model, ModelSpec):
        return model
    if isinstance(model, str):
        try:
            return model_preset(model)
        except ValueError as exc:
            raise TraceError(str(exc)) from None
    raise TraceError(f"model must be a ModelSpec or a preset name, got {type(model).__name__}")


def _profiles(model: ModelSpec, profile_seed: int) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """Log-space expert preferences of a model (fixed for a model and profile seed).

    Returns:
        ``(shared [L, E], {domain: [L, E]})``: the model-wide popularity and each base domain's own
        component (its hot experts plus a broad random part, with a per-layer sharpness).
    """
    num_layers, e = model.num_layers, model.num_experts
    rng = np.random.default_rng(_stable_seed("relibra-synthetic-model", model.name, e, num_layers, profile_seed))
    shared = MODEL_SIGMA * rng.standard_normal((num_layers, e))
    n_hot = min(MODEL_HOT, e)
    hot = np.argsort(rng.random((num_layers, e)), axis=1)[:, :n_hot]
    boost = MODEL_HOT_BOOST * (0.6 + 0.4 * rng.random((num_layers, n_hot)))
    np.put_along_axis(shared, hot, np.take_along_axis(shared, hot, 1) + boost, axis=1)
    out = {}
    for name in BASE_DOMAINS:
        st = STYLES[name]
        r = np.random.default_rng(_stable_seed("relibra-synthetic-domain", model.name, e, num_layers, name,
                                               profile_seed))
        sharp = 0.75 + 0.5 * r.random((num_layers, 1))  # some layers are more skewed than others
        logits = st.domain_sigma * sharp * r.standard_normal((num_layers, e))
        n_hot = min(st.hot_experts, e)
        hot = np.argsort(r.random((num_layers, e)), axis=1)[:, :n_hot]
        boost = st.hot_boost * sharp * (0.6 + 0.4 * r.random((num_layers, n_hot)))
        np.put_along_axis(logits, hot, np.take_along_axis(logits, hot, 1) + boost, axis=1)
        out[name] = logits
    return shared, out


ROW_CHUNK = 4096
"""Rows ``[E]`` per pass of :func:`_inclusion_rates` / :func:`_round_counts` (their temporaries stay a few MB, so
they are reused rather than freshly mapped: a paper-scale batch has ``N L`` = 96k rows)."""


def _inclusion_rates(logits: np.ndarray, k: int) -> np.ndarray:
    """``q = min(1, k softmax(logits))`` water-filled so each row sums to k (``[..., E]`` float64)."""
    z = logits.reshape(-1, logits.shape[-1])
    q = np.empty(z.shape, dtype=np.float64)
    for lo in range(0, z.shape[0], ROW_CHUNK):  # row by row in effect: chunks give the same values
        q[lo:lo + ROW_CHUNK] = _inclusion_rates_rows(z[lo:lo + ROW_CHUNK], k)
    return q.reshape(logits.shape)


def _inclusion_rates_rows(z: np.ndarray, k: int) -> np.ndarray:
    """:func:`_inclusion_rates` of rows ``z`` ``[R, E]``."""
    p = np.exp(z - z.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    q = k * p
    rows = np.flatnonzero((q > 1.0).any(axis=1))  # only rows with an over-full expert need water-filling
    if rows.size:
        ps, qs = p[rows], q[rows]
        capped = np.zeros(qs.shape, dtype=bool)
        for _ in range(k + 1):
            over = (qs > 1.0) & ~capped
            if not over.any():
                break
            capped |= over
            free = np.where(capped, 0.0, ps)
            room = k - capped.sum(axis=1, keepdims=True)
            qs = np.where(capped, 1.0, free * (room / np.maximum(free.sum(axis=1, keepdims=True), 1e-300)))
        q[rows] = qs
    return q


def _round_counts(tokens: np.ndarray, q: np.ndarray, k: int, rng: np.random.Generator) -> np.ndarray:
    """Integer counts ``[..., E]`` with ``sum = k * tokens`` exactly and every count <= tokens.

    ``floor(S q)`` plus the remaining units placed by systematic sampling on the fractional parts
    (each expert gets at most one extra unit, with probability equal to its fractional part).

    Args:
        tokens: int ``[...]`` tokens S per row.
        q: ``[..., E]`` inclusion rates in [0, 1] summing to k.
        rng: randomness of the systematic offsets (one uniform per row, drawn first, in row order).
    """
    u = rng.random(tokens.shape).reshape(-1)
    s = tokens.astype(np.int64).reshape(-1)
    qr = q.reshape(-1, q.shape[-1])
    counts = np.empty(qr.shape, dtype=np.int64)
    for lo in range(0, qr.shape[0], ROW_CHUNK):
        hi = lo + ROW_CHUNK
        counts[lo:hi] = _round_rows(s[lo:hi], qr[lo:hi], k, u[lo:hi])
    return counts.reshape(q.shape)


def _round_rows(tokens: np.ndarray, q: np.ndarray, k: int, u: np.ndarray) -> np.ndarray:
    """:func:`_round_counts` of rows: tokens int64 ``[R]``, rates ``[R, E]``, offsets ``u`` ``[R]`` in [0, 1)."""
    s = tokens[:, None]
    x = s * q
    fl = np.minimum(np.floor(x), s).astype(np.int64)
    need = k * s[:, 0] - fl.sum(axis=-1)                    # units still to place, 0 <= need < E
    frac = np.where(fl < s, np.clip(x - fl, 0.0, 1.0), 0.0)  # saturated experts never get another unit
    cum = np.cumsum(frac, axis=-1)
    total = cum[:, -1:]
    cum *= np.where(total > 0, need[:, None] / np.where(total > 0, total, 1.0), 0.0)
    cum[:, -1] = need                                        # exact end point: the extras sum to need
    hits = np.ceil(cum - u[:, None]).astype(np.int64)        # points u, u+1, ... below each cumulative end
    extra = np.diff(hits, axis=-1, prepend=0)
    counts = fl + extra
    bad = (counts > s).any(axis=-1) | (extra < 0).any(axis=-1) | (extra > 1).any(axis=-1)
    if bad.any():  # rounding noise at a boundary: place those rows' units by largest remainder instead
        idx = np.nonzero(bad)
        f = np.where(fl[idx] < s[idx], x[idx] - fl[idx], -1.0)
        order = np.argsort(-f, axis=-1, kind="stable")
        add = np.zeros(f.shape, dtype=np.int64)
        np.put_along_axis(add, order, (np.arange(f.shape[-1]) < need[idx][:, None]).astype(np.int64), axis=-1)
        counts[idx] = fl[idx] + add
    if np.any(counts > s) or np.any(counts.sum(axis=-1) != k * s[:, 0]):  # cannot happen; guard anyway
        raise TraceError("synthetic count rounding broke its invariants (report this)")
    return counts


_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)


@njit(cache=True, inline="always")
def _split_draw(state: np.uint64, n: int, m: int) -> tuple[np.uint64, int, int]:
    """One splitmix64 step: ``(next state, uniform int in [0, n), uniform int in [0, m))`` for ``0 < n, m < 2**32``
    (the high and low 32 bits of the output, each scaled by multiply-shift)."""
    state = state + _GOLDEN
    z = state
    z = (z ^ (z >> np.uint64(30))) * _MIX1
    z = (z ^ (z >> np.uint64(27))) * _MIX2
    z = z ^ (z >> np.uint64(31))
    hi = int(((z >> np.uint64(32)) * np.uint64(n)) >> np.uint64(32))
    lo = int(((z & np.uint64(0xFFFFFFFF)) * np.uint64(m)) >> np.uint64(32))
    return state, hi, lo


@njit(cache=True)
def _fill_ids(counts: np.ndarray, k: int, seed: np.uint64, out: np.ndarray) -> bool:
    """Write ids ``out`` ``[S, L, k]`` whose per-layer expert counts are ``counts`` ``[L, E]``; False (and ``out``
    unspecified) unless every count is in ``[0, S]`` and each layer's counts sum to ``S k``.

    Per layer l: the experts, in a random order, are laid out ``counts[l, e]`` times each in a run of ``S k``
    entries, entry ``p`` going to column ``p % S``, slot ``(p // S - rot[c]) % k`` of ``cols[l]`` ``[S, k]`` (each
    column's slots rotated by a random offset); a column holds k distinct experts because no expert's run is longer
    than S. Token t takes column ``pick[l, t]``, a random permutation of the S columns. Randomness: splitmix64 from
    ``seed`` (a Fisher-Yates draw gives the permutation's swap and one rotation); tokens are written in order, each
    copying one contiguous column.
    """
    s, num_layers = out.shape[0], out.shape[1]
    e = counts.shape[1]
    state = seed
    order = np.empty(e, np.int64)
    cols = np.empty((num_layers, s, k), out.dtype)
    pick = np.empty((num_layers, s), np.int32)
    rot = np.empty(s, np.int64)
    run = np.empty(2 * s * k, out.dtype)
    for layer in range(num_layers):
        for a in range(e - 1, -1, -1):
            order[a] = a
        for a in range(e - 1, 0, -1):
            state, b, _ = _split_draw(state, a + 1, 1)
            order[a], order[b] = order[b], order[a]
        for t in range(s):
            pick[layer, t] = t
        for t in range(s - 1, -1, -1):
            state, b, rot[t] = _split_draw(state, t + 1, k)
            pick[layer, t], pick[layer, b] = pick[layer, b], pick[layer, t]
        pos = 0
        for a in range(e):
            c = counts[layer, order[a]]
            if c < 0 or c > s or pos + c > s * k:
                return False
            run[pos:pos + c] = order[a]
            pos += c
        if pos != s * k:
            return False
        run[s * k:] = run[:s * k]  # doubled: a rotated column reads s-strided entries without a wrap
        for col in range(s):
            base = rot[col] * s + col
            for j in range(k):
                cols[layer, col, j] = run[base + j * s]
    for t in range(s):
        for layer in range(num_layers):
            c = pick[layer, t]
            for j in range(k):
                out[t, layer, j] = cols[layer, c, j]
    return True


def _ids_from_counts(counts: np.ndarray, tokens: int, k: int, rng: np.random.Generator, dtype: np.dtype) -> np.ndarray:
    """Per-token ids ``[S, L, k]`` whose expert counts are exactly ``counts`` ``[L, E]`` (shuffled; see
    :func:`_fill_ids`, which draws from one 64-bit seed taken from ``rng``).

    Raises:
        TraceError: counts not in ``[0, S]`` or a layer's counts not summing to ``S k`` (cannot happen for
            counts from :func:`_round_counts`).
    """
    counts = np.ascontiguousarray(counts, dtype=np.int64)
    out = np.empty((int(tokens), counts.shape[0], int(k)), dtype=dtype)
    seed = np.uint64(rng.integers(0, 2**63, dtype=np.int64))
    if not _fill_ids(counts, int(k), seed, out):
        raise TraceError(f"synthetic ids: counts must lie in [0, S={int(tokens)}] and sum to S k = "
                         f"{int(tokens) * int(k)} per layer")
    return out


def domain_sequence(num_blocks: int, seed: int) -> list[str]:
    """Domains of consecutive blocks for ``mixed``: rounds of a seeded permutation of the base domains,
    never the same domain twice in a row."""
    rng = np.random.default_rng(_stable_seed("relibra-synthetic-mixed", seed))
    seq: list[str] = []
    while len(seq) < num_blocks:
        perm = [BASE_DOMAINS[i] for i in rng.permutation(len(BASE_DOMAINS))]
        if seq and perm[0] == seq[-1]:
            perm = perm[1:] + perm[:1]
        seq.extend(perm)
    return seq[:num_blocks]


def _lengths(rng: np.random.Generator, median: np.ndarray, sigma: np.ndarray, lo: int, hi: int) -> np.ndarray:
    return np.clip(np.round(median * np.exp(sigma * rng.standard_normal(median.shape))), lo, hi).astype(np.int64)


def _prompt_domains(domain: str, num_prompts: int, r: int, micro_batch_size: int | None, seed: int) -> np.ndarray:
    """The base domain of each of the ``num_prompts`` prompts (str ``[P]``): ``domain`` itself, or for ``mixed``
    the domain of the block (micro-batch, else ``DEFAULT_BLOCK`` samples) holding the prompt's first response."""
    if domain != "mixed":
        return np.full(num_prompts, domain)
    block = int(micro_batch_size or DEFAULT_BLOCK)
    sample_block = np.arange(num_prompts * r) // block
    seq = np.array(domain_sequence(int(sample_block.max()) + 1, seed))
    return seq[sample_block[::r]]


def _per_prompt(dom_idx: np.ndarray, attr: str) -> np.ndarray:
    """float64 ``[P]``: style attribute ``attr`` of each prompt's base domain (``dom_idx``: index into BASE_DOMAINS)."""
    return np.array([getattr(STYLES[BASE_DOMAINS[i]], attr) for i in dom_idx], dtype=np.float64)


def _routing_counts(spec: ModelSpec, dom_idx: np.ndarray, prompt_len: np.ndarray, resp_len: np.ndarray, r: int,
                    rng: np.random.Generator, profile_seed: int) -> tuple[np.ndarray, np.ndarray]:
    """``rl_batch``'s routing: int64 ``(prompt_counts [P, L, E], resp_counts [P r, L, E])`` tokens per expert of
    each prompt (shared by its group) and each response, drawn from ``rng`` (after the lengths)."""
    num_prompts, num_layers, e, k = len(dom_idx), spec.num_layers, spec.num_experts, spec.top_k
    n = num_prompts * r
    styles = [STYLES[d] for d in BASE_DOMAINS]

    def per_prompt(attr: str) -> np.ndarray:
        return _per_prompt(dom_idx, attr)

    # model popularity + focus x domain component + the prompt's own hot experts and noise
    shared, profiles = _profiles(spec, profile_seed)
    base = np.stack([profiles[d] for d in BASE_DOMAINS])                       # [3, L, E]
    focus = np.exp(per_prompt("focus_sigma") * rng.standard_normal(num_prompts))
    prompt_logits = shared[None] + focus[:, None, None] * base[dom_idx]       # [P, L, E]
    prompt_logits += per_prompt("prompt_sigma")[:, None, None] * rng.standard_normal((num_prompts, num_layers, e))
    n_hot = int(min(max(st.prompt_hot for st in styles), e))
    if n_hot:
        own = np.argpartition(rng.random((num_prompts, num_layers, e)), n_hot - 1, axis=2)[:, :, :n_hot]
        boost = per_prompt("prompt_hot_boost")[:, None, None] * (
            0.5 + 0.5 * rng.random((num_prompts, num_layers, n_hot)))
        boost *= np.arange(n_hot)[None, None, :] < per_prompt("prompt_hot")[:, None, None]
        np.put_along_axis(prompt_logits, own, np.take_along_axis(prompt_logits, own, 2) + boost, axis=2)
    prompt_q = _inclusion_rates(prompt_logits, k)
    prompt_counts = _round_counts(np.broadcast_to(prompt_len[:, None], (num_prompts, num_layers)), prompt_q, k, rng)
    del prompt_q
    resp_logits = np.repeat(prompt_logits, r, axis=0)
    del prompt_logits
    resp_logits += np.repeat(per_prompt("response_sigma_r"), r)[:, None, None] * rng.standard_normal(
        (n, num_layers, e))
    resp_q = _inclusion_rates(resp_logits, k)
    del resp_logits
    resp_counts = _round_counts(np.broadcast_to(resp_len[:, None], (n, num_layers)), resp_q, k, rng)
    del resp_q
    return prompt_counts, resp_counts


def _materializer(seed: int, r: int, prompt_len: np.ndarray, resp_len: np.ndarray, prompt_counts: np.ndarray,
                  resp_counts: np.ndarray, num_layers: int, k: int, dtype: np.dtype) -> Callable[[int], np.ndarray]:
    """``rl_batch``'s per-sample ids on demand: sample i -> ``[T_i, L, k]`` ids of ``dtype`` holding exactly its
    counts (prompt part from the prompt's seed, response part from the sample's)."""

    def materialize(i: int) -> np.ndarray:
        p = i // r
        prompt_rng = np.random.default_rng([_stable_seed("relibra-synthetic-prompt", seed), p])
        resp_rng = np.random.default_rng([_stable_seed("relibra-synthetic-response", seed), i])
        head = int(prompt_len[p])
        out = np.empty((head + int(resp_len[i]), num_layers, k), dtype=dtype)  # filled in place, no concatenation
        for part, c, rg in ((out[:head], prompt_counts[p], prompt_rng), (out[head:], resp_counts[i], resp_rng)):
            if not _fill_ids(c, k, np.uint64(rg.integers(0, 2**63, dtype=np.int64)), part):
                raise TraceError(f"synthetic ids of sample {i}: counts inconsistent with the lengths (report this)")
        return out

    return materialize


def rl_batch(model: ModelSpec | str, domain: str, num_prompts: int, responses_per_prompt: int = 4, seed: int = 0,
             micro_batch_size: int | None = None, *, max_len: int = MAX_LEN, profile_seed: int = 0) -> TraceBatch:
    """A synthetic RL global batch of ``num_prompts * responses_per_prompt`` samples (labelled synthetic).

    Args:
        model: a ModelSpec or preset name (L, E, k come from it).
        domain: ``math``, ``code``, ``instruction`` or ``mixed``.
        num_prompts: prompts P.
        responses_per_prompt: responses R per prompt (GRPO group size).
        seed: seed of the prompts, lengths and routing (same seed, same batch).
        micro_batch_size: if given, sample i goes to micro-batch ``i // micro_batch_size``, and
            ``mixed`` switches domain every micro-batch; otherwise no assignment and ``mixed`` switches
            every 32 samples.
        max_len: cap on a sample's tokens (prompt + response).
        profile_seed: seed of the model's per-domain hot-expert profiles (fixed by default, so batches
            with different seeds come from the same "model").

    Returns:
        A count-built TraceBatch (per-token ids materialized on demand); ``sample_info`` has
        ``domain``, ``prompt``, ``response``, ``prompt_tokens`` per sample; ``starts`` are 0.
    """
    spec = _model(model)
    if domain not in DOMAINS:
        raise TraceError(f"unknown synthetic domain {domain!r}; known: {list(DOMAINS)}")
    num_prompts = positive_int("num_prompts", num_prompts)
    r = positive_int("responses_per_prompt", responses_per_prompt)
    if micro_batch_size is not None:
        micro_batch_size = positive_int("micro_batch_size", micro_batch_size)
    check_count("max_len", max_len, 2, error=TraceError)
    n = num_prompts * r
    num_layers, e, k = spec.num_layers, spec.num_experts, spec.top_k
    rng = np.random.default_rng(_stable_seed("relibra-synthetic-batch", seed))

    prompt_domain = _prompt_domains(domain, num_prompts, r, micro_batch_size, seed)
    dom_idx = np.array([BASE_DOMAINS.index(d) for d in prompt_domain])

    def per_prompt(attr: str) -> np.ndarray:
        return _per_prompt(dom_idx, attr)

    # lengths: prompt tokens shared by the group, responses long-tailed (log-normal, capped)
    prompt_len = _lengths(rng, per_prompt("prompt_median"), np.full(num_prompts, 0.5), 8, max_len // 2)
    group_median = per_prompt("response_median") * np.exp(per_prompt("group_sigma") * rng.standard_normal(num_prompts))
    resp_len = _lengths(rng, np.repeat(group_median, r), np.repeat(per_prompt("response_sigma"), r), 1,
                        max_len)
    resp_len = np.minimum(resp_len, max_len - np.repeat(prompt_len, r))

    prompt_counts, resp_counts = _routing_counts(spec, dom_idx, prompt_len, resp_len, r, rng, profile_seed)
    counts = resp_counts + np.repeat(prompt_counts, r, axis=0)

    prompt_len_rep = np.repeat(prompt_len, r)
    materialize = _materializer(seed, r, prompt_len, resp_len, prompt_counts, resp_counts, num_layers, k,
                                ids_dtype(e))
    micro_batch = None if micro_batch_size is None else (np.arange(n) // int(micro_batch_size)).astype(np.int32)
    source = (f"synthetic RL batch (relibra_moe.synthetic, not real routing): model {spec.name}, domain {domain}, "
              f"{num_prompts} prompts x {r} responses, seed {seed}")
    info = {
        "domain": np.repeat(prompt_domain, r),
        "prompt": np.repeat(np.arange(num_prompts, dtype=np.int64), r),
        "response": np.tile(np.arange(r, dtype=np.int64), num_prompts),
        "prompt_tokens": prompt_len_rep,
    }
    return TraceBatch.from_counts(counts, k, np.arange(num_layers, dtype=np.int32), materialize=materialize,
                                  micro_batch=micro_batch, source=source, sample_info=info)
