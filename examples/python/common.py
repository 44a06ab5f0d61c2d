"""Settings shared by the examples.

The gateway endpoint comes from --endpoint or OUTBOX_ENDPOINT (default
http://127.0.0.1:50051), the database from --database-url or DATABASE_URL (default
postgres://postgres@127.0.0.1:5432/outbox): the same names and defaults as the gateway.
"""

import argparse
import os

import grpc
from outbox_gateway.proto import pb, rpc

DEFAULT_ENDPOINT = "http://127.0.0.1:50051"
DEFAULT_DATABASE_URL = "postgres://postgres@127.0.0.1:5432/outbox"


def parser(description, endpoint=False, database=False):
    """An argument parser with the connection options the program needs."""
    args = argparse.ArgumentParser(description=description)
    if endpoint:
        args.add_argument(
            "--endpoint",
            default=os.environ.get("OUTBOX_ENDPOINT", DEFAULT_ENDPOINT),
            help=f"gateway address (env OUTBOX_ENDPOINT; default {DEFAULT_ENDPOINT})",
        )
    if database:
        args.add_argument(
            "--database-url",
            default=os.environ.get("DATABASE_URL", DEFAULT_DATABASE_URL),
            help=f"PostgreSQL URL (env DATABASE_URL; default {DEFAULT_DATABASE_URL})",
        )
    return args


def consumer_parser(description, subscription, database=False):
    """The options of the consuming programs."""
    args = parser(description, endpoint=True, database=database)
    args.add_argument("--subscription", default=subscription)
    args.add_argument(
        "--max-deliveries", type=int, default=0, help="stop after this many (0: no limit)"
    )
    args.add_argument("--timeout", type=float, default=30, help="stop after this many seconds")
    return args


def ensure_subscription(endpoint, name):
    """Creates the subscription unless it exists, with the Admin stub the package ships.
    A new one starts at the earliest retained event, so it also sees events published
    before the consumer first ran."""
    subscription = pb.Subscription(
        name=name,
        event_types=["order.*"],
        start=pb.StartPosition(boundary=pb.BOUNDARY_EARLIEST),
    )
    with grpc.insecure_channel(endpoint.removeprefix("http://")) as channel:
        try:
            rpc.AdminStub(channel).CreateSubscription(
                pb.CreateSubscriptionRequest(subscription=subscription)
            )
        except grpc.RpcError as error:
            if error.code() != grpc.StatusCode.ALREADY_EXISTS:
                raise
