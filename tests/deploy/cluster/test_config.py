"""deploy/cluster/config.py: each variable, and that it is read when asked, not at import."""
from __future__ import annotations

from deploy.cluster.config import ClusterSettings, settings


def test_nothing_set_is_every_default():
    assert ClusterSettings.from_env({}) == ClusterSettings(no_install=False, force_podman=False,
                                                           offline_wheels=False, keep=False)


def test_each_variable_sets_its_field():
    chosen = ClusterSettings.from_env({"TESSERA_CLUSTER_NO_INSTALL": "1", "TESSERA_CLUSTER_ENGINE": "podman",
                                       "TESSERA_OFFLINE_WHEELS": "1", "TESSERA_CLUSTER_KEEP": "1"})
    assert chosen == ClusterSettings(no_install=True, force_podman=True, offline_wheels=True, keep=True)


def test_only_podman_forces_an_engine():
    assert not ClusterSettings.from_env({"TESSERA_CLUSTER_ENGINE": "docker"}).force_podman


def test_the_environment_is_read_when_asked(monkeypatch):
    monkeypatch.delenv("TESSERA_CLUSTER_KEEP", raising=False)
    assert not settings().keep
    monkeypatch.setenv("TESSERA_CLUSTER_KEEP", "1")
    assert settings().keep
