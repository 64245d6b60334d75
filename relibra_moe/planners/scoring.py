"""Re-export of the plan evaluation, which lives in ``relibra_moe.evaluate`` (below the planners)."""

from ..evaluate import batch_sha1, check_plan_batch, json_summary, plan_flow, plan_loads, score_plan  # noqa: F401
