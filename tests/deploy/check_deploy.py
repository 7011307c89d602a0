#!/usr/bin/env python3
"""Checks deploy/ against itself and against the real kvkeepd.

One subcommand per ctest test (tests/deploy/CMakeLists.txt):
  k8s       renders a kustomize overlay (no errors, no warnings) and checks
            that the Deployment (or a fleet's StatefulSet and its headless
            Service), Service, ServiceMonitor and PDB agree with the
            kvkeepd.json of the ConfigMap, and that kvkeepd accepts its
            flags and starts on that config
  prometheus  promtool check config / check rules / test rules
  metrics   every metric the dashboard and the alerts use is one kvkeepd
            exports (deploy/metrics.txt), and the dashboard is well formed
  packages  the cpu image's runtime package list covers every shared
            library the built binaries load
Exit status: 0 pass, 1 fail (each problem printed), 77 skipped (a tool the
check needs is absent; ctest reports it as skipped).
"""

import argparse
import base64
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

SKIP = 77
REPO = Path(__file__).resolve().parents[2]
HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")
DTYPE_BYTES = {"f32": 4, "f16": 2, "bf16": 2}
LOOPBACK_HOSTS = ("127.", "localhost", "[::1]", "::1")


class Problems:
    """Collects failed expectations, so one run reports all of them."""

    def __init__(self):
        self.items = []

    def check(self, ok, message):
        if not ok:
            self.items.append(message)
        return ok

    def exit_status(self, what):
        for item in self.items:
            print(f"FAIL: {item}")
        if self.items:
            print(f"{what}: {len(self.items)} problem(s)")
            return 1
        print(f"{what}: ok")
        return 0


def run(cmd, **kwargs):
    return subprocess.run(cmd, capture_output=True, text=True, **kwargs)


def find_tool(given, name):
    path = given or shutil.which(name)
    if path and os.access(path, os.X_OK):
        return path
    return None


# ---------------------------------------------------------------- k8s


def host_port(address):
    host, _, port = address.rpartition(":")
    return host, int(port)


def memory_bytes(quantity):
    """Kubernetes memory quantity ("12Gi", "500M", "1e9") in bytes."""
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50,
             "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15}
    m = re.fullmatch(r"([0-9.eE+-]+)([A-Za-z]*)", str(quantity))
    if not m or (m.group(2) and m.group(2) not in units):
        raise ValueError(f"cannot read memory quantity {quantity!r}")
    return float(m.group(1)) * units.get(m.group(2), 1)


def pool_bytes(config):
    """Bytes of every layout's pool: pages x 2 (K, V) x page_tokens x kv_heads
    x head_dim x element bytes (docs/config.md)."""
    total = 0
    for layout in config.get("layouts", []):
        page = (2 * layout.get("page_tokens", 16) * layout["kv_heads"] *
                layout["head_dim"] * DTYPE_BYTES[layout.get("dtype", "bf16")])
        total += page * layout["pool_pages"]
    return total


def parse_args_flags(args):
    """[(name, value or None)] for every --flag in a container's args."""
    flags = []
    i = 0
    while i < len(args):
        arg = args[i]
        if arg.startswith("--"):
            name, eq, value = arg[2:].partition("=")
            if not eq and i + 1 < len(args) and not args[i + 1].startswith("-"):
                value = args[i + 1]
                i += 1
            flags.append((name, value if (eq or value) else None))
        i += 1
    return flags


def kvkeepd_flags(kvkeepd):
    """Every flag kvkeepd accepts. --helpfull rather than --help: absl's
    --help lists only flags defined in a file named after the program, and
    kvkeepd's are in main.cc."""
    out = run([kvkeepd, "--helpfull"], timeout=60)
    names = set(re.findall(r"^\s+--(\w+) \(", out.stdout + out.stderr, re.M))
    if not names:
        raise RuntimeError(f"{kvkeepd} --helpfull listed no flags:\n"
                           f"{out.stdout}{out.stderr}")
    return names


def mounted_source(container, volumes, path):
    """(volume, key) that provides the file at `path` in the container, or
    (None, None). key: the ConfigMap/Secret key behind the file."""
    best = None
    for mount in container.get("volumeMounts", []):
        mp = mount["mountPath"].rstrip("/")
        if path == mp or path.startswith(mp + "/"):
            if best is None or len(mp) > len(best["mountPath"].rstrip("/")):
                best = mount
    if best is None:
        return None, None
    volume = volumes.get(best["name"])
    if volume is None:
        return None, None
    mp = best["mountPath"].rstrip("/")
    rel = path[len(mp) + 1:] if path != mp else ""
    if best.get("subPath"):
        rel = best["subPath"] + ("/" + rel if rel else "")
    source = volume.get("configMap") or volume.get("secret") or {}
    key = rel
    for item in source.get("items", []):  # items map keys to other paths
        if item["path"] == rel:
            key = item["key"]
    return volume, key


# The pod name $(VAR)s from the downward API stand for when kvkeepd is
# started on an overlay's args here.
SAMPLE_POD_NAME = "kvkeepd-0"


def expand_env(args, container):
    """args with Kubernetes' $(VAR) references replaced as the kubelet would:
    a literal env value, or SAMPLE_POD_NAME for the downward API's
    metadata.name. Also returns {var: fieldPath} of the downward API vars."""
    values, fields = {}, {}
    for e in container.get("env", []):
        if "value" in e:
            values[e["name"]] = e["value"]
        path = e.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath")
        if path:
            fields[e["name"]] = path
            values[e["name"]] = (SAMPLE_POD_NAME if path == "metadata.name"
                                 else f"sample-{path}")
    expanded = [re.sub(r"\$\((\w+)\)",
                       lambda m: values.get(m.group(1), m.group(0)), a)
                for a in args]
    return expanded, fields


def check_fleet(p, workload, pod_labels, services, flags, fields, grpc_port):
    """A StatefulSet fleet (docs/fleet.md): its serviceName is a headless
    Service of its pods with the gRPC port; each replica's name is its pod's
    (the downward API) and it advertises its name in that Service."""
    service_name = workload["spec"].get("serviceName")
    headless = [s for s in services if s["metadata"]["name"] == service_name]
    if p.check(headless, f"the StatefulSet's serviceName {service_name!r} is "
               "not a Service of its pods"):
        s = headless[0]
        p.check(s["spec"].get("clusterIP") == "None",
                f"Service {service_name} is not headless (clusterIP: None): "
                "pods would get no DNS names of their own")
        p.check(any(port.get("port") == grpc_port
                    for port in s["spec"].get("ports", [])),
                f"Service {service_name} has no port {grpc_port} (gRPC)")
    raw = dict(flags)
    replica = raw.get("replica_name") or ""
    m = re.fullmatch(r"\$\((\w+)\)", replica)
    p.check(m and fields.get(m.group(1)) == "metadata.name",
            f"--replica_name={replica!r}: a fleet's replica name must be the "
            "pod's name, $(VAR) of an env var from the downward API "
            "(fieldRef metadata.name)")
    peers = raw.get("fleet_peers") or ""
    p.check(peers == f"dns:///{service_name}:{grpc_port}",
            f"--fleet_peers={peers!r}: a draining replica finds its peers "
            f"through the headless Service, dns:///{service_name}:{grpc_port}")
    advertise = raw.get("advertise_address") or ""
    want = f"{replica}.{service_name}"
    host, _, port = advertise.rpartition(":")
    p.check(host == want or host.startswith(want + "."),
            f"--advertise_address={advertise!r}: should be the pod's name in "
            f"the headless Service, {want}:{grpc_port}")
    p.check(port == str(grpc_port),
            f"--advertise_address={advertise!r}: port {port!r}, the gRPC "
            f"port is {grpc_port}")


def labels_match(selector, labels):
    return bool(selector) and all(labels.get(k) == v
                                  for k, v in selector.items())


def check_k8s(opts):
    kubectl = find_tool(opts.kubectl, "kubectl")
    if kubectl is None:
        print("SKIP: kubectl not found; the Kubernetes manifests are not "
              "checked (install kubectl with kustomize >= 5 to check them)")
        return SKIP
    overlay = Path(opts.deploy_dir) / "k8s" / opts.overlay
    p = Problems()

    # (a) it renders, with nothing on stderr (kustomize prints deprecation
    # warnings there).
    out = run([kubectl, "kustomize", str(overlay)], timeout=120)
    if out.returncode != 0 or out.stderr.strip():
        print(f"FAIL: kubectl kustomize {overlay} (status {out.returncode}):"
              f"\n{out.stderr}")
        return 1
    docs = [d for d in yaml.safe_load_all(out.stdout) if d]
    by_kind = {}
    for d in docs:
        by_kind.setdefault(d["kind"], []).append(d)
    named = {(d["kind"], d["metadata"]["name"]): d for d in docs}

    # (b) the pieces agree with each other and with kvkeepd.json.
    deployments = by_kind.get("Deployment", []) + by_kind.get("StatefulSet",
                                                               [])
    if not p.check(len(deployments) == 1,
                   "expected one Deployment or StatefulSet, got "
                   f"{len(deployments)}"):
        return p.exit_status(f"k8s {opts.overlay}")
    fleet = deployments[0]["kind"] == "StatefulSet"
    pod_meta = deployments[0]["spec"]["template"]["metadata"]
    pod = deployments[0]["spec"]["template"]["spec"]
    pod_labels = pod_meta.get("labels", {})
    containers = [c for c in pod["containers"] if c["name"] == "kvkeepd"]
    if not p.check(len(containers) == 1, "no container named kvkeepd"):
        return p.exit_status(f"k8s {opts.overlay}")
    c = containers[0]
    volumes = {v["name"]: v for v in pod.get("volumes", [])}
    p.check(labels_match(deployments[0]["spec"]["selector"].get("matchLabels"),
                         pod_labels),
            "the Deployment's selector does not match its pod labels")

    raw_flags = parse_args_flags(c.get("args", []))
    expanded_args, env_fields = expand_env(c.get("args", []), c)
    flags = parse_args_flags(expanded_args)
    flag_values = dict(flags)
    known = kvkeepd_flags(opts.kvkeepd)
    for name, _ in flags:
        bare = name[2:] if name.startswith("no") and name[2:] in known else name
        p.check(bare in known,
                f"container arg --{name}: kvkeepd has no such flag")

    # The config file: --config must be a key of a mounted ConfigMap.
    config_path = flag_values.get("config")
    if not p.check(config_path, "the container args give no --config"):
        return p.exit_status(f"k8s {opts.overlay}")
    volume, key = mounted_source(c, volumes, config_path)
    cm = None
    if volume and "configMap" in volume:
        cm = named.get(("ConfigMap", volume["configMap"]["name"]))
    if not p.check(cm is not None and key in cm.get("data", {}),
                   f"--config={config_path} is not a key of a ConfigMap "
                   f"mounted in the container"):
        return p.exit_status(f"k8s {opts.overlay}")
    config_text = cm["data"][key]
    config = json.loads(config_text)

    # What kvkeepd will use: a flag wins over the file (docs/config.md).
    def effective(name, default=None):
        value = flag_values.get(name)
        return value if value is not None else config.get(name, default)

    listen = effective("listen", "127.0.0.1:50051")
    metrics_listen = effective("metrics_listen", "127.0.0.1:9464")
    for what, address in (("listen", listen), ("metrics_listen", metrics_listen)):
        p.check(not address.startswith(LOOPBACK_HOSTS),
                f"{what} {address}: a loopback address is unreachable from "
                "outside the pod (use 0.0.0.0:PORT)")
    grpc_port = host_port(listen)[1]
    metrics_port = host_port(metrics_listen)[1]

    ports = {cp.get("name"): cp["containerPort"] for cp in c.get("ports", [])}
    p.check(ports.get("grpc") == grpc_port,
            f"container port 'grpc' is {ports.get('grpc')}, kvkeepd listens "
            f"on {grpc_port} ({listen})")
    p.check(ports.get("metrics") == metrics_port,
            f"container port 'metrics' is {ports.get('metrics')}, kvkeepd "
            f"serves metrics on {metrics_port} ({metrics_listen})")
    # The data socket for incoming transfers: kvkeepd's default is listen's
    # host on a free port, which no container port can name.
    transfer_listen = effective("transfer_listen", "")
    transfer_port = None
    if p.check(transfer_listen not in ("", None),
               "transfer_listen is unset: the data socket would take a random "
               "port that no container port names (set it, or 'off')") \
            and transfer_listen != "off":
        p.check(not transfer_listen.startswith(LOOPBACK_HOSTS),
                f"transfer_listen {transfer_listen}: a loopback address is "
                "unreachable from other stores")
        transfer_port = host_port(transfer_listen)[1]
        p.check(ports.get("transfer") == transfer_port,
                f"container port 'transfer' is {ports.get('transfer')}, "
                f"kvkeepd's data socket is on {transfer_port} "
                f"({transfer_listen})")

    for probe_name in ("livenessProbe", "readinessProbe", "startupProbe"):
        probe = c.get(probe_name)
        if probe is None:
            p.check(probe_name == "startupProbe", f"no {probe_name}")
            continue
        if not p.check("grpc" in probe,
                       f"{probe_name} is not a native gRPC probe"):
            continue
        p.check(probe["grpc"].get("port") == grpc_port,
                f"{probe_name} probes port {probe['grpc'].get('port')}, the "
                f"gRPC port is {grpc_port}")
        p.check(probe["grpc"].get("service", "") == "",
                f"{probe_name} asks for service "
                f"{probe['grpc'].get('service')!r}; kvkeepd reports the "
                "overall service \"\"")

    def target_port(service_port):
        target = service_port.get("targetPort", service_port["port"])
        return ports.get(target) if isinstance(target, str) else target

    services = [s for s in by_kind.get("Service", [])
                if labels_match(s["spec"].get("selector"), pod_labels)]
    p.check(services, "no Service selects the kvkeepd pods")
    metrics_service_ports = []
    for s in services:
        sp = {port.get("name"): port for port in s["spec"].get("ports", [])}
        wanted = [("grpc", grpc_port), ("metrics", metrics_port)]
        if transfer_port is not None:
            wanted.append(("transfer", transfer_port))
        for name, want in wanted:
            got = target_port(sp[name]) if name in sp else None
            p.check(got == want,
                    f"Service {s['metadata']['name']} port '{name}' reaches "
                    f"container port {got}, kvkeepd uses {want}")
        metrics_service_ports.append(
            (s, {n for n, port in sp.items() if target_port(port) == metrics_port}))

    if fleet:
        check_fleet(p, deployments[0], pod_labels, services, raw_flags,
                    env_fields, grpc_port)

    monitors = by_kind.get("ServiceMonitor", [])
    p.check(monitors, "no ServiceMonitor")
    for m in monitors:
        selector = m["spec"].get("selector", {}).get("matchLabels")
        chosen = [names for s, names in metrics_service_ports
                  if labels_match(selector, s["metadata"].get("labels", {}))]
        p.check(chosen, f"ServiceMonitor {m['metadata']['name']} selects no "
                "Service of the kvkeepd pods")
        endpoints = m["spec"].get("endpoints", [])
        p.check(endpoints, f"ServiceMonitor {m['metadata']['name']} has no "
                "endpoints")
        for e in endpoints:
            p.check(chosen and all(e.get("port") in names for names in chosen),
                    f"ServiceMonitor endpoint port {e.get('port')!r} is not "
                    "the Service port that reaches the metrics port")
            p.check(e.get("path", "/metrics") == "/metrics",
                    f"ServiceMonitor path {e.get('path')!r}, kvkeepd serves "
                    "/metrics")

    pdbs = by_kind.get("PodDisruptionBudget", [])
    p.check(pdbs, "no PodDisruptionBudget")
    for pdb in pdbs:
        p.check(labels_match(pdb["spec"].get("selector", {}).get("matchLabels"),
                             pod_labels),
                f"PodDisruptionBudget {pdb['metadata']['name']} does not "
                "select the kvkeepd pods")

    # Tenants: --tenants_file (or the config's key) is a key of a mounted
    # Secret holding [{"name", "token"}].
    tenants_path = effective("tenants_file")
    tenants_text = None
    if tenants_path:
        if "tenants_file" in flag_values and "tenants_file" in config:
            p.check(flag_values["tenants_file"] == config["tenants_file"],
                    f"--tenants_file={flag_values['tenants_file']} but "
                    f"kvkeepd.json says {config['tenants_file']}")
        volume, key = mounted_source(c, volumes, tenants_path)
        secret = None
        if volume and "secret" in volume:
            secret = named.get(("Secret", volume["secret"]["secretName"]))
        data = (secret or {}).get("data", {})
        if p.check(key in data, f"tenants file {tenants_path} is not a key of "
                   "a Secret mounted in the container"):
            tenants_text = base64.b64decode(data[key]).decode()
            tenants = json.loads(tenants_text)
            p.check(isinstance(tenants, list) and tenants and all(
                isinstance(t, dict) and t.get("name") and t.get("token")
                for t in tenants),
                f"{tenants_path}: not a list of {{\"name\", \"token\"}}")

    # The peer token (docs/security.md): peers.token_file is a key of a
    # mounted Secret, so that the replicas can move sessions to each other.
    peers = config.get("peers", {})
    peer_path = flag_values.get("peer_token_file") or peers.get("token_file")
    peer_text = None
    if p.check(peer_path or peers.get("token") or peers.get("identities"),
               "no peers configured: the replicas could not move sessions "
               "to each other (peers.token_file)") and peer_path:
        volume, key = mounted_source(c, volumes, peer_path)
        secret = None
        if volume and "secret" in volume:
            secret = named.get(("Secret", volume["secret"]["secretName"]))
        data = (secret or {}).get("data", {})
        if p.check(key in data, f"peer token file {peer_path} is not a key "
                   "of a Secret mounted in the container"):
            peer_text = base64.b64decode(data[key]).decode()
            p.check(len(peer_text.strip()) >= 16,
                    f"{peer_path}: the peer token is under 16 characters")

    # Shutdown: the grace period covers the preStop pause and the drain.
    drain = float(effective("drain_seconds", 10))
    pause = 0.0
    pre_stop = c.get("lifecycle", {}).get("preStop", {})
    command = pre_stop.get("exec", {}).get("command", [])
    if len(command) == 2 and os.path.basename(command[0]) == "sleep":
        pause = float(command[1])
    pause += float(pre_stop.get("sleep", {}).get("seconds", 0))
    grace = pod.get("terminationGracePeriodSeconds", 30)
    p.check(grace > drain + pause,
            f"terminationGracePeriodSeconds {grace} <= drain_seconds {drain} "
            f"+ preStop pause {pause}: kvkeepd would be killed mid-drain")
    if fleet:
        # A draining replica moves its sessions away (fleet_drain.h): every
        # move ends by fleet.move_seconds, then it lingers, then drains.
        fleet_config = config.get("fleet", {})
        move = float(fleet_config.get("move_seconds", 30))
        linger = float(fleet_config.get("linger_seconds", 2))
        p.check(grace > pause + move + linger + drain,
                f"terminationGracePeriodSeconds {grace} <= preStop pause "
                f"{pause} + fleet.move_seconds {move} + fleet.linger_seconds "
                f"{linger} + drain_seconds {drain}: a replica could be killed "
                "while moving its sessions away")

    # Memory: the pool is backed as it fills, so the limit must hold all of
    # it.
    limits = c.get("resources", {}).get("limits", {})
    need = pool_bytes(config)
    if p.check("memory" in limits, "no memory limit"):
        p.check(memory_bytes(limits["memory"]) > need,
                f"memory limit {limits['memory']} does not hold the pools' "
                f"{need / 2**30:.1f} GiB")
    if "nvidia.com/gpu" in limits:
        p.check(any(t.get("key") == "nvidia.com/gpu"
                    for t in pod.get("tolerations", [])),
                "a GPU is requested but nvidia.com/gpu is not tolerated")

    # (c) kvkeepd starts on exactly this config and these args, with the
    # paths moved to local copies and loopback ports of its own.
    with tempfile.TemporaryDirectory() as tmp:
        local = dict(config)
        args = []
        if tenants_text is not None:
            tenants_copy = Path(tmp) / "tenants.json"
            tenants_copy.write_text(tenants_text)
            if "tenants_file" in local:
                local["tenants_file"] = str(tenants_copy)
        if peer_text is not None:
            peer_copy = Path(tmp) / "peer-token"
            peer_copy.write_text(peer_text)
            if "token_file" in local.get("peers", {}):
                local["peers"] = dict(local["peers"], token_file=str(peer_copy))
        config_copy = Path(tmp) / "kvkeepd.json"
        config_copy.write_text(json.dumps(local))
        for name, value in flags:
            if name == "config":
                value = str(config_copy)
            elif name == "tenants_file" and tenants_text is not None:
                value = str(Path(tmp) / "tenants.json")
            elif name == "peer_token_file" and peer_text is not None:
                value = str(Path(tmp) / "peer-token")
            args.append(f"--{name}" if value is None else f"--{name}={value}")
        # Every port free (the overlays' checks run in parallel, and the
        # config's data socket port is fixed).
        cmd = [opts.kvkeepd] + args + [
            "--exit_after_start", "--self_check=false",
            "--listen=127.0.0.1:0", "--metrics_listen=127.0.0.1:0",
            "--transfer_listen=127.0.0.1:0"]
        out = run(cmd, timeout=120)
        device = [a for a in args if a.startswith("--device=cuda")]
        if (device and out.returncode == 2
                and "usable CUDA device" in out.stderr):
            # The overlay asks for a GPU this machine lacks: kvkeepd must
            # refuse exactly that (and nothing else), and start on the same
            # config with the pools in host memory.
            print(f"note: no GPU here: {device[0]} is refused as it should "
                  "be; checking the rest of the config with --device=host")
            cmd = [c if c not in device else "--device=host" for c in cmd]
            out = run(cmd, timeout=120)
        p.check(out.returncode == 0 and "grpc listening on" in out.stdout,
                f"kvkeepd refused the ConfigMap's config (status "
                f"{out.returncode}):\n  {' '.join(cmd)}\n"
                f"{out.stdout}{out.stderr}")
    return p.exit_status(f"k8s {opts.overlay}")


# ---------------------------------------------------------------- prometheus


def check_prometheus(opts):
    promtool = find_tool(opts.promtool, "promtool")
    if promtool is None:
        print("SKIP: promtool not found (Debian package prometheus)")
        return SKIP
    d = Path(opts.deploy_dir) / "prometheus"
    p = Problems()
    for cmd in (["check", "config", d / "prometheus.yml"],
                ["check", "rules", d / "alerts.yml"],
                ["test", "rules", d / "alerts_test.yml"]):
        out = run([promtool] + [str(x) for x in cmd], timeout=120)
        p.check(out.returncode == 0,
                f"promtool {' '.join(str(x) for x in cmd)} (status "
                f"{out.returncode}):\n{out.stdout}{out.stderr}")
    return p.exit_status("prometheus")


# ---------------------------------------------------------------- metrics

PROMQL_WORDS = {"and", "or", "unless", "by", "without", "on", "ignoring",
                "group_left", "group_right", "offset", "bool", "inf", "nan",
                "atan2"}

# Grafana's variables, replaced by values that keep the PromQL valid.
GRAFANA_VARS = [("$__rate_interval", "5m"), ("$__interval", "1m"),
                ("$__range", "1h"), ("$topk", "10")]


def load_metric_names(path):
    names = set()
    for line in Path(path).read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            names.add(line)
    return names


def promql_metric_names(expr):
    """Metric names an expression selects: identifiers outside strings,
    label matchers, grouping clauses and ranges that are not functions or
    keywords."""
    e = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    e = re.sub(r"\{[^}]*\}", " ", e)
    e = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)",
               " ", e)
    e = re.sub(r"\[[^\]]*\]", " ", e)
    names = []
    for m in re.finditer(r"(?<![\w.$])([A-Za-z_:][\w:]*)(\s*\()?", e):
        word, call = m.group(1), m.group(2)
        if call or word.lower() in PROMQL_WORDS:
            continue
        names.append(word)
    return names


def grafana_to_promql(expr):
    for var, value in GRAFANA_VARS:
        expr = expr.replace(var, value)
    # Any other variable sits inside a regex matcher: match everything.
    return re.sub(r"\$\{?\w+\}?", ".*", expr)


def all_panels(dashboard):
    """Every panel, those inside collapsed rows included."""
    for panel in dashboard.get("panels", []):
        yield panel
        yield from panel.get("panels", [])


def dashboard_queries(dashboard, p):
    """(where, PromQL) for every panel target and query variable."""
    queries = []
    for panel in all_panels(dashboard):
        for target in panel.get("targets", []):
            if "expr" in target:
                queries.append((f"panel '{panel.get('title')}'",
                                target["expr"]))
    for var in dashboard.get("templating", {}).get("list", []):
        if var.get("type") != "query":
            continue
        q = var.get("query")
        q = q.get("query", "") if isinstance(q, dict) else (q or "")
        m = re.fullmatch(r"\s*label_values\((.*),\s*\w+\s*\)\s*", q)
        if p.check(m, f"variable {var['name']}: not label_values(SELECTOR, "
                   f"label): {q!r}"):
            queries.append((f"variable {var['name']}", m.group(1)))
    return queries


def check_dashboard_shape(dashboard, p):
    variables = dashboard.get("templating", {}).get("list", [])
    ds_vars = {v["name"] for v in variables if v.get("type") == "datasource"}
    p.check(ds_vars, "the dashboard has no datasource variable")

    def uses_ds_var(ds):
        return (ds or {}).get("uid", "").strip("${}") in ds_vars

    for var in variables:
        if var.get("type") == "query":
            p.check(uses_ds_var(var.get("datasource")),
                    f"variable {var['name']}: datasource "
                    f"{var.get('datasource')} is not the datasource variable")
    ids = set()
    cells = {}
    overlaps = set()
    for panel in dashboard.get("panels", []):
        title = panel.get("title", "?")
        p.check(panel.get("id") not in ids, f"panel {title}: id reused")
        ids.add(panel.get("id"))
        g = panel.get("gridPos")
        if not p.check(g and all(k in g for k in "hwxy"),
                       f"panel {title}: no gridPos"):
            continue
        p.check(g["x"] + g["w"] <= 24, f"panel {title}: wider than the grid")
        for cell in [(g["x"] + dx, g["y"] + dy)
                     for dx in range(g["w"]) for dy in range(g["h"])]:
            other = cells.setdefault(cell, title)
            if other != title and (other, title) not in overlaps:
                overlaps.add((other, title))
                p.check(False, f"panel {title} overlaps panel {other}")
        if panel.get("type") == "row":
            continue
        for ds in [panel.get("datasource")] + [
                t.get("datasource") for t in panel.get("targets", [])]:
            p.check(uses_ds_var(ds),
                    f"panel {title}: datasource {ds} is not the dashboard's "
                    "datasource variable")
        p.check(panel.get("targets"), f"panel {title}: no queries")


def check_metrics(opts):
    deploy = Path(opts.deploy_dir)
    known = load_metric_names(deploy / "metrics.txt")
    p = Problems()
    p.check(known and all(re.fullmatch(r"kvkeep_\w+", n) for n in known),
            "deploy/metrics.txt: every line must be one kvkeep_* name")
    for n in known:
        p.check(not n.endswith(HISTOGRAM_SUFFIXES),
                f"deploy/metrics.txt: {n}: list histograms by base name")

    dashboard = json.loads((deploy / "grafana" / "kvkeep.json").read_text())
    check_dashboard_shape(dashboard, p)
    queries = [(f"dashboard {w}", grafana_to_promql(q))
               for w, q in dashboard_queries(dashboard, p)]
    alerts = yaml.safe_load((deploy / "prometheus" / "alerts.yml").read_text())
    for group in alerts["groups"]:
        for rule in group["rules"]:
            queries.append((f"alert {rule.get('alert', rule.get('record'))}",
                            rule["expr"]))

    used = set()
    for where, expr in queries:
        names = promql_metric_names(expr)
        p.check(names, f"{where}: selects no metric: {expr}")
        for name in names:
            used.add(name)
            base = name
            for suffix in HISTOGRAM_SUFFIXES:
                if name.endswith(suffix) and name[:-len(suffix)] in known:
                    base = name[:-len(suffix)]
            # Histograms (the *_seconds names) exist only with a suffix.
            if base in known and base.endswith("_seconds"):
                p.check(base != name, f"{where}: {name} is a histogram; "
                        "select NAME_bucket, NAME_sum or NAME_count")
            elif base in known:
                p.check(base == name, f"{where}: {name}: {base} is not a "
                        "histogram")
            else:
                p.check(False, f"{where}: {name} is not in deploy/metrics.txt")

    # Every expression is valid PromQL once Grafana's variables are filled
    # in: promtool parses them as recording rules.
    promtool = find_tool(opts.promtool, "promtool")
    if promtool is None:
        print("note: promtool not found; the PromQL syntax is not checked")
    else:
        rules = {"groups": [{"name": "syntax", "rules": [
            {"record": f"syntax:query{i}", "expr": expr}
            for i, (_, expr) in enumerate(queries)]}]}
        with tempfile.NamedTemporaryFile("w", suffix=".yml") as f:
            yaml.safe_dump(rules, f)
            f.flush()
            out = run([promtool, "check", "rules", f.name], timeout=60)
        if not p.check(out.returncode == 0, "a query is not valid PromQL:\n"
                       f"{out.stdout}{out.stderr}"):
            for i, (where, expr) in enumerate(queries):
                if re.search(rf"\bsyntax:query{i}\b", out.stdout + out.stderr):
                    print(f"  syntax:query{i} = {where}: {expr}")
    print(f"{len(queries)} queries use {len(used)} metric names")
    return p.exit_status("metrics")


# ---------------------------------------------------------------- packages


def check_packages(opts):
    for tool in ("ldd", "dpkg-query"):
        if shutil.which(tool) is None:
            print(f"SKIP: {tool} not found (not a Debian system)")
            return SKIP
    script = Path(opts.deploy_dir) / "docker" / "runtime-packages.sh"
    listing = Path(opts.deploy_dir) / "docker" / "runtime-packages-debian12.txt"
    out = run([str(script), "--check", str(listing)] + opts.binaries,
              timeout=120)
    print(out.stdout, end="")
    if out.returncode != 0:
        print(f"FAIL: {out.stderr}")
        return 1
    return 0


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--deploy_dir", default=str(REPO / "deploy"))
    sub = parser.add_subparsers(dest="command", required=True)
    k8s = sub.add_parser("k8s")
    k8s.add_argument("--overlay", required=True,
                     help="under deploy/k8s: base, overlays/cpu, ...")
    k8s.add_argument("--kvkeepd", required=True)
    k8s.add_argument("--kubectl")
    prom = sub.add_parser("prometheus")
    prom.add_argument("--promtool")
    metrics = sub.add_parser("metrics")
    metrics.add_argument("--promtool")
    packages = sub.add_parser("packages")
    packages.add_argument("binaries", nargs="+")
    opts = parser.parse_args()
    return {"k8s": check_k8s, "prometheus": check_prometheus,
            "metrics": check_metrics, "packages": check_packages}[
                opts.command](opts)


if __name__ == "__main__":
    sys.exit(main())
