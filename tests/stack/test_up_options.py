"""`ragserve up` reaches every component's options: the shared ones (tracing endpoint, log level) given once
reach every child, each component's own flags pass through --engine-arg/--router-arg/--cachestore-arg and are
checked against that component's parser before anything starts; one request through a local stack started
with --otlp-traces-endpoint gives one trace holding router, engine and cachestore spans."""

from __future__ import annotations

import json

import httpx
import pytest

from ragserve.cli import build_parser
from ragserve.stack.config import StackConfig
from ragserve.stack.passthrough import parser_for
from ragserve.stack.spec import Ports, cachestore_spec, engine_spec, router_spec
from ragserve.stack.supervisor import child_env
from tests.helpers.engine_server import LONG_CONTEXT
from tests.helpers.otlp import Receiver
from tests.helpers.process import until
from tests.helpers.stack import Up, run_up, tiny

PORTS = Ports(8080, 50051, 50061, 9090, 6379, [8001])


def children(cfg: StackConfig) -> dict[str, list[str]]:
    """Each child's `ragserve <component> ...` arguments."""
    specs = [engine_spec(cfg, PORTS, 0), router_spec(cfg, PORTS, "redis://127.0.0.1:6379/0")]
    specs.append(cachestore_spec(cfg, PORTS, "redis://127.0.0.1:6379/0"))
    return {spec.name.split("-")[0]: spec.argv[spec.argv.index("ragserve.cli") + 1 :] for spec in specs}


def value(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def test_shared_options_are_given_once_and_reach_every_child(monkeypatch):
    monkeypatch.setenv("RAGSERVE_OTLP_TRACES_ENDPOINT", "collector:4317")  # as a new user tries it first
    args = build_parser().parse_args(["up", "--log-level", "debug", "--cachestore-arg=--workers=3"])
    argvs = children(StackConfig.from_args(args))
    assert set(argvs) == {"engine", "router", "cachestore"}
    for component, argv in argvs.items():
        assert argv[0] == component
        assert value(argv, "--otlp-traces-endpoint") == "collector:4317", component
        assert value(argv, "--log-level") == "debug", component
        parsed = parser_for(component).parse_args(argv[1:])  # the component accepts its whole command line
        assert parsed.otlp_traces_endpoint == "collector:4317" and parsed.log_level == "debug"
    assert parser_for("cachestore").parse_args(argvs["cachestore"][1:]).workers == 3


def test_children_keep_the_cache_dir_and_no_flag_from_the_environment(monkeypatch, tmp_path):
    """RAGSERVE_CACHE_DIR is where children build the C++ ops and keep inductor's cache: without it a stack
    started with a cache dir set builds everything again in ~/.cache; RAGSERVE_<FLAG> values reach children
    only as the flags up passes."""
    monkeypatch.setenv("RAGSERVE_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("RAGSERVE_POLICY", "round_robin")
    env = child_env()
    assert env["RAGSERVE_CACHE_DIR"] == str(tmp_path) and "RAGSERVE_POLICY" not in env


@pytest.mark.parametrize(
    "flag, says",
    [
        ("--engine-arg=--max-num-sqs=4", "ragserve engine says: unrecognized arguments: --max-num-sqs=4"),
        ("--router-arg=--policy=fastest", "ragserve router says: argument --policy: invalid choice: 'fastest'"),
        ("--cachestore-arg=--memory=lots", "ragserve cachestore says: argument --memory: invalid size 'lots'"),
    ],
)
def test_a_typo_in_a_passed_flag_fails_before_anything_starts(flag, says):
    proc = run_up("--port", "0", "--model", "no-such-model", flag)  # a stack that started would fail on the model
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert says in proc.stderr and flag.split("=", 1)[1] in proc.stderr
    assert "started" not in proc.stdout and "Traceback" not in proc.stderr


def test_one_trace_holds_router_engine_and_cachestore_spans(tmp_path):
    with Receiver() as receiver:
        up = Up(tmp_path, "--engines", "1", "--embedding-engines", "0", "--redis", "off", "--num-gpu-blocks", "256",
                "--model", tiny(), "--served-model-name", "tiny",
                "--otlp-traces-endpoint", receiver.endpoint)  # fmt: skip
        try:
            state = up.wait_ready()
            chat = {"model": "tiny", "messages": [{"role": "user", "content": LONG_CONTEXT}], "max_tokens": 2}
            resp = httpx.post(state["url"] + "/v1/chat/completions", json=chat, timeout=120)
            assert resp.status_code == 200, resp.text
            (route,) = until(lambda: receiver.named("router.route"), what="the router's span")

            def services() -> set[str]:
                return {s.service for s in receiver.trace(route.trace_id)}

            wanted = {"ragserve-router", "ragserve-engine", "ragserve-cachestore"}
            until(lambda: wanted <= services(), what=f"{wanted} in one trace")
            names = {s.name for s in receiver.trace(route.trace_id)}
            assert {"router.route", "engine.request", "cachestore.lookup"} <= names, names
        finally:
            up.cleanup()


def test_external_engines_pose_as_vllm_pods_the_router_follows():
    """StackConfig(external_engines=True): engines do not register and publish vLLM KV events on ports of their
    own; the router follows each (--external-engine, in engine order) with the model's tokenizer and the
    engines' block size (bench/rag_cluster.py's kv_aware+external)."""
    cfg = StackConfig(engines=2, model=tiny(), external_engines=True, engine_flags=["--block-size", "32"])
    ports = Ports.pick(cfg)
    assert len(ports.kv_events) == 2 and len({*ports.engines, *sum(ports.kv_events, ())}) == 6
    router = router_spec(cfg, ports, None).argv
    router = parser_for("router").parse_args(router[router.index("ragserve.cli") + 2 :])
    assert router.tokenizer == tiny() and router.external_block_size == 32
    for i, port in enumerate(ports.engines):
        argv = engine_spec(cfg, ports, i).argv
        engine = parser_for("engine").parse_args(argv[argv.index("ragserve.cli") + 2 :])
        assert engine.router is None and engine.kv_events_bind and engine.block_size == 32
        events = json.loads(engine.kv_events_config)
        assert events["enable_kv_cache_events"] and events["publisher"] == "zmq"
        spec = router.external_engine[i]
        assert spec.url == f"http://127.0.0.1:{port}"
        assert (spec.events, spec.replay) == (events["endpoint"], events["replay_endpoint"])
