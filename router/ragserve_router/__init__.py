"""The ragserve gateway (torch-free)."""
