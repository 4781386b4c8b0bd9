"""The command line of a `runtime: vllm` engine pool's pods and the router's `--external-engine` value for each,
built once: tests/charts/test_vllm_pool.py renders the chart's templates/engine/vllm.yaml and router flags and
requires these (the operator is to build the same from a RAGServe spec)."""

from __future__ import annotations

import json
from dataclasses import dataclass

from ragserve.external_engine import ExternalEngineSpec

VLLM_IMAGE = "docker.io/vllm/vllm-openai:v0.11.0"
VLLM_PORT, VLLM_EVENTS_PORT, VLLM_REPLAY_PORT = 8000, 5557, 5558


@dataclass(frozen=True)
class VllmPod:
    model: str
    port: int = VLLM_PORT
    served_model_name: str = ""
    block_size: int = 16
    gpus: int = 1  # > 1: --tensor-parallel-size
    events_port: int = VLLM_EVENTS_PORT
    replay_port: int = VLLM_REPLAY_PORT
    extra_args: tuple[str, ...] = ()


def zmq_kv_events_config(endpoint: str, replay_endpoint: str) -> dict:
    """vLLM's KVEventsConfig (--kv-events-config): ZMQ PUB on `endpoint`, the replay ROUTER, every topic."""
    return {
        "enable_kv_cache_events": True,
        "endpoint": endpoint,
        "publisher": "zmq",
        "replay_endpoint": replay_endpoint,
        "topic": "",
    }


def kv_events_config(pod: VllmPod) -> dict:
    """A vLLM pod's: PUB on events_port, replay on replay_port, on every interface."""
    return zmq_kv_events_config(f"tcp://*:{pod.events_port}", f"tcp://*:{pod.replay_port}")


def vllm_command(pod: VllmPod) -> list[str]:
    """`vllm serve ...` arguments (a container's args; its command is `vllm`)."""
    args = ["serve", pod.model, "--port", str(pod.port)]
    if pod.served_model_name:
        args += ["--served-model-name", pod.served_model_name]
    args += ["--enable-prefix-caching", "--block-size", str(pod.block_size)]
    if pod.gpus > 1:
        args += ["--tensor-parallel-size", str(pod.gpus)]
    args += ["--kv-events-config", json.dumps(kv_events_config(pod), separators=(",", ":"), sort_keys=True)]
    return args + list(pod.extra_args)


def external_engines(statefulset: str, service_host: str, replicas: int, pod: VllmPod) -> list[str]:
    """One `--external-engine` value per StatefulSet replica, by its stable DNS name under the headless Service."""
    out = []
    for i in range(replicas):
        host = f"{statefulset}-{i}.{service_host}"
        events, replay = f"tcp://{host}:{pod.events_port}", f"tcp://{host}:{pod.replay_port}"
        out.append(ExternalEngineSpec(f"http://{host}:{pod.port}", events, replay).value())
    return out
