"""`ringq certs`: a cluster CA and member certificates for development and tests.

Responsible for: making a CA (kept in DIR/ca.pem and DIR/ca.key) and, signed by it, the certificate
and key of a node (DIR/node-ID.pem, .key) or of the coordinators (DIR/coordinator.pem, .key), with
the identity names services/tls.py checks and the host names clients dial, or of a user
(DIR/user-NAME.pem, .key: the user's name as common name, no member identity, client use only). Private keys are written
with mode 0600 and never overwritten; an existing CA is reused, so certificates made later join the
same cluster. Production clusters may use their own PKI instead: docs/security.md says what a
certificate must carry.
"""

from __future__ import annotations

import datetime
import hashlib
import ipaddress
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from services.tls import COORDINATOR_NAME, ClusterTLS, node_name

CA_DAYS = 3650
MEMBER_DAYS = 825  # what browsers accept for a leaf: a development cluster outlives a year
DEFAULT_HOSTS = ("localhost", "127.0.0.1")


@dataclass(frozen=True)
class Issued:
    """Paths of a certificate and its key."""

    certificate: Path
    key: Path


def ca_paths(directory: Path) -> Issued:
    return Issued(directory / "ca.pem", directory / "ca.key")


def node_paths(directory: Path, node_id: str) -> Issued:
    return Issued(directory / f"node-{node_id}.pem", directory / f"node-{node_id}.key")


def user_paths(directory: Path, user: str) -> Issued:
    """Where a user's certificate goes; the file name is a digest when the user name is not a safe one."""
    stem = user if user.isascii() and user.replace("-", "").replace("_", "").isalnum() else _digest(user)
    return Issued(directory / f"user-{stem}.pem", directory / f"user-{stem}.key")


def coordinator_paths(directory: Path) -> Issued:
    return Issued(directory / "coordinator.pem", directory / "coordinator.key")


def ensure_ca(directory: Path | str, *, common_name: str = "ringq cluster CA") -> Issued:
    """The CA in `directory`, made first if there is none."""
    directory = Path(directory)
    paths = ca_paths(directory)
    if paths.certificate.exists() and paths.key.exists():
        return paths
    directory.mkdir(parents=True, exist_ok=True)
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    now = _now()
    certificate = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=CA_DAYS))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    _write_key(paths.key, key)
    paths.certificate.write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
    return paths


def issue_node(directory: Path | str, node_id: str, hosts: Sequence[str] = DEFAULT_HOSTS) -> Issued:
    """A certificate for node `node_id` (made if missing), valid for its identity and `hosts`."""
    directory = Path(directory)
    return _issue(directory, node_paths(directory, node_id), f"ringq node {node_id}", [node_name(node_id)], hosts)


def issue_coordinator(directory: Path | str, hosts: Sequence[str] = DEFAULT_HOSTS) -> Issued:
    """A certificate every coordinator of the cluster may use (made if missing)."""
    directory = Path(directory)
    return _issue(directory, coordinator_paths(directory), "ringq coordinator", [COORDINATOR_NAME], hosts)


def issue_user(directory: Path | str, user: str) -> Issued:
    """A client certificate that authenticates as `user` on a node's certificate port (made if missing)."""
    directory = Path(directory)
    return _issue(directory, user_paths(directory, user), user, [], [], server=False)


def cluster_material(directory: Path | str, node_ids: Iterable[str]) -> None:
    """A CA, the coordinators' certificate and one per node in `directory` (what exists is kept)."""
    issue_coordinator(directory)
    for node_id in node_ids:
        issue_node(directory, node_id)


def load_node(directory: Path | str, node_id: str) -> ClusterTLS:
    directory = Path(directory)
    issued = node_paths(directory, node_id)
    return ClusterTLS.from_files(ca_paths(directory).certificate, issued.certificate, issued.key)


def load_coordinator(directory: Path | str) -> ClusterTLS:
    directory = Path(directory)
    issued = coordinator_paths(directory)
    return ClusterTLS.from_files(ca_paths(directory).certificate, issued.certificate, issued.key)


def _issue(
    directory: Path,
    paths: Issued,
    common_name: str,
    identities: Sequence[str],
    hosts: Sequence[str],
    *,
    server: bool = True,
) -> Issued:
    if paths.certificate.exists() and paths.key.exists():
        return paths
    ca = ensure_ca(directory)
    ca_key = serialization.load_pem_private_key(ca.key.read_bytes(), password=None)
    ca_certificate = x509.load_pem_x509_certificate(ca.certificate.read_bytes())
    if not isinstance(ca_key, ec.EllipticCurvePrivateKey):
        raise ValueError(f"{ca.key} is not the EC key ringq certs makes")
    key = ec.generate_private_key(ec.SECP256R1())
    now = _now()
    builder = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)]))
        .issuer_name(ca_certificate.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=MEMBER_DAYS))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
    )
    names = [*map(x509.DNSName, identities), *_host_names(hosts)]
    if names:
        builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
    uses = (
        [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
        if server
        else [ExtendedKeyUsageOID.CLIENT_AUTH]
    )
    certificate = builder.add_extension(x509.ExtendedKeyUsage(uses), critical=False).sign(ca_key, hashes.SHA256())
    _write_key(paths.key, key)
    paths.certificate.write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
    return paths


def _host_names(hosts: Sequence[str]) -> list[x509.GeneralName]:
    names: list[x509.GeneralName] = []
    for host in dict.fromkeys(hosts):
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    return names


def _write_key(path: Path, key: ec.EllipticCurvePrivateKey) -> None:
    data = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(descriptor, "wb") as out:
        out.write(data)


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)
