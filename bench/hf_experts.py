"""HF experts kernels: ``experts_implementation="relibra"`` against ``"eager"`` and ``"grouped_mm"``.

For each family (``--families``, default every family that transformers routes through
``experts_implementation``), one Hugging Face fused experts module of ``--hidden`` x ``--ffn`` with
``--experts`` experts is called on ``--tokens`` tokens with top-``--topk`` routing drawn from a skewed
distribution (Zipf-like expert popularity, ``--skew``), forward and backward of ``sum(y * dy)``:

- correctness (every device): max |output - eager| and max |grad - eager| (input and every weight)
  for ``relibra`` and ``grouped_mm``, in fp32;
- timings (CUDA only): median ms of forward and of forward + backward over ``--iters`` runs after
  ``--warmup``, in ``--dtype`` (bf16 by default), with CUDA events.

    python bench/hf_experts.py                         # CPU: correctness only
    TRITON_INTERPRET=1 python bench/hf_experts.py      # CPU: the Triton kernels in the interpreter
    python bench/hf_experts.py --hidden 2048 --ffn 768 --experts 128 --topk 8 --tokens 8192   # CUDA

Prints a table and writes JSON (``--out``, default ``bench/results/hf_experts_<device>.json``).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import platform
from pathlib import Path

import torch
from common import routing_ids, time_ms

import relibra_moe.integrations.hf_experts  # noqa: F401  (registers "relibra")
from relibra_moe.integrations.hf_tiny import FAMILIES, tiny_config, tiny_model

IMPLS = ("eager", "grouped_mm", "relibra")
# the config field of the expert FFN width (the others use moe_intermediate_size)
FFN_KEY = {"mixtral": "intermediate_size", "olmoe": "intermediate_size", "gpt_oss": "intermediate_size"}


def make_experts(family: str, hidden: int, ffn: int, experts: int, top_k: int, seed: int,
                 device: torch.device) -> torch.nn.Module:
    """One HF fused experts module of ``family`` at the given size, random weights (std 1/sqrt(fan-in))."""
    cls = type(next(m for m in tiny_model(family, num_layers=2).modules() if type(m).__name__.endswith("Experts")))
    cfg = tiny_config(family, num_layers=2, num_experts=experts, top_k=top_k, hidden_size=hidden,
                      **{FFN_KEY.get(family, "moe_intermediate_size"): ffn})
    mod = cls(cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in mod.named_parameters():
            fan_in = hidden if "gate_up" in name else ffn
            std = 0.02 if name.endswith("bias") else fan_in ** -0.5
            p.copy_(torch.randn(p.shape, generator=g) * std)
    return mod.to(device)


def routing(tokens: int, experts: int, top_k: int, skew: float, seed: int, device: torch.device):
    """``top_k_index [T, k]`` (distinct experts per token, popularity ~ rank^-skew: ``common.routing_ids``
    ``"zipf"``) and softmax routing weights ``[T, k]``."""
    ids = routing_ids(tokens, top_k, experts, device, "zipf", seed=seed, skew=skew)
    g = torch.Generator().manual_seed(seed)
    return ids, torch.softmax(torch.randn(tokens, top_k, generator=g), dim=-1).to(device)


def run_impl(mod: torch.nn.Module, impl: str, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor,
             dy: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Forward + backward of ``sum(y * dy)`` with ``impl``: (output, {input and parameter grads})."""
    mod.config._experts_implementation = impl
    mod.zero_grad(set_to_none=True)
    xi = x.detach().requires_grad_(True)
    y = mod(xi, ids, w)
    (y.float() * dy).sum().backward()
    grads = {"x": xi.grad.detach().clone()} | {n: p.grad.detach().clone() for n, p in mod.named_parameters()}
    return y.detach(), grads


def time_impl(mod, impl, x, ids, w, dy, iters: int, warmup: int) -> dict[str, float]:
    """Median CUDA ms of the forward and of forward + backward (``common.time_ms``)."""
    mod.config._experts_implementation = impl

    def fwd():
        return mod(x.detach().requires_grad_(True), ids, w)

    return {"fwd_ms": time_ms(fwd, iters, warmup), "fwd_bwd_ms": time_ms(lambda: (fwd().float() * dy).sum().backward(),
                                                                           iters, warmup)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--families", nargs="+", default=list(FAMILIES), choices=FAMILIES)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--ffn", type=int, default=32)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--topk", type=int, default=4, help="k (spelled as in earlier results)")
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--skew", type=float, default=1.0)
    ap.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16",
                    help="dtype of the CUDA timings (correctness is always fp32)")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=str, default=None)
    args = ap.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    rows = []
    for i, fam in enumerate(args.families):  # each family its own weights (seed + i)
        mod = make_experts(fam, args.hidden, args.ffn, args.experts, args.topk, args.seed + i, device)
        ids, w = routing(args.tokens, args.experts, args.topk, args.skew, args.seed, device)
        g = torch.Generator().manual_seed(args.seed + 1)
        x = torch.randn(args.tokens, args.hidden, generator=g).to(device)
        dy = torch.randn(args.tokens, args.hidden, generator=g).to(device)
        ref_y, ref_g = run_impl(mod, "eager", x, ids, w, dy)
        row = {"family": fam, "experts_class": type(mod).__name__}
        for impl in IMPLS[1:]:
            try:
                y, gr = run_impl(mod, impl, x, ids, w, dy)
            except Exception as exc:  # noqa: BLE001 - grouped_mm may be unavailable on this device / dtype
                row[f"{impl}_error"] = f"{type(exc).__name__}: {exc}"[:200]
                continue
            row[f"{impl}_out_err"] = float((y - ref_y).abs().max())
            row[f"{impl}_grad_err"] = max(float((gr[k] - ref_g[k]).abs().max()) for k in ref_g)
        if device.type == "cuda":
            dtype = getattr(torch, args.dtype)
            mod_t = mod.to(dtype)
            xt, wt = x.to(dtype), w.to(dtype)
            for impl in IMPLS:
                if f"{impl}_error" in row:
                    continue
                row[f"{impl}_timing"] = time_impl(mod_t, impl, xt, ids, wt, dy, args.iters, args.warmup)
        rows.append(row)
    print(f"{'family':<12} {'impl':<11} {'max|out-eager|':>15} {'max|grad-eager|':>16} {'fwd ms':>8} "
          f"{'fwd+bwd ms':>11}")
    for r in rows:
        for impl in IMPLS[1:]:
            if f"{impl}_error" in r:
                print(f"{r['family']:<12} {impl:<11} {r[f'{impl}_error']}")
                continue
            t = r.get(f"{impl}_timing", {})
            fw = f"{t['fwd_ms']:8.3f}" if t else f"{'n/a':>8}"
            fb = f"{t['fwd_bwd_ms']:11.3f}" if t else f"{'n/a':>11}"
            print(f"{r['family']:<12} {impl:<11} {r[f'{impl}_out_err']:15.2e} {r[f'{impl}_grad_err']:16.2e} {fw} {fb}")
        t = r.get("eager_timing")
        if t:
            print(f"{r['family']:<12} {'eager':<11} {'':>15} {'':>16} {t['fwd_ms']:8.3f} {t['fwd_bwd_ms']:11.3f}")
    from relibra_moe.triton_kernels.backend import INTERPRET

    out = {"device": torch.cuda.get_device_name() if device.type == "cuda" else platform.processor() or "cpu",
           "triton_interpret": INTERPRET, "torch": torch.__version__, "args": vars(args), "rows": rows,
           "date": _dt.date.today().isoformat()}
    path = Path(args.out or Path(__file__).parent / "results" / f"hf_experts_{device.type}.json")
    path.write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
