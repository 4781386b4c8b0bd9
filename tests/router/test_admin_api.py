"""The runtime admin API on two real router replicas sharing Redis, with two real engines: without the admin key 401;
a drain, undrain, removal or addition through one replica holds on the other; an engine with a request in flight
through the other replica (held there by freezing the engine) is not reported drained; new requests go elsewhere,
the held one still completes, drain reports empty once the engine says it is idle."""

from __future__ import annotations

import signal
import threading

import httpx

ADMIN_KEY = "admin-secret-key"
AUTH = {"Authorization": f"Bearer {ADMIN_KEY}"}


def chat(text: str) -> dict:
    return {"model": "tiny", "messages": [{"role": "user", "content": text}], "max_tokens": 2}


def test_admin_api_drains_removes_and_adds_engines_on_every_replica(cluster, tmp_path, until):
    key_file = tmp_path / "admin-key"
    key_file.write_text(ADMIN_KEY + "\n")
    a, b = cluster.real_engines(None, 2, "--max-model-len", "256")
    flags = ["--static-engines", f"{a.url},{b.url}", "--policy", "round_robin", "--probe-interval", "30"]
    flags += ["--admin-api-key-file", str(key_file), "--redis", cluster.redis()]
    one, two = cluster.router(*flags, name="router-1"), cluster.router(*flags, name="router-2")
    admin = {r.url: httpx.Client(base_url=r.url + "/admin", headers=AUTH, timeout=60) for r in (one, two)}

    def engines(router) -> dict[str, dict]:
        return {e["engine_id"]: e for e in admin[router.url].get("/engines").json()["engines"]}

    def post(router, text: str) -> httpx.Response:
        return httpx.post(router.url + "/v1/chat/completions", json=chat(text), timeout=120)

    def served_by(router, text: str, n: int) -> set[str]:
        return {post(router, f"{text} {i}").headers["x-ragserve-engine"] for i in range(n)}

    for r in (one, two):
        until(lambda r=r: all(e["healthy"] for e in engines(r).values()), timeout=60, message="both engines probed")
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        refused = httpx.get(one.url + "/admin/engines", headers=headers, timeout=5)
        assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_admin_key"
    assert httpx.post(one.url + "/admin/engines/static-0/drain", timeout=5).status_code == 401
    assert not engines(one)["static-0"]["draining"]  # the refused call changed nothing

    # a drain through replica one holds on replica two as well
    assert admin[one.url].post("/engines/static-1/drain").json()["drained"] is True
    until(lambda: engines(two)["static-1"]["draining"], message="replica two sees the drain")
    # hold a request in flight on static-0 through replica two: the only candidate, and frozen
    a.popen.send_signal(signal.SIGSTOP)
    held: list[httpx.Response] = []
    thread = threading.Thread(target=lambda: held.append(post(two, "held on a frozen engine")))
    thread.start()
    try:
        until(lambda: engines(two)["static-0"]["inflight"] == 1, message="request in flight on static-0")
        assert admin[two.url].post("/engines/static-1/undrain").json()["draining"] is False
        drained = admin[one.url].post("/engines/static-0/drain").json()
        # replica one has nothing in flight there, but the engine has not said it is idle: not drained
        assert drained["draining"] is True and drained["inflight"] == 0 and drained["drained"] is False
        until(lambda: not engines(one)["static-1"]["draining"], message="replica one sees the undrain")
        until(lambda: engines(two)["static-0"]["draining"], message="replica two sees the drain")
        assert served_by(one, "one, while draining", 3) == served_by(two, "two, while draining", 3) == {"static-1"}
    finally:
        a.popen.send_signal(signal.SIGCONT)
    thread.join(timeout=120)
    assert held[0].status_code == 200 and held[0].headers["x-ragserve-engine"] == "static-0"  # in-flight finished
    final = admin[one.url].post("/engines/static-0/drain", params={"wait": 30}).json()  # answers once it is empty
    assert final["drained"] is True and final["inflight"] == 0

    # remove the drained engine through one: both forget it; add it back through two: both route to it
    assert admin[one.url].delete("/engines/static-0").json()["removed"] is True
    assert set(engines(one)) == {"static-1"}
    until(lambda: set(engines(two)) == {"static-1"}, message="replica two forgets static-0")
    assert served_by(two, "one left", 3) == {"static-1"}
    for bad in ({"json": {"url": "ftp://x"}}, {"json": {"url": 7}}, {"json": ["x"]}, {"content": b"{not json"}):
        answer = admin[two.url].post("/engines", **bad)
        assert answer.status_code == 400 and answer.json()["error"]["param"] == "url", bad
    added = admin[two.url].post("/engines", json={"url": a.url})
    assert added.status_code == 201, added.text
    new_id = added.json()["engine_id"]
    assert added.json()["healthy"] is True and added.json()["models"] == ["tiny"] and new_id.startswith("admin-")
    until(lambda: engines(one).get(new_id, {}).get("healthy"), timeout=30, message="replica one probed the new one")
    assert admin[one.url].post("/engines", json={"url": a.url}).status_code == 409
    assert served_by(one, "two again", 4) == {"static-1", new_id}
    assert admin[one.url].delete(f"/engines/{new_id}").json()["removed"] is True  # an added one leaves everywhere
    until(lambda: set(engines(two)) == {"static-1"}, message="replica two forgets the added engine")
    assert admin[one.url].delete("/engines/nope").status_code == 404
