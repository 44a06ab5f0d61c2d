"""Consumes a subscription exactly once, with outbox_consume in the consumer's own database.

Each delivery is handled in one PostgreSQL transaction that first calls
outbox_consume(subscription, ack_id). True: the transaction records a shipment for the
order and publishes its shipment.requested event. False: a committed transaction already
consumed the event, so nothing is written again. The gateway settles the delivery when
the transaction commits: there is no Ack call. Prints one JSON line per delivery; stops
after --max-deliveries deliveries or --timeout seconds.
"""

import json
import sys

import grpc
import psycopg

from common import channel, ensure_subscription, parser, pb, rpc

# No unique constraint: outbox_consume, not the table, keeps a shipment from being
# written twice.
SHIPMENTS = """CREATE TABLE IF NOT EXISTS shipments (
    id bigserial PRIMARY KEY, order_id text, event_id text, created_at timestamptz DEFAULT now()
)"""


def consume(conn, subscription, delivery):
    """Handles a delivery in one transaction; False when it was consumed before."""
    order_id = delivery.event.aggregate_id
    with conn.transaction():
        # First: under READ COMMITTED, a concurrent call for the same event waits here.
        consumed = conn.execute(
            "SELECT outbox_consume(%s, %s)", (subscription, delivery.ack_id)
        ).fetchone()[0]
        if consumed:
            conn.execute(
                "INSERT INTO shipments (order_id, event_id) VALUES (%s, %s)",
                (order_id, delivery.event.id),
            )
            conn.execute(
                "SELECT outbox_publish('shipment', %s, 'shipment.requested', %s::jsonb)",
                (order_id, json.dumps({"order_id": order_id})),
            )
    # Committed, false included: the gateway settles the delivery now.
    return consumed


def main():
    args = parser(__doc__, endpoint=True, database=True)
    args.add_argument("--subscription", default="orders-exactly-once-python")
    args.add_argument(
        "--max-deliveries", type=int, default=0, help="stop after this many (0: no limit)"
    )
    args.add_argument("--timeout", type=float, default=30, help="stop after this many seconds")
    args = args.parse_args()

    # autocommit: each `with conn.transaction()` block in consume() is one transaction.
    conn = psycopg.connect(args.database_url, autocommit=True)
    with conn, channel(args.endpoint) as ch:
        conn.execute(SHIPMENTS)
        ensure_subscription(rpc.AdminStub(ch), args.subscription)
        # The deadline bounds the whole stream: it ends the loop after --timeout seconds.
        stream = rpc.SubscriberStub(ch).Subscribe(
            pb.SubscribeRequest(subscription=args.subscription), timeout=args.timeout
        )
        received = 0
        try:
            for delivery in stream:
                event = delivery.event
                line = {
                    "event_id": event.id,
                    "event_type": event.event_type,
                    "aggregate_id": event.aggregate_id,
                    "consumed": consume(conn, args.subscription, delivery),
                }
                print(json.dumps(line), flush=True)
                received += 1
                if received == args.max_deliveries:
                    break
        except grpc.RpcError as error:
            if error.code() != grpc.StatusCode.DEADLINE_EXCEEDED:
                raise
            print(f"timed out after {args.timeout:g} s", file=sys.stderr)
        finally:
            # A delivery whose settlement has not reached the gateway yet goes back: it
            # comes again, and outbox_consume reports it consumed (false).
            stream.cancel()
    print(f"received {received} deliveries", file=sys.stderr)


if __name__ == "__main__":
    main()
