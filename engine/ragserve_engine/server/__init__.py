"""The engine's HTTP server: OpenAI API, metrics, warm-up, and its cluster duties (registration, KV events)."""
