"""Where the planning loop's tasks run: the ``TaskExecutor`` protocol and the plain executors.

The planning loop (``strategies.relibra_inter`` and the replication pass) cuts its work into independent
tasks (a reorder layer x seed, a locality pass, a chunk of replication cells) and hands them to an
executor's ``map``. ``plan_batch`` uses ``InlineExecutor`` (one worker) or ``PoolExecutor`` (a process
pool); the ``Planner`` service passes its own, which adds a deadline, worker-death handling and Ray
(``service.py``). Whatever the executor, the loop is the same code, so without fallbacks the plan is
the same.

A task that did not finish (deadline passed, worker died) comes back as a ``TaskFailed``; the loop then
falls back for that task's cells (a reorder layer keeps its previous homes, the locality pass keeps the
samples where they are, a replication cell gets no replicas) and records it in ``FallbackLog``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from ..validate import check_int

__all__ = ["TaskExecutor", "TaskFailed", "InlineExecutor", "PoolExecutor", "FallbackLog", "default_executor"]

Key = tuple[str, Any]
"""A task's name: (kind, key) with kind "reorder" (key (layer, seed)), "locality" (round), "replicate" (cells),
"locality-replicas" (layers)."""


class TaskFailed:
    """Result of a task that did not finish (missed the deadline, lost its worker); ``reason`` says which."""

    __slots__ = ("reason",)

    def __init__(self, reason: str) -> None:
        self.reason = reason

    def __repr__(self) -> str:
        return f"TaskFailed({self.reason!r})"


@runtime_checkable
class TaskExecutor(Protocol):
    """Runs planning tasks: ``map(fn, args, keys)`` returns ``[fn(*a) or TaskFailed]`` in task order.

    ``expired`` tells the loop to skip optional work (the final reorder, the migration pricing) because
    its deadline has passed; executors without a deadline return False. ``workers`` is the parallelism
    the loop sizes its tasks for (seeds per layer, cells per chunk).
    """

    workers: int

    def map(self, fn: Callable[..., Any], args: Sequence[tuple], keys: Sequence[Key]) -> list[Any]:
        ...

    @property
    def expired(self) -> bool:
        ...


class InlineExecutor:
    """Every task in this process, in order (the executor of ``plan_batch`` with ``workers=1``)."""

    workers = 1

    def map(self, fn: Callable[..., Any], args: Sequence[tuple], keys: Sequence[Key]) -> list[Any]:
        return [fn(*a) for a in args]

    @property
    def expired(self) -> bool:
        return False


class PoolExecutor:
    """Tasks on a process pool of ``workers`` started for each ``map`` call (``plan_batch`` with workers > 1).

    A batch of fewer than two tasks runs in this process. Exceptions of a task propagate."""

    def __init__(self, workers: int) -> None:
        self.workers = check_int("workers", workers, 1)

    def map(self, fn: Callable[..., Any], args: Sequence[tuple], keys: Sequence[Key]) -> list[Any]:
        if self.workers == 1 or len(args) < 2:
            return [fn(*a) for a in args]
        with ProcessPoolExecutor(max_workers=self.workers) as pool:
            futs = [pool.submit(fn, *a) for a in args]
            return [f.result() for f in futs]

    @property
    def expired(self) -> bool:
        return False


def default_executor(workers: int) -> InlineExecutor | PoolExecutor:
    """``InlineExecutor`` for one worker, else a ``PoolExecutor``."""
    return InlineExecutor() if check_int("workers", workers, 1) == 1 else PoolExecutor(workers)


@dataclass
class FallbackLog:
    """Cells that fell back because their task failed: reorder layers, locality passes, replication cells,
    and whole-strategy tasks (``eplb``, ``eplb-history``: their layout is one task; on failure the plan
    keeps the previous homes, else the static ones, without replicas)."""

    reorder: list[int] = field(default_factory=list)
    locality: int = 0
    replicate: list[list[int]] = field(default_factory=list)
    strategy: int = 0

    @property
    def count(self) -> int:
        """Fallen-back cells in all."""
        return len(self.reorder) + self.locality + len(self.replicate) + self.strategy

    def as_dict(self) -> dict[str, Any]:
        """``stats.fallback_cells`` of a Planner plan (``"strategy"`` only when a whole-strategy task fell back)."""
        out: dict[str, Any] = {"reorder": list(self.reorder), "locality": self.locality,
                               "replicate": list(self.replicate)}
        if self.strategy:
            out["strategy"] = self.strategy
        return out
