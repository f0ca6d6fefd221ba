"""Ansible filters over k31deploy.pki: whether a host's certificate must be (re-)issued, and issuing it on
the controller from the vaulted cluster CA. Docs: `ansible-doc -t filter k31_pki_issue`."""

from __future__ import annotations

from typing import Any

from ansible.errors import AnsibleFilterError

try:
    from k31deploy import pki
    from k31deploy.errors import K31Error
except ImportError as exc:  # pragma: no cover - only without the package installed
    raise AnsibleFilterError(f"k31 filters need the k31deploy package (pip install -e .): {exc}") from exc


def k31_pki_renewal(cert_pem: str | None, ca_cert: str, names: list[str]) -> str:
    """Why the host's certificate must be issued ('' when the one it has is good)."""
    try:
        return pki.renewal_reason(cert_pem or None, str(ca_cert), [str(n) for n in names]) or ""
    except K31Error as exc:
        raise AnsibleFilterError(f"error: k31_pki_ca_cert: {exc}") from None


def k31_pki_issue(ca_key: str, ca_cert: str, common_name: str, names: list[str]) -> dict[str, Any]:
    """A new key and certificate for the host from the cluster CA: {key, cert} (PEM)."""
    try:
        pair = pki.issue(pki.Pair(str(ca_key), str(ca_cert)), str(common_name), [str(n) for n in names])
    except K31Error as exc:
        raise AnsibleFilterError(f"error: k31_pki_ca_key: {exc}") from None
    return {"key": pair.key, "cert": pair.cert}


def k31_pki_names(plan: dict[str, Any], host: str) -> list[str]:
    """What `host`'s certificate must name: the addresses the plan gives it (cluster, and public on the
    router host), its inventory name, and loopback for clients on the host itself."""
    return pki.host_names(plan, host)


def k31_pki_secret(ca_key: str, purpose: str) -> str:
    """A secret derived from the cluster CA key for `purpose` (e.g. the NATS token); use it under no_log."""
    return pki.derived_secret(str(ca_key), str(purpose))


class FilterModule:
    def filters(self):
        return {"k31_pki_renewal": k31_pki_renewal, "k31_pki_issue": k31_pki_issue, "k31_pki_names": k31_pki_names,
                "k31_pki_secret": k31_pki_secret}
