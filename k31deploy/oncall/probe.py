"""The host-side client: runs ON each host. `k31 status` / `k31 logs` ship it through Ansible's script module
(it reads the k31 units' systemd state, probes the health URLs where each unit binds, and prints one JSON
document; the controller appends a line calling cli() with what to probe on every host). k31_engine,
k31_redeploy and k31_router install it as /usr/local/lib/k31/k31_probe.py: the engines' health gate and the PD
watcher import its HTTP and systemd calls (request(), health(), unit_props(), drain(), rejoin(), idle()), and a
redeploy step runs it with `--call ACTION` on the router host (drain, rejoin), the engine host (roll: the whole
step of a server on one host; stop, start, restore for a server on several; rank 0's stop first waits for its
requests in flight, its start and restore end with the health gate, k31-engine-gate, installed beside it) and
the lock host (lock: take, renew, release).

Standard library only and Python 3.8-compatible: hosts have nothing of k31 but what the roles put there.
"""

import fcntl
import json
import os
import re
import shutil
import socket
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request

PROPS = ("LoadState", "ActiveState", "SubState", "ExecMainStartTimestamp", "ExecMainStartTimestampMonotonic",
         "NRestarts", "MainPID", "Result")
# k31 processes without a launch script of their own (Dynamo's discovery, the PD restart-rule watcher).
EXTRA_UNITS = ("k31-etcd", "k31-nats", "k31-pd-follow")
FOLLOW_STATE = "/run/k31/pd-follow.state.json"
# What a redeploy leaves on hosts while it runs (k31deploy.oncall.recover reads both).
FOLLOW_HOLD = "/run/k31/pd-follow.hold"
REDEPLOY_LOCK = "/run/k31/redeploy.lock"
# The engines' health gate (gate.py of this folder), which k31_engine installs beside this file as k31-engine-gate.
GATE = os.path.join(os.path.dirname(os.path.realpath(__file__)), "k31-engine-gate")


def run(argv):
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return 1, str(exc)
    return proc.returncode, proc.stdout


def discovered_units(etc_dir):
    """k31's services on this host (loaded or only installed): the known extras and every k31-* unit with a
    launch script in etc_dir (an engine rank or router, also one a newer plan no longer has)."""
    found = set()
    for argv in (["systemctl", "list-units", "--all", "--plain", "--no-legend", "k31-*"],
                 ["systemctl", "list-unit-files", "--plain", "--no-legend", "k31-*"]):
        rc, out = run(argv)
        if rc == 0:
            for line in out.splitlines():
                name = line.split()[0] if line.split() else ""
                if name.endswith(".service"):
                    found.add(name[: -len(".service")])
    return sorted(u for u in found if u in EXTRA_UNITS or os.path.exists(f"{etc_dir}/{u}.sh"))


def unit_props(unit, names):
    """The systemd properties `names` of `unit` as systemctl shows them; {} when it cannot say."""
    rc, out = run(["systemctl", "show", "-p", ",".join(names), unit])
    return dict(line.split("=", 1) for line in out.splitlines() if "=" in line) if rc == 0 else {}


def unit_state(unit, now_mono):
    props = unit_props(unit, PROPS)
    started_mono = int(props.get("ExecMainStartTimestampMonotonic") or 0) / 1e6
    active = props.get("ActiveState", "unknown")
    return {
        "unit": unit,
        "load": props.get("LoadState", "unknown"),
        "active": active,
        "sub": props.get("SubState", "unknown"),
        "result": props.get("Result", ""),
        "started": props.get("ExecMainStartTimestamp", ""),
        "started_monotonic": started_mono,
        "uptime_s": round(now_mono - started_mono, 1) if started_mono and active == "active" else None,
        "restarts": int(props.get("NRestarts") or 0),
        "pid": int(props.get("MainPID") or 0),
    }


def env_value(path, var):
    """VAR's value in a k31 env file (KEY=VALUE lines, maybe double-quoted); None when absent."""
    try:
        with open(path) as fh:
            for line in fh:
                key, sep, value = line.rstrip("\n").partition("=")
                if sep and key == var:
                    value = value.strip()
                    if len(value) >= 2 and value[0] == value[-1] == '"':
                        value = value[1:-1].replace('\\"', '"').replace("\\\\", "\\")
                    return value
    except OSError:
        return None
    return None


def router_key(auth):
    """The router's control-plane key (the last field of id:name:role:key) in its own env file: auth {"env_file",
    "var"}; "" when there is none (or auth names no env file)."""
    value = env_value(auth["env_file"], auth["var"]) if (auth or {}).get("env_file") else None
    return value.rsplit(":", 1)[-1] if value else ""


def http(url, timeout=3.0, auth=None):
    """GET url. auth: {"env_file", "var"} -> a Bearer key read from the unit's own env file (the router's
    control-plane key: the last field of id:name:role:key); {"ca", "cert", "key"} -> mutual TLS with the
    host's cluster certificate (the Dynamo frontend); "own_tls" -> the unit serves the site's certificate
    (public_tls) and the probe, asking its own host, does not check it."""
    key = router_key(auth)
    headers = {"Authorization": "Bearer " + key} if key else {}
    context = cluster_tls(auth) if auth and (auth.get("cert") or auth.get("own_tls")) else None
    return request(url, headers=headers, timeout=timeout, context=context)


def cluster_tls(auth):
    """A TLS context: {"ca", "cert", "key"} -> mutual TLS with the host's cluster certificate; "own_tls" -> the
    unit serves the site's certificate, not checked (the caller asks its own host)."""
    context = ssl.create_default_context(cafile=auth.get("ca"))
    if auth.get("own_tls"):
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    if auth.get("cert"):
        context.load_cert_chain(auth["cert"], auth["key"])
    return context


def silence(spec):
    """k31 redeploy's Alertmanager silence over the servers it restarts, asked on the monitoring host with its cluster
    certificate: spec {"url": .../api/v2/silences, "auth", "body"} creates it (its id in the answer); {"url":
    .../api/v2/silence/ID, "auth", "expire": true} expires it. {"reason": "" or why not, "id"}."""
    try:
        context = cluster_tls(spec["auth"])
    except (OSError, ValueError) as exc:    # ssl.SSLError is an OSError
        return {"reason": f"the host's cluster certificate cannot be loaded: {exc}", "id": ""}
    answer = request(spec["url"], "DELETE" if spec.get("expire") else "POST", spec.get("body"), None, 10.0, context)
    if answer["status"] != 200:
        return {"reason": answer.get("error") or f"Alertmanager answered HTTP {answer['status']}", "id": ""}
    return {"reason": "", "id": str((answer.get("json") or {}).get("silenceID") or "")}


def request(url, method="GET", body=None, headers=None, timeout=3.0, context=None):
    """One HTTP call to a cluster address, never through a proxy the environment names. {"status": the HTTP
    status, 0 when nothing answered; "json": the body, when it parses; "error": why nothing answered;
    "silent": true when that was a timeout (a hung host or a network cut, not a closed port)}."""
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method, headers=dict(headers or {}))
    if data is not None:
        req.add_header("Content-Type", "application/json")
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}), urllib.request.HTTPSHandler(context=context))
    try:
        with opener.open(req, timeout=timeout) as resp:
            raw = resp.read()
            status = resp.status
    except urllib.error.HTTPError as exc:
        return {"status": exc.code}
    except (OSError, ValueError) as exc:
        reason = getattr(exc, "reason", exc)
        return {"status": 0, "error": str(reason),
                "silent": isinstance(exc, socket.timeout) or isinstance(reason, socket.timeout)}
    try:
        return {"status": status, "json": json.loads(raw) if raw else None}
    except ValueError:
        return {"status": status}


def health(url, timeout=3.0):
    """up (200); error (an error status: a process answers, unhealthy or still loading); down (refused, reset or
    unreachable: no process listens); silent (no answer in time: a hung host or a network cut)."""
    answer = request(url, timeout=timeout)
    if answer["status"]:
        return "up" if answer["status"] == 200 else "error"
    return "silent" if answer.get("silent") else "down"


def wait_for(done, timeout, now=time.monotonic, sleep=time.sleep, interval=1.0):
    """Call done() every interval seconds until it is true (True) or timeout seconds passed (False)."""
    deadline = now() + timeout
    while not done():
        if now() >= deadline:
            return False
        sleep(interval)
    return True


# The SGLang router's worker API, for k31 redeploy's drain and re-add (run on the router host: call_cli) and the
# k31-pd-follow watcher. call(method, url, body) -> (status, parsed body) is the caller's authenticated request.
def router_workers(call, router):
    """The workers the router lists ([{id, url, is_healthy, ...}]); None when it did not answer with a list."""
    status, body = call("GET", router + "/workers", None)
    return body.get("workers", []) if status == 200 and isinstance(body, dict) else None


# The drain and re-add poll the router's own listing (on its host's loopback) four times a second: the step waits
# only as long as the router takes, where a 1 s poll added up to a second to each.
ROUTER_POLL = 0.25


def drain(call, router, worker_url, timeout, now=time.monotonic, sleep=time.sleep):
    """Remove worker_url from the router and wait until it no longer lists it: "" when done, else why not."""
    listed = router_workers(call, router)
    if listed is None:
        return "the router did not list its workers (GET /workers)"
    for worker in listed:
        if worker.get("url") == worker_url:
            status, _ = call("DELETE", router + "/workers/" + str(worker.get("id")), None)
            if status not in (200, 202, 204, 404):
                return f"DELETE /workers/{worker.get('id')} answered {status or 'nothing'}"

    def gone():
        workers = router_workers(call, router)
        return workers is not None and all(w.get("url") != worker_url for w in workers)

    if not wait_for(gone, timeout, now, sleep, ROUTER_POLL):
        return f"the router still lists {worker_url} after {timeout:g} s"
    return ""


def rejoin(call, router, worker, timeout, now=time.monotonic, sleep=time.sleep):
    """POST the worker ({url, worker_type, bootstrap_port, api_key}) to the router and wait until the router lists
    it healthy (it checks /health itself first): "" when done, else why not."""
    status, _ = call("POST", router + "/workers", worker)
    if status not in (200, 201, 202):
        return f"POST /workers answered {status or 'nothing'}"

    def healthy():
        return any(w.get("url") == worker["url"] and w.get("is_healthy")
                   for w in router_workers(call, router) or [])

    if not wait_for(healthy, timeout, now, sleep, ROUTER_POLL):
        return f"the router does not list {worker['url']} healthy after {timeout:g} s"
    return ""


def in_flight(call, load_url):
    """Requests an engine runs or queues, from its /get_load; None when it has no such endpoint to read."""
    status, body = call("GET", load_url, None)
    if status != 200 or not isinstance(body, list):
        return None
    return sum(int(r.get("num_reqs", 0)) + int(r.get("num_waiting_reqs", 0)) for r in body)


# The in-flight wait reads the engine on its own host (the stop runs there) four times a second too: a drained
# server stops within a quarter second of its last request's end, where a 2 s poll added up to two seconds to each.
LOAD_POLL = 0.25


def idle(call, load_url, timeout, interval=LOAD_POLL, now=time.monotonic, sleep=time.sleep):
    """Wait until the engine has no request in flight (or nothing to read it from): "" then, else why not."""
    if wait_for(lambda: not in_flight(call, load_url), timeout, now, sleep, interval):
        return ""
    return f"requests were still in flight on {load_url} after {timeout:g} s"


def put(src, dest):
    """Copy src over dest as `cp -p` does (mode, owner, times), through a temporary file: dest is whole throughout."""
    tmp = dest + ".k31-tmp"
    if os.path.lexists(tmp):
        os.remove(tmp)
    # 0600 until the source's mode is copied: an env file holds secrets
    with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb") as out, open(src, "rb") as inp:
        shutil.copyfileobj(inp, out)
    info = os.stat(src)
    os.chown(tmp, info.st_uid, info.st_gid)
    shutil.copystat(src, tmp)
    os.replace(tmp, dest)


def same(a, b):
    try:
        with open(a, "rb") as fa, open(b, "rb") as fb:
            return fa.read() == fb.read()
    except OSError:
        return False


def systemctl(*args):
    """No timeout of its own: a stop waits for a Dynamo worker that drains itself on SIGTERM (systemd bounds it)."""
    try:
        proc = subprocess.run(["systemctl", *args], capture_output=True, text=True)
    except OSError as exc:
        return f"systemctl {' '.join(args)} failed: {exc}"
    return "" if proc.returncode == 0 else f"systemctl {' '.join(args)} failed: {proc.stderr.strip()}"


def engine_key(auth_file):
    """The API key in an engine's key file (k31_engine's engine.auth.yaml: `api-key: "JSON string"`), the one the
    running engine checks even when this redeploy changes it; "" when there is none."""
    try:
        with open(auth_file) as fh:
            for line in fh:
                if line.startswith("api-key:"):
                    value = json.loads(line.split(":", 1)[1])
                    return value if isinstance(value, str) else ""
    except (OSError, ValueError):
        pass
    return ""


def wait_idle(spec):
    """Before rank 0 of a drained server stops -- spec {"load_url", "auth_file", "timeout",
    "not_before": the epoch before which requests the router routed just before the removal may still arrive}:
    wait out that grace, then until the engine's /get_load shows nothing in flight. "" then, else why not."""
    key = engine_key(spec["auth_file"]) if spec.get("auth_file") else ""
    headers = {"Authorization": "Bearer " + key} if key else {}

    def call(method, url, body):
        answer = request(url, method, body, headers, 10.0)
        return answer["status"], answer.get("json")

    time.sleep(max(0.0, min(float(spec.get("not_before", 0)) - time.time(), 60.0)))
    return idle(call, spec["load_url"], float(spec.get("timeout", 30)))


def health_gate(args):
    """k31-engine-gate ARGS: its answer {"ok", "seconds", "healthy", "reason"}."""
    try:
        proc = subprocess.run([GATE, *args], capture_output=True, text=True)
    except OSError as exc:
        return {"ok": False, "reason": f"{GATE} could not run: {exc}"}
    try:
        return json.loads(proc.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):
        return {"ok": False, "reason": f"{GATE} exited {proc.returncode}: {proc.stderr.strip()[-300:]}"}


def step(action, spec):
    """A redeploy step's calls on one engine host: {"ok", "reason", and "idle" or "gate" when they ran}. spec
    {"units", "files": [{"live", "staged", "prev"}] (rollout.step_files), "stage_dir", "rollout": whether this step
    rolls out a new version; rank 0 only: "idle" (wait_idle's spec) and "gate" (k31-engine-gate's arguments);
    "journal": how many log lines per unit a failed start or restore quotes (0: none)}.
    stop: waits for the requests in flight (they finish; the stop goes on after the idle timeout), a rollout keeps
    the running version as .prev, then the units stop. start: a rollout puts the staged files that differ in place,
    the stage is dropped (a restart for the PD rule puts nothing in place), the units start, then the gate waits for
    /health. restore: the .prev copies go back, the units restart on them, then the gate."""
    out = {}
    if action == "stop" and spec.get("idle"):
        out["idle"] = wait_idle(spec["idle"])
    reason = swap(action, spec)
    if not reason and action != "stop" and spec.get("gate"):
        out["gate"] = health_gate(spec["gate"])
        reason = "" if out["gate"].get("ok") else out["gate"].get("reason") or "the health gate failed"
    if reason and action != "stop" and int(spec.get("journal") or 0) > 0:
        reason = journal(spec["units"], int(spec["journal"]), reason)
    return {"ok": not reason, "reason": reason, **out}


def journal(units, lines, reason):
    """`reason`, then the units' last log lines interleaved in time order (one rank's failure often shows in
    another's log): what a failed start or restore reports."""
    rc, text = run(["journalctl", "--no-pager", "-n", str(lines * len(units)), *("--unit=" + u for u in units)])
    return f"{reason}. Last log lines:\n{text if rc == 0 else 'journalctl failed: ' + text}"


def roll(spec):
    """A whole server step on one engine host, in one call: step()'s stop; and where the server has no rank on
    another host ("start": true), its start with the gate, on a failed rollout the restore with its own gate
    ("restore_gate", the roll-back's timeout), and, for a prefill that came back on either version, the release of
    this host's k31-pd-follow hold ("release": its path; the prefill's PD restart is done). A server on several hosts
    stops here and starts in a call of its own once every host stopped. {"ok", "reason", "stopped", and "idle",
    "gate", "rollback": {"ok", "reason"}, "released" when they ran}."""
    out = step("stop", spec)
    out["stopped"] = out["ok"]
    if not out["ok"] or not yes(spec.get("start")):
        return out
    started = step("start", spec)
    out.update(started)
    back_ok = False
    if not started["ok"] and yes(spec.get("rollout")):
        back = step("restore", dict(spec, gate=spec.get("restore_gate") or []))
        out["rollback"] = {"ok": back["ok"], "reason": back["reason"]}
        back_ok = back["ok"]
    if spec.get("release") and (started["ok"] or back_ok):
        out["released"] = os.path.lexists(spec["release"])
        if out["released"]:
            os.remove(spec["release"])
    return out


def yes(value):
    """A spec's flag: true as JSON or as Ansible templated it into text."""
    return value in (True, "true", "True")


def swap(action, spec):
    """step()'s file swap and unit calls: "" when done, else why not."""
    files, units = spec.get("files", []), list(spec["units"])
    rollout = yes(spec.get("rollout"))
    if action == "stop":
        for f in files if rollout else []:
            if os.path.lexists(f["prev"]):
                os.remove(f["prev"])
            if os.path.exists(f["live"]):
                put(f["live"], f["prev"])
        return systemctl("stop", *units)
    if action == "start":
        placed = []
        for f in files if rollout else []:
            if os.path.exists(f["staged"]) and not same(f["staged"], f["live"]):
                put(f["staged"], f["live"])
                placed.append(f["live"])
        if spec.get("stage_dir"):
            shutil.rmtree(spec["stage_dir"], ignore_errors=True)
        # systemd rereads a unit only on a reload: needed where a file changed (a plain restart staged none)
        why = systemctl("daemon-reload") if placed else ""
        return why or systemctl("start", *units)
    for f in files:
        if os.path.exists(f["prev"]):
            put(f["prev"], f["live"])
    return systemctl("daemon-reload") or systemctl("restart", *units)


def lock(spec, path=None, wait=10.0):
    """k31 redeploy's lock on this host (k31deploy/oncall/recover.py says why), under flock so two runs never
    interleave: spec {"op": "take", "expect", "new"} writes `new` only if the lock still reads `expect` (what the
    controller judged free or stale); {"op": "renew", "id", "new"} and {"op": "release", "id"} act only on a lock
    whose record carries this run's id. "" when done, else why not."""
    path = path or REDEPLOY_LOCK
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + ".flock", "a") as guard:
        deadline = time.monotonic() + wait
        while True:
            try:
                fcntl.flock(guard, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError:
                if time.monotonic() > deadline:
                    return f"{path} stayed locked for {wait:g} s"
                time.sleep(0.1)
        try:
            with open(path) as f:
                current = f.read().rstrip("\n")
        except FileNotFoundError:
            current = ""
        op = spec["op"]
        if op == "take" and current != spec.get("expect", ""):
            return "another run took the redeploy lock meanwhile: " + current
        if op in ("renew", "release") and '"id": ' + json.dumps(spec["id"]) not in current:
            return "the redeploy lock is no longer this run's: " + (current or "none")
        if op == "release":
            os.remove(path)
            return ""
        tmp = path + ".tmp"
        if os.path.lexists(tmp):
            os.remove(tmp)
        with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644), "w") as out:
            out.write(spec["new"] + "\n")
        os.replace(tmp, path)
        return ""


def call_cli(action, spec):
    """One step of k31 redeploy run on a host, its spec on stdin: drain or rejoin on the router host, which asks its
    own router (public_tls: the site's certificate, not checked here) with the key it checks, read from its env
    file, as is the key a re-added worker's entry carries (the one the router sends its workers) --
    {"router", "auth", "timeout", "worker_url" | "worker"}; roll (roll()), stop,
    start or restore on an engine host (step()), or there only idle (wait_idle(): the repair's drained prefill);
    lock on the lock host (lock()); silence on the monitoring host (silence(): its "auth" is the host's cluster
    certificate). Prints {"ok", "reason", "at"} (and step()'s "idle" or "gate", roll()'s, silence()'s "id"); exit 1
    when not ok."""
    key = router_key(spec.get("auth"))
    headers = {"Authorization": "Bearer " + key} if key else {}
    context = cluster_tls({"own_tls": True}) if spec.get("router", "").startswith("https:") else None

    def call(method, url, body):
        answer = request(url, method, body, headers, 10.0, context)
        return answer["status"], answer.get("json")

    timeout = float(spec.get("timeout", 30))
    if action in ("stop", "start", "restore"):
        out = step(action, spec)
    elif action == "roll":
        out = roll(spec)
    elif action == "lock":
        out = {"reason": lock(spec)}
    elif action == "idle":
        out = {"reason": wait_idle(spec)}
    elif action == "silence":
        out = silence(spec)
    elif action == "drain":
        out = {"reason": drain(call, spec["router"], spec["worker_url"], timeout)}
    else:
        # the worker's entry gets the key the router sends its workers, from the same env file ("" where unset)
        auth = spec.get("auth") or {}
        worker_key = env_value(auth["env_file"], auth["worker_var"]) if auth.get("worker_var") else None
        worker = {**spec["worker"], **({"api_key": worker_key} if worker_key else {})}
        out = {"reason": rejoin(call, spec["router"], worker, timeout)}
    print(json.dumps({"ok": not out["reason"], **out, "at": time.time()}))
    return 1 if out["reason"] else 0


def runtime(unit, etc_dir):
    """What the unit runs, read from its launch script: a container (with the image the running container
    was started from), a venv, or the stand-in."""
    try:
        with open(f"{etc_dir}/{unit}.sh") as fh:
            script = fh.read()
    except OSError:
        return {}
    lines = [line for line in script.splitlines() if line.startswith("exec ")]
    tokens = lines[-1].split() if lines else []
    if len(tokens) > 2 and tokens[1].rsplit("/", 1)[-1] in ("docker", "podman") and tokens[2] == "run":
        cli = tokens[1]
        rc, out = run([cli, "inspect", "--format", "{{.Config.Image}}", unit])
        return {"runtime": "container", "image": out.strip() if rc == 0 else None, "container_cli": cli}
    if re.search(r"-m k31deploy\.standin", script):
        return {"runtime": "standin"}
    return {"runtime": "venv"}


def status(spec):
    now_mono = time.monotonic()  # systemd's *Monotonic timestamps use the same clock
    units = {}
    etc_dir = spec.get("etc_dir", "/etc/k31")
    for unit in sorted(set(spec.get("units", {})) | set(discovered_units(etc_dir))):
        info = unit_state(unit, now_mono)
        info.update(runtime(unit, etc_dir))
        urls = dict(spec.get("units", {}).get(unit) or {})
        auth = urls.pop("auth", None)
        for key, url in urls.items():
            answer = http(url, auth=auth)
            info[key] = answer["status"]
            if key == "workers" and isinstance(answer.get("json"), dict):
                info["workers"] = [{"url": w.get("url"), "type": w.get("worker_type"),
                                    "healthy": w.get("is_healthy")} for w in answer["json"].get("workers", [])]
            elif key == "models" and isinstance(answer.get("json"), dict):
                info["models"] = [m.get("id") for m in answer["json"].get("data", [])]
        units[unit] = info
    # Both clocks at one instant: unit start times (monotonic) become epochs comparable across hosts.
    out = {"units": units, "clock": {"time": time.time(), "monotonic": time.monotonic()}}
    hold = hold_state(FOLLOW_HOLD)
    if hold:
        out["pd_follow_hold"] = hold
    if spec.get("lock"):
        try:
            with open(REDEPLOY_LOCK) as fh:
                out["redeploy_lock"] = fh.read().strip()
        except OSError:
            out["redeploy_lock"] = ""
    if spec.get("alerts"):
        out["alerts"] = alerts(spec)
    try:
        with open(FOLLOW_STATE) as fh:
            out["pd_follow"] = json.load(fh)
    except (OSError, ValueError):
        pass
    return out


def hold_state(path):
    """k31 redeploy's hold on the k31-pd-follow watcher: its text is seconds counted from its mtime."""
    try:
        mtime = os.stat(path).st_mtime
        with open(path) as fh:
            seconds = float(fh.read().strip() or 0)
    except (OSError, ValueError):
        return None if not os.path.exists(path) else {"until": 0.0, "seconds": 0.0}
    return {"until": mtime + seconds, "seconds": seconds}


def alerts(spec):
    """Alertmanager's alerts (its API v2, over mutual TLS with the host's certificate): firing ones and those a
    silence or an inhibition holds back, each with what on-call needs."""
    where = spec["alerts"]
    answer = http(where["url"], timeout=5.0, auth=where.get("auth"))
    if answer["status"] != 200 or not isinstance(answer.get("json"), list):
        return {"error": answer.get("error") or "Alertmanager answered " + str(answer["status"])}
    found = []
    for item in answer["json"]:
        labels, notes, state = item.get("labels") or {}, item.get("annotations") or {}, item.get("status") or {}
        found.append({"alert": labels.get("alertname"), "severity": labels.get("severity"),
                      "server": labels.get("k31_server"), "role": labels.get("k31_role"),
                      "state": state.get("state"), "silenced_by": state.get("silencedBy") or [],
                      "inhibited_by": state.get("inhibitedBy") or [], "since": item.get("startsAt"),
                      "summary": notes.get("summary"), "runbook": notes.get("runbook")})
    return {"list": sorted(found, key=lambda a: (a["state"] != "active", a["alert"] or "", a["server"] or ""))}


def logs(spec):
    lines = str(int(spec.get("lines", 200)))
    out = {}
    for unit in sorted(set(spec.get("units", {})) | set(discovered_units(spec.get("etc_dir", "/etc/k31")))):
        rc, text = run(["journalctl", "-u", unit, "-n", lines, "--no-pager", "-o", "short-iso"])
        out[unit] = text if rc == 0 else "journalctl failed: " + text
    return {"logs": out}


def main(spec, host):
    """spec: {"mode": "status"|"logs"|"alerts", "common": {...}, "hosts": {name: {...}}}."""
    mine = dict(spec.get("common", {}), **spec["hosts"].get(host, {}))
    mode = spec.get("mode")
    print(json.dumps(logs(mine) if mode == "logs" else {"alerts": alerts(mine)} if mode == "alerts" else status(mine)))
    return 0


def cli(spec):
    """What the controller's appended line calls: the host's inventory name is the script's argument."""
    return main(spec, sys.argv[1])


CALLS = ("drain", "rejoin", "stop", "start", "restore", "roll", "idle", "lock", "silence")


# k31_redeploy runs the installed file (argv: --call CALL, the spec on stdin), and its repair ships this
# file as it is (argv: HOST SPEC-JSON); `k31 status` appends its own call line and passes only HOST, so neither
# runs there.
if __name__ == "__main__" and len(sys.argv) == 3 and sys.argv[1] == "--call" and sys.argv[2] in CALLS:
    raise SystemExit(call_cli(sys.argv[2], json.load(sys.stdin)))
if __name__ == "__main__" and len(sys.argv) == 3:
    raise SystemExit(main(json.loads(sys.argv[2]), sys.argv[1]))
