"""The ragserve.v1.CacheStore gRPC service: request validation and limits in front of a TieredStore."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

import grpc

from ragserve import tracing
from ragserve.cachestore_args import DEFAULT_MAX_BLOCKS_PER_CALL
from ragserve.keys import store_key
from ragserve.v1 import cachestore_pb2 as pb
from ragserve.v1 import cachestore_pb2_grpc as pb_grpc
from ragserve_cachestore.record import StoredBlock, block_error, key_error, layout_error
from ragserve_cachestore.store import TieredStore


@dataclass(frozen=True)
class Limits:
    max_blocks_per_call: int = DEFAULT_MAX_BLOCKS_PER_CALL


class CacheStoreServicer(pb_grpc.CacheStoreServicer):
    def __init__(self, store: TieredStore, limits: Limits | None = None) -> None:
        self.store = store
        self.limits = limits or Limits()

    def Lookup(self, request: pb.LookupRequest, context: grpc.ServicerContext) -> pb.LookupResponse:
        with _span("cachestore.lookup", context, len(request.keys)) as span:
            tiers = self.store.lookup(self._store_keys(request.layout, request.keys, context))
            if span is not None:
                span.set_attribute("ragserve.prefix_blocks", len(tiers))
        return pb.LookupResponse(prefix_len=len(tiers), tiers=tiers)

    def Get(self, request: pb.GetRequest, context: grpc.ServicerContext) -> Iterator[pb.Block]:
        with _span("cachestore.get", context, len(request.keys)):
            yield from self._get(request, context)

    def _get(self, request: pb.GetRequest, context: grpc.ServicerContext) -> Iterator[pb.Block]:
        keys = list(request.keys)
        served = []
        for key, skey in zip(keys, self._store_keys(request.layout, keys, context), strict=True):
            found = self.store.get(skey)
            if found is None:
                break
            block, _ = found
            served.append(skey)
            yield pb.Block(key=key, data=block.data, dtype=block.dtype, shape=block.shape, checksum=block.checksum)
        self.store.touch_chain(served)

    def Put(self, request_iterator: Iterable[pb.PutRequest], context: grpc.ServicerContext) -> pb.PutResponse:
        with _span("cachestore.put", context) as span:
            response = self._put(request_iterator, context)
            if span is not None:
                span.set_attributes({"ragserve.stored_blocks": response.stored, "ragserve.skipped": response.skipped})
        return response

    def _put(self, request_iterator: Iterable[pb.PutRequest], context: grpc.ServicerContext) -> pb.PutResponse:
        stored = skipped = seen = 0
        chain: list[bytes] = []
        for request in request_iterator:
            self._check_layout(request.layout, context)
            seen += len(request.blocks)
            self._check_count(seen, context)
            blocks = self._blocks(request, seen - len(request.blocks), context)
            for key, block in blocks:
                if self.store.put(key, block):
                    stored += 1
                else:
                    skipped += 1
            chain += [key for key, _ in blocks]
        self.store.touch_chain(chain)
        return pb.PutResponse(stored=stored, skipped=skipped)

    def Delete(self, request: pb.DeleteRequest, context: grpc.ServicerContext) -> pb.DeleteResponse:
        keys = self._store_keys(request.layout, request.keys, context)
        return pb.DeleteResponse(deleted=sum(self.store.delete(k) for k in keys))

    def Stats(self, request: pb.StatsRequest, context: grpc.ServicerContext) -> pb.StatsResponse:
        snap = self.store.snapshot()
        c = snap.counters
        tiers = [
            pb.TierStats(
                tier=t.kind, used_bytes=t.used, capacity_bytes=t.capacity, blocks=t.blocks, hits=t.counters.hits
            )
            for t in snap.tiers
        ]
        return pb.StatsResponse(
            tiers=tiers,
            lookups=c.lookups,
            hits=c.hits,
            misses=c.misses,
            corrupt=sum(t.counters.corrupt for t in snap.tiers),
            puts=c.puts,
            evictions=c.dropped,
        )

    def _blocks(self, request: pb.PutRequest, offset: int, context: grpc.ServicerContext) -> list:
        """Validate every block of one PutRequest before storing any of them."""
        out = []
        for i, b in enumerate(request.blocks):
            key, data, shape = b.key, b.data, tuple(b.shape)
            if message := block_error(key, data, b.dtype, shape, b.checksum):
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"block {offset + i}: {message}")
            out.append((store_key(request.layout, key), StoredBlock(data, b.dtype, shape, b.checksum)))
        return out

    def _store_keys(self, layout: str, keys: Sequence[bytes], context: grpc.ServicerContext) -> list[bytes]:
        self._check_layout(layout, context)
        self._check_count(len(keys), context)
        for i, key in enumerate(keys):
            if message := key_error(key):
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"key {i}: {message}")
        return [store_key(layout, key) for key in keys]

    def _check_layout(self, layout: str, context: grpc.ServicerContext) -> None:
        if message := layout_error(layout):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, message)

    def _check_count(self, count: int, context: grpc.ServicerContext) -> None:
        if count > self.limits.max_blocks_per_call:
            context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{count} blocks in one call exceeds the limit of {self.limits.max_blocks_per_call}; split the call",
            )


def _span(name: str, context: grpc.ServicerContext, num_keys: int | None = None):
    """The call's span, a child of the caller's `traceparent` metadata (a no-op with tracing off)."""
    if not tracing.enabled():
        return tracing.span(name)
    attributes = {"ragserve.keys": num_keys} if num_keys is not None else None
    return tracing.span(name, tracing.extract(context.invocation_metadata()), attributes)
