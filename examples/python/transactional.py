"""Writes an order and its order.created event in one PostgreSQL transaction.

The first order commits, so its event is delivered. The second is rolled back: neither
the order nor its event is stored, and the event is never delivered. Prints one JSON
line per order.
"""

import json
import uuid

import psycopg

from common import parser


def create_order(conn, total):
    """Inserts an order and publishes its event in the caller's transaction."""
    order_id = f"o-{uuid.uuid4().hex[:8]}"
    conn.execute("INSERT INTO orders (id, total) VALUES (%s, %s)", (order_id, total))
    event_id = conn.execute(
        "SELECT outbox_publish('order', %s, 'order.created', %s::jsonb, %s::jsonb)",
        (order_id, json.dumps({"total": total}), json.dumps({"source": "python-example"})),
    ).fetchone()[0]
    return order_id, str(event_id)


def main():
    args = parser(__doc__, database=True).parse_args()
    # autocommit: each `with conn.transaction()` block below is one explicit transaction.
    with psycopg.connect(args.database_url, autocommit=True) as conn:
        conn.execute("CREATE TABLE IF NOT EXISTS orders (id text PRIMARY KEY, total numeric)")

        with conn.transaction():
            order_id, event_id = create_order(conn, 99.5)
        print(json.dumps({"order_id": order_id, "event_id": event_id, "committed": True}))

        with conn.transaction():
            order_id, event_id = create_order(conn, 13)
            # Say a business rule fails after the writes: roll the whole transaction back.
            raise psycopg.Rollback()
        print(json.dumps({"order_id": order_id, "event_id": event_id, "committed": False}))


if __name__ == "__main__":
    main()
