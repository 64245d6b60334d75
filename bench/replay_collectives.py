"""Collectives per micro-batch of a replayed stack of MoE layers on 2 gloo ranks with a replica plan.

``--layers`` ``ReplayBalancedMoE`` layers (hidden 64, 8 experts, top-2, one replica slot per rank, the hot expert
of every layer replicated on its home's partner: ``layers.testing.hot_replica_plan``), 64 tokens per rank. One
micro-batch is run inside ``replay(model, ids, plan, micro_batch=0)`` (entry, forward, backward) while every
``torch.distributed.all_to_all_single`` call is counted, by where it came from: the agreement exchanges
(``exchange``), the token all-to-alls (forward and backward), and the replica weight / gradient traffic.

    python bench/replay_collectives.py --out bench/results/replay_collectives_cpu.json
"""

from __future__ import annotations

import argparse
import json
import tempfile
import traceback
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from relibra_moe.atomic import write_text
from relibra_moe.layers.moe import ReplayBalancedMoE
from relibra_moe.layers.relayout import relayout
from relibra_moe.layers.replay import replay
from relibra_moe.layers.replica_buffer import LayerSharedReplicaBuffer
from relibra_moe.layers.testing import hot_replica_plan, run_group


def _kind() -> str:
    names = [f.name for f in traceback.extract_stack()]
    if "exchange" in names:
        return "agreement"
    if "replica_exchange" in names:
        return "replica weights and gradients"
    return "token all-to-all"


def _worker(rank: int, world: int, layers: int, out_dir: str) -> None:
    E, H = 8, 64
    torch.manual_seed(0)
    buf = LayerSharedReplicaBuffer(H, 2 * H, 1)
    model = torch.nn.ModuleList([ReplayBalancedMoE(H, 2 * H, E, 2, layer_index=i, replica_buffer=buf)
                                 for i in range(layers)])
    plan = hot_replica_plan(layers, E, 2, 2, np.zeros(layers, np.int64), seed=1)
    relayout(model, plan.placement)
    x = torch.randn(64, H, requires_grad=True)
    ids = [torch.stack([torch.randperm(E)[:2] for _ in range(64)]) for _ in range(layers)]
    counts: dict[str, int] = {}
    orig = dist.all_to_all_single

    def counted(*args, **kwargs):
        kind = _kind()
        counts[kind] = counts.get(kind, 0) + 1
        return orig(*args, **kwargs)

    dist.all_to_all_single = counted
    try:
        with replay(model, ids, plan, micro_batch=0):
            h = x
            for layer in model:
                h = h + layer(h)
        h.square().sum().backward()
    finally:
        dist.all_to_all_single = orig
    write_text(Path(out_dir, f"rank{rank}.json"), json.dumps(counts))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--out", type=Path, default=Path("bench/results/replay_collectives_cpu.json"))
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        run_group(_worker, 2, args.layers, tmp)
        counts = json.loads(Path(tmp, "rank0.json").read_text())
    report = {"layers": args.layers, "collectives_per_micro_batch": counts, "total": sum(counts.values())}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_text(args.out, json.dumps(report, indent=1))
    print(json.dumps(report))


if __name__ == "__main__":
    main()
