"""Issue: every service bound to the right network, every control plane authenticated (plan side)."""

from __future__ import annotations

import pytest
from recipe_helpers import flag

from k31deploy import launch, pki
from k31deploy.errors import K31Error
from k31deploy.launch import rank_mounts
from k31deploy.oncall.rollout import follow_config, rollout
from k31deploy.recipe import from_mapping, resolve


def hosts(router_public: str = "192.0.2.9"):
    return [from_mapping("p0", ["k31_prefill"], {"ansible_host": "10.0.0.1", "k31_cluster_address": "10.8.0.1"}),
            from_mapping("d0", ["k31_decode"], {"ansible_host": "10.0.0.2", "k31_cluster_address": "10.8.0.2"}),
            from_mapping("r0", ["k31_router", "k31_mooncake_master"],
                         {"ansible_host": "10.0.0.9", "k31_cluster_address": "10.8.0.9",
                          "k31_public_address": router_public})]


def test_internal_services_bind_the_cluster_address_and_only_the_router_the_public_one():
    plan = resolve({"platform": "mi355x", "agents": 92}, hosts())
    for server in plan["servers"]:
        rank = server["ranks"][0]
        assert flag(rank["argv"], "--host") == rank["address"] == {"prefill": "10.8.0.1", "decode": "10.8.0.2"}[
            server["role"]]
    router = plan["router"]["argv"]
    assert flag(router, "--host") == "192.0.2.9" and flag(router, "--prometheus-host") == "10.8.0.9"
    assert flag(router, "--prefill") == "http://10.8.0.1:30000"        # workers reached on the cluster network
    assert "0.0.0.0" not in " ".join(router)


def test_mooncake_master_binds_rpc_and_metrics_to_the_cluster_address():
    plan = resolve({"platform": "b300", "topology": "pd", "kv_offload": "mooncake", "router": "sglang",
                    "router_dialect": "launch_router", "prefill_strategy": "low-latency",
                    "max_running_requests": 8}, hosts())
    assert plan["mooncake_master"]["argv"] == ["mooncake_master", "--rpc_address=10.8.0.9", "--rpc_port=50051",
                                               "--metrics_host=10.8.0.9", "--metrics_port=9003"]


def test_dynamo_processes_authenticate_every_control_plane():
    plan = resolve({"platform": "b300", "topology": "pd", "prefill_strategy": "low-latency",
                    "max_running_requests": 8}, hosts())
    assert plan["router"]["kind"] == "dynamo" and plan["pki"]["cert"] == "/etc/k31/pki/host.crt"
    worker = plan["servers"][0]["ranks"][0]["env"]
    assert worker["NATS_SERVER"] == "tls://10.8.0.9:4222" and worker["NATS_TLS_CLIENT_CERT_PATH"] == plan["pki"]["cert"]
    assert worker["ETCD_ENDPOINTS"] == "https://10.8.0.9:2379" and "ETCD_AUTH_USERNAME" not in worker
    # etcd: mutual TLS; its client takes PEM text, which the launch script reads from the certificate files
    for process in (plan["servers"][0]["ranks"][0], plan["router"]):
        assert process["env_from_files"] == {"ETCD_AUTH_CA": plan["pki"]["ca"],
                                             "ETCD_AUTH_CLIENT_CERT": plan["pki"]["cert"],
                                             "ETCD_AUTH_CLIENT_KEY": plan["pki"]["key"]}
    # the request plane binds the cluster address; its port is the next of a range at each start (launch.start_env)
    assert worker["DYN_TCP_RPC_HOST"] == "10.8.0.1" and "DYN_TCP_RPC_PORT" not in worker
    assert plan["servers"][0]["ranks"][0]["request_plane_ports"] == [29110, 29125]
    plane = [p for p in plan["ports"] if p["service"] == "dynamo-request-plane"]
    assert [(p["host"], p["port"], p["port_last"]) for p in plane] == [("p0", 29110, 29125), ("d0", 29110, 29125)]
    assert worker["DYN_TCP_TLS_CLIENT_CA_CERT_PATH"] == plan["pki"]["ca"]       # the request plane wants certs
    assert worker["DYN_SYSTEM_HOST"] == "10.8.0.1"
    frontend = plan["router"]["env"]
    assert frontend["DYN_TLS_CLIENT_CA_CERT_PATH"] == plan["pki"]["ca"]        # clients need a certificate
    assert frontend["DYN_TCP_RESPONSE_STREAM_PORT"] == "29101"
    assert frontend["DYN_TCP_HOST_IDLE_TTL_SECS"] == "60"    # a restarted worker's old pool goes in <= 90 s
    assert flag(plan["router"]["argv"], "--http-host") == "192.0.2.9"
    for env in (worker, frontend):    # secrets never in the plan: they go to 0600 env files
        assert not {"NATS_AUTH_TOKEN", "ETCD_AUTH_PASSWORD", "ETCD_AUTH_CLIENT_KEY"} & set(env)


def test_sglang_router_plans_need_the_cluster_ca_only_for_monitoring():
    assert resolve({"platform": "mi355x", "agents": 92, "monitoring": "none"})["pki"] is None
    plan = resolve({"platform": "mi355x", "agents": 92})
    assert plan["pki"]["cert"] == "/etc/k31/pki/host.crt"    # Prometheus, Alertmanager, node exporters
    # engines do not see the cluster CA's folder: only Dynamo's workers use it
    assert all("/etc/k31/pki" not in m for s in plan["servers"] for r in s["ranks"] for m in rank_mounts(plan, r))


def test_certificates_name_what_each_host_is_reached_by_and_secrets_derive_per_purpose():
    plan = resolve({"platform": "mi355x", "agents": 92}, hosts())
    assert pki.host_names(plan, "r0") == ["10.8.0.9", "192.0.2.9", "r0", "127.0.0.1", "::1"]
    assert pki.host_names(plan, "p0") == ["10.8.0.1", "p0", "127.0.0.1", "::1"]
    key = pki.new_ca().key
    assert pki.derived_secret(key, "nats-token") == pki.derived_secret(key, "nats-token")
    purposes = ("nats-token", "engine-admin-api-key", "router-control-plane")
    assert len({pki.derived_secret(key, p) for p in purposes}) == 3
    assert pki.derived_secret(pki.new_ca().key, "nats-token") != pki.derived_secret(key, "nats-token")


# -- public_tls: the client endpoint serves HTTPS with the site's certificate ------------------------------


def test_public_tls_puts_the_sites_certificate_on_the_sglang_router():
    plan = resolve({"platform": "mi355x", "agents": 92, "public_tls": True, "monitoring": "none"}, hosts())
    router = plan["router"]
    assert flag(router["argv"], "--tls-cert-path") == "/etc/k31/tls/public.crt"
    assert flag(router["argv"], "--tls-key-path") == "/etc/k31/tls/public.key"
    assert router["mounts"] == ["/etc/k31/tls"] and router["tls"]["ca"] == "/etc/k31/tls/ca.crt"
    assert launch.endpoint(plan) == "https://192.0.2.9:8000/v1"
    assert plan["pki"] is None                       # no cluster CA needed for the site's certificate
    assert rollout(plan, ["d0"])["router"]["url"] == "https://192.0.2.9:8000"
    follow = follow_config(plan, "p0")
    assert follow["drains"][0]["router"] == "https://192.0.2.9:8000"
    assert follow["drains"][0]["router_ca"] == "/etc/k31/tls/ca.crt"
    assert "--tls-cert-path" not in resolve({"platform": "mi355x", "agents": 92}, hosts())["router"]["argv"]


def test_public_tls_behind_dynamo_swaps_the_frontends_certificate_and_keeps_client_certificates():
    plan = resolve({"platform": "b300", "topology": "pd", "prefill_strategy": "low-latency",
                    "max_running_requests": 8, "public_tls": True}, hosts())
    env = plan["router"]["env"]
    assert (env["DYN_TLS_CERT_PATH"], env["DYN_TLS_KEY_PATH"]) == ("/etc/k31/tls/public.crt", "/etc/k31/tls/public.key")
    assert env["DYN_TLS_CLIENT_CA_CERT_PATH"] == plan["pki"]["ca"]     # clients still show a cluster-CA certificate
    assert plan["router"]["mounts"] == ["/etc/k31/pki", "/etc/k31/tls"]


@pytest.mark.parametrize("knobs, match", [
    ({"platform": "mi355x", "agents": 32}, r"public_tls=true needs a router .* valid choices: router=sglang"),
    ({"platform": "mi355x", "agents": 92, "router_dialect": "sgl-router"},
     r"public_tls=true with router_dialect=sgl-router: .* valid choices: router_dialect=launch_router"),
])
def test_public_tls_is_refused_where_nothing_can_serve_it(knobs, match):
    with pytest.raises(K31Error, match=match):
        resolve({**knobs, "public_tls": True})


def test_a_service_container_mounts_the_folders_of_its_certificates_read_only():
    argv = launch.service_command(["python3", "-m", "dynamo.frontend"], "container", unit="k31-dynamo-frontend",
                                  image="img", venv="/v", mounts=["/etc/k31/pki", "/etc/k31/tls"])
    assert argv[argv.index("img") - 4:argv.index("img")] == ["-v", "/etc/k31/pki:/etc/k31/pki:ro",
                                                             "-v", "/etc/k31/tls:/etc/k31/tls:ro"]


def test_launch_scripts_read_pem_env_from_files_and_containers_take_it_by_name():
    lines = launch.env_from_files({"ETCD_AUTH_CA": "/etc/k31/pki/ca.crt"})
    assert lines == ['ETCD_AUTH_CA="$(cat /etc/k31/pki/ca.crt)"; export ETCD_AUTH_CA']
    with pytest.raises(K31Error, match="env_from_files"):
        launch.env_from_files({"ETCD_AUTH_CA; rm -rf /": "/x"})
    plan = resolve({"platform": "b300", "topology": "pd", "prefill_strategy": "low-latency",
                    "max_running_requests": 8, "image": "reg/k31:cuda"}, hosts())
    rank = plan["servers"][0]["ranks"][0]
    argv = launch.engine_command(plan, rank, "container", env_file="/etc/k31/x.env")
    assert argv[argv.index("--env-file") + 2:argv.index("--env-file") + 8] == [
        "-e", "ETCD_AUTH_CA", "-e", "ETCD_AUTH_CLIENT_CERT", "-e", "ETCD_AUTH_CLIENT_KEY"]
    assert not any("BEGIN" in token for token in argv)


def test_the_watchers_control_plane_key_on_a_public_address_in_the_clear_is_warned_about():
    warning = ("the PD watchers on the prefill hosts drain through the router's worker API at its public address "
               "192.0.2.9, so without public_tls its control-plane key crosses that network in the clear; set "
               "public_tls=true")
    assert warning in resolve({"platform": "mi355x", "agents": 92}, hosts())["warnings"]
    assert warning not in resolve({"platform": "mi355x", "agents": 92, "public_tls": True}, hosts())["warnings"]
    same = resolve({"platform": "mi355x", "agents": 92}, hosts(router_public=""))["warnings"]
    assert not [w for w in same if "PD watchers" in w]
