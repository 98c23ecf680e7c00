"""The compose cluster in real containers, for tests/cluster (collected only with --cluster: make cluster-test).

The session starts it with deploy.cluster.up (engine set-up, base image, wheelhouse, images, compose up,
health), so `make cluster-test` needs nothing before it; a cluster already up is reused. Where no engine
can be had, every test is skipped with one line that says why: skipped, never passed.
"""
from __future__ import annotations

import os

import pytest

from deploy import cluster as cluster_mod


@pytest.fixture(scope="session")
def cluster(request) -> cluster_mod.Engine:
    # Minutes of set-up on a fresh machine: its progress lines go to the terminal as they come, not captured.
    live = request.config.pluginmanager.getplugin("capturemanager").global_and_fixture_disabled
    chosen = cluster_mod.settings()
    keep = chosen.keep
    with live():
        try:
            engine = cluster_mod.up(install=not chosen.no_install)
        except cluster_mod.EngineUnavailable as exc:
            pytest.skip(f"cluster test NOT RUN: {exc}")
        except BaseException:
            if not keep:
                cluster_mod.down()  # a half-started cluster is not left running
            raise
    yield engine
    # The last test takes it down and checks; this is for a run that stopped before it.
    if not keep:
        with live():
            cluster_mod.down(engine)


def pytest_collection_modifyitems(config, items):
    """`pytest tests` never collects this folder (tests/conftest.py ignores it); named explicitly without
    --cluster, its tests are deselected rather than started, so no cluster comes up by accident."""
    if config.getoption("--cluster"):
        return
    here = os.path.dirname(os.path.abspath(__file__))
    mine = [item for item in items if str(item.path).startswith(here + os.sep)]
    if mine:
        config.hook.pytest_deselected(items=mine)
        items[:] = [item for item in items if item not in mine]
