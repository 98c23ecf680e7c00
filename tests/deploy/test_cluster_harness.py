"""deploy/cluster.py (make cluster-up) and podman's override file, checked offline. The real run is
tests/cluster (make cluster-test); these hold the parts that need no engine."""
from __future__ import annotations

import resource
import shutil

import pytest
import yaml

from deploy import cluster
from tests.deploy import topology as topo


class ResetLoader(yaml.SafeLoader):
    """Reads compose's `!reset` tag (Docker Compose and podman-compose both know it) as a marker."""


RESET = object()
ResetLoader.add_constructor("!reset", lambda loader, node: RESET)


@pytest.fixture(scope="module")
def override() -> dict:
    return yaml.load(cluster.PODMAN_OVERRIDE.read_text(), Loader=ResetLoader)


def test_the_podman_override_drops_start_interval_wherever_the_main_file_sets_it(override):
    main = topo.load_compose()["services"]
    assert set(override["services"]) <= set(main)
    for name, svc in main.items():
        if "start_interval" in svc.get("healthcheck", {}):
            assert override["services"][name]["healthcheck"] == {"start_interval": RESET}, name


def test_the_podman_override_changes_nothing_else_but_the_redis_image(override):
    for name, svc in override["services"].items():
        extra = set(svc) - {"healthcheck"}
        assert extra == ({"image", "pull_policy"} if name == "redis" else set()), name
    assert override["services"]["redis"]["image"] == cluster.REDIS_IMAGE


def test_containers_conf_takes_the_file_limit_from_ulimit_hn():
    text = cluster.containers_conf_text()
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    want = 1048576 if hard == resource.RLIM_INFINITY else min(hard, 1048576)
    assert f'"nofile={want}:{want}"' in text and 'runtime = "runc"' in text
    assert text.startswith(cluster.CONF_MARK)


def test_no_engine_and_no_install_is_one_line_and_not_a_pass(monkeypatch, capsys):
    real_which = shutil.which
    monkeypatch.setattr(cluster.shutil, "which",
                        lambda name: None if name in ("docker", "podman") else real_which(name))
    monkeypatch.setenv("TESSERA_CLUSTER_NO_INSTALL", "1")
    with pytest.raises(cluster.EngineUnavailable) as refused:
        cluster.find_engine(install=True)
    assert "\n" not in str(refused.value) and "TESSERA_CLUSTER_NO_INSTALL" in str(refused.value)
    assert cluster.main(["up"]) == cluster.NOT_AVAILABLE
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 2 and out[-1].startswith("cluster: NOT RUN: no container engine")  # [cluster] phase line


def test_the_build_context_leaves_out_venvs_models_and_build_outputs():
    """buildah reads this file only through --ignorefile (deploy/cluster.py passes it); Docker reads it by name."""
    ignored = set(cluster.IGNOREFILE.read_text().split())
    assert {".venv", "models", "build", "gen"} <= ignored


def test_the_offline_pip_steps_take_the_wheels_context_only():
    text = topo.DOCKERFILE.read_text()
    assert "FROM scratch AS wheels" in text  # no wheels unless --build-context wheels=DIR replaces it
    pip_steps = [step for step in text.split("\nRUN ")[1:] if "pip install" in step]
    assert len(pip_steps) == 2
    for step in pip_steps:
        assert step.startswith("--mount=type=bind,from=wheels,target=/wheels")
        assert 'if [ "$WHEELS" = local ]; then export PIP_NO_INDEX=1 PIP_FIND_LINKS=/wheels; fi' in step
