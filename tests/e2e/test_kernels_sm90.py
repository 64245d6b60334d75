"""Ahead-of-time compile of every Triton kernel for sm_90 (H100/H200) without a GPU.

Triton's bundled ptxas compiles the kernels for a GPUTarget without a device. This catches what the
CPU interpreter cannot (unsupported constructs, type errors in compiled code) and checks the
resources of every tile config of :mod:`relibra_moe.triton_kernels.heuristics` (forward with each
epilogue, dW, the split reduction) and of the permute / replica kernels: ``ptxas -v`` must report no
register spills, and shared memory must fit sm_90's 227 KB per block. It also guards the
performance-critical lowering: the 64- and 128-row grouped GEMMs and dW must use Hopper's wgmma and
software-pipelined cp.async loads, and so must the replica copy and add-back loops. Runs in a
subprocess because TRITON_INTERPRET (set for the test session) is read when the kernels are
decorated.
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
    import json, os, re, subprocess, tempfile, time, warnings
    warnings.simplefilter("ignore")
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import get_ptxas
    from triton.compiler import ASTSource
    from relibra_moe.triton_kernels import grouped_gemm as gg, replica_copy as rc
    from relibra_moe.triton_kernels._details import grouped_gemm as ggk, permute as pmk, replica_copy as rck
    from relibra_moe.triton_kernels.heuristics import DW_CONFIGS, GEMM_CONFIGS

    target = GPUTarget("cuda", 90, 32)
    ptxas = get_ptxas(90).path
    tmp = tempfile.mkdtemp()
    out = {}

    def resources(tag, ptx):
        # ptxas -v as Triton runs it (same register-allocation option), parsed for registers and spills
        src = os.path.join(tmp, tag + ".ptx")
        with open(src, "w") as f:
            f.write(ptx)
        log = subprocess.run([ptxas, "-v", "--regAllocOptLevel=2", "--gpu-name=sm_90a", src, "-o", src + ".o"],
                             capture_output=True, text=True, check=True).stderr
        regs = [int(v) for v in re.findall(r"Used (\d+) registers", log)]
        spills = [int(a) + int(b) for a, b in re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)]
        assert regs and spills, log
        return max(regs), sum(spills)

    def build(tag, fn, sig, consts, div16, **opts):
        sig = {k: v for k, v in sig.items() if k not in consts}
        sig.update({k: "constexpr" for k in consts})
        attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in div16 if n not in consts}
        t0 = time.time()
        k = triton.compile(ASTSource(fn, sig, consts, attrs), target=target, options=opts)
        g = k.asm["ttgir"]
        regs, spill = resources(tag, k.asm["ptx"])
        out[tag] = dict(smem=k.metadata.shared, wgmma=g.count("warp_group_dot "),
                        cp_async=g.count("async_copy_global_to_local"), regs=regs, spill=spill,
                        warps=opts.get("num_warps", 4), seconds=round(time.time() - t0, 2))

    I = "i32"

    def gemm_sig(t):
        return dict(x_ptr=t, w_ptr=t, w_off_ptr="*i64", offsets_ptr="*i32", tile_slot_ptr="*i32", tile_row_ptr="*i32",
                    out_ptr=t, h_ptr=t, a_ptr=t, R=I, N=I, K=I, num_tiles=I, stride_xm=I, stride_ws=I, stride_wk=I,
                    stride_wn=I, stride_om=I, stride_hm=I, stride_am=I)

    gemm_div = ["x_ptr", "w_ptr", "out_ptr", "h_ptr", "a_ptr", "N", "K", "stride_xm", "stride_ws", "stride_wk",
                "stride_wn", "stride_om", "stride_hm", "stride_am"]
    gmm = ggk.grouped_mm_kernel
    # every forward config of the table, with each epilogue, as the layer runs it: ExpertWeights (home +
    # replica slots) in the HF layout
    for name, c in GEMM_CONFIGS.items():
        f32 = name.startswith("f32")
        t = "*fp32" if f32 else "*bf16"
        base = dict(INDIRECT=True, W_ALIGNED=True, UPCAST=False, RNE=False, PRECISION="tf32" if f32 else None,
                    EVEN_K=True, STORE_H=True, BLOCK_M=c.block_m, BLOCK_K=c.block_k, GROUP_M=c.group_m, stride_wk=1)
        opts = dict(num_warps=c.num_warps, num_stages=c.num_stages)
        build(f"gemm:{name}:plain", gmm, gemm_sig(t), dict(base, EPILOGUE=ggk.EPI_PLAIN, BLOCK_N=c.block_n), gemm_div,
              **opts)
        for epi, ename in ((ggk.EPI_SWIGLU, "swiglu"), (ggk.EPI_SWIGLU_BWD, "swiglu_bwd")):
            if epi == ggk.EPI_SWIGLU_BWD and not c.swiglu_bwd:
                continue
            build(f"gemm:{name}:{ename}", gmm, gemm_sig(t), dict(base, EPILOGUE=epi, BLOCK_N=c.block_n // 2),
                  gemm_div, **opts)
    c = GEMM_CONFIGS["m128_n256"]
    build("gemm:m128_n256:plain_row_major_dense", gmm, gemm_sig("*bf16"),
          dict(INDIRECT=False, W_ALIGNED=False, UPCAST=False, RNE=False, PRECISION=None, EVEN_K=True, STORE_H=False,
               EPILOGUE=ggk.EPI_PLAIN, BLOCK_M=c.block_m, BLOCK_N=c.block_n, BLOCK_K=c.block_k, GROUP_M=c.group_m,
               stride_wn=1), gemm_div, num_warps=c.num_warps, num_stages=c.num_stages)

    def dw_sig(t):
        return dict(x_ptr=t, dy_ptr=t, offsets_ptr="*i32", order_ptr="*i32", seg_ptr="*i32", seg_slot_ptr="*i32",
                    dest_off_ptr="*i64", nsplit_ptr="*i32", part_ptr="*i32", ws_ptr="*fp32", dw_ptr=t, N=I, K=I,
                    stride_xm=I, stride_dm=I, stride_gk=I, stride_gn=I)

    dw_div = ["x_ptr", "dy_ptr", "ws_ptr", "dw_ptr", "N", "K", "stride_xm", "stride_dm", "stride_gk", "stride_gn"]
    for name, c in DW_CONFIGS.items():
        f32 = name.startswith("f32")
        t = "*fp32" if f32 else "*bf16"
        base = dict(UPCAST=False, RNE=False, PRECISION="tf32" if f32 else None, SPLIT_MAX=gg.DW_SPLIT_MAX,
                    BLOCK_M=c.block_m, BLOCK_K=c.block_k, BLOCK_N=c.block_n)
        opts = dict(num_warps=c.num_warps, num_stages=c.num_stages)
        build(f"dw:{name}:hf_layout", ggk.grouped_mm_dw_kernel, dw_sig(t), dict(base, stride_gk=1), dw_div, **opts)
        build(f"dw:{name}:row_major", ggk.grouped_mm_dw_kernel, dw_sig(t), dict(base, stride_gn=1), dw_div, **opts)
    for t in ("*bf16", "*fp32"):
        rk, rn = gg.DW_REDUCE_TILE
        build(f"dw_reduce:{t[1:]}", ggk.dw_reduce_kernel, dict(hot_ptr="*i32", nsplit_ptr="*i32", part_ptr="*i32",
              dest_off_ptr="*i64", ws_ptr="*fp32", dw_ptr=t, N=I, K=I, stride_gk=I, stride_gn=I),
              dict(RNE=False, BLOCK_K=rk, BLOCK_N=rn, stride_gk=1), ["ws_ptr", "dw_ptr", "N", "K"], num_warps=4)
    build("permute", pmk.permute_kernel, dict(x_ptr="*bf16", gather_ptr="*i32", scale_ptr="*fp32", out_ptr="*bf16", R=I,
          H=I, stride_x=I, stride_o=I), dict(TOP_K=8, HAS_SCALE=True, RNE=False, BLOCK_R=4, BLOCK_H=1024),
          ["x_ptr", "out_ptr", "H", "stride_x", "stride_o"], num_warps=4)
    build("combine", pmk.combine_kernel, dict(y_ptr="*bf16", scatter_ptr="*i32", w_ptr="*fp32", out_ptr="*bf16", T=I,
          H=I, stride_y=I, stride_o=I), dict(TOP_K=8, RNE=False, BLOCK_T=2, BLOCK_H=1024),
          ["y_ptr", "out_ptr", "H", "stride_y", "stride_o"], num_warps=4)
    build("rowdot", pmk.rowdot_kernel, dict(a_ptr="*bf16", b_ptr="*bf16", scatter_ptr="*i32", out_ptr="*fp32", T=I, H=I,
          stride_a=I, stride_b=I), dict(TOP_K=8, BLOCK_T=16, BLOCK_H=256), ["a_ptr", "b_ptr", "H"], num_warps=4)
    warps = rc.COMPILED_WARPS
    build("copy_rows", rck.copy_rows_kernel, dict(src_ptr="*bf16", src_idx_ptr="*i64", dst_ptr="*bf16",
          dst_idx_ptr="*i64", D=I, stride_src=I, stride_dst=I, num_items=I, chunks_per_row=I),
          dict(NUM_PROGRAMS=16, NUM_STAGES=rc.COMPILED_STAGES, BLOCK=rc.COPY_BLOCK),
          ["src_ptr", "dst_ptr", "D", "stride_src", "stride_dst"], num_warps=warps)
    build("add_rows", rck.add_rows_kernel, dict(slot_ptr="*bf16", slot_idx_ptr="*i32", home_ptr="*bf16",
          home_idx_ptr="*i32", run_ptr="*i32", D=I, stride_slot=I, stride_home=I, num_items=I, chunks_per_row=I,
          num_pairs=I), dict(NUM_PROGRAMS=16, NUM_STAGES=rc.COMPILED_STAGES, RUN=rc.ADD_RUN, RNE=False,
          BLOCK=rc.ADD_BLOCK),
          ["slot_ptr", "home_ptr", "D", "stride_slot", "stride_home"], num_warps=warps)
    print("RESULT" + json.dumps(out))
    """
)

#: The per-block shared-memory limit of sm_90 (H100 / H200): 227 KB.
SM90_SMEM_LIMIT = 227 * 1024


def _ptxas() -> Path | None:
    try:
        import triton
    except ImportError:
        return None
    p = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    return p if p.exists() else None


@pytest.mark.timeout(900)
def test_kernels_compile_for_sm90():
    if _ptxas() is None:
        pytest.skip("Triton's bundled ptxas not found")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=880,
        cwd=Path(__file__).resolve().parents[2],
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT"))
    res = json.loads(line.removeprefix("RESULT"))
    from relibra_moe.triton_kernels.heuristics import DW_CONFIGS, GEMM_CONFIGS

    n_bwd = sum(c.swiglu_bwd for c in GEMM_CONFIGS.values())
    assert len(res) == 2 * len(GEMM_CONFIGS) + n_bwd + 1 + 2 * len(DW_CONFIGS) + 2 + 5
    for tag, r in res.items():
        assert r["smem"] <= SM90_SMEM_LIMIT, (tag, r)  # fits one block's shared memory
        assert r["spill"] == 0, (tag, r)  # no register spills (ptxas -v)
        assert r["regs"] * 32 * r["warps"] <= 64 * 1024, (tag, r)  # the register file holds one block
    for name, c in GEMM_CONFIGS.items():
        if c.block_m < 64:  # 16- / 32-row tiles run mma.sync, not a 64-row wgmma
            continue
        for epi in ("plain", "swiglu", "swiglu_bwd")[: 3 if c.swiglu_bwd else 2]:
            r = res[f"gemm:{name}:{epi}"]
            assert r["wgmma"] >= (2 if epi == "swiglu" else 1), (name, epi, r)  # Hopper tensor-core MMA
            assert r["cp_async"] >= (3 if epi == "swiglu" else 2), (name, epi, r)  # operands software-pipelined
            assert r["smem"] >= 2 * (c.block_m + c.block_n) * c.block_k * 2, (name, epi, r)  # >= 2 stages in flight
    for name in DW_CONFIGS:
        for layout in ("hf_layout", "row_major"):
            r = res[f"dw:{name}:{layout}"]
            assert r["wgmma"] >= 1 and r["cp_async"] >= 2, (name, layout, r)
    assert res["copy_rows"]["cp_async"] >= 1, res["copy_rows"]  # the persistent copy loop is pipelined
    assert res["add_rows"]["cp_async"] >= 2, res["add_rows"]  # so is the add-back (home and slot rows)
