"""deploy/k8s/, validated offline: every object against the Kubernetes JSON schemas that the pinned
`kubernetes-validate` wheel ships (strict: unknown fields fail), then the wiring a schema cannot see
(selectors, probes, headless gRPC Services, HPAs, PDBs) and agreement with the launcher table."""
from __future__ import annotations

import copy
import math
import re

import kubernetes_validate
import pytest
import yaml

from deploy import threads
from tests.deploy import topology as topo

# The oldest release with GA gRPC probes, and the newest the package knows.
K8S_VERSIONS = ("1.27.0", "1.37.0")
WORKLOAD_KINDS = ("Deployment", "StatefulSet")


@pytest.fixture(scope="module")
def objects() -> list[dict]:
    return topo.load_k8s()


def by_kind(objects, kind) -> dict[str, dict]:
    return {o["metadata"]["name"]: o for o in objects if o["kind"] == kind}


def workloads(objects) -> dict[str, dict]:
    return {o["metadata"]["name"]: o for o in objects if o["kind"] in WORKLOAD_KINDS}


def container(workload) -> dict:
    (only,) = workload["spec"]["template"]["spec"]["containers"]
    return only


def port_flag(command) -> int:
    return int(command[command.index("--port") + 1])


def strip(obj) -> dict:
    return {k: v for k, v in obj.items() if k != "_file"}


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_every_object_validates_against_the_kubernetes_schemas(objects, version):
    for obj in objects:
        try:
            kubernetes_validate.validate(strip(obj), version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{obj['_file']} {obj['kind']}/{obj['metadata']['name']} (k8s {version}): {exc.message} "
                        f"at {'.'.join(map(str, exc.path))}")


def test_the_schema_check_rejects_broken_objects(objects):
    """The validator is strict and really reads the objects: a misspelt field and a wrong type both fail."""
    deployment = strip(workloads(objects)["pooling"])
    typo = copy.deepcopy(deployment)
    typo["spec"]["replica"] = typo["spec"].pop("replicas")
    wrong_type = copy.deepcopy(deployment)
    container(wrong_type)["readinessProbe"]["grpc"]["port"] = "fifty"
    for broken in (typo, wrong_type):
        with pytest.raises(kubernetes_validate.ValidationError):
            kubernetes_validate.validate(broken, K8S_VERSIONS[-1], strict=True)


def test_kustomization_lists_every_manifest():
    kustomization = yaml.safe_load((topo.K8S / "kustomization.yaml").read_text())
    on_disk = {p.name for p in topo.K8S.glob("*.y*ml")} - {"kustomization.yaml"}
    assert set(kustomization["resources"]) == on_disk


def test_grpc_backends_have_headless_services_and_the_gateway_a_cluster_ip(objects):
    services, loads = by_kind(objects, "Service"), workloads(objects)
    for name, svc in services.items():
        selected = [w for w in loads.values()
                    if svc["spec"]["selector"].items() <= w["spec"]["template"]["metadata"]["labels"].items()]
        assert len(selected) == 1, f"Service {name} selects {len(selected)} workloads"
        ports = {p["name"]: p["containerPort"] for p in container(selected[0])["ports"]}
        for port in svc["spec"]["ports"]:
            assert ports.get(port["targetPort"]) == port["port"], f"Service {name}: {port}"
            grpc = port.get("appProtocol") == "grpc"
            # gRPC keeps one HTTP/2 connection open: only a headless Service lets clients see every pod.
            assert grpc == (svc["spec"].get("clusterIP") == "None"), f"Service {name}"
    assert {n for n, s in services.items() if s["spec"].get("clusterIP") == "None"} == \
        {"vision", "decoder", "decoder-vl", "pooling"}
    for name in ("decoder", "decoder-vl"):
        assert loads[name]["spec"]["serviceName"] == name


def test_grpc_services_have_grpc_startup_readiness_and_liveness_probes(objects):
    known = topo.grpc_service_names()
    for name in ("vision", "decoder", "decoder-vl", "pooling"):
        c = container(workloads(objects)[name])
        port = port_flag(c["command"])
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            grpc = c[probe]["grpc"]
            assert grpc["port"] == port and grpc["service"] in known, f"{name} {probe}: {grpc}"
    gateway = container(workloads(objects)["gateway"])
    assert gateway["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert gateway["livenessProbe"]["httpGet"]["path"] == "/health"


def test_hpas_scale_the_gateway_and_pooling_on_requested_cpu(objects):
    hpas, loads = by_kind(objects, "HorizontalPodAutoscaler"), workloads(objects)
    assert {h["spec"]["scaleTargetRef"]["name"] for h in hpas.values()} == {"gateway", "pooling"}
    for hpa in hpas.values():
        ref = hpa["spec"]["scaleTargetRef"]
        target = loads[ref["name"]]
        assert target["kind"] == ref["kind"] == "Deployment"
        assert 1 < hpa["spec"]["minReplicas"] < hpa["spec"]["maxReplicas"]
        # A Utilization target is a fraction of the request: without a CPU request the HPA never acts.
        assert "cpu" in container(target)["resources"]["requests"], ref["name"]


def test_pdbs_cover_every_model_service_and_never_block_a_drain(objects):
    pdbs, loads = by_kind(objects, "PodDisruptionBudget"), workloads(objects)
    covered = set()
    for name, pdb in pdbs.items():
        match = [w for w in loads.values() if pdb["spec"]["selector"]["matchLabels"].items()
                 <= w["spec"]["template"]["metadata"]["labels"].items()]
        assert len(match) == 1, f"PDB {name} selects {len(match)} workloads"
        covered.add(match[0]["metadata"]["name"])
        replicas = match[0]["spec"]["replicas"]
        if "minAvailable" in pdb["spec"]:
            assert pdb["spec"]["minAvailable"] < replicas, f"PDB {name} forbids every eviction"
        else:
            assert pdb["spec"]["maxUnavailable"] >= 1
    assert covered == {"vision", "decoder", "decoder-vl", "pooling", "gateway"}


def test_redis_is_bounded_and_keeps_nothing(objects):
    c = container(workloads(objects)["redis"])
    flags = dict(topo.split_argv(c["command"])[1])
    assert flags["--maxmemory-policy"] == "allkeys-lru" and flags["--save"] == "" and flags["--appendonly"] == "no"
    maxmemory = int(re.fullmatch(r"(\d+)mb", flags["--maxmemory"])[1])
    limit = int(re.fullmatch(r"(\d+)Mi", c["resources"]["limits"]["memory"])[1])
    assert limit > maxmemory, "the container limit must leave room above maxmemory, or Redis is OOM-killed"


def test_models_come_read_only_from_the_claim_and_config_from_the_configmap(objects):
    claims, configmaps = by_kind(objects, "PersistentVolumeClaim"), by_kind(objects, "ConfigMap")
    for name, load in workloads(objects).items():
        pod, c = load["spec"]["template"]["spec"], container(load)
        volumes = {v["name"]: v for v in pod.get("volumes", [])}
        reads_models = any(arg.startswith("/models/") for arg in c["command"])
        mounts = [m for m in c.get("volumeMounts", []) if m["mountPath"] == "/models"]
        assert bool(mounts) == reads_models, name
        for m in mounts:
            claim = volumes[m["name"]]["persistentVolumeClaim"]
            assert m["readOnly"] and claim["readOnly"] and claim["claimName"] in claims, name
        for ref in c.get("envFrom", []):
            assert ref["configMapRef"]["name"] in configmaps, name
    (config,) = configmaps.values()
    # Every key is a variable some service reads: a misspelt or stale name would be ignored silently.
    known = set().union(*topo.env_variables().values())
    assert sorted(set(config["data"]) - known) == []


def test_images_are_the_compose_images(objects):
    """kubectl apply -k runs exactly what `docker compose build` produced."""
    kustomization = yaml.safe_load((topo.K8S / "kustomization.yaml").read_text())
    tags = {i["name"]: i["newTag"] for i in kustomization["images"]}
    compose = topo.load_compose()["services"]
    for name, load in workloads(objects).items():
        image = container(load)["image"]
        assert (f"{image}:{tags[image]}" if image in tags else image) == compose[name]["image"], name


def normalise_address(value: str | None) -> str | None:
    """decoder-1.decoder:50052 (a StatefulSet pod) -> decoder:50052: the same service, one replica of it."""
    return re.sub(r"^([a-z][\w-]*)-\d+\.\1:", r"\1:", value) if value else value


def test_manifests_and_launcher_describe_the_same_topology(objects):
    loads, services = workloads(objects), by_kind(objects, "Service")
    rows = topo.rows()
    assert set(loads) == set(rows) | set(topo.AWAITING_LAUNCHER_ROW)
    for name, row in rows.items():
        c = container(loads[name])
        expected = topo.container_argv(row)
        if name == "gateway":
            for awaited, flag in topo.AWAITING_LAUNCHER_ROW.items():
                expected += [flag, f"{awaited}:{port_flag(container(loads[awaited])['command'])}"]
        head, pairs = topo.split_argv(c["command"])
        want_head, want_pairs = topo.split_argv(expected)
        got = {(flag, normalise_address(value)) for flag, value in pairs}
        assert (head, got) == (want_head, set(want_pairs)), f"{name}: command differs from the launcher's"
        assert [p["containerPort"] for p in c["ports"]] == [row.port], name
        assert [p["port"] for p in services[name]["spec"]["ports"]] == [row.port], name
    (config,) = by_kind(objects, "ConfigMap").values()
    for row in rows.values():  # optional flags `make up` takes from the environment come from the ConfigMap
        for flag, env, default in row.env_flags:
            key = topo.env_var_for(row, flag)
            assert key in config["data"], f"{row.name}: {flag} ({env}) has no ConfigMap key"
            assert config["data"][key] == topo.container_value(default), f"{key}: not `make up`'s default"


def cpu(quantity: str) -> float:
    return int(quantity[:-1]) / 1000 if quantity.endswith("m") else float(quantity)


def test_model_pods_request_their_share_and_run_that_many_threads_without_spinning(objects):
    """Pods share nodes: each model service runs its cpu request in torch threads (torch would start one per
    node CPU), with idle OpenMP workers asleep; the requests are the launcher's shares of the machine."""
    rows = topo.rows()
    for name, load in workloads(objects).items():
        c = container(load)
        env = {e["name"]: e.get("value") for e in c.get("env", [])}
        if not rows[name].compute_share:
            assert not set(threads.WAIT_VARIABLES) & set(env), name
            continue
        request = cpu(c["resources"]["requests"]["cpu"])
        assert request == rows[name].compute_share, name
        assert int(env[topo.ENV_PREFIX[topo.module_of(c["command"])] + "THREADS"]) == math.ceil(request), name
        assert env["OMP_WAIT_POLICY"] == threads.SHARED_WAIT["OMP_WAIT_POLICY"], name


def test_the_gateway_lists_every_decoder_replica(objects):
    """Every replica of every decoder StatefulSet (SmolLM2's and qwen2-vl-random's), by its stable name."""
    loads = workloads(objects)
    command = container(loads["gateway"])["command"]
    listed = [command[i + 1] for i, arg in enumerate(command) if arg == "--decoder"]
    decoders = [load for load in loads.values() if topo.module_of(container(load)["command"]) == "services.decoder"]
    assert {load["metadata"]["name"] for load in decoders} == {"decoder", "decoder-vl"}
    want = []
    for load in decoders:
        name, port = load["metadata"]["name"], port_flag(container(load)["command"])
        assert load["kind"] == "StatefulSet" and load["spec"]["serviceName"] == name
        want += [f"{name}-{i}.{name}:{port}" for i in range(load["spec"]["replicas"])]
    assert sorted(listed) == sorted(want)


# -- hardening: pods, containers, secrets --------------------------------------------------------------------

def dockerfile_uid() -> int:
    """The numeric user the tessera images run as (deploy/Dockerfile's USER uid:gid)."""
    return int(re.search(r"^USER (\d+):\d+$", topo.DOCKERFILE.read_text(), re.M)[1])


def test_every_pod_runs_non_root_under_seccomp_without_a_service_account_token(objects):
    for name, load in workloads(objects).items():
        pod = load["spec"]["template"]["spec"]
        assert pod["automountServiceAccountToken"] is False, name
        ctx = pod["securityContext"]
        assert ctx["runAsNonRoot"] is True and ctx["seccompProfile"] == {"type": "RuntimeDefault"}, name
        assert all(ctx[k] > 0 for k in ("runAsUser", "runAsGroup", "fsGroup")), f"{name}: {ctx}"
        assert "hostNetwork" not in pod and "hostPID" not in pod and "hostIPC" not in pod, name
        if container(load)["image"].startswith("tessera-"):
            assert ctx["runAsUser"] == dockerfile_uid(), f"{name}: not the image's user"


def test_every_container_is_read_only_unprivileged_with_every_capability_dropped(objects):
    for name, load in workloads(objects).items():
        pod = load["spec"]["template"]["spec"]
        for c in pod["containers"] + pod.get("initContainers", []):
            ctx = c["securityContext"]
            assert ctx == {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                           "capabilities": {"drop": ["ALL"]}}, f"{name}/{c['name']}: {ctx}"
            # Requests for the scheduler (and the HPAs), a memory limit against a runaway. No CPU limit by
            # choice: CFS throttling would stall a decode step mid-batch; the request reserves the cores.
            assert {"cpu", "memory"} <= set(c["resources"]["requests"]), name
            assert "memory" in c["resources"]["limits"], name


def test_the_writable_paths_are_size_capped_empty_dirs(objects):
    """Under a read-only root, each writable mount is an emptyDir with a size limit: /tmp for the services
    (where the image points the caches), Redis's --dir."""
    for name, load in workloads(objects).items():
        pod, c = load["spec"]["template"]["spec"], container(load)
        volumes = {v["name"]: v for v in pod["volumes"]}
        writable = {m["mountPath"]: volumes[m["name"]] for m in c["volumeMounts"] if not m.get("readOnly")}
        for path, volume in writable.items():
            assert "sizeLimit" in volume.get("emptyDir", {}), f"{name}: {path} is {volume}"
        if c["command"][0] == "redis-server":
            assert set(writable) == {dict(topo.split_argv(c["command"])[1])["--dir"]}, name
        else:
            assert set(writable) == {"/tmp"}, name
    assert "XDG_CACHE_HOME=/tmp/" in topo.DOCKERFILE.read_text() and "TRITON_HOME=/tmp" in topo.DOCKERFILE.read_text()


def test_redis_runs_as_its_user_and_its_probes_authenticate(objects):
    load = workloads(objects)["redis"]
    pod, c = load["spec"]["template"]["spec"], container(load)
    assert c["command"][0] == "redis-server"   # no entrypoint runs first: the pod's user is Redis's user
    assert pod["securityContext"]["runAsUser"] != 0
    port = int(dict(topo.split_argv(c["command"])[1])["--port"])
    for probe in ("readinessProbe", "livenessProbe"):
        assert c[probe]["exec"]["command"] == topo.redis_ping(port), probe
    (secret,) = [v["secret"] for v in pod["volumes"] if "secret" in v]
    assert {i["key"] for i in secret["items"]} == {"redis_conf", "redis_password"}


def test_no_secret_that_carries_auth_is_optional(objects):
    """A missing or misnamed Secret must keep a pod from starting, never start it without authentication.
    Only the admin key may be absent: without it the admin endpoints are refused (it fails closed)."""
    for name, load in workloads(objects).items():
        pod, c = load["spec"]["template"]["spec"], container(load)
        for volume in pod["volumes"]:
            if "secret" in volume:
                assert volume["secret"]["optional"] is False, f"{name}: {volume['name']}"
        for env in c.get("env", []):
            ref = env.get("valueFrom", {}).get("secretKeyRef")
            if ref:
                assert ref["optional"] is (env["name"] == "TESSERA_GATEWAY_ADMIN_KEY"), f"{name}: {env['name']}"
    gateway_env = {e["name"] for e in container(workloads(objects)["gateway"]).get("env", [])}
    assert "TESSERA_GATEWAY_API_KEY" in gateway_env


# -- NetworkPolicies -------------------------------------------------------------------------------------------

ANYWHERE = "anywhere"


def selected(selector: dict, loads: dict[str, dict]) -> set[str]:
    """The workloads whose pods a podSelector picks ({} picks them all)."""
    labels = selector.get("matchLabels", {})
    assert set(selector) <= {"matchLabels"}, f"only matchLabels is evaluated here: {selector}"
    return {n for n, w in loads.items() if labels.items() <= w["spec"]["template"]["metadata"]["labels"].items()}


def container_port(load: dict, port) -> int | None:
    """A policy's port on this workload: a number as it is, a name through the container's named ports."""
    if isinstance(port, int):
        return port
    return {p["name"]: p["containerPort"] for p in container(load)["ports"]}.get(port)


def admitted(objects) -> set[tuple[str, str, int]]:
    """(source, target workload, port) for every connection the policies let in. source: a workload of the
    namespace, ANYWHERE, or `namespaces:KEY=VALUE` for a namespaceSelector."""
    loads, edges = workloads(objects), set()
    for policy in by_kind(objects, "NetworkPolicy").values():
        spec = policy["spec"]
        assert spec["policyTypes"] == ["Ingress"], policy["metadata"]["name"]
        for target in selected(spec["podSelector"], loads):
            for rule in spec.get("ingress", []):
                sources = {ANYWHERE} if "from" not in rule else set()
                for peer in rule.get("from", []):
                    assert set(peer) in ({"podSelector"}, {"namespaceSelector"}), peer
                    if "podSelector" in peer:
                        sources |= selected(peer["podSelector"], loads)
                    else:
                        sources |= {"namespaces:" + ",".join(f"{k}={v}" for k, v in
                                                              peer["namespaceSelector"]["matchLabels"].items())}
                for port in rule["ports"]:
                    assert port["protocol"] == "TCP"
                    number = container_port(loads[target], port["port"])
                    if number is not None:
                        edges |= {(source, target, number) for source in sources}
    return edges


def dialled(objects) -> set[tuple[str, str, int]]:
    """(workload, workload it connects to, port), read from every command's HOST:PORT arguments."""
    loads, services = workloads(objects), by_kind(objects, "Service")
    edges = set()
    for name, load in loads.items():
        for arg in container(load)["command"]:
            for host, port in re.findall(r"(?:^|//)([a-z][\w.-]*):(\d+)", normalise_address(arg) or ""):
                if host in services:
                    (target,) = selected({"matchLabels": services[host]["spec"]["selector"]}, loads)
                    edges.add((name, target, int(port)))
    return edges


def test_ingress_is_denied_by_default_in_the_namespace(objects):
    policies = by_kind(objects, "NetworkPolicy")
    deny = [p for p in policies.values() if p["spec"]["podSelector"] == {} and not p["spec"].get("ingress")]
    assert len(deny) == 1 and deny[0]["spec"]["policyTypes"] == ["Ingress"]
    assert "networkpolicy.yaml" in yaml.safe_load((topo.K8S / "kustomization.yaml").read_text())["resources"]


def test_the_policies_admit_exactly_the_connections_the_fleet_makes(objects):
    """The gateway's HTTP port from anywhere; each backend's gRPC port from the gateway; Redis from vision;
    nothing else (the metrics rule matches no port in these manifests, see the next test)."""
    http = port_flag(container(workloads(objects)["gateway"])["command"])
    want = dialled(objects) | {(ANYWHERE, "gateway", http)}
    assert {(s, t) for s, t, _ in want} >= {("gateway", b) for b in ("decoder", "decoder-vl", "pooling", "vision")} \
        | {("vision", "redis")}
    assert admitted(objects) == want


def test_metrics_are_admitted_only_from_a_labelled_monitoring_namespace(objects):
    policies = by_kind(objects, "NetworkPolicy")
    (rule,) = policies["allow-metrics"]["spec"]["ingress"]
    assert rule == {"from": [{"namespaceSelector": {"matchLabels": {"tessera.io/scrape": "true"}}}],
                    "ports": [{"protocol": "TCP", "port": "metrics"}]}
    # A container that names a port `metrics` is then scraped from there, and from nowhere else.
    with_metrics = copy.deepcopy(objects)
    decoder = container(workloads(with_metrics)["decoder"])
    decoder["ports"].append({"name": "metrics", "containerPort": 9090})
    assert admitted(with_metrics) - admitted(objects) == {("namespaces:tessera.io/scrape=true", "decoder", 9090)}


def test_the_policy_check_notices_a_missing_or_wider_rule(objects):
    """The comparison is live: drop the vision -> Redis rule, or let every pod reach Redis, and it disagrees."""
    without = [o for o in objects if o["metadata"]["name"] != "redis-from-vision"]
    wider = copy.deepcopy(objects)
    next(o for o in wider if o["metadata"]["name"] == "redis-from-vision")["spec"]["ingress"][0]["from"] = \
        [{"podSelector": {}}]
    for broken in (without, wider):
        with pytest.raises(AssertionError):
            test_the_policies_admit_exactly_the_connections_the_fleet_makes(broken)


def test_the_namespace_enforces_the_restricted_pod_security_profile(objects):
    """Admission refuses any pod that drifts from what the tests above check; the volumes are of the kinds the
    profile allows."""
    (namespace,) = by_kind(objects, "Namespace").values()
    labels = namespace["metadata"]["labels"]
    assert labels["pod-security.kubernetes.io/enforce"] == "restricted"
    allowed = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim", "projected",
               "secret"}
    for name, load in workloads(objects).items():
        for volume in load["spec"]["template"]["spec"]["volumes"]:
            assert set(volume) - {"name"} <= allowed, f"{name}: {volume}"
