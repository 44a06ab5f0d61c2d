"""Publishes events over gRPC (outbox.v1.Publisher/Publish) and prints their ids."""

import json
import uuid

from common import channel, parser, pb, rpc


def event(order_id, event_type, payload):
    return pb.EventInput(
        aggregate_type="order",
        aggregate_id=order_id,
        event_type=event_type,
        payload=json.dumps(payload).encode(),
        metadata={"source": "python-example"},
    )


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
        event(order_id, "order.created", {"total": 42}),
        event(order_id, "order.paid", {"amount": 42}),
    ]
    if args.poison:
        events.append(event(f"o-{uuid.uuid4().hex[:8]}", "order.created", {"poison": True}))

    with channel(args.endpoint) as ch:
        # The batch is stored atomically: every event or none.
        response = rpc.PublisherStub(ch).Publish(pb.PublishRequest(events=events))
    for result in response.results:
        print(result.id)


if __name__ == "__main__":
    main()
