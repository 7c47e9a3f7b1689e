"""Certificates for a local etcd's members to know each other by (peer TLS).

Why: every local user can connect to 127.0.0.1, so an etcd member's peer
port is open to all of them. Without peer TLS anyone could speak raft to
it: pose as a member, and read or write the cluster's state beneath the
client authentication. With it each member presents a certificate signed by
a CA made for this etcd alone, and accepts only peers that do the same
(``--peer-client-cert-auth``). The CA's private key is thrown away once the
members' certificates are signed: nobody, root included, can mint another
member certificate afterwards, and a local etcd never adds members.

Keys are ECDSA P-256 (small and fast), written root-only (0600, in a 0700
directory) with the ``cryptography`` library: never hand-written crypto.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path

#: How long the certificates are valid: a local cluster lives for hours or
#: days; ten years keeps a long-lived test cluster from breaking one morning.
VALIDITY = datetime.timedelta(days=3650)


@dataclass(frozen=True)
class PeerFiles:
    cert_file: str
    key_file: str
    trusted_ca_file: str


def make_peer_certs(directory: Path, names: list[str], host: str) -> dict[str, PeerFiles]:
    """A throw-away CA and one certificate per member (server and client use,
    for ``host``), under ``directory`` (created 0700); the CA key is not kept."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(directory, 0o700)
    now = datetime.datetime.now(datetime.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"gangd local etcd CA ({directory})"[:64])])
    ca_cert = (
        x509.CertificateBuilder()
        .subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + VALIDITY)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=False, content_commitment=False, key_encipherment=False, data_encipherment=False,
                                     key_agreement=False, key_cert_sign=True, crl_sign=True, encipher_only=False, decipher_only=False), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    ca_path = directory / "peer-ca.pem"
    _write(ca_path, ca_cert.public_bytes(serialization.Encoding.PEM))
    files: dict[str, PeerFiles] = {}
    for name in names:
        key = ec.generate_private_key(ec.SECP256R1())
        cert = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])).issuer_name(ca_name)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + VALIDITY)
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address(host))]), critical=False)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
            .sign(ca_key, hashes.SHA256())
        )
        cert_path, key_path = directory / f"{name}.pem", directory / f"{name}.key"
        _write(key_path, key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
        _write(cert_path, cert.public_bytes(serialization.Encoding.PEM))
        files[name] = PeerFiles(str(cert_path), str(key_path), str(ca_path))
    return files


def _write(path: Path, data: bytes) -> None:
    """Root-only, fsynced, replacing nothing by surprise (O_EXCL on a fresh name, then rename)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
