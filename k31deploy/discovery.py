"""Dynamo's discovery (etcd) and event plane (NATS) on the router host: etcd's command line and NATS's
configuration, from the plan.

roles/k31_dynamo only writes these out (`k31-etcd.service`, `k31-nats.conf`); what each binds and how it
authenticates its clients is decided here:

- Both bind the router host's cluster address (the plan's `router.address`) on the plan's discovery ports
  (`router.discovery`); etcd also loopback, for `etcdctl` on the host (the role's authentication check).
- etcd is a one-member cluster: its peer listener is on loopback only, on etcd's default peer port.
- Both take only clients with a certificate of the k31 cluster CA (the plan's `pki` files on every host):
  etcd by mutual TLS (--client-cert-auth); NATS by TLS with `verify`, plus a token (k31_dynamo_nats_token,
  derived from the CA key) that clients send as NATS_AUTH_TOKEN (catalog `dynamo`: tried with ai-dynamo
  1.6.1 and Debian's etcd 3.4 / nats-server 2.9).

The one host-side path that is the role's to choose, k31_dynamo_state_dir (etcd's data goes to its `etcd`),
comes in as an argument; everything else comes from the plan.
"""

from __future__ import annotations

import re
from typing import Any

from k31deploy import validate
from k31deploy.address import url
from k31deploy.catalog import flag_registry
from k31deploy.errors import K31Error
from k31deploy.plan import Pki, Plan, Service

ETCD = "/usr/bin/etcd"          # Debian's etcd-server
ETCD_NAME = "k31"
LOOPBACK = "127.0.0.1"
ETCD_PEER_PORT = 2380           # etcd's default peer port (upstream etcd server/embed/config.go)
# What a token of the unit's ExecStart may hold unquoted: systemd splits on whitespace and expands % and $,
# and a quote or backslash would change the words. Plan addresses and paths are validated to this already.
_UNIT_WORD = re.compile(r"[A-Za-z0-9._+@=/:,\[\]-]+", re.ASCII)


def _dynamo(doc: Plan | dict[str, Any]) -> tuple[Service, Pki]:
    plan = Plan.of(doc)
    if plan.router_kind != "dynamo" or not plan.router or not plan.pki:
        raise K31Error("Dynamo's etcd and NATS run only where the plan has router=dynamo (with the cluster CA); "
                       f"this plan has router={plan.router_kind or 'none'}")
    return plan.router, plan.pki


def etcd_command(plan: Plan | dict[str, Any], state_dir: str) -> list[list[str]]:
    """etcd's command line in groups of related flags (one line each in the unit); its data in
    `<state_dir>/etcd` (state_dir: k31_dynamo_state_dir)."""
    router, pki = _dynamo(plan)
    data_dir = f"{validate.local_path('k31_dynamo_state_dir', state_dir)}/etcd"
    port = router.discovery["etcd_port"]
    cluster = url("https", router.address, port)
    groups = [
        [ETCD, "--name", ETCD_NAME, "--data-dir", data_dir],
        ["--listen-client-urls", f"{cluster},{url('https', LOOPBACK, port)}"],
        ["--advertise-client-urls", cluster],
        ["--cert-file", pki.cert, "--key-file", pki.key],
        ["--client-cert-auth", "--trusted-ca-file", pki.ca],
        ["--listen-peer-urls", url("http", LOOPBACK, ETCD_PEER_PORT)],
    ]
    known = flag_registry()["etcd"]
    for token in (t for group in groups for t in group):
        if token.startswith("--") and token not in known:
            raise AssertionError(f"flag {token} is not registered in data/flags.yaml [etcd]")
    return groups


def etcd_argv(plan: Plan | dict[str, Any], state_dir: str) -> list[str]:
    return [token for group in etcd_command(plan, state_dir) for token in group]


def etcd_exec_start(plan: Plan | dict[str, Any], state_dir: str) -> str:
    """The unit's ExecStart= value: etcd's command, a group of flags per continued line."""
    groups = etcd_command(plan, state_dir)
    for token in (t for group in groups for t in group):
        if not _UNIT_WORD.fullmatch(token):
            raise AssertionError(f"etcd argument {token!r} cannot go into a unit's ExecStart unquoted")
    return " \\\n  ".join(" ".join(group) for group in groups)


def nats_conf(plan: Plan | dict[str, Any], token: str) -> str:
    """NATS's configuration (nats-server -c): listen address and port, TLS requiring a cluster-CA client
    certificate, and the token clients must also send."""
    router, pki = _dynamo(plan)
    if not token or re.search(r'["\\]', token) or validate.CONTROL.search(token):
        raise K31Error("k31_dynamo_nats_token is empty or holds a quote, backslash or control character; valid: "
                       "a non-empty token without them (by default derived from the CA key: leave it unset)")
    return "\n".join([
        f'host: "{router.address}"',
        f"port: {router.discovery['nats_port']}",
        "tls {",
        f'  cert_file: "{pki.cert}"',
        f'  key_file: "{pki.key}"',
        f'  ca_file: "{pki.ca}"',
        "  verify: true",
        "}",
        "authorization {",
        f'  token: "{token}"',
        "}",
    ])
