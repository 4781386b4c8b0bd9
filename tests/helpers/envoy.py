"""An ext_proc client that behaves like Envoy in front of an endpoint picker (GIE protocol v1.0.0), from Envoy's
own protos: request headers with pseudo-headers, the body in chunks (end_of_stream on the last), the picker's
answers read in order; then, like the gateway's router, the request forwarded to the picked endpoints in order
(falling back when one refuses the connection) and the upstream's response headers and body sent back through the
same stream with the served endpoint in metadata_context. No Envoy binary runs here: this stands in for one."""

from __future__ import annotations

import json
import queue
import ssl
import time
from dataclasses import dataclass, field

import grpc
import httpx
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc
from google.protobuf import struct_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc

DESTINATION = "x-gateway-destination-endpoint"
SERVED = "x-gateway-destination-endpoint-served"
SUBSET = "x-gateway-destination-endpoint-subset"


def channel(address: str, tls: bool) -> grpc.Channel:
    """TLS trusting the certificate the picker presents (Envoy's GIE clusters connect without verifying it)."""
    if not tls:
        return grpc.insecure_channel(address)
    host, port = address.rsplit(":", 1)
    pem = ssl.get_server_certificate((host, int(port))).encode()
    options = [("grpc.ssl_target_name_override", "localhost")]
    return grpc.secure_channel(address, grpc.ssl_channel_credentials(root_certificates=pem), options)


def health_status(chan: grpc.Channel, service: str) -> str:
    stub = health_pb2_grpc.HealthStub(chan)
    answer = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
    return health_pb2.HealthCheckResponse.ServingStatus.Name(answer.status)


def _headers(pairs: dict[str, str], end_of_stream: bool = False) -> ext.HttpHeaders:
    values = [base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs.items()]
    return ext.HttpHeaders(headers=base_pb2.HeaderMap(headers=values), end_of_stream=end_of_stream)


def _metadata(namespace: str, values: dict) -> base_pb2.Metadata:
    inner = struct_pb2.Struct()
    inner.update(values)
    return base_pb2.Metadata(filter_metadata={namespace: inner})


class Stream:
    """One ext_proc stream (one HTTP request): messages sent as Envoy sends them, answers read one by one."""

    def __init__(self, chan: grpc.Channel) -> None:
        self.outbox: queue.Queue = queue.Queue()
        stub = external_processor_pb2_grpc.ExternalProcessorStub(chan)
        self.answers = stub.Process(iter(self.outbox.get, None))

    def send(self, **fields) -> None:
        self.outbox.put(ext.ProcessingRequest(**fields))

    def recv(self) -> ext.ProcessingResponse:
        return next(self.answers)

    def close(self) -> None:
        self.outbox.put(None)

    def cut(self) -> None:
        """The gateway's side of the stream goes away (client gone, gateway restarting)."""
        self.answers.cancel()


@dataclass
class Pick:
    """The picker's answer to a request: an immediate response, or the endpoints and the request's mutations."""

    stream: Stream
    path: str
    body: bytes
    decided_s: float  # from the last body chunk sent to the picker's first answer
    immediate: ext.ImmediateResponse | None = None
    header: str = ""  # x-gateway-destination-endpoint as set on the request
    metadata: str = ""  # dynamic_metadata envoy.lb x-gateway-destination-endpoint
    set_headers: dict[str, str] = field(default_factory=dict)
    removed: list[str] = field(default_factory=list)  # request headers the picker removed
    client_headers: dict[str, str] = field(default_factory=dict)  # the client's, forwarded less `removed`
    body_echo: bytes = b""  # the request body the picker sent back

    @property
    def endpoints(self) -> list[str]:
        return self.header.split(",") if self.header else []

    def error(self) -> dict:
        return json.loads(self.immediate.body)["error"]


@dataclass
class Served:
    status: int
    endpoint: str
    body: bytes  # what the client got: the upstream's body as the picker passed it on
    headers: dict[str, str]  # the upstream's
    added: dict[str, str] = field(default_factory=dict)  # response headers the picker set


class Envoy:
    def __init__(self, address: str, tls: bool = True, authority: str = "gateway.test") -> None:
        self.chan = channel(address, tls)
        self.authority = authority

    def pick(
        self, path: str, body: dict | bytes, headers: dict | None = None, chunks: int = 3, subset: list | None = None
    ) -> Pick:
        """Send a request's headers and body (in `chunks` pieces) and read the picker's answer."""
        raw = body if isinstance(body, bytes) else json.dumps(body).encode()
        stream = Stream(self.chan)
        pseudo = {":method": "POST", ":path": path, ":authority": self.authority, ":scheme": "http"}
        pairs = {**pseudo, "content-type": "application/json", **(headers or {})}
        context = _metadata("envoy.lb.subset_hint", {SUBSET: subset}) if subset is not None else None
        stream.send(request_headers=_headers(pairs), metadata_context=context)
        size = -(-len(raw) // chunks) or 1
        pieces = [raw[i : i + size] for i in range(0, len(raw), size)] or [b""]
        for piece in pieces[:-1]:
            stream.send(request_body=ext.HttpBody(body=piece))
        t0 = time.perf_counter()
        stream.send(request_body=ext.HttpBody(body=pieces[-1], end_of_stream=True))
        first = stream.recv()
        pick = Pick(stream, path, raw, time.perf_counter() - t0)
        pick.client_headers = {k: v for k, v in pairs.items() if not k.startswith(":")}
        if first.HasField("immediate_response"):
            pick.immediate = first.immediate_response
            stream.close()
            return pick
        assert first.HasField("request_headers"), first
        options = first.request_headers.response.header_mutation.set_headers
        pick.set_headers = {o.header.key: (o.header.raw_value or o.header.value.encode()).decode() for o in options}
        pick.removed = list(first.request_headers.response.header_mutation.remove_headers)
        pick.header = pick.set_headers.get(DESTINATION, "")
        pick.metadata = first.dynamic_metadata.fields["envoy.lb"].struct_value.fields[DESTINATION].string_value
        second = stream.recv()
        pick.body_echo = second.request_body.response.body_mutation.streamed_response.body
        return pick

    def serve(self, pick: Pick, client: httpx.Client | None = None, cut_after: int | None = None) -> Served:
        """Forward to the endpoints in order (the next on a refused connection), with the client's headers less those
        the picker removed, plus those it set; then send the upstream's answer back through the stream with the
        served endpoint. cut_after: cut the stream after that many body chunks."""
        client = client or httpx.Client(timeout=120)
        headers = {k: v for k, v in pick.client_headers.items() if k.lower() not in pick.removed}
        headers |= {k: v for k, v in pick.set_headers.items() if not k.startswith(":")}
        for endpoint in pick.endpoints:
            try:
                url = f"http://{endpoint}{pick.path}"  # the body as the picker sent it back goes upstream
                with client.stream("POST", url, content=pick.body_echo, headers=headers) as r:
                    return self._answer(pick, endpoint, r, cut_after)
            except httpx.ConnectError:
                continue
        raise AssertionError(f"no endpoint of {pick.endpoints} answered")

    def _answer(self, pick: Pick, endpoint: str, r: httpx.Response, cut_after: int | None) -> Served:
        stream = pick.stream
        pairs = {":status": str(r.status_code), "content-type": r.headers.get("content-type", "")}
        stream.send(response_headers=_headers(pairs), metadata_context=_metadata("envoy.lb", {SERVED: endpoint}))
        answer = stream.recv()
        assert answer.HasField("response_headers")
        options = answer.response_headers.response.header_mutation.set_headers
        added = {o.header.key: (o.header.raw_value or o.header.value.encode()).decode() for o in options}
        body = b""
        for n, chunk in enumerate(r.iter_raw()):
            if cut_after is not None and n >= cut_after:
                stream.cut()
                return Served(r.status_code, endpoint, body, dict(r.headers), added)
            stream.send(response_body=ext.HttpBody(body=chunk))
            passed = stream.recv().response_body.response.body_mutation.streamed_response
            assert not passed.end_of_stream
            body += passed.body
        stream.send(response_body=ext.HttpBody(body=b"", end_of_stream=True))
        passed = stream.recv().response_body.response.body_mutation.streamed_response
        assert passed.end_of_stream
        stream.close()
        return Served(r.status_code, endpoint, body + passed.body, dict(r.headers), added)

    def close(self) -> None:
        self.chan.close()
