"""layers of relibra_moe."""
