"""How the planners judge a finished candidate plan: the ``StepEvaluator`` interface and its one implementation on
the step simulator (``SimulatedStep``).

The portfolio (``portfolio``) and its lower bounds (``bounds``) read a candidate's step time and the re-layout
time of a move only through a ``StepEvaluator`` (``PlanContext.evaluator``), so they can be run against another
judge (a measured step, a test double) and this is the one planners module that imports the simulator.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np

from ..plan import BatchPlan, Placement
from ..sim import reorder_traffic, simulate_loads
from ..specs import ClusterSpec, ModelSpec

__all__ = ["CandidateStep", "StepEvaluator", "SimulatedStep", "SIMULATED_STEP"]


class CandidateStep(Protocol):
    """What a judge reports of one candidate's step (seconds; ``sim.StepTime`` is one)."""

    @property
    def step_s(self) -> float: ...  # the whole step, moves and exposed replica traffic included

    @property
    def t_moe_s(self) -> float: ...  # the sum of the forward T_MoE over (micro-batch, layer)

    @property
    def reorder_s(self) -> float: ...  # the once-per-batch re-layout from the previous homes

    @property
    def replica_exposed_s(self) -> float: ...  # replica push / pull not hidden behind its window

    @property
    def replica_mode(self) -> str: ...  # how the replicas are fetched ("per-layer", ...)


class StepEvaluator(Protocol):
    """The planners' judge of a candidate plan."""

    def step(self, plan: BatchPlan, lengths: np.ndarray, x: np.ndarray, model: ModelSpec, cluster: ClusterSpec,
             previous: Placement, optimizer_bytes_per_param: float) -> CandidateStep:
        """The step of ``plan`` (not validated) for samples of ``lengths [N]`` tokens with loads ``x [M, L, G, E]``,
        experts moved from ``previous``; every expert carries ``optimizer_bytes_per_param`` optimizer bytes."""
        ...

    def relayout_seconds(self, previous: Placement, placement: Placement, model: ModelSpec, cluster: ClusterSpec,
                         optimizer_bytes_per_param: float) -> float:
        """Seconds to move the experts from ``previous`` to ``placement`` (the ``reorder_s`` that ``step``
        charges for the same move)."""
        ...


@dataclass(frozen=True)
class SimulatedStep:
    """``StepEvaluator`` on the step simulator: ``sim.simulate_loads`` (as ``sim.simulate_step`` and
    ``steady.evaluate_plan`` run it) and ``sim.reorder_traffic``."""

    def step(self, plan: BatchPlan, lengths: np.ndarray, x: np.ndarray, model: ModelSpec, cluster: ClusterSpec,
             previous: Placement, optimizer_bytes_per_param: float) -> CandidateStep:
        return simulate_loads(plan, lengths, x, model, cluster, previous=previous,
                              optimizer_bytes_per_param=optimizer_bytes_per_param, validate=False)

    def relayout_seconds(self, previous: Placement, placement: Placement, model: ModelSpec, cluster: ClusterSpec,
                         optimizer_bytes_per_param: float) -> float:
        return reorder_traffic(previous, placement, model, cluster, optimizer_bytes_per_param)[0]


SIMULATED_STEP = SimulatedStep()
"""The default judge of every ``PlanContext``."""
