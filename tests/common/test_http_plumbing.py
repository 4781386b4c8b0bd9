"""The shared server plumbing in ragserve.http, ragserve.tls and ragserve.logs, in-process."""

from __future__ import annotations

import asyncio
import logging
import signal

import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.testclient import TestClient

from ragserve.http.auth import INVALID, MISSING, SINGLE, ApiKey, ApiKeys, digest, require_api_key
from ragserve.http.drain import DrainingServer
from ragserve.http.errors import ApiError, install_error_handlers
from ragserve.tls import channel_credentials, server_credentials


def app_with(keys: ApiKeys, admit=None) -> TestClient:
    app = FastAPI()
    auth = require_api_key(keys, admit)
    install_error_handlers(app, "test", logging.getLogger("test"))

    @app.get("/who")
    async def who(key: ApiKey | None = auth) -> dict:
        return {"name": key.name if key else None}

    @app.get("/boom")
    async def boom() -> dict:
        raise RuntimeError("secret detail")

    return TestClient(app, raise_server_exceptions=False)


def bearer(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


def test_keys_off_lets_everyone_in():
    assert app_with(ApiKeys(None)).get("/who").json() == {"name": None}


def test_named_keys_tell_missing_from_wrong():
    client = app_with(ApiKeys([ApiKey("a", digest("sk-a")), ApiKey("b", digest("sk-b"))]))
    assert client.get("/who", headers=bearer("sk-b")).json() == {"name": "b"}
    for headers, message in (({}, MISSING), (bearer("sk-c"), INVALID), ({"Authorization": "Basic sk-a"}, MISSING)):
        resp = client.get("/who", headers=headers)
        assert resp.status_code == 401
        assert resp.json()["error"] == {
            "message": message,
            "type": "authentication_error",
            "param": None,
            "code": "invalid_api_key",
        }


def test_single_key_has_one_message():
    client = app_with(ApiKeys.single("sk-1"))
    assert client.get("/who", headers=bearer("sk-1")).status_code == 200
    assert client.get("/who").json()["error"]["message"] == SINGLE
    assert client.get("/who", headers=bearer("sk-2")).json()["error"]["message"] == SINGLE
    assert ApiKeys.single(None).keys is None


def test_admit_runs_after_the_key_and_may_refuse():
    def admit(request: Request, key: ApiKey | None) -> None:
        raise ApiError(429, f"slow down, {key.name}", "rate_limit_exceeded", headers={"Retry-After": "1"})

    resp = app_with(ApiKeys.single("sk-1"), admit).get("/who", headers=bearer("sk-1"))
    assert resp.status_code == 429 and resp.headers["retry-after"] == "1"
    assert resp.json()["error"]["type"] == "rate_limit_error"


def test_unexpected_errors_and_unknown_routes_are_openai_bodies():
    client = app_with(ApiKeys(None))
    resp = client.get("/boom")
    assert resp.status_code == 500
    assert resp.json()["error"] == {
        "message": "internal test error",
        "type": "server_error",
        "param": None,
        "code": "internal_error",
    }
    assert client.get("/nowhere").json()["error"]["code"] == "not_found"
    assert client.post("/who").json()["error"]["type"] == "invalid_request_error"  # 405


class Recorder(DrainingServer):
    def __init__(self) -> None:
        super().__init__(uvicorn.Config(FastAPI()))
        self.calls: list[str] = []

    def begin_drain(self, reason: str) -> None:
        super().begin_drain(reason)
        self.calls.append(f"begin {reason}")

    async def drain(self, reason: str) -> None:
        self.calls.append(f"drain {reason}")


def test_first_signal_drains_second_forces():
    async def main() -> Recorder:
        server = Recorder()
        server.loop = asyncio.get_running_loop()
        server.handle_exit(signal.SIGTERM, None)
        assert server.calls == ["begin SIGTERM"] and not server.should_exit
        for _ in range(3):
            await asyncio.sleep(0)
        assert server.should_exit and not server.force_exit
        server.handle_exit(signal.SIGTERM, None)
        assert server.force_exit
        return server

    assert asyncio.run(main()).calls == ["begin SIGTERM", "drain SIGTERM"]


def test_tls_names_the_flag_of_an_unreadable_file(tmp_path):
    missing = str(tmp_path / "missing.pem")
    with pytest.raises(ValueError, match="cannot read --tls-cert"):
        key = tmp_path / "key.pem"
        key.write_text("not checked before the certificate is read")
        server_credentials(missing, str(key))
    with pytest.raises(ValueError, match="cannot read --router-tls-ca"):
        channel_credentials(missing, flags="--router-tls-")
    assert channel_credentials() is not None  # system roots


@pytest.mark.parametrize(
    ("field", "value"),
    [("quantization", "int3"), ("kv_cache_dtype", "fp4"), ("attention_backend", "cuda"), ("dtype", "float8")],
)
def test_engine_config_built_in_code_checks_each_choice(field, value):
    """Flags are checked by argparse; a config made in code (LLM(...), tests) by the same choices."""
    from ragserve.engine_args import EngineConfig

    with pytest.raises(ValueError, match=f"{field} must be one of"):
        EngineConfig(**{field: value})
