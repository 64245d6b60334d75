"""Ablation of issue 22's planner changes on seven cells of bench/never_lose.py.

relibra's step (steady mean of steps 2..4 for K = 4, the single step for K = 1; the simulator's one rule
throughout) with: the defaults; ``step_objective=False`` (reorder and locality anneal T_MoE instead of the step's
``1.5 comp + comm``); the replica pricing (``replicate_cell`` / ``timing.cell_step_seconds``) patched back to the
window before issue 22 (a replayed fetch hidden behind the attention forward only). online's step beside.
Writes bench/results/never_lose_ablation.json.

Usage::

    RELIBRA_TRACES=/work/shared/traces python bench/never_lose_ablation.py
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

import relibra_moe.planners.replicate as replicate
import relibra_moe.timing as timing
from relibra_moe.steady import plan_steady

sys.path.insert(0, str(Path(__file__).resolve().parent))
import never_lose as nl  # noqa: E402

CELLS = (0, 1, 5, 10, 21, 25, 30)
ONE_RULE = timing.replica_push_overlap


def old_window(attn_fwd: np.ndarray | float, comm: np.ndarray | float, fetch: str = "per-layer"):
    """The replica-push window before issue 22: the attention forward for a replayed fetch."""
    return attn_fwd if fetch == "per-layer" else 0.5 * comm


def steady_step(batches, model, cluster, strategy: str, r: int, **options) -> float:
    _, rows = plan_steady(batches, model, cluster, strategy, replica_slots=r, **options)
    rest = rows[1:] or rows
    return float(np.mean([row["step_s"] for row in rest]))


def main() -> None:
    out = {}
    for i in CELLS:
        batches, model, cluster = nl.build(i)
        r = nl.CELLS[i][5]
        row = {"default": steady_step(batches, model, cluster, "relibra", r),
               "step_objective=False": steady_step(batches, model, cluster, "relibra", r, step_objective=False)}
        replicate.replica_push_overlap = timing.replica_push_overlap = old_window  # the planner's pricing only
        try:
            row["old window in pricing"] = steady_step(batches, model, cluster, "relibra", r)
        finally:
            replicate.replica_push_overlap = timing.replica_push_overlap = ONE_RULE
        row["online"] = steady_step(batches, model, cluster, "online", r)
        out[nl.cell_name(i)] = row
        print(nl.cell_name(i), {k: round(v, 4) for k, v in row.items()}, flush=True)
    (nl.OUT.parent / "never_lose_ablation.json").write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
