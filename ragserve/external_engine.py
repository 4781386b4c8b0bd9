"""The `--external-engine` value: an unmodified vLLM engine's URL and KV-event endpoints.

Here, not in the router package, so that ragserve.router_args (the CLI, the operator, the chart tests)
parses and checks it without importing the router or ZMQ.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

FORMAT = "URL,events=tcp://HOST:PORT[,replay=tcp://HOST:PORT][,dp=N]"


@dataclass(frozen=True)
class ExternalEngineSpec:
    url: str
    events: str
    replay: str | None = None
    dp: int = 1

    @classmethod
    def parse(cls, text: str) -> ExternalEngineSpec:
        url, *options = [part.strip() for part in text.split(",")]
        if not url.startswith(("http://", "https://")) or "=" in url:
            raise ValueError(f"--external-engine {text!r}: must start with the engine's http(s) URL ({FORMAT})")
        values: dict[str, str] = {}
        for option in options:
            name, sep, value = option.partition("=")
            if not sep or not value:
                raise ValueError(f"--external-engine {text!r}: {option!r} is not NAME=VALUE ({FORMAT})")
            if name not in ("events", "replay", "dp"):
                raise ValueError(f"--external-engine {text!r}: unknown option {name!r} (events, replay, dp)")
            if name in values:
                raise ValueError(f"--external-engine {text!r}: {name} given twice")
            values[name] = value
        if "events" not in values:
            raise ValueError(f"--external-engine {text!r}: events=tcp://HOST:PORT is required ({FORMAT})")
        for name in ("events", "replay"):
            if name in values:
                _check_tcp(text, name, values[name])
        dp = values.get("dp", "1")
        if not dp.isdigit() or int(dp) < 1:
            raise ValueError(f"--external-engine {text!r}: dp must be a positive integer, got {dp!r}")
        return cls(url.rstrip("/"), values["events"], values.get("replay"), int(dp))

    def value(self) -> str:
        """The `--external-engine` text parse() reads back as this spec."""
        options = [f"events={self.events}"] + ([f"replay={self.replay}"] if self.replay else [])
        return ",".join([self.url, *options, *([f"dp={self.dp}"] if self.dp > 1 else [])])

    def endpoints(self) -> list[tuple[int, str, str | None]]:
        """(rank, PUB endpoint, replay endpoint) per data-parallel rank, by vLLM's port + rank rule."""
        from ragserve.vllm_events.config import offset_endpoint_port  # imports ZMQ: only when followed

        out = []
        for rank in range(self.dp):
            events = offset_endpoint_port(self.events, rank)
            assert events is not None
            out.append((rank, events, offset_endpoint_port(self.replay, rank)))
        return out

    def index_ids(self, engine_id: str) -> list[str]:
        """State engine ids of its ranks' GPU blocks: the engine id itself without data parallelism."""
        return [engine_id] if self.dp == 1 else [f"{engine_id}/dp{rank}" for rank in range(self.dp)]


def _check_tcp(text: str, name: str, endpoint: str) -> None:
    host, sep, port = endpoint.removeprefix("tcp://").rpartition(":")
    if not endpoint.startswith("tcp://") or not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"--external-engine {text!r}: {name}={endpoint!r} must be tcp://HOST:PORT")


def external_engine(text: str) -> ExternalEngineSpec:
    """argparse type of --external-engine: a ValueError's message becomes the usage error."""
    try:
        return ExternalEngineSpec.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
