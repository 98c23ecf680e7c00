"""deploy/cluster/podman.py and podman's override file, checked without an engine. The real run is
tests/cluster (make cluster-test)."""
from __future__ import annotations

import resource
import shutil

import pytest
import yaml

from deploy.cluster import NOT_AVAILABLE, EngineUnavailable, find_engine, main, podman
from deploy.cluster.config import ClusterSettings
from deploy.cluster.images import REDIS_IMAGE
from deploy.cluster.paths import PODMAN_OVERRIDE
from tests.deploy import topology as topo


class ResetLoader(yaml.SafeLoader):
    """Reads compose's `!reset` tag (Docker Compose and podman-compose both know it) as a marker."""


RESET = object()
ResetLoader.add_constructor("!reset", lambda loader, node: RESET)


@pytest.fixture(scope="module")
def override() -> dict:
    return yaml.load(PODMAN_OVERRIDE.read_text(), Loader=ResetLoader)


def test_the_podman_override_drops_start_interval_wherever_the_main_file_sets_it(override):
    main_services = topo.load_compose()["services"]
    assert set(override["services"]) <= set(main_services)
    for name, svc in main_services.items():
        if "start_interval" in svc.get("healthcheck", {}):
            assert override["services"][name]["healthcheck"] == {"start_interval": RESET}, name


def test_the_podman_override_changes_nothing_else_but_the_redis_image(override):
    for name, svc in override["services"].items():
        extra = set(svc) - {"healthcheck"}
        assert extra == ({"image", "pull_policy"} if name == "redis" else set()), name
    assert override["services"]["redis"]["image"] == REDIS_IMAGE


def test_containers_conf_takes_the_file_limit_from_ulimit_hn():
    text = podman.containers_conf_text()
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    want = 1048576 if hard == resource.RLIM_INFINITY else min(hard, 1048576)
    assert f'"nofile={want}:{want}"' in text and 'runtime = "runc"' in text
    assert text.startswith(podman.CONF_MARK)


@pytest.mark.parametrize("first_line, ours", [
    ("# Written by tessera's deploy/cluster.py (make cluster-up): podman as root where crun cannot set", True),
    ("# Written by tessera's deploy/cluster (make cluster-up): podman as root where crun cannot set", True),
    ("# my own containers.conf", False),
])
def test_a_containers_conf_is_rewritten_only_when_tessera_wrote_it(tmp_path, monkeypatch, first_line, ours):
    """A file the single-module harness wrote carries the older mark and is still ours to bring up to date;
    anyone else's is left as it is."""
    conf = tmp_path / "containers.conf"
    conf.write_text(first_line + "\n[engine]\nruntime = \"crun\"\n")
    monkeypatch.setattr(podman, "CONTAINERS_CONF", conf)
    monkeypatch.setattr(podman.os, "geteuid", lambda: 0)
    before = conf.read_text()
    podman.configure_podman()
    assert (conf.read_text() == podman.containers_conf_text()) is ours
    assert (conf.read_text() == before) is not ours


def test_may_install_says_why_not():
    assert podman.may_install(ClusterSettings(no_install=True, force_podman=False, offline_wheels=False,
                                              keep=False)) == (False, "TESSERA_CLUSTER_NO_INSTALL is set")


def test_no_engine_and_no_install_is_one_line_and_not_a_pass(monkeypatch, capsys):
    real_which = shutil.which
    monkeypatch.setattr(shutil, "which", lambda name: None if name in ("docker", "podman") else real_which(name))
    monkeypatch.setenv("TESSERA_CLUSTER_NO_INSTALL", "1")
    with pytest.raises(EngineUnavailable) as refused:
        find_engine(install=True)
    assert "\n" not in str(refused.value) and "TESSERA_CLUSTER_NO_INSTALL" in str(refused.value)
    assert main(["up"]) == NOT_AVAILABLE
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 2 and out[-1].startswith("cluster: NOT RUN: no container engine")  # [cluster] phase line
