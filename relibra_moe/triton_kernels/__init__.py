"""triton_kernels of relibra_moe."""
