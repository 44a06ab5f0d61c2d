"""Publishes a batch of events with outbox_gateway.Publisher and prints their ids."""

import uuid

from common import parser
from outbox_gateway import Event, Publisher


def order_event(order_id, event_type, payload):
    # A dict payload is sent as JSON.
    return Event("order", order_id, event_type, payload, metadata={"source": "python-example"})


def main():
    args = parser(__doc__, endpoint=True)
    args.add_argument(
        "--poison",
        action="store_true",
        help='also publish an event with payload {"poison": true}',
    )
    args = args.parse_args()

    order_id = f"o-{uuid.uuid4().hex[:8]}"
    events = [
        order_event(order_id, "order.created", {"total": 42}),
        order_event(order_id, "order.paid", {"amount": 42}),
    ]
    if args.poison:
        events.append(order_event(f"o-{uuid.uuid4().hex[:8]}", "order.created", {"poison": True}))

    with Publisher(args.endpoint) as publisher:
        # The batch is stored atomically: every event or none.
        for event_id in publisher.publish(events):
            print(event_id)


if __name__ == "__main__":
    main()
