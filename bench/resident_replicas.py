"""Replica traffic of one batch, per-layer mode against resident mode, on 2 gloo ranks (issue 27).

``--layers`` ``ReplayBalancedMoE`` layers (hidden 64, FFN 128, 8 experts, top-2, one replica slot per rank, the
hot expert of every layer replicated on its home's partner: ``layers.testing.hot_replica_plan``), 64 tokens per rank
and micro-batch, ``--micro-batches`` M micro-batches, each forward inside ``replay`` and its backward right after.
The same replicas run twice: as one resident plan of M micro-batches (``ReplicaPlan.resident``: each layer's own
slots, filled once, gradients returned once) and as M one-micro-batch plans (the per-layer mode: the layer-shared
buffer filled per layer and micro-batch, refilled in backward, gradients returned per micro-batch). Counted on
rank 0: the replica collectives (``Dispatcher.replica_exchange`` calls) and the bytes this rank sent in them,
and the batch's wall time (median of ``--repeats`` batches after one warm-up batch; CPU, gloo: not a GPU figure).

    python bench/resident_replicas.py --out bench/results/resident_replicas_cpu.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from relibra_moe.atomic import write_text
from relibra_moe.layers.dispatch import AllToAllDispatcher
from relibra_moe.layers.moe import ReplayBalancedMoE
from relibra_moe.layers.relayout import relayout
from relibra_moe.layers.replay import replay
from relibra_moe.layers.replica_buffer import LayerSharedReplicaBuffer
from relibra_moe.layers.testing import hot_replica_plan, run_group
from relibra_moe.plan import ReplicaPlan

E, H, T = 8, 64, 64


def resident_and_split(layers: int, micro_batches: int) -> tuple[ReplicaPlan, list[ReplicaPlan], object]:
    """The hot-expert plan as one resident plan of M micro-batches and as M one-micro-batch plans; the placement."""
    one = hot_replica_plan(layers, E, 2, 2, np.zeros(layers, np.int64), seed=1)
    rep = one.replicas
    idx = np.concatenate([rep.split_index + [m, 0, 0, 0, 0] for m in range(micro_batches)])
    resident = ReplicaPlan(np.repeat(rep.replica_expert, micro_batches, axis=0), idx,
                           np.tile(rep.split_share, micro_batches), rep.scope)
    assert resident.resident
    return resident, [rep] * micro_batches, one.placement


def _batch(model, data, plan_of) -> float:
    t0 = time.perf_counter()
    for m, (x, ids) in enumerate(data):
        plan, mb = plan_of(m)
        xr = x.clone().requires_grad_()
        with replay(model, ids, plan, micro_batch=mb):
            h = xr
            for layer in model:
                h = h + layer(h)
        h.square().sum().backward()
    return time.perf_counter() - t0


def _fills(model, buf: LayerSharedReplicaBuffer) -> tuple[int, int]:
    """Fills of the shared buffer, and of the layers' own (resident) slots summed over the layers."""
    own = [lay.resident_replicas.buffer for lay in model]
    return buf.fills, sum(b.fills for b in own if b is not None)


def _worker(rank: int, world: int, layers: int, micro_batches: int, repeats: int, out_dir: str) -> None:
    torch.manual_seed(0)
    buf = LayerSharedReplicaBuffer(H, 2 * H, 1)
    model = torch.nn.ModuleList([ReplayBalancedMoE(H, 2 * H, E, 2, layer_index=i, replica_buffer=buf)
                                 for i in range(layers)])
    resident, split, placement = resident_and_split(layers, micro_batches)
    relayout(model, placement)
    torch.manual_seed(1 + rank)
    data = [(torch.randn(T, H), [torch.stack([torch.randperm(E)[:2] for _ in range(T)]) for _ in range(layers)])
            for _ in range(micro_batches)]
    counts = {"calls": 0, "bytes": 0}
    orig = AllToAllDispatcher.replica_exchange

    def counted(self, x, send_splits, recv_splits, intra_node):
        counts["calls"] += 1
        counts["bytes"] += x.numel() * x.element_size()
        return orig(self, x, send_splits, recv_splits, intra_node)

    AllToAllDispatcher.replica_exchange = counted
    modes = {"per-layer": lambda m: (split[m], 0), "resident": lambda m: (resident, m)}
    report = {}
    try:
        for name, plan_of in modes.items():
            _batch(model, data, plan_of)  # warm-up
            counts.update(calls=0, bytes=0)
            fills = _fills(model, buf)
            _batch(model, data, plan_of)
            after = _fills(model, buf)
            report[name] = {"replica_collectives_per_batch": counts["calls"],
                            "replica_bytes_sent_per_batch": counts["bytes"],
                            "shared_buffer_fills_per_batch": after[0] - fills[0],
                            "own_slot_fills_per_batch": after[1] - fills[1]}
        seconds = {name: [] for name in modes}
        for _ in range(repeats):  # the modes alternate: a busy box slows both alike
            for name, plan_of in modes.items():
                seconds[name].append(_batch(model, data, plan_of))
        for name in modes:
            report[name]["batch_seconds_median"] = round(statistics.median(seconds[name]), 4)
    finally:
        AllToAllDispatcher.replica_exchange = orig
    write_text(Path(out_dir, f"rank{rank}.json"), json.dumps(report))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--micro-batches", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--out", type=Path, default=Path("bench/results/resident_replicas_cpu.json"))
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        run_group(_worker, 2, args.layers, args.micro_batches, args.repeats, tmp, timeout_s=300)
        rank0 = json.loads(Path(tmp, "rank0.json").read_text())
    report = {"layers": args.layers, "micro_batches": args.micro_batches, "tokens_per_rank": T, "hidden": H,
              "ffn": 2 * H, "experts": E, "device": "CPU, 2 cores, 2 gloo ranks", "date": "2026-12-02", **rank0}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_text(args.out, json.dumps(report, indent=1))
    print(json.dumps(report))


if __name__ == "__main__":
    main()
