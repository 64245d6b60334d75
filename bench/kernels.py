"""Kernel benchmark: grouped GEMM and expert-MLP TFLOP/s, permute / combine / replica-copy GB/s, each
target of issue 12 evaluated (met / missed with the measured ratio), after a correctness pass that
compares every Triton op with its torch reference.

On CUDA (bf16), for each model shape and each routing (``uniform`` top-k, and ``skewed``: expert 0
receives 30% of the (token, k) pairs, repeats inside a token allowed as the kernels do not need
distinct ids):

* grouped GEMM forward (gate_up and down), dX and dW in TFLOP/s, against dense ``torch.matmul`` at
  equal FLOPs (one [R, K] x [K, N] product) and ``torch._grouped_mm`` (its error is reported when this
  torch build or GPU rejects it); the forward also through ``ExpertWeights`` (home experts + replica
  slots of a separate buffer);
* the whole SwiGLU expert MLP through ``GroupedSwiGLUExperts.mlp`` (the layer's public expert API),
  forward and forward + backward, plain and with ``ExpertWeights``, against the same MLP on one dense
  weight pair (``torch.matmul`` + SwiGLU, autograd) at equal FLOPs;
* permute and combine of the top-k layout, and the k = 1 permute / combine the layer's expert side runs
  (``GroupedExperts.compute_tensors``), in GB/s (bytes read + written) against a device ``copy_``;
* the 16-program replica copy and gradient add-back in GB/s against a device ``copy_`` of their bytes;

at the Qwen3-30B-A3B expert shapes (T = 32768, k = 8, E = 128, H = 2048, FFN 768) and Qwen3-235B-A22B
(H = 4096, FFN 1536). The JSON is rewritten after every measurement, so a run cut short keeps what it
measured. Exit code: 1 if a correctness check fails, 2 if a target is missed, else 0.

Without CUDA it runs the correctness pass only, in Triton's CPU interpreter at tiny shapes.

    python bench/kernels.py                                   # both shapes -> bench/results/kernels.json
    python bench/kernels.py --shapes qwen3-30b-a3b --tokens 8192 --routing uniform
    python bench/kernels.py --out /tmp/k.json                 # CPU: interpreter correctness pass
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.nn.functional as F
from common import (
    JsonReport,
    bench_ms,
    environment,
    expert_weights,
    rel_err,
    replica_slot_ids,
    routing_ids,
    select_kernel_mode,
)

select_kernel_mode()  # before Triton is imported

from relibra_moe.layers.experts import GroupedSwiGLUExperts  # noqa: E402
from relibra_moe.triton_kernels import grouped_gemm as gg_mod  # noqa: E402
from relibra_moe.triton_kernels import permute as permute_mod  # noqa: E402
from relibra_moe.triton_kernels import replica_copy as replica_mod  # noqa: E402
from relibra_moe.triton_kernels.backend import force_backend  # noqa: E402
from relibra_moe.triton_kernels.grouped_gemm import (  # noqa: E402
    grouped_mm,
    grouped_mm_dw,
    grouped_mm_dx,
)
from relibra_moe.triton_kernels.permute import combine, permute  # noqa: E402
from relibra_moe.triton_kernels.replica_copy import add_slot_grads, copy_into_slots  # noqa: E402
from relibra_moe.triton_kernels.routing import RoutingMeta, routing_metadata  # noqa: E402

SHAPES = {
    # name: (tokens T, top-k, experts E, hidden H, expert ffn I)
    "qwen3-30b-a3b": (32768, 8, 128, 2048, 768),
    "qwen3-235b-a22b": (32768, 8, 128, 4096, 1536),
}
#: Tiny shapes of the CPU correctness pass (interpreter).
CPU_SHAPE = (24, 4, 8, 32, 16)

#: The targets of issue 12 (bf16, H200): key -> (what, {shape: minimum ratio} or one minimum for every shape).
TARGETS: dict[str, tuple[str, dict[str, float] | float]] = {
    "gemm_fwd_vs_dense": ("grouped GEMM forward / dense torch.matmul at equal FLOPs",
                          {"qwen3-235b-a22b": 0.70, "qwen3-30b-a3b": 0.60}),
    "gemm_fwd_vs_torch_grouped_mm": ("grouped GEMM forward / torch._grouped_mm", 1.0),
    "mlp_fwd_bwd_vs_dense": ("SwiGLU expert MLP forward+backward / the dense MLP at equal FLOPs", 0.50),
    "permute_vs_copy": ("permute GB/s / device copy_", 0.80),
    "combine_vs_copy": ("combine GB/s / device copy_", 0.80),
    "replica_copy_vs_copy": ("replica copy (16 programs) GB/s / device copy_", 0.60),
    "add_slot_grads_vs_copy": ("replica gradient add-back (16 programs) GB/s / device copy_", 0.60),
}
TOLERANCE = {"float32": 1e-5, "float16": 5e-3, "bfloat16": 3e-2}


# --------------------------------------------------------------------------------------------------
# helpers of this benchmark (the shared ones: bench/common.py)
# --------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def triton_launches() -> Iterator[dict[str, int]]:
    """Count the calls of every ``*_triton`` entry point of the kernel modules inside the block (a
    correctness check that ran none compared the torch reference with itself)."""
    counts: dict[str, int] = {}
    saved = []
    for mod in (permute_mod, gg_mod, replica_mod):
        for name, fn in list(vars(mod).items()):
            if name.endswith("_triton") and callable(fn) and getattr(fn, "__module__", None) == mod.__name__:
                def spy(*a, _fn=fn, _name=name, **kw):
                    counts[_name] = counts.get(_name, 0) + 1
                    return _fn(*a, **kw)

                saved.append((mod, name, fn))
                setattr(mod, name, spy)
    try:
        yield counts
    finally:
        for mod, name, fn in saved:
            setattr(mod, name, fn)


def swiglu_experts_module(E: int, H: int, inter: int, dtype: torch.dtype, device) -> GroupedSwiGLUExperts:
    """The layer's expert container with E experts (its ``mlp`` is what the layer runs)."""
    torch.manual_seed(0)
    return GroupedSwiGLUExperts(H, inter, E, dtype=dtype, device=device)


# --------------------------------------------------------------------------------------------------
# correctness: every Triton op against its torch reference
# --------------------------------------------------------------------------------------------------


def _ops(device: str, dtype: torch.dtype, T: int, k: int, E: int, H: int, inter: int, r: int,
         block_m: int) -> dict[str, Callable[[], list[torch.Tensor]]]:
    """One random case; each entry computes one op (outputs and gradients) under the current backend."""
    g = torch.Generator(device=device).manual_seed(2)

    def rnd(*shape, s=1.0):
        return (torch.randn(*shape, generator=g, device=device) * s).to(dtype)

    ids = routing_ids(T, k, E, device, "skewed", seed=1)
    ids[0, -1] = -1  # an unrouted pair: padding rows are exercised
    meta = routing_metadata(ids, E, block_m=block_m)
    replicated = torch.arange(r, device=device) * 3 % E
    slot_ids = replica_slot_ids(ids, E, replicated)
    meta_s = routing_metadata(slot_ids, E + r, block_m=block_m)
    x, wts = rnd(T, H), torch.rand(T, k, generator=g, device=device)
    hf_gate_up = rnd(E, 2 * inter, H, s=H**-0.5)  # HF [E, N, K] storage
    wg = hf_gate_up.transpose(1, 2)  # [E, H, 2I] strided view
    wd = rnd(E, inter, H, s=inter**-0.5)
    rep_g = torch.zeros(r, 2 * inter, H, device=device, dtype=dtype).transpose(1, 2)  # same layout as wg
    rep_d = torch.zeros(r, inter, H, device=device, dtype=dtype)
    copy_into_slots(wg, replicated, rep_g, torch.arange(r, device=device))  # (checked below as its own op)
    copy_into_slots(wd, replicated, rep_d, torch.arange(r, device=device))
    dy = rnd(meta.num_rows, 2 * inter)
    xs_ref = permute(x, meta)
    experts = swiglu_experts_module(E, H, inter, dtype, device)
    with torch.no_grad():
        experts.w_gate_up.copy_(wg)
        experts.w_down.copy_(wd)

    def leaves(*ts):
        return [t.detach().clone().requires_grad_() for t in ts]

    def mlp(use_slots: bool) -> list[torch.Tensor]:
        xs, w1, w2 = leaves(xs_ref, experts.w_gate_up, experts.w_down)
        m = meta_s if use_slots else meta
        tensors = experts.slot_tensors([w1, w2], [rep_g.contiguous(), rep_d] if use_slots else None)
        y = experts.mlp(xs, m, tensors)
        y.float().square().sum().backward()
        return [y, xs.grad, w1.grad, w2.grad]

    def moe_chain() -> list[torch.Tensor]:
        xl, wl = leaves(x, wts)
        out = combine(experts.mlp(permute(xl, meta), meta, [experts.w_gate_up, experts.w_down]), meta, wl)
        out.float().square().sum().backward()
        return [out, xl.grad, wl.grad]

    def k1_chain() -> list[torch.Tensor]:
        """The layer's expert side: received rows x [R, H] at slots [R] -> k = 1 permute / combine."""
        rows = x.repeat(2, 1)[: 2 * T - 1]
        slots = ids.reshape(-1)[: rows.shape[0]].clamp_min(0)
        m1 = routing_metadata(slots.view(-1, 1), E, block_m=block_m)
        xl = leaves(rows)[0]
        ys = permute(xl, m1) * 2
        out = combine(ys, m1, torch.ones(rows.shape[0], 1, device=device))
        out.float().square().sum().backward()
        return [out, xl.grad]

    def replica_copy() -> list[torch.Tensor]:
        buf = torch.zeros(r, E, 2 * inter, H, device=device, dtype=dtype)[:, 0]  # rows with a stride gap
        copy_into_slots(hf_gate_up, replicated, buf, torch.arange(r, device=device))
        return [buf]

    def add_back() -> list[torch.Tensor]:
        home = rnd(E, inter, H)
        add_slot_grads(rep_d + 1, torch.arange(r, device=device), home, replicated % 2)  # repeats: summed in order
        return [home]

    return {
        "permute": lambda: [permute(x, meta)],
        "combine": lambda: [combine(xs_ref, meta, wts)],
        "grouped_mm_hf_view": lambda: [grouped_mm(xs_ref, wg, meta)],
        "grouped_mm_contiguous": lambda: [grouped_mm(xs_ref, wg.contiguous(), meta)],
        "grouped_mm_expert_weights": lambda: [grouped_mm(permute(x, meta_s), expert_weights(wg, rep_g), meta_s)],
        "grouped_mm_dx": lambda: [grouped_mm_dx(dy, wg, meta)],
        "grouped_mm_dw": lambda: [grouped_mm_dw(xs_ref, dy, meta)],
        "expert_mlp_fwd_bwd": lambda: mlp(False),
        "expert_mlp_fwd_bwd_replica_slots": lambda: mlp(True),
        "moe_chain_fwd_bwd": moe_chain,
        "k1_permute_combine": k1_chain,
        "replica_copy": replica_copy,
        "add_slot_grads": add_back,
    }


def correctness(device: str, dtype: torch.dtype, shape: tuple[int, int, int, int, int], r: int = 3,
                block_m: int = 64) -> dict[str, dict]:
    """Per op: max relative error of Triton against the torch reference (over all outputs and gradients),
    the Triton entry points that ran, and ``ok`` (within the dtype's tolerance, and Triton did run)."""
    T, k, E, H, inter = shape
    tol = TOLERANCE[str(dtype).removeprefix("torch.")]
    results: dict[str, dict] = {}
    for backend in ("torch", "triton"):  # the same case (same seeds) under each backend
        with force_backend(backend):
            ops = _ops(device, dtype, T, k, E, H, inter, r, block_m)
            for name, op in ops.items():
                try:
                    with triton_launches() as launched:
                        results.setdefault(name, {})[backend] = op()
                    results[name][backend + "_launches"] = dict(launched)
                except Exception as exc:  # noqa: BLE001 - reported per op, the others still run
                    results.setdefault(name, {})["error"] = f"{backend}: {type(exc).__name__}: {exc}"
                    results[name]["traceback"] = traceback.format_exc(limit=6)
    out = {}
    for name, res in results.items():
        if "error" in res:
            out[name] = {"error": res["error"], "traceback": res["traceback"], "ok": False}
            continue
        err = max(rel_err(a, b) for a, b in zip(res["triton"], res["torch"], strict=True))
        launched = res["triton_launches"]
        if res["torch_launches"]:  # the reference must not have touched a kernel
            out[name] = {"error": f"the torch reference ran Triton: {res['torch_launches']}", "ok": False}
            continue
        out[name] = {"rel_err": err, "triton": launched, "ok": err <= tol and bool(launched)}
    return out


def print_correctness(checks: dict[str, dict[str, dict]]) -> bool:
    dtypes = list(checks)
    print(f"{'op':34} " + " ".join(f"{d:>12}" for d in dtypes) + "  triton entry points")
    ok = True
    for op in checks[dtypes[0]]:
        cells = []
        for d in dtypes:
            c = checks[d][op]
            ok &= c["ok"]
            cells.append(f"{'ERROR':>12}" if "error" in c else f"{c['rel_err']:10.2e}{'  ' if c['ok'] else ' !'}")
        c0 = checks[dtypes[0]][op]
        print(f"{op:34} " + " ".join(cells) + "  " + (c0.get("error") or ",".join(sorted(c0["triton"])) or "NONE"))
    print("correctness (Triton vs the torch reference):", "OK" if ok else "FAILED")
    return ok


# --------------------------------------------------------------------------------------------------
# timing (CUDA)
# --------------------------------------------------------------------------------------------------


def copy_gbps(nbytes: int, device) -> float:
    """Device-to-device ``copy_`` bandwidth (bytes read + written) for a buffer of ``nbytes``."""
    a = torch.empty(max(nbytes // 2, 1), dtype=torch.bfloat16, device=device)
    b = torch.empty_like(a)
    return 2 * a.numel() * 2 / bench_ms(lambda: b.copy_(a)) / 1e6


def torch_grouped_mm(x: torch.Tensor, w: torch.Tensor, meta: RoutingMeta) -> tuple[Callable | None, str | None]:
    """``torch._grouped_mm(x [R, K], w [E, K, N], offs)`` as a callable, or (None, the error it raised).
    Tries w's own layout, then the transposed storage."""
    fn = getattr(torch, "_grouped_mm", None)
    if fn is None:
        return None, f"torch {torch.__version__} has no torch._grouped_mm"
    offs = meta.offsets[1:].contiguous()
    x = x[: int(meta.offsets[-1])]  # routed rows only: the offsets end there
    errors = []
    for cand in (w.contiguous(), w.transpose(1, 2).contiguous().transpose(1, 2)):
        try:
            fn(x, cand, offs=offs)
            torch.cuda.synchronize()
            return (lambda cand=cand: fn(x, cand, offs=offs)), None
        except Exception as exc:  # noqa: BLE001 - reported in the JSON and the table
            errors.append(f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}")
    return None, " | ".join(errors)


def bench_routing(rep: JsonReport, key: tuple, name: str, T: int, k: int, E: int, H: int, inter: int, routing: str,
                  replicas: int, block_m: int, dev: str = "cuda") -> None:
    """Time every op at one shape and routing; each figure is written to the report as it is measured."""
    dt, esz = torch.bfloat16, 2
    ids = routing_ids(T, k, E, dev, routing)
    meta = routing_metadata(ids, E, block_m=block_m)
    R = meta.num_rows
    rep.set(*key, "R", R)
    rep.set(*key, "max_slot_share", float(meta.counts.max()) / max(int(meta.counts.sum()), 1))
    rep.set(*key, "routing_metadata_ms", bench_ms(lambda: routing_metadata(ids, E, block_m=block_m)))
    x = torch.randn(T, H, device=dev, dtype=dt)
    wts = torch.rand(T, k, device=dev)
    xs = permute(x, meta)
    experts = swiglu_experts_module(E, H, inter, dt, dev)
    hf_gate_up = (torch.randn(E, 2 * inter, H, device=dev) * H**-0.5).to(dt)  # HF [E, N, K] storage
    w_gu, w_dn = hf_gate_up.transpose(1, 2), experts.w_down.detach()
    replicated = torch.arange(replicas, device=dev) * (E // max(replicas, 1)) % E
    meta_s = routing_metadata(replica_slot_ids(ids, E, replicated), E + replicas, block_m=block_m)
    xs_s = permute(x, meta_s)
    copy = copy_gbps(R * H * esz, dev)
    rep.set(*key, "copy_gbps", copy)

    for proj, (a, a_s, w, K, N) in {"gate_up": (xs, xs_s, w_gu, H, 2 * inter),
                                    "down": (torch.randn(R, inter, device=dev, dtype=dt), None, w_dn, inter, H)
                                    }.items():
        pk = (*key, "gemm", proj)
        flops = 2.0 * int(meta.offsets[-1]) * K * N
        dy = torch.randn(R, N, device=dev, dtype=dt)
        rep.set(*pk, "flops", flops)
        rep.set(*pk, "fwd_tflops", flops / bench_ms(lambda a=a, w=w: grouped_mm(a, w, meta)) / 1e9)
        rep.set(*pk, "dx_tflops", flops / bench_ms(lambda dy=dy, w=w: grouped_mm_dx(dy, w, meta)) / 1e9)
        rep.set(*pk, "dw_tflops", flops / bench_ms(lambda a=a, dy=dy: grouped_mm_dw(a, dy, meta)) / 1e9)
        dense_w = torch.randn(K, N, device=dev, dtype=dt)
        rep.set(*pk, "dense_matmul_tflops", flops / bench_ms(lambda a=a, dense_w=dense_w: torch.matmul(a, dense_w))
                / 1e9)
        g = rep.get(*pk)
        g["fwd_vs_dense"] = g["fwd_tflops"] / g["dense_matmul_tflops"]
        fn, err = torch_grouped_mm(a, w, meta)
        if fn is None:
            g["torch_grouped_mm_error"] = err
            print(f"  torch._grouped_mm failed ({name}, {routing}, {proj}): {err}")
        else:
            g["torch_grouped_mm_tflops"] = flops / bench_ms(fn) / 1e9
            g["fwd_vs_torch_grouped_mm"] = g["fwd_tflops"] / g["torch_grouped_mm_tflops"]
        rep.save()
        if proj == "gate_up":  # ExpertWeights: E home rows + r replica slots of a separate allocation
            rep_buf = torch.empty(replicas, N, K, device=dev, dtype=dt).transpose(1, 2)
            copy_into_slots(w, replicated, rep_buf, torch.arange(replicas, device=dev))
            ew = expert_weights(w, rep_buf)
            flops_s = 2.0 * int(meta_s.offsets[-1]) * K * N
            t_ew = bench_ms(lambda a_s=a_s, ew=ew: grouped_mm(a_s, ew, meta_s))
            rep.set(*pk, "expert_weights_fwd_tflops", flops_s / t_ew / 1e9)

    # the whole SwiGLU expert MLP (the layer's expert API), against the dense MLP at equal FLOPs
    mk = (*key, "expert_mlp")
    routed = int(meta.offsets[-1])
    mlp_flops_fwd = 6.0 * routed * H * inter
    dense_x = xs[:routed].detach()
    dw1 = torch.randn(H, 2 * inter, device=dev, dtype=dt) * H**-0.5
    dw2 = torch.randn(inter, H, device=dev, dtype=dt) * inter**-0.5

    def dense_mlp(xx, w1, w2):
        h = xx @ w1
        return (F.silu(h[:, :inter]) * h[:, inter:]) @ w2

    home = [experts.w_gate_up, experts.w_down]
    slots = [torch.randn(replicas, H, 2 * inter, device=dev, dtype=dt), torch.randn(replicas, inter, H, device=dev,
                                                                                        dtype=dt)]
    for variant, (m, xin, tensors) in {"plain": (meta, xs, experts.slot_tensors(home, None)),
                                       "replica_slots": (meta_s, xs_s, experts.slot_tensors(home, slots))}.items():
        with torch.no_grad():
            t_fwd = bench_ms(lambda m=m, xin=xin, tensors=tensors: experts.mlp(xin, m, tensors))
        xl = xin.detach().clone().requires_grad_()
        dy_out = torch.randn(m.num_rows, H, device=dev, dtype=dt)

        def fwd_bwd(m=m, xl=xl, tensors=tensors, dy_out=dy_out):
            for p in (xl, *home):
                p.grad = None
            experts.mlp(xl, m, tensors).backward(dy_out)

        t_fb = bench_ms(fwd_bwd)
        fl = mlp_flops_fwd * int(m.offsets[-1]) / max(routed, 1)
        rep.set(*mk, variant, {"fwd_ms": t_fwd, "fwd_tflops": fl / t_fwd / 1e9, "fwd_bwd_ms": t_fb,
                               "fwd_bwd_tflops": 3 * fl / t_fb / 1e9})
    with torch.no_grad():
        t_dense_fwd = bench_ms(lambda: dense_mlp(dense_x, dw1, dw2))
    dl = [dense_x.clone().requires_grad_(), dw1.clone().requires_grad_(), dw2.clone().requires_grad_()]
    dy_dense = torch.randn(routed, H, device=dev, dtype=dt)

    def dense_fwd_bwd():
        for p in dl:
            p.grad = None
        dense_mlp(*dl).backward(dy_dense)

    t_dense_fb = bench_ms(dense_fwd_bwd)
    rep.set(*mk, "dense", {"fwd_tflops": mlp_flops_fwd / t_dense_fwd / 1e9,
                           "fwd_bwd_tflops": 3 * mlp_flops_fwd / t_dense_fb / 1e9})
    d = rep.get(*mk)
    d["fwd_vs_dense"] = d["plain"]["fwd_tflops"] / d["dense"]["fwd_tflops"]
    d["fwd_bwd_vs_dense"] = d["plain"]["fwd_bwd_tflops"] / d["dense"]["fwd_bwd_tflops"]
    rep.save()

    # permute / combine (top-k layout), and the k = 1 pair the layer's expert side runs
    rep.set(*key, "permute_gbps", 2 * routed * H * esz / bench_ms(lambda: permute(x, meta)) / 1e6)
    yv = torch.randn(R, H, device=dev, dtype=dt)
    rep.set(*key, "combine_gbps", ((routed + T) * H * esz + T * k * 8) / bench_ms(lambda: combine(yv, meta, wts)) / 1e6)
    # the received rows of a one-rank layer: pair order (token t's k rows together), slot = expert
    rows = x.repeat_interleave(k, dim=0)
    slot_of = ids.reshape(-1, 1)
    rep.set(*key, "k1_routing_metadata_ms", bench_ms(lambda: routing_metadata(slot_of, E, block_m=block_m)))
    m1 = routing_metadata(slot_of, E, block_m=block_m)
    n1 = rows.shape[0]
    ones = torch.ones(n1, 1, device=dev)
    rep.set(*key, "k1_permute_gbps", 2 * n1 * H * esz / bench_ms(lambda: permute(rows, m1)) / 1e6)
    y1 = permute(rows, m1)
    rep.set(*key, "k1_combine_gbps", (2 * n1 * H * esz + n1 * 8) / bench_ms(lambda: combine(y1, m1, ones)) / 1e6)
    d = rep.get(*key)
    for op in ("permute", "combine", "k1_permute", "k1_combine"):
        d[f"{op}_vs_copy"] = d[f"{op}_gbps"] / copy
    rep.save()


def bench_replica_copy(rep: JsonReport, key: tuple, E: int, H: int, inter: int, replicas: int,
                       dev: str = "cuda") -> None:
    """The 16-program replica copy (gate_up and down of ``replicas`` experts) and its gradient add-back."""
    dt, esz = torch.bfloat16, 2
    w_gu = torch.randn(E, 2 * inter, H, device=dev, dtype=dt)
    w_dn = torch.randn(E, inter, H, device=dev, dtype=dt)
    buf_gu = torch.empty(replicas, 2 * inter, H, device=dev, dtype=dt)
    buf_dn = torch.empty(replicas, inter, H, device=dev, dtype=dt)
    src_idx = torch.randperm(E, device=dev)[:replicas]
    slot_idx = torch.arange(replicas, device=dev)

    def rep_copy():
        copy_into_slots(w_gu, src_idx, buf_gu, slot_idx, num_programs=16)
        copy_into_slots(w_dn, src_idx, buf_dn, slot_idx, num_programs=16)

    def add_back():
        add_slot_grads(buf_gu, slot_idx, w_gu, src_idx, num_programs=16)
        add_slot_grads(buf_dn, slot_idx, w_dn, src_idx, num_programs=16)

    nbytes = replicas * 3 * inter * H * esz
    ref = copy_gbps(nbytes, dev)
    rep.set(*key, "copy_gbps", ref)
    rep.set(*key, "replica_copy_gbps", 2 * nbytes / bench_ms(rep_copy) / 1e6)
    rep.set(*key, "replica_copy_vs_copy", rep.get(*key, "replica_copy_gbps") / ref)
    rep.set(*key, "add_slot_grads_gbps", 3 * nbytes / bench_ms(add_back) / 1e6)  # read both, write home
    rep.set(*key, "add_slot_grads_vs_copy", rep.get(*key, "add_slot_grads_gbps") / ref)


# --------------------------------------------------------------------------------------------------
# targets
# --------------------------------------------------------------------------------------------------


def evaluate_targets(results: dict) -> list[dict]:
    """Every target against the measured ratios (uniform routing; both projections for the GEMM)."""
    rows = []
    for shape, res in results.items():
        uni = res.get("uniform", {})
        measured: dict[str, list[tuple[str, float | None]]] = {
            "gemm_fwd_vs_dense": [(p, g.get("fwd_vs_dense")) for p, g in uni.get("gemm", {}).items()],
            "gemm_fwd_vs_torch_grouped_mm": [(p, g.get("fwd_vs_torch_grouped_mm")) for p, g in
                                             uni.get("gemm", {}).items()],
            "mlp_fwd_bwd_vs_dense": [("", uni.get("expert_mlp", {}).get("fwd_bwd_vs_dense"))],
            "permute_vs_copy": [("", uni.get("permute_vs_copy"))],
            "combine_vs_copy": [("", uni.get("combine_vs_copy"))],
            "replica_copy_vs_copy": [("", res.get("replica", {}).get("replica_copy_vs_copy"))],
            "add_slot_grads_vs_copy": [("", res.get("replica", {}).get("add_slot_grads_vs_copy"))],
        }
        for tkey, (what, need) in TARGETS.items():
            minimum = need if isinstance(need, float) else need.get(shape, min(need.values()))
            for part, ratio in measured[tkey] or [("", None)]:
                status = "not measured" if ratio is None else ("met" if ratio >= minimum else "missed")
                rows.append({"shape": shape, "target": tkey + (f"[{part}]" if part else ""), "what": what,
                             "minimum": minimum, "ratio": ratio, "status": status})
    return rows


def print_targets(rows: list[dict]) -> None:
    print("\ntargets (uniform routing, bf16)")
    for r in rows:
        ratio = "   -  " if r["ratio"] is None else f"{r['ratio']:6.2f}"
        print(f"  {r['shape']:16} {r['target']:38} {ratio} (>= {r['minimum']:.2f})  {r['status'].upper()}")


def print_summary(results: dict) -> None:
    print("\ngrouped GEMM TFLOP/s (bf16): fwd / dX / dW / dense / torch._grouped_mm / ExpertWeights fwd")
    for shape, res in results.items():
        for routing in ("uniform", "skewed"):
            for proj, g in res.get(routing, {}).get("gemm", {}).items():
                tg = f"{g['torch_grouped_mm_tflops']:7.1f}" if "torch_grouped_mm_tflops" in g else "  error"
                ew = f"{g['expert_weights_fwd_tflops']:7.1f}" if "expert_weights_fwd_tflops" in g else "      -"
                print(f"  {shape:16} {routing:8} {proj:8} {g.get('fwd_tflops', 0):7.1f} {g.get('dx_tflops', 0):7.1f} "
                      f"{g.get('dw_tflops', 0):7.1f} {g.get('dense_matmul_tflops', 0):7.1f} {tg} {ew}")
    print("expert MLP TFLOP/s: fwd / fwd+bwd (plain, replica slots, dense)")
    for shape, res in results.items():
        for routing in ("uniform", "skewed"):
            m = res.get(routing, {}).get("expert_mlp", {})
            if "dense" in m:
                print(f"  {shape:16} {routing:8} " + "  ".join(
                    f"{v}: {m[v]['fwd_tflops']:.1f} / {m[v]['fwd_bwd_tflops']:.1f}" for v in ("plain", "replica_slots",
                                                                                            "dense") if v in m))
    print("memory-bound ops, ratio to device copy_: permute / combine / k1 permute / k1 combine")
    for shape, res in results.items():
        for routing in ("uniform", "skewed"):
            r = res.get(routing, {})
            if "k1_combine_vs_copy" in r:
                print(f"  {shape:16} {routing:8} {r['permute_vs_copy']:.2f} / {r['combine_vs_copy']:.2f} / "
                      f"{r['k1_permute_vs_copy']:.2f} / {r['k1_combine_vs_copy']:.2f}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated subset of {list(SHAPES)}")
    ap.add_argument("--tokens", type=int, default=None, help="override T (tokens per micro-batch)")
    ap.add_argument("--routing", default="uniform,skewed", help="comma-separated subset of uniform,skewed")
    ap.add_argument("--block-m", type=int, default=64, help="rows per routing block (routing_metadata)")
    ap.add_argument("--replicas", type=int, default=16, help="replica slots (ExpertWeights and replica copy)")
    ap.add_argument("--dtypes", default="float32,bfloat16", help="dtypes of the CPU correctness pass")
    ap.add_argument("--out", default=None,
                    help="JSON path (default bench/results/kernels.json, or kernels_interpreter.json without CUDA)")
    args = ap.parse_args(argv)
    cuda = torch.cuda.is_available()
    default = "kernels.json" if cuda else "kernels_interpreter.json"
    rep = JsonReport(Path(args.out) if args.out else Path(__file__).parent / "results" / default,
                     environment=environment(), args=vars(args),
                     targets={k: {"what": w, "minimum": m} for k, (w, m) in TARGETS.items()})
    print(f"device: {rep.data['environment']['device']}")
    if not cuda:
        rep.set("note", "correctness pass only (Triton interpreter, tiny shapes): timings need a CUDA GPU")
        print("No CUDA device: correctness pass in the Triton interpreter at tiny shapes; timings need a GPU.")
        checks = {}
        for name in args.dtypes.split(","):
            checks[name] = correctness("cpu", getattr(torch, name), CPU_SHAPE, block_m=16)
            rep.set("correctness", checks)
        ok = print_correctness(checks)
        rep.set("correctness_ok", ok)
        print(f"wrote {rep.path}")
        return 0 if ok else 1

    checks = {"bfloat16": correctness("cuda", torch.bfloat16, (2048, 8, 32, 512, 256), block_m=args.block_m)}
    rep.set("correctness", checks)
    ok = print_correctness(checks)
    rep.set("correctness_ok", ok)
    for name in args.shapes.split(","):
        T, k, E, H, inter = SHAPES[name]
        T = args.tokens or T
        rep.set("results", name, "shape", {"T": T, "k": k, "E": E, "H": H, "ffn": inter, "block_m": args.block_m})
        for routing in args.routing.split(","):
            try:
                bench_routing(rep, ("results", name, routing), name, T, k, E, H, inter, routing, args.replicas,
                              args.block_m)
            except Exception as exc:  # noqa: BLE001 - recorded; the other shapes still run
                rep.set("results", name, routing, "error", f"{type(exc).__name__}: {exc}")
                traceback.print_exc()
            torch.cuda.empty_cache()
        try:
            bench_replica_copy(rep, ("results", name, "replica"), E, H, inter, args.replicas)
        except Exception as exc:  # noqa: BLE001
            rep.set("results", name, "replica", "error", f"{type(exc).__name__}: {exc}")
            traceback.print_exc()
        rep.set("target_results", evaluate_targets(rep.data["results"]))
    print_summary(rep.data.get("results", {}))
    rows = evaluate_targets(rep.data.get("results", {}))
    rep.set("target_results", rows)
    print_targets(rows)
    print(f"wrote {rep.path}")
    if not ok:
        return 1
    return 0 if all(r["status"] == "met" for r in rows) else 2


if __name__ == "__main__":
    sys.exit(main())
