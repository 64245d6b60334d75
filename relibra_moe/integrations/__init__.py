"""integrations of relibra_moe."""
