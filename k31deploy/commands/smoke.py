"""`k31 smoke -i INV`: the smoke checks (k31deploy.smoke) against the plan's router, or its first
unified server where the shape has no router; `--via HOST` reaches it through an SSH tunnel."""

from __future__ import annotations

import argparse
import getpass
import re
import select
import shlex
import socket
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from k31deploy.address import host_port
from k31deploy.commands.recipe import add_plan_args, plan_from_args
from k31deploy.errors import K31Error
from k31deploy.launch import endpoint_address, endpoint_scheme, http_url
from k31deploy.smoke import (
    API_KEY_ENV,
    DEFAULT_TIMEOUT,
    MAX_TOKENS,
    ClientTLS,
    add_tls_args,
    read_api_key,
    report,
    run_smoke,
    validate,
)

SSH_TIMEOUT = 10.0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("smoke", help="models, chat, streaming, reasoning and a tool call through the router")
    add_plan_args(p)
    p.add_argument("--via", metavar="HOST",
                   help="inventory host to tunnel through (SSH) when this machine cannot reach the router")
    p.add_argument("--api-key-file", help=f"file holding the router API key (default: env {API_KEY_ENV})")
    p.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT, help="seconds per request")
    p.add_argument("--skip", action="append", metavar="CHECK",
                   help="a check the endpoint cannot pass by design, reported as skipped (repeatable; default: the "
                        "inventory's k31_smoke_skip, as the deploy's smoke check uses)")
    p.add_argument("--max-tokens", type=int,
                   help="max_tokens per request (default: the inventory's k31_smoke_max_tokens, else 2048)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    add_tls_args(p)
    p.set_defaults(func=cmd_smoke)


def cmd_smoke(args: argparse.Namespace) -> int:
    if not args.inventory:
        raise K31Error("k31 smoke needs -i INVENTORY: the deployed inventory names the router to check")
    plan = plan_from_args(args)
    address, port = endpoint_address(plan)
    key = read_api_key(args.api_key_file)
    tls = ClientTLS.from_args(args.ca_cert, args.client_cert, args.client_key)
    scheme = endpoint_scheme(plan)
    if plan["router"] and plan["router"]["kind"] == "dynamo" and (tls is None or tls.cert is None):
        ca = ("the site's CA that signed the frontend's certificate (public_tls), unless this machine trusts it"
              if plan["router"].get("tls") else "the cluster CA's certificate")
        raise K31Error(f"the Dynamo frontend takes only clients with a certificate of the k31 cluster CA; give "
                       f"--client-cert and --client-key (`k31 pki client-cert` writes them) and --ca-cert: {ca}")
    target = http_url(address, port, scheme)
    validate(target, plan["model"], args.timeout)  # before a tunnel is opened for nothing
    settings = smoke_settings(args.inventory)
    options = {"skip": tuple(args.skip if args.skip is not None else settings.get("k31_smoke_skip") or ()),
               "max_tokens": int(args.max_tokens or settings.get("k31_smoke_max_tokens") or MAX_TOKENS)}
    if args.via:
        via = via_host(args.inventory, args.via)
        with tunnel(via, address, port) as local_port:    # the frontend's certificate names 127.0.0.1 too
            results = run_smoke(http_url("127.0.0.1", local_port, scheme), plan["model"], key, args.timeout,
                                tls=tls, **options)
        target += f" via {via.name}"
    else:
        results = run_smoke(target, plan["model"], key, args.timeout, tls=tls, **options)
    print(report(results, target, plan["model"], args.json))
    if not args.via and results and all(r.detail.startswith("Connection error") for r in results):
        print(f"hint: this machine cannot reach {host_port(address, port)}; --via HOST tunnels through an inventory "
              "host that can", file=sys.stderr)
    return 0 if all(r.ok for r in results) else 1


# -- SSH tunnel ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class ViaHost:
    name: str
    address: str
    port: int
    user: str
    key_file: Path | None
    known_hosts: tuple[Path, ...]
    known_hosts_source: str  # where the known_hosts list came from, for messages


def known_hosts_files(common_args: str) -> tuple[Path, ...] | None:
    """UserKnownHostsFile from ssh options (`-o K=V`, `-oK=V`, `-o 'K V'`); None when not set."""
    options = []
    tokens = iter(shlex.split(common_args))
    for token in tokens:
        if token == "-o":
            options.append(next(tokens, ""))
        elif token.startswith("-o"):
            options.append(token[2:])
    for option in options:
        match = re.match(r"\s*(\w+)\s*(?:=|\s)\s*(.*)", option)
        if match and match[1].lower() == "userknownhostsfile":
            return tuple(Path(p).expanduser() for p in match[2].split())
    return None


def smoke_settings(inventory: str) -> dict[str, Any]:
    """The smoke role's settings the inventory gives for all hosts (k31_smoke_skip, k31_smoke_max_tokens)."""
    from ansible.inventory.manager import InventoryManager
    from ansible.parsing.dataloader import DataLoader
    from ansible.vars.manager import VariableManager

    loader = DataLoader()
    inv = InventoryManager(loader=loader, sources=[inventory])
    hosts = inv.list_hosts("all")
    if not hosts:
        return {}
    found = VariableManager(loader=loader, inventory=inv).get_vars(host=hosts[0], include_hostvars=False)
    return {k: found[k] for k in ("k31_smoke_skip", "k31_smoke_max_tokens") if k in found}


def via_host(inventory: str, name: str) -> ViaHost:
    """SSH settings of inventory host `name` as Ansible's ssh connection would use them."""
    from ansible.inventory.manager import InventoryManager
    from ansible.parsing.dataloader import DataLoader
    from ansible.vars.manager import VariableManager

    loader = DataLoader()
    inv = InventoryManager(loader=loader, sources=[inventory])
    host = inv.get_host(name)
    if host is None:
        names = ", ".join(h.name for h in inv.list_hosts("all"))
        raise K31Error(f"--via {name} is not a host of inventory {inventory}; hosts: {names}")
    hostvars = VariableManager(loader=loader, inventory=inv).get_vars(host=host, include_hostvars=False)

    def var(key: str) -> str | None:
        value = hostvars.get(key)
        return None if value is None or str(value) == "" else str(value)

    try:
        port = int(var("ansible_port") or 22)
    except ValueError:
        raise K31Error(f"ansible_port of {name} is {var('ansible_port')!r}; give a port number") from None
    key_file = Path(var("ansible_ssh_private_key_file")).expanduser() if var("ansible_ssh_private_key_file") else None
    if key_file is not None and not key_file.is_file():
        raise K31Error(f"ansible_ssh_private_key_file of {name} ({key_file}) does not exist; fix it in the inventory")
    files = known_hosts_files(var("ansible_ssh_common_args") or "")
    if files is None:
        files, source = (Path("~/.ssh/known_hosts").expanduser(),), "~/.ssh/known_hosts"
    else:
        source = f"UserKnownHostsFile of {name}'s ansible_ssh_common_args ({' '.join(map(str, files))})"
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise K31Error(f"the known_hosts file {', '.join(missing)} named in ansible_ssh_common_args of "
                           f"{name} does not exist; k31 checks host keys against it")
    return ViaHost(name, var("ansible_host") or name, port, var("ansible_user") or getpass.getuser(),
                   key_file, files, source)


def _connect(via: ViaHost) -> Any:
    import paramiko

    class RejectUnknown(paramiko.RejectPolicy):
        def missing_host_key(self, client: Any, hostname: str, key: Any) -> None:
            raise K31Error(f"the host key of --via {via.name} ({hostname}, {key.get_name()} {key.fingerprint}) is "
                           f"not in {via.known_hosts_source}; check it and add it there (unknown host keys "
                           "are refused)")

    client = paramiko.SSHClient()
    for file in via.known_hosts:
        if file.is_file():
            client.load_host_keys(str(file))
    client.set_missing_host_key_policy(RejectUnknown())
    where = f"{via.user}@{via.address}:{via.port} (--via {via.name})"
    try:
        client.connect(via.address, via.port, username=via.user,
                       key_filename=str(via.key_file) if via.key_file else None,
                       look_for_keys=via.key_file is None, timeout=SSH_TIMEOUT, banner_timeout=SSH_TIMEOUT,
                       auth_timeout=SSH_TIMEOUT)
    except K31Error:
        client.close()
        raise
    except paramiko.BadHostKeyException as exc:
        client.close()
        raise K31Error(f"the host key of {where} does not match {via.known_hosts_source} "
                       f"(got {exc.key.fingerprint}); refusing to connect") from None
    except paramiko.AuthenticationException as exc:
        client.close()
        raise K31Error(f"SSH login to {where} failed ({exc}); check ansible_user and "
                       "ansible_ssh_private_key_file") from None
    except (paramiko.SSHException, OSError) as exc:
        client.close()
        raise K31Error(f"cannot open SSH to {where}: {exc}") from None
    return client


class _Forward:
    """127.0.0.1:<ephemeral> on this machine -> `dest` as seen from the SSH host (direct-tcpip)."""

    def __init__(self, transport: Any, dest: tuple[str, int]):
        self._transport = transport
        self._dest = dest
        self._stop = threading.Event()
        self._server = socket.create_server(("127.0.0.1", 0))
        self._server.settimeout(0.2)  # the accept loop polls for close()
        self.port = self._server.getsockname()[1]
        self._thread = threading.Thread(target=self._accept, name=f"k31-tunnel-{self.port}", daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, peer = self._server.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            threading.Thread(target=self._pipe, args=(conn, peer), daemon=True).start()

    def _pipe(self, conn: socket.socket, peer: tuple[str, int]) -> None:
        import paramiko

        try:
            chan = self._transport.open_channel("direct-tcpip", self._dest, peer, timeout=SSH_TIMEOUT)
        except (paramiko.SSHException, OSError):
            conn.close()  # the client sees the connection drop and the check reports it
            return
        with conn, chan:
            while not self._stop.is_set():
                ready, _, _ = select.select([conn, chan], [], [], 0.5)
                if conn in ready:
                    data = conn.recv(65536)
                    if not data:
                        break
                    chan.sendall(data)
                if chan in ready:
                    data = chan.recv(65536)
                    if not data:
                        break
                    conn.sendall(data)

    def close(self) -> None:
        self._stop.set()
        self._server.close()
        self._thread.join(2)


@contextmanager
def tunnel(via: ViaHost, address: str, port: int) -> Iterator[int]:
    """A local port forwarded through `via` to address:port; yields the local port."""
    client = _connect(via)
    forward = _Forward(client.get_transport(), (address, port))
    try:
        yield forward.port
    finally:
        forward.close()
        client.close()
