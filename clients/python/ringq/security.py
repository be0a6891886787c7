"""How a client reaches nodes securely: TLS settings, credentials, and the channels made with them.

Responsible for: one `TLS` value that says which CA the client trusts (a PEM file or bytes; None:
the system's trust store) and, optionally, the name the nodes' certificates must carry when it is
not the host dialled (`server_name`), and the client's own certificate and key when it authenticates
with a user certificate (on the nodes' certificate port) instead of a password; `Credentials` (a
user and password, sent with every call as `authorization: Basic ...` metadata); and opening gRPC
channels and stubs with them.
Guarantees: with a `TLS`, a channel completes only with a node whose certificate the CA signed for
the name expected; without one, the channel is plaintext (for a development cluster on loopback).
Credentials are sent with every call made through `authenticated(stub, credentials)`, and never
printed (their repr hides the password).
"""

from __future__ import annotations

import base64
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc


@dataclass(frozen=True)
class TLS:
    """TLS to the nodes: `ca` is the CA's PEM (a path or the bytes; None: system roots). With
    `certificate` and `key` (PEM paths or bytes), the client presents a user certificate: give the
    nodes' certificate-port addresses then, and no Credentials."""

    ca: str | Path | bytes | None = None
    server_name: str | None = None
    certificate: str | Path | bytes | None = None
    key: str | Path | bytes | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if (self.certificate is None) != (self.key is None):
            raise ValueError("TLS: a client certificate and its key go together")

    def credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(_pem(self.ca), _pem(self.key), _pem(self.certificate))

    def options(self) -> list[tuple[str, Any]]:
        return [("grpc.ssl_target_name_override", self.server_name)] if self.server_name else []


def aio_channel(address: str, tls: TLS | None, options: Sequence[tuple[str, Any]] = ()) -> grpc.aio.Channel:
    """An asyncio channel to `address`: TLS as `tls` says, or plaintext if None."""
    if tls is None:
        return grpc.aio.insecure_channel(address, options=list(options))
    return grpc.aio.secure_channel(address, tls.credentials(), options=[*options, *tls.options()])


def channel(address: str, tls: TLS | None, options: Sequence[tuple[str, Any]] = ()) -> grpc.Channel:
    """A blocking channel to `address`: TLS as `tls` says, or plaintext if None."""
    if tls is None:
        return grpc.insecure_channel(address, options=list(options))
    return grpc.secure_channel(address, tls.credentials(), options=[*options, *tls.options()])


def _pem(value: str | Path | bytes | None) -> bytes | None:
    if value is None or isinstance(value, bytes):
        return value
    return Path(value).read_bytes()


@dataclass(frozen=True)
class Credentials:
    """A user and its password."""

    user: str
    password: str = field(repr=False)

    def metadata(self) -> tuple[tuple[str, str], ...]:
        token = base64.b64encode(f"{self.user}:{self.password}".encode()).decode()
        return (("authorization", f"Basic {token}"),)


class _WithMetadata:
    """A stub whose every call carries the same metadata."""

    def __init__(self, stub: Any, metadata: tuple[tuple[str, str], ...]) -> None:
        self._stub = stub
        self._metadata = metadata

    def __getattr__(self, name: str) -> Any:
        return _MethodWithMetadata(getattr(self._stub, name), self._metadata)


class _MethodWithMetadata:
    """One method of a stub, sending the same metadata however it is called: directly (blocking or
    asyncio), or with `.future(...)` / `.with_call(...)` (blocking stubs)."""

    def __init__(self, method: Any, metadata: tuple[tuple[str, str], ...]) -> None:
        self._method = method
        self._metadata = metadata

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._method(*args, metadata=self._metadata, **kwargs)

    def future(self, *args: Any, **kwargs: Any) -> Any:
        return self._method.future(*args, metadata=self._metadata, **kwargs)

    def with_call(self, *args: Any, **kwargs: Any) -> Any:
        return self._method.with_call(*args, metadata=self._metadata, **kwargs)


def authenticated(stub: Any, credentials: Credentials | None) -> Any:
    """`stub`, sending `credentials` with each call (unchanged if None)."""
    return stub if credentials is None else with_metadata(stub, credentials.metadata())


def with_metadata(stub: Any, metadata: tuple[tuple[str, str], ...]) -> Any:
    """`stub`, sending `metadata` with each call (unchanged if empty)."""
    return _WithMetadata(stub, metadata) if metadata else stub
