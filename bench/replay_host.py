"""Host cost of the replayed layer: device-to-host syncs and host time per MoE layer pass, against the plain
Hugging Face block, on a tiny Qwen3-MoE (one process, CPU).

The model: ``tiny_model("qwen3_moe")`` with hidden 64, 8 experts, top-2, 8 MoE layers; one micro-batch of
64 tokens. The plain side runs each HF ``Qwen3MoeSparseMoeBlock`` on the tokens (forward, then backward of
``(y * dy).sum()``); the replayed side runs the same blocks after ``swap_moe_blocks`` inside
``replay(model, ids)`` with the ids the plain blocks chose. Reported:

- ``syncs_per_layer``: what :class:`relibra_moe.layers.testing.SyncCounter` counts in one layer's forward
  and in its backward (aten ``_local_scalar_dense`` / ``nonzero`` / data-dependent ops, ``Tensor.item`` /
  ``tolist`` / ``numpy`` / ``cpu`` / ``__bool__`` / ``__int__``), for both sides;
- ``host_ms_per_layer``: median CPU time of the calling thread (``time.thread_time``, so a shared box's
  other load does not count) of one layer's forward + backward (on CPU the host time is the whole time),
  both sides interleaved, and their ratio (the goal is <= 1.2x);
- ``entry_ms``: the CPU time of entering ``replay`` for the micro-batch (building, checking and uploading the
  schedule of every layer; with traces and a plan it runs one micro-batch ahead in a background thread),
  and that time per layer.

    python bench/replay_host.py --out bench/results/replay_host_cpu.json

The torch reference kernels run (``TRITON_INTERPRET`` unset); set ``--threads`` to pin intra-op threads.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time
from pathlib import Path

import torch
from common import environment

from relibra_moe.atomic import write_text
from relibra_moe.integrations.hf import moe_blocks, swap_moe_blocks
from relibra_moe.integrations.hf_tiny import tiny_model
from relibra_moe.layers.replay import replay
from relibra_moe.layers.testing import SyncCounter


def _blocks(model) -> list:
    return [b for _, _, b in moe_blocks(model)]


def _call(block, x: torch.Tensor) -> torch.Tensor:
    """The block on ``x [T, H]`` as one sequence ``[1, T, H]`` (HF blocks read batch and sequence)."""
    out = block(x[None])
    return (out[0] if isinstance(out, tuple) else out)[0]


def _pass(block, x: torch.Tensor, dy: torch.Tensor) -> None:
    (_call(block, x) * dy).sum().backward()


def _syncs(blocks, x, dy) -> dict:
    fwd, bwd = SyncCounter(), SyncCounter()
    for b in blocks:
        with fwd:
            out = _call(b, x)
        with bwd:
            (out * dy).sum().backward()
    n = len(blocks)
    return {"forward": {k: v / n for k, v in fwd.counts.items()}, "backward": {k: v / n for k, v in bwd.counts.items()},
            "forward_total": fwd.total / n, "backward_total": bwd.total / n}


def _time(sides: dict, x, dy, iters: int) -> dict[str, float]:
    """Median CPU time of this thread (``time.thread_time``: the box may be shared, time spent descheduled does
    not count) of one layer pass per side, the sides interleaved pass by pass; ``sides``: name -> (blocks,
    context factory)."""
    samples: dict[str, list[float]] = {name: [] for name in sides}
    for it in range(iters + 1):  # the first round warms up
        for name, (blocks, ctx) in sides.items():
            with ctx():
                t0 = time.thread_time()
                for b in blocks:
                    _pass(b, x, dy)
                dt = (time.thread_time() - t0) * 1e3 / len(blocks)
            if it:
                samples[name].append(dt)
    return {name: statistics.median(v) for name, v in samples.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=Path, default=Path("bench/results/replay_host_cpu.json"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    kw = dict(num_layers=args.layers, num_experts=args.experts, top_k=args.top_k, hidden_size=args.hidden,
              num_attention_heads=4, mlp_only_layers=[])
    plain = tiny_model("qwen3_moe", **kw).train()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(args.tokens, args.hidden, generator=g, requires_grad=True)
    dy = torch.randn(args.tokens, args.hidden, generator=g)
    ids = []
    for b in _blocks(plain):
        with torch.no_grad():
            ids.append(b.gate(x)[2].clone())  # Qwen3MoeTopKRouter -> (logits, gates, ids)
    swapped = swap_moe_blocks(tiny_model("qwen3_moe", **kw)).train()
    report = {"config": vars(args) | {"out": str(args.out)}, "environment": environment()}
    report["syncs_per_layer"] = {"plain_hf": _syncs(_blocks(plain), x, dy)}
    entry = []
    for _ in range(5):
        t0 = time.thread_time()
        with replay(swapped, ids):
            entry.append((time.thread_time() - t0) * 1e3)
    with replay(swapped, ids):
        report["syncs_per_layer"]["replayed"] = _syncs(_blocks(swapped), x, dy)
    report["host_ms_per_layer"] = _time({"plain_hf": (_blocks(plain), contextlib.nullcontext),
                                         "replayed": (_blocks(swapped), lambda: replay(swapped, ids))},
                                        x, dy, args.iters)
    ms = report["host_ms_per_layer"]
    ms["ratio"] = ms["replayed"] / ms["plain_hf"]
    report["entry_ms"] = {"per_micro_batch": statistics.median(entry),
                          "per_layer": statistics.median(entry) / args.layers}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_text(args.out, json.dumps(report, indent=1))
    s = report["syncs_per_layer"]
    print(f"syncs per layer fwd/bwd: replayed {s['replayed']['forward_total']:.1f} / "
          f"{s['replayed']['backward_total']:.1f}, plain HF {s['plain_hf']['forward_total']:.1f} / "
          f"{s['plain_hf']['backward_total']:.1f}")
    print(f"  replayed forward: {s['replayed']['forward']}")
    print(f"  replayed backward: {s['replayed']['backward']}")
    print(f"host ms per layer fwd+bwd: replayed {ms['replayed']:.3f}, plain HF {ms['plain_hf']:.3f} "
          f"({ms['ratio']:.2f}x); replay entry {report['entry_ms']['per_micro_batch']:.3f} ms per micro-batch")


if __name__ == "__main__":
    main()
