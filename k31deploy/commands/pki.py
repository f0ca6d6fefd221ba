"""`k31 pki`: the cluster CA that issues the control planes' certificates, kept in Ansible Vault.

    k31 pki init   --vars-file inventories/site/group_vars/all/k31_pki.yml --vault-password-file ~/.vault
    k31 pki rotate --vars-file ... --vault-password-file ...   # a new CA; the next deploy re-issues every cert
    k31 pki show   --vars-file ...                             # subject and expiry (no secret)
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
from pathlib import Path

from k31deploy import pki
from k31deploy.errors import K31Error


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("pki", help="the cluster CA (vault-encrypted) that issues control-plane certificates")
    actions = p.add_subparsers(dest="pki_command", metavar="ACTION", required=True)
    for name, text in (("init", "create the CA (refuses to replace one)"),
                       ("rotate", "replace the CA; the next deploy re-issues every certificate")):
        a = actions.add_parser(name, help=text)
        a.add_argument("--vars-file", required=True, type=Path,
                       help="inventory vars file to write (e.g. group_vars/all/k31_pki.yml)")
        a.add_argument("--vault-password-file", required=True,
                       help="file (or executable) giving the vault password, as for ansible-playbook")
        a.add_argument("--name", default="k31 cluster CA", help="the CA's common name")
        a.set_defaults(func=cmd_write)
    a = actions.add_parser("client-cert", help="a client certificate of the CA (the Dynamo frontend wants one)")
    a.add_argument("--vars-file", required=True, type=Path, help="the vars file k31 pki init wrote")
    a.add_argument("--vault-password-file", required=True, help="its vault password (file or executable)")
    a.add_argument("--name", required=True, help="who the certificate is for (its common name)")
    a.add_argument("--out", required=True, type=Path,
                   help="folder (made 0700) for ca.crt, client.crt and client.key (0600)")
    a.add_argument("--days", type=int, default=pki.CERT_DAYS, help="validity in days")
    a.set_defaults(func=cmd_client_cert)
    a = actions.add_parser("show", help="the CA's subject and validity")
    a.add_argument("--vars-file", required=True, type=Path)
    a.set_defaults(func=cmd_show)


def _vault(password_file: str):
    from ansible.parsing.dataloader import DataLoader
    from ansible.parsing.vault import VaultLib, get_file_vault_secret

    if not os.path.exists(password_file):
        raise K31Error(f"--vault-password-file {password_file} does not exist")
    secret = get_file_vault_secret(filename=password_file, loader=DataLoader())
    secret.load()
    return VaultLib([("default", secret)])


def render(ca: pki.Pair, vault, when: str) -> str:
    encrypted = vault.encrypt(ca.key).decode()
    cert = "".join(f"  {line}\n" for line in ca.cert.strip().splitlines())
    key = "".join(f"  {line}\n" for line in encrypted.strip().splitlines())
    return (f"---\n# The k31 cluster CA (k31 pki, {when}): it issues the certificates etcd, NATS and the Dynamo\n"
            f"# frontend authenticate clients with. The key is vault-encrypted; replace it with `k31 pki rotate`.\n"
            f"k31_pki_ca_cert: |\n{cert}k31_pki_ca_key: !vault |\n{key}")


def cmd_write(args: argparse.Namespace) -> int:
    if args.pki_command == "init" and args.vars_file.exists():
        raise K31Error(f"--vars-file {args.vars_file} already holds a CA; use `k31 pki rotate` to replace it")
    if args.pki_command == "rotate" and not args.vars_file.exists():
        raise K31Error(f"--vars-file {args.vars_file} does not exist; create the CA with `k31 pki init`")
    vault = _vault(args.vault_password_file)
    ca = pki.new_ca(args.name)
    args.vars_file.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.vars_file.with_name(args.vars_file.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as fh:
        fh.write(render(ca, vault, dt.date.today().isoformat()))
    os.replace(tmp, args.vars_file)
    print(f"k31 pki: {args.pki_command}: wrote {args.vars_file}"
          + ("; deploy again to re-issue every certificate from the new CA" if args.pki_command == "rotate" else ""))
    return 0


def load_ca(vars_file: Path, password_file: str) -> pki.Pair:
    """The CA from the vars file `k31 pki init` wrote, its key decrypted with the vault password."""
    import yaml

    if not vars_file.exists():
        raise K31Error(f"--vars-file {vars_file} does not exist; create the CA with `k31 pki init`")
    vault = _vault(password_file)

    class Loader(yaml.SafeLoader):
        pass

    Loader.add_constructor("!vault", lambda loader, node: vault.decrypt(loader.construct_scalar(node)).decode())
    try:
        data = yaml.load(vars_file.read_text(encoding="utf-8"), Loader=Loader) or {}
    except Exception as exc:    # the vault's own errors say what went wrong
        why = " ".join(str(exc).split())
        raise K31Error(f"{vars_file} could not be read with that vault password ({why})") from None
    if "k31_pki_ca_cert" not in data or "k31_pki_ca_key" not in data:
        raise K31Error(f"{vars_file} has no k31_pki_ca_cert / key; create the CA with `k31 pki init`")
    return pki.Pair(str(data["k31_pki_ca_key"]), str(data["k31_pki_ca_cert"]))


def write_private(path: Path, text: str, mode: int) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "w", encoding="utf-8") as fh:
        fh.write(text)
    os.chmod(path, mode)


def cmd_client_cert(args: argparse.Namespace) -> int:
    ca = load_ca(args.vars_file, args.vault_password_file)
    issued = pki.issue(ca, args.name, [args.name], days=args.days)
    args.out.mkdir(parents=True, exist_ok=True)
    os.chmod(args.out, 0o700)
    write_private(args.out / "ca.crt", ca.cert, 0o644)
    write_private(args.out / "client.crt", issued.cert, 0o644)
    write_private(args.out / "client.key", issued.key, 0o600)
    print(f"k31 pki: client certificate for {args.name} in {args.out} (ca.crt, client.crt, client.key)")
    return 0


def cmd_show(args: argparse.Namespace) -> int:
    import yaml
    from cryptography import x509

    if not args.vars_file.exists():
        raise K31Error(f"--vars-file {args.vars_file} does not exist")

    class Loader(yaml.SafeLoader):
        pass

    Loader.add_constructor("!vault", lambda loader, node: "<vaulted>")
    data = yaml.load(args.vars_file.read_text(encoding="utf-8"), Loader=Loader) or {}
    if "k31_pki_ca_cert" not in data:
        raise K31Error(f"{args.vars_file} has no k31_pki_ca_cert; create the CA with `k31 pki init`")
    cert = x509.load_pem_x509_certificate(data["k31_pki_ca_cert"].encode())
    print(f"{cert.subject.rfc4514_string()}: valid {cert.not_valid_before_utc:%Y-%m-%d} to "
          f"{cert.not_valid_after_utc:%Y-%m-%d}, serial {cert.serial_number:x}")
    return 0
