"""The Planner service: plan a global batch in parallel, with a deadline and per-cell fallback.

``Planner(model, cluster, strategy="relibra", ...)`` plans a ``TraceBatch`` with the same code as
``plan_batch`` (``strategies.run_strategy``: one planning loop), on its own ``executor.TaskExecutor``, to
which the loop hands independent tasks:

- **reorder**: one task per layer x seed (``reorder.anneal_layer`` from the layer's start); per layer the
  best candidate by exact batch cost wins, the start included;
- **locality**: one task (sample -> GPU annealing needs every layer at once);
- **replicate**: layer x micro-batch cells (``replicate.replicate_cell``; for ``online`` and ``lplb`` their
  own per-cell rule, ``online.online_cell`` / ``lplb.lplb_cells_task``), grouped in chunks.

Executors: ``"inline"`` (this process, in order), ``"process"`` (a process pool of ``workers``) and
``"ray"`` (Ray tasks; ``ray.init()`` locally unless ``ray_address`` is given or Ray is already up).

Connecting to Ray runs under a time limit (``ray_connect_timeout_s``, and never past the deadline): a
cluster address is first probed over TCP, then ``ray.init`` runs on a helper thread that is waited for at
most that long. On failure ``on_ray_failure="raise"`` (default) raises ``PlanError`` naming the address;
``"process"`` logs one warning and plans on a process pool instead (``stats.executor`` says
``"process"`` and ``stats.executor_fallback`` why). A connection that timed out may still complete on
its thread later; the planner does not use it.

Deadlines per executor: "process" and "ray" stop waiting for unfinished tasks at the deadline (their
workers are killed with SIGKILL, so a frozen one never outlives the plan nor holds up the interpreter's
exit / the tasks cancelled); "inline" cannot interrupt a running task: it checks the
deadline before starting each task, so a plan can return up to one task's duration late. Every plan made
with a deadline reports it: ``stats.deadline`` = ``{"deadline_s", "interrupts_tasks"}`` (False for
"inline") and ``stats.timing.deadline_overrun_s`` (seconds past the deadline when the plan returned,
0 when on time; wall clock, so kept out of saved files like all of ``timing``). Every strategy honours the
deadline: the EPLB strategies run their layout as one task (``context.eplb_task``); static, lpt and
balanced do no search (milliseconds).

Fallbacks keep results correct, only slower: when a task misses ``deadline_s`` (measured from the
start of ``plan``) or its worker dies, each of its cells falls back: a reorder layer keeps the
previous placement (option ``previous``, else the last plan's, else its start), locality keeps the samples
where the previous round left them, a replication cell gets no replicas; past the deadline the final
reorder and the migration pricing are skipped. Each fallen-back cell counts in ``plan.stats.fallbacks``
(details in ``stats.fallback_cells``); warnings are aggregated: one line per cause (task kind and
reason) per ``plan`` call, with the count of tasks. Any other exception in a task is a bug or bad input
and propagates.

``submit(batch)`` runs ``plan`` on a background thread and returns a ``concurrent.futures.Future``, so a
trainer can plan while rewards are computed.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
from concurrent.futures.process import BrokenProcessPool, ProcessPoolExecutor
from typing import Any

import numpy as np

from ..errors import PlanError
from ..evaluate import plan_loads
from ..plan import BatchPlan, Placement, check_replica_slots
from ..plan_stats import DeadlineStats
from ..specs import ClusterSpec, ModelSpec
from ..trace import TraceBatch
from ..validate import check_choice, check_int, check_positive
from .executor import Key, TaskFailed
from .options import PlanOptions
from .strategies import check_batch_fits, check_strategy, make_context, run_strategy

log = logging.getLogger(__name__)

EXECUTORS = ("inline", "process", "ray")
RAY_FAILURE_MODES = ("raise", "process")
"""``on_ray_failure``: what a failed Ray connection does (raise ``PlanError``, or plan on a process pool)."""
_FALLBACK_OF = {"reorder": "previous placement", "locality": "samples kept where they were",
                "replicate": "no replicas", "eplb": "previous (else static) homes, no replicas",
                "eplb-history": "previous (else static) homes, no replicas",
                "locality-replicas": "those layers of the locality-replica candidate without replicas"}

__all__ = ["Planner", "EXECUTORS"]


def _call(hook: Callable[[str, Any], None] | None, kind: str, key: Any, fn: Callable, args: tuple) -> Any:
    """Run one task in a worker (``hook(kind, key)`` first: a test seam, e.g. to kill the worker)."""
    if hook is not None:
        hook(kind, key)
    return fn(*args)


class _PlannerExecutor:
    """The ``TaskExecutor`` of one ``Planner.plan`` call: the planner's pool (or Ray, or inline) and deadline."""

    def __init__(self, planner: Planner, deadline: float | None) -> None:
        self.planner = planner
        self.deadline = deadline
        self.workers = planner.workers
        self.failures: Counter[tuple[str, str]] = Counter()  # (task kind, reason) -> tasks, for one warning each

    def map(self, fn: Callable[..., Any], args: Sequence[tuple], keys: Sequence[Key]) -> list[Any]:
        res = self.planner._run([(fn, a) for a in args], keys, self.deadline)
        for (kind, _), r in zip(keys, res):
            if isinstance(r, TaskFailed):
                self.failures[kind, r.reason] += 1
        return res

    def warn(self) -> None:
        """One warning per cause (task kind and reason) with its count of tasks."""
        for (kind, reason), n in sorted(self.failures.items()):
            log.warning("relibra planner: %d %s task(s) %s; falling back (%s)", n, kind, reason,
                        _FALLBACK_OF.get(kind, "fallback"))

    @property
    def expired(self) -> bool:
        return self.deadline is not None and time.monotonic() > self.deadline


class Planner:
    """Plans global batches in parallel with deadlines and per-cell fallback (see the module docstring).

    Args:
        model, cluster: the specs.
        strategy: a name of ``strategies.STRATEGIES``; every strategy runs through ``strategies.run_strategy``
            (relibra and relibra-inter hand their reorder, locality and replication tasks to the executor).
        replica_slots: r replica slots per GPU.
        workers: parallel workers (default: the CPUs this process may use).
        executor: "inline", "process" or "ray".
        deadline_s: seconds from the start of ``plan`` after which unfinished tasks fall back (None: wait).
        seed: plan seed (same inputs, seed and no fallback -> same plan, whatever the executor).
        ray_address: Ray cluster address (executor="ray"); None starts or reuses a local Ray.
        ray_connect_timeout_s: seconds a Ray connection (``ray.init``) may take, > 0 (also capped by the
            deadline); see the module docstring.
        on_ray_failure: ``"raise"`` (``PlanError`` naming the address) or ``"process"`` (plan on a process
            pool, with one warning) when Ray cannot be reached in time.
        task_hook: called as ``hook(kind, key)`` inside the worker before each task (tests use it to kill
            a worker); must be picklable for "process" / "ray".
        options: the other fields of ``options.PlanOptions`` (``iters``, ``num_seeds``, ``repack``, ``skew_cap``,
            ``cell_chunk``, ``replicate``, ...), as for ``plan_batch``.
    """

    def __init__(self, model: ModelSpec, cluster: ClusterSpec, strategy: str = "relibra", replica_slots: int = 2,
                 workers: int | None = None, executor: str = "process", deadline_s: float | None = None,
                 seed: int = 0, *, ray_address: str | None = None, ray_connect_timeout_s: float = 30.0,
                 on_ray_failure: str = "raise", task_hook: Callable[[str, Any], None] | None = None,
                 **options: Any) -> None:
        check_strategy(strategy)
        check_choice("executor", executor, EXECUTORS)
        check_choice("on_ray_failure", on_ray_failure, RAY_FAILURE_MODES)
        check_positive("ray_connect_timeout_s", ray_connect_timeout_s)
        if deadline_s is not None:
            check_positive("deadline_s", deadline_s)
        if workers is not None:
            check_int("workers", workers, 1)
        if model.num_experts % cluster.num_gpus:
            raise PlanError(f"num_experts={model.num_experts} is not divisible by num_gpus={cluster.num_gpus}")
        self.model, self.cluster, self.strategy = model, cluster, strategy
        self.workers = int(workers) if workers is not None else _cpus()
        self.options = PlanOptions.from_kwargs(replica_slots=replica_slots, seed=seed, workers=self.workers,
                                               **options)
        self.options.check_for(strategy)
        check_replica_slots(self.options.replica_slots, model.num_experts, cluster.num_gpus)
        self.replica_slots = self.options.replica_slots
        self.seed = self.options.seed
        self.executor = executor
        self.deadline_s = deadline_s
        self.ray_address = ray_address
        self.ray_connect_timeout_s = float(ray_connect_timeout_s)
        self.on_ray_failure = on_ray_failure
        self.executor_fallback: str | None = None  # why "ray" became "process" (on_ray_failure="process")
        self.task_hook = task_hook
        self.previous: Placement | None = None
        self._previous_loads: np.ndarray | None = None  # option move_horizon > 1: the last batch as it ran
        self._settled = 0  # batches left that a credited move's homes serve without another credit
        self._pool: ProcessPoolExecutor | None = None
        self._thread: ThreadPoolExecutor | None = None
        self._ray_fn = None

    # ------------------------------------------------------------------ lifecycle
    def close(self) -> None:
        """Stop the worker pool and the background thread (Ray itself is left running). Workers still running a
        task nobody waits for (a frozen one) are killed, so neither ``close`` nor the interpreter's exit waits for
        them."""
        if self._thread is not None:
            self._thread.shutdown(wait=True)
            self._thread = None
        pool = self._pool
        busy = pool is not None and any(getattr(pool, "_pending_work_items", {}))
        self._drop_pool(kill=busy)

    def __enter__(self) -> Planner:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def submit(self, batch: TraceBatch, micro_batch_size: int | None = None, *, sample_gpu: Any = None) -> Future:
        """Plan ``batch`` on a background thread (arguments as ``plan``); returns a ``Future[BatchPlan]``."""
        if sample_gpu is not None:  # a bad value raises here, in the caller's thread
            self.options.replace(sample_gpu=sample_gpu)
        if self._thread is None:
            self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="relibra-planner")
        return self._thread.submit(self.plan, batch, micro_batch_size, sample_gpu=sample_gpu)

    # ------------------------------------------------------------------ planning
    def plan(self, batch: TraceBatch, micro_batch_size: int | None = None, *, sample_gpu: Any = None) -> BatchPlan:
        """Plan one global batch; returns a validated BatchPlan (``stats.fallbacks`` counts fallen-back cells,
        ``stats.fallback_cells`` names them).

        ``sample_gpu``: with ``sample_owner="trainer"``, this batch's trainer ranks, int ``[N]`` in ``[0, G)``
        (replaces the option ``sample_gpu`` for this call; None: the option's, else round-robin). With the
        default ``sample_owner="planner"`` it must be None (PlanError).

        Moves are priced against the option ``previous`` if given, else this planner's last placement (the
        first call: the static one); a reorder layer whose tasks all fail keeps that placement. With option
        ``move_horizon`` H > 1 and no option ``previous``, the last batch's loads under its plan are this call's
        ``previous_loads`` (``PlanOptions``; none on the first call, nor in the H - 1 calls after a plan whose move
        was credited, ``PlanStats.move_credited``).
        """
        check_batch_fits(batch, self.model, self.cluster)
        deadline = None if self.deadline_s is None else time.monotonic() + float(self.deadline_s)
        if self.executor == "ray":
            self._connect_ray(deadline)
        L, E = self.model.num_layers, self.model.num_experts
        last = self.previous.expert_gpu.astype(np.int64) if self.previous is not None and \
            self.previous.expert_gpu.shape == (L, E) else None
        opts = base = self.options if sample_gpu is None else self.options.replace(sample_gpu=sample_gpu)
        if last is not None and opts.previous is None:
            opts = opts.replace(previous=last, **({} if self._previous_loads is None or opts.previous_loads is not None
                                                  else {"previous_loads": self._previous_loads}))
        fallback = last if opts.previous is None else np.asarray(getattr(opts.previous, "expert_gpu", opts.previous),
                                                                 dtype=np.int64)
        ctx = make_context(batch, self.model, self.cluster, self.strategy, opts, _PlannerExecutor(self, deadline),
                           micro_batch_size, fallback_expert_gpu=fallback)
        ctx.stats.options, ctx.stats.executor, ctx.stats.workers = base.strategy_options(), self.executor, self.workers
        if self.executor_fallback is not None:
            ctx.stats.executor_fallback = self.executor_fallback
        if deadline is not None:
            ctx.stats.deadline = DeadlineStats(deadline_s=float(self.deadline_s),
                                               interrupts_tasks=self.executor != "inline")
        try:
            plan = run_strategy(ctx, self.strategy)
        finally:
            ctx.executor.warn()
        plan.stats.fallback_cells = ctx.fallbacks.as_dict()
        if deadline is not None:
            plan.stats.timings()["deadline_overrun_s"] = max(0.0, time.monotonic() - deadline)
        self.previous = plan.placement
        if self.options.move_horizon > 1:
            self._settled = self.options.move_horizon - 1 if plan.stats.move_credited else max(self._settled - 1, 0)
            self._previous_loads = None if self._settled else plan_loads(plan, batch, self.cluster.num_gpus)
        return plan

    def _connect_ray(self, deadline: float | None) -> None:
        """Make sure Ray is up (module docstring): ``PlanError`` naming the address, or a switch to the process
        executor (``on_ray_failure="process"``), when it is not reachable within the time limit."""
        import ray

        if ray.is_initialized():
            return
        limit = self.ray_connect_timeout_s
        if deadline is not None:
            limit = max(0.0, min(limit, deadline - time.monotonic()))
        where = self.ray_address if self.ray_address is not None else "a new local Ray"
        try:
            _probe_ray_address(self.ray_address, limit)
            done: dict[str, BaseException | None] = {}

            def connect() -> None:
                try:
                    if self.ray_address is not None:
                        ray.init(address=self.ray_address, ignore_reinit_error=True, log_to_driver=False)
                    else:
                        ray.init(num_cpus=self.workers, ignore_reinit_error=True, log_to_driver=False,
                                 include_dashboard=False)
                    done["error"] = None
                except BaseException as exc:  # reported below, in the caller's thread
                    done["error"] = exc

            t = threading.Thread(target=connect, name="relibra-ray-connect", daemon=True)
            t.start()
            t.join(limit)
            if "error" not in done:
                raise TimeoutError(f"ray.init did not return within {limit:.3g} s")
            if done["error"] is not None:
                raise done["error"]
        except Exception as exc:
            reason = f"cannot connect to Ray at {where} ({type(exc).__name__}: {exc})"
            if self.on_ray_failure == "raise":
                raise PlanError(f"Planner(executor='ray'): {reason}") from None
            log.warning("relibra planner: %s; planning on a process pool of %d workers instead", reason,
                        self.workers)
            self.executor, self.executor_fallback = "process", reason

    # ------------------------------------------------------------------ executors
    def _run(self, tasks: Sequence[tuple[Callable, tuple]], keys: Sequence[tuple[str, Any]],
             deadline: float | None) -> list[Any]:
        """Run tasks; a task past the deadline or on a dead worker yields ``TaskFailed`` (logged)."""
        if not tasks:
            return []
        if deadline is not None and time.monotonic() > deadline:  # nothing to start a worker for
            res: list[Any] = [TaskFailed("missed the deadline") for _ in tasks]
        elif self.executor == "inline":
            res = self._run_inline(tasks, keys, deadline)
        elif self.executor == "process":
            res = self._run_process(tasks, keys, deadline)
        else:
            res = self._run_ray(tasks, keys, deadline)
        return res  # failures are counted by the caller's _PlannerExecutor, one warning per cause

    def _run_inline(self, tasks, keys, deadline) -> list[Any]:
        out = []
        for (fn, args), (kind, key) in zip(tasks, keys):
            if deadline is not None and time.monotonic() > deadline:
                out.append(TaskFailed("missed the deadline"))
                continue
            out.append(_call(self.task_hook, kind, key, fn, args))
        return out

    def _get_pool(self) -> ProcessPoolExecutor:
        if self._pool is None:
            self._pool = ProcessPoolExecutor(max_workers=self.workers)
        return self._pool

    def _drop_pool(self, kill: bool) -> None:
        pool, self._pool = self._pool, None
        if pool is None:
            return
        procs = list(getattr(pool, "_processes", {}).values()) if kill else []
        # When killing, leave the pending futures alone: the pool's manager thread fails them with
        # BrokenProcessPool once the workers are gone, and on Python 3.11 it raises InvalidStateError in its
        # thread for any future already cancelled (cancel_futures=True, or Future.cancel()).
        pool.shutdown(wait=not kill, cancel_futures=not kill)
        # our own workers, busy with tasks nobody waits for: SIGKILL (a frozen worker may ignore SIGTERM, and would
        # then keep the pool's manager thread, and with it the interpreter's exit, waiting forever)
        for p in procs:
            if p.is_alive():
                p.kill()
        for p in procs:
            end = time.monotonic() + WORKER_JOIN_S
            p.join(WORKER_JOIN_S)
            # join can return while the pool's manager thread is reaping the same child (its waitpid wins, ours
            # sees ECHILD): wait, within the same limit, until the process object says it is gone
            while p.is_alive() and time.monotonic() < end:
                time.sleep(0.005)

    def _run_process(self, tasks, keys, deadline) -> list[Any]:
        pool = self._get_pool()
        try:
            futs = [pool.submit(_call, self.task_hook, kind, key, fn, args)
                    for (fn, args), (kind, key) in zip(tasks, keys)]
        except BrokenProcessPool:
            self._drop_pool(kill=True)
            return [TaskFailed("lost its worker (the pool is broken)") for _ in tasks]
        timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
        futures_wait(futs, timeout=timeout)
        out: list[Any] = []
        broken = late = False
        for f in futs:
            if not f.done():  # not cancelled: the pool is dropped below (see _drop_pool)
                late = True
                out.append(TaskFailed("missed the deadline"))
                continue
            exc = f.exception()
            if isinstance(exc, BrokenProcessPool):
                broken = True
                out.append(TaskFailed("lost its worker (the worker process died)"))
            elif exc is not None:
                raise exc
            else:
                out.append(f.result())
        if broken or late:
            self._drop_pool(kill=True)
        return out

    def _run_ray(self, tasks, keys, deadline) -> list[Any]:
        import ray

        self._connect_ray(deadline)
        if self.executor != "ray":  # the connection failed and on_ray_failure="process"
            return self._run_process(tasks, keys, deadline)
        if self._ray_fn is None:
            self._ray_fn = ray.remote(max_retries=0)(_call)
        refs = [self._ray_fn.remote(self.task_hook, kind, key, fn, args)
                for (fn, args), (kind, key) in zip(tasks, keys)]
        timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout)
        ready = set(ready)
        out: list[Any] = []
        for ref in refs:
            if ref not in ready:
                ray.cancel(ref, force=True)
                out.append(TaskFailed("missed the deadline"))
                continue
            try:
                out.append(ray.get(ref))
            except (ray.exceptions.WorkerCrashedError, ray.exceptions.NodeDiedError,
                    ray.exceptions.TaskCancelledError) as exc:
                out.append(TaskFailed(f"lost its worker ({type(exc).__name__})"))
            except ray.exceptions.RayTaskError as exc:
                cause = exc.as_instanceof_cause() if hasattr(exc, "as_instanceof_cause") else exc
                raise cause from None
        return out


#: Seconds ``close`` / a deadline waits for each killed planner worker to be reaped.
WORKER_JOIN_S = 1.0


def _probe_ray_address(address: str | None, timeout_s: float) -> None:
    """Fail fast (``ConnectionError``) when ``address`` names a ``host:port`` (optionally ``ray://``) where nothing
    accepts a TCP connection within ``timeout_s``; other addresses (``None``, ``"auto"``, ``"local"``) pass."""
    if address is None or address in ("auto", "local"):
        return
    hostport = address.split("://", 1)[-1]
    host, sep, port = hostport.rpartition(":")
    if not sep or not port.isdigit():
        return
    try:
        with socket.create_connection((host or "127.0.0.1", int(port)), timeout=max(timeout_s, 1e-3)):
            pass
    except OSError as exc:
        raise ConnectionError(f"nothing accepts connections at {host}:{port} ({exc})") from None


def _cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover
        return os.cpu_count() or 1
