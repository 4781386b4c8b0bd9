"""CacheStoreClient: the engine's view of the cachestore (torch-free, thread-safe, best effort).

Keys are sharded over replicas by rendezvous hashing. Every call has a deadline;
a replica that is down, slow or refusing is skipped (a miss, a dropped put) and
retried after a backoff. Only programming errors (a malformed block) raise.
"""

from __future__ import annotations

import contextvars
import logging
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeVar

import grpc

from ragserve import tracing
from ragserve.cachestore_args import DEFAULT_MAX_BLOCKS_PER_CALL, DEFAULT_MAX_MESSAGE_BYTES
from ragserve.tls import channel_credentials
from ragserve.v1 import cachestore_pb2 as pb
from ragserve.v1 import cachestore_pb2_grpc as pb_grpc
from ragserve_cachestore.record import block_error, checksum, key_error, layout_error
from ragserve_cachestore.sharding import Backoff, parse_addresses, rendezvous_owner

log = logging.getLogger(__name__)
_T = TypeVar("_T")
# codes after which a replica is skipped for a backoff period (down, too slow, or refusing us)
_DOWN = (
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.UNAUTHENTICATED,
    grpc.StatusCode.PERMISSION_DENIED,
)
_MESSAGE_SLACK = 64 * 1024  # framing and header room in a PutRequest
PUT_MESSAGE_BYTES = 1024**2


@dataclass(frozen=True)
class KVBlock:
    key: bytes  # chained block hash (32 bytes)
    data: bytes
    dtype: str  # "bfloat16", "float16", "float32", "float8_e4m3fn", "float8_e5m2", "int8", "uint8"
    shape: tuple[int, ...]


@dataclass(frozen=True)
class PutResult:
    stored: int = 0  # blocks newly stored (the store had the others already)
    accepted_bytes: int = 0  # block bytes in the Put calls the store answered (not those a down store dropped)


@dataclass(frozen=True)
class TLSConfig:
    ca_file: str | None = None  # CA that signed the server certificate (default: system roots)
    cert_file: str | None = None  # client certificate for mutual TLS
    key_file: str | None = None

    def credentials(self) -> grpc.ChannelCredentials:
        # the engine's --cachestore-tls-* flags are where these files come from
        return channel_credentials(self.ca_file, self.cert_file, self.key_file, flags="--cachestore-tls-")


class Replica:
    def __init__(self, address: str, channel: grpc.Channel, backoff: Backoff) -> None:
        self.address, self.channel, self.backoff = address, channel, backoff
        self.stub = pb_grpc.CacheStoreStub(channel)

    def call(self, default: object, fn: Callable, *args: object, **kwargs: object) -> object:
        """fn(*args, **kwargs); on an RPC error log, back off if the replica looks down, and return `default`."""
        if not self.backoff.available():
            return default
        try:
            result = fn(*args, **kwargs)
        except grpc.RpcError as exc:
            code = exc.code() if hasattr(exc, "code") else None
            if code in _DOWN:
                self.backoff.failed()
            log.warning("cachestore %s: %s %s", self.address, code, exc.details() if code else exc)
            return default
        self.backoff.succeeded()
        return result


class CacheStoreClient:
    def __init__(
        self,
        addresses: str | list[str],
        layout: str,
        timeout_s: float = 2.0,
        *,
        tls: TLSConfig | None = None,
        token: str | None = None,
        backoff_s: float = 1.0,
        max_backoff_s: float = 30.0,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        max_blocks_per_call: int = DEFAULT_MAX_BLOCKS_PER_CALL,
    ) -> None:
        if message := layout_error(layout):
            raise ValueError(message)
        self.addresses = parse_addresses(addresses)
        self.layout, self.timeout_s = layout, timeout_s
        self.max_message_bytes, self.max_blocks_per_call = max_message_bytes, max_blocks_per_call
        self._metadata = (("authorization", f"Bearer {token}"),) if token else None
        options = [
            ("grpc.max_send_message_length", max_message_bytes),
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.initial_reconnect_backoff_ms", 250),
            ("grpc.min_reconnect_backoff_ms", 1000),  # also the connect timeout: room for a TLS handshake
            ("grpc.max_reconnect_backoff_ms", 2000),
        ]
        creds = tls.credentials() if tls else None
        self.replicas = [
            Replica(
                a,
                grpc.secure_channel(a, creds, options) if creds else grpc.insecure_channel(a, options),
                Backoff(backoff_s, max_backoff_s),
            )
            for a in self.addresses
        ]
        self._pool = ThreadPoolExecutor(max(2, 2 * len(self.replicas)), thread_name_prefix="cachestore-client")

    # -- the connector's API -------------------------------------------------------------------------------

    def lookup(self, hashes: Sequence[bytes]) -> int:
        """Length of the longest prefix of the chain `hashes` stored across the replicas (0 on any trouble)."""
        self._check_keys(hashes)
        return min([len(hashes), *self._fanout(hashes, self._lookup_shard)])

    def get(self, hashes: Sequence[bytes]) -> list[KVBlock]:
        """Blocks of the longest prefix of `hashes` that could be fetched and verified, in chain order."""
        self._check_keys(hashes)
        found: dict[int, KVBlock] = {}
        firsts = self._fanout(hashes, lambda r, items: self._get_shard(r, items, found))
        return [found[i] for i in range(min([len(hashes), *firsts]))]

    def put(self, blocks: Sequence[KVBlock]) -> int:
        """Store blocks on their owners; returns how many were newly stored. Safe from a background thread."""
        return self.put_blocks(blocks).stored

    def put_blocks(self, blocks: Sequence[KVBlock]) -> PutResult:
        """put(), also telling how many block bytes the store accepted (a replica down or backing off drops its
        blocks silently: the engine's stored-KV counters count only what arrived)."""
        for block in blocks:
            if message := block_error(block.key, block.data, block.dtype, tuple(block.shape), None):
                raise ValueError(message)
            if len(block.data) + _MESSAGE_SLACK > self.max_message_bytes:
                raise ValueError(f"a {len(block.data)}-byte block exceeds max_message_bytes={self.max_message_bytes}")
        by_pos = {i: b for i, b in enumerate(blocks)}
        shards = self._fanout([b.key for b in blocks], lambda r, items: self._put_shard(r, items, by_pos))
        return PutResult(sum(r.stored for r in shards), sum(r.accepted_bytes for r in shards))

    def delete(self, hashes: Sequence[bytes]) -> int:
        self._check_keys(hashes)
        return sum(self._fanout(hashes, self._delete_shard))

    def stats(self) -> dict[str, pb.StatsResponse | None]:
        """Each replica's Stats, None for a replica that did not answer."""
        return {r.address: r.call(None, r.stub.Stats, pb.StatsRequest(), **self._kw()) for r in self.replicas}

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        for replica in self.replicas:
            replica.channel.close()

    def __enter__(self) -> CacheStoreClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- per shard ------------------------------------------------------------------------------------------

    def _lookup_shard(self, replica: Replica, items: list[tuple[int, bytes]]) -> int:
        """Chain position of this shard's first missing block (len of chain if none is missing)."""
        for chunk in self._chunks(items):
            request = pb.LookupRequest(layout=self.layout, keys=[k for _, k in chunk])
            reply = replica.call(None, replica.stub.Lookup, request, **self._kw())
            n = reply.prefix_len if reply is not None else 0
            if n < len(chunk):
                return chunk[n][0]
        return _END

    def _get_shard(self, replica: Replica, items: list[tuple[int, bytes]], found: dict[int, KVBlock]) -> int:
        for chunk in self._chunks(items):
            request = pb.GetRequest(layout=self.layout, keys=[k for _, k in chunk])
            got = replica.call([], self._stream_get, replica, request, chunk)
            for (pos, _), block in zip(chunk, got, strict=False):
                found[pos] = block
            if len(got) < len(chunk):
                return chunk[len(got)][0]
        return _END

    def _stream_get(self, replica: Replica, request: pb.GetRequest, chunk: list[tuple[int, bytes]]) -> list[KVBlock]:
        """Verified blocks in order; an error after some blocks arrived keeps those blocks."""
        out: list[KVBlock] = []
        try:
            for message, (_, key) in zip(replica.stub.Get(request, **self._kw()), chunk, strict=False):
                data = message.data
                if message.key != key or checksum(data) != message.checksum:
                    log.warning("cachestore %s: block %s failed verification", replica.address, key.hex())
                    break
                out.append(KVBlock(key, data, message.dtype, tuple(message.shape)))
        except grpc.RpcError as exc:
            if not out:
                raise
            log.warning("cachestore %s Get: %s after %d blocks", replica.address, exc.code(), len(out))
            if exc.code() in _DOWN:
                replica.backoff.failed()
        return out

    def _put_shard(self, replica: Replica, items: list[tuple[int, bytes]], by_pos: dict[int, KVBlock]) -> PutResult:
        stored = accepted = 0
        for chunk in self._chunks(items):
            blocks = [by_pos[pos] for pos, _ in chunk]
            reply = replica.call(None, replica.stub.Put, self._put_requests(blocks), **self._kw())
            if reply is None:
                break
            stored, accepted = stored + reply.stored, accepted + sum(len(b.data) for b in blocks)
        return PutResult(stored, accepted)

    def _put_requests(self, blocks: list[KVBlock]) -> Iterator[pb.PutRequest]:
        """Messages of a few MiB: huge ones cost more to (de)serialize than they save in framing."""
        budget = min(self.max_message_bytes, PUT_MESSAGE_BYTES) - _MESSAGE_SLACK
        request, size = pb.PutRequest(layout=self.layout), 0
        for b in blocks:
            if request.blocks and size + len(b.data) > budget:
                yield request
                request, size = pb.PutRequest(layout=self.layout), 0
            request.blocks.add(key=b.key, data=b.data, dtype=b.dtype, shape=b.shape, checksum=checksum(b.data))
            size += len(b.data)
        if request.blocks:
            yield request

    def _delete_shard(self, replica: Replica, items: list[tuple[int, bytes]]) -> int:
        deleted = 0
        for chunk in self._chunks(items):
            request = pb.DeleteRequest(layout=self.layout, keys=[k for _, k in chunk])
            reply = replica.call(None, replica.stub.Delete, request, **self._kw())
            deleted += reply.deleted if reply is not None else 0
        return deleted

    # -- plumbing ---------------------------------------------------------------------------------------------

    def _fanout(self, keys: Sequence[bytes], fn: Callable[[Replica, list[tuple[int, bytes]]], _T]) -> list[_T]:
        """fn(replica, [(chain position, key), ...]) for every replica owning some of `keys`, in parallel."""
        shards: dict[int, list[tuple[int, bytes]]] = {}
        for pos, key in enumerate(keys):
            shards.setdefault(rendezvous_owner(key, self.addresses), []).append((pos, key))
        jobs = [(self.replicas[i], items) for i, items in shards.items()]
        if len(jobs) == 1:
            return [fn(*jobs[0])]
        return [f.result() for f in [self._pool.submit(contextvars.copy_context().run, fn, *job) for job in jobs]]

    def _chunks(self, items: list[tuple[int, bytes]]) -> list[list[tuple[int, bytes]]]:
        n = self.max_blocks_per_call
        return [items[i : i + n] for i in range(0, len(items), n)]

    def _kw(self) -> dict:
        return {"timeout": self.timeout_s, "metadata": tracing.grpc_metadata(self._metadata)}

    @staticmethod
    def _check_keys(hashes: Sequence[bytes]) -> None:
        for key in hashes:
            if message := key_error(key):
                raise ValueError(message)


_END = 2**62  # "no missing block in this shard"
