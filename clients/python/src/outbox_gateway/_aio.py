"""`AsyncSubscriber`: the asyncio form of `Subscriber`, on grpc.aio, with the same acks,
nacks, lease extension, reconnects and draining stop."""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import Callable, Sequence
from typing import Any, Optional

import grpc
import grpc.aio

from ._channel import Backoff, Target, TlsOption, is_transient, target
from ._events import Delivery
from ._leases import (
    ACK_BATCH,
    ACK_FLUSH_INTERVAL,
    Leases,
    check_concurrency,
    check_handler,
    check_settings,
    extend_request,
    is_broken,
    log_failure,
    nack_request,
    needs_rollback,
    subscribe_request,
)
from ._proto.outbox.v1 import outbox_pb2 as pb
from ._proto.outbox.v1 import outbox_pb2_grpc as rpc
from .errors import InvalidArgumentError, OutboxError, RefusedError

__all__ = ["AsyncSubscriber"]

logger = logging.getLogger("outbox_gateway")

CALL_TIMEOUT = 10.0
ACK_TRIES = 5


async def _maybe_await(value: Any) -> Any:
    return await value if inspect.isawaitable(value) else value


class AsyncSubscriber:
    """The asyncio form of :class:`Subscriber`, with the same arguments::

        stop = asyncio.Event()
        await AsyncSubscriber("http://127.0.0.1:50051", "billing").run(handle, stop=stop)

    Handlers are coroutine functions (plain functions work too, but block the loop).
    """

    def __init__(
        self,
        endpoint: str,
        subscription: str,
        max_in_flight: int = 100,
        token: str | None = None,
        tls: TlsOption = None,
        *,
        max_in_flight_bytes: int = 0,
        options: Sequence[tuple[str, Any]] | None = None,
    ):
        self._target = target(endpoint, token, tls, options)
        self._settings = check_settings(subscription, max_in_flight, max_in_flight_bytes)

    @property
    def subscription(self) -> str:
        """The subscription's name."""
        return self._settings.subscription

    async def run(
        self,
        handler: Callable[[Delivery], Any],
        concurrency: int = 1,
        stop: asyncio.Event | None = None,
    ) -> None:
        """Awaits ``handler(delivery)`` for each delivery, ``concurrency`` at a time,
        until ``stop`` is set or the task is cancelled; then stops taking deliveries,
        lets the running handlers finish, settles them and returns. See
        :meth:`Subscriber.run`."""
        handler = check_handler("handler", handler, asynchronous=True)
        run = _AsyncRun(self._target, self._settings, check_concurrency(concurrency), _check_stop(stop))

        async def process(delivery: Delivery) -> None:
            await run.handle(handler, delivery)

        await run.run(process)

    async def run_exactly_once(
        self,
        connect: Callable[[], Any],
        handler: Callable[[Delivery, Any], Any],
        stop: asyncio.Event | None = None,
        *,
        concurrency: int = 1,
    ) -> None:
        """Consumes each delivery exactly once in a transaction of a psycopg
        ``AsyncConnection`` from ``connect()`` (a coroutine function such as
        ``lambda: psycopg.AsyncConnection.connect(url)``, called once per handler and
        again after a connection breaks). See :meth:`Subscriber.run_exactly_once`."""
        if not callable(connect):
            raise InvalidArgumentError("connect", f"must be callable, got {type(connect).__name__}")
        handler = check_handler("handler", handler, asynchronous=True)
        run = _AsyncRun(self._target, self._settings, check_concurrency(concurrency), _check_stop(stop))
        connections: list[Any] = []
        try:
            await run.run(run.consumer(connect, connections, handler))
        finally:
            for connection in connections:
                try:
                    await connection.close()
                except Exception:  # closing is best effort: the run is over
                    logger.debug("could not close a consumer connection", exc_info=True)


def _check_stop(stop: object) -> asyncio.Event:
    if stop is None:
        return asyncio.Event()
    if not (hasattr(stop, "is_set") and hasattr(stop, "wait")):
        raise InvalidArgumentError("stop", f"must be an asyncio.Event, got {type(stop).__name__}")
    return stop  # type: ignore[return-value]


class _AsyncRun:
    """One call of run or run_exactly_once: a reader task holding the stream, handler
    tasks, an acker task and a lease-extending task."""

    def __init__(self, target: Target, settings: Any, concurrency: int, stop: asyncio.Event):
        self.target = target
        self.settings = settings
        self.subscription = settings.subscription
        self.concurrency = concurrency
        self.stop = stop
        self.halt = asyncio.Event()
        self.deliveries: asyncio.Queue[Optional[tuple[int, Delivery]]] = asyncio.Queue()
        self.acks: asyncio.Queue[Optional[str]] = asyncio.Queue()
        self.leases = Leases()
        self.fatal: OutboxError | None = None
        self.call: Any = None
        self.stream = 0
        self.channel = target.aio_channel()
        self.stub = rpc.SubscriberStub(self.channel)

    async def run(self, process: Callable[[Delivery], Any]) -> None:
        reader = asyncio.create_task(self.read())
        workers = [asyncio.create_task(self.work(process)) for _ in range(self.concurrency)]
        acker = asyncio.create_task(self.send_acks())
        extender = asyncio.create_task(self.extend_leases())
        stop_wait = asyncio.create_task(self.stop.wait())
        halt_wait = asyncio.create_task(self.halt.wait())
        cancelled = False
        logger.info("subscribed to %s at %s", self.subscription, self.target.address)
        try:
            try:
                await asyncio.wait({stop_wait, halt_wait}, return_when=asyncio.FIRST_COMPLETED)
            except asyncio.CancelledError:
                cancelled = True
            self.halt.set()
            logger.info("stopping %s: letting running handlers finish", self.subscription)
            for _ in workers:
                self.deliveries.put_nowait(None)
            await asyncio.shield(asyncio.gather(*workers))
            self.acks.put_nowait(None)
            await asyncio.shield(acker)
        finally:
            self.halt.set()
            for task in (stop_wait, halt_wait, extender, acker, *workers):
                task.cancel()
            # Only now does the stream close: closing it gives back its unsettled leases,
            # and an ack after that would be stale.
            if self.call is not None:
                self.call.cancel()
            reader.cancel()
            await asyncio.gather(reader, extender, stop_wait, halt_wait, return_exceptions=True)
            await self.channel.close()
        logger.info("stopped %s", self.subscription)
        if self.fatal is not None:
            raise self.fatal
        if cancelled:
            raise asyncio.CancelledError

    async def read(self) -> None:
        backoff = Backoff()
        request = subscribe_request(self.settings)
        while not self.halt.is_set():
            self.call = call = self.stub.Subscribe(request, metadata=self.target.metadata)
            self.stream += 1
            stream = self.stream
            try:
                async for message in call:
                    backoff.reset()
                    if self.halt.is_set():
                        continue  # not taken: given back when the stream closes
                    delivery = Delivery._from_proto(message, self.subscription)
                    self.leases.add(delivery)
                    self.deliveries.put_nowait((stream, delivery))
                if not self.halt.is_set():
                    logger.info("the gateway ended the stream of %s; reconnecting", self.subscription)
                    await self.pause(backoff.next_delay())
            except grpc.RpcError as error:
                if self.halt.is_set():
                    return
                if not is_transient(error):
                    self.fatal = RefusedError.from_rpc(error)
                    logger.error("the gateway refused to stream %s: %s", self.subscription, self.fatal)
                    self.halt.set()
                    return
                delay = backoff.next_delay()
                logger.info(
                    "stream of %s lost (%s: %s); reconnecting in %.1f s",
                    self.subscription,
                    error.code().name,
                    error.details(),
                    delay,
                )
                await self.pause(delay)
            self.stream += 1  # deliveries still queued from that stream were given back

    async def pause(self, delay: float) -> None:
        """Waits `delay` seconds, or less when the run stops."""
        try:
            await asyncio.wait_for(self.halt.wait(), delay)
        except asyncio.TimeoutError:
            pass

    async def work(self, process: Callable[[Delivery], Any]) -> None:
        while True:
            item = await self.deliveries.get()
            if item is None:
                return
            stream, delivery = item
            # `stop` itself, not only `halt`: no handler starts once it is set.
            if self.halt.is_set() or self.stop.is_set() or stream != self.stream:
                self.leases.remove(delivery.ack_id)
                continue
            try:
                await process(delivery)
            except Exception:  # a bug of ours must not take the handler task down
                logger.exception("could not settle event %s", delivery.event.id)
                self.leases.remove(delivery.ack_id)

    async def handle(self, handler: Callable[[Delivery], Any], delivery: Delivery) -> None:
        try:
            await _maybe_await(handler(delivery))
        except Exception as error:
            await self.nack(delivery, error)
        else:
            self.leases.remove(delivery.ack_id)
            self.acks.put_nowait(delivery.ack_id)

    def consumer(
        self,
        connect: Callable[[], Any],
        connections: list[Any],
        handler: Callable[[Delivery, Any], Any],
    ) -> Callable[[Delivery], Any]:
        """The per-delivery step of run_exactly_once; each handler task keeps a
        connection of its own, taken from `free` and put back after each delivery."""
        free: list[Any] = []

        async def consume(delivery: Delivery) -> None:
            connection = free.pop() if free else None
            try:
                if connection is None or is_broken(connection):
                    connection = await _maybe_await(connect())
                    connections.append(connection)
                if needs_rollback(connection):
                    await connection.rollback()
                async with connection.transaction():
                    cursor = await connection.execute(
                        "SELECT outbox_consume(%s, %s)", (self.subscription, delivery.ack_id)
                    )
                    row = await cursor.fetchone()
                    if row[0]:
                        await _maybe_await(handler(delivery, connection))
                    else:
                        logger.debug("event %s was consumed before: handler skipped", delivery.event.id)
            except Exception as error:
                await self.nack(delivery, error)
            else:
                self.leases.remove(delivery.ack_id)  # committed: the gateway settles it
            finally:
                if connection is not None:
                    free.append(connection)

        return consume

    async def nack(self, delivery: Delivery, error: BaseException) -> None:
        log_failure(delivery, error)
        self.leases.remove(delivery.ack_id)
        try:
            await self.stub.Nack(
                nack_request(self.subscription, delivery, error),
                timeout=CALL_TIMEOUT,
                metadata=self.target.metadata,
            )
        except grpc.RpcError as failure:
            logger.warning("could not nack event %s: %s", delivery.event.id, failure.details())

    async def send_acks(self) -> None:
        while True:
            first = await self.acks.get()
            if first is None:
                return
            batch, last = [first], False
            while len(batch) < ACK_BATCH:
                try:
                    ack_id = await asyncio.wait_for(self.acks.get(), ACK_FLUSH_INTERVAL)
                except asyncio.TimeoutError:
                    break
                if ack_id is None:
                    last = True
                    break
                batch.append(ack_id)
            await self.ack(batch)
            if last:
                return

    async def ack(self, ack_ids: list[str]) -> None:
        backoff = Backoff()
        for attempt in range(1, ACK_TRIES + 1):
            try:
                response = await self.stub.Ack(
                    pb.AckRequest(subscription=self.subscription, ack_ids=ack_ids),
                    timeout=CALL_TIMEOUT,
                    metadata=self.target.metadata,
                )
            except grpc.RpcError as error:
                if not is_transient(error) or attempt == ACK_TRIES:
                    logger.warning("could not ack %d deliveries: %s", len(ack_ids), error.details())
                    return
                await asyncio.sleep(backoff.next_delay())
                continue
            if response.stale_ack_ids:
                logger.info(
                    "%d acks came too late (lease expired or taken over): those events come again",
                    len(response.stale_ack_ids),
                )
            ack_ids = list(response.unavailable_ack_ids)
            if not ack_ids:
                return
            await asyncio.sleep(backoff.next_delay())
        logger.warning("could not ack %d deliveries: their source stayed unavailable", len(ack_ids))

    async def extend_leases(self) -> None:
        while True:
            await asyncio.sleep(self.leases.wait_time())
            for lease, ack_ids in self.leases.due().items():
                try:
                    response = await self.stub.ExtendAckDeadline(
                        extend_request(self.subscription, lease, ack_ids),
                        timeout=CALL_TIMEOUT,
                        metadata=self.target.metadata,
                    )
                except grpc.RpcError as error:
                    logger.debug("could not extend %d leases: %s", len(ack_ids), error.details())
                    continue
                for ack_id in response.stale_ack_ids:
                    logger.info("a lease was lost before its handler finished: the event comes again")
                    self.leases.remove(ack_id)
