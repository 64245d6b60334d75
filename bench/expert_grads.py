"""Torch reference of the grouped GEMM's weight gradient with ``ExpertWeights`` (home experts + replica
slots, CPU): the per-slot path (``_source_grads_torch``: each slot's ``X_s^T dY_s`` written straight into
its source row) against the composition it replaced (the ``[S, K, N]`` per-slot gradient, its layout
copy, then ``add_slot_grads`` into zeroed per-source tensors). Both give the same bits (checked here).

    python bench/expert_grads.py                          # H=512, F=1024, 8 home experts + 2 slots
    python bench/expert_grads.py --hidden 256 --ffn 512 --rows 2048

Times the gate_up weight gradient of one layer (``[E, H, 2F]`` home + ``[r, H, 2F]`` slots, HF's
transposed layout with ``--hf``), min over ``--iters`` interleaved runs. Prints a table and writes JSON (``--out``,
default ``bench/results/expert_grads_cpu.json``). CPU timings are noisy on a shared machine.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import platform
import time
from pathlib import Path

import torch

from relibra_moe.triton_kernels import grouped_gemm as gg
from relibra_moe.triton_kernels.backend import force_backend
from relibra_moe.triton_kernels.replica_copy import add_slot_grads
from relibra_moe.triton_kernels.routing import routing_metadata


def composed(x, dy, offsets, sources, slot_source, slot_index, transposed):
    """The previous reference: [S, K, N] dW (in the sources' layout), then added into zeroed sources."""
    dw = gg._grouped_mm_dw_op(x, dy, offsets, transposed)
    slots = torch.arange(dw.shape[0])
    out = []
    for i, src in enumerate(sources):
        g = torch.zeros_like(src)
        add_slot_grads(dw, slots, g, torch.where(slot_source == i, slot_index, torch.full_like(slots, -1)))
        out.append(g)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--ffn", type=int, default=1024)
    ap.add_argument("--experts", type=int, default=8, help="home experts on the rank")
    ap.add_argument("--slots", type=int, default=2, help="replica slots")
    ap.add_argument("--rows", type=int, default=1024, help="routed rows on the rank")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--hf", action="store_true", help="HF's transposed [E, 2F, H] layout")
    ap.add_argument("--out", default="bench/results/expert_grads_cpu.json")
    a = ap.parse_args()
    torch.manual_seed(0)
    H, N, E, r = a.hidden, 2 * a.ffn, a.experts, a.slots
    shape = (N, H) if a.hf else (H, N)
    home, rep = torch.randn(E, *shape), torch.randn(r, *shape)
    if a.hf:
        home, rep = home.transpose(1, 2), rep.transpose(1, 2)
    S = E + r
    meta = routing_metadata(torch.randint(0, S, (a.rows, 1)), S, block_m=64)
    x, dy = torch.randn(meta.num_rows, H), torch.randn(meta.num_rows, N)
    src = torch.cat([torch.zeros(E, dtype=torch.long), torch.ones(r, dtype=torch.long)])
    idx = torch.cat([torch.arange(E), torch.arange(r)])
    runs = {
        "per-slot (current)": lambda: gg._source_grads_torch(x, dy, meta.offsets, [home, rep], src, idx, [True, True]),
        "composed (previous)": lambda: composed(x, dy, meta.offsets, [home, rep], src, idx, a.hf),
    }
    outs = {}
    ts: dict[str, list[float]] = {name: [] for name in runs}
    with force_backend("torch"):
        for _ in range(a.iters):  # interleaved, so load from other processes hits both alike
            for name, fn in runs.items():
                t0 = time.perf_counter()
                outs[name] = fn()
                ts[name].append(time.perf_counter() - t0)
    res = {name: min(t) * 1e3 for name, t in ts.items()}
    same = all(torch.equal(u, v) for u, v in zip(*outs.values()))
    print(f"gate_up weight grad, H={H}, F={a.ffn}, E_loc={E}, r={r}, rows={a.rows}, hf_layout={a.hf}")
    for name, ms in res.items():
        print(f"  {name:22s} {ms:9.1f} ms")
    print(f"  identical results: {same}")
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({
        "when": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"), "host": platform.node(),
        "threads": torch.get_num_threads(), "args": vars(a), "ms": res, "identical": same}, indent=1))


if __name__ == "__main__":
    main()
