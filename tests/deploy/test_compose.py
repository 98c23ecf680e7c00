"""deploy/docker-compose.yml, validated offline (no container engine runs here): the compose-spec JSON schema,
semantic checks, the Dockerfile targets it builds, and agreement with `make up`'s launcher table."""
from __future__ import annotations

import dataclasses
import json
import math
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from deploy import threads
from tests.deploy import topology as topo

CHECK_JSONSCHEMA = Path(sys.executable).parent / "check-jsonschema"


def validate_compose_spec(path: Path) -> subprocess.CompletedProcess:
    # The compose-spec schema vendored inside check-jsonschema (pinned in requirements.txt): no network.
    return subprocess.run([str(CHECK_JSONSCHEMA), "--builtin-schema", "vendor.compose-spec", str(path)],
                          capture_output=True, text=True, timeout=60)


@pytest.fixture(scope="module")
def compose() -> dict:
    return topo.load_compose()


def test_compose_file_matches_the_compose_spec_schema():
    done = validate_compose_spec(topo.COMPOSE)
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_schema_check_rejects_a_broken_file(tmp_path):
    """The validator really reads our file: a misspelt depends_on condition must fail it."""
    broken = tmp_path / "docker-compose.yml"
    text = topo.COMPOSE.read_text()
    assert "condition: service_healthy" in text
    broken.write_text(text.replace("condition: service_healthy", "condition: service_ready", 1))
    done = validate_compose_spec(broken)
    assert done.returncode != 0 and "service_ready" in done.stdout + done.stderr


def test_six_services(compose):
    assert set(compose["services"]) == {"redis", "vision", "decoder", "decoder-vl", "pooling", "gateway"}


def test_dependencies_exist_have_health_checks_and_wait_for_healthy(compose):
    services = compose["services"]
    for name, svc in services.items():
        for dep, how in svc.get("depends_on", {}).items():
            assert dep in services, f"{name} depends on unknown service {dep}"
            assert "healthcheck" in services[dep], f"{name} waits for {dep}, which has no healthcheck"
            assert how == {"condition": "service_healthy"}, f"{name} -> {dep}: {how}"


def dialled_services(command: list[str], services) -> set[str]:
    """Compose services a command connects to: NAME:PORT or scheme://NAME:PORT in its arguments."""
    hosts = {m for arg in command for m in re.findall(r"(?:^|//)([a-z][\w-]*):\d+", arg)}
    return hosts & set(services)


def test_each_service_waits_for_exactly_what_it_dials(compose):
    services = compose["services"]
    for name, svc in services.items():
        assert set(svc.get("depends_on", {})) == dialled_services(svc["command"], services), name


def test_every_service_has_a_health_check_the_right_way(compose):
    """gRPC services are checked with grpc.health.v1 for a service the protos declare; nothing uses a bare
    TCP connect, which would call a server healthy while its model is still loading."""
    known = topo.grpc_service_names()
    for name, svc in compose["services"].items():
        test = svc["healthcheck"]["test"]
        assert test[0] == "CMD", name
        if test[1:4] == ["python", "-m", "services.common.healthcheck"]:
            target = test[4]
            if not target.startswith("http://"):
                assert test[5] in known, f"{name} checks unknown gRPC service {test[5]}"
                assert target.endswith(f":{port_flag(svc['command'])}"), name
        else:
            assert name == "redis" and test[1:] == topo.redis_ping(int(port_flag(svc["command"])))


def port_flag(command: list[str]) -> str:
    return command[command.index("--port") + 1]


def test_ports_are_published_as_the_process_binds_them(compose):
    for name, svc in compose["services"].items():
        port = port_flag(svc["command"])
        assert any(p.endswith(f"{port}:{port}") for p in svc["ports"]), f"{name}: {svc['ports']}"


def test_redis_is_bounded_lru_and_keeps_nothing_on_disk(compose):
    _, flags = topo.split_argv(compose["services"]["redis"]["command"])
    flags = dict(flags)
    assert re.fullmatch(r"\d+[kmg]b", flags["--maxmemory"]), flags
    assert flags["--maxmemory-policy"] == "allkeys-lru"
    assert flags["--save"] == "" and flags["--appendonly"] == "no"


def mount_target(volume: str) -> str:
    """SOURCE:TARGET[:MODE] -> TARGET; the source may itself hold a colon (${VAR:-default})."""
    parts = volume.rsplit(":", 2)
    return parts[-2] if parts[-1] in ("ro", "rw") else parts[-1]


def test_models_are_mounted_read_only_where_they_are_read(compose):
    for name, svc in compose["services"].items():
        reads_models = any(arg.startswith("/models/") for arg in svc["command"])
        mounts = [v for v in svc.get("volumes", []) if mount_target(v) == "/models"]
        if reads_models:
            assert mounts and all(v.endswith(":ro") for v in mounts), f"{name}: {svc.get('volumes')}"
        else:
            assert not mounts, f"{name} reads no model but mounts them"


def dockerfile_targets() -> dict[str, dict]:
    """target -> {"from": parent, "expose": [ports], "cmd": [...]}, parsed from deploy/Dockerfile."""
    targets, current = {}, None
    for line in topo.DOCKERFILE.read_text().splitlines():
        if m := re.match(r"FROM\s+(\S+)\s+AS\s+(\S+)", line):
            current = targets.setdefault(m[2], {"from": m[1], "expose": [], "cmd": None})
        elif current is not None and (m := re.match(r"EXPOSE\s+(.+)", line)):
            current["expose"] += m[1].split()
        elif current is not None and (m := re.match(r"CMD\s+(\[.*\])", line)):
            current["cmd"] = json.loads(m[1])
    return targets


def test_every_built_service_has_a_dockerfile_target_on_the_one_base(compose):
    targets = dockerfile_targets()
    text = topo.DOCKERFILE.read_text()
    # The pinned environment: the CPU torch wheel first, then requirements.txt, then `make protos`.
    assert re.search(r"pip install --index-url https://download\.pytorch\.org/whl/cpu torch==2\.13\.0", text)
    assert text.index("torch==2.13.0") < text.index("requirements.txt") < text.index("make protos")
    for name, svc in compose["services"].items():
        if "build" not in svc:
            continue
        assert svc["build"]["context"] == ".." and svc["build"]["dockerfile"] == "deploy/Dockerfile", name
        target = targets[svc["build"]["target"]]
        assert target["from"] == "base", f"{name} is not built on the shared base"
        assert target["expose"] == [port_flag(svc["command"])], name
        assert target["cmd"] == svc["command"][:3], f"{name}: the image's default module differs"


def test_the_images_protos_step_runs_without_the_dev_venv(tmp_path):
    """The image has no .venv; its `make protos` overrides PY and STAMP. Run that exact invocation (dry) on a
    copy of the Makefile and protos, so a Makefile change that breaks the image build fails here."""
    invocation = re.search(r"RUN (make protos[^\\&\n]*)", topo.DOCKERFILE.read_text())[1].split()
    shutil.copy(topo.ROOT / "Makefile", tmp_path)
    shutil.copytree(topo.ROOT / "protos", tmp_path / "protos")
    done = subprocess.run([*invocation, "-n"], cwd=tmp_path, capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    assert "python -m grpc_tools.protoc" in done.stdout and "pip install" not in done.stdout


def test_awaiting_rows_are_really_missing_from_the_launcher():
    """When another issue adds a row to the launcher, drop it from AWAITING_LAUNCHER_ROW so the full
    comparison below covers it."""
    landed = set(topo.AWAITING_LAUNCHER_ROW) & set(topo.rows())
    assert not landed, f"{sorted(landed)} now in the launcher table: remove from AWAITING_LAUNCHER_ROW"


def test_compose_and_launcher_describe_the_same_topology(compose):
    services = compose["services"]
    rows = topo.rows()
    assert set(services) == set(rows) | set(topo.AWAITING_LAUNCHER_ROW), \
        "compose services differ from the launcher table (plus the rows still awaited)"
    for name, row in rows.items():
        svc = services[name]
        expected = topo.container_argv(row)
        if name == "gateway":  # it reaches the awaited services too, as compose runs them
            for awaited, flag in topo.AWAITING_LAUNCHER_ROW.items():
                expected += [flag, f"{awaited}:{port_flag(services[awaited]['command'])}"]
        assert topo.split_argv(svc["command"]) == topo.split_argv(expected), f"{name}: command differs"
        assert svc["healthcheck"]["test"] == topo.expected_healthcheck(row, row.port), f"{name}: health differs"
        waits = set(svc.get("depends_on", {}))
        expected_waits = topo.referenced_services(row) | (set(topo.AWAITING_LAUNCHER_ROW) if name == "gateway"
                                                          else set())
        assert waits == expected_waits, f"{name}: waits for {waits}, the launcher starts it after {expected_waits}"
        for flag, env, default in row.env_flags:  # flags `make up` takes from the environment, or its default
            value = svc.get("environment", {}).get(topo.env_var_for(row, flag), "")
            assert value == f"${{{env}:-{topo.container_value(default)}}}", \
                f"{name}: {flag} is not passed from ${env} with `make up`'s default"
        # Every variable handed to a container is one its own service reads (per-service prefixes).
        environment = svc.get("environment", {})
        keys = set(environment) if isinstance(environment, dict) else {e.split("=", 1)[0] for e in environment}
        reads = topo.env_variables().get(topo.module_of(list(row.argv)), set())
        if row.compute_share:   # and libgomp's wait, which torch's OpenMP reads (deploy/threads.py)
            reads = reads | set(threads.WAIT_VARIABLES)
        assert sorted(keys - reads) == [], f"{name}: sets variables its service does not read"


def test_the_agreement_check_notices_a_changed_port(compose, monkeypatch):
    """The comparison is live: move pooling to another port in the table and it must disagree."""
    from deploy import launcher
    moved = tuple(dataclasses.replace(row, port=50099) if row.name == "pooling" else row for row in launcher.TOPOLOGY)
    monkeypatch.setattr(launcher, "TOPOLOGY", moved)
    with pytest.raises(AssertionError, match="pooling|gateway"):
        test_compose_and_launcher_describe_the_same_topology(compose)


def test_model_services_run_their_cpu_cap_in_threads_and_let_idle_workers_sleep(compose):
    """They share the host's cores: torch would start one thread per host CPU, each team spinning when idle."""
    rows = topo.rows()
    for name, svc in compose["services"].items():
        env = svc.get("environment", {})
        if not rows[name].compute_share:
            assert not set(threads.WAIT_VARIABLES) & set(env), name
            continue
        variable = topo.ENV_PREFIX[topo.module_of(svc["command"])] + "THREADS"
        assert int(env[variable]) == math.ceil(float(svc["cpus"])), name
        assert env["OMP_WAIT_POLICY"] == threads.SHARED_WAIT["OMP_WAIT_POLICY"], name


# -- hardening ---------------------------------------------------------------------------------------------

def test_every_container_is_read_only_unprivileged_and_capped(compose):
    for name, svc in compose["services"].items():
        assert svc["cap_drop"] == ["ALL"] and "cap_add" not in svc, name
        assert "no-new-privileges:true" in svc["security_opt"], name
        assert svc["read_only"] is True and not svc.get("privileged"), name
        assert "network_mode" not in svc and "pid" not in svc and "ipc" not in svc, name
        assert re.fullmatch(r"\d+[mg]", str(svc["mem_limit"])) and 0 < float(svc["cpus"]) <= 2, name
        # Writable: size-capped tmpfs only (the image points the caches at /tmp; Redis writes its --dir).
        tmpfs = {entry.split(":", 1)[0]: entry for entry in svc["tmpfs"]}
        assert all(re.search(r":size=\d+[kmg]$", entry) for entry in tmpfs.values()), name
        want = {"/tmp", dict(topo.split_argv(svc["command"])[1])["--dir"]} if name == "redis" else {"/tmp"}
        assert set(tmpfs) == want, name
        assert all(v.endswith(":ro") for v in svc.get("volumes", [])), name


def parse_bytes(size: str) -> int:
    """4g / 4Gi / 384m / 384Mi -> bytes (binary units either way)."""
    number, unit = re.fullmatch(r"(\d+)([kmgKMG])i?", size).groups()
    return int(number) << {"k": 10, "m": 20, "g": 30}[unit.lower()]


def test_memory_caps_are_the_kubernetes_limits(compose):
    k8s = {o["metadata"]["name"]: o for o in topo.load_k8s() if o["kind"] in ("Deployment", "StatefulSet")}
    for name, svc in compose["services"].items():
        (c,) = k8s[name]["spec"]["template"]["spec"]["containers"]
        assert parse_bytes(svc["mem_limit"]) == parse_bytes(c["resources"]["limits"]["memory"]), name


def test_redis_runs_as_its_user_not_root(compose):
    user = compose["services"]["redis"]["user"]
    uid, gid = (int(part) for part in user.split(":"))
    assert uid != 0 and gid != 0


def test_ports_are_published_on_loopback_only(compose):
    """A fleet started without an API key must not answer the network: the gateway too stays on this host
    (docs/deployment.md shows the override that publishes it, which demands a key)."""
    for name, svc in compose["services"].items():
        assert all(p.startswith("127.0.0.1:") for p in svc["ports"]), f"{name}: {svc['ports']}"


def test_each_service_is_given_exactly_the_secrets_it_reads(compose):
    for name, svc in compose["services"].items():
        words = [*svc["command"], *svc["healthcheck"]["test"]]
        read = {m for word in words for m in re.findall(r"/run/secrets/(\w+)", word)}
        assert set(svc["secrets"]) == read, name
        assert read <= set(compose["secrets"]), name
