"""``relibra calibrate``: measure the rates the cost model charges on this box and write a cluster profile.

On a GPU box it measures (docs/method.md, "Rates"):

- **expert GEMMs**: the project's Triton grouped GEMM (``triton_kernels.swiglu_experts``, forward + backward) at the
  model's own expert shape (h x h', SwiGLU; ``--model PRESET`` or ``--model-config config.json``: the GEMM rate
  depends on the shape, docs/method.md "Rates") for several rows per expert; the profile's ``gemm_curve`` holds the
  curve and ``flops`` its value at ``--rows-per-expert`` (the cost model charges one rate, forward and backward alike:
  ``3 x 6 h h' rows / t_fwd+bwd``);
- **attention**: one attention layer of the model (Q, K, V, O projections and causal ``torch`` SDPA, forward +
  backward) on ``--seq-len`` tokens; ``attn_flops = 3 x timing.attention_flops / t`` (the simulator charges the
  backward as twice the forward);
- **NVLink all-to-all**: ``torch.distributed`` (NCCL) ``all_to_all_single`` between the local GPUs in spawned
  processes, bytes each GPU sends to the others over the time (needs 2 GPUs or more; else the preset's rate stays);
- **NVLink latency**: the same all-to-all at small sizes (``LATENCY_SIZES``, 4 KiB .. 1 MiB per GPU), fitted by
  least squares to ``t = alpha + bytes / B`` (``fit_alpha_beta``); ``nvlink_latency = alpha`` (the preset's when the
  fit is not usable: a negative intercept).

Inter-node rates (RDMA) cannot be measured on one box: ``--rdma-bw`` or the preset's. ``--dry-run`` (any machine)
measures nothing and writes the preset's rates, saying so in the profile's ``source``. The profile is read by
``relibra plan / score / simulate / compare --cluster-profile FILE`` and ``specs.load_cluster_profile``.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any

from ..atomic import check_target
from ..errors import PlanError
from ..specs import (
    CLUSTER_PRESETS,
    CPU_PROFILE,
    DEFAULT_CLUSTER,
    DISPATCHERS,
    RATE_RANGE,
    ModelSpec,
    cluster_preset,
    cluster_profile,
    save_cluster_profile,
)
from ..validate import check_count, check_positive, check_range, is_int
from .plan import add_model_args, model_from_args

DEFAULT_ROWS = (64, 256, 1024, 2048, 8192)
"""Rows per expert the GEMM curve is measured at (2048: a 32K-token batch of a 128-expert top-8 model on one GPU)."""


def _timed(fn: Any, iters: int, warmup: int, device: Any) -> float:
    """Mean seconds of ``fn()`` over ``iters`` calls after ``warmup`` (CUDA-synchronized on a GPU)."""
    import torch

    for _ in range(warmup):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - t0) / max(iters, 1)


def measure_gemm(model: ModelSpec, rows_per_expert: tuple[int, ...], local_experts: int, device: Any,
                 dtype: Any = None, iters: int = 10, warmup: int = 3) -> list[dict[str, float]]:
    """Forward + backward of the Triton SwiGLU experts at ``model``'s expert shape.

    Args:
        rows_per_expert: the rows each of ``local_experts`` experts receives, one measurement each.
        device, dtype: torch device and dtype (default bf16).

    Returns:
        One dict per point: ``rows_per_expert``, ``seconds`` (forward + backward), ``flops`` (``18 h h' R / t``,
        R = rows x local_experts).
    """
    import torch

    from ..triton_kernels.grouped_gemm import swiglu_experts
    from ..triton_kernels.permute import permute
    from ..triton_kernels.routing import routing_metadata

    dtype = dtype or torch.bfloat16
    H, Fh, S = model.hidden, model.ffn, int(local_experts)
    g = torch.Generator(device="cpu").manual_seed(0)
    w1 = (torch.randn(S, H, 2 * Fh, generator=g) / H ** 0.5).to(device, dtype).requires_grad_()
    w2 = (torch.randn(S, Fh, H, generator=g) / Fh ** 0.5).to(device, dtype).requires_grad_()
    out = []
    for rows in rows_per_expert:
        R = int(rows) * S
        slot_ids = torch.arange(S, device=device).repeat_interleave(int(rows))[torch.randperm(R).to(device)][:, None]
        meta = routing_metadata(slot_ids, S)
        x = torch.randn(R, H, generator=g).to(device, dtype).requires_grad_()

        def step(x: torch.Tensor = x, meta: Any = meta) -> None:
            y = swiglu_experts(permute(x, meta), meta, w1, w2)
            y.float().sum().backward()

        t = _timed(step, iters, warmup, device)
        out.append({"rows_per_expert": float(rows), "seconds": t, "flops": 18.0 * H * Fh * R / t})
    return out


def measure_attention(model: ModelSpec, seq_len: int, batch: int, device: Any, dtype: Any = None, iters: int = 10,
                      warmup: int = 3) -> dict[str, float]:
    """Forward + backward of one attention layer of ``model`` (projections + causal SDPA) on ``batch`` sequences
    of ``seq_len`` tokens: ``{"seconds", "flops"}`` with ``flops = 3 x timing.attention_flops x batch / t``."""
    import numpy as np
    import torch
    import torch.nn.functional as F

    from ..timing import BACKWARD_FACTOR, attention_flops

    dtype = dtype or torch.bfloat16
    h, d, nq, nkv = model.hidden, model.head_dim, model.num_heads, model.num_kv_heads
    g = torch.Generator(device="cpu").manual_seed(0)
    wq, wk, wv = (torch.randn(h, n * d, generator=g).to(device, dtype).mul_(h ** -0.5).requires_grad_()
                  for n in (nq, nkv, nkv))
    wo = torch.randn(nq * d, h, generator=g).to(device, dtype).mul_((nq * d) ** -0.5).requires_grad_()
    x = torch.randn(batch, seq_len, h, generator=g).to(device, dtype).requires_grad_()

    def step() -> None:
        q = (x @ wq).view(batch, seq_len, nq, d).transpose(1, 2)
        k = (x @ wk).view(batch, seq_len, nkv, d).transpose(1, 2)
        v = (x @ wv).view(batch, seq_len, nkv, d).transpose(1, 2)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=nq != nkv)
        (o.transpose(1, 2).reshape(batch, seq_len, nq * d) @ wo).float().sum().backward()

    t = _timed(step, iters, warmup, device)
    fl = (1.0 + BACKWARD_FACTOR) * float(attention_flops(np.array([seq_len]), model)[0]) * batch
    return {"seq_len": float(seq_len), "batch": float(batch), "seconds": t, "flops": fl / t}


LATENCY_SIZES = (4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20)
"""Bytes per GPU of the small all-to-alls whose times ``fit_alpha_beta`` fits for the NVLink latency."""


def fit_alpha_beta(nbytes: Any, seconds: Any) -> tuple[float, float]:
    """Least-squares fit of ``seconds = alpha + nbytes / bw`` over measured points: ``(alpha seconds, bw bytes/s)``.

    ``nbytes`` are the bytes each GPU sends to the others in one round. PlanError for fewer than 2 distinct sizes or a
    non-positive slope (times that do not grow with the bytes)."""
    import numpy as np

    b = np.asarray(nbytes, dtype=np.float64)
    t = np.asarray(seconds, dtype=np.float64)
    if b.shape != t.shape or len(np.unique(b)) < 2:
        raise PlanError(f"fit_alpha_beta needs >= 2 distinct sizes with one time each, got {b.tolist()} bytes and "
                        f"{t.tolist()} s")
    slope, alpha = np.polyfit(b, t, 1)
    if not slope > 0:
        raise PlanError(f"fit_alpha_beta: the times {t.tolist()} s do not grow with the bytes {b.tolist()}")
    return float(alpha), float(1.0 / slope)


def _a2a_worker(rank: int, world: int, nbytes: Any, iters: int, port: int, backend: str, result: Any) -> None:
    """One process of ``measure_all_to_all``: ``all_to_all_single`` of ``nbytes`` per rank (an int, or a tuple of
    sizes measured one after the other: then a list of results), rank 0 reports."""
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group(backend, rank=rank, world_size=world)
    try:
        dev = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
        out = []
        for size in (nbytes if isinstance(nbytes, tuple) else (nbytes,)):
            n = size // 2 // world * world
            src = torch.ones(n, dtype=torch.bfloat16, device=dev)
            dst = torch.empty_like(src)
            for _ in range(3):
                dist.all_to_all_single(dst, src)
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(iters):
                dist.all_to_all_single(dst, src)
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            t = torch.tensor([(time.perf_counter() - t0) / iters], dtype=torch.float64, device=dev)  # NCCL: GPU
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            out.append({"world": world, "bytes_per_gpu": 2 * n, "seconds": float(t.item()),
                        "bw": 2 * n * (world - 1) / world / float(t.item())})
        if rank == 0:
            result.put(out if isinstance(nbytes, tuple) else out[0])
    finally:
        dist.destroy_process_group()


def measure_all_to_all(world: int, nbytes: int | tuple[int, ...] = 256 << 20, iters: int = 10,
                       backend: str = "nccl", timeout_s: float = 300.0) -> Any:
    """Bandwidth per GPU per direction of ``all_to_all_single`` among ``world`` spawned processes: the bytes each
    rank sends to the others (``(world - 1) / world`` of its buffer) over the slowest rank's time. ``nbytes`` a
    tuple: one dict per size, in order."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_a2a_worker, args=(r, world, nbytes, iters, port, backend, q)) for r in range(world)]
    for p in procs:
        p.start()
    try:
        res = q.get(timeout=timeout_s)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.terminate()
    bad = [p.exitcode for p in procs if p.exitcode]
    if bad:
        raise RuntimeError(f"all-to-all worker exit codes {bad}")
    return res


def measure_all_to_all_latency(world: int, sizes: tuple[int, ...] = LATENCY_SIZES, iters: int = 20,
                               backend: str = "nccl", timeout_s: float = 300.0) -> dict[str, Any]:
    """Per-message latency of ``all_to_all_single`` among ``world`` spawned processes: the times at ``sizes`` bytes
    per GPU fitted to ``t = alpha + sent / B`` (``fit_alpha_beta``; ``sent`` = the bytes a GPU sends to the others).
    Returns ``{"alpha", "bw", "points"}`` (seconds, bytes/s, the measured dicts)."""
    pts = measure_all_to_all(world, tuple(int(s) for s in sizes), iters, backend, timeout_s)
    sent = [p["bytes_per_gpu"] * (world - 1) / world for p in pts]
    alpha, bw = fit_alpha_beta(sent, [p["seconds"] for p in pts])
    return {"alpha": alpha, "bw": bw, "points": pts}


def _device(device: str | None) -> Any:
    """The torch device of ``--device`` (default ``cuda``): a CUDA device that exists here, or the CPU (whose
    profile is labelled as no GPU profile); PlanError naming the value otherwise."""
    import torch

    try:
        dev = torch.device(device or "cuda")
    except (RuntimeError, TypeError, ValueError):
        raise PlanError(f"--device {device!r} is not a torch device (cuda, cuda:N, or cpu)") from None
    if dev.type not in ("cuda", "cpu"):
        raise PlanError(f"--device {device!r}: calibrate measures a CUDA GPU (cuda, cuda:N), or the CPU as a "
                        "functional check (cpu)")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise PlanError("relibra calibrate: no CUDA device here; pass --dry-run for the preset's profile")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise PlanError(f"--device {device!r}: this box has {torch.cuda.device_count()} CUDA device(s)")
    return dev


def _check_calibrate_args(preset: str, dispatcher: str, rdma_bw: float | None, rows: tuple[int, ...],
                          rows_per_expert: float, a2a_gpus: int | None, counts: tuple[tuple[str, int], ...]) -> None:
    """``calibrate``'s argument checks: PlanError naming the flag and the value (``counts``: (flag, value) pairs
    that must be positive integers)."""
    if preset not in CLUSTER_PRESETS:
        raise PlanError(f"--preset {preset!r} is unknown; known: {sorted(CLUSTER_PRESETS)}")
    if dispatcher not in DISPATCHERS:
        raise PlanError(f"--dispatcher {dispatcher!r} is not one of {list(DISPATCHERS)}")
    if rdma_bw is not None:
        check_range("--rdma-bw (bytes/s)", rdma_bw, *RATE_RANGE, what="a rate")
    if not rows or any(not is_int(r) or r < 1 for r in rows):
        raise PlanError(f"--rows={list(rows)} must be positive row counts")
    for name, value in counts:
        check_count(name, value)
    check_positive("--rows-per-expert", rows_per_expert)
    if a2a_gpus is not None:
        check_count("--a2a-gpus", a2a_gpus)


def calibrate(model: ModelSpec, preset: str = DEFAULT_CLUSTER, dispatcher: str = "alltoall", gpus_per_node: int = 8,
              rdma_bw: float | None = None, rows: tuple[int, ...] = DEFAULT_ROWS, rows_per_expert: float = 2048,
              local_experts: int = 8, seq_len: int = 4096, attn_batch: int = 1, a2a_gpus: int | None = None,
              dry_run: bool = False, device: str | None = None, iters: int = 10) -> dict[str, Any]:
    """Measure this box and return the cluster profile dict (``specs.cluster_profile``).

    ``preset`` supplies every rate not measured (RDMA unless ``rdma_bw`` bytes/s is given; NVLink with fewer than 2
    GPUs or for ``deepep``, whose own kernels are not run here). ``dry_run``: nothing is measured, the preset's rates
    are written and ``source`` says so. ``device`` (default ``cuda``): ``cpu`` runs the GEMM and attention
    measurements on the CPU (the Triton interpreter; a functional check, not a rate to plan with).
    """
    _check_calibrate_args(preset, dispatcher, rdma_bw, rows, rows_per_expert, a2a_gpus,
                          (("--gpus-per-node", gpus_per_node), ("--local-experts", local_experts),
                           ("--seq-len", seq_len), ("--attn-batch", attn_batch), ("--iters", iters)))
    base = cluster_preset(preset, nodes=1, gpus_per_node=gpus_per_node, dispatcher=dispatcher)
    if rdma_bw is not None:
        base = base.with_(rdma_bw=float(rdma_bw))
    shape = {"model": model.name, "expert_shape": [int(model.hidden), int(model.ffn)]}
    if dry_run:
        src = (f"preset {preset} ({dispatcher}): dry run, nothing measured; rates from docs/method.md (the GEMM rate "
               f"not at {model.name}'s expert shape {model.hidden} x {model.ffn})"
               + (f", rdma_bw {rdma_bw:.3g} B/s given by the user" if rdma_bw is not None else ""))
        return cluster_profile(base, src, {"dry_run": True, **shape})
    dev = _device(device)
    import torch

    meas: dict[str, Any] = {"device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
                            "torch": torch.__version__, **shape}
    if dev.type == "cpu":
        meas["device_kind"] = CPU_PROFILE
    curve = measure_gemm(model, tuple(rows), local_experts, dev, iters=iters)
    meas["gemm"] = curve
    base = base.with_(gemm_curve=tuple((p["rows_per_expert"], p["flops"]) for p in curve))
    base = base.with_(flops=base.expert_flops_at(rows_per_expert))
    meas["gemm_rows_per_expert"] = float(rows_per_expert)
    attn = measure_attention(model, seq_len, attn_batch, dev, iters=iters)
    meas["attention"] = attn
    base = base.with_(attn_flops=attn["flops"])
    n = torch.cuda.device_count() if dev.type == "cuda" else 0
    world = min(n, gpus_per_node) if a2a_gpus is None else a2a_gpus
    measured = [f"gemm at {model.name}'s expert shape {model.hidden} x {model.ffn}", "attention"]
    if dispatcher == "deepep":
        meas["nvlink"] = "not measured: DeepEP's own kernels are not run by calibrate (preset rate kept)"
    elif world >= 2:
        a2a = measure_all_to_all(world)
        meas["nvlink"] = a2a
        base = base.with_(nvlink_bw=a2a["bw"])
        measured.append(f"nvlink all-to-all ({world} GPUs)")
        try:
            lat = measure_all_to_all_latency(world)
        except PlanError as e:  # times that do not grow with the bytes: keep the preset's alpha, say why
            meas["nvlink_latency"] = f"not fitted ({e}); preset alpha kept"
        else:
            meas["nvlink_latency"] = lat
            if lat["alpha"] >= 0:
                base = base.with_(nvlink_latency=lat["alpha"])
                measured.append("nvlink latency (small all-to-alls)")
    else:
        meas["nvlink"] = f"not measured: {n} GPU(s) here (preset rate kept)"
    try:
        import deep_ep  # noqa: F401

        meas["deep_ep"] = "importable; its benchmarks (tests/test_intranode.py) give the deepep rates"
    except ImportError:
        meas["deep_ep"] = "not importable"
    rd = "given by the user" if rdma_bw is not None else f"preset {preset}"
    src = f"measured on {meas['device']}: {', '.join(measured)}; rdma_bw {rd}; other rates preset {preset}"
    if dev.type == "cpu":
        src = ("NOT A GPU PROFILE (a functional check on the CPU, Triton interpreter; plan commands refuse it): "
               + src)
    name = f"{preset}-cpu-check" if dev.type == "cpu" else f"{preset}-calibrated"
    return cluster_profile(base.with_(name=name), src, meas)


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``relibra calibrate`` to the CLI."""
    p = subparsers.add_parser(
        "calibrate", help="measure this box's GEMM, attention and NVLink rates; write a cluster profile",
        description="Measure the rates the cost model charges (grouped-GEMM and attention throughput, NVLink "
                    "all-to-all bandwidth) and write a cluster profile JSON for --cluster-profile. Rates not "
                    "measured come from --preset; --dry-run measures nothing.")
    add_model_args(p)  # the model whose expert shape and attention are measured
    p.add_argument("--preset", default=DEFAULT_CLUSTER,
                   help=f"cluster preset for the rates not measured (default {DEFAULT_CLUSTER})")
    p.add_argument("--dispatcher", default="alltoall", choices=DISPATCHERS, help="token dispatcher (default alltoall)")
    p.add_argument("--gpus-per-node", type=int, default=8, help="GPUs per node of the cluster described (default 8)")
    p.add_argument("--rdma-bw", type=float, default=None, metavar="GB/s",
                   help="achieved RDMA bandwidth per GPU per direction in GB/s (default: the preset's)")
    p.add_argument("--rows", default=",".join(map(str, DEFAULT_ROWS)),
                   help="rows per expert of the GEMM curve (comma-separated)")
    p.add_argument("--rows-per-expert", type=float, default=2048,
                   help="rows per expert whose rate the cost model charges (default 2048)")
    p.add_argument("--local-experts", type=int, default=8, help="experts per GPU in the GEMM measurement")
    p.add_argument("--seq-len", type=int, default=4096, help="tokens per sequence in the attention measurement")
    p.add_argument("--iters", type=int, default=10, help="timed iterations per measurement")
    p.add_argument("--device", default=None,
                   help="torch device (default cuda; cpu: a functional check only, its profile labelled NOT A GPU "
                        "PROFILE, which plan commands refuse)")
    p.add_argument("--dry-run", action="store_true", help="measure nothing: write the preset's profile")
    p.add_argument("--out", required=True, help="profile JSON to write")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """``relibra calibrate``: write the profile, print its rates and source; exit status 0."""
    check_target(args.out)  # before minutes of measurement
    try:
        rows = tuple(int(r) for r in str(args.rows).split(",") if r.strip())
    except ValueError:
        raise PlanError(f"--rows={args.rows!r} must be comma-separated integers") from None
    prof = calibrate(model_from_args(args), args.preset, args.dispatcher, args.gpus_per_node,
                     None if args.rdma_bw is None else args.rdma_bw * 1e9, rows, args.rows_per_expert,
                     args.local_experts, args.seq_len, dry_run=args.dry_run, device=args.device, iters=args.iters)
    save_cluster_profile(args.out, prof)
    if args.dry_run:
        print("dry run: nothing measured, the profile holds the preset's rates")
    print(json.dumps({k: prof[k] for k in ("name", "dispatcher", "gpus_per_node", "flops", "attn_flops",
                                           "nvlink_bw", "rdma_bw", "nvlink_latency", "rdma_latency", "source")},
                     indent=1))
    print(f"wrote {args.out}")
    return 0


__all__ = ["calibrate", "measure_gemm", "measure_attention", "measure_all_to_all", "measure_all_to_all_latency",
           "fit_alpha_beta", "LATENCY_SIZES"]
