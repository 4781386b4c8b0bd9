"""An asyncio subscriber to a vLLM-format KV-event publisher (one engine, one data-parallel rank).

It yields `Received` batches in sequence order. On a gap it asks the replay socket for the missing
sequences; when they cannot all be had (no replay endpoint, no answer, the buffer has moved past
them) or when sequence numbers go backwards (the publisher restarted), it yields `Cold` first: the
caller must drop what it knows of that engine and rebuild from the batches that follow.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass

import msgspec
import zmq
import zmq.asyncio

from ragserve.vllm_events.wire import END_SEQ, KVEventBatch, decode_batch, decode_seq, encode_seq


@dataclass
class Received:
    seq: int
    batch: KVEventBatch
    replayed: bool = False


@dataclass
class Cold:
    reason: str  # "gap", "restart" or "undecodable"
    detail: str


Item = Received | Cold


class ZmqEventSubscriber:
    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str | None = None,
        topic: str = "",
        *,
        start_seq: int | None = 0,
        replay_timeout: float = 2.0,
        context: zmq.asyncio.Context | None = None,
    ) -> None:
        """start_seq 0: everything from the publisher's first batch is wanted (a late start replays it);
        None: the first batch seen starts the stream."""
        self._ctx = context or zmq.asyncio.Context.instance()
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.socket = self._ctx.socket(zmq.SUB)
        self.socket.setsockopt(zmq.SUBSCRIBE, topic.encode("utf-8"))
        self.socket.connect(endpoint)
        self._dealer: zmq.asyncio.Socket | None = None
        self._timeout = replay_timeout
        self._expected = start_seq  # next sequence owed to the caller
        self._live_last: int | None = None  # highest sequence seen on the PUB socket
        self._replayed: dict[int, bytes] = {}  # replayed ahead of the live stream: seq -> payload

    async def recv(self) -> list[Item]:
        """Wait for the next PUB message and return what it delivers (possibly replayed batches first)."""
        return await self.handle_frames(await self.socket.recv_multipart())

    async def __aiter__(self) -> AsyncIterator[Item]:
        while True:
            for item in await self.recv():
                yield item

    async def catch_up(self) -> list[Item]:
        """Replay everything from the next owed sequence now (e.g. right after connecting)."""
        if self._expected is None:
            return []
        items, _ = await self._replay_from(self._expected, None)
        return items

    async def handle_frames(self, frames: list[bytes]) -> list[Item]:
        """Process one multipart PUB message [topic, seq, payload] (public so tests can drop frames)."""
        if len(frames) != 3:
            return [Cold("undecodable", f"PUB message of {len(frames)} frames")]
        _, seq_frame, payload = frames
        seq = decode_seq(seq_frame)
        items: list[Item] = []
        if self._live_last is not None and seq <= self._live_last:
            items.append(Cold("restart", f"sequence went back from {self._live_last} to {seq}"))
            self._reset(expected=0)
        elif seq in self._replayed:
            if self._replayed.pop(seq) == payload:
                self._live_last = seq
                return []  # already delivered by a replay
            items.append(Cold("restart", f"batch {seq} differs from the replayed one"))
            self._reset(expected=0)
        self._live_last = seq
        self._replayed = {s: p for s, p in self._replayed.items() if s > seq}
        if self._expected is None:
            self._expected = seq
        if seq > self._expected:
            replayed, complete = await self._replay_from(self._expected, seq)
            items += replayed
            if not complete:
                items.append(Cold("gap", f"batches {self._expected}..{seq - 1} cannot be replayed"))
        if seq >= self._expected:
            items += self._deliver(seq, payload, replayed=False)
        return items

    def close(self) -> None:
        self.socket.close(linger=0)
        if self._dealer is not None:
            self._dealer.close(linger=0)

    def _reset(self, expected: int) -> None:
        self._expected = expected
        self._live_last = None
        self._replayed = {}

    def _deliver(self, seq: int, payload: bytes, replayed: bool) -> list[Item]:
        self._expected = seq + 1
        try:
            return [Received(seq, decode_batch(payload), replayed)]
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            return [Cold("undecodable", f"batch {seq}: {exc}")]

    async def _replay_from(self, start: int, stop: int | None) -> tuple[list[Item], bool]:
        """Batches start..stop-1 (or all buffered from start) and whether start..stop-1 were all there."""
        frames = await self._request_replay(start)
        if frames is None:
            return [], False
        items: list[Item] = []
        for seq, payload in frames:
            if seq < start or (stop is not None and seq >= stop):
                continue
            if seq != self._expected:
                return items, False  # the buffer no longer holds the sequences owed
            items += self._deliver(seq, payload, replayed=True)
            if stop is None:
                self._replayed[seq] = payload
        return items, stop is None or self._expected == stop

    async def _request_replay(self, start: int) -> list[tuple[int, bytes]] | None:
        if self.replay_endpoint is None:
            return None
        if self._dealer is None:
            self._dealer = self._ctx.socket(zmq.DEALER)
            self._dealer.connect(self.replay_endpoint)
        await self._dealer.send_multipart([b"", encode_seq(start)])
        frames: list[tuple[int, bytes]] = []
        try:
            while True:
                reply = await asyncio.wait_for(self._dealer.recv_multipart(), self._timeout)
                if len(reply) != 3:
                    continue
                seq = decode_seq(reply[1])
                if seq == END_SEQ:
                    return frames
                frames.append((seq, reply[2]))
        except TimeoutError:
            # Late replies must not answer the next request: start over with a fresh socket.
            self._dealer.close(linger=0)
            self._dealer = None
            return None
