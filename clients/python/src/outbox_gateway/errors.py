"""The exceptions the client raises, and the ones a handler raises to steer a nack."""

from __future__ import annotations

import re
from datetime import timedelta

import grpc

__all__ = [
    "DeadLetter",
    "InvalidArgumentError",
    "OutboxError",
    "RefusedError",
    "RetryLater",
    "UnavailableError",
]

# The gateway names the offending field first: "events[0].aggregate_id: must not be empty".
_FIELD = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*(?:\[\d+\])?(?:\.[A-Za-z_][A-Za-z0-9_]*(?:\[\d+\])?)*): ")


class OutboxError(Exception):
    """Base class of every error the client raises.

    Attributes:
        code: the gRPC status code (``INVALID_ARGUMENT`` for input refused before any
            call), or ``None`` when no call was involved.
        field: the field the error is about, e.g. ``"events[0].aggregate_id"``, when
            there is one.
        message: what went wrong, without the field.
    """

    def __init__(self, message: str, *, code: grpc.StatusCode | None = None, field: str | None = None):
        super().__init__(f"{field}: {message}" if field else message)
        self.code = code
        self.field = field
        self.message = message


class InvalidArgumentError(OutboxError, ValueError):
    """Input the client refuses at once, before any call: ``field`` names it."""

    def __init__(self, field: str, message: str):
        super().__init__(message, code=grpc.StatusCode.INVALID_ARGUMENT, field=field)


class RefusedError(OutboxError):
    """The gateway refused the call and retrying it unchanged cannot help (bad input,
    an unknown subscription, a missing permission). ``code`` is the gRPC status code and
    ``field`` the field the gateway named, if any."""

    @classmethod
    def from_rpc(cls, error: grpc.RpcError) -> RefusedError:
        code, details = _status(error)
        match = _FIELD.match(details)
        if match:
            return cls(details[match.end() :], code=code, field=match.group(1))
        return cls(details, code=code)


class UnavailableError(OutboxError):
    """The gateway (or its database) could not be reached, after the retries allowed."""

    @classmethod
    def from_rpc(cls, error: grpc.RpcError) -> UnavailableError:
        code, details = _status(error)
        return cls(details or code.name, code=code)


def _status(error: grpc.RpcError) -> tuple[grpc.StatusCode, str]:
    code = error.code() if hasattr(error, "code") else grpc.StatusCode.UNKNOWN
    details = error.details() if hasattr(error, "details") else str(error)
    return code, details or ""


class RetryLater(Exception):
    """Raise from a handler to nack with a delay of your own instead of the
    subscription's backoff::

        raise RetryLater("rate limited", after=30)
    """

    def __init__(self, reason: str = "retry later", *, after: float | timedelta):
        super().__init__(reason)
        self.reason = reason
        self.after = after.total_seconds() if isinstance(after, timedelta) else float(after)


class DeadLetter(Exception):
    """Raise from a handler for a failure no retry can fix: the event goes to the
    subscription's dead-letter queue at once (unless its type is listed in the
    subscription's ``persistent_event_types``)."""

    def __init__(self, reason: str = "dead-lettered by the consumer"):
        super().__init__(reason)
        self.reason = reason
