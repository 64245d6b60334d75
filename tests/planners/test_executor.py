"""executor: the plain executors run every task in order (inline or on a pool, same results), the log counts
fallen-back cells."""

from __future__ import annotations

import operator

import pytest

from relibra_moe.errors import PlanError
from relibra_moe.planners.executor import (
    FallbackLog,
    InlineExecutor,
    PoolExecutor,
    TaskExecutor,
    TaskFailed,
    default_executor,
)

ARGS = [(2, 3), (5, 7), (11, 13)]
KEYS = [("reorder", (0, 0)), ("reorder", (1, 0)), ("locality", 0)]


def test_inline_runs_in_order_and_never_expires():
    ex = InlineExecutor()
    assert ex.map(operator.mul, ARGS, KEYS) == [6, 35, 143]
    assert ex.workers == 1 and ex.expired is False
    assert isinstance(ex, TaskExecutor)


@pytest.mark.timeout(120)
def test_pool_gives_the_inline_results_in_task_order():
    ex = PoolExecutor(2)
    assert ex.map(operator.mul, ARGS, KEYS) == [6, 35, 143]
    assert ex.map(operator.add, ARGS[:1], KEYS[:1]) == [5]  # one task: in this process
    assert ex.map(operator.add, [], []) == []
    assert isinstance(ex, TaskExecutor) and ex.expired is False


@pytest.mark.timeout(120)
def test_pool_task_exception_propagates():
    with pytest.raises(ZeroDivisionError):
        PoolExecutor(2).map(operator.truediv, [(1, 1), (1, 0)], KEYS[:2])


def test_default_executor_and_bad_workers():
    assert isinstance(default_executor(1), InlineExecutor)
    pool = default_executor(3)
    assert isinstance(pool, PoolExecutor) and pool.workers == 3
    for bad in (0, 1.5, True):
        with pytest.raises(PlanError, match="workers="):
            default_executor(bad)
    with pytest.raises(PlanError, match="workers=0 must be an int >= 1"):
        PoolExecutor(0)


def test_fallback_log_counts_and_serialises():
    log = FallbackLog()
    assert log.count == 0
    assert log.as_dict() == {"reorder": [], "locality": 0, "replicate": []}
    log.reorder += [3, 5]
    log.locality += 1
    log.replicate.extend([[0, 2], [1, 2]])
    assert log.count == 2 + 1 + 2
    assert log.as_dict() == {"reorder": [3, 5], "locality": 1, "replicate": [[0, 2], [1, 2]]}
    log.strategy = 1
    assert log.count == 6 and log.as_dict()["strategy"] == 1
    d = log.as_dict()
    d["reorder"].append(9)  # a copy: the log is not changed through it
    assert log.reorder == [3, 5]


def test_task_failed_names_its_reason():
    f = TaskFailed("deadline")
    assert f.reason == "deadline" and repr(f) == "TaskFailed('deadline')"
