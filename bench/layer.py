"""Layer benchmark: forward + backward time per micro-batch of a stack of MoE layers on an EP group,
the plain EP layer (static placement, no replicas) against the replay-balanced layer following a
real ReLibra plan, on real GPT-OSS-20B routing.

The routing of ``--requests`` real requests (first ``--tokens`` tokens of each, ``--layers`` MoE
layers spread over the model's 24) is planned three times with
``relibra_moe.planners.strategies.plan_batch``: ``static`` (Megatron placement, round-robin
samples: the plain EP layer), ``relibra-inter`` (reorder + locality, no replicas) and ``relibra``
(reorder + locality + r replica slots per rank). Each plan runs on ``--world`` spawned ranks (gloo
on CPU; NCCL with one GPU per rank when CUDA has enough devices): ``relayout`` to the plan's
placement, then every micro-batch is replayed (``replay``) and timed (barrier, forward,
backward, barrier; the slowest rank counts). Reported per strategy: mean ms per micro-batch, the
max/mean of the per-rank expert loads the layers actually saw (next to the plan's own figure), and
the plan's exact T_MoE per micro-batch from the cost model (hopper-rail constants) for reference.

    python bench/layer.py                                  # CPU/gloo, 4 ranks (2 nodes x 2)
    python bench/layer.py --world 8 --gpus-per-node 4 --hidden 512 --ffn 1024

Prints a table and writes JSON (``--out``, default ``bench/results/layer_<device>.json``).
CPU timings are dominated by process scheduling when the machine is shared; treat them as a
functional run, and take throughput figures from CUDA/NCCL.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from relibra_moe.layers.moe import ReplayBalancedMoE
from relibra_moe.layers.relayout import relayout
from relibra_moe.layers.replay import replay
from relibra_moe.layers.replica_buffer import LayerSharedReplicaBuffer
from relibra_moe.layers.testing import run_group
from relibra_moe.triton_kernels.backend import force_backend


def _worker(rank: int, world: int, cfg: dict, plan, sample_ids: list[np.ndarray], out_dir: str) -> None:
    dev = torch.device(f"cuda:{torch.cuda.current_device()}") if cfg["backend"] == "nccl" else torch.device("cpu")
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    H, Fh, E, k, L, r = cfg["hidden"], cfg["ffn"], cfg["experts"], cfg["top_k"], cfg["layers"], plan.replica_slots
    torch.manual_seed(0)
    buf = LayerSharedReplicaBuffer(H, Fh, r, dtype=dtype, device=dev) if r else None
    model = torch.nn.ModuleList([ReplayBalancedMoE(H, Fh, E, k, gpus_per_node=cfg["gpus_per_node"],
                                                   replica_buffer=buf, dtype=dtype, device=dev)
                                 for _ in range(L)])
    relayout(model, plan.placement)
    use_plan = plan if cfg["follow_plan"] else None
    times, loads = [], []
    backend = "torch" if dev.type == "cpu" else None
    with force_backend(backend):
        for it in range(cfg["warmup"] + cfg["iters"]):
            for m in range(plan.num_micro_batches):
                mine = [n for n in range(len(sample_ids))
                        if plan.samples.micro_batch[n] == m and plan.samples.gpu[n] == rank]
                T = sum(len(sample_ids[n]) for n in mine)
                ids = [torch.as_tensor(np.concatenate([sample_ids[n][:, l] for n in mine]) if mine
                                       else np.zeros((0, k), np.int64), device=dev) for l in range(L)]
                x = torch.randn(T, H, device=dev, dtype=dtype, requires_grad=True)
                dist.barrier()
                if dev.type == "cuda":
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                with replay(model, ids, plan=use_plan, micro_batch=m):
                    h = x
                    for layer in model:
                        h = h + layer(h)
                h.float().square().mean().backward()
                if dev.type == "cuda":
                    torch.cuda.synchronize()
                dt = time.perf_counter() - t0
                t = torch.tensor([dt], dtype=torch.float64)
                dist.all_reduce(t, op=dist.ReduceOp.MAX)
                if it >= cfg["warmup"]:
                    times.append(float(t))
                    loads.append([layer.last_load for layer in model])
                model.zero_grad(set_to_none=True)
    all_loads = [None] * world
    dist.all_gather_object(all_loads, loads)
    if rank == 0:
        lo = np.array(all_loads, dtype=np.float64)  # [G, samples, L]
        skew = (lo.max(axis=0) / np.maximum(lo.mean(axis=0), 1e-9)).mean()
        with open(os.path.join(out_dir, "result.json"), "w") as f:
            json.dump({"ms_per_micro_batch": 1e3 * float(np.mean(times)), "ms_std": 1e3 * float(np.std(times)),
                       "rank_load_max_over_mean": float(skew), "samples": len(times)}, f)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--gpus-per-node", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--ffn", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=64, help="first tokens of each request")
    ap.add_argument("--micro-batch-size", type=int, default=8, help="requests per micro-batch")
    ap.add_argument("--replica-slots", type=int, default=2)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=str, default=None)
    args = ap.parse_args()

    from relibra_moe.datasets import gpt_oss_batch
    from relibra_moe.evaluate import score_plan
    from relibra_moe.planners.strategies import plan_batch
    from relibra_moe.specs import ClusterSpec, ModelSpec
    from relibra_moe.trace import RoutingTrace, TraceBatch

    cuda = torch.cuda.is_available() and torch.cuda.device_count() >= args.world
    backend = "nccl" if cuda else "gloo"
    full = gpt_oss_batch(num_requests=args.requests, seed=args.seed)
    layer_ids = np.linspace(0, full.num_layers - 1, args.layers).round().astype(int)
    traces = [RoutingTrace(t.experts[:args.tokens, layer_ids], layer_ids, full.num_experts, full.top_k)
              for t in full.traces]
    batch = TraceBatch(traces)
    E, k = full.num_experts, full.top_k
    model = ModelSpec("gpt-oss-layers", args.hidden, args.ffn, E, k, args.layers)
    cluster = ClusterSpec(nodes=args.world // args.gpus_per_node, gpus_per_node=args.gpus_per_node)
    sample_ids = [t.experts.astype(np.int64) for t in traces]
    cfg = dict(hidden=args.hidden, ffn=args.ffn, experts=E, top_k=k, layers=args.layers,
               gpus_per_node=args.gpus_per_node, iters=args.iters, warmup=args.warmup, backend=backend)
    rows = []
    for name, strategy, slots, follow in (("plain EP", "static", 0, False),
                                          ("reorder only", "relibra-inter", 0, True),
                                          ("replay-balanced", "relibra", args.replica_slots, True)):
        plan = plan_batch(batch, model, cluster, strategy, replica_slots=slots,
                          micro_batch_size=args.micro_batch_size, seed=args.seed)
        score = score_plan(plan, batch.with_micro_batch_size(args.micro_batch_size), model, cluster)
        with tempfile.TemporaryDirectory() as d:
            run_group(_worker, args.world, {**cfg, "follow_plan": follow}, plan, sample_ids, d,
                      backend=backend, timeout_s=300)
            res = json.loads(Path(d, "result.json").read_text())
        res.update(name=name, strategy=strategy, replica_slots=slots,
                   t_moe_model_ms=1e3 * score.t_moe_s / max(plan.num_micro_batches, 1),
                   model_rank_skew=float(score["rank_skew_mean"]))
        rows.append(res)
    device = torch.cuda.get_device_name(0) if cuda else platform.processor() or "cpu"
    print(f"\nMoE layer stack, {args.layers} layers, H={args.hidden}, F={args.ffn}, E={E}, k={k}, "
          f"{args.world} ranks ({args.gpus_per_node}/node), {backend}, {device}")
    print(f"{'layer':<18}{'ms/micro-batch':>16}{'std':>8}{'load max/mean':>15}{'plan skew':>11}"
          f"{'model T_MoE ms':>16}")
    for r in rows:
        print(f"{r['name']:<18}{r['ms_per_micro_batch']:>16.2f}{r['ms_std']:>8.2f}"
              f"{r['rank_load_max_over_mean']:>15.3f}{r['model_rank_skew']:>11.3f}{r['t_moe_model_ms']:>16.4f}")
    out = Path(args.out) if args.out else Path(__file__).parent / "results" / f"layer_{'cuda' if cuda else 'cpu'}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"), "device": device,
        "backend": backend, "args": vars(args), "rows": rows}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
