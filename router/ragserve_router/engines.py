"""What the router knows about an engine: identity, models, reported load."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

GRPC, STATIC, K8S, EXTERNAL = "grpc", "static", "k8s", "external"  # where the router learned of an engine
SOURCES = (GRPC, STATIC, K8S, EXTERNAL)
CONNECT, TIMEOUT, SERVER_ERROR = "connect", "timeout", "server_error"  # how an engine failed a request


@dataclass(frozen=True)
class Load:
    """An engine's last heartbeat (proto Load): queues, KV usage, measured speeds (0: not measured). A new heartbeat
    replaces it, never changes it (cost_model.FleetSpeeds keeps what it computed from a fleet's loads until then)."""

    num_running: int = 0
    num_waiting: int = 0
    kv_usage: float = 0.0
    free_blocks: int = 0
    total_blocks: int = 0
    prefill_tokens_per_s: float = 0.0
    decode_step_s: float = 0.0
    decode_seq_s: float = 0.0
    queued_prefill_tokens: int = 0
    step_token_budget: int = 0
    long_prefill_token_threshold: int = 0  # most tokens one prefill takes per step (0: no cap)
    max_long_partial_prefills: int = 0  # with the cap: most prompts longer than it prefilled at once (0: any)
    fetch_s_per_block: float = 0.0
    computed_prompt_tokens: int = 0
    fetched_prompt_tokens: int = 0
    decode_path: int = 0  # proto DecodePath: which steps decode_step_s/decode_seq_s were timed on
    decode_seq_measured: bool = False  # decode_seq_s was fitted (0.0 is then a measurement)
    reported_at: float = 0.0  # wall-clock time the router received it (0: never)

    @property
    def active(self) -> int:
        return self.num_running + self.num_waiting


@dataclass
class EngineRecord:
    engine_id: str
    url: str
    models: list[str]
    source: str = GRPC
    model_id: str = ""
    block_size: int = 0
    tokenizer_fingerprint: str = ""
    layout_fingerprint: str = ""
    version: str = ""
    labels: dict[str, str] = field(default_factory=dict)
    cachestore: str = ""  # the cachestore it fetches from and offloads to ("": none)
    role: str = "both"  # --role: "both", "prefill" (computes prompts into the cachestore) or "decode"
    num_blocks: int = 0
    max_model_len: int = 0
    load: Load = field(default_factory=Load)

    @property
    def has_events(self) -> bool:
        """A ragserve engine that registered over gRPC: it streams KV events and speaks ragserve's extensions."""
        return self.source == GRPC

    @property
    def has_exact_index(self) -> bool:
        """The exact KV index covers it: a registered engine, or an external one followed from its vLLM events
        (the pool's exact_index also checks that its follower did not refuse it)."""
        return self.source in (GRPC, EXTERNAL)

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str | bytes) -> EngineRecord:
        data = json.loads(text)
        load = data.get("load", {})
        legacy = load.pop("cachestore", "")  # stored by a router from before the address moved to the identity
        data["load"] = Load(**load)
        data.setdefault("cachestore", legacy)
        return cls(**data)


@dataclass(frozen=True)
class ModelSpec:
    """How the engines serving one model hash prompts; the registry keeps it unique per model."""

    model_id: str
    block_size: int
    tokenizer_fingerprint: str

    @classmethod
    def of(cls, record: EngineRecord) -> ModelSpec | None:
        if record.source != GRPC:
            return None
        return cls(record.model_id, record.block_size, record.tokenizer_fingerprint)


@dataclass
class TokenizerBlob:
    """The tokenizer an engine shipped at registration, as stored and shared between replicas."""

    tokenizer_json: str
    chat_template: str | None
    special_tokens: dict[str, str | None]

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str | bytes) -> TokenizerBlob:
        return cls(**json.loads(text))
