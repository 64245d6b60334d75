"""The Planner service: inline / process / Ray paths agree, deadlines and dead workers fall back per cell.

The Planner service keeps its promises on every executor: Ray connects under a time limit (a named error,
or the process fallback the caller chose), the inline executor's deadline is reported, every strategy honours
``deadline_s`` (eplb too), and warnings come one line per cause with a count.
"""

from __future__ import annotations

import functools
import logging
import os
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from relibra_moe.errors import PlanError
from relibra_moe.planners.service import Planner
from relibra_moe.planners.strategies import plan_batch
from relibra_moe.specs import ClusterSpec, ModelSpec
from relibra_moe.trace import RoutingTrace, TraceBatch

MODEL = ModelSpec("tiny", hidden=1024, ffn=512, num_experts=8, top_k=2, num_layers=3)
CLUSTER = ClusterSpec(nodes=2, gpus_per_node=2)
# tiny cells: priced replicas would never pay for their transfers, so price_replicas=False keeps the replica path
# (and portfolio=False keeps relibra's own plan, which the portfolio would swap for one without replicas)
FAST = dict(iters=300, locality_iters=200, num_seeds=2, rounds=1, price_replicas=False, portfolio=False)


def make_batch(seed=0, n=16, M=2):
    rng = np.random.default_rng(seed)
    traces = []
    for i in range(n):
        S = int(rng.integers(5, 40))
        pr = np.ones(8)
        pr[[i % 3, 4 + i % 2]] = 10.0
        keys = rng.random((S, 3, 8)) ** (1.0 / pr)
        ids = np.argsort(-keys, axis=2)[:, :, :2]
        traces.append(RoutingTrace(ids.astype(np.int16), np.arange(3, dtype=np.int32), 8, 2))
    return TraceBatch(traces, micro_batch=np.arange(n) * M // n)


def same_plan(a, b):
    np.testing.assert_array_equal(a.placement.expert_gpu, b.placement.expert_gpu)
    np.testing.assert_array_equal(a.samples.gpu, b.samples.gpu)
    np.testing.assert_array_equal(a.samples.micro_batch, b.samples.micro_batch)
    np.testing.assert_array_equal(a.replicas.replica_expert, b.replicas.replica_expert)
    np.testing.assert_array_equal(a.replicas.split_index, b.replicas.split_index)
    np.testing.assert_array_equal(a.replicas.split_share, b.replicas.split_share)


def kill_once(kind, key, marker):
    """Task hook: the first replication task to run kills its worker process."""
    if kind == "replicate" and not os.path.exists(marker):
        Path(marker).write_text("killed")
        os._exit(3)


def sleepy(kind, key):
    """Task hook: every task outlives the deadline."""
    import time

    time.sleep(20)


@pytest.fixture(scope="module")
def inline_plan():
    with Planner(MODEL, CLUSTER, replica_slots=1, executor="inline", **FAST) as p:
        return p.plan(make_batch())


def test_inline_plan_is_valid_and_uses_replicas(inline_plan):
    inline_plan.validate(MODEL, CLUSTER, 16)
    assert inline_plan.stats.fallbacks == 0
    assert (inline_plan.replicas.replica_expert >= 0).any()
    from relibra_moe.evaluate import batch_sha1, score_plan

    assert inline_plan.stats.batch_sha1 == batch_sha1(make_batch())
    with pytest.raises(PlanError, match="plan was made for another batch"):
        score_plan(inline_plan, make_batch(seed=1), MODEL, CLUSTER)


@pytest.mark.timeout(240)
def test_process_pool_and_submit_match_inline(inline_plan):
    with Planner(MODEL, CLUSTER, replica_slots=1, workers=2, executor="process", **FAST) as p:
        plan = p.plan(make_batch())
        fut = p.submit(make_batch())
        again = fut.result(timeout=200)
    assert plan.stats.fallbacks == 0
    same_plan(plan, inline_plan)
    same_plan(again, inline_plan)


def test_tiny_deadline_falls_back_everywhere(caplog):
    batch = make_batch()
    with caplog.at_level(logging.WARNING, logger="relibra_moe.planners.service"):
        with Planner(MODEL, CLUSTER, replica_slots=1, executor="inline", deadline_s=1e-9, **FAST) as p:
            plan = p.plan(batch)
    plan.validate(MODEL, CLUSTER, 16)
    M, L = 2, 3
    assert plan.stats.fallbacks == L + 1 + M * L  # every reorder layer, locality, every cell
    assert (plan.replicas.replica_expert == -1).all() and len(plan.replicas.split_index) == 0
    # reorder fell back to the LPT start (no previous placement), samples stayed at relibra's start, verl's
    # length-balanced placement
    from relibra_moe.sample_placements import length_balanced
    mb, gpu = length_balanced(batch.lengths, batch.resolve_micro_batch(), 4)
    np.testing.assert_array_equal(plan.samples.gpu, gpu)
    np.testing.assert_array_equal(plan.samples.micro_batch, mb)
    assert any("falling back" in r.message for r in caplog.records)


@pytest.mark.timeout(240)
def test_deadline_keeps_previous_placement_process():
    batch = make_batch()
    with Planner(MODEL, CLUSTER, replica_slots=1, workers=2, executor="process", **FAST) as p:
        first = p.plan(batch)
        p.deadline_s = 1e-9
        second = p.plan(make_batch(seed=1))
    assert first.stats.fallbacks == 0
    assert second.stats.fallbacks >= 1
    second.validate(MODEL, CLUSTER, 16)
    for l in second.stats.fallback_cells["reorder"]:
        np.testing.assert_array_equal(second.placement.expert_gpu[l], first.placement.expert_gpu[l])


@pytest.mark.timeout(120)
def test_deadline_kills_running_tasks():
    import time

    with Planner(MODEL, CLUSTER, replica_slots=1, workers=2, executor="process", deadline_s=1.0, task_hook=sleepy,
                 **FAST) as p:
        t0 = time.monotonic()
        plan = p.plan(make_batch())
        elapsed = time.monotonic() - t0
    plan.validate(MODEL, CLUSTER, 16)
    assert plan.stats.fallbacks == 3 + 1 + 2 * 3  # every layer, locality, every cell
    assert elapsed < 15  # the sleeping workers were stopped, not waited for


@pytest.mark.timeout(240)
def test_dead_worker_falls_back_and_pool_recovers(tmp_path, caplog):
    hook = functools.partial(kill_once, marker=str(tmp_path / "killed"))
    with caplog.at_level(logging.WARNING, logger="relibra_moe.planners.service"):
        with Planner(MODEL, CLUSTER, replica_slots=1, workers=2, executor="process", task_hook=hook,
                     cell_chunk=1, **FAST) as p:
            plan = p.plan(make_batch())
            again = p.plan(make_batch())
    assert (tmp_path / "killed").exists()
    plan.validate(MODEL, CLUSTER, 16)
    cells = plan.stats.fallback_cells["replicate"]
    assert plan.stats.fallbacks == len(cells) >= 1
    for m, l in cells:
        assert (plan.replicas.replica_expert[m, l] == -1).all()
    assert any("lost its worker" in r.message for r in caplog.records)
    assert again.stats.fallbacks == 0  # a fresh pool after the broken one


@pytest.mark.timeout(300)
def test_ray_matches_inline(inline_plan):
    ray = pytest.importorskip("ray")
    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        with Planner(MODEL, CLUSTER, replica_slots=1, workers=2, executor="ray", **FAST) as p:
            plan = p.plan(make_batch())
        assert plan.stats.fallbacks == 0, plan.stats.fallback_cells
        same_plan(plan, inline_plan)
    finally:
        if started:
            ray.shutdown()


def test_other_strategies_delegate():
    with Planner(MODEL, CLUSTER, strategy="lpt", replica_slots=0, executor="inline") as p:
        plan = p.plan(make_batch())
    plan.validate(MODEL, CLUSTER, 16)
    assert plan.stats.strategy == "lpt"


@pytest.mark.parametrize("placement", ["length-balanced", "longest-first"])
def test_planner_runs_a_baseline_on_a_sample_placement(placement):
    """The option reaches the service's plans: a baseline on a placement equals plan_batch's, samples included."""
    from relibra_moe.sample_placements import place_samples

    batch = make_batch()
    with Planner(MODEL, CLUSTER, strategy="online", replica_slots=1, executor="inline",
                 sample_placement=placement) as p:
        plan = p.plan(batch)
    ref = plan_batch(batch, MODEL, CLUSTER, "online", replica_slots=1, sample_placement=placement)
    mb, gpu = place_samples(placement, batch.lengths, batch.resolve_micro_batch(), CLUSTER.num_gpus)
    np.testing.assert_array_equal(plan.samples.micro_batch, mb)
    np.testing.assert_array_equal(plan.samples.gpu, gpu)
    np.testing.assert_array_equal(plan.replicas.replica_expert, ref.replicas.replica_expert)
    assert plan.stats.sample_placement == placement


def test_invalid_inputs():
    with pytest.raises(PlanError, match="unknown strategy 'nope'"):
        Planner(MODEL, CLUSTER, strategy="nope")
    with pytest.raises(PlanError, match="executor='threads' is not one of"):
        Planner(MODEL, CLUSTER, executor="threads")
    with pytest.raises(PlanError, match="replica_slots=-1 must be an int >= 0"):
        Planner(MODEL, CLUSTER, replica_slots=-1)
    with pytest.raises(PlanError, match="deadline_s=0 must be a finite number > 0"):
        Planner(MODEL, CLUSTER, deadline_s=0)
    with pytest.raises(PlanError, match="replica_slots=True must be an int >= 0"):
        Planner(MODEL, CLUSTER, replica_slots=True)
    with pytest.raises(PlanError, match="workers=True must be an int >= 1"):
        Planner(MODEL, CLUSTER, workers=True)
    with pytest.raises(PlanError, match="workers=0 must be an int >= 1"):
        Planner(MODEL, CLUSTER, workers=0)
    with pytest.raises(PlanError, match="num_experts=8 is not divisible by num_gpus=3"):
        Planner(MODEL, ClusterSpec(nodes=1, gpus_per_node=3))
    with pytest.raises(PlanError, match="model tiny"):
        Planner(MODEL.with_(num_layers=2), CLUSTER, executor="inline").plan(make_batch())
    with pytest.raises(PlanError, match="seed=-1 must be an int >= 0"):
        Planner(MODEL, CLUSTER, seed=-1)
    with pytest.raises(PlanError, match="replica_slots=1.5 must be an int >= 0"):
        Planner(MODEL, CLUSTER, replica_slots=1.5)
    with pytest.raises(PlanError, match="unknown plan option itres=3"):
        Planner(MODEL, CLUSTER, itres=3)
    with pytest.raises(PlanError, match="iters=-1 must be an int >= 0"):
        Planner(MODEL, CLUSTER, iters=-1)
    with pytest.raises(PlanError, match="cell_chunk=0 must be an int >= 1"):
        Planner(MODEL, CLUSTER, cell_chunk=0)
    with pytest.raises(PlanError, match="replicate=3 must be a dict"):
        Planner(MODEL, CLUSTER, replicate=3)
    with pytest.raises(PlanError, match="token_cap=100 only applies with repack=True"):
        Planner(MODEL, CLUSTER, token_cap=100)




class _FailingExecutor:
    """A TaskExecutor whose tasks of the given kinds (and, for reorder, layers) never finish."""

    workers = 1
    expired = False

    def __init__(self, kinds, layers=()):
        self.kinds, self.layers, self.seen = set(kinds), set(layers), []

    def map(self, fn, args, keys):
        from relibra_moe.planners.executor import TaskFailed

        self.seen += [k for k, _ in keys]
        return [TaskFailed("test") if kind in self.kinds and (kind != "reorder" or key[0] in self.layers)
                else fn(*a) for a, (kind, key) in zip(args, keys)]


def test_plan_batch_loop_falls_back_per_task_on_any_executor():
    """The one planning loop behind plan_batch and Planner: a failed reorder layer keeps its start (LPT), a
    failed locality pass keeps the samples, failed replication cells get no replicas; each is counted."""
    from relibra_moe.planners.options import PlanOptions
    from relibra_moe.planners.reorder import lpt_placement
    from relibra_moe.planners.strategies import plan_with_options

    batch = make_batch()
    opts = PlanOptions(replica_slots=1, migration=False, **FAST)
    ex = _FailingExecutor({"reorder", "locality", "replicate"}, layers={1})
    plan = plan_with_options(batch, MODEL, CLUSTER, "relibra", opts, executor=ex)
    assert set(ex.seen) == {"reorder", "locality", "replicate"}
    x = batch.loads(plan.samples.gpu, CLUSTER.num_gpus, plan.samples.micro_batch)
    np.testing.assert_array_equal(plan.placement.expert_gpu[1], lpt_placement(x[:, 1].sum(axis=(0, 1)), 4))
    from relibra_moe.sample_placements import length_balanced

    mb, gpu = length_balanced(batch.lengths, batch.resolve_micro_batch(), 4)  # relibra's start, kept
    np.testing.assert_array_equal(plan.samples.gpu, gpu)
    np.testing.assert_array_equal(plan.samples.micro_batch, mb)
    assert not (plan.replicas.replica_expert >= 0).any()
    cells = plan.num_micro_batches * MODEL.num_layers
    assert plan.stats.fallbacks == 1 + 1 + cells  # one reorder layer, one locality round, every cell
    ok = plan_with_options(batch, MODEL, CLUSTER, "relibra", opts, executor=_FailingExecutor(set()))
    assert ok.stats.fallbacks == 0 and (ok.replicas.replica_expert >= 0).any()


def test_planner_stats_are_plan_batchs_plus_the_executor(inline_plan):
    """One loop: a Planner plan records what plan_batch records (rounds, options, repack), plus its executor,
    workers and fallback cells (the oracle's Planner plan files changed by exactly these keys)."""
    from relibra_moe.planners.strategies import plan_batch

    ref = plan_batch(make_batch(), MODEL, CLUSTER, "relibra", replica_slots=1, workers=1, **FAST)
    assert set(inline_plan.stats.to_dict()) == set(ref.stats.to_dict()) | {"executor", "workers", "fallback_cells"}
    assert inline_plan.stats.options == ref.stats.options == dict(sorted(FAST.items()))  # none at its default
    assert inline_plan.stats.fallback_cells == {"reorder": [], "locality": 0, "replicate": []}


def test_lplb_runs_on_the_executor_and_falls_back_per_task():
    """LPLB+ splits are "replicate" tasks on the given executor (no private pool): the same plan as inline
    when they finish; a failed task leaves its cells without replicas (every token home) and counts them."""
    from relibra_moe.planners.options import PlanOptions
    from relibra_moe.planners.strategies import plan_with_options

    batch = make_batch()
    opts = PlanOptions(replica_slots=1)
    ref = plan_with_options(batch, MODEL, CLUSTER, "lplb", opts)
    ok_ex = _FailingExecutor(set())
    ok = plan_with_options(batch, MODEL, CLUSTER, "lplb", opts, executor=ok_ex)
    assert ok_ex.seen == ["replicate"]  # one chunk of every cell for one worker
    same_plan(ok, ref)
    assert ok.stats.fallbacks == 0 and (ok.replicas.replica_expert >= 0).any() and len(ok.replicas.split_share)
    ex = _FailingExecutor({"replicate"})
    plan = plan_with_options(batch, MODEL, CLUSTER, "lplb", opts, executor=ex)
    plan.validate(MODEL, CLUSTER, 16)
    cells = plan.num_micro_batches * MODEL.num_layers
    assert plan.stats.fallbacks == cells
    np.testing.assert_array_equal(plan.placement.expert_gpu, ref.placement.expert_gpu)
    assert not (plan.replicas.replica_expert >= 0).any() and len(plan.replicas.split_share) == 0


def test_planner_lplb_deadline_falls_back_every_cell(caplog):
    """Planner(strategy="lplb") gets the service's deadline: tasks past it fall back, cell by cell, logged."""
    with caplog.at_level(logging.WARNING, logger="relibra_moe.planners.service"):
        with Planner(MODEL, CLUSTER, strategy="lplb", replica_slots=1, executor="inline", deadline_s=1e-9) as p:
            plan = p.plan(make_batch())
    plan.validate(MODEL, CLUSTER, 16)
    M, L = plan.num_micro_batches, MODEL.num_layers
    assert plan.stats.strategy == "lplb" and plan.stats.fallbacks == M * L
    assert sorted(map(tuple, plan.stats.fallback_cells["replicate"])) == [(m, l) for m in range(M) for l in range(L)]
    assert not (plan.replicas.replica_expert >= 0).any() and len(plan.replicas.split_index) == 0
    assert any("falling back" in r.message for r in caplog.records)


ADVERSARIAL_FAST = dict(iters=300, locality_iters=200, num_seeds=2, rounds=1, price_replicas=False)


def _batch(seed: int = 0, n: int = 8) -> TraceBatch:
    rng = np.random.default_rng(seed)
    counts = np.zeros((n, 3, 8), np.int64)
    for i in range(n):
        tokens = int(rng.integers(4, 12))
        for l in range(3):
            for _ in range(tokens):
                counts[i, l, rng.choice(8, 2, replace=False, p=np.r_[[4.0] * 2, [1.0] * 6] / 14)] += 1
    return TraceBatch.from_counts(counts, 2).with_micro_batch(np.arange(n) % 2)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def slow_task(kind, key):
    """Task hook: every task takes 1.5 s (picklable, for the process pool)."""
    time.sleep(1.5)


def test_ray_with_nothing_listening_raises_a_named_error_quickly():
    addr = f"127.0.0.1:{_free_port()}"  # bound then released: nothing listens there
    t0 = time.perf_counter()
    with Planner(MODEL, CLUSTER, "static", replica_slots=0, executor="ray", ray_address=addr, deadline_s=5) as p:
        with pytest.raises(PlanError, match=rf"Planner\(executor='ray'\): cannot connect to Ray at {addr} "):
            p.plan(_batch())
    assert time.perf_counter() - t0 < 10


def test_ray_failure_can_fall_back_to_processes():
    addr = f"127.0.0.1:{_free_port()}"
    with Planner(MODEL, CLUSTER, "eplb", replica_slots=1, workers=2, executor="ray", ray_address=addr,
                 on_ray_failure="process") as p:
        plan = p.plan(_batch())
    plan.validate(MODEL, CLUSTER, 8)
    assert plan.stats.executor == "process" and addr in plan.stats.executor_fallback
    ref = plan_batch(_batch(), MODEL, CLUSTER, "eplb", replica_slots=1)  # the same plan as in one process
    np.testing.assert_array_equal(plan.placement.expert_gpu, ref.placement.expert_gpu)
    np.testing.assert_array_equal(plan.replicas.replica_expert, ref.replicas.replica_expert)


@pytest.mark.timeout(60)
def test_ray_init_that_hangs_is_cut_at_the_connect_timeout():
    """A server that accepts the TCP connection and never answers: the probe passes, ``ray.init`` would block;
    the planner gives up at ``ray_connect_timeout_s``. In a subprocess: the abandoned connect stays there."""
    code = textwrap.dedent("""
        import socket, sys, time
        import numpy as np
        from relibra_moe.errors import PlanError
        from relibra_moe.planners.service import Planner
        from relibra_moe.specs import ClusterSpec, ModelSpec
        from relibra_moe.trace import TraceBatch
        srv = socket.socket(); srv.bind(("127.0.0.1", 0)); srv.listen(8)
        addr = "127.0.0.1:%d" % srv.getsockname()[1]
        batch = TraceBatch.from_counts(np.full((2, 1, 4), 1), 2).with_micro_batch([0, 1])
        p = Planner(ModelSpec("t", hidden=64, ffn=64, num_experts=4, top_k=2, num_layers=1),
                    ClusterSpec(nodes=1, gpus_per_node=2), "static", replica_slots=0, executor="ray",
                    ray_address=addr, ray_connect_timeout_s=2)
        t0 = time.perf_counter()
        try:
            p.plan(batch)
            print("NO ERROR")
        except PlanError as exc:
            print("ERR", round(time.perf_counter() - t0, 1), exc)
        sys.stdout.flush()
        import os; os._exit(0)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=50)
    line = [x for x in out.stdout.splitlines() if x.startswith(("ERR", "NO ERROR"))]
    assert line and line[0].startswith("ERR"), (out.stdout, out.stderr[-2000:])
    secs = float(line[0].split()[1])
    assert secs < 6, line[0]
    assert "cannot connect to Ray at 127.0.0.1:" in line[0], line[0]


def test_inline_deadline_is_reported_in_stats():
    t0 = time.perf_counter()
    with Planner(MODEL, CLUSTER, replica_slots=1, executor="inline", deadline_s=1.0, task_hook=slow_task,
                 **ADVERSARIAL_FAST) as p:
        plan = p.plan(_batch())
    took = time.perf_counter() - t0
    plan.validate(MODEL, CLUSTER, 8)
    assert plan.stats.deadline.to_dict() == {"deadline_s": 1.0, "interrupts_tasks": False}
    overrun = plan.stats.timing["deadline_overrun_s"]
    assert 0.3 < overrun <= took  # the running task finished past the deadline: said so, in seconds
    assert plan.stats.fallbacks >= 1  # and the tasks not started fell back
    with Planner(MODEL, CLUSTER, replica_slots=1, executor="inline", deadline_s=100.0, **ADVERSARIAL_FAST) as p:
        on_time = p.plan(_batch())
    assert on_time.stats.timing["deadline_overrun_s"] == 0.0 and on_time.stats.fallbacks == 0


@pytest.mark.timeout(60)
@pytest.mark.parametrize("strategy", ["eplb", "eplb-history"])
def test_eplb_strategies_honour_the_deadline(strategy):
    opts = {"history": np.ones((3, 8))} if strategy == "eplb-history" else {}
    t0 = time.perf_counter()
    with Planner(MODEL, CLUSTER, strategy, replica_slots=1, workers=1, executor="process", deadline_s=0.5,
                 task_hook=slow_task, **opts) as p:
        plan = p.plan(_batch())
    assert time.perf_counter() - t0 < 1.4  # the 1.5 s layout task was not waited for
    plan.validate(MODEL, CLUSTER, 8)
    assert plan.stats.fallback_cells["strategy"] == 1 and plan.stats.fallbacks == 1
    from relibra_moe.planners.baselines import static_placement

    np.testing.assert_array_equal(plan.placement.expert_gpu, static_placement(3, 8, 4))  # no previous: static
    assert (plan.replicas.replica_expert == -1).all()
    with Planner(MODEL, CLUSTER, strategy, replica_slots=1, executor="inline", **opts) as p:
        ok = p.plan(_batch())  # no deadline: the same as plan_batch
    ref = plan_batch(_batch(), MODEL, CLUSTER, strategy, replica_slots=1, **opts)
    np.testing.assert_array_equal(ok.placement.expert_gpu, ref.placement.expert_gpu)
    assert "strategy" not in ok.stats.fallback_cells


def test_warnings_are_one_line_per_cause_with_a_count(caplog):
    with caplog.at_level(logging.WARNING, logger="relibra_moe.planners.service"):
        with Planner(MODEL, CLUSTER, replica_slots=1, executor="inline", deadline_s=1e-9, **ADVERSARIAL_FAST) as p:
            plan = p.plan(_batch())
    msgs = [r.getMessage() for r in caplog.records if r.name == "relibra_moe.planners.service"]
    M, L = 2, 3
    assert plan.stats.fallbacks == L + 1 + M * L
    assert len(msgs) == len({m.split(" task(s) ")[0].split()[-1] for m in msgs}) == 3, msgs  # reorder, locality,
    assert any(m.startswith(f"relibra planner: {L * ADVERSARIAL_FAST['num_seeds']} reorder task(s) missed the deadline")
               for m in msgs), msgs                                                    # replicate: one line each
    assert any(m.startswith("relibra planner: 1 locality task(s) missed the deadline") for m in msgs), msgs


FROZEN_SCRIPT = textwrap.dedent("""
    import signal, sys, time
    import numpy as np
    from relibra_moe.planners.service import Planner
    from relibra_moe.specs import ClusterSpec, ModelSpec
    from relibra_moe.trace import TraceBatch

    def frozen(kind, key):  # a worker frozen in its task, deaf to SIGTERM
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        while True:
            time.sleep(0.05)

    if __name__ == "__main__":
        counts = np.zeros((4, 2, 8), np.int64)
        counts[:, :, :2] = 3
        batch = TraceBatch.from_counts(counts, 2).with_micro_batch([0, 0, 1, 1])
        p = Planner(ModelSpec("t", hidden=64, ffn=64, num_experts=8, top_k=2, num_layers=2),
                    ClusterSpec(nodes=1, gpus_per_node=2), "relibra", replica_slots=1, workers=1, executor="process",
                    deadline_s=1.0, task_hook=frozen, iters=50, locality_iters=20, num_seeds=1, rounds=1,
                    price_replicas=False, portfolio=False)
        plan = p.plan(batch)
        import multiprocessing
        alive = [c.pid for c in multiprocessing.active_children() if c.is_alive()]
        print("PLANNED", plan.stats.fallbacks, "ALIVE", len(alive), flush=True)
        if sys.argv[1] == "close":
            p.close()
        print("DONE", flush=True)
""")


@pytest.mark.timeout(200)
@pytest.mark.parametrize("end", ["close", "exit"])
def test_a_frozen_worker_never_keeps_the_interpreter_alive(end, tmp_path):
    """The plan returns on its deadline with no worker left alive, and neither ``close()`` nor the interpreter's
    exit waits for a worker frozen in its task (before: SIGTERM, which the frozen worker ignores, left it running
    and the exit waiting for it forever)."""
    script = tmp_path / "frozen.py"
    script.write_text(FROZEN_SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    proc = subprocess.Popen([sys.executable, str(script), end], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=90)  # imports take seconds on a loaded box; the hang was forever
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)  # the script's own process group: it and its frozen worker
        proc.communicate()
        pytest.fail(f"the interpreter did not exit after the plan ({end})")
    assert proc.returncode == 0, err[-2000:]
    assert "PLANNED" in out and "DONE" in out, (out, err[-2000:])
    assert int(out.split("PLANNED")[1].split()[0]) >= 1  # it did miss the deadline
    assert out.split("ALIVE")[1].split()[0] == "0"  # no worker outlives the plan that gave up on it
