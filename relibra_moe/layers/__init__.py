"""The MoE layer and its parts (nn.Modules and autograd glue; see docs/architecture.md, "Module map").

- ``router``: ``TopKRouter`` (softmax / DeepSeek-V3 sigmoid with group-limited selection) with replay.
- ``experts``: grouped SwiGLU experts over home experts + replica slots (the Triton grouped GEMM).
- ``replica_buffer``: ``LayerSharedReplicaBuffer`` (r slots per rank shared by all layers),
  ``ResidentReplicas`` (a layer's own slots for resident plans, filled once per batch), ``replica_buffer_bytes``.
- ``dispatch``: the ``Dispatcher`` protocol, ``LocalDispatcher``, ``AllToAllDispatcher``,
  ``DeepEPDispatcher``.
- ``moe``: ``ReplayBalancedMoE`` (its forward in stages: route, agree on errors across the EP group,
  destinations, dispatch, experts, combine) and ``materialize_counts`` (largest-remainder token splits).
- ``replay``: ``replay`` (``relibra_moe.replay``, the one replay context manager: recorded traces or ids and
  the plan of one micro-batch for every layer), ``LayerReplay``, ``layout_ids``.
- ``relayout``: ``relayout`` (move experts, grads and optimizer state to a new placement).
- ``data_parallel``: EP layers under DDP / accelerate (experts kept out of the reducer, expert gradients
  scaled like DDP's average, ``clip_grad_norm_`` over the global norm).
- ``testing``: ``run_group`` (spawn a local process group; tests and benchmarks).

Submodules are imported on use (``relibra_moe.layers.moe``, ...); the package itself stays light.
"""
