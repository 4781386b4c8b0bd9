"""OpenTelemetry tracing across router -> engine -> cachestore, linked by W3C `traceparent`.

Off unless `--otlp-traces-endpoint` is given (vLLM's flag); then spans go over OTLP/gRPC. When off, every
helper here is a no-op and opentelemetry is never imported. The context travels as the `traceparent` HTTP
header (router -> engine) and gRPC metadata key (engine -> cachestore).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

TRACEPARENT = "traceparent"
FETCHED_TOKENS = "ragserve.fetched_tokens"  # engine: prompt tokens fetched from the cachestore
_tracer = None
_provider = None
live: dict[str, Any] = {}  # engine: request id -> its open span, for the cachestore calls made on its behalf


def setup(endpoint: str | None, service: str) -> None:
    """Export spans of `service` to the OTLP/gRPC collector at `endpoint` (host:port or http(s)://host:port)."""
    global _tracer, _provider
    if not endpoint:
        return
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    insecure = not endpoint.startswith("https://")
    exporter = OTLPSpanExporter(endpoint=endpoint.removeprefix("http://"), insecure=insecure)
    _provider = TracerProvider(resource=Resource.create({"service.name": service}))
    _provider.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=500))
    _tracer = _provider.get_tracer("ragserve")


def shutdown() -> None:
    """Flush the spans still queued (on a clean stop)."""
    if _provider is not None:
        _provider.shutdown()


def enabled() -> bool:
    return _tracer is not None


def extract(carrier: Mapping[str, str] | Iterable[tuple[str, str]] | None):
    """The remote parent in HTTP headers or gRPC invocation metadata (None when off or absent)."""
    if _tracer is None or carrier is None:
        return None
    items = carrier.items() if isinstance(carrier, Mapping) else carrier
    value = next((v for k, v in items if k.lower() == TRACEPARENT), None)
    if not value:
        return None
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    return TraceContextTextMapPropagator().extract({TRACEPARENT: value})


def _context(parent):
    """A span or an extracted context -> a context to start a child in."""
    from opentelemetry import trace

    if parent is None or isinstance(parent, dict):
        return parent
    return trace.set_span_in_context(parent) if isinstance(parent, trace.Span) else parent


def start(name: str, parent=None, attributes: Mapping[str, Any] | None = None, start_time: float | None = None):
    """An open span (end it yourself), child of `parent` (span or context); None when off.
    `start_time`: a time.monotonic() reading."""
    if _tracer is None:
        return None
    ns = _epoch_ns(start_time) if start_time is not None else None
    return _tracer.start_span(name, _context(parent), attributes=dict(attributes or {}), start_time=ns)


def record(name: str, parent, start_time: float | None, end_time: float | None, attributes=None) -> None:
    """A finished span from two time.monotonic() readings (skipped when either is missing)."""
    if parent is None or start_time is None or end_time is None:
        return
    span = start(name, parent, attributes, start_time)
    span.end(_epoch_ns(end_time))


@contextlib.contextmanager
def span(name: str, parent=None, attributes: Mapping[str, Any] | None = None) -> Iterator[Any]:
    """A span current for the block (yields None when off); without `parent`, a child of the current span."""
    if _tracer is None:
        yield None
        return
    with _tracer.start_as_current_span(name, _context(parent), attributes=dict(attributes or {})) as s:
        yield s


@contextlib.contextmanager
def use(parent) -> Iterator[None]:
    """Make a span current on this thread for the block (no-op for None)."""
    if parent is None:
        yield
        return
    from opentelemetry import context

    token = context.attach(_context(parent))
    try:
        yield
    finally:
        context.detach(token)


def headers() -> dict[str, str]:
    """{'traceparent': ...} for the current span, or {}."""
    if _tracer is None:
        return {}
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    carrier: dict[str, str] = {}
    TraceContextTextMapPropagator().inject(carrier)
    return carrier


def grpc_metadata(base: tuple | None) -> tuple | None:
    """gRPC call metadata plus the current span's traceparent (unchanged when off or outside a span)."""
    extra = tuple(headers().items())
    return (*(base or ()), *extra) if extra else base


def _epoch_ns(monotonic_s: float) -> int:
    return time.time_ns() - int((time.monotonic() - monotonic_s) * 1e9)
