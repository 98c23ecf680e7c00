"""deploy/k8s/, validated offline: every object against the Kubernetes JSON schemas that the pinned
`kubernetes-validate` wheel ships (strict: unknown fields fail), then the wiring a schema cannot see
(selectors, probes, headless gRPC Services, HPAs, PDBs) and agreement with the launcher table."""
from __future__ import annotations

import copy
import re

import kubernetes_validate
import pytest
import yaml

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
