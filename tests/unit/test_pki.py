"""The cluster CA: certificates that verify, re-issue only when needed, and a CA kept in Ansible Vault."""

from __future__ import annotations

import datetime as dt
import os
import stat

import pytest
from cryptography import x509

from k31deploy import pki
from k31deploy.cli import main
from k31deploy.errors import K31Error


@pytest.fixture(scope="module")
def ca() -> pki.Pair:
    return pki.new_ca()


def test_issued_certificates_chain_to_the_ca_and_carry_their_names(ca):
    pair = pki.issue(ca, "node0", ["10.231.7.10", "node0", "fd00::7"])
    cert = x509.load_pem_x509_certificate(pair.cert.encode())
    cert.verify_directly_issued_by(x509.load_pem_x509_certificate(ca.cert.encode()))
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert [str(n) for n in names.get_values_for_type(x509.IPAddress)] == ["10.231.7.10", "fd00::7"]
    assert names.get_values_for_type(x509.DNSName) == ["node0"]
    usages = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert {u.dotted_string for u in usages} == {"1.3.6.1.5.5.7.3.1", "1.3.6.1.5.5.7.3.2"}   # server + client
    assert pki.matches(pair.key, pair.cert) and not pki.matches(ca.key, pair.cert)


def test_a_good_certificate_is_kept_and_a_stale_one_reissued(ca):
    pair = pki.issue(ca, "node0", ["10.231.7.10", "node0"])
    assert pki.renewal_reason(pair.cert, ca.cert, ["10.231.7.10", "node0"]) is None
    assert pki.renewal_reason(None, ca.cert, ["node0"]) == "no certificate yet"
    assert pki.renewal_reason("garbage", ca.cert, ["node0"]) == "the certificate on the host does not parse"
    assert pki.renewal_reason(pair.cert, ca.cert, ["10.231.7.11"]) == "lacks 10.231.7.11"
    assert pki.renewal_reason(pair.cert, pki.new_ca().cert, ["node0"]) == "issued by another CA (rotated)"
    short = pki.issue(ca, "node0", ["node0"], days=10)
    assert pki.renewal_reason(short.cert, ca.cert, ["node0"]).startswith("expires ")
    with pytest.raises(K31Error, match="needs at least one address"):
        pki.issue(ca, "node0", [])


def _vars(path, password: bytes) -> dict:
    """The vars file as Ansible sees it: YAML, with the !vault value decrypted by Ansible's VaultLib."""
    import yaml
    from ansible.parsing.vault import VaultLib, VaultSecret

    class Loader(yaml.SafeLoader):
        pass

    vault = VaultLib([("default", VaultSecret(password))])
    Loader.add_constructor("!vault", lambda loader, node: vault.decrypt(loader.construct_scalar(node)).decode())
    return yaml.load(path.read_text(), Loader=Loader)


def test_pki_init_writes_a_vaulted_ca_ansible_reads_back(tmp_path, capsys):
    password = tmp_path / "vault-password"
    password.write_text("s3cret\n")
    out = tmp_path / "group_vars" / "all" / "k31_pki.yml"
    assert main(["pki", "init", "--vars-file", str(out), "--vault-password-file", str(password)]) == 0
    assert stat.S_IMODE(os.stat(out).st_mode) == 0o600
    text = out.read_text()
    assert "BEGIN PRIVATE KEY" not in text and "$ANSIBLE_VAULT;1.1;AES256" in text
    data = _vars(out, b"s3cret")
    assert pki.matches(str(data["k31_pki_ca_key"]), data["k31_pki_ca_cert"])
    issued = pki.issue(pki.Pair(str(data["k31_pki_ca_key"]), data["k31_pki_ca_cert"]), "n", ["n"])
    assert pki.renewal_reason(issued.cert, data["k31_pki_ca_cert"], ["n"]) is None

    assert main(["pki", "init", "--vars-file", str(out), "--vault-password-file", str(password)]) == 2
    assert "already holds a CA; use `k31 pki rotate`" in capsys.readouterr().err
    old = data["k31_pki_ca_cert"]
    assert main(["pki", "rotate", "--vars-file", str(out), "--vault-password-file", str(password)]) == 0
    new = _vars(out, b"s3cret")["k31_pki_ca_cert"]
    assert new != old and pki.renewal_reason(issued.cert, new, ["n"]) == "issued by another CA (rotated)"
    capsys.readouterr()
    assert main(["pki", "show", "--vars-file", str(out)]) == 0
    shown = capsys.readouterr().out
    assert shown.startswith("CN=k31 cluster CA: valid ") and f"to {dt.date.today().year + 10}" in shown


def test_pki_refuses_a_missing_password_file_or_ca(tmp_path, capsys):
    out = tmp_path / "k31_pki.yml"
    assert main(["pki", "init", "--vars-file", str(out), "--vault-password-file", str(tmp_path / "nope")]) == 2
    assert main(["pki", "rotate", "--vars-file", str(out), "--vault-password-file", str(tmp_path / "nope")]) == 2
    assert main(["pki", "show", "--vars-file", str(out)]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("error: --vault-password-file") and "does not exist" in err[0]
    assert "create the CA with `k31 pki init`" in err[1]
