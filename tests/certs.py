"""A test CA and server certificates signed by it (PEM files), as an
operator's cert-manager or `openssl` would make them."""

from __future__ import annotations

import datetime
import ipaddress
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def kubelet_serving_name(node: str) -> x509.Name:
    """The subject the cluster's kubelet-serving signer issues to a node's kubelet."""
    return x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "system:nodes"),
                      x509.NameAttribute(NameOID.COMMON_NAME, f"system:node:{node}")])  # fmt: skip


class TestCA:
    __test__ = False

    def __init__(self, name: str = "nodesampler test CA") -> None:
        self.key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.UTC)
        self.cert = (
            x509.CertificateBuilder().subject_name(_name(name)).issuer_name(_name(name))
            .public_key(self.key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                         content_commitment=False, key_encipherment=False, data_encipherment=False,
                                         key_agreement=False, encipher_only=False, decipher_only=False),
                           critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(self.key.public_key()), critical=False)
            .sign(self.key, hashes.SHA256())
        )  # fmt: skip

    def write_ca(self, path: Path) -> Path:
        path.write_bytes(self.cert.public_bytes(serialization.Encoding.PEM))
        return path

    def issue(self, cert_path: Path, key_path: Path, names: list[str], subject: x509.Name | None = None) -> int:
        """A server certificate for these DNS names / IP addresses (its subject
        the first, unless given); its serial number."""
        key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.UTC)
        sans: list[x509.GeneralName] = []
        for n in names:
            try:
                sans.append(x509.IPAddress(ipaddress.ip_address(n)))
            except ValueError:
                sans.append(x509.DNSName(n))
        cert = (
            x509.CertificateBuilder().subject_name(subject or _name(names[0])).issuer_name(self.cert.subject)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName(sans), critical=False)
            # As openssl and cert-manager make them: Python 3.13 verifies strictly (VERIFY_X509_STRICT).
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(self.key.public_key()), critical=False)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .sign(self.key, hashes.SHA256())
        )  # fmt: skip
        key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                               serialization.NoEncryption()))  # fmt: skip
        cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        return cert.serial_number
