"""What the sync and asyncio subscribers share: the leases they hold and when each is
due for an extension, how a handler's outcome becomes a nack, and argument checks."""

from __future__ import annotations

import inspect
import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone

from google.protobuf.duration_pb2 import Duration

from ._events import Delivery
from ._proto.outbox.v1 import outbox_pb2 as pb
from .errors import DeadLetter, InvalidArgumentError, RetryLater

logger = logging.getLogger("outbox_gateway")

ACK_BATCH = 500
ACK_FLUSH_INTERVAL = 0.01
MAX_REASON_BYTES = 4096
DEFAULT_LEASE = 30.0
MAX_LEASE = 12 * 3600.0
# SQLSTATE of outbox_consume refusing its arguments (an ack id of a deleted
# subscription, say): retrying cannot pass.
INVALID_PARAMETER_VALUE = "22023"


class Leases:
    """The unsettled deliveries this subscriber holds, each extended at half its lease
    for as long as it is held: while its handler runs, and while it waits for a free
    handler (so that a delivery is never redelivered only because the handlers were
    busy)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        # ack id -> [lease length in seconds, monotonic time of the next extension]
        self._held: dict[str, list[float]] = {}

    def add(self, delivery: Delivery) -> None:
        lease = DEFAULT_LEASE
        if delivery.ack_deadline is not None:
            left = (delivery.ack_deadline - datetime.now(timezone.utc)).total_seconds()
            lease = min(max(1.0, math.ceil(left)), MAX_LEASE)
        with self._lock:
            self._held[delivery.ack_id] = [lease, time.monotonic() + lease / 2]

    def remove(self, ack_id: str) -> None:
        with self._lock:
            self._held.pop(ack_id, None)

    def __len__(self) -> int:
        with self._lock:
            return len(self._held)

    def due(self) -> dict[float, list[str]]:
        """The leases to extend now, by lease length; each is next due half a lease on."""
        now = time.monotonic()
        due: dict[float, list[str]] = {}
        with self._lock:
            for ack_id, entry in self._held.items():
                if entry[1] <= now:
                    due.setdefault(entry[0], []).append(ack_id)
                    entry[1] = now + entry[0] / 2
        return due

    def wait_time(self, ceiling: float = 1.0) -> float:
        """Seconds until the next extension is due (at most `ceiling`)."""
        with self._lock:
            if not self._held:
                return ceiling
            soonest = min(entry[1] for entry in self._held.values())
        return min(max(0.0, soonest - time.monotonic()), ceiling)


def extend_request(subscription: str, lease: float, ack_ids: list[str]) -> pb.ExtendAckDeadlineRequest:
    extension = Duration()
    extension.FromTimedelta(timedelta(seconds=lease))
    return pb.ExtendAckDeadlineRequest(subscription=subscription, ack_ids=ack_ids, extension=extension)


def reason_of(error: BaseException) -> str:
    """The reason recorded with the nack: the exception's type and message."""
    text = str(error)
    reason = f"{type(error).__name__}: {text}" if text else type(error).__name__
    encoded = reason.encode()
    if len(encoded) > MAX_REASON_BYTES:
        reason = encoded[: MAX_REASON_BYTES - 3].decode(errors="ignore") + "..."
    return reason


def nack_request(subscription: str, delivery: Delivery, error: BaseException) -> pb.NackRequest:
    """A nack for a handler that raised `error`: :class:`RetryLater` sets the delay,
    :class:`DeadLetter` (or a refusal of outbox_consume) dead-letters at once, anything
    else is retried after the subscription's backoff."""
    request = pb.NackRequest(subscription=subscription, ack_id=delivery.ack_id)
    if isinstance(error, RetryLater):
        request.reason = error.reason[:MAX_REASON_BYTES]
        request.retry_after.FromTimedelta(timedelta(seconds=max(0.0, error.after)))
    elif isinstance(error, DeadLetter):
        request.reason = error.reason[:MAX_REASON_BYTES]
        request.dead_letter = True
    else:
        request.reason = reason_of(error)
        request.dead_letter = getattr(error, "sqlstate", None) == INVALID_PARAMETER_VALUE
    return request


def log_failure(delivery: Delivery, error: BaseException) -> None:
    if isinstance(error, (RetryLater, DeadLetter)):
        logger.info(
            "event %s (attempt %d) %s: %s",
            delivery.event.id,
            delivery.attempt,
            "retried later" if isinstance(error, RetryLater) else "dead-lettered",
            error,
        )
    else:
        logger.warning(
            "handler failed for event %s (attempt %d); nacking",
            delivery.event.id,
            delivery.attempt,
            exc_info=error,
        )


@dataclass(frozen=True)
class Settings:
    subscription: str
    max_in_flight: int
    max_in_flight_bytes: int


def check_settings(subscription: object, max_in_flight: object, max_in_flight_bytes: object) -> Settings:
    if not isinstance(subscription, str) or not subscription:
        raise InvalidArgumentError("subscription", "must be a non-empty string")
    for name, value, low in (("max_in_flight", max_in_flight, 1), ("max_in_flight_bytes", max_in_flight_bytes, 0)):
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            raise InvalidArgumentError(name, f"must be an integer of at least {low}, got {value!r}")
    assert isinstance(max_in_flight, int) and isinstance(max_in_flight_bytes, int)
    return Settings(subscription, max_in_flight, max_in_flight_bytes)


def check_handler(name: str, handler: object, *, asynchronous: bool) -> Callable:
    if not callable(handler):
        raise InvalidArgumentError(name, f"must be callable, got {type(handler).__name__}")
    if not asynchronous and (
        inspect.iscoroutinefunction(handler)
        or inspect.iscoroutinefunction(getattr(handler, "__call__", None))
    ):
        raise InvalidArgumentError(name, "is a coroutine function: use AsyncSubscriber")
    return handler


def check_concurrency(concurrency: object) -> int:
    if not isinstance(concurrency, int) or isinstance(concurrency, bool) or concurrency < 1:
        raise InvalidArgumentError("concurrency", f"must be an integer of at least 1, got {concurrency!r}")
    return concurrency


def subscribe_request(settings: Settings) -> pb.SubscribeRequest:
    return pb.SubscribeRequest(
        subscription=settings.subscription,
        max_in_flight=settings.max_in_flight,
        max_in_flight_bytes=settings.max_in_flight_bytes,
    )


def needs_rollback(connection: object) -> bool:
    """Whether a psycopg connection is inside a transaction (left over by someone else):
    the consuming transaction must be a transaction of its own, not a savepoint."""
    status = getattr(getattr(connection, "info", None), "transaction_status", None)
    return getattr(status, "name", "") in ("INTRANS", "INERROR")


def is_broken(connection: object) -> bool:
    return bool(getattr(connection, "closed", False) or getattr(connection, "broken", False))
