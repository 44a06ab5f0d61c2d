"""AsyncPublisher and AsyncSubscriber against a live gateway."""

from __future__ import annotations

import asyncio

from conftest import unique

from outbox_gateway import AsyncPublisher, AsyncSubscriber, Event, RefusedError


def test_async_publish_consume_retry_and_stop(gateway):
    kind = unique("order")
    subscription = gateway.create_subscription(kind, retry_backoff_min=0.2)
    seen: list = []

    async def scenario():
        async with AsyncPublisher(gateway.endpoint) as publisher:
            ids = await publisher.publish([Event(kind, f"o-{n}", "order.created", {"n": n}) for n in range(4)])
        stop = asyncio.Event()

        async def handle(delivery):
            seen.append(delivery)
            if delivery.event.id == ids[0] and delivery.attempt == 1:
                raise RuntimeError("first try fails")
            await asyncio.sleep(0)
            if {d.event.id for d in seen} == set(ids) and any(d.attempt == 2 for d in seen):
                stop.set()  # this handler still finishes and is acked

        await asyncio.wait_for(AsyncSubscriber(gateway.endpoint, subscription).run(handle, 2, stop), 60)
        return ids

    ids = asyncio.run(scenario())
    assert sorted((d.event.id, d.attempt) for d in seen) == sorted(
        [(ids[0], 1), (ids[0], 2)] + [(event_id, 1) for event_id in ids[1:]]
    )
    assert seen[0].event.payload in ({"n": n} for n in range(4))
    # run returned after the acks were applied.
    stats = gateway.stats(subscription)
    assert (stats.acked_total, stats.lag_events) == (4, 0), stats


def test_async_handler_running_three_ack_deadlines_keeps_its_lease(gateway):
    deadline = 2.0
    kind = unique("order")
    subscription = gateway.create_subscription(kind, ack_deadline=deadline)
    calls: list = []

    async def scenario():
        async with AsyncPublisher(gateway.endpoint) as publisher:
            await publisher.publish([Event(kind, "o-1", "order.created", {})])
        stop = asyncio.Event()

        async def handle(delivery):
            calls.append(delivery.attempt)
            await asyncio.sleep(3 * deadline)  # the handler's own slow work
            stop.set()

        await asyncio.wait_for(AsyncSubscriber(gateway.endpoint, subscription).run(handle, 2, stop), 60)

    asyncio.run(scenario())
    assert calls == [1]
    stats = gateway.stats(subscription)
    assert (stats.delivered_total, stats.acked_total) == (1, 1), stats


def test_async_unknown_subscription_is_refused(gateway):
    async def scenario():
        await AsyncSubscriber(gateway.endpoint, "no-such-subscription").run(lambda d: None)

    try:
        asyncio.run(asyncio.wait_for(scenario(), 60))
    except RefusedError as refused:
        assert refused.code.name == "NOT_FOUND"
    else:
        raise AssertionError("the unknown subscription was not refused")
