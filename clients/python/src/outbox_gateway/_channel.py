"""How the client reaches the gateway: the endpoint, TLS and bearer token turned into a
gRPC channel (blocking or asyncio), which failures are worth retrying, and the one
backoff policy (the publisher's retries and the subscriber's reconnects)."""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from os import PathLike
from pathlib import Path
from typing import Any, Union

import grpc
import grpc.aio

from .errors import InvalidArgumentError

__all__ = ["Tls"]

FIRST_DELAY = 0.1
MAX_DELAY = 10.0

# grpcio's own reconnect backoff grows to two minutes: a gateway back after a restart
# would go unnoticed that long. The subscriber has its own backoff on top.
CHANNEL_OPTIONS: list[tuple[str, Any]] = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", int(MAX_DELAY * 1000)),
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
]

_PEM = Union[bytes, str, PathLike]


@dataclass(frozen=True)
class Tls:
    """TLS settings: the CA that signed the gateway's certificate (default: the system's
    roots), and a client certificate and key for gateways that require mutual TLS. Each
    is PEM, given as ``bytes`` or as the path of a file."""

    ca_certificate: _PEM | None = None
    certificate: _PEM | None = None
    private_key: _PEM | None = None

    def credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(
            root_certificates=_pem("tls.ca_certificate", self.ca_certificate),
            private_key=_pem("tls.private_key", self.private_key),
            certificate_chain=_pem("tls.certificate", self.certificate),
        )


def _pem(name: str, value: _PEM | None) -> bytes | None:
    if value is None or isinstance(value, bytes):
        return value
    try:
        return Path(value).read_bytes()
    except OSError as error:
        raise InvalidArgumentError(name, f"cannot read {value}: {error.strerror}") from None


TlsOption = Union[bool, Tls, grpc.ChannelCredentials, None]


@dataclass(frozen=True)
class Target:
    """A checked endpoint with its credentials and call metadata."""

    address: str
    credentials: grpc.ChannelCredentials | None
    metadata: tuple[tuple[str, str], ...]
    options: tuple[tuple[str, Any], ...]

    def channel(self) -> grpc.Channel:
        if self.credentials is None:
            return grpc.insecure_channel(self.address, options=self.options)
        return grpc.secure_channel(self.address, self.credentials, options=self.options)

    def aio_channel(self) -> grpc.aio.Channel:
        if self.credentials is None:
            return grpc.aio.insecure_channel(self.address, options=self.options)
        return grpc.aio.secure_channel(self.address, self.credentials, options=self.options)


def target(
    endpoint: str,
    token: str | None,
    tls: TlsOption,
    options: Sequence[tuple[str, Any]] | None = None,
) -> Target:
    """Checks the connection settings: `endpoint` is ``host:port``, ``http://host:port``
    or ``https://host:port`` (TLS); `tls` turns TLS on (True, :class:`Tls` or gRPC
    channel credentials) or off (False); `token` is sent as ``authorization: Bearer``."""
    if not isinstance(endpoint, str) or not endpoint.strip():
        raise InvalidArgumentError("endpoint", "must be a non-empty string such as 'http://127.0.0.1:50051'")
    address = endpoint.strip()
    scheme_tls = None
    for scheme, secure in (("http://", False), ("https://", True)):
        if address.startswith(scheme):
            address, scheme_tls = address[len(scheme) :], secure
    address = address.rstrip("/")
    if not address or "/" in address:
        raise InvalidArgumentError("endpoint", f"{endpoint!r} must be host:port, optionally after http:// or https://")
    if isinstance(tls, grpc.ChannelCredentials):
        credentials: grpc.ChannelCredentials | None = tls
    elif isinstance(tls, Tls):
        credentials = tls.credentials()
    elif tls is True or (tls is None and scheme_tls):
        credentials = grpc.ssl_channel_credentials()
    elif tls is None or tls is False:
        credentials = None
    else:
        raise InvalidArgumentError("tls", f"must be a bool, Tls or grpc.ChannelCredentials, got {type(tls).__name__}")
    metadata: tuple[tuple[str, str], ...] = ()
    if token is not None:
        if not isinstance(token, str) or not token or not token.isprintable() or not token.isascii():
            raise InvalidArgumentError("token", "must be a non-empty string of printable ASCII")
        metadata = (("authorization", f"Bearer {token}"),)
    return Target(address, credentials, metadata, tuple(CHANNEL_OPTIONS) + tuple(options or ()))


_TRANSIENT = {
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.ABORTED,
    grpc.StatusCode.UNKNOWN,
    grpc.StatusCode.CANCELLED,
}


def is_transient(error: grpc.RpcError) -> bool:
    """Failures worth retrying: the gateway or its database may come back. A connection
    cut mid-call surfaces as UNKNOWN or CANCELLED too, and a stream reset by a gateway
    that shuts down as INTERNAL "h2 protocol error"."""
    code = error.code() if hasattr(error, "code") else None
    if code in _TRANSIENT:
        return True
    details = (error.details() if hasattr(error, "details") else "") or ""
    return code == grpc.StatusCode.INTERNAL and (
        "h2 protocol error" in details or "RST_STREAM" in details
    )


class Backoff:
    """Delays doubling from 100 ms to at most 10 s, with a little jitter so that many
    clients do not come back at once; :meth:`reset` starts over."""

    def __init__(self) -> None:
        self._next = FIRST_DELAY

    def next_delay(self) -> float:
        delay = self._next
        self._next = min(self._next * 2, MAX_DELAY)
        return delay * random.uniform(0.8, 1.0)

    def reset(self) -> None:
        self._next = FIRST_DELAY
