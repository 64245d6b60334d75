"""The Planner service: plan a global batch in parallel, with a deadline and per-cell fallback.

``Planner(model, cluster, strategy="relibra", ...)`` plans a ``TraceBatch`` the way ``plan_batch`` does,
but splits the work into independent tasks and runs them on an executor:

- **reorder**: one task per layer x seed (``reorder.anneal_layer`` from the layer's LPT start, or the
  previous placement); per layer the best candidate by exact batch cost wins, the start included;
- **locality**: one task (sample -> GPU annealing needs every layer at once);
- **replicate**: layer x micro-batch cells (``replicate.replicate_cell``), grouped in chunks.

Executors: ``"inline"`` (this process, in order), ``"process"`` (a process pool of ``workers``) and
``"ray"`` (Ray tasks; ``ray.init()`` locally unless ``ray_address`` is given or Ray is already up).

Fallbacks keep results correct, only slower: when a task misses ``deadline_s`` (measured from the
start of ``plan``) or its worker dies, each of its cells falls back: a reorder layer keeps the
previous placement (the last plan's, else the LPT start), locality keeps round-robin samples, a
replication cell gets no replicas. Each fallen-back cell counts in ``plan.stats["fallbacks"]``
(details in ``stats["fallback_cells"]``) and is logged as a warning. Any other exception in a task is
a bug or bad input and propagates.

``submit(batch)`` runs ``plan`` on a background thread and returns a ``concurrent.futures.Future``, so a
trainer can plan while rewards are computed.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
from concurrent.futures.process import BrokenProcessPool, ProcessPoolExecutor
from typing import TYPE_CHECKING, Any

import numpy as np

from ..cost import DEFAULT_BETA
from ..errors import PlanError
from ..evaluate import batch_sha1
from ..plan import BatchPlan, Placement, ReplicaPlan, SamplePlacement
from ..specs import ClusterSpec, ModelSpec
from .replicate import CellResult, assemble, replicate_cell

if TYPE_CHECKING:
    from ..trace import TraceBatch

log = logging.getLogger(__name__)

EXECUTORS = ("inline", "process", "ray")
_TASKED = ("relibra", "relibra-inter")

__all__ = ["Planner", "EXECUTORS"]


class _Failed:
    """Marker result of a task that missed the deadline or whose worker died."""

    __slots__ = ("reason",)

    def __init__(self, reason: str) -> None:
        self.reason = reason


def _call(hook: Callable[[str, Any], None] | None, kind: str, key: Any, fn: Callable, args: tuple) -> Any:
    """Run one task in a worker (``hook(kind, key)`` first: a test seam, e.g. to kill the worker)."""
    if hook is not None:
        hook(kind, key)
    return fn(*args)


def _reorder_task(x_layer, model, cluster, seed, init, kw):
    from .reorder import anneal_layer

    return anneal_layer(x_layer, model, cluster, seed, init=init, **kw)


def _locality_task(counts, lengths, mb, sg, eg, model, cluster, kw):
    from .locality import anneal_locality

    return anneal_locality(counts, lengths, mb, sg, eg, model, cluster, **kw)


def _replicate_task(xs, egs, model, cluster, slots, kw, attn=None):
    return [replicate_cell(xs[i].astype(np.float64), egs[i], model, cluster, slots,
                           attn_fwd=None if attn is None else float(attn[i]), **kw) for i in range(len(xs))]


_SERVICE_OPTIONS = ("cell_chunk", "replicate", "repack")
"""Planner options beyond ``plan_batch``'s ``PLAN_OPTIONS`` (``repack`` is a ``plan_batch`` argument)."""


class Planner:
    """Plans global batches in parallel with deadlines and per-cell fallback (see the module docstring).

    Args:
        model, cluster: the specs.
        strategy: a name of ``strategies.STRATEGIES``; "relibra" and "relibra-inter" run as tasks, the
            others run ``plan_batch`` in this process.
        replica_slots: r replica slots per GPU.
        workers: parallel workers (default: the CPUs this process may use).
        executor: "inline", "process" or "ray".
        deadline_s: seconds from the start of ``plan`` after which unfinished tasks fall back (None: wait).
        seed: plan seed (same inputs, seed and no fallback -> same plan, whatever the executor).
        ray_address: Ray cluster address (executor="ray"); None starts or reuses a local Ray.
        task_hook: called as ``hook(kind, key)`` inside the worker before each task (tests use it to kill
            a worker); must be picklable for "process" / "ray".
        options: strategy options as for ``plan_batch`` (``iters``, ``num_seeds``, ``objective``, ``beta``,
            ``locality_iters``, ``tol``, ``token_cap``, ``rounds``, ``repack``, ``skew_cap`` for the
            rank-balance mode, ...) and ``cell_chunk`` (cells per replication task) and ``replicate`` (a dict
            of ``replicate_cell`` keywords).
    """

    def __init__(self, model: ModelSpec, cluster: ClusterSpec, strategy: str = "relibra", replica_slots: int = 2,
                 workers: int | None = None, executor: str = "process", deadline_s: float | None = None,
                 seed: int = 0, *, ray_address: str | None = None,
                 task_hook: Callable[[str, Any], None] | None = None, **options: Any) -> None:
        from .strategies import STRATEGIES, check_plan_args

        if strategy not in STRATEGIES:
            raise PlanError(f"unknown strategy {strategy!r}; known: {sorted(STRATEGIES)}")
        if executor not in EXECUTORS:
            raise PlanError(f"executor={executor!r} is not one of {EXECUTORS}")
        if not isinstance(replica_slots, (int, np.integer)) or replica_slots < 0:
            raise PlanError(f"replica_slots={replica_slots!r} must be an int >= 0")
        if deadline_s is not None and not deadline_s > 0:
            raise PlanError(f"deadline_s={deadline_s!r} must be > 0 or None")
        if workers is not None and (not isinstance(workers, (int, np.integer)) or workers < 1):
            raise PlanError(f"workers={workers!r} must be an int >= 1 or None")
        if model.num_experts % cluster.num_gpus:
            raise PlanError(f"num_experts={model.num_experts} is not divisible by num_gpus={cluster.num_gpus}")
        check_plan_args(replica_slots=replica_slots, seed=seed, workers=1 if workers is None else workers,
                        options={k: v for k, v in options.items() if k not in _SERVICE_OPTIONS})
        if options.get("token_cap") is not None and not options.get("repack", False):
            raise PlanError(f"token_cap={options['token_cap']!r} only applies with repack=True")
        chunk = options.get("cell_chunk")
        if chunk is not None and (isinstance(chunk, bool) or not isinstance(chunk, (int, np.integer)) or chunk < 1):
            raise PlanError(f"cell_chunk={chunk!r} must be an int >= 1")
        if not isinstance(options.get("replicate", {}), dict):
            raise PlanError(f"replicate={options['replicate']!r} must be a dict of replicate_cell keywords")
        self.model, self.cluster, self.strategy = model, cluster, strategy
        self.replica_slots = int(replica_slots)
        self.workers = int(workers) if workers is not None else _cpus()
        self.executor = executor
        self.deadline_s = deadline_s
        self.seed = int(seed)
        self.ray_address = ray_address
        self.task_hook = task_hook
        self.options = dict(options)
        self.previous: Placement | None = None
        self._pool: ProcessPoolExecutor | None = None
        self._thread: ThreadPoolExecutor | None = None
        self._ray_fn = None

    # ------------------------------------------------------------------ lifecycle
    def close(self) -> None:
        """Stop the worker pool and the background thread (Ray itself is left running)."""
        if self._thread is not None:
            self._thread.shutdown(wait=True)
            self._thread = None
        self._drop_pool(kill=False)

    def __enter__(self) -> Planner:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def submit(self, batch: TraceBatch, micro_batch_size: int | None = None) -> Future:
        """Plan ``batch`` on a background thread; returns a ``Future[BatchPlan]``."""
        if self._thread is None:
            self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="relibra-planner")
        return self._thread.submit(self.plan, batch, micro_batch_size)

    # ------------------------------------------------------------------ planning
    def plan(self, batch: TraceBatch, micro_batch_size: int | None = None) -> BatchPlan:
        """Plan one global batch; returns a validated BatchPlan (``stats["fallbacks"]`` counts fallbacks)."""
        from .strategies import plan_batch

        model, cluster = self.model, self.cluster
        if batch.num_experts != model.num_experts or batch.num_layers != model.num_layers:
            raise PlanError(f"batch has L={batch.num_layers}, E={batch.num_experts}; model {model.name} has "
                            f"L={model.num_layers}, E={model.num_experts}")
        if self.strategy not in _TASKED:
            opts = {k: v for k, v in self.options.items() if k not in _SERVICE_OPTIONS[:2]}
            plan = plan_batch(batch, model, cluster, self.strategy, replica_slots=self.replica_slots, seed=self.seed,
                              workers=self.workers, micro_batch_size=micro_batch_size, **opts)
            self.previous = plan.placement
            return plan
        t0 = time.perf_counter()
        deadline = None if self.deadline_s is None else time.monotonic() + float(self.deadline_s)
        if micro_batch_size is not None:
            batch = batch.with_micro_batch_size(int(micro_batch_size))
        stats: dict[str, Any] = {"strategy": self.strategy, "seed": self.seed, "replica_slots": self.replica_slots,
                                 "executor": self.executor, "workers": self.workers, "fallbacks": 0,
                                 "fallback_cells": {"reorder": [], "locality": 0, "replicate": []}}
        timing = stats.setdefault("timing", {})
        eg, mb, sg = self._inter(batch, deadline, stats)
        M = int(mb.max()) + 1
        placement = Placement(eg)
        samples = SamplePlacement(mb, sg, M)
        if self.strategy == "relibra" and self.replica_slots > 0:
            t1 = time.perf_counter()
            replicas = self._replicate(placement, samples, batch.with_micro_batch(mb.astype(np.int32)), deadline,
                                       stats)
            timing["replicate_s"] = time.perf_counter() - t1
        else:
            replicas = ReplicaPlan.empty(M, model.num_layers, cluster.num_gpus, 0)
        stats["solve_seconds"] = time.perf_counter() - t0
        stats["batch_sha1"] = batch_sha1(batch)
        plan = BatchPlan(placement, samples, replicas, cluster.num_gpus, cluster.gpus_per_node, stats)
        plan.validate(model, cluster, num_samples=batch.num_sequences)
        self.previous = placement
        return plan

    def _inter(self, batch, deadline, stats) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Reorder (layer x seed tasks) + locality (one task), ``rounds`` times.

        Mirrors ``strategies.relibra_inter`` (same defaults, seeds and kwargs), so that without fallbacks
        the plan equals ``plan_batch``'s whatever the executor (tests/test_service.py checks it).
        """
        from ..plan import round_robin_gpus
        from .locality import default_locality_iters, loads_from_counts
        from .reorder import _better_start, batch_cost, default_iters, layer_seeds, lpt_placement
        from .strategies import DEFAULT_ROUNDS, final_iters, migrate, rank_balance_options

        model, cluster, o = self.model, self.cluster, self.options
        G, L, E = cluster.num_gpus, model.num_layers, model.num_experts
        counts = batch.sample_expert_counts()
        lengths = np.asarray(batch.lengths, dtype=np.int64)
        mb = np.asarray(batch.resolve_micro_batch(), dtype=np.int64)
        M = int(mb.max()) + 1
        sg = round_robin_gpus(mb, G)
        repack = bool(o.get("repack", False))
        prev = self.previous.expert_gpu.astype(np.int64) if self.previous is not None and \
            self.previous.expert_gpu.shape == (L, E) else None
        rounds = int(DEFAULT_ROUNDS if o.get("rounds") is None else o["rounds"])
        if rounds < 1:
            raise PlanError(f"rounds={rounds} must be >= 1")
        objective = o.get("objective", "batch")
        iters = o.get("iters")
        if iters is None:
            iters = max(default_iters(E, G, M if objective == "batch" else 1, L) // rounds, 300)
        loc_iters = o.get("locality_iters")
        if loc_iters is None:
            loc_iters = max(default_locality_iters(len(lengths), L, G, repack) // rounds, 100)
        num_seeds = o.get("num_seeds")
        num_seeds = max(1, self.workers) if num_seeds is None else int(num_seeds)
        beta = o.get("beta", DEFAULT_BETA)
        node_comp, skew_cap = rank_balance_options(o)
        kw = dict(objective=objective, beta=beta, iters=iters, smooth=o.get("smooth"), node_comp=node_comp,
                  skew_cap=skew_cap)
        timing = stats["timing"]
        eg = None
        for rnd in range(rounds):
            t0 = time.perf_counter()
            x = loads_from_counts(counts, mb, sg, M, G)
            xl = np.ascontiguousarray(np.moveaxis(x, 1, 0), dtype=np.float64)  # [L, M, G, E]
            if eg is None:
                eg = np.stack([lpt_placement(xl[l].sum(axis=(0, 1)), G) for l in range(L)])
            if node_comp and cluster.nodes > 1:
                eg = np.stack([_better_start(xl[l], eg[l], model, cluster, self.seed + rnd, l, skew_cap)
                               for l in range(L)])
            start = eg
            best_obj = np.array([batch_cost(xl[l], start[l], model, cluster, node_comp, skew_cap) for l in range(L)])
            best = start.copy()
            tasks, keys = [], []
            for l in range(L):
                for s in layer_seeds(self.seed + rnd, num_seeds, l):
                    tasks.append((_reorder_task, (xl[l], model, cluster, s, start[l], kw)))
                    keys.append(("reorder", (l, s)))
            results = self._run(tasks, keys, deadline)
            failed_layers, done_layers = set(), set()
            for (_, (l, _s)), res in zip(keys, results):
                if isinstance(res, _Failed):
                    failed_layers.add(l)
                    continue
                done_layers.add(l)
                cand, obj = res
                if obj < best_obj[l]:  # task order is deterministic: ties keep the earlier candidate
                    best_obj[l], best[l] = obj, cand
            for l in sorted(failed_layers - done_layers):  # no seed of the layer finished
                best[l] = prev[l] if prev is not None else start[l]
                stats["fallbacks"] += 1
                stats["fallback_cells"]["reorder"].append(int(l))
            eg = best
            t1 = time.perf_counter()
            lkw = dict(num_micro_batches=M, repack=repack, token_cap=o.get("token_cap"), tol=o.get("tol", 0.05),
                       seed=self.seed + rnd, iters=loc_iters, beta=beta,
                       smooth=bool(o.get("locality_smooth", False)))
            (res,) = self._run([(_locality_task, (counts, lengths, mb, sg, eg, model, cluster, lkw))],
                               [("locality", rnd)], deadline)
            if isinstance(res, _Failed):
                stats["fallbacks"] += 1
                stats["fallback_cells"]["locality"] += 1
            else:
                mb, sg, info = res
                stats["objective"] = info["objective"]
            timing[f"reorder_s_{rnd}"] = t1 - t0
            timing[f"locality_s_{rnd}"] = time.perf_counter() - t1
        if o.get("final_reorder", False) and not (deadline is not None and time.monotonic() > deadline):
            from .reorder import reorder

            t0 = time.perf_counter()  # as strategies.relibra_inter (in this process: one call, no fallback cells)
            eg, stats["final_reorder"] = reorder(loads_from_counts(counts, mb, sg, M, G), model, cluster,
                                                 seed=self.seed + rounds, num_seeds=num_seeds, workers=self.workers,
                                                 init=eg, objective=objective, beta=beta,
                                                 iters=final_iters(o, iters),
                                                 smooth=o.get("smooth"), node_comp=node_comp, skew_cap=skew_cap)
            timing["reorder_s_final"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        mopts = dict(o)
        if prev is not None and "previous" not in mopts:
            mopts["previous"] = prev
        if deadline is not None and time.monotonic() > deadline:
            mopts["migration"] = False  # past the deadline: no more work, the fallbacks stand as they are
        replicated = self.strategy == "relibra" and self.replica_slots > 0  # as strategies.strategy_relibra
        eg, sg, stats["migration"] = migrate(eg, np.asarray(mb, dtype=np.int64), sg, counts, M, model, cluster, mopts,
                                             node_comp or replicated)
        timing["migration_s"] = time.perf_counter() - t0
        return eg, np.asarray(mb, dtype=np.int64), np.asarray(sg, dtype=np.int64)

    def _replicate(self, placement: Placement, samples: SamplePlacement, batch, deadline, stats) -> ReplicaPlan:
        G, M, L = self.cluster.num_gpus, int(samples.num_micro_batches), placement.num_layers
        x = np.asarray(batch.loads(samples.gpu, G, samples.micro_batch))
        x = x.astype(np.int32) if x.max(initial=0) < 2**31 else x
        cells = [(m, l) for l in range(L) for m in range(M)]
        chunk = int(self.options.get("cell_chunk", max(1, math.ceil(len(cells) / (16 * self.workers)))))
        kw = dict(self.options.get("replicate", {}))
        from .strategies import replica_pricing

        attn = replica_pricing(self.options, np.asarray(batch.lengths), samples, self.model, self.cluster)
        tasks, keys = [], []
        for i in range(0, len(cells), chunk):
            cs = cells[i:i + chunk]
            ms = np.array([c[0] for c in cs])
            ls = np.array([c[1] for c in cs])
            tasks.append((_replicate_task, (x[ms, ls], placement.expert_gpu[ls], self.model, self.cluster,
                                            self.replica_slots, kw, None if attn is None else attn[ms])))
            keys.append(("replicate", tuple(cs)))
        results = self._run(tasks, keys, deadline)
        out: dict[tuple[int, int], CellResult] = {}
        for (_, cs), res in zip(keys, results):
            if isinstance(res, _Failed):
                stats["fallbacks"] += len(cs)
                stats["fallback_cells"]["replicate"].extend([list(c) for c in cs])
                continue
            out.update(zip(cs, res))
        return assemble(out, M, L, G, self.replica_slots)

    # ------------------------------------------------------------------ executors
    def _run(self, tasks: Sequence[tuple[Callable, tuple]], keys: Sequence[tuple[str, Any]],
             deadline: float | None) -> list[Any]:
        """Run tasks; a task past the deadline or on a dead worker yields ``_Failed`` (logged)."""
        if not tasks:
            return []
        if deadline is not None and time.monotonic() > deadline:  # nothing to start a worker for
            res: list[Any] = [_Failed("missed the deadline") for _ in tasks]
        elif self.executor == "inline":
            res = self._run_inline(tasks, keys, deadline)
        elif self.executor == "process":
            res = self._run_process(tasks, keys, deadline)
        else:
            res = self._run_ray(tasks, keys, deadline)
        for (kind, key), r in zip(keys, res):
            if isinstance(r, _Failed):
                what = f"{len(key)} cells" if kind == "replicate" else f"{key}"
                log.warning("relibra planner: %s task %s %s; falling back (%s)", kind, what, r.reason,
                            "previous placement" if kind == "reorder" else
                            "round-robin samples" if kind == "locality" else "no replicas")
        return res

    def _run_inline(self, tasks, keys, deadline) -> list[Any]:
        out = []
        for (fn, args), (kind, key) in zip(tasks, keys):
            if deadline is not None and time.monotonic() > deadline:
                out.append(_Failed("missed the deadline"))
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
        for p in procs:  # our own workers, still busy with tasks nobody waits for
            if p.is_alive():
                p.terminate()

    def _run_process(self, tasks, keys, deadline) -> list[Any]:
        pool = self._get_pool()
        try:
            futs = [pool.submit(_call, self.task_hook, kind, key, fn, args)
                    for (fn, args), (kind, key) in zip(tasks, keys)]
        except BrokenProcessPool:
            self._drop_pool(kill=True)
            return [_Failed("lost its worker (the pool is broken)") for _ in tasks]
        timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
        futures_wait(futs, timeout=timeout)
        out: list[Any] = []
        broken = late = False
        for f in futs:
            if not f.done():  # not cancelled: the pool is dropped below (see _drop_pool)
                late = True
                out.append(_Failed("missed the deadline"))
                continue
            exc = f.exception()
            if isinstance(exc, BrokenProcessPool):
                broken = True
                out.append(_Failed("lost its worker (the worker process died)"))
            elif exc is not None:
                raise exc
            else:
                out.append(f.result())
        if broken or late:
            self._drop_pool(kill=True)
        return out

    def _run_ray(self, tasks, keys, deadline) -> list[Any]:
        import ray

        if not ray.is_initialized():
            if self.ray_address is not None:
                ray.init(address=self.ray_address, ignore_reinit_error=True, log_to_driver=False)
            else:
                ray.init(num_cpus=self.workers, ignore_reinit_error=True, log_to_driver=False,
                         include_dashboard=False)
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
                out.append(_Failed("missed the deadline"))
                continue
            try:
                out.append(ray.get(ref))
            except (ray.exceptions.WorkerCrashedError, ray.exceptions.NodeDiedError,
                    ray.exceptions.TaskCancelledError) as exc:
                out.append(_Failed(f"lost its worker ({type(exc).__name__})"))
            except ray.exceptions.RayTaskError as exc:
                cause = exc.as_instanceof_cause() if hasattr(exc, "as_instanceof_cause") else exc
                raise cause from None
        return out


def _cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover
        return os.cpu_count() or 1
