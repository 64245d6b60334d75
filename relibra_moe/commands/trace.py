"""``relibra trace import|synth|stats``: make trace files from real or synthetic routing, and summarize them.

- ``relibra trace import gpt-oss [--requests N --seed S --micro-batch-size B] --out FILE``: the real
  GPT-OSS-20B routing of ``../shared/traces``; N requests drawn with seed S, kept in the drawn order;
  with B, micro-batch i holds samples ``i*B .. i*B+B-1``.
- ``relibra trace import FORMAT FILE ... [--model M | --model-config config.json | --num-experts E] --out FILE``:
  your own routing dump (verl, slime, nemo-rl, vllm, sglang, megatron, npz; :mod:`relibra_moe.dumps`).
- ``relibra trace synth --model PRESET --domain D --prompts N --seed S [--micro-batch-size B] [--counts-only]
  --out FILE``: a SYNTHETIC RL batch (``relibra_moe.synthetic``); B defaults to 32, the paper's micro-batch
  size. ``--counts-only`` writes the per-sample expert counts without per-token ids (the file says so in
  its ``counts_only`` field): enough to plan, score and simulate, not to replay.
- ``relibra trace stats FILE [--micro-batch-size B] [--json]``: sizes, expert skew per micro-batch and
  the hot-set intersection between consecutive micro-batches (top-8, or top-E/4 when E < 32).
  Micro-batches: ``--micro-batch-size`` if given, else the file's assignment, else one sequence each.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import TraceError
from .plan import add_model_args, model_from_args

if TYPE_CHECKING:
    from ..trace import TraceBatch

SYNTH_DEFAULT_MICRO_BATCH = 32


def _positive(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if v <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {v}")
    return v


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``relibra trace {import,synth,stats}`` to the ``relibra`` parser."""
    p = subparsers.add_parser(
        "trace", help="routing traces: import real ones, synthesize RL batches, statistics",
        description="Make routing-trace files (.npz, version 2) from real or synthetic routing, and summarize them.",
        epilog="examples:\n"
               "  relibra trace import gpt-oss --requests 64 --seed 0 --micro-batch-size 8 --out gptoss.npz\n"
               "  relibra trace import verl step3.pkl --model-config config.json --micro-batch-size 8 --out mine.npz\n"
               "  relibra trace synth --model qwen3-30b-a3b --domain mixed --prompts 256 --out mixed.npz\n"
               "  relibra trace synth --model qwen3-235b-a22b --domain mixed --prompts 256 --counts-only --out b.npz\n"
               "  relibra trace stats mixed.npz --json",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="trace_command", metavar="ACTION", required=True)

    from ..dumps import FORMATS

    imp = sub.add_parser("import", help="import real routing (the bundled GPT-OSS trace, or your own dump)",
                         description="Import real routing into a relibra trace file (.npz, version 2): the bundled "
                                     "GPT-OSS-20B trace, or dump files of verl, slime, NeMo-RL, vLLM (SkyRL), SGLang, "
                                     "Megatron RouterReplay, or a plain ids + offsets .npz (docs/rl-frameworks.md).")
    imp.add_argument("format", choices=["gpt-oss", *FORMATS],
                     help="gpt-oss: GPT-OSS-20B decode routing of ../shared/traces; the others: dump files FILE ...")
    imp.add_argument("files", nargs="*", metavar="FILE", help="dump file(s) of the format (not for gpt-oss)")
    imp.add_argument("--requests", type=_positive, default=None, metavar="N",
                     help="gpt-oss: draw N requests without replacement, kept in the drawn order (default: all 703)")
    imp.add_argument("--seed", type=int, default=0, metavar="S", help="gpt-oss: seed of the draw (default 0)")
    imp.add_argument("--micro-batch-size", type=_positive, default=None, metavar="B",
                     help="micro-batch i holds samples i*B .. i*B+B-1, in order (default: no assignment)")
    imp.add_argument("--domains", nargs="+", default=None, help="gpt-oss: keep only these request domains")
    imp.add_argument("--drop-repetition", action="store_true",
                     help="gpt-oss: drop requests stuck in a repetition loop")
    g = imp.add_mutually_exclusive_group()
    g.add_argument("--model", default=None, help="dumps: model preset giving E and k (and checking L)")
    g.add_argument("--model-config", default=None, metavar="CONFIG.json",
                   help="dumps: the model's HF config.json giving E and k (and checking L)")
    imp.add_argument("--num-experts", type=_positive, default=None, metavar="E",
                     help="dumps: routed experts per layer (default: from --model / --model-config)")
    imp.add_argument("--top-k", type=_positive, default=None, metavar="K", help="sglang: ids per token")
    imp.add_argument("--num-layers", type=_positive, default=None, metavar="L",
                     help="sglang: decoder layers the payload covers, dense ones included")
    imp.add_argument("--dense-layers", type=int, nargs="+", default=(), metavar="I",
                     help="sglang, slime: decoder indices of dense layers in the dump (dropped)")
    imp.add_argument("--trust-pickle", action="store_true",
                     help="dumps: also read pickles that name classes outside the allow-list (tensors, numpy arrays, "
                          "containers, verl's DataProto / TensorDict, NeMo-RL's BatchedDataDict) by running their "
                          "code. Without it no code from a file runs. Only for dumps you wrote yourself")
    imp.add_argument("--out", required=True, help="output .npz file")
    imp.set_defaults(func=run_import)

    syn = sub.add_parser("synth", help="write a synthetic RL batch (labelled synthetic)",
                         description="Write a SYNTHETIC RL global batch (GRPO groups, domain hot sets, long-tailed "
                                     "lengths) as a trace file. Not real routing.")
    add_model_args(syn)
    syn.add_argument("--domain", required=True, choices=["math", "code", "instruction", "mixed"])
    syn.add_argument("--prompts", type=_positive, required=True, help="prompts N (samples = N x responses)")
    syn.add_argument("--responses", type=_positive, default=4, help="responses per prompt (default 4)")
    syn.add_argument("--seed", type=int, default=0, help="seed (default 0)")
    syn.add_argument("--micro-batch-size", type=_positive, default=SYNTH_DEFAULT_MICRO_BATCH, metavar="B",
                     help=f"micro-batch i holds samples i*B .. i*B+B-1 (default {SYNTH_DEFAULT_MICRO_BATCH})")
    syn.add_argument("--compress", action="store_true", help="zip-compress the file (smaller, slower)")
    syn.add_argument("--counts-only", action="store_true",
                     help="write per-sample expert counts only, no per-token ids (the file says so): plans, scores "
                          "and simulates, but cannot be replayed")
    syn.add_argument("--out", required=True, help="output .npz file")
    syn.set_defaults(func=run_synth)

    st = sub.add_parser("stats", help="statistics of a trace file",
                        description="Sizes, per-micro-batch expert skew (max / mean expert load, averaged over "
                                    "layers) and the top-k hot-set intersection between consecutive micro-batches.")
    st.add_argument("file", help="trace file (.npz)")
    st.add_argument("--micro-batch-size", type=_positive, default=None, metavar="B",
                    help="micro-batch i holds samples i*B .. i*B+B-1 (default: the file's assignment, else one "
                         "sequence per micro-batch)")
    st.add_argument("--hot-k", type=_positive, default=None, metavar="K",
                    help="hot-set size (default 8, or E/4 when E < 32)")
    st.add_argument("--json", action="store_true",
                    help="print JSON (num_sequences, num_tokens, num_layers, num_experts, topk, skew_mean, "
                         "intersection_mean, ...; null where undefined) instead of a table")
    st.set_defaults(func=run_stats)


def run_import(args: argparse.Namespace) -> int:
    """``relibra trace import``: write the real GPT-OSS routing (drawn, filtered), or the routing of the dump files
    ``args.files`` in ``args.format`` (:func:`relibra_moe.dumps.read_dump`), to ``args.out``; returns 0."""
    if args.format == "gpt-oss":
        if args.files:
            raise TraceError(f"trace import gpt-oss reads the bundled trace and takes no FILE (got {args.files})")
        from ..datasets import gpt_oss_batch

        batch = gpt_oss_batch(num_requests=args.requests, seed=args.seed, domains=args.domains,
                              drop_repetition=args.drop_repetition)
    else:
        batch = import_dump(args)
    if args.micro_batch_size:
        batch = batch.with_micro_batch_size(args.micro_batch_size)
    batch.save(args.out)
    print(f"wrote {args.out}: {batch.num_sequences} sequences, {batch.num_tokens} tokens, {batch.num_layers} MoE "
          f"layers, {batch.num_experts} experts, top-{batch.top_k} ({batch.source})")
    return 0


def import_dump(args: argparse.Namespace) -> TraceBatch:
    """The TraceBatch of ``relibra trace import FORMAT FILE ...`` (not gpt-oss); E and k from ``--num-experts`` /
    ``--top-k`` or the model, whose L, E and k the routing must match (TraceError naming the field)."""
    from ..dumps import read_dump

    for flag, value in (("--requests", args.requests), ("--domains", args.domains),
                        ("--drop-repetition", args.drop_repetition or None)):
        if value is not None:
            raise TraceError(f"{flag} only applies to trace import gpt-oss, not {args.format}")
    model = model_from_args(args) if (args.model or args.model_config) else None
    E = args.num_experts if args.num_experts is not None else (model.num_experts if model else None)
    k = args.top_k if args.top_k is not None else (model.top_k if model else None)
    batch = read_dump(args.format, args.files, num_experts=E, top_k=k, num_layers=args.num_layers,
                      dense_layers=args.dense_layers, trust_pickle=args.trust_pickle)
    if model is not None:
        for field, have, want in (("MoE layers", batch.num_layers, model.num_layers),
                                  ("num_experts", batch.num_experts, model.num_experts),
                                  ("top_k", batch.top_k, model.top_k)):
            if have != want:
                raise TraceError(f"the dump ({', '.join(map(str, args.files))}) has {field}={have}, model {model.name} "
                                 f"has {want}")
    return batch


def run_synth(args: argparse.Namespace) -> int:
    """``relibra trace synth``: write a SYNTHETIC RL batch to ``args.out``; returns 0."""
    from ..synthetic import rl_batch

    t0 = time.perf_counter()
    batch = rl_batch(model_from_args(args), args.domain, args.prompts, responses_per_prompt=args.responses,
                     seed=args.seed, micro_batch_size=args.micro_batch_size)
    batch.save(args.out, compress=args.compress, counts_only=args.counts_only)
    what = "counts only (no per-token ids)" if args.counts_only else "with per-token ids"
    print(f"wrote {args.out}: SYNTHETIC, {batch.num_sequences} sequences, {batch.num_tokens} tokens, {what}, "
          f"{time.perf_counter() - t0:.1f} s ({batch.source})")
    return 0


def trace_stats(batch: TraceBatch, micro_batch_size: int | None = None, hot_k: int | None = None) -> dict[str, Any]:
    """The statistics ``relibra trace stats --json`` prints, for a TraceBatch.

    Micro-batches: ``micro_batch_size`` if given (sample i in micro-batch ``i // B``); else the batch's
    assignment (which must then cover every sample); else one sequence per micro-batch.

    Returns:
        A JSON-ready dict: sizes (``num_sequences``, ``num_tokens``, ``num_layers``, ``num_experts``,
        ``topk`` (k; this key keeps its spelling so saved output stays comparable), ``num_micro_batches``,
        ``tokens_per_sequence``), ``skew_mean`` / ``skew_min`` / ``skew_max`` (dimensionless, over
        micro-batches of the layer-mean expert skew; None when no micro-batch has a routed token), ``hot_k``,
        ``intersection_mean`` (None with one micro-batch), ``synthetic`` and ``source``.

    Raises:
        TraceError: a partial micro-batch assignment in the file, or ``hot_k`` > E.
    """
    from ..metrics import default_hot_k, hot_set_intersection, micro_batch_skew

    if micro_batch_size is not None:
        mb, rule = np.arange(batch.num_sequences) // int(micro_batch_size), f"{int(micro_batch_size)} per micro-batch"
    elif batch.micro_batch is not None and (batch.micro_batch >= 0).any():
        if (batch.micro_batch < 0).any():
            i = int(np.flatnonzero(batch.micro_batch < 0)[0])
            raise TraceError(f"the file assigns some samples to micro-batches but not sample {i} (micro_batch -1); "
                             "pass --micro-batch-size")
        mb, rule = batch.micro_batch.astype(np.int64), "file's assignment"
    else:
        mb, rule = np.arange(batch.num_sequences), "one sequence per micro-batch"
    counts = batch.micro_batch_expert_counts(mb)
    k = default_hot_k(batch.num_experts) if hot_k is None else int(hot_k)
    if k > batch.num_experts:
        raise TraceError(f"--hot-k {k} exceeds num_experts={batch.num_experts}")
    _, skew = micro_batch_skew(counts)
    inter = hot_set_intersection(counts, k) if counts.shape[0] >= 2 else None
    lengths = batch.lengths
    defined = skew[np.isfinite(skew)]  # a micro-batch with no routed token has no skew

    def stat(fn: Any) -> float | None:
        return float(fn(defined)) if defined.size else None

    return {
        "num_sequences": batch.num_sequences,
        "num_tokens": batch.num_tokens,
        "num_layers": batch.num_layers,
        "num_experts": batch.num_experts,
        "topk": batch.top_k,
        "num_micro_batches": int(counts.shape[0]),
        "micro_batch_rule": rule,
        "tokens_per_sequence": {"min": int(lengths.min()), "mean": float(lengths.mean()),
                                "max": int(lengths.max())},
        "skew_mean": stat(np.mean),
        "skew_min": stat(np.min),
        "skew_max": stat(np.max),
        "hot_k": k,
        "intersection_mean": float(inter.mean()) if inter is not None else None,
        "synthetic": "synthetic" in batch.source.lower(),
        "source": batch.source,
    }


def _fmt(v: float | None) -> str:
    return "n/a (no routed tokens)" if v is None else f"{v:.3f}"


def run_stats(args: argparse.Namespace) -> int:
    """``relibra trace stats``: print :func:`trace_stats` of ``args.file`` as a table or JSON; returns 0."""
    from ..trace import TraceBatch

    stats = trace_stats(TraceBatch.load(args.file), args.micro_batch_size, args.hot_k)
    if args.json:
        print(json.dumps(stats, indent=2))
        return 0
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"{args.file}" + (" (SYNTHETIC)" if stats["synthetic"] else ""))
    table.add_column("statistic")
    table.add_column("value", justify="right")
    lens = stats["tokens_per_sequence"]
    rows = [
        ("sequences", f"{stats['num_sequences']}"),
        ("tokens", f"{stats['num_tokens']}"),
        ("tokens / sequence (min / mean / max)", f"{lens['min']} / {lens['mean']:.0f} / {lens['max']}"),
        ("MoE layers / experts / top-k", f"{stats['num_layers']} / {stats['num_experts']} / {stats['topk']}"),
        ("micro-batches", f"{stats['num_micro_batches']} ({stats['micro_batch_rule']})"),
        ("expert skew per micro-batch (mean)", _fmt(stats["skew_mean"])),
        ("expert skew (min / max)", f"{_fmt(stats['skew_min'])} / {_fmt(stats['skew_max'])}"),
        (f"top-{stats['hot_k']} intersection, consecutive (mean)",
         "n/a (one micro-batch)" if stats["intersection_mean"] is None else f"{stats['intersection_mean']:.3f}"),
    ]
    for name, value in rows:
        table.add_row(name, value)
    console = Console()
    console.print(table)
    console.print(f"source: {stats['source']}", soft_wrap=True)
    return 0
