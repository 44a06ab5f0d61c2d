"""Python client of outbox-gateway: publish events, and consume subscriptions with
acks, nacks, lease extension, reconnects and exactly-once consumption done for you.

::

    from outbox_gateway import Event, Publisher, Subscriber

    with Publisher("http://127.0.0.1:50051") as publisher:
        publisher.publish([Event("order", "o-42", "order.created", {"total": 42})])

    def handle(delivery):
        print(delivery.event.event_type, delivery.event.payload)

    Subscriber("http://127.0.0.1:50051", "billing").run(handle, stop=stop)

The library logs to the ``outbox_gateway`` logger and adds no handler of its own.
"""

import logging

from ._aio import AsyncSubscriber
from ._channel import Tls
from ._events import Delivery, Event, Payload, ReceivedEvent
from ._publisher import AsyncPublisher, Publisher
from ._subscriber import Subscriber
from ._version import __version__
from .errors import (
    DeadLetter,
    InvalidArgumentError,
    OutboxError,
    RefusedError,
    RetryLater,
    UnavailableError,
)

__all__ = [
    "AsyncPublisher",
    "AsyncSubscriber",
    "DeadLetter",
    "Delivery",
    "Event",
    "InvalidArgumentError",
    "OutboxError",
    "Payload",
    "Publisher",
    "ReceivedEvent",
    "RefusedError",
    "RetryLater",
    "Subscriber",
    "Tls",
    "UnavailableError",
    "__version__",
]

logging.getLogger(__name__).addHandler(logging.NullHandler())
