"""docker-compose.yml and the Dockerfiles: valid for Compose, every command and flag real, wired like `ragserve up`."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import compose
import pytest

from ragserve.cachestore_command import CacheStoreLaunch, cachestore_command
from ragserve.cli import build_parser
from ragserve.engine_command import EnginePod, engine_command
from ragserve.model_source import DEFAULT_EMBED_MODEL
from ragserve.router_command import RouterLaunch, router_command
from tests.helpers.stack import ROOT

# the package's `docker-compose` script is a wrapper that always exits 0; call the Go binary itself
COMPOSE = Path(compose.__file__).parent / "docker-compose"
RAGSERVE_SERVICES = {"cachestore", "router", "engine-0", "engine-1", "embed-0"}
ENGINES = ("engine-0", "engine-1", "embed-0")


@pytest.fixture(scope="module")
def config() -> dict:
    proc = subprocess.run(
        [str(COMPOSE), "-f", str(ROOT / "docker-compose.yml"), "config", "--format", "json"],
        capture_output=True, text=True, timeout=60, cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def parse(command: list[str]):
    assert command[0] == "ragserve", command
    return build_parser().parse_args(command[1:])  # argparse exits (fails the test) on an unknown flag


def built(name: str) -> list[str]:
    """What the command builders make for the compose services' settings (Service names as hosts)."""
    if name == "cachestore":
        launch = CacheStoreLaunch(port=50061, metrics_port=9090, memory="2GiB", disk_dir="/var/cache/ragserve",
                                  disk="20GiB", redis="redis://redis:6379/0", redis_capacity="2GiB")  # fmt: skip
        return cachestore_command(launch)
    if name == "router":
        launch = RouterLaunch(port=8080, grpc_port=50051, policy="kv_aware", redis="redis://redis:6379/0",
                              registry_allow_unauthenticated=True)  # fmt: skip
        return router_command(launch)
    wiring = {
        "router": "router:50051",
        "advertise_url": f"http://{name}:{{port}}",
        "engine_id": name,
        "drain_timeout": 25,
    }
    if name == "embed-0":  # `ragserve up`'s embedding engine (spec.embedding_engine_spec): no cachestore
        return engine_command(EnginePod(model=DEFAULT_EMBED_MODEL, task="embed", **wiring))
    pod = EnginePod(model="smollm2-135m", engine={"kvCacheMemory": "2GiB"}, cachestore=("cachestore:50061",), **wiring)
    return engine_command(pod)


def unjoined(command: list[str]) -> list[str]:
    """--flag=value as --flag value, as the builders write them."""
    return [part for a in command for part in (a.split("=", 1) if a.startswith("--") else [a])]


def test_commands_are_the_builders(config):
    for name in RAGSERVE_SERVICES:
        assert unjoined(config["services"][name]["command"]) == ["ragserve", *built(name)], name


def test_the_compose_binary_rejects_a_broken_file(tmp_path):
    bad = tmp_path / "compose.yml"
    bad.write_text("services:\n  x:\n    image: a\n    depends_on: [missing]\n")
    proc = subprocess.run([str(COMPOSE), "-f", str(bad), "config"], capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and "missing" in proc.stderr


def test_services_and_commands_exist_in_the_cli(config):
    services = config["services"]
    assert set(services) == {"redis"} | RAGSERVE_SERVICES
    for name in RAGSERVE_SERVICES:
        args = parse(services[name]["command"])
        assert args.command == ("engine" if name in ENGINES else name)
        test = services[name]["healthcheck"]["test"]
        assert test[:4] == ["CMD", "python", "-m", "ragserve.stack.health"], test


def test_wired_like_ragserve_up(config):
    s = config["services"]
    router, store = parse(s["router"]["command"]), parse(s["cachestore"]["command"])
    assert router.redis.startswith("redis://redis:6379") and store.redis.startswith("redis://redis:6379")
    assert router.policy == "kv_aware" and s["router"]["ports"][0]["target"] == router.port
    for name in ENGINES:
        engine = parse(s[name]["command"])
        assert engine.router == f"router:{router.grpc_port}"
        assert engine.cachestore == (None if name == "embed-0" else f"cachestore:{store.port}")
        assert (engine.task, engine.model) == (
            ("embed", DEFAULT_EMBED_MODEL) if name == "embed-0" else ("generate", "smollm2-135m")
        )
        assert engine.advertise_url == f"http://{name}:{engine.port}" and engine.engine_id == name
        assert s[name]["depends_on"]["router"]["condition"] == "service_healthy"
        assert s[name]["healthcheck"]["test"][-1] == f"http://127.0.0.1:{engine.port}/ready"
    assert s["cachestore"]["healthcheck"]["test"][-1] == f"grpc://127.0.0.1:{store.port}"
    assert s["cachestore"]["volumes"][0]["target"] == store.disk_dir


@pytest.mark.parametrize("name", ["Dockerfile", "Dockerfile.engine", "Dockerfile.engine-cuda"])
def test_dockerfiles_run_as_non_root_with_a_health_check(name):
    text = (ROOT / name).read_text()
    users = re.findall(r"^USER (\S+)", text, re.M)
    assert users and users[-1] not in ("root", "0")
    assert re.search(r"^HEALTHCHECK .*\n?.*CMD python -m ragserve\.stack\.health", text, re.M)
    cmd = json.loads(re.search(r"^CMD (\[.*\])$", text, re.M).group(1))
    parse(cmd)
    for path in re.findall(r"^COPY (?!--from)(\S+)", text, re.M):
        assert (ROOT / path).exists(), path


def pip_installs(dockerfile: str) -> list[str]:
    """The repository folders a Dockerfile pip-installs ("" is the core at the root), extras dropped."""
    commands = " ".join(re.findall(r"pip install ([^\n\\]*)", dockerfile))
    return re.findall(r'"?\./([a-z]*)', commands)


def test_only_engine_images_install_torch():
    router = (ROOT / "Dockerfile").read_text()
    assert pip_installs(router) == ["", "router", "cachestore", "operator"]
    assert "assert 'torch' not in sys.modules" in router  # checked while building
    for name, index in (("Dockerfile.engine", "whl/cpu"), ("Dockerfile.engine-cuda", "whl/cu128")):
        text = (ROOT / name).read_text()
        assert index in text and pip_installs(text) == ["", "cachestore", "engine"], name


def test_engines_get_their_own_cores(config):
    """torch's thread count in each engine equals its CPU limit (the chart's OMP_NUM_THREADS from
    requests.cpu; `ragserve up`'s cores / engines), so co-located engines do not oversubscribe the host."""
    for name in ENGINES:
        engine = config["services"][name]
        assert float(engine["cpus"]) >= 1
        assert int(engine["environment"]["OMP_NUM_THREADS"]) == float(engine["cpus"])
