"""planners of relibra_moe."""
