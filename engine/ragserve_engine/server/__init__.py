"""The engine's HTTP server: OpenAI API, metrics, warm-up, and its cluster duties (registration, KV events).

launcher (the `ragserve engine` process: uvicorn, model load, drain), engine_server (EngineServer: what one
server holds), routes (the FastAPI endpoints), serving_base / serving_chat / serving_completion (OpenAI
requests), blend_api (chats with chunk parts), generation, streaming, logprobs, protocol (request bodies),
transport (body parsing, disconnects), errors (engine ValueErrors as 400s), metrics, warmup, calibration,
registration and kv_events (the router's registry). It reaches the engine only through
ragserve_engine.engine_client: EngineClient and the values it takes and returns (tests/common/test_layout.py).
"""
