"""The validate play's prerequisite checks (k31deploy/prereqs.py, the k31_validate role's filter): wheel sets,
image source, secrets -- one sentence each, before any host is touched. Hostvars are faked here; the real
Ansible vault and undefined-variable behaviour is in tests/integration/test_prerequisites.py."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from ansible.errors import AnsibleFilterError
from archive_helpers import write_archive

from k31deploy import prereqs as kv
from k31deploy import wheelhouse
from k31deploy.errors import K31Error
from k31deploy.recipe import resolve

REPO = Path(__file__).resolve().parents[2]

PD = {"platform": "mi355x", "agents": 92, "image": "reg/k31:rocm10", "model_path": "/models/kimi"}
PLAYBOOK_DIR = str(REPO / "playbooks")
PEM_CERT = "-----BEGIN CERTIFICATE-----\nMIIBfake+/=\n-----END CERTIFICATE-----\n"
PEM_KEY = "-----BEGIN PRIVATE KEY-----\nMIIBfake+/=\n-----END PRIVATE KEY-----\n"


class Tripping:
    """A value Ansible cannot work out: using it raises, as 2.19's undefined and vault markers do."""

    def __init__(self, message: str) -> None:
        self.message = message

    def __str__(self) -> str:
        raise RuntimeError(self.message)


class FakeHostVars(dict):
    def __getitem__(self, host):
        return super().__getitem__(host)


def cluster(plan, common=None, ca=True, **per_host):
    """hostvars for the plan's hosts and localhost: the cluster CA (`k31 pki init`'s vars file) unless ca=False,
    `common` everywhere (group all), then per-host vars."""
    names = [r["host"] for s in plan["servers"] for r in s["ranks"]]
    names += [plan["router"]["host"]] if plan.get("router") else []
    out = FakeHostVars()
    base = {"k31_pki_ca_cert": PEM_CERT, "k31_pki_ca_key": PEM_KEY} if ca else {}
    for name in [*dict.fromkeys(names), "localhost"]:
        out[name] = {**base, **(common or {}), **per_host.get(name, {})}
    return out


def groups_of(plan):
    out = {"k31_prefill": [], "k31_decode": [], "k31_unified": [], "k31_router": []}
    for server in plan["servers"]:
        out[f"k31_{server['role']}"] += [r["host"] for r in server["ranks"]]
    if plan.get("router"):
        out["k31_router"].append(plan["router"]["host"])
    return out


def check(plan, hostvars, checks=kv.CHECKS, **kw):
    return kv.prerequisites(plan, groups_of(plan), hostvars, PLAYBOOK_DIR, checks, **kw)


def test_a_complete_setup_has_no_problem(tmp_path):
    plan = resolve(PD)
    assert check(plan, cluster(plan, {"k31_router_api_key": "rk-1234567"})) == []


# --- secrets ------------------------------------------------------------------------------------

def test_the_secrets_are_the_no_log_role_variables():
    assert {"k31_router_api_key", "k31_engine_hf_token", "k31_model_hf_token", "k31_smoke_api_key"} <= set(
        kv.secret_names())


@pytest.mark.parametrize(("value", "sentence"), [
    (Tripping("'vault_router_key' is undefined"),
     "k31_router_api_key on node0 cannot be resolved ('vault_router_key' is undefined); pass the vaulted vars "
     "file that defines it (-e @secrets.yml) or remove k31_router_api_key"),
    (Tripping("A vault exception marker was tripped."),
     "k31_router_api_key is vault-encrypted on node0 but could not be decrypted (A vault exception marker was "
     "tripped.); give its vault password (--vault-password-file FILE or --ask-vault-pass)"),
    ("  ", "k31_router_api_key is set but empty on node0; give the secret (Ansible Vault) or remove "
           "k31_router_api_key"),
    ("rk-1234\nLD_PRELOAD=/x", "k31_router_api_key on node0 holds a control character (a line break?); a secret "
                               "must be one line"),
])
def test_a_router_key_that_does_not_resolve_to_one_line_is_refused(value, sentence):
    plan = resolve(PD)
    assert plan["router"]["host"] == "node0"
    hostvars = cluster(plan, {"k31_router_api_key": "rk-1234567"}, node0={"k31_router_api_key": value})
    assert check(plan, hostvars, ["secrets"])[0] == sentence


@pytest.mark.parametrize("var", ["k31_router_api_key", "k31_engine_api_key"])
def test_an_api_key_that_sglang_would_read_as_an_option_is_refused(var):
    # The engines' keys reach SGLang through their --config file, which SGLang turns into arguments.
    plan = resolve(PD)
    hostvars = cluster(plan, {"k31_router_api_key": "rk-1234567"}, node0={var: "-Rk2x9"})
    assert check(plan, hostvars, ["secrets"])[0] == (
        f"{var} on node0 starts with '-': the engines' --config file becomes SGLang's arguments, where the key "
        f"would read as an option; give a key that does not start with '-'")
    assert check(plan, cluster(plan, {"k31_router_api_key": "rk-1234567", var: "Rk-2x9"}), ["secrets"]) == []


def test_the_cluster_ca_is_checked_for_its_pem_shape_not_for_line_breaks():
    plan = resolve(PD)
    good = cluster(plan, {"k31_router_api_key": "rk-1234567", "k31_pki_ca_cert": PEM_CERT, "k31_pki_ca_key": PEM_KEY})
    assert check(plan, good, ["secrets"]) == []
    bad = cluster(plan, {"k31_router_api_key": "rk-1234567", "k31_pki_ca_cert": PEM_CERT,
                         "k31_pki_ca_key": PEM_CERT})
    assert check(plan, bad, ["secrets"]) == [
        "k31_pki_ca_key on node0, node1, localhost is not a PEM private key"]


def test_the_same_problem_on_several_hosts_is_one_sentence():
    plan = resolve(PD)
    hostvars = cluster(plan, {"k31_engine_hf_token": "", "k31_router_api_key": "rk-1234567"})
    assert check(plan, hostvars, ["secrets"]) == [
        "k31_engine_hf_token is set but empty on node0, node1, localhost; give the secret (Ansible Vault) or "
        "remove k31_engine_hf_token"]


def test_a_router_key_only_on_the_router_host_is_refused():
    plan = resolve(PD)
    hostvars = cluster(plan, node0={"k31_router_api_key": "rk-1234567"})
    assert check(plan, hostvars, ["secrets"]) == [
        "k31_router_api_key on node1, localhost is unset or not the router's (node0); the smoke check (localhost) "
        "and redeploys (engine hosts) send it, so set it once for group all (-e @secrets.yml does)"]
    hostvars = cluster(plan, localhost={"k31_router_api_key": "rk-1234567"})
    assert check(plan, hostvars, ["secrets"])[0].startswith(
        "k31_router_api_key is set on localhost but not on the router host node0, so the router would run without it")


def test_a_router_key_the_router_cannot_keep_out_of_argv_or_would_not_check_is_refused():
    seed = resolve({"platform": "gb300", "topology": "pd", "router": "sglang", "speculative": "none",
                    "image": "reg/k31:cuda"})
    assert seed["router"]["dialect"] == "sgl-router"
    [sentence] = check(seed, cluster(seed, {"k31_router_api_key": "rk-1234567"}), ["secrets"])
    assert sentence.startswith("k31_router_api_key cannot be kept out of the router's argv with "
                               "router_dialect=sgl-router: the sgl-router binary takes the key only as --api-key")
    dynamo = resolve({"platform": "gb300", "topology": "pd", "image": "reg/k31:cuda", "speculative": "none"})
    assert dynamo["router"]["kind"] == "dynamo"
    ca = {"k31_pki_ca_cert": PEM_CERT, "k31_pki_ca_key": PEM_KEY}
    [sentence] = check(dynamo, cluster(dynamo, {"k31_router_api_key": "rk-1234567", **ca}), ["secrets"])
    assert "router=dynamo: the Dynamo frontend (ai-dynamo 1.6.1) has no API key check" in sentence
    single = resolve({"platform": "mi355x", "agents": 16, "image": "reg/k31:rocm10"})
    assert single["router"] is None    # the unified engine serves clients itself and checks the key
    assert check(single, cluster(single, {"k31_router_api_key": "rk-1234567"}), ["secrets"]) == []


def test_every_exposed_api_is_authenticated_or_the_run_is_refused():
    plan = resolve(PD)
    [sentence] = check(plan, cluster(plan), ["secrets"])
    assert sentence == ("the engines' HTTP API (node0, node1) and the router in front of them are authenticated with "
                        "k31_router_api_key, which is not set; put it in Ansible Vault and pass it for group all "
                        "(-e @secrets.yml)")
    [sentence] = check(plan, cluster(plan, {"k31_router_api_key": "rk-1234567"}, ca=False), ["secrets"])
    assert sentence.startswith("the engines' admin API (--admin-api-key) and the router's worker API "
                               "(--control-plane-api-keys) authenticate with keys derived from the k31 cluster CA, "
                               "which node0, node1 lack; run `k31 pki init")
    dynamo = resolve({"platform": "gb300", "topology": "pd", "image": "reg/k31:cuda", "speculative": "none"})
    [sentence] = check(dynamo, cluster(dynamo, ca=False), ["secrets"])
    assert sentence.startswith("router=dynamo: its control planes (NATS, the request and response planes, the "
                               "frontend) authenticate with certificates of the k31 cluster CA, which node0, node1, "
                               "node2, node3 lack; run `k31 pki init")
    assert check(dynamo, cluster(dynamo), ["secrets"]) == []


# --- image source -------------------------------------------------------------------------------

def test_image_sources_need_their_inputs(tmp_path, monkeypatch):
    plan = resolve(PD)
    assert check(plan, cluster(plan, {"k31_image_source": "ftp"}), ["image"]) == [
        "k31_image_source=ftp on node0, node1 is not valid; valid choices: registry, tarball, build"]
    assert check(plan, cluster(plan, {"k31_image_source": "tarball"}), ["image"]) == [
        "k31_image_source=tarball on node0, node1 needs k31_image_tarball, a `docker save` of reg/k31:rocm10"]
    missing = tmp_path / "k31.tar"
    [sentence] = check(plan, cluster(plan, {"k31_image_source": "tarball", "k31_image_tarball": str(missing)}),
                       ["image"])
    assert sentence.startswith(f"k31_image_tarball={missing} (for node0, node1) does not exist on the controller")
    missing.write_bytes(b"tar")
    [sentence] = check(plan, cluster(plan, {"k31_image_source": "tarball", "k31_image_tarball": str(missing)}),
                       ["image"])
    assert sentence.startswith(f"k31_image_tarball={missing} is not a `docker save` / `podman save` archive")
    assert sentence.endswith("(for node0, node1)")
    write_archive(missing, [{"Config": f"{'c' * 64}.json", "RepoTags": ["reg/k31:other"]}])
    [sentence] = check(plan, cluster(plan, {"k31_image_source": "tarball", "k31_image_tarball": str(missing)}),
                       ["image"])
    assert sentence.startswith(f"k31_image_tarball={missing} does not hold reg/k31:rocm10 (it holds reg/k31:other)")
    write_archive(missing, [{"Config": f"{'c' * 64}.json", "RepoTags": ["reg/k31:rocm10"]}])
    assert check(plan, cluster(plan, {"k31_image_source": "tarball", "k31_image_tarball": str(missing)}),
                 ["image"]) == []
    # the copy to the hosts is rsync from the controller: a controller without it is refused before any host
    monkeypatch.setattr(kv.shutil, "which", lambda name: None if name == "rsync" else f"/usr/bin/{name}")
    assert check(plan, cluster(plan, {"k31_image_source": "tarball", "k31_image_tarball": str(missing)}),
                 ["image"]) == [
        f"k31_image_tarball={missing} goes to node0, node1 by rsync from the controller (an interrupted copy "
        "resumes), and this controller has no rsync; install it (apt install rsync), or set "
        "k31_image_tarball_on_host=true where each host already has the archive"]
    local = {"k31_image_source": "tarball", "k31_image_tarball": str(missing), "ansible_connection": "local"}
    assert check(plan, cluster(plan, local), ["image"]) == []     # ansible.builtin.copy there
    monkeypatch.undo()
    pinned = {"k31_image_source": "tarball", "k31_image_tarball": str(missing),
              "k31_image_digest": "sha256:" + "a" * 64}
    assert check(plan, cluster(plan, pinned), ["image"]) == [
        "k31_image_digest on node0, node1 pins a registry digest, which a `docker save` archive does not keep; with "
        "k31_image_source=tarball leave it empty (k31 checks the loaded image's ID against the archive's)"]
    on_host = {"k31_image_source": "tarball", "k31_image_tarball": "/shared/k31.tar",
               "k31_image_tarball_on_host": "yes"}
    assert check(plan, cluster(plan, on_host), ["image"]) == []
    assert check(plan, cluster(plan, {"k31_image_source": "build"}), ["image"]) == [
        "k31_image_source=build on node0, node1 needs k31_image_build_context, an SGLang checkout on each host"]
    assert check(plan, cluster(plan, {"k31_image_digest": "sha256:abc"}), ["image"])[0].startswith(
        "k31_image_digest=sha256:abc on node0, node1 is not an image digest")
    assert check(plan, cluster(plan, {"k31_image_digest": "sha256:" + "a" * 64}), ["image"]) == []


def test_only_hosts_that_run_the_image_need_its_source():
    plan = resolve(PD)
    standin = {"k31_engine_runtime": "standin", "k31_router_runtime": "venv", "k31_image_source": "tarball"}
    assert check(plan, cluster(plan, standin), ["image"]) == []
    forced = cluster(plan, standin, node1={"k31_image_enabled": "true"})
    assert check(plan, forced, ["image"])[0].startswith("k31_image_source=tarball on node1 needs")
    # A run whose tags skip the image step needs no image source.
    assert check(plan, cluster(plan, {"k31_image_source": "ftp"}), ["image"], run_tags=["k31_engine"]) == []


@pytest.mark.parametrize("kind", ["sglang", "dynamo"])
@pytest.mark.parametrize("engine", [None, "container", "standin", "venv"])
@pytest.mark.parametrize("router", [None, "container", "venv"])
@pytest.mark.parametrize("dynamo", [None, "container", "venv"])
def test_the_roles_and_the_validate_play_agree_on_which_hosts_run_the_image(kind, engine, router, dynamo):
    """roles/k31's _k31_serves_image, rendered as Ansible renders it for each host, names the hosts the validate
    filter checks the image source of (both ask k31deploy.recipe.hosts.serves_image; roles/k31's defaults,
    container, where the inventory says nothing)."""
    import jinja2
    import yaml

    from k31deploy.recipe.hosts import serves_image

    spec = importlib.util.spec_from_file_location("k31_filter", REPO / "filter_plugins" / "k31.py")
    k31 = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(k31)
    env = jinja2.Environment(undefined=jinja2.StrictUndefined)
    env.filters.update(k31.FilterModule().filters())
    expression = yaml.safe_load((REPO / "roles" / "k31" / "vars" / "main.yml").read_text())["_k31_serves_image"]
    groups = {"k31_prefill": ["p0"], "k31_decode": ["d0"], "k31_router": ["r0"], "k31_monitoring": ["m0"]}
    plan = {"router": {"kind": kind}}
    given = {k: v for k, v in {"k31_engine_runtime": engine, "k31_router_runtime": router,
                               "k31_dynamo_runtime": dynamo}.items() if v}
    defaults = yaml.safe_load((REPO / "roles" / "k31" / "defaults" / "main.yml").read_text())
    rendered = {host for host in ("p0", "d0", "r0", "m0")
                if env.from_string(expression).render(inventory_hostname=host, groups=groups, _k31_plan=plan,
                                                      **{**defaults, **given}).strip() == "True"}
    runtimes = {"engine": engine or "container", "router": router or "container", "dynamo": dynamo or "container"}
    wanted = {host for host in ("p0", "d0", "r0", "m0")
              if serves_image(host, groups, kind, runtimes["engine"], runtimes["router"], runtimes["dynamo"])}
    assert rendered == wanted
    assert ({"p0", "d0"} <= wanted) == (runtimes["engine"] == "container") and "m0" not in wanted
    assert ("r0" in wanted) == (runtimes["dynamo" if kind == "dynamo" else "router"] == "container")


# --- wheelhouse -----------------------------------------------------------------------------------

def test_a_venv_router_needs_the_router_set_in_its_wheelhouse(tmp_path):
    plan = resolve(PD)
    hostvars = cluster(plan, {"k31_router_runtime": "venv", "k31_router_wheelhouse": str(tmp_path / "wh")})
    assert check(plan, hostvars, ["wheelhouse"]) == [
        f"the router runs from a venv (k31_router_runtime=venv on node0), but wheelhouse {tmp_path / 'wh'} does not "
        f"exist; run `k31 wheelhouse build --set router --dest {tmp_path / 'wh'}` (or copy a complete wheelhouse "
        f"there)"]
    (tmp_path / "wh").mkdir()
    [sentence] = check(plan, hostvars, ["wheelhouse"])
    pins = wheelhouse.set_pins("router")
    assert f"lacks {len(pins)} of the {len(pins)} pinned" in sentence and "--set router" in sentence
    for pin in pins:  # every pinned wheel present: nothing to say
        (tmp_path / "wh" / f"{pin.name.replace('-', '_')}-{pin.version}-py3-none-any.whl").write_bytes(b"")
    assert check(plan, hostvars, ["wheelhouse"]) == []
    # The container runtime installs nothing; a run that skips the router needs no router wheels.
    assert check(plan, cluster(plan, {"k31_router_wheelhouse": str(tmp_path / "none")}), ["wheelhouse"]) == []
    empty = cluster(plan, {"k31_router_runtime": "venv", "k31_router_wheelhouse": str(tmp_path / "none")})
    assert check(plan, empty, ["wheelhouse"], run_tags=["k31_engine"]) == []
    assert check(plan, empty, ["wheelhouse"], skip_tags=["k31_router"]) == []
    assert len(check(plan, empty, ["wheelhouse"], run_tags=["k31_router_install"])) == 1


def test_role_defaults_are_read_as_the_roles_see_them():
    defaults = kv.role_defaults(PLAYBOOK_DIR)
    assert defaults["k31_router_wheelhouse"] == f"{PLAYBOOK_DIR}/../.k31/wheelhouse"
    assert defaults["k31_router_runtime"] == "container" and defaults["k31_image_source"] == "registry"


def test_dynamo_and_mooncake_sets_follow_their_runtimes(tmp_path):
    dyn = resolve({"platform": "gb300", "topology": "pd", "image": "reg/k31:cuda", "speculative": "none"})
    hostvars = cluster(dyn, {"k31_dynamo_runtime": "venv", "k31_engine_runtime": "standin",
                             "k31_dynamo_wheelhouse": str(tmp_path / "a"),
                             "k31_engine_wheelhouse": str(tmp_path / "b")})
    found = check(dyn, hostvars, ["wheelhouse"])
    assert len(found) == 2
    assert found[0].startswith("the Dynamo frontend runs from a venv (k31_dynamo_runtime=venv on node0)")
    assert found[1].startswith("the Dynamo worker stand-in runs from a venv (k31_engine_runtime=standin on ")
    assert "--set dynamo" in found[1]
    l3 = resolve({"platform": "b300", "topology": "pd", "router": "sglang", "router_dialect": "launch_router",
                  "kv_offload": "mooncake", "max_running_requests": 64, "image": "reg/k31:cuda"})
    hostvars = cluster(l3, {"k31_mooncake_store_runtime": "venv", "k31_mooncake_store_wheelhouse": str(tmp_path / "c")})
    assert check(l3, hostvars, ["wheelhouse"])[0].startswith(
        f"the Mooncake master runs from a venv (k31_mooncake_store_runtime=venv on {l3['mooncake_master']['host']})")


def test_an_unknown_check_is_refused():
    with pytest.raises(K31Error, match="names floppy; valid choices: secrets, image, wheelhouse"):
        check(resolve(PD), FakeHostVars(), ["floppy"])
    # the role's filter is the playbook's way in: the same checks, the refusal as Ansible's filter error
    spec = importlib.util.spec_from_file_location(
        "k31_validate_filter", REPO / "roles" / "k31_validate" / "filter_plugins" / "k31_validate.py")
    plugin = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(plugin)
    filt = plugin.FilterModule().filters()["k31_validate_prerequisites"]
    plan = resolve(PD)
    assert filt(plan, groups_of(plan), cluster(plan, {"k31_router_api_key": "rk-1234567"}), PLAYBOOK_DIR) == []
    with pytest.raises(AnsibleFilterError, match="names floppy"):
        filt(plan, groups_of(plan), FakeHostVars(), PLAYBOOK_DIR, ["floppy"])


def test_problem_names_the_command_that_fixes_it(tmp_path):
    assert wheelhouse.problem("router", tmp_path / "x", "x86_64").endswith(
        f"run `k31 wheelhouse build --set router --dest {tmp_path / 'x'}` (or copy a complete wheelhouse there)")
    with pytest.raises(Exception, match="unknown"):
        wheelhouse.problem("floppy", tmp_path, "x86_64")


def test_public_tls_needs_the_sites_certificate_and_key_on_the_router_host():
    plan = resolve({**PD, "public_tls": True})
    router = plan["router"]["host"]
    bare = cluster(plan, {"k31_router_api_key": "rk-1234567"})
    assert check(plan, bare, ["secrets"]) == [
        f"public_tls=true: the router host {router} serves clients over HTTPS with the site's certificate, and "
        f"k31_pki_public_cert and k31_pki_public_key are not set there; give the PEM certificate (naming "
        f"{plan['router']['public_address']}) and its key (Ansible Vault), or set k31_public_tls=false"]
    given = cluster(plan, {"k31_router_api_key": "rk-1234567", "k31_pki_public_cert": PEM_CERT,
                           "k31_pki_public_key": PEM_KEY.replace("PRIVATE KEY", "EC PRIVATE KEY")})
    assert check(plan, given, ["secrets"]) == []


# --- monitoring settings: refused before any host is touched, not in the monitoring play after the engines --------

@pytest.mark.parametrize("extra, sentence", [
    ({"k31_monitoring_scrape_interval": "15 seconds"},
     "k31_monitoring_scrape_interval is '15 seconds'; it takes a Prometheus duration such as 15s, 5m or 15d"),
    ({"k31_monitoring_rule_settings": {"engine_down_for": "20 minutes"}},
     "k31_monitoring_rule_settings: monitoring setting engine_down_for is '20 minutes'; it takes a Prometheus "
     "duration (5m, 1h30m)"),
    ({"k31_monitoring_rule_settings": {"engine_down_fr": "20m"}},
     "k31_monitoring_rule_settings: monitoring setting engine_down_fr is not valid; valid settings: "),
])
def test_bad_monitoring_settings_are_refused_before_any_host(extra, sentence):
    plan = resolve(PD)
    found = check(plan, cluster(plan, {"k31_router_api_key": "rk-1234567", **extra}), ["secrets"])
    assert len(found) == 1 and found[0].startswith(sentence), found
    good = {"k31_monitoring_scrape_interval": "5s", "k31_monitoring_rule_settings": {"engine_down_for": "30m"}}
    assert check(plan, cluster(plan, {"k31_router_api_key": "rk-1234567", **good}), ["secrets"]) == []


def test_a_flag_reads_as_the_roles_bool_filter_reads_it():
    """Host.flag is Ansible's own lenient boolean (the roles test these settings with `| bool`)."""
    hostvars = {"node0": {f"v{i}": v for i, v in enumerate(("yes", "on", "1", 1, 1.0, True, "1.0", "no", 2, ""))}}
    host = kv.Host("node0", hostvars, {})
    assert [host.flag(f"v{i}") for i in range(10)] == [True] * 6 + [False] * 4
    assert host.flag("unset") is False
