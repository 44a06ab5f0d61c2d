"""Subscriber against a live gateway: publish and consume, nacks and retries, lease
extension, reconnects after a killed gateway, and a stop that drains."""

from __future__ import annotations

import threading
import time

from conftest import Background, Recorder, eventually, unique

from outbox_gateway import DeadLetter, Event, Publisher, RetryLater, Subscriber
from outbox_gateway._proto.outbox.v1 import outbox_pb2 as pb


def orders(aggregate_type: str, count: int, start: int = 0) -> list[Event]:
    return [
        Event(aggregate_type, f"o-{n}", "order.created", {"n": n}, metadata={"test": "yes"})
        for n in range(start, start + count)
    ]


def test_publish_and_consume(gateway):
    kind = unique("order")
    subscription = gateway.create_subscription(kind)
    with Publisher(gateway.endpoint) as publisher:
        ids = publisher.publish(
            [
                Event(kind, "o-1", "order.created", {"total": 42}, metadata={"source": "test"}),
                Event(kind, "o-1", "order.items", [1, 2, 3]),
                Event(kind, "o-2", "order.note", '{"text": "as str"}'),
                Event(kind, "o-3", "order.blob", b"\x00\x01", content_type="application/octet-stream"),
            ]
        )
    assert len(ids) == 4 and len(set(ids)) == 4
    seen = Recorder()
    run = Background(Subscriber(gateway.endpoint, subscription).run, seen.add, concurrency=2, stop=threading.Event())
    eventually("every event is handled", lambda: seen.ids() == set(ids))
    eventually("every delivery is acked", lambda: gateway.settled(subscription, acked=4))
    run.finish()
    by_id = {delivery.event.id: delivery for delivery in seen.deliveries}
    first = by_id[ids[0]]
    assert first.attempt == 1 and first.ack_id and first.subscription == subscription
    assert (first.event.aggregate_type, first.event.aggregate_id, first.event.event_type) == (kind, "o-1", "order.created")
    assert first.event.payload == {"total": 42}
    assert first.event.metadata == {"source": "test"}
    assert first.event.created_at is not None and first.event.source == "default"
    assert by_id[ids[1]].event.payload == [1, 2, 3]
    assert by_id[ids[2]].event.payload == {"text": "as str"}
    assert by_id[ids[3]].event.payload == b"\x00\x01"
    assert by_id[ids[3]].event.content_type == "application/octet-stream"
    assert len(seen) == 4, "nothing was delivered twice"


def test_a_handler_that_raises_is_retried(gateway):
    kind = unique("order")
    subscription = gateway.create_subscription(kind, retry_backoff_min=0.2)
    with Publisher(gateway.endpoint) as publisher:
        failing, later, poison = publisher.publish(orders(kind, 3))
    seen = Recorder()

    def handle(delivery):
        seen.add(delivery)
        if delivery.event.id == poison:
            raise DeadLetter("cannot ever work")
        if delivery.attempt == 1 and delivery.event.id == failing:
            raise RuntimeError("first try fails")
        if delivery.attempt == 1 and delivery.event.id == later:
            raise RetryLater("busy", after=0.5)

    run = Background(Subscriber(gateway.endpoint, subscription).run, handle, stop=threading.Event())
    eventually("the failed events come again", lambda: seen.attempts(failing) == [1, 2] and seen.attempts(later) == [1, 2])
    eventually("they are acked", lambda: gateway.settled(subscription, acked=2))
    run.finish()
    assert seen.attempts(poison) == [1]
    request = pb.ListDeadLettersRequest(subscription=subscription)
    letters = gateway.admin.ListDeadLetters(request, timeout=30).dead_letters
    assert [(letter.event.id, letter.last_error) for letter in letters] == [(poison, "cannot ever work")]


def test_a_handler_running_three_ack_deadlines_keeps_its_lease(gateway):
    deadline = 2.0
    kind = unique("order")
    subscription = gateway.create_subscription(kind, ack_deadline=deadline)
    with Publisher(gateway.endpoint) as publisher:
        [event_id] = publisher.publish(orders(kind, 1))
    seen = Recorder()

    def handle(delivery):
        seen.add(delivery)
        time.sleep(3 * deadline)  # the handler's own slow work

    # Two handler threads: a redelivery would be handled while the first still runs.
    run = Background(Subscriber(gateway.endpoint, subscription).run, handle, concurrency=2, stop=threading.Event())
    eventually("the slow handler's ack is applied", lambda: gateway.settled(subscription, acked=1))
    run.finish()
    assert seen.attempts(event_id) == [1]
    assert gateway.stats(subscription).delivered_total == 1, "the event was delivered again"


def test_stop_lets_running_handlers_finish_and_acks_them(gateway):
    kind = unique("order")
    subscription = gateway.create_subscription(kind)
    with Publisher(gateway.endpoint) as publisher:
        ids = publisher.publish(orders(kind, 5))
    started, finished = Recorder(), Recorder()
    stop = threading.Event()

    def handle(delivery):
        started.add(delivery)
        stop.wait(60)
        time.sleep(0.5)  # the handler's own work goes on after the stop
        finished.add(delivery)

    subscriber = Subscriber(gateway.endpoint, subscription, max_in_flight=5)
    run = Background(subscriber.run, handle, concurrency=3, stop=stop)
    eventually("three handlers run", lambda: len(started) == 3)
    eventually("all five are held", lambda: gateway.stats(subscription).in_flight == 5)
    run.finish()
    # run returned only after the running handlers finished and their acks were applied.
    assert len(finished) == 3 and finished.ids() == started.ids()
    stats = gateway.stats(subscription)
    assert stats.acked_total == 3, stats
    # The two never started were given back when the stream closed; a new run takes them.
    rest = Recorder()
    run = Background(subscriber.run, rest.add, stop=threading.Event())
    eventually("the rest is handled", lambda: rest.ids() == set(ids) - started.ids())
    eventually("and acked", lambda: gateway.settled(subscription, acked=5))
    run.finish()
    assert len(rest) == 2


def test_a_killed_gateway_loses_nothing_and_the_subscriber_reconnects(own_gateway):
    gateway = own_gateway
    kind = unique("order")
    subscription = gateway.create_subscription(kind, ack_deadline=3.0)
    seen = Recorder()

    def handle(delivery):
        seen.add(delivery)
        time.sleep(0.05)  # the handler's own work, so that some are in flight at the kill

    run = Background(Subscriber(gateway.endpoint, subscription, max_in_flight=10).run, handle, concurrency=2, stop=threading.Event())
    published: set[str] = set()
    with Publisher(gateway.endpoint) as publisher:
        published.update(publisher.publish(orders(kind, 40)))
    eventually("some events are handled", lambda: len(seen) >= 5)
    gateway.kill()
    gateway.start()
    with Publisher(gateway.endpoint) as publisher:
        published.update(publisher.publish(orders(kind, 40, start=40)))
    eventually("every event is handled", lambda: published <= seen.ids())
    assert run.alive(), "the subscriber gave up"
    eventually("every event is acked", lambda: gateway.stats(subscription).lag_events == 0)
    run.finish()
    assert seen.ids() == published
