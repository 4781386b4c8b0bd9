"""`ragserve sim-engine`: simulated engines for router scale benchmarks and load tests (never correctness tests).

Each simulated engine is a real engine server (ragserve_engine.server: the same OpenAI routes, SSE, /metrics,
registration, heartbeats and KV-event stream) in front of SimEngine, an EngineClient whose steps are asyncio
sleeps drawn from the engine's cost model and whose prefix cache is the engine's BlockPool keyed by
ragserve.keys: kv (the paged-KV model), engine (the simulated scheduler), cli (flags; N engines per process).
Torch-free: 256 of them fit in one process.
"""
