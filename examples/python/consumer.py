"""Consumes a subscription with outbox_gateway.Subscriber.

Creates the subscription when it is missing. The subscriber acks each delivery whose
handler returns; a poison message (a payload with "poison": true) goes to the
dead-letter queue at once by raising DeadLetter. Prints one JSON line per delivery;
stops after --max-deliveries deliveries or --timeout seconds.
"""

import base64
import json
import sys
import threading

from common import consumer_parser, ensure_subscription
from outbox_gateway import DeadLetter, Subscriber


def main():
    args = consumer_parser(__doc__, "orders-python").parse_args()
    ensure_subscription(args.endpoint, args.subscription)
    stop = threading.Event()
    timer = threading.Timer(args.timeout, stop.set)
    timer.daemon = True
    received = 0

    def handle(delivery):
        nonlocal received
        event = delivery.event
        poison = isinstance(event.payload, dict) and event.payload.get("poison") is True
        payload = event.payload
        if isinstance(payload, bytes):  # not JSON
            payload = base64.b64encode(payload).decode()
        line = {
            "id": event.id,
            "aggregate_type": event.aggregate_type,
            "aggregate_id": event.aggregate_id,
            "event_type": event.event_type,
            "payload": payload,
            "metadata": event.metadata,
            "attempt": delivery.attempt,
            "settled": "dead-lettered" if poison else "acked",
        }
        print(json.dumps(line), flush=True)
        received += 1
        if received == args.max_deliveries:
            stop.set()  # run() returns once this delivery is settled
        if poison:
            raise DeadLetter("poison message")
        # A real consumer handles the event here; returning acks it.

    timer.start()
    Subscriber(args.endpoint, args.subscription).run(handle, stop=stop)
    timer.cancel()
    print(f"received {received} deliveries", file=sys.stderr)


if __name__ == "__main__":
    main()
