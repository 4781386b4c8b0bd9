"""A KV-event publisher whose sockets carry the same bytes as vLLM's ZmqEventPublisher.

PUB frames: [topic (utf-8), sequence (8 bytes, big-endian, from 0), msgpack EventBatch]. The ROUTER
replay socket takes [identity, b"", start sequence (8 bytes)] and answers, for every buffered batch
at or after that sequence, [identity, b"", sequence, payload], then the end marker
[identity, b"", END_SEQ_BYTES, b""]. The last `buffer_steps` batches are kept for replay.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import queue
import threading
import time
from collections import deque

import zmq

from ragserve.vllm_events.config import KVEventsConfig, binds, offset_endpoint_port
from ragserve.vllm_events.wire import END_SEQ_BYTES, EventBatch, KVEvent, encode_batch, encode_seq

log = logging.getLogger(__name__)

_POLL_S = 0.01  # how long the thread waits for a batch before looking at the replay socket again


class ZmqEventPublisher:
    def __init__(
        self,
        endpoint: str = "tcp://*:5557",
        replay_endpoint: str | None = None,
        buffer_steps: int = 10_000,
        hwm: int = 100_000,
        max_queue_size: int = 100_000,
        topic: str = "",
        *,
        data_parallel_rank: int = 0,
        bind: bool | None = None,
    ) -> None:
        """`bind` None follows vLLM (bind wildcard/ipc/inproc endpoints, connect otherwise); True binds a
        concrete address such as tcp://127.0.0.1:PORT, which vLLM's rule would connect to."""
        self.data_parallel_rank = data_parallel_rank
        self.endpoint = offset_endpoint_port(endpoint, data_parallel_rank)
        self.replay_endpoint = offset_endpoint_port(replay_endpoint, data_parallel_rank)
        assert self.endpoint is not None
        self._topic = topic.encode("utf-8")
        self._queue: queue.Queue[EventBatch | None] = queue.Queue(maxsize=max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._seq = itertools.count()
        ctx = zmq.Context.instance()
        self._pub = ctx.socket(zmq.PUB)
        self._pub.set_hwm(hwm)
        self._bound = binds(self.endpoint) if bind is None else bind
        if self._bound:
            self._pub.bind(self.endpoint)
        else:
            self._pub.connect(self.endpoint)
        self._replay: zmq.Socket | None = None
        if self.replay_endpoint is not None:
            self._replay = ctx.socket(zmq.ROUTER)
            self._replay.bind(self.replay_endpoint)
        self._running = True
        self._thread = threading.Thread(target=self._run, name="kv-events-publisher", daemon=True)
        self._thread.start()

    @property
    def bound(self) -> bool:
        """Whether the PUB socket bound its endpoint (else it connected to it)."""
        return self._bound

    @classmethod
    def from_config(
        cls, config: KVEventsConfig, data_parallel_rank: int = 0, bind: bool | None = None
    ) -> ZmqEventPublisher:
        if not config.publishes:
            raise ValueError("kv-events-config does not enable the zmq publisher")
        return cls(
            config.endpoint,
            config.replay_endpoint,
            config.buffer_steps,
            config.hwm,
            config.max_queue_size,
            config.topic,
            data_parallel_rank=data_parallel_rank,
            bind=bind,
        )

    def publish(self, batch: EventBatch) -> None:
        """Queue one batch (blocks while max_queue_size batches wait); a batch without a rank gets ours."""
        if not self._running:
            raise RuntimeError("publisher is closed")
        if batch.data_parallel_rank is None:
            batch.data_parallel_rank = self.data_parallel_rank
        self._queue.put(batch)

    def publish_events(self, events: list[KVEvent], ts: float | None = None) -> None:
        self.publish(EventBatch(ts=time.time() if ts is None else ts, events=list(events)))

    def flush(self, timeout: float = 5.0) -> None:
        """Wait until every queued batch has been handed to the PUB socket."""
        deadline = time.monotonic() + timeout
        while self._queue.unfinished_tasks:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self._queue.unfinished_tasks} batches still queued")
            time.sleep(0.002)

    def close(self, linger_ms: int = 100) -> None:
        if not self._running:
            return
        self._running = False
        self._queue.put(None)
        self._thread.join(timeout=5.0)
        # Unbind first so a successor (a restarted engine) can bind the same ports at once.
        if self._bound:
            _unbind(self._pub, self.endpoint)
        self._pub.close(linger=linger_ms)
        if self._replay is not None:
            assert self.replay_endpoint is not None
            _unbind(self._replay, self.replay_endpoint)
            self._replay.close(linger=linger_ms)

    def __enter__(self) -> ZmqEventPublisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _run(self) -> None:
        # The one thread that touches the sockets (zmq sockets are not thread-safe).
        while True:
            if self._replay is not None:
                while self._replay.poll(0):
                    self._serve_replay()
            try:
                batch = self._queue.get(timeout=_POLL_S)
            except queue.Empty:
                continue
            try:
                if batch is None:
                    return
                seq = next(self._seq)
                payload = encode_batch(batch)
                self._pub.send_multipart((self._topic, encode_seq(seq), payload))
                self._buffer.append((seq, payload))
            except Exception:
                log.exception("publishing KV-event batch failed")
            finally:
                self._queue.task_done()

    def _serve_replay(self) -> None:
        assert self._replay is not None
        frames = self._replay.recv_multipart()
        if len(frames) != 3:
            log.warning("ignoring replay request of %d frames", len(frames))
            return
        identity, _, start = frames
        start_seq = int.from_bytes(start, "big")
        for seq, payload in self._buffer:
            if seq >= start_seq:
                self._replay.send_multipart((identity, b"", encode_seq(seq), payload))
        self._replay.send_multipart((identity, b"", END_SEQ_BYTES, b""))


def _unbind(socket: zmq.Socket, endpoint: str) -> None:
    # The socket is closed right after: unbinding only makes the port free sooner.
    with contextlib.suppress(zmq.ZMQError):
        socket.unbind(socket.last_endpoint.decode() if "*" in endpoint else endpoint)
