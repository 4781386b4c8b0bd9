"""`ragserve engine` flags (the contract chart, operator and `ragserve up` rely on) and start-up failures."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from ragserve.cli import build_parser
from ragserve.engine_args import EngineConfig, ServerConfig
from ragserve.flags import cpu_list
from tests.helpers.engine_server import start_engine

CONTRACT = (
    "--host 0.0.0.0 --port 8000 --model m --served-model-name n --dtype bfloat16 --device cpu --block-size 32 "
    "--num-gpu-blocks 100 --kv-cache-memory 2GiB --gpu-memory-utilization 0.8 --kv-cache-dtype fp8 "
    "--attention-backend torch --no-enable-prefix-caching --max-model-len 2048 --max-num-seqs 8 "
    "--max-num-batched-tokens 512 --preemption-mode swap --swap-space 2 --scheduling-policy priority "
    "--router r:50051 --advertise-url http://10.0.0.5:8000 --cachestore a:50061,b:50061 --api-key k "
    "--max-body-bytes 1MiB --engine-id e1"
)


def test_contract_flags_parse_into_the_configs():
    args = build_parser().parse_args(["engine", *CONTRACT.split()])
    engine, server = EngineConfig.from_args(args), ServerConfig.from_args(args)
    assert (engine.model, engine.served_model_name, engine.block_size, engine.kv_cache_memory) == ("m", "n", 32, 2**31)
    assert not engine.enable_prefix_caching and engine.preemption_mode == "swap" and engine.kv_cache_dtype == "fp8"
    assert (server.host, server.port, server.router, server.api_key) == ("0.0.0.0", 8000, "r:50051", "k")
    assert server.url == "http://10.0.0.5:8000" and engine.cachestore == "a:50061,b:50061"
    assert (server.max_body_bytes, server.engine_id) == (2**20, "e1")


def test_prefiller_allow_repeats_and_reads_the_environment(monkeypatch):
    args = build_parser().parse_args(["engine", "--prefiller-allow", "10.0.0.0/8", "--prefiller-allow", "fd00::1"])
    nets = [str(n) for n in ServerConfig.from_args(args).prefiller_networks()]
    assert nets == ["10.0.0.0/8", "fd00::1/128"]
    monkeypatch.setenv("RAGSERVE_PREFILLER_ALLOW", "10.1.0.0/16;192.168.0.0/24")
    nets = [str(n) for n in ServerConfig.from_args(build_parser().parse_args(["engine"])).prefiller_networks()]
    assert nets == ["10.1.0.0/16", "192.168.0.0/24"]


def test_kv_transfer_cpus_take_a_taskset_list():
    assert cpu_list("0,2-3,2") == (0, 2, 3) and cpu_list([1, 0]) == (0, 1)
    args = build_parser().parse_args(["engine", "--cachestore", "s:1", "--kv-transfer-cpus", "0-0"])
    assert EngineConfig.from_args(args).kv_transfer_cpus == (0,)
    assert EngineConfig.from_args(build_parser().parse_args(["engine"])).kv_transfer_cpus is None


def test_flags_read_ragserve_environment(monkeypatch):
    monkeypatch.setenv("RAGSERVE_PORT", "9123")
    monkeypatch.setenv("RAGSERVE_ROUTER", "router:50051")
    monkeypatch.setenv("RAGSERVE_MAX_BODY_BYTES", "2MiB")
    server = ServerConfig.from_args(build_parser().parse_args(["engine"]))
    assert (server.port, server.router, server.max_body_bytes) == (9123, "router:50051", 2 * 2**20)
    assert server.engine_id and server.url.endswith(":9123")


def test_building_the_parser_does_not_import_torch():
    code = "from ragserve.cli import build_parser; build_parser(); import sys; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--router", "no-port"], "--router must be HOST:PORT"),
        (["--advertise-url", "10.0.0.5:8000"], "--advertise-url must be an http(s) URL"),
        (["--router-tls-cert", "/nonexistent.crt"], "--router-tls-cert needs --router-tls-key"),
        ([], "unknown model '/nonexistent/model'"),
        (["--block-size", "7"], "block_size must be"),
        (["--quantization", "int4", "--device", "cuda"], "quantization int4 runs on CPU only"),
        (["--kv-events-config", "{not json"], "kv-events-config is not valid JSON"),
        (["--prefiller-allow", "10.0.0.0/33"], "--prefiller-allow must be a CIDR or an IP"),
        (["--prefiller-allow", "prefill-pod"], "--prefiller-allow must be a CIDR or an IP"),
        (["--prefiller-timeout", "0"], "--prefiller-timeout must be positive"),
        (["--kv-transfer-cpus", "3-1"], "invalid CPU list '3-1'"),
        (["--kv-transfer-cpus", "0,4096"], "kv_transfer_cpus names CPUs this machine lacks"),
        (["--kv-events-config", '{"enable_kv_cache_events": true, "publisher": "kafka"}'], "unknown publisher 'kafka'"),
        (
            ["--kv-events-config", '{"enable_kv_cache_events": true, "endpoint": "tcp://nohost"}'],
            "must be tcp://HOST:PORT",
        ),
        (
            ["--kv-events-config", '{"enable_kv_cache_events": true, "buffer_step": 5}'],
            "unknown field(s) ['buffer_step']",
        ),
    ],
)
def test_bad_flags_exit_2_with_a_message(args, message):
    proc = subprocess.run(
        [sys.executable, "-m", "ragserve.cli", "engine", "--port", "1", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "RAGSERVE_MODEL": "/nonexistent/model"},  # nothing loads even if a check were missing
    )
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr


def test_a_model_that_fails_to_load_exits_1(tmp_path):
    model = tmp_path / "broken"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "model.safetensors").write_bytes(b"not safetensors")
    proc = start_engine(tmp_path, "--model", str(model))
    assert proc.popen.wait(120) == 1
    assert "failed to load model" in proc.output()
