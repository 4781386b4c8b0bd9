"""The ragserve shared KV-block store (torch-free)."""
