"""`make up` (deploy/launcher.py) hands the gateway's API and admin keys to the gateway alone, and refuses to
bind beyond loopback without an API key."""
from __future__ import annotations

import json
import sys

import pytest

from deploy import launcher, threads
from tests.deploy import topology as topo

KEYS = {"TESSERA_GATEWAY_API_KEY": "api-key-0123456789abcdef0123456789",
        "TESSERA_GATEWAY_ADMIN_KEY": "admin-key-0123456789abcdef01234567"}
FORMER = {"TESSERA_API_KEY": "old-api", "TESSERA_ADMIN_KEY": "old-admin"}
# Read by every service alike, or by none of them: these pass to every child.
SHARED = {"TESSERA_KERNELS_DIR": "/k", "TESSERA_BACKEND_TOKEN_FILE": "/t", "PATH": "/usr/bin", "HOME": "/h"}
OWN = {"TESSERA_DECODER_LOG_LEVEL": "DEBUG", "TESSERA_VISION_LOG_LEVEL": "DEBUG",
       "TESSERA_POOLING_LOG_LEVEL": "DEBUG"}
ENVIRON = {**KEYS, **FORMER, **SHARED, **OWN}


def rows() -> dict[str, launcher.Service]:
    return {row.name: row for row in launcher.TOPOLOGY}


def test_the_prefixes_are_the_config_modules_own():
    assert launcher.ENV_PREFIXES == topo.ENV_PREFIX


@pytest.mark.parametrize("name", [row.name for row in launcher.TOPOLOGY])
def test_each_child_gets_its_own_variables_and_only_the_gateway_gets_the_keys(name):
    env = launcher.child_env(rows()[name], ENVIRON)
    module = launcher.module_of(rows()[name])
    own = launcher.ENV_PREFIXES.get(module)
    assert SHARED.items() <= env.items() and env["PYTHONUNBUFFERED"] == "1"
    if module == "gateway":
        assert KEYS.items() <= env.items()
        assert FORMER.items() <= env.items()   # so that the gateway can refuse them by name
    else:
        assert not set(KEYS) & set(env) and not set(FORMER) & set(env), name
    assert {k for k in env if k.startswith(tuple(launcher.ENV_PREFIXES.values()))} == \
        {k for k in ENVIRON if own and k.startswith(own)}, name


def test_redis_gets_no_tessera_service_variable():
    env = launcher.child_env(rows()["redis"], ENVIRON)
    assert launcher.module_of(rows()["redis"]) == "redis-server"
    assert sorted(k for k in env if k.startswith("TESSERA_")) == ["TESSERA_BACKEND_TOKEN_FILE", "TESSERA_KERNELS_DIR"]


def test_the_processes_up_starts_see_only_their_environment(tmp_path, monkeypatch):
    """Through Fleet.start itself, as `up` spawns: each row's process dumps the environment it was given."""
    for name, value in ENVIRON.items():
        monkeypatch.setenv(name, value)
    (tmp_path / "logs").mkdir()
    fleet = launcher.Fleet(tmp_path, "127.0.0.1", drain_seconds=5)
    dump = "import json, os, sys; print(json.dumps(dict(os.environ)))"
    seen = {}
    for row in launcher.TOPOLOGY:
        proc = fleet.start(row, [sys.executable, "-c", dump])
        assert proc.wait(60) == 0
        seen[row.name] = json.loads((tmp_path / "logs" / f"{row.name}.log").read_text())
    fleet.stop()
    for name, env in seen.items():
        has_keys = {k for k in KEYS if k in env}
        assert has_keys == (set(KEYS) if name == "gateway" else set()), name
        if name == "gateway":
            assert all(env[k] == v for k, v in KEYS.items())


@pytest.mark.parametrize("host, environ, refused", [
    ("127.0.0.1", {}, False),
    ("localhost", {}, False),
    ("::1", {}, False),
    ("0.0.0.0", {}, True),
    ("10.1.2.3", {}, True),
    ("0.0.0.0", {"TESSERA_GATEWAY_API_KEY": ""}, True),   # an empty key is no key
    ("0.0.0.0", {"TESSERA_GATEWAY_API_KEY": KEYS["TESSERA_GATEWAY_API_KEY"]}, False),
])
def test_up_binds_beyond_loopback_only_with_an_api_key(host, environ, refused):
    assert (launcher.open_bind_refusal(host, environ) is not None) == refused


def test_up_without_a_key_on_every_interface_starts_nothing(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("TESSERA_GATEWAY_API_KEY", raising=False)
    run = tmp_path / "run"
    assert launcher.main(["up", "--run-dir", str(run), "--host", "0.0.0.0"]) == 2
    assert "without TESSERA_GATEWAY_API_KEY" in capsys.readouterr().err
    assert not (run / "fleet.json").exists() and not (run / "secrets").exists()


# -- thread settings (deploy/threads.py) ---------------------------------------------------------------------

@pytest.mark.parametrize("cpus, want", [
    # Fewer CPUs than model services: one thread each (they take turns; no team to spin at all).
    (2, {"vision": 1, "pooling": 1, "decoder": 1, "decoder-vl": 1}),
    # Shares 1:1:2:1 of 8 -> quotas 1.6, 1.6, 3.2, 1.6: floors 1, 1, 3, 1 and the two spare CPUs to the
    # largest remainders, first in the table on a tie.
    (8, {"vision": 2, "pooling": 2, "decoder": 3, "decoder-vl": 1}),
])
def test_up_splits_the_cpus_by_share_and_lets_idle_workers_sleep(cpus, want):
    settings = launcher.thread_settings(cpus, {})
    assert {name: s.threads for name, s in settings.items()} == want
    assert sum(want.values()) == max(cpus, len(want))
    for name, s in settings.items():
        assert s.argv() == ["--threads", str(want[name])]
        assert s.env == {"OMP_WAIT_POLICY": "PASSIVE"}
        env = launcher.child_env(rows()[name], {}, s)
        assert env["OMP_WAIT_POLICY"] == "PASSIVE", name
    assert set(settings) == {row.name for row in launcher.TOPOLOGY if row.compute_share}
    assert "gateway" not in settings and "redis" not in settings


def test_the_operators_settings_win():
    environ = {"TESSERA_POOLING_THREADS": "3", "GOMP_SPINCOUNT": "10000"}
    settings = launcher.thread_settings(8, environ)
    assert settings["pooling"].threads is None and settings["pooling"].argv() == []
    assert settings["decoder"].threads == 3
    assert all(not s.env for s in settings.values())   # the operator chose how workers wait
    assert {n: s.threads for n, s in launcher.thread_settings(8, {"OMP_WAIT_POLICY": "ACTIVE"}).items()} == \
        {n: s.threads for n, s in launcher.thread_settings(8, {}).items()}


def test_a_service_alone_keeps_every_core_and_the_active_wait():
    assert threads.fleet({"decoder": 2}, 16, {}) == {"decoder": threads.ThreadSettings()}
    assert threads.ThreadSettings().argv() == [] and not threads.ThreadSettings().env


@pytest.mark.parametrize("cpus, shares", [(0, {"a": 1}), (4, {}), (4, {"a": 0, "b": 1})])
def test_split_refuses_what_cannot_be_split(cpus, shares):
    with pytest.raises(ValueError, match="cpus"):
        threads.split(cpus, shares)


def test_up_starts_each_model_service_with_its_threads(tmp_path, monkeypatch):
    """Through Fleet.start, as `up` spawns: the variables reach the process."""
    (tmp_path / "logs").mkdir()
    fleet = launcher.Fleet(tmp_path, "127.0.0.1", drain_seconds=5)
    settings = launcher.thread_settings(2, {})
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    dump = "import json, os; print(json.dumps(dict(os.environ)))"
    for row in launcher.TOPOLOGY:
        proc = fleet.start(row, [sys.executable, "-c", dump], settings.get(row.name))
        assert proc.wait(60) == 0
        env = json.loads((tmp_path / "logs" / f"{row.name}.log").read_text())
        assert env.get("OMP_WAIT_POLICY") == ("PASSIVE" if row.compute_share else None), row.name
    fleet.stop()
