"""The package itself: its version follows the gateway's, its generated stubs match the
proto, it ships its type information, and bad input is refused before any call."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import re
import threading
from datetime import datetime
from pathlib import Path

import grpc
import pytest

import outbox_gateway
from outbox_gateway import (
    AsyncPublisher,
    AsyncSubscriber,
    Event,
    InvalidArgumentError,
    Publisher,
    RefusedError,
    Subscriber,
)

CLIENT = Path(__file__).resolve().parent.parent
REPOSITORY = CLIENT.parent.parent
# Nothing listens here: a call that was made would fail as UNAVAILABLE, not as invalid input.
NOWHERE = "http://127.0.0.1:1"


def workspace_version() -> str:
    text = (REPOSITORY / "Cargo.toml").read_text()
    section = text.split("[workspace.package]", 1)[1]
    match = re.search(r'^version\s*=\s*"([^"]+)"', section, re.MULTILINE)
    assert match, "no version in [workspace.package] of Cargo.toml"
    return match.group(1)


def test_version_follows_the_gateway():
    version = workspace_version()
    assert outbox_gateway.__version__ == version
    assert importlib.metadata.version("outbox-gateway-client") == version


def test_generated_stubs_match_the_proto():
    spec = importlib.util.spec_from_file_location("generate", CLIENT / "generate.py")
    assert spec and spec.loader
    generate = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(generate)
    assert generate.stale() == [], (
        "the stubs in src/outbox_gateway/_proto are stale: run `python clients/python/generate.py`"
    )


def test_type_information_ships_with_the_package():
    package = Path(outbox_gateway.__file__).parent
    assert (package / "py.typed").exists()
    assert (package / "_proto" / "outbox" / "v1" / "outbox_pb2.pyi").exists()


def test_the_runtime_depends_only_on_grpcio_and_protobuf():
    requirements = importlib.metadata.requires("outbox-gateway-client") or []
    required = sorted(
        re.split(r"[<>=!~ ;\[]", requirement, maxsplit=1)[0]
        for requirement in requirements
        if "extra ==" not in requirement
    )
    assert required == ["grpcio", "protobuf"]


@pytest.mark.parametrize(
    ("arguments", "field"),
    [
        ({"aggregate_id": ""}, "aggregate_id"),
        ({"aggregate_type": ""}, "aggregate_type"),
        ({"aggregate_id": 42}, "aggregate_id"),
        ({"aggregate_id": "x" * 256}, "aggregate_id"),
        ({"event_type": ""}, "event_type"),
        ({"event_type": "order created"}, "event_type"),
        ({"payload": 42}, "payload"),
        ({"payload": None}, "payload"),
        ({"payload": {1, 2}}, "payload"),
        ({"payload": {"when": datetime(2024, 1, 1)}}, "payload"),
        ({"metadata": {"source": 1}}, "metadata['source']"),
        ({"metadata": ["source"]}, "metadata"),
        ({"id": "not-a-uuid"}, "id"),
        ({"aggregate_version": 0}, "aggregate_version"),
        ({"content_type": ""}, "content_type"),
        ({"occurred_at": datetime(2024, 1, 1)}, "occurred_at"),
    ],
)
def test_a_bad_event_is_refused_when_made_naming_the_field(arguments, field):
    event = {"aggregate_type": "order", "aggregate_id": "o-1", "event_type": "order.created", "payload": {}}
    with pytest.raises(InvalidArgumentError) as refused:
        Event(**{**event, **arguments})
    assert refused.value.field == field
    assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert str(refused.value).startswith(f"{field}: ")


def test_payloads_of_every_accepted_kind():
    for payload in (b"\x00raw", bytearray(b"raw"), memoryview(b"raw"), "text", {"a": 1}, [1, 2]):
        Event("order", "o-1", "order.created", payload)


@pytest.mark.parametrize(
    ("events", "field"),
    [([], "events"), (["not an event"], "events[0]"), (None, "events"), ("order", "events")],
)
def test_a_bad_batch_is_refused_before_any_call(events, field):
    with Publisher(NOWHERE, max_attempts=1) as publisher:
        with pytest.raises(InvalidArgumentError) as refused:
            publisher.publish(events)
    assert refused.value.field == field


def test_bad_connection_settings_are_refused_at_once():
    for arguments, field in (
        ({"endpoint": ""}, "endpoint"),
        ({"endpoint": "http://host:1/path"}, "endpoint"),
        ({"endpoint": NOWHERE, "token": ""}, "token"),
        ({"endpoint": NOWHERE, "token": "new\nline"}, "token"),
        ({"endpoint": NOWHERE, "tls": "yes"}, "tls"),
        ({"endpoint": NOWHERE, "max_attempts": 0}, "max_attempts"),
    ):
        with pytest.raises(InvalidArgumentError) as refused:
            Publisher(**arguments)
        assert refused.value.field == field, arguments


def test_bad_subscriber_arguments_are_refused_before_any_call():
    for arguments, field in (
        ({"subscription": ""}, "subscription"),
        ({"subscription": "s", "max_in_flight": 0}, "max_in_flight"),
        ({"subscription": "s", "max_in_flight": True}, "max_in_flight"),
    ):
        with pytest.raises(InvalidArgumentError) as refused:
            Subscriber(NOWHERE, **arguments)
        assert refused.value.field == field
    subscriber = Subscriber(NOWHERE, "s")
    stop = threading.Event()
    for call, field in (
        (lambda: subscriber.run("not callable", stop=stop), "handler"),
        (lambda: subscriber.run(lambda delivery: None, concurrency=0, stop=stop), "concurrency"),
        (lambda: subscriber.run(lambda delivery: None, stop="soon"), "stop"),
        (lambda: subscriber.run_exactly_once(None, lambda d, c: None, stop=stop), "connect"),
    ):
        with pytest.raises(InvalidArgumentError) as refused:
            call()
        assert refused.value.field == field

    async def handler(delivery):
        pass

    with pytest.raises(InvalidArgumentError, match="AsyncSubscriber") as refused:
        subscriber.run(handler, stop=stop)
    assert refused.value.field == "handler"


def test_async_forms_refuse_bad_input_before_any_call():
    import asyncio

    async def scenario():
        publisher = AsyncPublisher(NOWHERE, max_attempts=1)
        with pytest.raises(InvalidArgumentError) as refused:
            await publisher.publish([])
        assert refused.value.field == "events"
        await publisher.close()
        with pytest.raises(InvalidArgumentError) as refused:
            AsyncSubscriber(NOWHERE, "")
        assert refused.value.field == "subscription"
        with pytest.raises(InvalidArgumentError) as refused:
            await AsyncSubscriber(NOWHERE, "s").run(lambda d: None, concurrency=-1)
        assert refused.value.field == "concurrency"

    asyncio.run(scenario())


def test_the_gateways_refusal_carries_the_code_and_the_field(gateway):
    events = [
        Event("order", "o-1", "order.created", {"total": 1}),
        # No content type: the gateway's default, JSON, which this is not.
        Event("order", "o-1", "order.paid", "not json"),
    ]
    with Publisher(gateway.endpoint) as publisher:
        with pytest.raises(RefusedError) as refused:
            publisher.publish(events)
    assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert refused.value.field == "events[1].payload"


def test_an_unknown_subscription_is_refused_not_retried(gateway):
    subscriber = Subscriber(gateway.endpoint, "no-such-subscription")
    with pytest.raises(RefusedError) as refused:
        subscriber.run(lambda delivery: None, stop=threading.Event())
    assert refused.value.code == grpc.StatusCode.NOT_FOUND

