"""The k31 cluster CA: generated on the controller, kept in Ansible Vault, issuing the certificates the
internal control planes authenticate with (etcd and NATS client certificates, the Dynamo frontend).

Keys are EC P-256. Host certificates are issued by the controller during a deploy and only when the one on
the host is missing, about to expire, issued by another CA, or lacks a name it must carry, so a second
deploy changes nothing and a rotated CA re-issues everything. `k31 pki init` writes the CA as an
inventory vars file whose private key is vault-encrypted; `k31 pki rotate` replaces it.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
from dataclasses import dataclass
from typing import Any

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from k31deploy.errors import K31Error
from k31deploy.plan import Plan

CA_DAYS = 3650
CERT_DAYS = 397          # the CA/Browser ceiling; a redeploy renews ahead of it
RENEW_DAYS = 30          # a certificate with fewer days left is re-issued


@dataclass(frozen=True)
class Pair:
    key: str    # PEM, PKCS#8, unencrypted (the vault encrypts it at rest)
    cert: str   # PEM


def _now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


def _key_pem(key: ec.EllipticCurvePrivateKey) -> str:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption()).decode()


def _cert_pem(cert: x509.Certificate) -> str:
    return cert.public_bytes(serialization.Encoding.PEM).decode()


def _load_cert(pem: str, what: str) -> x509.Certificate:
    try:
        return x509.load_pem_x509_certificate(pem.encode())
    except ValueError as exc:
        raise K31Error(f"{what} is not a PEM certificate ({exc})") from None


def _load_key(pem: str, what: str) -> ec.EllipticCurvePrivateKey:
    try:
        key = serialization.load_pem_private_key(pem.encode(), password=None)
    except (ValueError, TypeError) as exc:
        raise K31Error(f"{what} is not an unencrypted PEM private key ({exc})") from None
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise K31Error(f"{what} is not an EC key")
    return key


def new_ca(name: str = "k31 cluster CA", days: int = CA_DAYS) -> Pair:
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = _now()
    cert = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + dt.timedelta(days=days))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                         content_commitment=False, key_encipherment=False,
                                         data_encipherment=False, key_agreement=False, encipher_only=False,
                                         decipher_only=False), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .sign(key, hashes.SHA256()))
    return Pair(_key_pem(key), _cert_pem(cert))


def _san(names: list[str]) -> list[x509.GeneralName]:
    out: list[x509.GeneralName] = []
    for name in names:
        try:
            out.append(x509.IPAddress(ipaddress.ip_address(name.strip("[]"))))
        except ValueError:
            out.append(x509.DNSName(name))
    return out


def issue(ca: Pair, common_name: str, names: list[str], days: int = CERT_DAYS) -> Pair:
    """A certificate for `common_name`, valid as a TLS server for `names` (IPs and host names) and as a
    TLS client (etcd and NATS take the same certificate from a host's services)."""
    if not names:
        raise K31Error(f"a certificate for {common_name} needs at least one address or host name")
    ca_key, ca_cert = _load_key(ca.key, "the CA key"), _load_cert(ca.cert, "the CA certificate")
    key = ec.generate_private_key(ec.SECP256R1())
    now = _now()
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)]))
            .issuer_name(ca_cert.subject).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(min(now + dt.timedelta(days=days), ca_cert.not_valid_after_utc))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_encipherment=False, key_cert_sign=False,
                                         crl_sign=False, content_commitment=False, data_encipherment=False,
                                         key_agreement=True, encipher_only=False, decipher_only=False),
                           critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                           critical=False)
            .add_extension(x509.SubjectAlternativeName(_san(names)), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
            .sign(ca_key, hashes.SHA256()))
    return Pair(_key_pem(key), _cert_pem(cert))


def renewal_reason(cert_pem: str | None, ca_cert_pem: str, names: list[str],
                   renew_days: int = RENEW_DAYS) -> str | None:
    """Why a host's certificate must be (re-)issued, or None when the one it has is good."""
    if not cert_pem or not cert_pem.strip():
        return "no certificate yet"
    try:
        cert = x509.load_pem_x509_certificate(cert_pem.encode())
    except ValueError:
        return "the certificate on the host does not parse"
    ca = _load_cert(ca_cert_pem, "the CA certificate")
    try:
        cert.verify_directly_issued_by(ca)
    except (ValueError, TypeError, InvalidSignature):
        return "issued by another CA (rotated)"
    if cert.not_valid_after_utc - _now() < dt.timedelta(days=renew_days):
        return f"expires {cert.not_valid_after_utc:%Y-%m-%d}"
    try:
        have = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        have = x509.SubjectAlternativeName([])
    missing = [n for n, g in zip(names, _san(names), strict=True) if g not in have]
    if missing:
        return f"lacks {', '.join(missing)}"
    return None


def derived_secret(ca_key_pem: str, purpose: str) -> str:
    """A secret for `purpose` (the NATS token) derived from the CA key: nothing more to keep in the vault,
    and rotating the CA rotates it too. HMAC-SHA256 of the purpose under a hash of the key's PEM."""
    import hashlib
    import hmac

    key = hashlib.sha256(str(ca_key_pem).encode()).digest()
    return hmac.new(key, f"k31:{purpose}".encode(), hashlib.sha256).hexdigest()


def host_names(doc: Plan | dict[str, Any], host: str) -> list[str]:
    """The subject alternative names of `host`'s certificate: every address the plan gives the host
    (cluster; public on the router host), its inventory name, and loopback for local clients."""
    plan = Plan.of(doc)
    found = [rank.address for _, rank in plan.placed(host)]
    for other in (plan.router, plan.mooncake_master):
        if other and other.host == host:
            found += [other.address, other.public_address]
    return list(dict.fromkeys([*found, host, "127.0.0.1", "::1"]))


def matches(key_pem: str, cert_pem: str) -> bool:
    """Whether a private key belongs to a certificate."""
    try:
        key = _load_key(key_pem, "the key")
        cert = x509.load_pem_x509_certificate(cert_pem.encode())
    except (K31Error, ValueError):
        return False
    return key.public_key().public_numbers() == cert.public_key().public_numbers()
