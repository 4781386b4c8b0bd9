"""The chart cannot drift from the code: every rendered `ragserve` container command line, and every
RAGSERVE_* variable it sets, is accepted by the real CLI parser (`ragserve.cli.build_parser()`)."""

from __future__ import annotations

import argparse
import contextlib
import io

from ragserve.cli import SUBCOMMANDS, build_parser
from ragserve.engine_args import EngineConfig, add_engine_arguments
from ragserve.flags import env_name

# Read by ragserve.model_source.cache_dir(), not a flag.
NON_FLAG_ENV = {"RAGSERVE_CACHE_DIR"}
SERVER_FLAGS = {
    "--host",
    "--port",
    "--router",
    "--advertise-url",
    "--registry-token-file",
    "--cachestore",
    "--max-body-bytes",
    "--drain-timeout",
    "--log-level",
}


def ragserve_containers(manifests: list[dict]) -> list[tuple[str, dict]]:
    out = []
    for doc in manifests:
        if doc["kind"] in ("Deployment", "StatefulSet"):
            for c in doc["spec"]["template"]["spec"]["containers"]:
                if c["command"] == ["ragserve"]:
                    out.append((f"{doc['metadata']['name']}/{c['name']}", c))
    return out


def parse(args: list[str]) -> argparse.Namespace | str:
    """The parsed namespace, or the CLI's error message."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            return build_parser().parse_args(args)
    except SystemExit:
        return err.getvalue().strip().splitlines()[-1]


def subcommand_env_names(command: str) -> set[str]:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[command]
    return {env_name(opt) for action in sub._actions for opt in action.option_strings if opt.startswith("--")}


def test_every_container_command_line_parses(manifests):
    containers = ragserve_containers(manifests)
    assert containers or not manifests
    for where, c in containers:
        command = c["args"][0]
        assert command in SUBCOMMANDS, where
        ns = parse(c["args"])
        assert isinstance(ns, argparse.Namespace), f"{where}: `ragserve {' '.join(c['args'])}` rejected: {ns}"
        assert ns.command == command, where
        if command == "engine":
            EngineConfig.from_args(ns)  # the engine's own start-up validation
        known = subcommand_env_names(command) | NON_FLAG_ENV
        for env in c.get("env", []):
            if env["name"].startswith("RAGSERVE_"):
                assert env["name"] in known, f"{where}: {env['name']} is no `ragserve {command}` flag"


def engine_args(manifests: list[dict], pool: str) -> list[str]:
    name = f"rs-ragserve-engine-{pool}"
    return next(c["args"] for where, c in ragserve_containers(manifests) if where.startswith(name + "/"))


def test_engine_values_reach_engine_flags(render, scenarios):
    """Pool settings become ragserve.engine_args flags, checked with that parser alone."""
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    args = engine_args(render(scenarios["gpu-pool"]), "llama")
    ns, rest = parser.parse_known_args(args[1:])
    assert {a for a in rest if a.startswith("--")} == SERVER_FLAGS
    cfg = EngineConfig.from_args(ns)
    assert (cfg.model, cfg.served_model_name) == ("/models/llama-3-8b-instruct", "llama-3-8b")
    assert (cfg.dtype, cfg.device, cfg.block_size, cfg.kv_cache_dtype) == ("bfloat16", "cuda", 32, "fp8")
    assert (cfg.attention_backend, cfg.gpu_memory_utilization, cfg.max_model_len) == ("triton", 0.92, 8192)
    assert (cfg.max_num_seqs, cfg.max_num_batched_tokens, cfg.long_prefill_token_threshold) == (128, 8192, 0)
    assert (cfg.preemption_mode, cfg.swap_space, cfg.scheduling_policy) == ("swap", 4.0, "priority")
    assert cfg.enable_prefix_caching and cfg.num_gpu_blocks is None and cfg.kv_cache_memory is None

    capped = scenarios["gpu-pool"]["engines"][0]
    capped = capped | {"engine": capped["engine"] | {"longPrefillTokenThreshold": 256}}
    args = engine_args(render({"engines": [capped]}), "llama")
    assert EngineConfig.from_args(parser.parse_known_args(args[1:])[0]).long_prefill_token_threshold == 256

    big = engine_args(render(scenarios["two-pools"]), "big")
    cfg = EngineConfig.from_args(parser.parse_known_args(big[1:])[0])
    assert (cfg.num_gpu_blocks, cfg.kv_cache_memory, cfg.enable_prefix_caching) == (4096, 20 * 1024**3, False)
    assert cfg.model == "/models/qwen3/model.gguf"


def test_cluster_wiring_flags(render, scenarios):
    """Engines register with the router's Service and shard over every cachestore pod by DNS."""
    args = engine_args(render(scenarios["two-pools"]), "small")
    assert args[args.index("--router") + 1] == "rs-ragserve-router-registry.ai.svc.cluster.local:50051"
    assert args[args.index("--advertise-url") + 1] == "http://$(POD_IP):8000"
    stores = args[args.index("--cachestore") + 1].split(",")
    assert stores == [
        f"rs-ragserve-cachestore-{i}.rs-ragserve-cachestore-headless.ai.svc.cluster.local:50061" for i in range(3)
    ]
    docs = render({"cachestore": {"enabled": False}, "router": {"enabled": False}})
    args = engine_args(docs, "default")
    assert not {"--router", "--cachestore", "--advertise-url"} & set(args)


def test_redis_urls_per_component(render, scenarios):
    docs = render(scenarios["hpa"])
    router = next(c for w, c in ragserve_containers(docs) if "-router/" in w)["args"]
    store = next(c for w, c in ragserve_containers(docs) if "-cachestore/" in w)["args"]
    assert router[router.index("--redis") + 1] == "redis://rs-ragserve-redis.ai.svc.cluster.local:6379/0"
    assert store[store.index("--redis") + 1] == "redis://rs-ragserve-redis.ai.svc.cluster.local:6379/1"
    assert store[store.index("--redis-prefix") + 1] == "ragserve-kv:$(POD_NAME):"
    docs = render(scenarios["external-redis-secret"])
    router = next(c for w, c in ragserve_containers(docs) if "-router/" in w)
    assert "--redis" not in router["args"]
    env = {e["name"]: e for e in router["env"]}
    assert env["RAGSERVE_REDIS"]["valueFrom"]["secretKeyRef"] == {"name": "redis-url", "key": "url"}


def test_an_unknown_flag_is_caught(render):
    docs = render({"router": {"extraArgs": ["--no-such-flag"]}, "cachestore": {"extraArgs": ["--memory", "lots"]}})
    checked = {
        c["args"][0]: where for where, c in ragserve_containers(docs) if c["args"][0] in ("router", "cachestore")
    }
    assert set(checked) == {"router", "cachestore"}  # else the loop below would check nothing
    for where, c in ragserve_containers(docs):
        if c["args"][0] in checked:
            error = parse(c["args"])
            assert isinstance(error, str) and ("--no-such-flag" in error or "lots" in error), where


def test_engines_verify_the_router_registry_tls(render, scenarios):
    docs = render(scenarios["tls"])
    (where, engine), *_ = [(w, c) for w, c in ragserve_containers(docs) if "-engine-" in w]
    args = engine["args"]
    assert args[args.index("--router-tls-ca") + 1] == "/etc/ragserve/router-ca/ca.crt"
    assert args[args.index("--router-tls-cert") + 1] == "/etc/ragserve/router-client/tls.crt"
    assert args[args.index("--router-tls-key") + 1] == "/etc/ragserve/router-client/tls.key"
    pod = next(d for d in docs if d["metadata"]["name"] == where.split("/")[0])["spec"]["template"]["spec"]
    volumes = {v["name"]: v["secret"] for v in pod["volumes"] if "secret" in v}
    assert volumes["router-ca"] == {"secretName": "router-tls", "items": [{"key": "ca.crt", "path": "ca.crt"}]}
    assert volumes["router-client"]["secretName"] == "engine-client-tls"  # never the router's own key
    router = next(c for w, c in ragserve_containers(docs) if "-router/" in w)["args"]
    assert router[router.index("--tls-client-ca") + 1] == "/etc/ragserve/tls/ca.crt"


def test_drain_fits_in_the_grace_period(render):
    pool = {"name": "p", "model": "m", "terminationGracePeriodSeconds": 300, "preStopSleepSeconds": 10}
    router = {"terminationGracePeriodSeconds": 90, "drainDelaySeconds": 15}
    docs = render({"engines": [pool], "router": router})
    args = engine_args(docs, "p")
    assert args[args.index("--drain-timeout") + 1] == "285"
    ns = parse(next(c for w, c in ragserve_containers(docs) if "-router/" in w)["args"])
    assert (ns.drain_delay, ns.drain_timeout) == (15.0, 70.0)


def test_cachestore_client_security_is_wired(render):
    """With cachestore TLS, mTLS and a token, engines get the CA, their client certificate and the token."""
    values = {"cachestore": {"tls": {"enabled": True, "secretName": "cs-tls", "clientAuth": True,
                                     "engineClientSecret": "engine-cs-client"},
                             "auth": {"existingSecret": "cs-token", "key": "token"}}}  # fmt: skip
    engines = [d for d in render(values) if d["kind"] == "Deployment" and "engine" in d["metadata"]["name"]]
    assert engines
    for dep in engines:
        pod = dep["spec"]["template"]["spec"]
        (container,) = [c for c in pod["containers"] if c["args"][0] == "engine"]
        args = container["args"]
        flags = {a: args[i + 1] for i, a in enumerate(args) if a.startswith("--cachestore-")}
        assert flags == {
            "--cachestore-tls-ca": "/etc/ragserve/cachestore-ca/ca.crt",
            "--cachestore-tls-cert": "/etc/ragserve/cachestore-client/tls.crt",
            "--cachestore-tls-key": "/etc/ragserve/cachestore-client/tls.key",
            "--cachestore-token-file": "/etc/ragserve/cachestore-token/token",
        }
        secrets = {v["name"]: v["secret"]["secretName"] for v in pod["volumes"] if "secret" in v}
        assert secrets["cachestore-ca"] == "cs-tls" and secrets["cachestore-client"] == "engine-cs-client"
        assert secrets["cachestore-token"] == "cs-token"
        mounts = {m["name"] for m in container["volumeMounts"]}
        assert {"cachestore-ca", "cachestore-client", "cachestore-token"} <= mounts


def test_router_reaches_a_secured_cachestore(render, scenarios):
    """kv_aware looks up the cachestore itself: with TLS, mTLS and a token the router gets the same CA, client
    certificate and token as the engines (parsed by its own CLI), and the cachestore's NetworkPolicy admits it."""
    docs = render(scenarios["tls"])
    (router,) = [d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "rs-ragserve-router"]
    pod = router["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    ns = parse(container["args"])
    assert isinstance(ns, argparse.Namespace), ns
    assert (ns.cachestore_tls_ca, ns.cachestore_tls_cert, ns.cachestore_tls_key, ns.cachestore_token_file) == (
        "/etc/ragserve/cachestore-ca/ca.crt",
        "/etc/ragserve/cachestore-client/tls.crt",
        "/etc/ragserve/cachestore-client/tls.key",
        "/etc/ragserve/cachestore-token/token",
    )
    secrets = {v["name"]: v["secret"] for v in pod["volumes"] if "secret" in v}
    assert secrets["cachestore-ca"] == {"secretName": "cachestore-tls", "items": [{"key": "ca.crt", "path": "ca.crt"}]}
    assert secrets["cachestore-client"]["secretName"] == "engine-cachestore-client"
    assert secrets["cachestore-token"]["secretName"] == "cachestore-token"
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    for flag, path in (
        ("ca", ns.cachestore_tls_ca),
        ("client", ns.cachestore_tls_key),
        ("token", ns.cachestore_token_file),
    ):
        assert path.startswith(mounts[f"cachestore-{flag}"] + "/"), flag
    policy = next(d for d in docs if d["kind"] == "NetworkPolicy" and d["metadata"]["name"] == "rs-ragserve-cachestore")
    (grpc,) = [r for r in policy["spec"]["ingress"] if r["ports"] == [{"port": "grpc"}]]
    labels = router["spec"]["template"]["metadata"]["labels"]
    assert any(set(peer["podSelector"]["matchLabels"].items()) <= set(labels.items()) for peer in grpc["from"])

    plain = next(c for w, c in ragserve_containers(render({})) if "-router/" in w)
    assert not [a for a in plain["args"] if a.startswith("--cachestore-")]
    assert not [m for m in plain["volumeMounts"] if m["name"].startswith("cachestore-")]


def test_same_flags_as_the_local_stack(render, scenarios):
    """Every flag `ragserve up` gives a process, the chart gives it too (except the per-process engine id)."""
    from ragserve.stack.spec import Ports, StackConfig, cachestore_spec, engine_spec, router_spec

    cfg = StackConfig(engines=1, redis="redis://127.0.0.1:6379")
    ports = Ports(8080, 50051, 50061, 9090, 6379, [8000])
    local = {
        "router": router_spec(cfg, ports, cfg.redis).argv,
        "cachestore": cachestore_spec(cfg, ports, cfg.redis).argv,
        "engine": engine_spec(cfg, ports, 0).argv,
    }
    values = {**scenarios["hpa"], "cachestore": {**scenarios["hpa"]["cachestore"], "auth": {"existingSecret": "t"}}}
    chart = {c["args"][0]: c["args"] for _, c in ragserve_containers(render(values))}  # up's store takes a token
    for component, argv in local.items():
        flags = {a for a in argv if a.startswith("--")} - {"--engine-id"}
        assert flags <= set(chart[component]), (component, sorted(flags - set(chart[component])))


def test_tracing_endpoint_reaches_every_component(render):
    endpoint = "otel-collector.observability:4317"
    traced = ragserve_containers(render({"monitoring": {"tracing": {"otlpEndpoint": endpoint}}}))
    assert {name.split("/")[0] for name, _ in traced} == {
        "rs-ragserve-router",
        "rs-ragserve-engine-default",
        "rs-ragserve-cachestore",
    }
    for name, c in traced:
        env = {e["name"]: e.get("value") for e in c.get("env", [])}
        assert env.get("RAGSERVE_OTLP_TRACES_ENDPOINT") == endpoint, name
        # the component reads it as its --otlp-traces-endpoint default
        assert "RAGSERVE_OTLP_TRACES_ENDPOINT" in subcommand_env_names(c["args"][0]), name
    for name, c in ragserve_containers(render({})):
        assert "RAGSERVE_OTLP_TRACES_ENDPOINT" not in {e["name"] for e in c.get("env", [])}, name
