"""Unit tests of cluster identity (services/tls.py) and `ringq certs` (services/certs.py)."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID

from services import certs, cli
from services.tls import (
    COORDINATOR_NAME,
    ClusterTLS,
    Identity,
    TLSConfigError,
    certificate_user,
    identity_of,
    is_loopback,
    node_name,
)


class _Call:
    """What certificate_user reads of a call: gRPC's auth context."""

    def __init__(self, common_names: list[str], dns_names: list[str]) -> None:
        self._auth = {
            "x509_common_name": [name.encode() for name in common_names],
            "x509_subject_alternative_name": [name.encode() for name in dns_names],
        }

    def auth_context(self) -> dict[str, list[bytes]]:
        return self._auth


def test_a_certificate_proves_exactly_one_member_identity() -> None:
    assert identity_of(["node1.node.ringq", "localhost"]) == Identity("node", "node1")
    assert identity_of(["node.with.dots.node.ringq"]) == Identity("node", "node.with.dots")
    assert identity_of([COORDINATOR_NAME, "127.0.0.1"]) == Identity("coordinator")
    # Two identities, none, or a node id that is not one prove nothing.
    assert identity_of(["node1.node.ringq", "node2.node.ringq"]) is None
    assert identity_of(["node1.node.ringq", COORDINATOR_NAME]) is None
    assert identity_of(["localhost"]) is None
    assert identity_of([".node.ringq", "coordinator.node.ringq", "a b.node.ringq"]) is None


def test_a_user_certificate_names_its_user_and_a_member_certificate_none() -> None:
    assert certificate_user(_Call(["carol"], [])) == "carol"
    # A member's certificate acts for the cluster, never as a user of the same name.
    assert certificate_user(_Call(["carol"], ["node1.node.ringq"])) is None
    assert certificate_user(_Call(["carol"], [COORDINATOR_NAME])) is None
    # No certificate (the client port asks for none), or an ambiguous subject: no user.
    assert certificate_user(_Call([], [])) is None
    assert certificate_user(_Call(["carol", "dave"], [])) is None


def test_ringq_certs_makes_user_certificates_for_clients_only(tmp_path: Path) -> None:
    directory = tmp_path / "tls"
    assert cli.main(["certs", "user", "--dir", str(directory), "--name", "carol"]) == 0
    issued = certs.user_paths(directory, "carol")
    certificate = x509.load_pem_x509_certificate(issued.certificate.read_bytes())
    assert certificate.subject.get_attributes_for_oid(x509.NameOID.COMMON_NAME)[0].value == "carol"
    with pytest.raises(x509.ExtensionNotFound):  # no member identity, no host name
        certificate.extensions.get_extension_for_class(x509.SubjectAlternativeName)
    uses = certificate.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert list(uses) == [ExtendedKeyUsageOID.CLIENT_AUTH]
    certificate.verify_directly_issued_by(
        x509.load_pem_x509_certificate(certs.ca_paths(directory).certificate.read_bytes())
    )
    # A user name that is not a safe file name never becomes one.
    odd = certs.issue_user(directory, "../../etc/passwd")
    assert odd.certificate.parent == directory and ".." not in odd.certificate.name


def test_loopback_addresses() -> None:
    assert is_loopback("127.0.0.1:7000") and is_loopback("localhost:1") and is_loopback("[::1]:5")
    assert not is_loopback("0.0.0.0:7000") and not is_loopback("node1:7101")


def test_ringq_certs_makes_a_ca_and_member_certificates_once(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    directory = tmp_path / "tls"
    assert cli.main(["certs", "node", "--dir", str(directory), "--id", "node1", "--host", "broker.example"]) == 0
    issued = certs.node_paths(directory, "node1")
    for key in (issued.key, certs.ca_paths(directory).key):
        assert stat.S_IMODE(key.stat().st_mode) == 0o600, key
    certificate = x509.load_pem_x509_certificate(issued.certificate.read_bytes())
    names = certificate.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert node_name("node1") in names.get_values_for_type(x509.DNSName)
    assert "broker.example" in names.get_values_for_type(x509.DNSName)
    ca = x509.load_pem_x509_certificate(certs.ca_paths(directory).certificate.read_bytes())
    certificate.verify_directly_issued_by(ca)
    # Asked again, nothing is overwritten; a coordinator certificate joins the same CA.
    before = issued.certificate.read_bytes()
    assert cli.main(["certs", "node", "--dir", str(directory), "--id", "node1"]) == 0
    assert issued.certificate.read_bytes() == before
    assert cli.main(["certs", "coordinator", "--dir", str(directory)]) == 0
    coordinator = x509.load_pem_x509_certificate(certs.coordinator_paths(directory).certificate.read_bytes())
    coordinator.verify_directly_issued_by(ca)
    assert isinstance(certs.load_coordinator(directory), ClusterTLS)
    capsys.readouterr()
    with pytest.raises(SystemExit) as usage:
        cli.main(["certs", "node", "--dir", str(directory)])
    assert usage.value.code == 2 and "--id" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["certs", "node", "--dir", str(directory), "--id", "../etc"])


def test_tls_files_that_cannot_be_used_are_named(tmp_path: Path) -> None:
    certs.issue_node(tmp_path, "n1")
    issued = certs.node_paths(tmp_path, "n1")
    with pytest.raises(TLSConfigError, match="cannot read the CA certificate"):
        ClusterTLS.from_files(tmp_path / "missing.pem", issued.certificate, issued.key)
    (tmp_path / "junk.pem").write_text("not a certificate")
    with pytest.raises(TLSConfigError, match="is not PEM"):
        ClusterTLS.from_files(certs.ca_paths(tmp_path).certificate, tmp_path / "junk.pem", issued.key)
