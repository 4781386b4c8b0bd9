"""`ragserve engine` settings, written once: the engine's and the server's dataclasses, whose fields are
also the CLI flags (vLLM's names; ragserve.flags.option), the RAGServe CRD's engine properties and the
chart's engine values. Torch-free, so `ragserve --help`, the operator and the chart tests use it cheaply.
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import socket
import time
from dataclasses import Field, dataclass
from typing import TYPE_CHECKING

from ragserve.flags import FromArgs, add_options, cpu_list, fraction, option, parse_bytes, positive_int, spec_fields
from ragserve.logs import LOG_LEVELS
from ragserve.model_source import DEFAULT_EMBED_MODEL, DEFAULT_MODEL

if TYPE_CHECKING:
    from ragserve.vllm_events.config import KVEventsConfig

BLOCK_SIZES = (8, 16, 32, 64, 128)
DTYPES = ("auto", "float32", "bfloat16", "float16")
QUANTIZATIONS = ("none", "int8", "int4")
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2", "int8")
ATTENTION_BACKENDS = ("auto", "torch", "triton")
PREEMPTION_MODES = ("recompute", "swap")
SCHEDULING_POLICIES = ("fcfs", "priority")
TASKS = ("generate", "embed")  # vLLM's --task: embed serves /v1/embeddings, /v1/rerank, /v1/score
POOLING_TYPES = ("auto", "mean", "cls", "last")
TOOL_CALL_PARSERS = ("hermes", "llama3_json", "mistral")  # ragserve_engine.server.tool_parsers
ROLES = ("both", "prefill", "decode")  # disaggregated prefill/decode (docs/disaggregation.md)
DEFAULT_MAX_BODY_BYTES = 8 * 1024**2
ENGINE_PORT = 8000
ENGINE_GROUPS = ("model", "KV cache", "scheduler")
SERVER_GROUPS = ("server", "cluster")


@dataclass
class EngineConfig(FromArgs):
    model: str = option(DEFAULT_MODEL, "alias, HF directory or .gguf file", "model")
    task: str = option(
        "generate", f"generate: chat and completions; embed: embeddings, rerank, score ({DEFAULT_EMBED_MODEL} "
        "unless --model names another encoder or decoder directory)", "model", choices=TASKS,
    )  # fmt: skip
    pooling_type: str = option(
        "auto", "embed: token states to one vector (auto: the sentence-transformers config, else mean for "
        "encoders, last token for decoders)", "model", choices=POOLING_TYPES,
    )  # fmt: skip
    served_model_name: str | None = option(None, "name clients use (default: the model name)", "model")
    dtype: str = option("auto", "model dtype", "model", choices=DTYPES, spec=True)  # auto: fp32 CPU, bf16 GPU
    device: str = option("auto", "cpu, cuda, cuda:N or auto", "model", spec=True)
    quantization: str = option("none", "weight-only quantization (int8: per channel; int4: groups of 32, CPU)", "model",
                               choices=QUANTIZATIONS)  # fmt: skip
    enforce_eager: bool = option(False, "no compiled decode graphs or fused ops, no prepacked CPU linears", "model")
    max_seq_len_to_capture: int = option(
        8192, "longest context a compiled decode graph serves (vLLM's; longer: eager)", "model", type=positive_int
    )
    compile_at_start: bool = option(
        True, "compile every decode-graph capture size before serving (a server: before /ready)", "model"
    )
    cuda_graph_sizes: list[int] = option(
        [], "a decode-graph capture size (vLLM's; repeat it; default: 1, 2, 4, 8, 16, 24, 32, 64, ... up to "
        "--max-num-seqs)", "model", type=positive_int, repeat=True,
    )  # fmt: skip
    seed: int = option(0, "global seed", "model", type=int)
    block_size: int = option(
        16, "tokens per KV block", "KV cache", type=positive_int, spec=True, schema={"enum": list(BLOCK_SIZES)}
    )
    num_gpu_blocks: int | None = option(
        None, "KV blocks (overrides memory budget)", "KV cache", type=positive_int, spec=True, schema={"minimum": 2}
    )
    kv_cache_memory: int | None = option(None, "KV cache bytes, e.g. 2GiB", "KV cache", type=parse_bytes, spec=True)
    gpu_memory_utilization: float = option(0.9, "fraction of GPU memory to use", "KV cache", type=fraction, spec=True)
    kv_cache_dtype: str = option("auto", "KV cache storage dtype", "KV cache", choices=KV_CACHE_DTYPES, spec=True)
    attention_backend: str = option("auto", "attention kernels", "KV cache", choices=ATTENTION_BACKENDS, spec=True)
    enable_prefix_caching: bool = option(True, "reuse cached prefix blocks", "KV cache", spec=True)
    blend_recompute_fraction: float = option(0.15, "chunk tokens a blended prefill recomputes", "KV cache", type=float)
    blend_cache_memory: int = option(512 * 1024**2, "bytes of chunk KV kept for blending", "KV cache", type=parse_bytes)
    max_model_len: int | None = option(None, "max prompt + output tokens", "scheduler", type=positive_int, spec=True)
    max_num_seqs: int = option(64, "max running sequences", "scheduler", type=positive_int, spec=True)
    max_num_batched_tokens: int = option(2048, "token budget per step", "scheduler", type=positive_int, spec=True)
    enable_chunked_prefill: bool = option(True, "split long prefills across steps", "scheduler")
    enable_jump_forward: bool = option(
        True, "append the tokens a grammar forces unsampled; the next step computes them (docs/api.md)", "scheduler"
    )
    long_prefill_token_threshold: int = option(
        0,
        "most tokens one prefill takes per step (vLLM's; 0: off; e.g. 256 for long RAG prompts beside short ones)",
        "scheduler",
        type=int,
        spec=True,
        schema={"minimum": 0},
    )
    max_long_partial_prefills: int = option(
        1,
        "with --long-prefill-token-threshold: most prompts longer than it prefilled at once (vLLM's); the others"
        " wait their turn and shorter prompts may pass them; 0: no limit",
        "scheduler",
        type=int,
        spec=True,
        schema={"minimum": 0},
    )
    preemption_mode: str = option(
        "recompute", "when KV blocks run out", "scheduler", choices=PREEMPTION_MODES, spec=True
    )
    swap_space: float = option(
        1.0, "GiB of host memory for swap preemption", "scheduler", type=float, spec=True, schema={"minimum": 0}
    )
    scheduling_policy: str = option("fcfs", "queue order", "scheduler", choices=SCHEDULING_POLICIES, spec=True)
    # the engine's cachestore connector offloads and fetches KV blocks; its flags sit with the server's
    cachestore: str | None = option(None, "shared KV-block store HOST:PORT[,HOST:PORT...]", "cluster")
    cachestore_tls_ca: str | None = option(None, "CA bundle to verify the cachestore (enables TLS)", "cluster")
    cachestore_tls_cert: str | None = option(None, "client certificate for mutual TLS with the cachestore", "cluster")
    cachestore_tls_key: str | None = option(None, "client key for mutual TLS with the cachestore", "cluster")
    cachestore_token_file: str | None = option(None, "file holding the cachestore's shared token", "cluster")
    kv_transfer_cpus: tuple[int, ...] | None = option(
        None, "CPUs (taskset's list: 0,2-3) the KV transfer threads (fetch, offload) run on; default: the engine's own",
        "cluster", type=cpu_list,
    )  # fmt: skip
    role: str = option(
        "both", "prefill: compute prompts and store their KV; decode: fetch it and decode", "cluster", choices=ROLES
    )

    @property
    def prefill_cap(self) -> int:
        """--long-prefill-token-threshold where it applies (chunked prefill on), else 0: no per-step cap."""
        return self.long_prefill_token_threshold if self.enable_chunked_prefill else 0

    def __post_init__(self) -> None:
        self.check_choices()
        if self.kv_transfer_cpus is not None:
            self.kv_transfer_cpus = cpu_list(self.kv_transfer_cpus)
        if self.task == "embed" and self.model == DEFAULT_MODEL:
            self.model = DEFAULT_EMBED_MODEL
        sizes = ", ".join(map(str, BLOCK_SIZES[:-1])) + f" or {BLOCK_SIZES[-1]}"
        checks = [
            (self.block_size in BLOCK_SIZES, f"block_size must be {sizes}, got {self.block_size}"),
            (self.max_num_seqs > 0, "max_num_seqs must be positive"),
            (self.max_num_batched_tokens > 0, "max_num_batched_tokens must be positive"),
            (self.swap_space >= 0, "swap_space must be >= 0"),
            (self.role == "both" or bool(self.cachestore), f"role {self.role} needs --cachestore (its KV moves there)"),
            (
                self.kv_transfer_cpus is None or max(self.kv_transfer_cpus, default=0) < (os.cpu_count() or 1),
                f"kv_transfer_cpus names CPUs this machine lacks (it has {os.cpu_count()}): {self.kv_transfer_cpus}",
            ),
            (self.long_prefill_token_threshold >= 0, "long_prefill_token_threshold must be >= 0"),
            (self.max_long_partial_prefills >= 0, "max_long_partial_prefills must be >= 0"),
            (0 <= self.blend_recompute_fraction <= 1, "blend_recompute_fraction must be in [0, 1]"),
            (0 < self.gpu_memory_utilization <= 1, "gpu_memory_utilization must be in (0, 1]"),
            (self.num_gpu_blocks is None or self.num_gpu_blocks > 1, "num_gpu_blocks must be > 1"),
            (
                self.quantization != "int4" or not self.device.startswith("cuda"),
                "quantization int4 runs on CPU only (its kernels are C++ CPU ops); use int8 on CUDA",
            ),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)


@dataclass
class ServerConfig(FromArgs):
    host: str = option("0.0.0.0", "HTTP bind address", "server")
    port: int = option(ENGINE_PORT, "HTTP port", "server", type=positive_int)
    router: str | None = option(None, "router gRPC registry HOST:PORT to register with", "cluster")
    advertise_url: str | None = option(None, "URL the router sends traffic to (default http(s)://HOST:PORT)", "cluster")
    api_key: str | None = option(None, "require 'Authorization: Bearer KEY' on /v1/*, /tokenize, /detokenize", "server")
    max_body_bytes: int = option(DEFAULT_MAX_BODY_BYTES, "request body limit", "server", type=parse_bytes)
    tls_cert_file: str | None = option(None, "HTTP TLS certificate (PEM): serve HTTPS", "server")
    tls_key_file: str | None = option(None, "HTTP TLS private key (PEM)", "server")
    tls_client_ca_file: str | None = option(None, "require HTTPS clients (the router) to present a certificate "
                                            "signed by this CA", "server")  # fmt: skip
    engine_id: str = option("", "unique engine id (default hostname-pid-starttime)", "cluster")
    drain_timeout: float = option(60.0, "seconds running requests get after SIGTERM", "server", type=float)
    router_tls_ca: str | None = option(None, "CA bundle to verify the router's registry (enables TLS)", "cluster")
    router_tls_cert: str | None = option(None, "client certificate for mutual TLS with the router", "cluster")
    router_tls_key: str | None = option(None, "client key for mutual TLS with the router", "cluster")
    registry_token_file: str | None = option(None, "file holding the router registry's shared token", "cluster")
    kv_events_config: str | None = option(
        None, "vLLM's --kv-events-config JSON: publish vLLM's KV events over ZMQ (beside --router's)", "cluster"
    )
    kv_events_bind: bool = option(
        False, "bind the KV-event PUB endpoint where vLLM's rule connects (e.g. tcp://127.0.0.1:5557)", "cluster",
        negatable=False,
    )  # fmt: skip
    log_level: str = option("info", "log level", "server", choices=LOG_LEVELS)
    tool_call_parser: str = option(
        "hermes", "format of chat tool calls (docs/api.md)", "server", choices=TOOL_CALL_PARSERS
    )
    otlp_traces_endpoint: str | None = option(None, "OTLP/gRPC collector for traces (off when unset)", "server")
    prefiller_allow: list[str] = option(
        [], "a --role decode engine runs the prefill leg on the x-prefiller-host-port the endpoint picker names only "
        "when its IP is in this CIDR (repeat it; default: none, the header is ignored; docs/disaggregation.md)",
        "cluster", repeat=True,
    )  # fmt: skip
    prefiller_timeout: float = option(
        120.0, "seconds a prefill leg may take before the decode engine computes the prompt itself", "cluster",
        type=float,
    )  # fmt: skip

    def __post_init__(self) -> None:
        if not self.engine_id:
            self.engine_id = f"{socket.gethostname()}-{os.getpid()}-{int(time.time())}"
        checks = [
            (0 < self.port < 65536, f"--port must be in 1..65535, got {self.port}"),
            (self.max_body_bytes > 0, "--max-body-bytes must be positive"),
            (self.drain_timeout >= 0, "--drain-timeout must be >= 0"),
            (bool(self.router_tls_cert) == bool(self.router_tls_key), "--router-tls-cert needs --router-tls-key"),
            (not self.router or ":" in self.router, f"--router must be HOST:PORT, got {self.router!r}"),
            (bool(self.tls_cert_file) == bool(self.tls_key_file), "--tls-cert-file and --tls-key-file go together"),
            (not self.tls_client_ca_file or bool(self.tls_cert_file), "--tls-client-ca-file needs --tls-cert-file"),
            (self.prefiller_timeout > 0, "--prefiller-timeout must be positive"),
            (
                not self.advertise_url or self.advertise_url.startswith(("http://", "https://")),
                f"--advertise-url must be an http(s) URL, got {self.advertise_url!r}",
            ),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)
        tls = (self.tls_cert_file, self.tls_key_file, self.tls_client_ca_file)
        for path in (self.router_tls_ca, self.router_tls_cert, self.router_tls_key, self.registry_token_file, *tls):
            if path and not os.path.isfile(path):
                raise FileNotFoundError(f"file {path} does not exist")
        self.kv_events()  # a bad --kv-events-config fails at start (ValueError naming the problem)
        self.prefiller_networks()  # and a bad --prefiller-allow

    def prefiller_networks(self) -> list[ipaddress.IPv4Network | ipaddress.IPv6Network]:
        """--prefiller-allow, parsed (a bare IP is a /32 or /128)."""
        try:
            return [ipaddress.ip_network(cidr.strip(), strict=False) for cidr in self.prefiller_allow]
        except ValueError as exc:
            raise ValueError(f"--prefiller-allow must be a CIDR or an IP: {exc}") from None

    def kv_events(self) -> KVEventsConfig | None:
        """The parsed --kv-events-config (None when unset)."""
        if not self.kv_events_config:
            return None
        from ragserve.vllm_events.config import KVEventsConfig  # zmq and msgspec only when asked for

        return KVEventsConfig.from_json(self.kv_events_config)

    @property
    def url(self) -> str:
        """The OpenAI base URL the router should use for this engine."""
        if self.advertise_url:
            return self.advertise_url.rstrip("/")
        host = self.host
        if host in ("0.0.0.0", "::", ""):
            try:
                host = socket.gethostbyname(socket.gethostname())
            except OSError:
                host = "127.0.0.1"
        return f"{'https' if self.tls_cert_file else 'http'}://{host}:{self.port}"


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """The engine's flags, shared by `ragserve engine`, `ragserve generate` and `ragserve up`."""
    add_options(parser, (EngineConfig,), ENGINE_GROUPS)


def add_server_arguments(parser: argparse.ArgumentParser) -> None:
    """`ragserve engine`'s server and cluster flags (with the engine's cachestore connection)."""
    add_options(parser, (ServerConfig, EngineConfig), SERVER_GROUPS)


def spec_options() -> list[tuple[str, Field]]:
    """(camelCase key, field) of every engine setting a RAGServe pool or a chart pool sets, in field order."""
    return spec_fields(EngineConfig)
