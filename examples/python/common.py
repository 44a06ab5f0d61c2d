"""Settings and gRPC stubs shared by the examples.

The gateway endpoint comes from --endpoint or OUTBOX_ENDPOINT (default
http://127.0.0.1:50051), the database from --database-url or DATABASE_URL (default
postgres://postgres@127.0.0.1:5432/outbox): the same names and defaults as the gateway.
"""

import argparse
import os
import sys
from pathlib import Path

import grpc

GENERATED = Path(__file__).resolve().parent / "generated"
if not (GENERATED / "outbox" / "v1" / "outbox_pb2.py").exists():
    sys.exit(f"no gRPC stubs in {GENERATED}: run ./generate.sh first")
sys.path.insert(0, str(GENERATED))

from outbox.v1 import outbox_pb2 as pb  # noqa: E402
from outbox.v1 import outbox_pb2_grpc as rpc  # noqa: E402

__all__ = ["channel", "ensure_subscription", "parser", "pb", "rpc"]

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


def channel(endpoint):
    """A plaintext channel; grpcio wants host:port, so an http:// prefix is dropped."""
    return grpc.insecure_channel(endpoint.removeprefix("http://"))


def ensure_subscription(admin, name):
    """Creates the subscription unless it exists. A new one starts at the earliest
    retained event, so it also sees events published before the consumer first ran."""
    subscription = pb.Subscription(
        name=name,
        event_types=["order.*"],
        start=pb.StartPosition(boundary=pb.BOUNDARY_EARLIEST),
    )
    try:
        admin.CreateSubscription(pb.CreateSubscriptionRequest(subscription=subscription))
    except grpc.RpcError as error:
        if error.code() != grpc.StatusCode.ALREADY_EXISTS:
            raise
