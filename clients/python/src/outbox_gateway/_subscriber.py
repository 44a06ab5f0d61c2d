"""`Subscriber`: runs a handler for each delivery of a subscription on threads, with
acks, nacks, lease extension, reconnects and a draining stop."""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Optional

import grpc

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

__all__ = ["Subscriber"]

logger = logging.getLogger("outbox_gateway")

# Unary calls (ack, nack, extend) give up after this long: the lease runs out and the
# event comes back anyway.
CALL_TIMEOUT = 10.0
ACK_TRIES = 5


class Subscriber:
    """Consumes a subscription with a handler, on threads.

    ::

        stop = threading.Event()
        Subscriber("http://127.0.0.1:50051", "billing").run(handle, concurrency=4, stop=stop)

    Every delivery is held under a lease. The subscriber acks a delivery when its
    handler returns and nacks it when the handler raises (the event comes back after
    the subscription's backoff; raise :class:`RetryLater` or :class:`DeadLetter` to
    choose otherwise). It extends the lease of every delivery it holds at half the
    lease, so a long handler keeps its event. When the stream or the gateway goes away
    it reconnects with backoff (100 ms doubling to 10 s).

    Args:
        endpoint: ``host:port``, ``http://host:port`` or ``https://host:port`` (TLS).
        subscription: the name of an existing subscription.
        max_in_flight: most unsettled deliveries the gateway sends ahead (default 100).
        token: a bearer token, sent with every call.
        tls: ``True`` for TLS with the system's roots, a :class:`Tls` or
            ``grpc.ChannelCredentials``; default: TLS for ``https://`` endpoints only.
        max_in_flight_bytes: most bytes of unsettled deliveries (0: the gateway's default).
        options: extra gRPC channel options.
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

    def run(
        self,
        handler: Callable[[Delivery], object],
        concurrency: int = 1,
        stop: threading.Event | None = None,
    ) -> None:
        """Calls ``handler(delivery)`` for each delivery, ``concurrency`` at a time,
        until ``stop`` is set (or Ctrl-C). Then it stops taking deliveries, lets the
        running handlers finish, sends their acks and nacks, and returns; deliveries
        received but not started go back to the gateway for redelivery.

        Raises:
            InvalidArgumentError: bad arguments, before any call.
            RefusedError: the gateway refused the stream in a way retrying cannot fix
                (an unknown subscription, a missing permission).
        """
        handler = check_handler("handler", handler, asynchronous=False)
        _Run(self._target, self._settings, check_concurrency(concurrency), _check_stop(stop)).run(
            lambda run, delivery: run.handle(handler, delivery)
        )

    def run_exactly_once(
        self,
        connect: Callable[[], Any],
        handler: Callable[[Delivery, Any], object],
        stop: threading.Event | None = None,
        *,
        concurrency: int = 1,
    ) -> None:
        """Consumes each delivery exactly once, in a transaction of your database (one of
        the gateway's sources).

        For each delivery it opens a transaction on a psycopg connection from
        ``connect()`` (called once per handler thread, and again after a connection
        breaks; the subscriber closes them when it returns), calls
        ``outbox_consume(subscription, ack_id)`` first, then ``handler(delivery,
        connection)`` unless a committed transaction consumed the event before, and
        commits. What the handler writes through the connection, events it publishes
        with ``outbox_publish`` included, therefore happens once per event. No ack is
        sent: the gateway settles the delivery when the transaction commits. A handler
        error rolls the transaction back and nacks.
        """
        if not callable(connect):
            raise InvalidArgumentError("connect", f"must be callable, got {type(connect).__name__}")
        handler = check_handler("handler", handler, asynchronous=False)
        connections: dict[int, Any] = {}
        run = _Run(self._target, self._settings, check_concurrency(concurrency), _check_stop(stop))
        try:
            run.run(lambda run, delivery: run.consume(connect, connections, handler, delivery))
        finally:
            for connection in connections.values():
                try:
                    connection.close()
                except Exception:  # closing is best effort: the run is over
                    logger.debug("could not close a consumer connection", exc_info=True)


def _check_stop(stop: object) -> threading.Event:
    if stop is None:
        return threading.Event()
    if not (hasattr(stop, "is_set") and hasattr(stop, "wait")):
        raise InvalidArgumentError("stop", f"must be a threading.Event, got {type(stop).__name__}")
    return stop  # type: ignore[return-value]


class _Run:
    """One call of run or run_exactly_once: a reader thread holding the stream,
    handler threads, an acker thread and a lease-extending thread."""

    def __init__(self, target: Target, settings: Any, concurrency: int, stop: threading.Event):
        self.target = target
        self.settings = settings
        self.subscription = settings.subscription
        self.concurrency = concurrency
        self.stop = stop
        self.halt = threading.Event()  # stop taking deliveries (stop, Ctrl-C or a refusal)
        self.done = threading.Event()  # every handler has finished and settled
        self.deliveries: queue.Queue[Optional[tuple[int, Delivery]]] = queue.Queue()
        self.acks: queue.Queue[Optional[str]] = queue.Queue()
        self.leases = Leases()
        self.fatal: OutboxError | None = None
        self.lock = threading.Lock()
        self.call: Any = None
        self.stream = 0  # counts streams, so deliveries of an ended one are dropped
        self.closing = False
        self.channel = target.channel()
        self.stub = rpc.SubscriberStub(self.channel)

    def run(self, process: Callable[[_Run, Delivery], None]) -> None:
        threads = [threading.Thread(target=self.read, name="outbox-reader", daemon=True)]
        workers = [
            threading.Thread(target=self.work, args=(process,), name=f"outbox-handler-{n}", daemon=True)
            for n in range(self.concurrency)
        ]
        acker = threading.Thread(target=self.send_acks, name="outbox-acker", daemon=True)
        extender = threading.Thread(target=self.extend_leases, name="outbox-leases", daemon=True)
        interrupted = False
        try:
            for thread in [*threads, *workers, acker, extender]:
                thread.start()
            logger.info("subscribed to %s at %s", self.subscription, self.target.address)
            try:
                # threading.Event offers no callback: look at `stop` several times a second.
                while not self.halt.wait(0.05):
                    if self.stop.is_set():
                        self.halt.set()
            except KeyboardInterrupt:
                interrupted = True
            self.halt.set()
            logger.info("stopping %s: letting running handlers finish", self.subscription)
            for _ in workers:
                self.deliveries.put(None)
            for worker in workers:
                worker.join()
            self.acks.put(None)
            acker.join()
        finally:
            self.halt.set()
            self.done.set()
            # Only now does the stream close: closing it gives back its unsettled leases,
            # and an ack after that would be stale.
            with self.lock:
                self.closing = True
                if self.call is not None:
                    self.call.cancel()
            extender.join(timeout=CALL_TIMEOUT)
            threads[0].join(timeout=CALL_TIMEOUT)
            self.channel.close()
        logger.info("stopped %s", self.subscription)
        if self.fatal is not None:
            raise self.fatal
        if interrupted:
            raise KeyboardInterrupt

    def read(self) -> None:
        """Holds a stream open, reconnecting with backoff, and queues its deliveries."""
        backoff = Backoff()
        request = subscribe_request(self.settings)
        while not self.halt.is_set():
            call = self.stub.Subscribe(request, metadata=self.target.metadata)
            with self.lock:
                if self.closing:
                    call.cancel()
                    return
                self.call = call
                self.stream += 1
                stream = self.stream
            try:
                for message in call:
                    backoff.reset()
                    if self.halt.is_set():
                        continue  # not taken: given back when the stream closes
                    delivery = Delivery._from_proto(message, self.subscription)
                    self.leases.add(delivery)
                    self.deliveries.put((stream, delivery))
                if not self.halt.is_set():
                    logger.info("the gateway ended the stream of %s; reconnecting", self.subscription)
                    self.halt.wait(backoff.next_delay())
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
                self.halt.wait(delay)
            with self.lock:
                self.stream += 1  # deliveries still queued from that stream were given back

    def work(self, process: Callable[[_Run, Delivery], None]) -> None:
        while True:
            item = self.deliveries.get()
            if item is None:
                return
            stream, delivery = item
            with self.lock:
                current = stream == self.stream
            # `stop` itself, not only `halt`: no handler starts once it is set.
            if self.halt.is_set() or self.stop.is_set() or not current:
                # Not started: the gateway redelivers it once its stream is closed.
                self.leases.remove(delivery.ack_id)
                continue
            try:
                process(self, delivery)
            except Exception:  # a bug of ours must not take the handler thread down
                logger.exception("could not settle event %s", delivery.event.id)
                self.leases.remove(delivery.ack_id)

    def handle(self, handler: Callable[[Delivery], object], delivery: Delivery) -> None:
        try:
            handler(delivery)
        except Exception as error:
            self.nack(delivery, error)
        else:
            self.leases.remove(delivery.ack_id)
            self.acks.put(delivery.ack_id)

    def consume(
        self,
        connect: Callable[[], Any],
        connections: dict[int, Any],
        handler: Callable[[Delivery, Any], object],
        delivery: Delivery,
    ) -> None:
        key = threading.get_ident()
        try:
            connection = connections.get(key)
            if connection is None or is_broken(connection):
                connection = connections[key] = connect()
            if needs_rollback(connection):
                connection.rollback()
            with connection.transaction():
                row = connection.execute(
                    "SELECT outbox_consume(%s, %s)", (self.subscription, delivery.ack_id)
                ).fetchone()
                if row[0]:
                    handler(delivery, connection)
                else:
                    logger.debug("event %s was consumed before: handler skipped", delivery.event.id)
        except Exception as error:
            self.nack(delivery, error)
        else:
            # Committed: the gateway settles the delivery; no ack.
            self.leases.remove(delivery.ack_id)

    def nack(self, delivery: Delivery, error: BaseException) -> None:
        log_failure(delivery, error)
        self.leases.remove(delivery.ack_id)
        try:
            self.stub.Nack(
                nack_request(self.subscription, delivery, error),
                timeout=CALL_TIMEOUT,
                metadata=self.target.metadata,
            )
        except grpc.RpcError as failure:
            # The lease runs out and the event comes back anyway.
            logger.warning("could not nack event %s: %s", delivery.event.id, failure.details())

    def send_acks(self) -> None:
        """Sends acks in batches of up to 500, at least every 10 ms, until told to stop."""
        while True:
            first = self.acks.get()
            if first is None:
                return
            batch, last = [first], False
            while len(batch) < ACK_BATCH:
                try:
                    ack_id = self.acks.get(timeout=ACK_FLUSH_INTERVAL)
                except queue.Empty:
                    break
                if ack_id is None:
                    last = True
                    break
                batch.append(ack_id)
            self.ack(batch)
            if last:
                return

    def ack(self, ack_ids: list[str]) -> None:
        backoff = Backoff()
        for attempt in range(1, ACK_TRIES + 1):
            try:
                response = self.stub.Ack(
                    pb.AckRequest(subscription=self.subscription, ack_ids=ack_ids),
                    timeout=CALL_TIMEOUT,
                    metadata=self.target.metadata,
                )
            except grpc.RpcError as error:
                if not is_transient(error) or attempt == ACK_TRIES:
                    # Unacked deliveries come back after their deadline: at least once holds.
                    logger.warning("could not ack %d deliveries: %s", len(ack_ids), error.details())
                    return
                time.sleep(backoff.next_delay())
                continue
            if response.stale_ack_ids:
                logger.info(
                    "%d acks came too late (lease expired or taken over): those events come again",
                    len(response.stale_ack_ids),
                )
            ack_ids = list(response.unavailable_ack_ids)
            if not ack_ids:
                return
            time.sleep(backoff.next_delay())
        logger.warning("could not ack %d deliveries: their source stayed unavailable", len(ack_ids))

    def extend_leases(self) -> None:
        """Extends each held lease at half its length until every handler has settled."""
        while not self.done.wait(self.leases.wait_time()):
            for lease, ack_ids in self.leases.due().items():
                try:
                    response = self.stub.ExtendAckDeadline(
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
