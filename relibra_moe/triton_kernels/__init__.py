"""Triton kernels of the MoE layer, each with a torch reference beside it (import-cheap: no submodule
is imported here).

Modules: ``backend`` (Triton vs reference choice), ``routing`` (metadata and tile schedule),
``permute`` (permute / combine), ``grouped_gemm`` (grouped GEMM fwd/dX/dW, SwiGLU experts),
``replica_copy`` (persistent copy into replica slots and gradient add-back).
"""
