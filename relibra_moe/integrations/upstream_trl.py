"""Every place the TRL integration relies on TRL (and the transformers ``Trainer`` under it) beyond their public API,
in one list.

Written against trl 1.16 (:data:`TESTED`); ``tests/integrations/test_upstream_trl.py`` asserts the installed version
is in that range and that every method below exists on ``trl.GRPOTrainer`` with the parameters listed, so a release
that renames or reshapes one fails a test named for it.

``GRPOTrainer`` has no public hook for what :class:`~relibra_moe.integrations.trl.ReplayGRPOTrainer` adds (record
the rollout's routing, plan the batch, replay it in the training step, save and resume relibra's placement with
the expert-parallel optimizer state), so the trainer overrides these private methods (:data:`OVERRIDES`), each
calling the parent's and keeping its signature.
"""

from __future__ import annotations

__all__ = ["OVERRIDES", "TESTED"]

#: trl versions this list was written and tested against: ``(lowest, first untested)`` major.minor.
TESTED: tuple[tuple[int, int], tuple[int, int]] = ((1, 16), (1, 17))

#: The private ``GRPOTrainer`` / ``Trainer`` methods ``ReplayGRPOTrainer`` overrides, with their parameters.
OVERRIDES: dict[str, tuple[str, ...]] = {
    "_generate_single_turn": ("self", "prompt_ids", "images", "multimodal_fields", "num_generations",
                              "has_tool_images"),  # rollout: record the routing of generate()
    "_generate": ("self", "prompts"),  # rollout of one batch
    "_generate_and_score_completions": ("self", "inputs"),  # the batch's traces, then its plan
    "_prepare_inputs": ("self", "generation_batch"),  # the training step's micro-batches, under replay
    "_save": ("self", "output_dir", "state_dict"),  # the full model from expert-parallel ranks
    "_save_optimizer_and_scheduler": ("self", "output_dir"),  # the experts' optimizer state and the placement
    "_load_from_checkpoint": ("self", "resume_from_checkpoint", "model"),  # the placement, then the weights
    "_load_optimizer_and_scheduler": ("self", "checkpoint"),  # the experts' optimizer state, by logical id
}
