"""Client side of proto/ragserve/v1/registry.proto: register, heartbeat, stream KV events, deregister.

Runs as one asyncio task on the server's event loop (grpc.aio); it never touches the engine's
step thread except through EngineClient.with_kv_snapshot. A refused or unreachable router never
stops the engine from serving: it keeps retrying with backoff.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from functools import cached_property

import grpc

from ragserve import __version__
from ragserve.engine_args import ServerConfig
from ragserve.keys import KEY_SCHEME, probe_hashes
from ragserve.tls import channel_credentials
from ragserve.token_auth import bearer, read_token
from ragserve.v1 import registry_pb2, registry_pb2_grpc
from ragserve_engine.engine_client import EngineClient
from ragserve_engine.server.kv_events import KVEventLog

log = logging.getLogger("ragserve_engine.registration")
MAX_MESSAGE_BYTES = 64 * 1024**2
RPC_TIMEOUT_S = 10.0
BACKOFF_S = (0.25, 10.0)
LOG_EVERY_S = 30.0
MAX_BATCH_EVENTS = 1024
REFUSED = (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.UNAUTHENTICATED)


def make_channel(cfg: ServerConfig) -> grpc.aio.Channel:
    options = [
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ]
    if not cfg.router_tls_ca:
        return grpc.aio.insecure_channel(cfg.router, options=options)
    creds = channel_credentials(cfg.router_tls_ca, cfg.router_tls_cert, cfg.router_tls_key, flags="--router-tls-")
    return grpc.aio.secure_channel(cfg.router, creds, options=options)


class RegistrationClient:
    def __init__(
        self,
        cfg: ServerConfig,
        llm: EngineClient,
        model_name: str,
        events: KVEventLog,
        long_prefill_token_threshold: int = 0,
        max_long_partial_prefills: int = 0,
    ) -> None:
        self.cfg = cfg
        self.long_prefill_token_threshold = long_prefill_token_threshold  # where it applies (0: no cap)
        self.max_long_partial_prefills = max_long_partial_prefills
        self.llm = llm
        self.model_name = model_name
        self.events = events
        self.registered = False
        self.registrations = 0
        self.acked_seq = 0
        self._last_log: dict[str, float] = {}
        self._task: asyncio.Task | None = None
        self._channel: grpc.aio.Channel | None = None
        self.metadata = bearer(read_token(cfg.registry_token_file)) if cfg.registry_token_file else None

    @cached_property
    def request(self) -> registry_pb2.RegisterRequest:
        cfg, info, tok = self.cfg, self.llm.info, self.llm.tokenizer
        layout = info.layout
        identity = registry_pb2.EngineIdentity(
            engine_id=cfg.engine_id,
            url=cfg.url,
            served_model_name=self.model_name,
            model_id=layout.model_id,
            key_scheme=KEY_SCHEME,
            block_size=layout.block_size,
            layout_fingerprint=layout.fingerprint(),
            tokenizer_fingerprint=tok.fingerprint(),
            version=__version__,
            cachestore=info.cachestore,
            role=info.role,
        )
        return registry_pb2.RegisterRequest(
            identity=identity,
            tokenizer_json=tok.tokenizer_json.encode(),
            chat_template=tok.chat_template or "",
            special_tokens_json=json.dumps(tok.special_tokens),
            num_blocks=info.num_blocks,
            max_model_len=info.max_model_len,
            probe_block_hashes=_probe(tok, layout.block_size, layout.model_id),
        )

    def start(self) -> None:
        self.events.bind(asyncio.get_running_loop())
        self.llm.add_kv_event_listener(self.events.on_events)
        self._channel = make_channel(self.cfg)
        self._task = asyncio.create_task(self._run(registry_pb2_grpc.RegistryStub(self._channel)))

    async def stop(self, reason: str) -> None:
        """Stop heartbeats and events, then Deregister (best effort)."""
        if self._task is None:
            return
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)
        self._task = None
        if self.registered:
            stub = registry_pb2_grpc.RegistryStub(self._channel)
            try:
                request = registry_pb2.DeregisterRequest(engine_id=self.cfg.engine_id, reason=reason)
                await stub.Deregister(request, timeout=5.0, metadata=self.metadata)
                log.info("deregistered from router %s (%s)", self.cfg.router, reason)
            except grpc.aio.AioRpcError as exc:
                log.warning("deregister failed: %s %s", exc.code().name, exc.details())
            self.registered = False
        await self._channel.close()

    # ---- the loop --------------------------------------------------------------------------------
    async def _run(self, stub: registry_pb2_grpc.RegistryStub) -> None:
        delay = BACKOFF_S[0]
        while True:
            try:
                resp = await stub.Register(self.request, timeout=RPC_TIMEOUT_S, metadata=self.metadata)
            except grpc.aio.AioRpcError as exc:
                self._rpc_failed("register", exc)
                await asyncio.sleep(delay)
                delay = min(delay * 2, BACKOFF_S[1])
                continue
            delay = BACKOFF_S[0]
            self.registered = True
            self.registrations += 1
            cursor = await self._resume(resp.resume_from_seq)
            log.info(
                "registered with router %s (%s) as %s; events from seq %d",
                self.cfg.router, resp.router_id or "?", self.cfg.engine_id, cursor + 1,
            )  # fmt: skip
            try:
                await self._session(stub, cursor, (resp.heartbeat_interval_ms or 1000) / 1000)
            except grpc.aio.AioRpcError as exc:
                self._rpc_failed("session", exc)
                await asyncio.sleep(BACKOFF_S[0])
            except LookupError as exc:  # the router fell behind our replay buffer: resync
                log.warning("%s; registering again to resync", exc)
            self.registered = False

    async def _resume(self, resume_from_seq: int) -> int:
        """Replay from the router's last applied seq, or send a snapshot numbered right after it."""
        if not self.events.can_replay(resume_from_seq):
            count = await self.llm.with_kv_snapshot(lambda snap: self.events.snapshot(snap, resume_from_seq))
            log.info("sending a KV snapshot of %d cached blocks", count)
        return resume_from_seq

    async def _session(self, stub, cursor: int, interval: float) -> None:
        """Heartbeat until the router forgets us or the event stream fails."""
        sender = asyncio.create_task(self._stream_events(stub, cursor))
        try:
            while not sender.done():
                sent = time.monotonic()
                request = registry_pb2.HeartbeatRequest(
                    engine_id=self.cfg.engine_id, load=self.load(), last_event_seq=self.events.last_seq
                )
                resp = await stub.Heartbeat(request, timeout=RPC_TIMEOUT_S, metadata=self.metadata)
                if not resp.known:
                    log.warning("router %s no longer knows this engine; registering again", self.cfg.router)
                    return
                # one heartbeat an interval, however long the router took to answer (a busy router answers
                # late: waiting a whole interval after that would miss its deadline)
                await asyncio.wait([sender], timeout=max(0.0, interval - (time.monotonic() - sent)))
            sender.result()  # raises what ended the stream
        finally:
            sender.cancel()
            await asyncio.gather(sender, return_exceptions=True)

    def load(self) -> registry_pb2.Load:
        """The heartbeat's load: queues, KV usage and the measured speeds of the router's cost model."""
        stats = self.llm.stats()
        return registry_pb2.Load(
            num_running=stats.num_running,
            num_waiting=stats.num_waiting,
            kv_usage=stats.kv_usage,
            free_blocks=stats.free_blocks,
            total_blocks=stats.total_blocks,
            prefill_tokens_per_s=stats.prefill_tokens_per_s,
            decode_step_s=stats.decode_step_s,
            decode_seq_s=stats.decode_seq_s,
            decode_seq_measured=stats.decode_seq_measured,
            decode_path=registry_pb2.DecodePath.Value("DECODE_" + stats.decode_path.upper()),
            long_prefill_token_threshold=self.long_prefill_token_threshold,
            max_long_partial_prefills=self.max_long_partial_prefills,
            queued_prefill_tokens=stats.queued_prefill_tokens,
            step_token_budget=stats.step_token_budget,
            fetch_s_per_block=stats.fetch_s_per_block,
            computed_prompt_tokens=stats.computed_prompt_tokens,
            fetched_prompt_tokens=stats.fetched_prompt_tokens,
        )

    async def _stream_events(self, stub, cursor: int) -> None:
        lost: list[LookupError] = []

        async def batches():
            nonlocal cursor
            while True:
                try:
                    events = self.events.since(cursor, MAX_BATCH_EVENTS)
                except LookupError as exc:  # ends the request stream; raised below
                    lost.append(exc)
                    return
                if events:
                    cursor = events[-1].seq
                    yield registry_pb2.KVEventBatch(engine_id=self.cfg.engine_id, events=events)
                    continue
                self.events.changed.clear()
                if not self.events.since(cursor, 1):
                    await self.events.changed.wait()

        async for ack in stub.StreamKVEvents(batches(), metadata=self.metadata):
            self.acked_seq = ack.acked_seq
        if lost:
            raise lost[0]

    def _rpc_failed(self, what: str, exc: grpc.aio.AioRpcError) -> None:
        refused = exc.code() in REFUSED
        key = f"{what}:{exc.code().name}"
        now = time.monotonic()
        if now - self._last_log.get(key, -LOG_EVERY_S) < LOG_EVERY_S:
            log.debug("%s with router %s failed: %s %s", what, self.cfg.router, exc.code().name, exc.details())
            return
        self._last_log[key] = now
        if refused:
            log.error(
                "ROUTER %s REFUSED THIS ENGINE (%s): %s. Serving continues, but the router will not send traffic "
                "here until this is fixed; retrying.",
                self.cfg.router, exc.code().name, exc.details(),
            )  # fmt: skip
        else:
            log.warning(
                "%s with router %s failed: %s %s; retrying", what, self.cfg.router, exc.code().name, exc.details()
            )


def _probe(tokenizer, block_size: int, model_id: str) -> list[bytes]:
    try:
        return probe_hashes(tokenizer, block_size, model_id)
    except ValueError:  # no chat template: the router then checks nothing either
        return []
