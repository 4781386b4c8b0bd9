"""The runtime admin API on a real router with two real engines: without the admin key 401; drain an engine with a
request in flight on it (held there by freezing the engine) -> new requests go elsewhere, the held one still
completes, drain reports empty; remove and add change the candidates."""

from __future__ import annotations

import signal
import threading

import httpx

ADMIN_KEY = "admin-secret-key"


def chat(text: str) -> dict:
    return {"model": "tiny", "messages": [{"role": "user", "content": text}], "max_tokens": 2}


def test_admin_api_drains_removes_and_adds_engines(cluster, tmp_path, until):
    key_file = tmp_path / "admin-key"
    key_file.write_text(ADMIN_KEY + "\n")
    a, b = cluster.real_engines(None, 2, "--max-model-len", "256")
    flags = ["--static-engines", f"{a.url},{b.url}", "--policy", "round_robin", "--probe-interval", "30"]
    router = cluster.router(*flags, "--admin-api-key-file", str(key_file))
    admin = httpx.Client(base_url=router.url + "/admin", headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=60)

    def engines() -> dict[str, dict]:
        return {e["engine_id"]: e for e in admin.get("/engines").json()["engines"]}

    def post(text: str) -> httpx.Response:
        return httpx.post(router.url + "/v1/chat/completions", json=chat(text), timeout=120)

    until(lambda: all(e["healthy"] for e in engines().values()), timeout=60, message="both engines probed")
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        refused = httpx.get(router.url + "/admin/engines", headers=headers, timeout=5)
        assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_admin_key"
    assert httpx.post(router.url + "/admin/engines/static-0/drain", timeout=5).status_code == 401
    assert not engines()["static-0"]["draining"]  # the refused call changed nothing

    # hold a request in flight on static-0: the only candidate while static-1 drains, and frozen
    assert admin.post("/engines/static-1/drain").json()["drained"] is True
    a.popen.send_signal(signal.SIGSTOP)
    held: list[httpx.Response] = []
    thread = threading.Thread(target=lambda: held.append(post("held on a frozen engine")))
    thread.start()
    try:
        until(lambda: engines()["static-0"]["inflight"] == 1, message="request in flight on static-0")
        assert admin.post("/engines/static-1/undrain").json()["draining"] is False
        drained = admin.post("/engines/static-0/drain").json()
        assert drained["draining"] is True and drained["inflight"] == 1 and drained["drained"] is False
        answers = [post(f"while draining {i}") for i in range(4)]
        assert [(r.status_code, r.headers["x-ragserve-engine"]) for r in answers] == [(200, "static-1")] * 4
    finally:
        a.popen.send_signal(signal.SIGCONT)
    thread.join(timeout=120)
    assert held[0].status_code == 200 and held[0].headers["x-ragserve-engine"] == "static-0"  # in-flight finished
    final = admin.post("/engines/static-0/drain", params={"wait": 30}).json()  # answers once it is empty
    assert final["drained"] is True and final["inflight"] == 0

    # remove the drained engine; add it back under a new id
    assert admin.delete("/engines/static-0").json()["removed"] is True
    assert set(engines()) == {"static-1"}
    assert {post(f"one left {i}").headers["x-ragserve-engine"] for i in range(3)} == {"static-1"}
    for bad in ({"json": {"url": "ftp://x"}}, {"json": {"url": 7}}, {"json": ["x"]}, {"content": b"{not json"}):
        answer = admin.post("/engines", **bad)
        assert answer.status_code == 400 and answer.json()["error"]["param"] == "url", bad
    added = admin.post("/engines", json={"url": a.url})
    assert added.status_code == 201, added.text
    assert added.json()["healthy"] is True and added.json()["models"] == ["tiny"]
    assert admin.post("/engines", json={"url": a.url}).status_code == 409
    assert {post(f"two again {i}").headers["x-ragserve-engine"] for i in range(4)} == {"static-1", "admin-0"}
    assert admin.delete("/engines/nope").status_code == 404
