"""run_exactly_once against a live gateway and its database: each effect is recorded
once through a consumer crash between the effect and the commit, a handler failure
after the effect, and requeues of every event; the async form likewise."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
import uuid
from pathlib import Path

import psycopg
from conftest import Background, Recorder, eventually, unique

from outbox_gateway import AsyncSubscriber, Event, Publisher, Subscriber
from outbox_gateway._proto.outbox.v1 import outbox_pb2 as pb

CRASHING_CONSUMER = """
import os, sys
import psycopg
from outbox_gateway import Subscriber

endpoint, subscription, url, table = sys.argv[1:]

def handle(delivery, connection):
    connection.execute(
        f"INSERT INTO {table} (event_id, attempt) VALUES (%s, %s)",
        (delivery.event.id, delivery.attempt),
    )
    print(delivery.event.id, flush=True)
    os._exit(3)  # the process dies after the effect, before the commit

Subscriber(endpoint, subscription, max_in_flight=1).run_exactly_once(
    lambda: psycopg.connect(url), handle
)
"""


def effects_table(database_url: str) -> str:
    table = f"effects_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(database_url, autocommit=True) as connection:
        # No unique constraint: outbox_consume, not the table, keeps effects single.
        connection.execute(f"CREATE TABLE {table} (event_id text NOT NULL, attempt int NOT NULL)")
    return table


def effects(database_url: str, table: str) -> dict[str, int]:
    with psycopg.connect(database_url) as connection:
        rows = connection.execute(f"SELECT event_id, count(*) FROM {table} GROUP BY event_id").fetchall()
    return dict(rows)


def requeue(gateway, subscription: str, ids: list[str]) -> None:
    for event_id in ids:
        gateway.admin.RequeueEvent(pb.RequeueEventRequest(id=event_id, subscription=subscription), timeout=30)


def test_exactly_once_through_a_crash_a_failure_and_requeues(gateway, database_url, tmp_path: Path):
    kind = unique("order")
    table = effects_table(database_url)
    subscription = gateway.create_subscription(kind, ack_deadline=5.0)
    with Publisher(gateway.endpoint) as publisher:
        ids = publisher.publish([Event(kind, f"o-{n}", "order.created", {"n": n}) for n in range(6)])

    script = tmp_path / "crashing_consumer.py"
    script.write_text(CRASHING_CONSUMER)
    crashed = subprocess.run(
        [sys.executable, str(script), gateway.endpoint, subscription, database_url, table],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert crashed.returncode == 3, crashed.stderr
    crashed_id = crashed.stdout.strip()
    assert crashed_id in ids
    assert effects(database_url, table) == {}, "the effect died with its transaction"

    calls = Recorder()
    failed_once = threading.Event()
    failing_id = next(event_id for event_id in ids if event_id != crashed_id)

    def handle(delivery, connection):
        calls.add(delivery)
        connection.execute(
            f"INSERT INTO {table} (event_id, attempt) VALUES (%s, %s)",
            (delivery.event.id, delivery.attempt),
        )
        if delivery.event.id == failing_id and not failed_once.is_set():
            failed_once.set()
            raise RuntimeError("fails after its effect")

    subscriber = Subscriber(gateway.endpoint, subscription)
    run = Background(
        subscriber.run_exactly_once,
        lambda: psycopg.connect(database_url),
        handle,
        concurrency=2,
        stop=threading.Event(),
    )
    eventually("every event is consumed", lambda: set(effects(database_url, table)) == set(ids))
    eventually("every delivery is settled by its commit", lambda: gateway.settled(subscription, acked=6))
    assert gateway.stats(subscription).consumption_records == 6

    # Every event again: recognised as consumed, settled, its handler not called.
    handled = len(calls)
    requeue(gateway, subscription, ids)
    eventually("the requeued deliveries are settled", lambda: gateway.settled(subscription, acked=12))
    run.finish()

    assert effects(database_url, table) == {event_id: 1 for event_id in ids}
    assert len(calls) == handled, "a handler ran for a consumed event"
    assert calls.attempts(failing_id) == [1, 2]
    assert calls.attempts(crashed_id) == [2]


def test_async_exactly_once(gateway, database_url):
    kind = unique("order")
    table = effects_table(database_url)
    subscription = gateway.create_subscription(kind)
    with Publisher(gateway.endpoint) as publisher:
        ids = publisher.publish([Event(kind, f"o-{n}", "order.created", {"n": n}) for n in range(4)])
    calls = Recorder()

    async def handle(delivery, connection):
        calls.add(delivery)
        await connection.execute(
            f"INSERT INTO {table} (event_id, attempt) VALUES (%s, %s)",
            (delivery.event.id, delivery.attempt),
        )
        if delivery.event.id == ids[0] and delivery.attempt == 1:
            raise RuntimeError("fails after its effect")

    async def scenario():
        stop = asyncio.Event()
        subscriber = AsyncSubscriber(gateway.endpoint, subscription)
        run = asyncio.create_task(
            subscriber.run_exactly_once(
                lambda: psycopg.AsyncConnection.connect(database_url), handle, stop, concurrency=2
            )
        )
        await asyncio.to_thread(eventually, "settled", lambda: gateway.settled(subscription, acked=4))
        requeue(gateway, subscription, ids)
        await asyncio.to_thread(eventually, "settled again", lambda: gateway.settled(subscription, acked=8))
        stop.set()
        await asyncio.wait_for(run, 60)

    asyncio.run(scenario())
    assert effects(database_url, table) == {event_id: 1 for event_id in ids}
    assert calls.attempts(ids[0]) == [1, 2]
    assert len(calls) == 5
