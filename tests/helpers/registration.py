"""A minimal recording Registry servicer (a real gRPC server in the test process) for registration tests.

It applies KV events like a router does (in order, duplicates skipped, a gap stops the batch),
so its index is what a router would know. No tests here.
"""

from __future__ import annotations

import threading
from concurrent import futures

import grpc
import httpx

from ragserve.keys import block_hashes, root_hash
from ragserve.v1 import registry_pb2, registry_pb2_grpc

HEARTBEAT_MS = 200


class Recorder(registry_pb2_grpc.RegistryServicer):
    def __init__(self, last_seq: dict[str, int] | None = None, index: dict[str, set] | None = None) -> None:
        self.lock = threading.Lock()
        self.registers: list[registry_pb2.RegisterRequest] = []
        self.heartbeats: list[registry_pb2.HeartbeatRequest] = []
        self.events: list[registry_pb2.KVEvent] = []  # applied, in order
        self.stream_starts: list[int] = []  # seq of the first event of each stream
        self.deregisters: list[registry_pb2.DeregisterRequest] = []
        self.last_seq = dict(last_seq or {})
        self.index = {k: set(v) for k, v in (index or {}).items()}
        self.known: set[str] = set()
        self.refuse = 0  # refuse this many registrations with FAILED_PRECONDITION

    def Register(self, request, context):
        with self.lock:
            self.registers.append(request)
            if self.refuse > 0:
                self.refuse -= 1
                context.abort(grpc.StatusCode.FAILED_PRECONDITION, "probe block hashes differ (test refusal)")
            engine_id = request.identity.engine_id
            self.known.add(engine_id)
            resume = self.last_seq.get(engine_id, 0)
        return registry_pb2.RegisterResponse(
            router_id="recorder", resume_from_seq=resume, heartbeat_interval_ms=HEARTBEAT_MS
        )

    def Heartbeat(self, request, context):
        with self.lock:
            self.heartbeats.append(request)
            return registry_pb2.HeartbeatResponse(known=request.engine_id in self.known)

    def StreamKVEvents(self, request_iterator, context):
        first = True
        for batch in request_iterator:
            with self.lock:
                if first and batch.events:
                    self.stream_starts.append(batch.events[0].seq)
                    first = False
                last = self._apply(batch.engine_id, batch.events)
            yield registry_pb2.KVEventAck(acked_seq=last)

    def _apply(self, engine_id: str, events) -> int:
        last = self.last_seq.get(engine_id, 0)
        blocks = self.index.setdefault(engine_id, set())
        for ev in events:
            if ev.seq <= last:
                continue
            if ev.seq != last + 1:
                break
            kind = ev.WhichOneof("event")
            if kind == "stored":
                blocks.update(ev.stored.block_hashes)
            elif kind == "removed":
                blocks.difference_update(ev.removed.block_hashes)
            else:
                blocks.clear()
            self.events.append(ev)
            last = ev.seq
        self.last_seq[engine_id] = last
        return last

    def Deregister(self, request, context):
        with self.lock:
            self.deregisters.append(request)
            self.known.discard(request.engine_id)
        return registry_pb2.DeregisterResponse()

    def forget(self, engine_id: str) -> None:
        """Like a router that expired the engine: heartbeats answer known=false, events start over."""
        with self.lock:
            self.known.discard(engine_id)
            self.last_seq.pop(engine_id, None)
            self.index.pop(engine_id, None)


def serve_recorder(
    port: int, recorder: Recorder | None = None, credentials: grpc.ServerCredentials | None = None
) -> tuple[grpc.Server, Recorder]:
    recorder = recorder or Recorder()
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=8),
        options=[("grpc.max_receive_message_length", 64 * 1024**2), ("grpc.so_reuseport", 1)],
    )
    registry_pb2_grpc.add_RegistryServicer_to_server(recorder, server)
    if credentials is None:
        server.add_insecure_port(f"127.0.0.1:{port}")
    else:
        server.add_secure_port(f"127.0.0.1:{port}", credentials)
    server.start()
    return server, recorder


def prompt_ids(k: int, n: int = 80) -> list[int]:
    """A prompt of n token ids no other prompt shares (k selects it)."""
    return [100 + k * 1000 + j for j in range(n)]


def complete(url: str, ids: list[int]) -> dict:
    """One prefill; with max_tokens=1 the engine caches exactly the prompt's full blocks."""
    resp = httpx.post(url + "/v1/completions", json={"prompt": ids, "max_tokens": 1}, timeout=60)
    assert resp.status_code == 200, resp.text
    return resp.json()


def expected_index(model_id: str, prompts: list[list[int]]) -> set[bytes]:
    root = root_hash(model_id)
    return {h for ids in prompts for h in block_hashes(ids, 16, root)}
