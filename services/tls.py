"""Cluster identity: who a cluster member is, proven with mutual TLS.

Responsible for: loading a member's CA certificate, certificate and key; the gRPC credentials of
the cluster port (a client certificate signed by the cluster CA is required), of the client port
(TLS, no client certificate) and of a node's optional certificate port (clients must present a
certificate of the cluster CA, which names their user); opening channels to other members that
check the far end is the member meant; and reading which member or user a certificate proves.

Identity lives in the certificate's DNS subject alternative names, so gRPC's own name check
verifies it when dialling (the channel's target name is overridden with the identity, so the
host or IP a member is reached at does not matter):
  - node `ID`:        `ID.node.ringq`
  - any coordinator:  `coordinator.ringq`
A certificate may carry other names too (the host names clients use for the client port).
A user's certificate carries no member identity; its subject's common name is the user's name.

Guarantees: with TLS on, a caller of the cluster port holds a certificate of the cluster CA, and
`caller()` names the one member identity it carries (a certificate naming two identities, or a
node id that is not a valid one, proves nothing); a channel to node X or to a coordinator
completes its handshake only with a certificate naming X or a coordinator. With TLS off
(plaintext, for development on loopback) nothing is proven and `caller()` returns None.
"""

from __future__ import annotations

import argparse
import ipaddress
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from services.arguments import node_id_problem

log = logging.getLogger("ringq.tls")

NODE_NAME_SUFFIX = ".node.ringq"
COORDINATOR_NAME = "coordinator.ringq"


@dataclass(frozen=True)
class Identity:
    """A proven cluster member: a node (with its id) or a coordinator."""

    role: str  # "node" or "coordinator"
    node: str = ""  # the node id, for a node

    def __str__(self) -> str:
        return f"node {self.node}" if self.role == "node" else "a coordinator"


def node_name(node_id: str) -> str:
    """The DNS name a node's certificate carries."""
    return f"{node_id}{NODE_NAME_SUFFIX}"


def identity_of(names: Sequence[str]) -> Identity | None:
    """The one member identity among a certificate's DNS names, or None (none, or more than one)."""
    found: set[Identity] = set()
    for name in names:
        if name == COORDINATOR_NAME:
            found.add(Identity("coordinator"))
        elif name.endswith(NODE_NAME_SUFFIX):
            node_id = name[: -len(NODE_NAME_SUFFIX)]
            if node_id_problem(node_id) is None:
                found.add(Identity("node", node_id))
    return found.pop() if len(found) == 1 else None


def caller(context: Any) -> Identity | None:
    """The member identity proven by the certificate of the client that made this call, or None."""
    auth = context.auth_context()
    names = [name.decode("utf-8", "replace") for name in auth.get("x509_subject_alternative_name", [])]
    return identity_of(names)


def certificate_user(context: Any) -> str | None:
    """The user a client certificate names (its subject's common name), or None: no certificate (the
    client port asks for none), or a member's certificate, which acts for the cluster, not a user."""
    auth = context.auth_context()
    if caller(context) is not None:
        return None
    names = auth.get("x509_common_name", [])
    return names[0].decode("utf-8", "replace") if len(names) == 1 else None


def secured(context: Any) -> bool:
    """Whether this call came over TLS (else: plaintext, where nothing is proven)."""
    return b"ssl" in context.auth_context().get("transport_security_type", [])


def member_problem(context: Any) -> str | None:
    """Why this call may not use a cluster port (over TLS: no member identity), or None."""
    if secured(context) and caller(context) is None:
        return "only cluster members may call this port: present a node or coordinator certificate of the cluster CA"
    return None


def acting_for_problem(context: Any, node: str) -> str | None:
    """Why this call may not act for node `node` (over TLS: its certificate names another), or None."""
    if not secured(context):
        return None
    identity = caller(context)
    if identity is None or identity.role != "node" or identity.node != node:
        return f"{identity or 'a caller without a member certificate'} may not act for node {node!r}"
    return None


class TLSConfigError(Exception):
    """The TLS files cannot be used (missing, unreadable, or not PEM)."""


@dataclass(frozen=True)
class ClusterTLS:
    """One member's TLS material: the cluster CA, its certificate and its private key (PEM)."""

    ca: bytes
    certificate: bytes
    key: bytes

    @classmethod
    def from_files(cls, ca: str | Path, certificate: str | Path, key: str | Path) -> ClusterTLS:
        parts = []
        for what, path in (("CA certificate", ca), ("certificate", certificate), ("private key", key)):
            try:
                data = Path(path).read_bytes()
            except OSError as error:
                raise TLSConfigError(f"cannot read the {what} {path}: {error.strerror}") from None
            if b"-----BEGIN " not in data:
                raise TLSConfigError(f"the {what} {path} is not PEM")
            parts.append(data)
        return cls(*parts)

    def cluster_server_credentials(self) -> grpc.ServerCredentials:
        """The cluster port: callers must present a certificate of the cluster CA."""
        return grpc.ssl_server_credentials(
            [(self.key, self.certificate)], root_certificates=self.ca, require_client_auth=True
        )

    def client_server_credentials(self) -> grpc.ServerCredentials:
        """The client port: TLS with this member's certificate; clients authenticate as users."""
        return grpc.ssl_server_credentials([(self.key, self.certificate)])

    def certificate_server_credentials(self) -> grpc.ServerCredentials:
        """A node's certificate port: clients must present a certificate of the cluster CA, whose common
        name is their user (RabbitMQ's EXTERNAL mechanism); no password is asked."""
        return self.cluster_server_credentials()

    def channel_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(self.ca, self.key, self.certificate)


class Dialer:
    """Opens channels from this member to other members: TLS checking who answers, or plaintext."""

    def __init__(self, tls: ClusterTLS | None) -> None:
        self.tls = tls

    def to_node(self, node_id: str, address: str, options: Sequence[tuple[str, Any]] = ()) -> grpc.aio.Channel:
        return self._channel(address, node_name(node_id), options)

    def to_coordinator(self, address: str, options: Sequence[tuple[str, Any]] = ()) -> grpc.aio.Channel:
        return self._channel(address, COORDINATOR_NAME, options)

    def _channel(self, address: str, name: str, options: Sequence[tuple[str, Any]]) -> grpc.aio.Channel:
        if self.tls is None:
            return grpc.aio.insecure_channel(address, options=list(options))
        return grpc.aio.secure_channel(
            address,
            self.tls.channel_credentials(),
            options=[*options, ("grpc.ssl_target_name_override", name)],
        )


PLAINTEXT = Dialer(None)


def is_loopback(address: str) -> bool:
    """Whether HOST:PORT names this machine only (127.0.0.0/8, ::1 or localhost)."""
    host = address.rsplit(":", 1)[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """--tls-ca, --tls-cert, --tls-key: a member's TLS material (all three, or none for plaintext)."""
    group = parser.add_argument_group("TLS (all three, or none for plaintext on loopback, for development)")
    group.add_argument("--tls-ca", metavar="PEM", help="the cluster CA certificate")
    group.add_argument("--tls-cert", metavar="PEM", help="this member's certificate, signed by the cluster CA")
    group.add_argument("--tls-key", metavar="PEM", help="this member's private key")


def from_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace, listen: str) -> ClusterTLS | None:
    """The TLS material the flags name; None (plaintext, with a warning) if none is named."""
    given = [args.tls_ca, args.tls_cert, args.tls_key]
    if not any(given):
        where = "on loopback only" if is_loopback(listen) else f"on {listen}, which is not loopback"
        log.warning(
            "serving PLAINTEXT %s: no member proves who it is and no client is authenticated; "
            "for development only (give --tls-ca, --tls-cert and --tls-key: docs/security.md)",
            where,
        )
        return None
    if not all(given):
        parser.error("--tls-ca, --tls-cert and --tls-key go together")
    try:
        return ClusterTLS.from_files(args.tls_ca, args.tls_cert, args.tls_key)
    except TLSConfigError as error:
        parser.error(str(error))
