"""The exceptions of the ringq SDK: what a call or a stream failed with, one class per kind of failure.

Responsible for: turning a gRPC status into a `RingqError` subclass in one place (`from_rpc_error`), with a
one-line message, and the two errors about reaching the cluster: `ConnectionFailed` (no node accepted a
connection within the connection's `connect_timeout`) and `Unavailable` (the cluster answered, then calls
kept failing with UNAVAILABLE until the retries ran out); both name every address tried and what each said
last.

Guarantees: every failure of a call or a stream that the blocking API (`ringq.Connection`, `ringq.Admin`),
the asyncio API (`ringq.aio`) and `ringq.group` report is a `RingqError`, never a raw `grpc.RpcError`;
`str(error)` is one line; `.code` is the gRPC status code (a `grpc.StatusCode`) and `.details` the text
the node sent with it, for those who need them. Mistakes found before anything is sent (a bad argument)
stay `ValueError` / `TypeError`.

    try:
        connection.queue_status("orders")
    except ringq.errors.NotFound:
        ...
    except ringq.errors.ConnectionFailed as error:
        print(error.attempts)          # {"127.0.0.1:7101": "connection refused", ...}
"""

from __future__ import annotations

from collections.abc import Mapping

import grpc

__all__ = [
    "AccessRefused",
    "AlreadyExists",
    "ConnectionFailed",
    "InvalidArgument",
    "NotFound",
    "PermissionDenied",
    "PreconditionFailed",
    "ResourceExhausted",
    "RingqError",
    "Unauthenticated",
    "Unavailable",
    "from_rpc_error",
    "one_line",
]


def one_line(text: str, limit: int = 300) -> str:
    """`text` on one line (whitespace runs become one space), cut to `limit` characters."""
    flat = " ".join(text.split())
    return flat if len(flat) <= limit else flat[: limit - 1] + "…"


class RingqError(Exception):
    """A call or stream of the SDK failed. `code`: the gRPC status code; `details`: the node's text;
    `address`: the node that answered so (None when no single node did)."""

    def __init__(
        self,
        message: str,
        *,
        code: grpc.StatusCode = grpc.StatusCode.UNKNOWN,
        details: str = "",
        address: str | None = None,
    ) -> None:
        super().__init__(one_line(message, 1000))
        self.code = code
        self.details = details
        self.address = address

    def __reduce__(self) -> tuple[object, ...]:  # keyword-only fields survive pickling (Spark workers)
        return (_rebuild, (type(self), str(self), self.code, self.details, self.address, self.__dict__))


def _rebuild(
    kind: type[RingqError],
    message: str,
    code: grpc.StatusCode,
    details: str,
    address: str | None,
    state: dict[str, object],
) -> RingqError:
    error = Exception.__new__(kind)
    Exception.__init__(error, message)
    error.__dict__.update(state)
    error.code, error.details, error.address = code, details, address
    return error


class NotFound(RingqError):
    """NOT_FOUND: the queue (vhost, user, policy, ...) does not exist."""


class AlreadyExists(RingqError):
    """ALREADY_EXISTS."""


class PreconditionFailed(RingqError):
    """FAILED_PRECONDITION: the request contradicts the current state (a queue redeclared with other
    properties, an unknown delivery tag, a node still alive for forget_node, ...)."""


class AccessRefused(RingqError):
    """The cluster refused who is asking (RabbitMQ's ACCESS_REFUSED): see the two subclasses."""


class Unauthenticated(AccessRefused):
    """UNAUTHENTICATED: no credentials, or wrong ones."""


class PermissionDenied(AccessRefused):
    """PERMISSION_DENIED: the user may not do this here (its permissions, or guest from afar)."""


class InvalidArgument(RingqError):
    """INVALID_ARGUMENT (or OUT_OF_RANGE): a name, argument, policy or message the cluster refuses; the
    message names it."""


class ResourceExhausted(RingqError):
    """RESOURCE_EXHAUSTED: a limit (queues per vhost, a disk alarm for persistent publishes, ...)."""


class Unavailable(RingqError):
    """UNAVAILABLE: the cluster kept failing calls after the retries (`retry_for` seconds without
    progress). `attempts` maps each address tried to what it said last."""

    def __init__(
        self,
        message: str,
        *,
        code: grpc.StatusCode = grpc.StatusCode.UNAVAILABLE,
        details: str = "",
        address: str | None = None,
        attempts: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message, code=code, details=details, address=address)
        self.attempts: dict[str, str] = dict(attempts or {})

    @property
    def addresses(self) -> list[str]:
        """The addresses tried, in the order given."""
        return list(self.attempts)


class ConnectionFailed(Unavailable):
    """No node accepted a connection within `connect_timeout` seconds: the cluster is down, the addresses
    are wrong, or TLS does not match. `attempts` maps every address to why it failed."""


_BY_CODE: dict[grpc.StatusCode, type[RingqError]] = {
    grpc.StatusCode.NOT_FOUND: NotFound,
    grpc.StatusCode.ALREADY_EXISTS: AlreadyExists,
    grpc.StatusCode.FAILED_PRECONDITION: PreconditionFailed,
    grpc.StatusCode.UNAUTHENTICATED: Unauthenticated,
    grpc.StatusCode.PERMISSION_DENIED: PermissionDenied,
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgument,
    grpc.StatusCode.OUT_OF_RANGE: InvalidArgument,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ResourceExhausted,
    grpc.StatusCode.UNAVAILABLE: Unavailable,
}


def status_of(error: grpc.RpcError) -> tuple[grpc.StatusCode, str]:
    """The status code and details of a gRPC error (UNKNOWN and its text if it carries none)."""
    code_of = getattr(error, "code", None)
    details_of = getattr(error, "details", None)
    code = code_of() if callable(code_of) else None
    details = details_of() if callable(details_of) else None
    return (code if isinstance(code, grpc.StatusCode) else grpc.StatusCode.UNKNOWN), (details or str(error))


def from_rpc_error(error: grpc.RpcError, address: str | None = None) -> RingqError:
    """The RingqError for a gRPC error a node (at `address`, if known) answered with."""
    code, details = status_of(error)
    where = f" (node {address})" if address else ""
    return _BY_CODE.get(code, RingqError)(f"{code.name}: {details}{where}", code=code, details=details, address=address)


def describe(error: BaseException) -> str:
    """What an attempt failed with, on one line, for `attempts`."""
    if isinstance(error, grpc.RpcError):
        code, details = status_of(error)
        return one_line(f"{code.name}: {details}", 200)
    return one_line(f"{type(error).__name__}: {error}", 200)


def attempts_text(attempts: Mapping[str, str]) -> str:
    """`a:1 (why); b:2 (why)`: every address and what it said last."""
    return "; ".join(f"{address} ({why})" for address, why in attempts.items())
