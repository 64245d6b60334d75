"""Triton kernels of the MoE layer, each with a torch reference beside it (import-cheap: no submodule
is imported here).

Modules: ``backend`` (Triton vs reference choice), ``routing`` (metadata and tile schedule),
``permute`` (permute / combine), ``grouped_gemm`` (grouped GEMM fwd/dX/dW, SwiGLU experts),
``heuristics`` (tile configs from the shapes),
``replica_copy`` (persistent copy into replica slots and gradient add-back).

One MoE layer call::

    meta = routing_metadata(slot_ids, num_slots)          # slot_ids [T, k], -1 = not served here
    xs = permute(x, meta)                                  # [T, H] -> [R, H], slot-sorted rows
    ys = swiglu_experts(xs, meta, w_gate_up, w_down)       # tensors or ExpertWeights
    out = combine(ys, meta, gates)                         # [R, H] -> [T, H], fp32 weighted sum
"""
