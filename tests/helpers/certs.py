"""A certificate authority for tests, made in memory with ``cryptography``: a server certificate for 127.0.0.1 and
client certificates with the subjects a test asks for, written as PEM files."""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID


@dataclass(frozen=True)
class CertFiles:
    cert: Path
    key: Path


class TestCA:
    __test__ = False  # not a pytest test class

    def __init__(self, folder: Path, name: str = "rtx test CA"):
        self.folder = folder
        self._key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        self._name = subject
        self._cert = (self._builder(subject, self._key.public_key())
                      .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
                      .sign(self._key, hashes.SHA256()))
        self.cert = folder / f"{name.replace(' ', '-')}.pem"
        self.cert.write_bytes(self._cert.public_bytes(serialization.Encoding.PEM))

    def issue(self, file_name: str, subject: dict[str, str], server: bool = False) -> CertFiles:
        key = ec.generate_private_key(ec.SECP256R1())
        oids = {"CN": NameOID.COMMON_NAME, "O": NameOID.ORGANIZATION_NAME, "OU": NameOID.ORGANIZATIONAL_UNIT_NAME}
        name = x509.Name([x509.NameAttribute(oids[k], v) for k, v in subject.items()])
        builder = self._builder(name, key.public_key(), issuer=self._name)
        if server:
            builder = builder.add_extension(x509.SubjectAlternativeName(
                [x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]), critical=False)
        cert = builder.sign(self._key, hashes.SHA256())
        files = CertFiles(self.folder / f"{file_name}.crt", self.folder / f"{file_name}.key")
        files.cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        files.key.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                serialization.NoEncryption()))
        return files

    @staticmethod
    def _builder(subject: x509.Name, public_key, issuer: x509.Name | None = None) -> x509.CertificateBuilder:
        now = datetime.datetime.now(datetime.timezone.utc)
        return (x509.CertificateBuilder().subject_name(subject).issuer_name(issuer or subject)
                .public_key(public_key).serial_number(x509.random_serial_number())
                .not_valid_before(now - datetime.timedelta(minutes=5))
                .not_valid_after(now + datetime.timedelta(days=1)))
