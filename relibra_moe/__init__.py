"""relibra-moe: routing-replay load balancing for MoE training in reinforcement learning.

The public API is imported lazily, so ``import relibra_moe`` stays cheap and the planners work
without importing torch or triton.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# public name -> module that defines it
_EXPORTS: dict[str, str] = {
    "TraceError": "relibra_moe.errors",
    "PlanError": "relibra_moe.errors",
    "ReplayError": "relibra_moe.errors",
    "RoutingTrace": "relibra_moe.trace",
    "TraceBatch": "relibra_moe.trace",
    "ModelSpec": "relibra_moe.specs",
    "ClusterSpec": "relibra_moe.specs",
    "model_preset": "relibra_moe.specs",
    "cluster_preset": "relibra_moe.specs",
    "load_cluster_profile": "relibra_moe.specs",
    "moe_cost": "relibra_moe.cost",
    "Placement": "relibra_moe.plan",
    "SamplePlacement": "relibra_moe.plan",
    "ReplicaPlan": "relibra_moe.plan",
    "BatchPlan": "relibra_moe.plan",
    "PlanStats": "relibra_moe.plan_stats",
    "Planner": "relibra_moe.planners.service",
    "PlanOptions": "relibra_moe.planners.options",
    "plan_batch": "relibra_moe.planners.strategies",
    "score_plan": "relibra_moe.evaluate",
    "PlanScore": "relibra_moe.evaluate",
    "simulate_step": "relibra_moe.sim",
    "StepTime": "relibra_moe.sim",
    "StepResult": "relibra_moe.sim",
    "ReplayBalancedMoE": "relibra_moe.layers.moe",
    "LayerSharedReplicaBuffer": "relibra_moe.layers.replica_buffer",
    "replay": "relibra_moe.layers.replay",
    "swap_moe_blocks": "relibra_moe.integrations.hf",
    "RoutingRecorder": "relibra_moe.integrations.hf",
    "relayout": "relibra_moe.layers.relayout",
}

__all__ = sorted(_EXPORTS) + ["__version__"]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'relibra_moe' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
