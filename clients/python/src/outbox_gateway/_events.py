"""What travels through the client: `Event` (an event to publish, checked when it is
made), `ReceivedEvent` and `Delivery` (what a handler is given), and their conversions
to and from the generated protobuf messages."""

from __future__ import annotations

import json
import os
import re
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, Union

from google.protobuf.timestamp_pb2 import Timestamp

from ._proto.outbox.v1 import outbox_pb2 as pb
from .errors import InvalidArgumentError

__all__ = ["Delivery", "Event", "Payload", "ReceivedEvent"]

#: What an event's payload may be: raw bytes, text, or a JSON document as dict or list.
Payload = Union[bytes, bytearray, memoryview, str, dict, list]

JSON_CONTENT_TYPE = "application/json"
MAX_IDENTIFIER_BYTES = 255
_EVENT_TYPE = re.compile(r"^[A-Za-z0-9_-]+(\.[A-Za-z0-9_-]+)*$")
_UUID = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$")
_JSON_MEDIA_TYPE = re.compile(r"^application/([a-z0-9!#$&^_.+-]+\+)?json$")


def is_json(content_type: str) -> bool:
    """Whether the gateway counts `content_type` as JSON: application/json or
    application/*+json, parameters allowed (empty means the default, JSON)."""
    media_type = content_type.split(";", 1)[0].strip().lower()
    return not media_type or bool(_JSON_MEDIA_TYPE.match(media_type))


@dataclass(frozen=True)
class Event:
    """An event to publish. Checked when made: bad input raises
    :class:`~outbox_gateway.InvalidArgumentError` naming the field, before any call.

    Args:
        aggregate_type: kind of entity the event is about, e.g. ``"order"`` (1 to 255 bytes).
        aggregate_id: identity of that entity, e.g. ``"ord-42"`` (1 to 255 bytes).
        event_type: dot-separated segments of ``[A-Za-z0-9_-]``, e.g. ``"order.created"``.
        payload: ``bytes`` or ``str`` sent as they are, or a ``dict`` or ``list`` sent as JSON.
        metadata: string attributes for filtering and tracing.
        id: the idempotency key, a UUID; one (UUIDv7) is generated when the event is
            published without one, and kept across retries.
        content_type: MIME type of the payload; the gateway's default is
            ``application/json``, which requires the payload to be JSON.
        aggregate_version: version of the aggregate after this event (at least 1).
        occurred_at: when the change happened (default: the time of the publish).
        deliver_at: deliver to no subscription before this time.
        expires_at: deliver to no subscription from this time on.
    """

    aggregate_type: str
    aggregate_id: str
    event_type: str
    payload: Payload
    metadata: Mapping[str, str] | None = None
    id: str | uuid.UUID | None = None
    content_type: str | None = None
    aggregate_version: int | None = None
    occurred_at: datetime | None = None
    deliver_at: datetime | None = None
    expires_at: datetime | None = None
    _data: bytes = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name in ("aggregate_type", "aggregate_id"):
            _identifier(name, getattr(self, name))
        _event_type(self.event_type)
        object.__setattr__(self, "_data", _encode_payload(self.payload))
        if self.metadata is not None:
            _metadata(self.metadata)
        if isinstance(self.id, uuid.UUID):
            object.__setattr__(self, "id", str(self.id))
        elif self.id is not None and (not isinstance(self.id, str) or not _UUID.match(self.id)):
            raise InvalidArgumentError(
                "id", f"must be a UUID in canonical lowercase form, got {self.id!r}"
            )
        if self.content_type is not None and (
            not isinstance(self.content_type, str) or not self.content_type
        ):
            raise InvalidArgumentError("content_type", "must be a non-empty string")
        if self.aggregate_version is not None and (
            not isinstance(self.aggregate_version, int)
            or isinstance(self.aggregate_version, bool)
            or self.aggregate_version < 1
        ):
            raise InvalidArgumentError(
                "aggregate_version", f"must be an integer of at least 1, got {self.aggregate_version!r}"
            )
        for name in ("occurred_at", "deliver_at", "expires_at"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, datetime) or value.utcoffset() is None):
                raise InvalidArgumentError(name, f"must be a timezone-aware datetime, got {value!r}")

    def _to_proto(self, event_id: str) -> pb.EventInput:
        message = pb.EventInput(
            id=event_id,
            aggregate_type=self.aggregate_type,
            aggregate_id=self.aggregate_id,
            event_type=self.event_type,
            payload=self._data,
            content_type=self.content_type
            or (JSON_CONTENT_TYPE if isinstance(self.payload, (dict, list)) else ""),
            metadata=dict(self.metadata or {}),
        )
        if self.aggregate_version is not None:
            message.aggregate_version = self.aggregate_version
        for name in ("occurred_at", "deliver_at", "expires_at"):
            value = getattr(self, name)
            if value is not None:
                getattr(message, name).CopyFrom(_timestamp(value))
        return message


def _identifier(name: str, value: object) -> None:
    if not isinstance(value, str):
        raise InvalidArgumentError(name, f"must be a string, got {type(value).__name__}")
    if not value:
        raise InvalidArgumentError(name, "must not be empty")
    if len(value.encode()) > MAX_IDENTIFIER_BYTES:
        raise InvalidArgumentError(name, f"must be at most {MAX_IDENTIFIER_BYTES} bytes")


def _event_type(value: object) -> None:
    _identifier("event_type", value)
    assert isinstance(value, str)
    if not _EVENT_TYPE.match(value):
        raise InvalidArgumentError(
            "event_type", f"{value!r} must be dot-separated segments of [A-Za-z0-9_-]"
        )


def _encode_payload(payload: object) -> bytes:
    if isinstance(payload, (bytes, bytearray, memoryview)):
        return bytes(payload)
    if isinstance(payload, str):
        return payload.encode()
    if isinstance(payload, (dict, list)):
        try:
            return json.dumps(payload, separators=(",", ":"), ensure_ascii=False).encode()
        except (TypeError, ValueError) as error:
            raise InvalidArgumentError("payload", f"cannot be encoded as JSON: {error}") from None
    raise InvalidArgumentError(
        "payload", f"must be bytes, str, dict or list, got {type(payload).__name__}"
    )


def _metadata(metadata: object) -> None:
    if not isinstance(metadata, Mapping):
        raise InvalidArgumentError("metadata", f"must be a mapping, got {type(metadata).__name__}")
    for key, value in metadata.items():
        if not isinstance(key, str) or not key:
            raise InvalidArgumentError("metadata", f"keys must be non-empty strings, got {key!r}")
        if not isinstance(value, str):
            raise InvalidArgumentError(
                f"metadata[{key!r}]", f"must be a string, got {type(value).__name__}"
            )


def _timestamp(value: datetime) -> Timestamp:
    timestamp = Timestamp()
    timestamp.FromDatetime(value.astimezone(timezone.utc))
    return timestamp


def uuid7() -> str:
    """A new UUIDv7: time-ordered, so the events of a batch sort as they were made."""
    milliseconds = time.time_ns() // 1_000_000
    value = (milliseconds & ((1 << 48) - 1)) << 80 | int.from_bytes(os.urandom(10), "big")
    value = (value & ~(0xF << 76)) | (0x7 << 76)  # version 7
    value = (value & ~(0x3 << 62)) | (0x2 << 62)  # RFC 4122 variant
    return str(uuid.UUID(int=value))


@dataclass(frozen=True)
class ReceivedEvent:
    """A stored event as a subscriber receives it.

    ``payload`` is the parsed JSON document when the content type is JSON (and parses),
    else the raw bytes; ``data`` always holds the raw bytes.
    """

    id: str
    aggregate_type: str
    aggregate_id: str
    event_type: str
    payload: Any
    data: bytes
    content_type: str
    metadata: dict[str, str]
    aggregate_version: int | None
    occurred_at: datetime | None
    created_at: datetime | None
    deliver_at: datetime | None
    expires_at: datetime | None
    source: str
    transaction_id: int

    @classmethod
    def _from_proto(cls, event: pb.Event) -> ReceivedEvent:
        payload: Any = event.payload
        if is_json(event.content_type):
            try:
                payload = json.loads(event.payload)
            except ValueError:
                payload = event.payload

        def time_of(name: str) -> datetime | None:
            if not event.HasField(name):
                return None
            return getattr(event, name).ToDatetime(tzinfo=timezone.utc)

        return cls(
            id=event.id,
            aggregate_type=event.aggregate_type,
            aggregate_id=event.aggregate_id,
            event_type=event.event_type,
            payload=payload,
            data=event.payload,
            content_type=event.content_type,
            metadata=dict(event.metadata),
            aggregate_version=event.aggregate_version if event.HasField("aggregate_version") else None,
            occurred_at=time_of("occurred_at"),
            created_at=time_of("created_at"),
            deliver_at=time_of("deliver_at"),
            expires_at=time_of("expires_at"),
            source=event.source,
            transaction_id=event.transaction_id,
        )


@dataclass(frozen=True)
class Delivery:
    """One lease of an event to this subscriber.

    Attributes:
        event: the event delivered.
        attempt: 1 for the first delivery of the event to the subscription, then 2, 3, ...
        ack_id: the token naming this lease (the subscriber acks, nacks and extends it).
        ack_deadline: when the lease ends unless settled or extended; the subscriber
            extends it while the handler runs.
        subscription: the subscription it came from.
    """

    event: ReceivedEvent
    attempt: int
    ack_id: str
    ack_deadline: datetime | None
    subscription: str

    @classmethod
    def _from_proto(cls, delivery: pb.Delivery, subscription: str) -> Delivery:
        return cls(
            event=ReceivedEvent._from_proto(delivery.event),
            attempt=delivery.attempt,
            ack_id=delivery.ack_id,
            ack_deadline=delivery.ack_deadline.ToDatetime(tzinfo=timezone.utc)
            if delivery.HasField("ack_deadline")
            else None,
            subscription=subscription,
        )
