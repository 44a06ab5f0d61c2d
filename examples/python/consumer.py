"""Reads a subscription over outbox.v1.Subscriber/Subscribe and settles every delivery.

Creates the subscription when it is missing, acks each delivery, and sends a poison
message (a payload with "poison": true) to the dead-letter queue at once. Prints one
JSON line per delivery; stops after --max-deliveries deliveries or --timeout seconds.
"""

import base64
import json
import re
import sys

import grpc

from common import channel, ensure_subscription, parser, pb, rpc

JSON_CONTENT_TYPE = re.compile(r"^application/([a-z0-9.+_-]+\+)?json$")


def decode(event):
    """The payload as JSON when its content type says so, otherwise base64."""
    if JSON_CONTENT_TYPE.match(event.content_type.split(";")[0].strip().lower()):
        return json.loads(event.payload)
    return base64.b64encode(event.payload).decode()


def settle(subscriber, subscription, delivery, payload):
    """Acks a delivery, or dead-letters it when it can never succeed."""
    if isinstance(payload, dict) and payload.get("poison") is True:
        response = subscriber.Nack(
            pb.NackRequest(
                subscription=subscription,
                ack_id=delivery.ack_id,
                reason="poison message",
                dead_letter=True,
            )
        )
        return "dead-lettered" if response.dead_lettered else "nacked"
    # A real consumer handles the event here, then acks it.
    response = subscriber.Ack(pb.AckRequest(subscription=subscription, ack_ids=[delivery.ack_id]))
    # A stale ack id: the lease expired and the event will be delivered again.
    return "stale" if response.stale_ack_ids else "acked"


def main():
    args = parser(__doc__, endpoint=True)
    args.add_argument("--subscription", default="orders-python")
    args.add_argument(
        "--max-deliveries", type=int, default=0, help="stop after this many (0: no limit)"
    )
    args.add_argument("--timeout", type=float, default=30, help="stop after this many seconds")
    args = args.parse_args()

    with channel(args.endpoint) as ch:
        ensure_subscription(rpc.AdminStub(ch), args.subscription)
        subscriber = rpc.SubscriberStub(ch)
        # The deadline bounds the whole stream: it ends the loop after --timeout seconds.
        stream = subscriber.Subscribe(
            pb.SubscribeRequest(subscription=args.subscription), timeout=args.timeout
        )
        received = 0
        try:
            for delivery in stream:
                event = delivery.event
                payload = decode(event)
                settled = settle(subscriber, args.subscription, delivery, payload)
                line = {
                    "id": event.id,
                    "aggregate_type": event.aggregate_type,
                    "aggregate_id": event.aggregate_id,
                    "event_type": event.event_type,
                    "payload": payload,
                    "metadata": dict(event.metadata),
                    "attempt": delivery.attempt,
                    "settled": settled,
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
            stream.cancel()  # closing the stream releases unsettled deliveries at once
    print(f"received {received} deliveries", file=sys.stderr)


if __name__ == "__main__":
    main()
