"""HTTP plumbing shared by the engine server and the router (needs the `http` extra: FastAPI, uvicorn)."""
