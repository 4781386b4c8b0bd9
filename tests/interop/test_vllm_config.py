"""--kv-events-config: vLLM's JSON parses to vLLM's defaults; bad input fails with a message naming the problem."""

import json

import pytest

from ragserve.vllm_events import KVEventsConfig, ZmqEventPublisher, offset_endpoint_port


def test_vllm_json_accepted() -> None:
    text = json.dumps(
        {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": "tcp://*:5557",
            "replay_endpoint": "tcp://*:5558",
            "buffer_steps": 500,
            "hwm": 1000,
            "max_queue_size": 2000,
            "topic": "kv-events",
        }
    )
    config = KVEventsConfig.from_json(text)
    assert config == KVEventsConfig(True, "zmq", "tcp://*:5557", "tcp://*:5558", 500, 1000, 2000, "kv-events")
    assert config.publishes


def test_defaults_are_vllms() -> None:
    # The llm-d / Dynamo docs' usual flag: only enable (publisher then defaults to zmq, as in vLLM).
    config = KVEventsConfig.from_json('{"enable_kv_cache_events": true, "topic": "kv-events"}')
    assert (config.publisher, config.endpoint, config.replay_endpoint) == ("zmq", "tcp://*:5557", None)
    assert (config.buffer_steps, config.hwm, config.max_queue_size) == (10_000, 100_000, 100_000)
    disabled = KVEventsConfig.from_json("{}")
    assert disabled.publisher == "null" and not disabled.publishes


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("{enable_kv_cache_events: true}", "not valid JSON"),
        ("[1, 2]", "must be a JSON object"),
        ('{"enable_kv_cache_events": true, "publisher": "kafka"}', "unknown publisher 'kafka'"),
        ('{"enable_kv_cache_events": true, "endpont": "tcp://*:1"}', r"unknown field\(s\) \['endpont'\]"),
        ('{"endpoint": "http://host:5557"}', "must start with one of"),
        ('{"endpoint": "tcp://host"}', "must be tcp://HOST:PORT"),
        ('{"replay_endpoint": "tcp://*:99999"}', "must be tcp://HOST:PORT"),
        ('{"buffer_steps": 0}', "buffer_steps must be positive"),
        ('{"hwm": "1000"}', "hwm must be int"),
        ('{"max_queue_size": true}', "max_queue_size must be int"),
        ('{"enable_kv_cache_events": "yes"}', "enable_kv_cache_events must be bool"),
        ('{"topic": 5}', "topic must be str"),
    ],
)
def test_bad_config(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        KVEventsConfig.from_json(text)


def test_data_parallel_rank_offsets_ports() -> None:
    assert offset_endpoint_port("tcp://*:5557", 0) == "tcp://*:5557"
    assert offset_endpoint_port("tcp://*:5557", 3) == "tcp://*:5560"
    assert offset_endpoint_port("tcp://[::1]:5557", 1) == "tcp://[::1]:5558"
    assert offset_endpoint_port("inproc://cache", 2) == "inproc://cache_dp2"
    assert offset_endpoint_port(None, 2) is None
    with pytest.raises(ValueError, match="tcp or inproc"):
        offset_endpoint_port("ipc:///tmp/kv", 1)
    config = KVEventsConfig(True, endpoint="tcp://*:5557", replay_endpoint="tcp://*:6557")
    assert config.endpoints_for_rank(2) == ("tcp://*:5559", "tcp://*:6559")


def test_publisher_needs_an_enabled_zmq_config() -> None:
    with pytest.raises(ValueError, match="does not enable the zmq publisher"):
        ZmqEventPublisher.from_config(KVEventsConfig(enable_kv_cache_events=True, publisher="null"))
