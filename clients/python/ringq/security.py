"""How a client reaches nodes securely: TLS settings, and the channels made with them.

Responsible for: one `TLS` value that says which CA the client trusts (a PEM file or bytes; None:
the system's trust store) and, optionally, the name the nodes' certificates must carry when it is
not the host dialled (`server_name`); and opening gRPC channels with it, or plaintext without it.
Guarantees: with a `TLS`, a channel completes only with a node whose certificate the CA signed for
the name expected; without one, the channel is plaintext (for a development cluster on loopback).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc


@dataclass(frozen=True)
class TLS:
    """TLS to the nodes' client port: `ca` is the CA's PEM (a path or the bytes; None: system roots)."""

    ca: str | Path | bytes | None = None
    server_name: str | None = None

    def ca_bytes(self) -> bytes | None:
        if self.ca is None or isinstance(self.ca, bytes):
            return self.ca
        return Path(self.ca).read_bytes()

    def options(self) -> list[tuple[str, Any]]:
        return [("grpc.ssl_target_name_override", self.server_name)] if self.server_name else []


def aio_channel(address: str, tls: TLS | None, options: Sequence[tuple[str, Any]] = ()) -> grpc.aio.Channel:
    """An asyncio channel to `address`: TLS as `tls` says, or plaintext if None."""
    if tls is None:
        return grpc.aio.insecure_channel(address, options=list(options))
    credentials = grpc.ssl_channel_credentials(tls.ca_bytes())
    return grpc.aio.secure_channel(address, credentials, options=[*options, *tls.options()])


def channel(address: str, tls: TLS | None, options: Sequence[tuple[str, Any]] = ()) -> grpc.Channel:
    """A blocking channel to `address`: TLS as `tls` says, or plaintext if None."""
    if tls is None:
        return grpc.insecure_channel(address, options=list(options))
    credentials = grpc.ssl_channel_credentials(tls.ca_bytes())
    return grpc.secure_channel(address, credentials, options=[*options, *tls.options()])
