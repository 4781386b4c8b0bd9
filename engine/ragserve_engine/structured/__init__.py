"""Structured outputs: grammar-constrained decoding with llguidance (docs/api.md says why llguidance)."""
