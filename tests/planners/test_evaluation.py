"""planners/evaluation.py: the simulator-backed judge reports what the simulator reports, its re-layout seconds are
the step's ``reorder_s`` for the same move, and no other planners module imports the simulator."""

from __future__ import annotations

import ast
from pathlib import Path

import numpy as np

from relibra_moe.evaluate import placement_loads
from relibra_moe.plan import Placement
from relibra_moe.planners.evaluation import SIMULATED_STEP, SimulatedStep
from relibra_moe.planners.strategies import plan_batch
from relibra_moe.sim import simulate_step
from relibra_moe.specs import ClusterSpec, ModelSpec
from relibra_moe.synthetic import rl_batch
from relibra_moe.timing import move_bytes, transfer_seconds

MODEL = ModelSpec("t", hidden=256, ffn=128, num_experts=8, top_k=2, num_layers=2)
CLUSTER = ClusterSpec(nodes=2, gpus_per_node=2)
PLANNERS = Path(__file__).resolve().parents[2] / "relibra_moe" / "planners"


def _plan_and_batch():
    batch = rl_batch(MODEL, "mixed", 3, responses_per_prompt=4, seed=5, micro_batch_size=6, max_len=64)
    return plan_batch(batch, MODEL, CLUSTER, "relibra", replica_slots=1, iters=100, locality_iters=50,
                      num_seeds=1, rounds=1), batch


def test_the_simulated_step_is_the_simulators():
    plan, batch = _plan_and_batch()
    previous = Placement.static(MODEL.num_layers, MODEL.num_experts, CLUSTER.num_gpus)
    x = placement_loads(batch, plan.samples.micro_batch, plan.samples.gpu, plan.num_micro_batches, CLUSTER.num_gpus)
    got = SIMULATED_STEP.step(plan, np.asarray(batch.lengths), x, MODEL, CLUSTER, previous, 12.0)
    want = simulate_step(plan, batch, MODEL, CLUSTER, previous=previous)
    assert (got.step_s, got.t_moe_s, got.reorder_s, got.replica_exposed_s, got.replica_mode) == (
        want.step_s, want.t_moe_s, want.reorder_s, want.replica_exposed_s, want.replica_mode)


def test_relayout_seconds_is_the_steps_reorder_term_and_the_hand_transfer():
    plan, batch = _plan_and_batch()
    previous = Placement.static(MODEL.num_layers, MODEL.num_experts, CLUSTER.num_gpus)
    x = placement_loads(batch, plan.samples.micro_batch, plan.samples.gpu, plan.num_micro_batches, CLUSTER.num_gpus)
    st = SimulatedStep().step(plan, np.asarray(batch.lengths), x, MODEL, CLUSTER, previous, 4.0)
    got = SimulatedStep().relayout_seconds(previous, plan.placement, MODEL, CLUSTER, 4.0)
    assert got == st.reorder_s
    moved = previous.expert_gpu != plan.placement.expert_gpu
    want = 0.0 if not moved.any() else float(transfer_seconds(
        previous.expert_gpu[moved], plan.placement.expert_gpu[moved], move_bytes(MODEL, 4.0), None, 1, CLUSTER)[0])
    assert got == want
    assert SIMULATED_STEP.relayout_seconds(previous, previous, MODEL, CLUSTER, 4.0) == 0.0


def sim_importers(root: Path) -> set[str]:
    """planners modules importing ``relibra_moe.sim`` (relative or absolute, anywhere in the file)."""
    out = set()
    for path in root.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (
                    (node.level == 2 and node.module == "sim") or node.module == "relibra_moe.sim"
                    or (node.level == 2 and node.module is None and any(a.name == "sim" for a in node.names))):
                out.add(path.name)
    return out


def test_only_the_evaluation_module_imports_the_simulator(tmp_path):
    assert sim_importers(PLANNERS) == {"evaluation.py"}
    (tmp_path / "p.py").write_text("def f():\n    from ..sim import simulate_loads\n")
    (tmp_path / "q.py").write_text("from .. import sim\n")
    assert sim_importers(tmp_path) == {"p.py", "q.py"}  # the checker sees local and package-form imports
