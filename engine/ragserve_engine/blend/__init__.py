"""CacheBlend-style reuse of retrieved documents' KV at any position (docs/blend.md)."""
