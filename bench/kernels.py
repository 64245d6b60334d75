"""Kernel benchmark: grouped GEMM TFLOP/s and permute / combine / replica-copy GB/s.

On CUDA (bf16, uniform random top-k routing):

* grouped GEMM forward (gate_up and down projections), dX and dW, in TFLOP/s, against dense
  ``torch.matmul`` at equal FLOPs (one [R, K] x [K, N] product) and against ``torch._grouped_mm``
  (where this torch build and GPU support it);
* permute, combine and the 16-program replica copy in GB/s (bytes read + written), against a
  device-to-device ``copy_`` of a tensor of the same size;

at the Qwen3-30B-A3B expert shapes (T = 32768 tokens, k = 8, E = 128, H = 2048, expert FFN 768) and
Qwen3-235B-A22B (H = 4096, FFN 1536). A correctness check of every op against the torch reference
runs first. On a machine without CUDA it runs a small correctness pass in Triton's CPU interpreter
and says that timings need a GPU.

    python bench/kernels.py                      # both shapes, table + bench/results/kernels.json
    python bench/kernels.py --shapes qwen3-30b-a3b --tokens 8192 --block-m 128   # one tile height

Prints a table and writes JSON (``--out``).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import sys
from pathlib import Path

import torch

if not torch.cuda.is_available():  # must precede the first triton import
    os.environ.setdefault("TRITON_INTERPRET", "1")

from relibra_moe.triton_kernels.backend import INTERPRET, force_backend  # noqa: E402
from relibra_moe.triton_kernels.grouped_gemm import (  # noqa: E402
    ExpertWeights,
    _fwd_config,
    grouped_mm,
    grouped_mm_dw,
    grouped_mm_dx,
    swiglu_experts,
)
from relibra_moe.triton_kernels.permute import combine, permute  # noqa: E402
from relibra_moe.triton_kernels.replica_copy import add_slot_grads, copy_into_slots  # noqa: E402
from relibra_moe.triton_kernels.routing import routing_metadata  # noqa: E402

SHAPES = {
    # name: (tokens T, top-k, experts E, hidden H, expert ffn I)
    "qwen3-30b-a3b": (32768, 8, 128, 2048, 768),
    "qwen3-235b-a22b": (32768, 8, 128, 4096, 1536),
}
TARGETS = {"gemm_fwd_vs_dense": 0.60, "permute_combine_vs_copy": 0.70, "replica_copy_vs_copy": 0.50}


def random_topk(T: int, k: int, E: int, device, seed: int = 0) -> torch.Tensor:
    """[T, k] distinct expert ids per token, uniform (a balanced load: the kernels' steady state)."""
    g = torch.Generator(device=device).manual_seed(seed)
    return torch.rand(T, E, generator=g, device=device).topk(k, dim=1).indices


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-12)) if b.numel() else 0.0


# --------------------------------------------------------------------------------------------------
# correctness (CPU interpreter, or the GPU before timing)
# --------------------------------------------------------------------------------------------------


def correctness(device: str, dtype: torch.dtype, T: int, k: int, E: int, H: int, inter: int) -> dict[str, float]:
    """Max relative error of every Triton op against the torch reference on one random case."""
    ids = random_topk(T, k, E, device, seed=1)
    ids[0, -1] = -1  # an unrouted pair, so padding rows are exercised
    meta = routing_metadata(ids, E, block_m=64 if device == "cuda" else 32)
    g = torch.Generator(device=device).manual_seed(2)

    def rnd(*shape, s=1.0):
        return (torch.randn(*shape, generator=g, device=device) * s).to(dtype)

    x, wts = rnd(T, H), torch.rand(T, k, generator=g, device=device)
    wg, wd = rnd(E, 2 * inter, H, s=H**-0.5).transpose(1, 2), rnd(E, inter, H, s=inter**-0.5)  # HF gate_up layout
    dy = rnd(meta.num_rows, H)
    res = {}
    outs = {}
    for backend in ("torch", "triton"):
        with force_backend(backend):
            xs = permute(x, meta)
            leaves = [t.detach().clone().requires_grad_() for t in (xs, wg, wd, wts)]
            y = swiglu_experts(leaves[0], meta, leaves[1], leaves[2])
            out = combine(y, meta, leaves[3])
            out.float().square().sum().backward()
            outs[backend] = {
                "permute": xs,
                "grouped_mm": grouped_mm(xs, wg, meta),
                "grouped_mm_dx": grouped_mm_dx(dy[:, : 2 * inter].contiguous(), wg, meta),
                "grouped_mm_dw": grouped_mm_dw(xs, dy, meta),
                "moe_out": out,
                "moe_dx": leaves[0].grad,
                "moe_dw_gate_up": leaves[1].grad,
                "moe_dw_down": leaves[2].grad,
                "moe_dweights": leaves[3].grad,
            }
            # replica copy + add-back through ExpertWeights (home + 3 replica slots)
            rep = torch.zeros(3, H, 2 * inter, device=device, dtype=dtype)
            copy_into_slots(wg, torch.tensor([0, 5, 5], device=device), rep, torch.tensor([0, 1, 2], device=device))
            outs[backend]["replica_copy"] = rep
            hg = torch.zeros_like(wd)
            add_slot_grads(wd, torch.arange(E, device=device), hg, torch.arange(E, device=device) % 3)
            outs[backend]["add_slot_grads"] = hg
    for name, ref in outs["torch"].items():
        res[name] = rel_err(outs["triton"][name], ref)
    # ExpertWeights: slot s reads home row s, except the last 3 slots read the replica buffer
    src = torch.zeros(E, dtype=torch.long, device=device)
    src[-3:] = 1
    idx = torch.arange(E, device=device)
    idx[-3:] = torch.arange(3, device=device)
    rep = wg[-3:].transpose(1, 2).contiguous().transpose(1, 2)
    ew = ExpertWeights((wg, rep), src, idx)
    with force_backend("triton"):
        a = grouped_mm(outs["torch"]["permute"], ew, meta)
    res["expert_weights_vs_tensor"] = rel_err(a, outs["torch"]["grouped_mm"])
    return res


# --------------------------------------------------------------------------------------------------
# timing (CUDA)
# --------------------------------------------------------------------------------------------------


def bench_ms(fn) -> float:
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median"))


def copy_gbps(nbytes: int, device) -> float:
    """Device-to-device copy_ bandwidth (read + write) for a buffer of nbytes."""
    a = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device)
    b = torch.empty_like(a)
    ms = bench_ms(lambda: b.copy_(a))
    return 2 * nbytes / ms / 1e6


def grouped_mm_torch_fn(x, w, offs_end):
    """torch._grouped_mm(x [R, K], w [E, K, N], offs) or None where unsupported."""
    fn = getattr(torch, "_grouped_mm", None)
    if fn is None:
        return None
    try:
        fn(x, w, offs=offs_end)
        return lambda: fn(x, w, offs=offs_end)
    except Exception:  # noqa: BLE001 - arch / layout not supported by this build
        return None


def bench_shape(
    name: str, T: int, k: int, E: int, H: int, inter: int, block_m: int, replicas: int, dev: str = "cuda"
) -> dict:
    """Time every op at one model's expert shapes (bf16, uniform top-k routing) on ``dev``."""
    dt = torch.bfloat16
    ids = random_topk(T, k, E, dev)
    meta = routing_metadata(ids, E, block_m=block_m)
    R = meta.num_rows
    row = {"shape": name, "T": T, "k": k, "E": E, "H": H, "ffn": inter, "R": R, "block_m": block_m}
    row["routing_metadata_ms"] = bench_ms(lambda: routing_metadata(ids, E, block_m=block_m))
    x = torch.randn(T, H, device=dev, dtype=dt)
    wts = torch.rand(T, k, device=dev)
    xs = permute(x, meta)
    hf_gate_up = torch.randn(E, 2 * inter, H, device=dev, dtype=dt) * H**-0.5  # HF [E, N, K]
    w_gu = hf_gate_up.transpose(1, 2)  # [E, H, 2I] view
    w_dn = torch.randn(E, inter, H, device=dev, dtype=dt) * inter**-0.5
    offs_end = meta.offsets[1:].contiguous()

    gemms = {}
    for proj, (a, w, K, N) in {
        "gate_up": (xs, w_gu, H, 2 * inter),
        "down": (torch.randn(R, inter, device=dev, dtype=dt), w_dn, inter, H),
    }.items():
        flops = 2.0 * R * K * N
        dy = torch.randn(R, N, device=dev, dtype=dt)
        t_fwd = bench_ms(lambda a=a, w=w: grouped_mm(a, w, meta))
        t_dx = bench_ms(lambda dy=dy, w=w: grouped_mm_dx(dy, w, meta))
        t_dw = bench_ms(lambda a=a, dy=dy: grouped_mm_dw(a, dy, meta))
        dense_w = torch.randn(K, N, device=dev, dtype=dt)
        t_dense = bench_ms(lambda a=a, dense_w=dense_w: torch.matmul(a, dense_w))
        g = {
            "config": {k: v for k, v in _fwd_config(N, K, dt, block_m).items()},
            "flops": flops,
            "fwd_tflops": flops / t_fwd / 1e9,
            "dx_tflops": flops / t_dx / 1e9,
            "dw_tflops": flops / t_dw / 1e9,
            "dense_matmul_tflops": flops / t_dense / 1e9,
        }
        w_c = w.contiguous()
        tg = grouped_mm_torch_fn(a, w_c, offs_end)
        tg_t = grouped_mm_torch_fn(a, w_c.transpose(1, 2).contiguous().transpose(1, 2), offs_end)
        fn = tg or tg_t
        g["torch_grouped_mm_tflops"] = flops / bench_ms(fn) / 1e9 if fn else None
        g["fwd_vs_dense"] = g["fwd_tflops"] / g["dense_matmul_tflops"]
        g["fwd_vs_torch_grouped_mm"] = g["fwd_tflops"] / g["torch_grouped_mm_tflops"] if fn else None
        gemms[proj] = g
    row["gemm"] = gemms

    # the whole expert MLP (SwiGLU, recomputing backward): 3 GEMMs forward, 6 backward
    leaves = [t.detach().clone().requires_grad_() for t in (xs, w_gu, w_dn)]
    dy_out = torch.randn(R, H, device=dev, dtype=dt)

    def mlp_fwd_bwd():
        for t in leaves:
            t.grad = None
        swiglu_experts(leaves[0], meta, leaves[1], leaves[2]).backward(dy_out)

    mlp_flops = 18.0 * R * H * inter
    t_mlp = bench_ms(mlp_fwd_bwd)
    row["expert_mlp_fwd_bwd_ms"] = t_mlp
    row["expert_mlp_fwd_bwd_tflops"] = mlp_flops / t_mlp / 1e9

    esz = 2
    copy_ref = copy_gbps(R * H * esz, dev)
    row["copy_gbps"] = copy_ref
    t_perm = bench_ms(lambda: permute(x, meta))
    perm_bytes = 2 * R * H * esz  # read a token row, write a sorted row
    yv = torch.randn(R, H, device=dev, dtype=dt)
    t_comb = bench_ms(lambda: combine(yv, meta, wts))
    comb_bytes = (R + T) * H * esz + T * k * 8
    row["permute_gbps"] = perm_bytes / t_perm / 1e6
    row["combine_gbps"] = comb_bytes / t_comb / 1e6
    row["permute_vs_copy"] = row["permute_gbps"] / copy_ref
    row["combine_vs_copy"] = row["combine_gbps"] / copy_ref

    # replica copy: `replicas` experts (gate_up and down) into a replica buffer, 16 programs
    buf_gu = torch.empty(replicas, 2 * inter, H, device=dev, dtype=dt).transpose(1, 2)
    buf_dn = torch.empty(replicas, inter, H, device=dev, dtype=dt)
    src_idx = torch.randperm(E, device=dev)[:replicas]
    slot_idx = torch.arange(replicas, device=dev)

    def rep_copy():
        copy_into_slots(w_gu, src_idx, buf_gu, slot_idx, num_programs=16)
        copy_into_slots(w_dn, src_idx, buf_dn, slot_idx, num_programs=16)

    rep_bytes = 2 * replicas * 3 * inter * H * esz
    t_rep = bench_ms(rep_copy)
    row["replica_copy_gbps"] = rep_bytes / t_rep / 1e6
    copy_rep_ref = copy_gbps(rep_bytes // 2, dev)
    row["replica_copy_ref_gbps"] = copy_rep_ref
    row["replica_copy_vs_copy"] = row["replica_copy_gbps"] / copy_rep_ref
    home_g = torch.zeros_like(w_dn)
    t_add = bench_ms(lambda: add_slot_grads(buf_dn, slot_idx, home_g, src_idx, num_programs=16))
    row["add_slot_grads_gbps"] = 3 * replicas * inter * H * esz / t_add / 1e6
    return row


def print_table(rows: list[dict]) -> None:
    hdr = f"{'shape':18} {'bm':>4} {'proj':8} {'fwd':>7} {'dX':>7} {'dW':>7} {'dense':>7} "
    hdr += f"{'_grouped':>9} {'fwd/dense':>9}"
    print("grouped GEMM, TFLOP/s (bf16)")
    print(hdr)
    for r in rows:
        for proj, g in r["gemm"].items():
            tg = f"{g['torch_grouped_mm_tflops']:9.1f}" if g["torch_grouped_mm_tflops"] else f"{'n/a':>9}"
            print(
                f"{r['shape']:18} {r['block_m']:4d} {proj:8} {g['fwd_tflops']:7.1f} {g['dx_tflops']:7.1f} "
                f"{g['dw_tflops']:7.1f} "
                f"{g['dense_matmul_tflops']:7.1f} {tg} {g['fwd_vs_dense']:9.2f}"
            )
    for r in rows:
        print(
            f"{r['shape']:18} bm {r['block_m']:3d} expert MLP fwd+bwd: {r['expert_mlp_fwd_bwd_ms']:.2f} ms, "
            f"{r['expert_mlp_fwd_bwd_tflops']:.1f} TFLOP/s"
        )
    print("\nmemory-bound ops, GB/s (ratio to device copy_)")
    print(
        f"{'shape':18} {'copy_':>8} {'permute':>14} {'combine':>14} {'replica(16 pr)':>16} "
        f"{'add_grads':>10} {'meta ms':>8}"
    )
    for r in rows:
        print(
            f"{r['shape']:18} {r['copy_gbps']:8.0f} {r['permute_gbps']:8.0f} ({r['permute_vs_copy']:.2f}) "
            f"{r['combine_gbps']:8.0f} ({r['combine_vs_copy']:.2f}) {r['replica_copy_gbps']:9.0f} "
            f"({r['replica_copy_vs_copy']:.2f}) {r['add_slot_grads_gbps']:10.0f} {r['routing_metadata_ms']:8.3f}"
        )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated subset of {list(SHAPES)}")
    ap.add_argument("--tokens", type=int, default=None, help="override T (tokens per micro-batch)")
    ap.add_argument(
        "--block-m", default="64,128", help="comma-separated rows per tile of the grouped GEMM schedule (each is run)"
    )
    ap.add_argument("--replicas", type=int, default=16, help="experts copied by the replica-copy benchmark")
    ap.add_argument(
        "--out", default=None, help="JSON path (default bench/results/kernels.json, or kernels_interpreter.json on CPU)"
    )
    args = ap.parse_args(argv)
    report: dict = {
        "date": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "targets": TARGETS,
    }
    import triton

    report["triton"] = triton.__version__
    if not torch.cuda.is_available():
        assert INTERPRET, "TRITON_INTERPRET must be set before triton is imported"
        report["device"] = "cpu (Triton interpreter)"
        report["note"] = "correctness pass only: timings need a CUDA GPU"
        print("No CUDA device: running a small correctness pass in the Triton interpreter; timings need a GPU.")
        checks = {}
        for dtype in (torch.float32, torch.float16, torch.bfloat16):
            checks[str(dtype).removeprefix("torch.")] = correctness("cpu", dtype, T=24, k=4, E=8, H=32, inter=16)
        report["correctness"] = checks
        tol = {"float32": 1e-5, "float16": 5e-3, "bfloat16": 3e-2}
        print(f"{'op':26} " + " ".join(f"{d:>10}" for d in checks))
        ok = True
        for op in next(iter(checks.values())):
            print(f"{op:26} " + " ".join(f"{checks[d][op]:10.2e}" for d in checks))
            ok &= all(checks[d][op] <= tol[d] for d in checks)
        report["correctness_ok"] = ok
        print("max relative error vs the torch reference:", "OK" if ok else "FAILED")
    else:
        report["device"] = torch.cuda.get_device_name()
        print(f"device: {report['device']}")
        checks = correctness("cuda", torch.bfloat16, T=512, k=8, E=16, H=256, inter=128)
        report["correctness"] = {"bfloat16": checks}
        report["correctness_ok"] = all(v <= 3e-2 for v in checks.values())
        print("correctness vs torch reference:", "OK" if report["correctness_ok"] else f"FAILED {checks}")
        rows = []
        for name in args.shapes.split(","):
            T, k, E, H, inter = SHAPES[name]
            for bm in (int(b) for b in args.block_m.split(",")):
                rows.append(bench_shape(name, args.tokens or T, k, E, H, inter, bm, args.replicas))
                torch.cuda.empty_cache()
        report["results"] = rows
        print_table(rows)
    default = "kernels.json" if torch.cuda.is_available() else "kernels_interpreter.json"
    out = Path(args.out) if args.out else Path(__file__).parent / "results" / default
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(f"wrote {out}")
    return 0 if report["correctness_ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
