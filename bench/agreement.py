"""Cost of the layer's cross-rank agreement (issue 21): the one exchange per layer forward that carries
every rank's pair counts, status, plan-slice digest and error message.

Measured on ``--world`` gloo ranks (CPU): the median time of ``Dispatcher.exchange`` of the agreement's
row width (``layers.moe._AGREE_COLS`` int64 per rank pair) against the 2-column rows the exchange had
before the digest and the message rode along; ``slice_digest`` of one (micro-batch, layer) slice of a
GPT-OSS-sized plan (E = 32, G = 8, r = 2, 32 split rows); and, for scale, one forward of a small
``ReplayBalancedMoE`` (T = 64, H = FFN = 64, E = 8, k = 2).

    python bench/agreement.py [--world 2] [--iters 400]

Prints JSON.
"""

from __future__ import annotations

import argparse
import json

import numpy as np
import torch
from common import time_ms


def _median_us(fn, iters: int) -> float:
    """Median host wall time of ``fn`` in microseconds (``common.time_ms`` on the host clock)."""
    return 1e3 * time_ms(fn, iters, 0, cuda=False)


def _worker(rank: int, world: int, iters: int, out_path: str) -> None:
    import torch.distributed as dist

    from relibra_moe.layers.moe import _AGREE_COLS, ReplayBalancedMoE

    torch.manual_seed(0)
    layer = ReplayBalancedMoE(64, 64, 8, 2, layer_index=0)
    disp = layer.dispatcher
    res = {}
    for cols in (2, _AGREE_COLS):
        meta = torch.zeros(world, cols, dtype=torch.int64)
        for _ in range(20):
            disp.exchange(meta)
        dist.barrier()
        res[f"exchange_{cols}_cols_us"] = _median_us(lambda m=meta: disp.exchange(m), iters)
    x = torch.randn(64, 64)
    with torch.no_grad():
        for _ in range(5):
            layer(x)
        dist.barrier()
        res["layer_forward_us"] = _median_us(lambda: layer(x), max(iters // 4, 20))
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(res, f)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--iters", type=int, default=400)
    args = ap.parse_args()
    import tempfile

    from relibra_moe.layers.moe import _AGREE_COLS, slice_digest
    from relibra_moe.layers.testing import hot_replica_plan, run_group

    with tempfile.NamedTemporaryFile(suffix=".json") as tmp:
        run_group(_worker, args.world, args.iters, tmp.name, timeout_s=120)
        res = json.load(open(tmp.name))
    plan = hot_replica_plan(2, 32, 8, 4, np.array([3, 5]), seed=0)
    home = plan.placement.expert_gpu[0].astype(np.int64)
    res["slice_digest_us"] = _median_us(lambda: slice_digest(home, plan.replicas, 0, 0), args.iters)
    res.update({"world": args.world, "agree_cols": _AGREE_COLS, "bytes_per_rank_pair": 8 * _AGREE_COLS})
    print(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
