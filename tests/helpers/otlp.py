"""A real OTLP/gRPC trace receiver in the test process: opentelemetry-proto's TraceService over grpc."""

from __future__ import annotations

import threading
from concurrent import futures
from dataclasses import dataclass, field

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2 as pb
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc as pb_grpc
from opentelemetry.proto.common.v1.common_pb2 import AnyValue


@dataclass
class Span:
    service: str
    name: str
    trace_id: str
    span_id: str
    parent_id: str  # "" for a root span
    attributes: dict = field(default_factory=dict)


def _value(v: AnyValue):
    return getattr(v, v.WhichOneof("value")) if v.WhichOneof("value") else None


class Receiver(pb_grpc.TraceServiceServicer):
    """Collects every exported span; `endpoint` is what --otlp-traces-endpoint takes."""

    def __init__(self) -> None:
        self.spans: list[Span] = []
        self._lock = threading.Lock()
        self.server = grpc.server(futures.ThreadPoolExecutor(4))
        pb_grpc.add_TraceServiceServicer_to_server(self, self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.endpoint = f"127.0.0.1:{self.port}"

    def Export(self, request: pb.ExportTraceServiceRequest, context) -> pb.ExportTraceServiceResponse:
        got = []
        for rs in request.resource_spans:
            resource = {a.key: _value(a.value) for a in rs.resource.attributes}
            for ss in rs.scope_spans:
                for s in ss.spans:
                    attrs = {a.key: _value(a.value) for a in s.attributes}
                    ids = (s.trace_id.hex(), s.span_id.hex(), s.parent_span_id.hex())
                    got.append(Span(resource.get("service.name", ""), s.name, *ids, attrs))
        with self._lock:
            self.spans += got
        return pb.ExportTraceServiceResponse()

    def trace(self, trace_id: str) -> list[Span]:
        with self._lock:
            return [s for s in self.spans if s.trace_id == trace_id]

    def named(self, name: str) -> list[Span]:
        with self._lock:
            return [s for s in self.spans if s.name == name]

    def __enter__(self) -> Receiver:
        self.server.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.stop(grace=None)
