"""--external-engine wiring: the repeatable flag, the pool's external records, which engines the exact index
covers (a refused engine is routed on load only), and the routing key the router hashes their prompts with."""

from __future__ import annotations

import argparse

import pytest

from ragserve.external_engine import ExternalEngineSpec
from ragserve.keys import block_hashes, root_hash
from ragserve.router_args import RouterConfig, add_router_arguments
from ragserve_router.engines import EXTERNAL, GRPC, STATIC, EngineRecord
from ragserve_router.external import ExternalEngines, load_tokenizer
from ragserve_router.memory_state import MemoryState
from ragserve_router.metrics import RouterMetrics
from ragserve_router.pool import EnginePool
from ragserve_router.prompt import Tokenizers

A = "http://a:8000,events=tcp://a:5557,replay=tcp://a:5558"
B = "http://b:8000/,events=tcp://b:5557"


def parse(*argv: str) -> RouterConfig:
    parser = argparse.ArgumentParser()
    add_router_arguments(parser)
    return RouterConfig.from_args(parser.parse_args(list(argv)))


def test_external_engine_is_repeatable(model_dir) -> None:
    cfg = parse("--external-engine", A, "--external-engine", B, "--tokenizer", str(model_dir))
    assert cfg.external_engine == [ExternalEngineSpec.parse(A), ExternalEngineSpec("http://b:8000", "tcp://b:5557")]
    assert cfg.external_block_size == 16 and parse().external_engine == []


def test_external_engine_from_the_environment(monkeypatch, model_dir) -> None:
    monkeypatch.setenv("RAGSERVE_EXTERNAL_ENGINE", f"{A}; {B}")
    assert len(parse("--tokenizer", str(model_dir)).external_engine) == 2


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--external-engine", "http://a:1"], "events=tcp://HOST:PORT is required"),
        (["--external-engine", A], "--external-engine needs --tokenizer"),
        (["--external-engine", A, "--tokenizer", "/no/such/dir"], "no such file or directory"),
    ],
)
def test_bad_external_engine_flags(argv: list[str], message: str, capsys) -> None:
    with pytest.raises((SystemExit, ValueError, OSError)) as info:
        parse(*argv)
    assert message in (str(info.value) + capsys.readouterr().err)


def make_pool(model_dir) -> EnginePool:
    cfg = RouterConfig(external_engine=[ExternalEngineSpec.parse(A)], tokenizer=str(model_dir))
    external = ExternalEngines(cfg.external_engine, load_tokenizer(str(model_dir)), cfg.external_block_size)
    return EnginePool(cfg, MemoryState(), RouterMetrics(), external)


@pytest.mark.asyncio
async def test_pool_holds_external_engines_routed_from_their_index(model_dir) -> None:
    pool = make_pool(model_dir)
    (record,) = pool.all()
    assert (record.engine_id, record.url, record.source) == ("external-0", "http://a:8000", EXTERNAL)
    assert not pool.health["external-0"].healthy  # until its first probe answers, as a static engine
    assert not pool.exact_index(record)  # not followed yet
    assert pool.spec("tiny") is None  # no engine serves it yet
    record.models = ["tiny"]
    assert pool.spec("tiny") == pool.external.spec
    pool.external.start(pool.state)
    try:
        assert pool.exact_index(record)
        (follower,) = pool.external.followers["external-0"]
        follower.refused = "engine external-0 publishes blocks of 32 tokens ..."
        assert not pool.exact_index(record)  # refused: on load only
    finally:
        await pool.external.stop()
    assert pool.exact_index(EngineRecord("e", "http://e", [], GRPC))
    assert not pool.exact_index(EngineRecord("s", "http://s", [], STATIC))


@pytest.mark.asyncio
async def test_routing_key_of_an_external_model_is_the_indexers(model_dir) -> None:
    """The router hashes an external engine's prompt with --tokenizer, rooted where its follower keys events."""
    pool = make_pool(model_dir)
    pool.all()[0].models = ["tiny"]
    tokenizers = Tokenizers(pool.state)
    tokenizers.add(pool.external.spec.tokenizer_fingerprint, pool.external.tokenizer)
    body = {"model": "tiny", "prompt": "retrieved passage " * 20}
    key = await tokenizers.routing_key(pool.spec("tiny"), "tiny", body, chat=False)
    tokens = pool.external.tokenizer.encode(body["prompt"])
    assert key.exact and key.num_prompt_tokens == len(tokens)
    assert key.hashes == block_hashes(tokens, 16, root_hash(pool.external.spec.model_id))


def test_tokenizer_path_without_a_tokenizer_is_refused(tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match="not a directory with tokenizer.json or a .gguf file"):
        load_tokenizer(str(tmp_path))
