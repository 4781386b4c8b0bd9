"""The Gateway API Inference Extension's endpoint picker protocol (v1.0.0) over Envoy's ext_proc messages: the
names the gateway and the picker agree on, reading what the gateway sends and building what the picker answers.
The messages are Envoy's own generated protos (xds-protos)."""

from __future__ import annotations

import json
from collections.abc import Iterable
from urllib.parse import urlsplit

from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext
from envoy.type.v3 import http_status_pb2
from google.protobuf import struct_pb2
from starlette.datastructures import Headers

from ragserve.http.errors import ApiError, error_body
from ragserve_router.engines import EngineRecord

DESTINATION = "x-gateway-destination-endpoint"  # header and dynamic metadata key: "ip:port[,ip:port...]"
SERVED = "x-gateway-destination-endpoint-served"  # response metadata_context key: the endpoint that answered
SUBSET = "x-gateway-destination-endpoint-subset"  # request metadata_context key: pick only from these
LB_NAMESPACE = "envoy.lb"
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"  # also a health service name
OVERWRITE = base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD  # a client cannot pre-set the destination


def endpoint(record: EngineRecord) -> str:
    """The engine's `ip:port` as the gateway addresses it (its registered or discovered URL's host and port)."""
    parts = urlsplit(record.url)
    host = parts.hostname or ""
    port = parts.port or (443 if parts.scheme == "https" else 80)
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def header_map(headers: ext.HttpHeaders) -> Headers:
    """Envoy's header map (pseudo-headers included) as case-insensitive headers; raw_value wins over value."""
    raw = [(h.key.lower().encode(), h.raw_value or h.value.encode()) for h in headers.headers.headers]
    return Headers(raw=raw)


def metadata_value(metadata: base_pb2.Metadata, namespace: str, key: str) -> struct_pb2.Value | None:
    """filter_metadata[namespace][key] of a metadata_context, None when absent."""
    if namespace not in metadata.filter_metadata:
        return None
    fields = metadata.filter_metadata[namespace].fields
    return fields.get(key)


def subset_hint(metadata: base_pb2.Metadata) -> set[str] | None:
    """The endpoints the gateway lets the picker choose from (None: no hint; a set, possibly empty, otherwise)."""
    value = metadata_value(metadata, SUBSET_NAMESPACE, SUBSET)
    if value is None:
        return None
    if value.HasField("list_value"):
        items = [v.string_value for v in value.list_value.values]
    else:  # tolerate one comma-separated string
        items = value.string_value.split(",")
    return {item.strip() for item in items if item.strip()}


def served_endpoint(metadata: base_pb2.Metadata) -> str | None:
    value = metadata_value(metadata, LB_NAMESPACE, SERVED)
    return value.string_value.strip() or None if value is not None else None


def _header(key: str, value: str) -> base_pb2.HeaderValueOption:
    header = base_pb2.HeaderValue(key=key, raw_value=value.encode())
    return base_pb2.HeaderValueOption(header=header, append_action=OVERWRITE)


def route_to(
    endpoints: Iterable[str], extra: dict[str, str], body_length: int | None, remove: Iterable[str] = ()
) -> ext.ProcessingResponse:
    """The request headers' answer: the endpoints (primary first) in the header and in dynamic metadata; `extra`
    headers set, `remove` ones removed."""
    value = ",".join(endpoints)
    headers = {DESTINATION: value, **extra}
    if body_length is not None:
        headers["content-length"] = str(body_length)
    mutation = ext.HeaderMutation(set_headers=[_header(k, v) for k, v in headers.items()], remove_headers=list(remove))
    common = ext.CommonResponse(header_mutation=mutation, clear_route_cache=True)
    metadata = struct_pb2.Struct()
    metadata.update({LB_NAMESPACE: {DESTINATION: value}})
    return ext.ProcessingResponse(request_headers=ext.HeadersResponse(response=common), dynamic_metadata=metadata)


def request_body(body: bytes) -> ext.ProcessingResponse:
    """The whole request body back, unchanged (full-duplex streamed mode: the picker answers at the end)."""
    streamed = ext.StreamedBodyResponse(body=body, end_of_stream=True)
    common = ext.CommonResponse(body_mutation=ext.BodyMutation(streamed_response=streamed))
    return ext.ProcessingResponse(request_body=ext.BodyResponse(response=common))


def response_body(body: bytes, end_of_stream: bool) -> ext.ProcessingResponse:
    """A response body chunk passed through as it came."""
    streamed = ext.StreamedBodyResponse(body=body, end_of_stream=end_of_stream)
    common = ext.CommonResponse(body_mutation=ext.BodyMutation(streamed_response=streamed))
    return ext.ProcessingResponse(response_body=ext.BodyResponse(response=common))


def headers_done(request: bool, add: dict[str, str] | None = None) -> ext.ProcessingResponse:
    """Headers left as they are, but for those in `add` (set)."""
    mutation = ext.HeaderMutation(set_headers=[_header(k, v) for k, v in (add or {}).items()]) if add else None
    answer = ext.HeadersResponse(response=ext.CommonResponse(header_mutation=mutation))
    return ext.ProcessingResponse(**{"request_headers" if request else "response_headers": answer})


def trailers_done(request: bool) -> ext.ProcessingResponse:
    answer = ext.TrailersResponse()
    return ext.ProcessingResponse(**{"request_trailers" if request else "response_trailers": answer})


def error_json(error: ApiError) -> bytes:
    return json.dumps(error_body(error.status, error.message, error.code, error.param)).encode()


def immediate(error: ApiError, request_id: str) -> ext.ProcessingResponse:
    """The gateway answers the client itself: the status and an OpenAI-style error body."""
    headers = {"content-type": "application/json", "x-request-id": request_id, **error.headers}
    body = error_json(error)
    answer = ext.ImmediateResponse(
        status=http_status_pb2.HttpStatus(code=error.status),
        headers=ext.HeaderMutation(set_headers=[_header(k.lower(), v) for k, v in headers.items()]),
        body=body,
        details=f"ragserve_epp_{error.code or error.status}",
    )
    return ext.ProcessingResponse(immediate_response=answer)
