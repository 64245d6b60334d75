"""Ahead-of-time compile of every Triton kernel for sm_90 (H100/H200) without a GPU.

Triton's bundled ptxas compiles the kernels for a GPUTarget without a device. This catches what the
CPU interpreter cannot (unsupported constructs, type errors in compiled code, shared-memory
overflow) and guards the performance-critical lowering: the grouped GEMMs must use Hopper's wgmma
and software-pipelined cp.async loads. Runs in a subprocess because TRITON_INTERPRET (set for the
test session) is read when the kernels are decorated.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

SCRIPT = textwrap.dedent(
    r"""
    import json, os, warnings
    warnings.simplefilter("ignore")
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from relibra_moe.triton_kernels import grouped_gemm as gg, permute as pm, replica_copy as rc

    target = GPUTarget("cuda", 90, 32)
    out = {}

    def build(tag, fn, sig, consts, div16, **opts):
        sig = {k: v for k, v in sig.items() if k not in consts}
        sig.update({k: "constexpr" for k in consts})
        attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in div16 if n not in consts}
        k = triton.compile(ASTSource(fn, sig, consts, attrs), target=target, options=opts)
        g = k.asm["ttgir"]
        out[tag] = dict(smem=k.metadata.shared, wgmma=g.count("warp_group_dot "),
                        cp_async=g.count("async_copy_global_to_local"))

    I = "i32"
    gemm_sig = dict(x_ptr="*bf16", w_ptr="*bf16", w_off_ptr="*i64", offsets_ptr="*i32", tile_slot_ptr="*i32",
                    tile_row_ptr="*i32", out_ptr="*bf16", R=I, N=I, K=I, num_tiles=I, stride_xm=I, stride_ws=I,
                    stride_wk=I, stride_wn=I, stride_om=I)
    gemm_div = ["x_ptr", "w_ptr", "out_ptr", "N", "K", "stride_xm", "stride_ws", "stride_wk", "stride_wn", "stride_om"]
    cfg = gg._fwd_config(1536, 2048, __import__("torch").bfloat16)  # the heuristic config of Qwen3-30B gate_up
    opts = dict(num_warps=cfg.pop("num_warps"), num_stages=cfg.pop("num_stages"))
    base = dict(INDIRECT=False, W_ALIGNED=False, UPCAST=False, RNE=False, PRECISION=None, EVEN_K=True,
                BLOCK_M=64, **cfg)
    gmm = gg._grouped_mm_kernel
    build("gemm_hf_layout", gmm, gemm_sig, dict(base, stride_wk=1), gemm_div, **opts)
    build("gemm_row_major", gmm, gemm_sig, dict(base, stride_wn=1), gemm_div, **opts)
    cfg128 = gg._fwd_config(1536, 2048, __import__("torch").bfloat16, 128)
    opts128 = dict(num_warps=cfg128.pop("num_warps"), num_stages=cfg128.pop("num_stages"))
    build("gemm_bm128", gmm, gemm_sig, dict(base, stride_wk=1, BLOCK_M=128, **cfg128), gemm_div, **opts128)
    ew = dict(base, stride_wk=1, INDIRECT=True, W_ALIGNED=True)
    build("gemm_expert_weights", gmm, gemm_sig, ew, gemm_div, **opts)
    build("gemm_fp32", gg._grouped_mm_kernel, {**gemm_sig, "x_ptr": "*fp32", "w_ptr": "*fp32", "out_ptr": "*fp32"},
          dict(base, stride_wn=1, PRECISION="tf32", BLOCK_K=32), gemm_div, num_warps=8, num_stages=3)
    dw_sig = dict(x_ptr="*bf16", dy_ptr="*bf16", offsets_ptr="*i32", dw_ptr="*bf16", N=I, K=I, stride_xm=I, stride_dm=I,
                  stride_gs=I, stride_gk=I, stride_gn=I)
    dw_c = dict(UPCAST=False, RNE=False, PRECISION=None, BLOCK_M=64, BLOCK_K=128, BLOCK_N=128)
    dw_div = ["x_ptr", "dy_ptr", "dw_ptr", "N", "K", "stride_xm", "stride_dm", "stride_gs", "stride_gk", "stride_gn"]
    build("dw_row_major", gg._grouped_mm_dw_kernel, dw_sig, dict(dw_c, stride_gn=1), dw_div, num_warps=8, num_stages=3)
    build("dw_hf_layout", gg._grouped_mm_dw_kernel, dw_sig, dict(dw_c, stride_gk=1), dw_div, num_warps=8, num_stages=3)
    build("permute", pm._permute_kernel, dict(x_ptr="*bf16", gather_ptr="*i32", scale_ptr="*fp32", out_ptr="*bf16", R=I,
          H=I, stride_x=I, stride_o=I), dict(TOPK=8, HAS_SCALE=True, RNE=False, BLOCK_R=4, BLOCK_H=1024),
          ["x_ptr", "out_ptr", "H", "stride_x", "stride_o"], num_warps=4)
    build("combine", pm._combine_kernel, dict(y_ptr="*bf16", scatter_ptr="*i32", w_ptr="*fp32", out_ptr="*bf16", T=I,
          H=I, stride_y=I, stride_o=I), dict(TOPK=8, RNE=False, BLOCK_T=2, BLOCK_H=1024),
          ["y_ptr", "out_ptr", "H", "stride_y", "stride_o"], num_warps=4)
    build("rowdot", pm._rowdot_kernel, dict(a_ptr="*bf16", b_ptr="*bf16", scatter_ptr="*i32", out_ptr="*fp32", T=I, H=I,
          stride_a=I, stride_b=I), dict(TOPK=8, BLOCK_T=16, BLOCK_H=256), ["a_ptr", "b_ptr", "H"], num_warps=4)
    build("copy_rows", rc._copy_rows_kernel, dict(src_ptr="*bf16", src_idx_ptr="*i64", dst_ptr="*bf16",
          dst_idx_ptr="*i64", D=I, stride_src=I, stride_dst=I, num_items=I, chunks_per_row=I),
          dict(NUM_PROGRAMS=16, NUM_STAGES=3, BLOCK=16384), ["src_ptr", "dst_ptr", "D", "stride_src", "stride_dst"],
          num_warps=16)
    build("add_rows", rc._add_rows_kernel, dict(slot_ptr="*bf16", slot_idx_ptr="*i32", home_ptr="*bf16",
          home_idx_ptr="*i32", seg_end_ptr="*i32", D=I, stride_slot=I, stride_home=I, num_items=I, chunks_per_row=I),
          dict(NUM_PROGRAMS=16, RNE=False, BLOCK=8192), ["slot_ptr", "home_ptr", "D"], num_warps=8)
    print("RESULT" + json.dumps(out))
    """
)


def _ptxas() -> Path | None:
    try:
        import triton
    except ImportError:
        return None
    p = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    return p if p.exists() else None


@pytest.mark.timeout(300)
def test_kernels_compile_for_sm90():
    if _ptxas() is None:
        pytest.skip("Triton's bundled ptxas not found")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=280,
        cwd=Path(__file__).resolve().parents[1],
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT"))
    res = json.loads(line.removeprefix("RESULT"))
    assert len(res) == 12
    for tag, r in res.items():
        assert r["smem"] <= 227 * 1024, (tag, r)
    for tag in (
        "gemm_hf_layout",
        "gemm_row_major",
        "gemm_bm128",
        "gemm_expert_weights",
        "dw_row_major",
        "dw_hf_layout",
    ):
        assert res[tag]["wgmma"] >= 1, (tag, res[tag])  # Hopper tensor-core MMA
        assert res[tag]["cp_async"] >= 2, (tag, res[tag])  # both operands software-pipelined
        assert res[tag]["smem"] >= 2 * 24 * 1024, (tag, res[tag])  # at least two stages in flight
    assert res["copy_rows"]["cp_async"] >= 1, res["copy_rows"]  # the persistent copy loop is pipelined
