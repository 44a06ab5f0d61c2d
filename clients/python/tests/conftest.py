"""Fixtures of the client's tests: gateway processes started from the binary that
OUTBOX_GATEWAY_BIN names, on the PostgreSQL database OUTBOX_TEST_DATABASE_URL names
(shared by every test: each uses subscriptions and aggregate types of its own), and
helpers that poll with a deadline instead of sleeping."""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import grpc
import pytest
from google.protobuf.duration_pb2 import Duration

from outbox_gateway._proto.outbox.v1 import outbox_pb2 as pb
from outbox_gateway._proto.outbox.v1 import outbox_pb2_grpc as rpc

# Generous, for a loaded two-core machine.
START_TIME = 60.0
WAIT_TIME = 60.0
POLL = 0.05

T = TypeVar("T")


def setting(name: str) -> str:
    value = os.environ.get(name)
    if not value:
        pytest.fail(
            f"set {name}: the tests need OUTBOX_GATEWAY_BIN (the outbox-gateway binary) and "
            "OUTBOX_TEST_DATABASE_URL (a PostgreSQL database they may fill)",
            pytrace=False,
        )
    return value


def eventually(what: str, check: Callable[[], T], within: float = WAIT_TIME) -> T:
    """Polls `check` until it returns something truthy, and returns that; fails naming
    `what` when it still does not after `within` seconds."""
    deadline = time.monotonic() + within
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {within:g} s waiting until {what} (last: {value!r})")
        time.sleep(POLL)


def unique(prefix: str) -> str:
    """A name no other test uses: subscriptions and aggregate types are per test."""
    return f"{prefix}-{uuid.uuid4().hex[:10]}"


def seconds(value: float) -> Duration:
    duration = Duration()
    duration.FromMilliseconds(int(value * 1000))
    return duration


class Gateway:
    """An outbox-gateway process; it can be killed and started again on the same port."""

    def __init__(self, binary: str, database_url: str, log_dir: Path):
        self.binary = binary
        self.database_url = database_url
        self.log_dir = log_dir
        self.port = 0
        self.process: subprocess.Popen | None = None
        self.log_path: Path | None = None
        self.starts = 0
        self.channel: grpc.Channel | None = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        """Starts the gateway (on a port of its choosing the first time, the same port
        after that) and waits until it reports SERVING."""
        self.starts += 1
        self.log_path = self.log_dir / f"gateway-{os.getpid()}-{id(self)}-{self.starts}.log"
        log = open(self.log_path, "wb")
        environment = {key: value for key, value in os.environ.items() if key != "RUST_LOG"}
        self.process = subprocess.Popen(
            [
                self.binary,
                "serve",
                "--listen",
                f"127.0.0.1:{self.port}",
                "--database-url",
                self.database_url,
                "--metrics-listen",
                "off",
                "--console-listen",
                "off",
            ],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=environment,
        )
        log.close()
        if self.port == 0:
            self.port = eventually("the gateway announces its gRPC address", self._announced_port, START_TIME)
        self.channel = grpc.insecure_channel(f"127.0.0.1:{self.port}")
        eventually("the gateway serves", self._serving, START_TIME)

    def _running(self) -> None:
        assert self.process is not None
        if self.process.poll() is not None:
            pytest.fail(f"the gateway exited ({self.process.returncode}):\n{self.log()}")

    def _announced_port(self) -> int | None:
        self._running()
        match = re.search(r"serving gRPC.*?address=127\.0\.0\.1:(\d+)", self.log())
        return int(match.group(1)) if match else None

    def _serving(self) -> bool:
        self._running()
        assert self.channel is not None
        check = self.channel.unary_unary(
            "/grpc.health.v1.Health/Check",
            request_serializer=lambda request: request,
            response_deserializer=lambda response: response,
        )
        try:
            # An empty HealthCheckRequest; SERVING is status 1 (field 1, varint).
            return check(b"", timeout=2) == b"\x08\x01"
        except grpc.RpcError:
            return False

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path else ""

    def kill(self) -> None:
        """SIGKILL: no graceful shutdown, no leases given back."""
        assert self.process is not None
        self.process.kill()
        self.process.wait(timeout=30)
        if self.channel is not None:
            self.channel.close()
            self.channel = None

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self.channel is not None:
            self.channel.close()
            self.channel = None

    @property
    def admin(self) -> rpc.AdminStub:
        assert self.channel is not None
        return rpc.AdminStub(self.channel)

    def create_subscription(
        self,
        aggregate_type: str,
        *,
        ack_deadline: float = 10.0,
        retry_backoff_min: float = 0.2,
        max_attempts: int = 10,
        **fields: Any,
    ) -> str:
        """A new subscription to the events of `aggregate_type`; returns its name."""
        name = unique("sub")
        self.admin.CreateSubscription(
            pb.CreateSubscriptionRequest(
                subscription=pb.Subscription(
                    name=name,
                    aggregate_types=[aggregate_type],
                    ack_deadline=seconds(ack_deadline),
                    retry_backoff_min=seconds(retry_backoff_min),
                    retry_backoff_max=seconds(max(retry_backoff_min, 1.0)),
                    max_attempts=max_attempts,
                    start=pb.StartPosition(boundary=pb.BOUNDARY_EARLIEST),
                    **fields,
                )
            ),
            timeout=30,
        )
        return name

    def stats(self, subscription: str) -> pb.SubscriptionStats:
        stats = self.admin.GetStats(pb.GetStatsRequest(subscription=subscription), timeout=30)
        return stats.subscriptions[0]

    def settled(self, subscription: str, acked: int) -> bool:
        """Whether every event of the subscription is settled, `acked` of them acked."""
        stats = self.stats(subscription)
        return stats.lag_events == 0 and stats.acked_total == acked


@pytest.fixture(scope="session")
def gateway_binary() -> str:
    return setting("OUTBOX_GATEWAY_BIN")


@pytest.fixture(scope="session")
def database_url() -> str:
    return setting("OUTBOX_TEST_DATABASE_URL")


@pytest.fixture(scope="session")
def log_dir() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="outbox-client-tests-") as directory:
        yield Path(directory)


@pytest.fixture(scope="session")
def gateway(gateway_binary: str, database_url: str, log_dir: Path) -> Iterator[Gateway]:
    """One gateway the tests share."""
    gateway = Gateway(gateway_binary, database_url, log_dir)
    gateway.start()
    yield gateway
    gateway.stop()


@pytest.fixture
def own_gateway(gateway_binary: str, database_url: str, log_dir: Path) -> Iterator[Gateway]:
    """A gateway of the test's own, to kill and restart."""
    gateway = Gateway(gateway_binary, database_url, log_dir)
    gateway.start()
    yield gateway
    gateway.stop()


class Background:
    """Runs `target` (a subscriber's run) on a thread; `finish` sets the stop event and
    waits for it, re-raising what it raised."""

    def __init__(self, target: Callable[..., None], *args: Any, stop: threading.Event, **kwargs: Any):
        self.stop = stop
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, args=(target, args, kwargs), daemon=True)
        self.thread.start()

    def _run(self, target: Callable[..., None], args: Any, kwargs: Any) -> None:
        try:
            target(*args, stop=self.stop, **kwargs)
        except BaseException as error:  # reported by finish
            self.error = error

    def alive(self) -> bool:
        return self.thread.is_alive()

    def finish(self, within: float = WAIT_TIME) -> None:
        self.stop.set()
        self.thread.join(within)
        assert not self.thread.is_alive(), f"run did not return within {within:g} s of stop"
        if self.error is not None:
            raise self.error


class Recorder:
    """What a handler saw, safe to share between handler threads."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.deliveries: list[Any] = []

    def add(self, delivery: Any) -> None:
        with self.lock:
            self.deliveries.append(delivery)

    def ids(self) -> set[str]:
        with self.lock:
            return {delivery.event.id for delivery in self.deliveries}

    def attempts(self, event_id: str) -> list[int]:
        with self.lock:
            return [d.attempt for d in self.deliveries if d.event.id == event_id]

    def __len__(self) -> int:
        with self.lock:
            return len(self.deliveries)
