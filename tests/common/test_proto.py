"""The committed gRPC stubs must equal what the .proto sources generate."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_stubs_match_proto_sources(tmp_path):
    env = dict(os.environ, PYTHON=sys.executable)
    subprocess.run([str(ROOT / "scripts" / "gen_proto.sh"), str(tmp_path)], check=True, env=env)
    generated = sorted(p.name for p in (tmp_path / "ragserve" / "v1").iterdir())
    assert generated, "protoc generated nothing"
    for name in generated:
        fresh = (tmp_path / "ragserve" / "v1" / name).read_text()
        committed = ROOT / "ragserve" / "v1" / name
        assert committed.is_file(), f"{name} is not committed; run `make proto`"
        assert committed.read_text() == fresh, f"{name} drifted from proto/; run `make proto`"


def test_stubs_import_and_roundtrip():
    from ragserve.v1 import cachestore_pb2, registry_pb2

    block = cachestore_pb2.Block(key=b"k" * 32, data=b"\x00\x01", dtype="float16", shape=[1, 1], checksum=7)
    assert cachestore_pb2.Block.FromString(block.SerializeToString()) == block
    event = registry_pb2.KVEvent(seq=3, stored=registry_pb2.BlocksStored(block_hashes=[b"a" * 32]))
    assert registry_pb2.KVEvent.FromString(event.SerializeToString()).WhichOneof("event") == "stored"
