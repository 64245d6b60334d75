"""The ``@triton.jit`` kernels, one module per public host module of :mod:`relibra_moe.triton_kernels`.

Private: only the host module of the same name launches them; everything else goes through the host
functions (which pick the torch reference or the kernel, check arguments, and allocate outputs)."""
