"""Test support shared across the suite: processes, ports, tiny models, fixtures' building blocks."""
