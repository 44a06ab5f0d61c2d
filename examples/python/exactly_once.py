"""Consumes a subscription exactly once with Subscriber.run_exactly_once.

Each delivery is handled in one PostgreSQL transaction in which the subscriber first
calls outbox_consume(subscription, ack_id); the handler then records a shipment for the
order and publishes its shipment.requested event in that transaction. For an event a
committed transaction consumed before, the handler is skipped. The gateway settles the
delivery when the transaction commits: there is no Ack call. Prints one JSON line per
consumed event; stops after --max-deliveries events or --timeout seconds.
"""

import json
import sys
import threading

import psycopg

from common import consumer_parser, ensure_subscription
from outbox_gateway import Subscriber

# No unique constraint: outbox_consume, not the table, keeps a shipment from being
# written twice.
SHIPMENTS = """CREATE TABLE IF NOT EXISTS shipments (
    id bigserial PRIMARY KEY, order_id text, event_id text, created_at timestamptz DEFAULT now()
)"""


def main():
    args = consumer_parser(__doc__, "orders-exactly-once-python", database=True).parse_args()
    with psycopg.connect(args.database_url, autocommit=True) as conn:
        conn.execute(SHIPMENTS)
    ensure_subscription(args.endpoint, args.subscription)
    stop = threading.Event()
    timer = threading.Timer(args.timeout, stop.set)
    timer.daemon = True
    received = 0

    def handle(delivery, conn):
        """Runs inside the consuming transaction: it commits with what it writes here."""
        nonlocal received
        order_id = delivery.event.aggregate_id
        conn.execute(
            "INSERT INTO shipments (order_id, event_id) VALUES (%s, %s)",
            (order_id, delivery.event.id),
        )
        conn.execute(
            "SELECT outbox_publish('shipment', %s, 'shipment.requested', %s::jsonb)",
            (order_id, json.dumps({"order_id": order_id})),
        )
        line = {
            "event_id": delivery.event.id,
            "event_type": delivery.event.event_type,
            "aggregate_id": order_id,
            "consumed": True,
        }
        print(json.dumps(line), flush=True)
        received += 1
        if received == args.max_deliveries:
            stop.set()  # run_exactly_once() returns once this transaction is committed

    timer.start()
    Subscriber(args.endpoint, args.subscription).run_exactly_once(
        lambda: psycopg.connect(args.database_url), handle, stop=stop
    )
    timer.cancel()
    print(f"consumed {received} events", file=sys.stderr)


if __name__ == "__main__":
    main()
