"""`Publisher` and `AsyncPublisher`: idempotent, retried publishing of event batches."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable, Sequence
from typing import Any

import grpc
import grpc.aio

from ._channel import Backoff, TlsOption, is_transient, target
from ._events import Event, uuid7
from ._proto.outbox.v1 import outbox_pb2 as pb
from ._proto.outbox.v1 import outbox_pb2_grpc as rpc
from .errors import InvalidArgumentError, RefusedError, UnavailableError

__all__ = ["AsyncPublisher", "Publisher"]

logger = logging.getLogger("outbox_gateway")


def _request(events: Event | Iterable[Event], source: str | None) -> pb.PublishRequest:
    """Checks the batch and gives every event its id, so that a retried call re-sends
    the same ids and the gateway stores each event once."""
    if isinstance(events, Event):
        events = [events]
    if isinstance(events, (str, bytes, dict)) or not isinstance(events, Iterable):
        raise InvalidArgumentError("events", f"must be an Event or a list of them, got {type(events).__name__}")
    batch = list(events)
    if not batch:
        raise InvalidArgumentError("events", "must hold at least one event")
    inputs = []
    for index, event in enumerate(batch):
        if not isinstance(event, Event):
            raise InvalidArgumentError(f"events[{index}]", f"must be an Event, got {type(event).__name__}")
        inputs.append(event._to_proto(str(event.id) if event.id else uuid7()))
    if source is not None and not isinstance(source, str):
        raise InvalidArgumentError("source", f"must be a string, got {type(source).__name__}")
    return pb.PublishRequest(events=inputs, source=source or "")


def _check_attempts(max_attempts: int) -> int:
    if not isinstance(max_attempts, int) or isinstance(max_attempts, bool) or max_attempts < 1:
        raise InvalidArgumentError("max_attempts", f"must be an integer of at least 1, got {max_attempts!r}")
    return max_attempts


class Publisher:
    """Publishes events to the gateway over one channel; thread-safe.

    Each ``publish`` is retried with backoff while the gateway is unavailable (up to
    ``max_attempts`` tries); a retry re-sends the same event ids, so each event is
    stored once. Use it as a context manager, or call :meth:`close`::

        with Publisher("http://127.0.0.1:50051") as publisher:
            ids = publisher.publish([Event("order", "o-42", "order.created", {"total": 42})])

    Args:
        endpoint: ``host:port``, ``http://host:port`` or ``https://host:port`` (TLS).
        token: a bearer token, sent with every call.
        tls: ``True`` for TLS with the system's roots, a :class:`Tls` or
            ``grpc.ChannelCredentials``; default: TLS for ``https://`` endpoints only.
        max_attempts: tries of a call while the gateway is unavailable (default 5).
        timeout: seconds each try may take (default 30).
        options: extra gRPC channel options.
    """

    def __init__(
        self,
        endpoint: str,
        token: str | None = None,
        tls: TlsOption = None,
        *,
        max_attempts: int = 5,
        timeout: float = 30.0,
        options: Sequence[tuple[str, Any]] | None = None,
    ):
        self._target = target(endpoint, token, tls, options)
        self._max_attempts = _check_attempts(max_attempts)
        self._timeout = timeout
        self._channel = self._target.channel()
        self._stub = rpc.PublisherStub(self._channel)

    def publish(self, events: Event | Iterable[Event], *, source: str | None = None) -> list[str]:
        """Publishes the batch atomically (every event is stored, or none) and returns
        the event ids in order. An event already stored with the same id and content
        counts as published.

        Raises:
            InvalidArgumentError: bad input, before any call.
            RefusedError: the gateway refused the batch (``code``, ``field``).
            UnavailableError: the gateway stayed unreachable for every try.
        """
        request = _request(events, source)
        backoff = Backoff()
        for attempt in range(1, self._max_attempts + 1):
            try:
                response = self._stub.Publish(
                    request, timeout=self._timeout, metadata=self._target.metadata
                )
                return [result.id for result in response.results]
            except grpc.RpcError as error:
                if not is_transient(error):
                    raise RefusedError.from_rpc(error) from None
                if attempt == self._max_attempts:
                    raise UnavailableError.from_rpc(error) from None
                delay = backoff.next_delay()
                logger.debug("publish failed (%s), try %d in %.1f s", error.code(), attempt + 1, delay)
                time.sleep(delay)
        raise AssertionError("unreachable")

    def close(self) -> None:
        """Closes the channel."""
        self._channel.close()

    def __enter__(self) -> Publisher:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class AsyncPublisher:
    """The asyncio form of :class:`Publisher`, with the same arguments::

        async with AsyncPublisher("http://127.0.0.1:50051") as publisher:
            ids = await publisher.publish([Event("order", "o-42", "order.created", {})])

    The channel is opened on first use, in the running event loop.
    """

    def __init__(
        self,
        endpoint: str,
        token: str | None = None,
        tls: TlsOption = None,
        *,
        max_attempts: int = 5,
        timeout: float = 30.0,
        options: Sequence[tuple[str, Any]] | None = None,
    ):
        self._target = target(endpoint, token, tls, options)
        self._max_attempts = _check_attempts(max_attempts)
        self._timeout = timeout
        self._channel: grpc.aio.Channel | None = None
        self._stub: rpc.PublisherStub | None = None

    async def publish(self, events: Event | Iterable[Event], *, source: str | None = None) -> list[str]:
        """Publishes the batch atomically and returns the event ids in order; see
        :meth:`Publisher.publish`."""
        request = _request(events, source)
        if self._stub is None:
            self._channel = self._target.aio_channel()
            self._stub = rpc.PublisherStub(self._channel)
        backoff = Backoff()
        for attempt in range(1, self._max_attempts + 1):
            try:
                response = await self._stub.Publish(
                    request, timeout=self._timeout, metadata=self._target.metadata
                )
                return [result.id for result in response.results]
            except grpc.RpcError as error:
                if not is_transient(error):
                    raise RefusedError.from_rpc(error) from None
                if attempt == self._max_attempts:
                    raise UnavailableError.from_rpc(error) from None
                delay = backoff.next_delay()
                logger.debug("publish failed (%s), try %d in %.1f s", error.code(), attempt + 1, delay)
                await asyncio.sleep(delay)
        raise AssertionError("unreachable")

    async def close(self) -> None:
        """Closes the channel."""
        if self._channel is not None:
            await self._channel.close()
            self._channel = self._stub = None

    async def __aenter__(self) -> AsyncPublisher:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()
