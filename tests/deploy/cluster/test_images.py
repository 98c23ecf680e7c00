"""What the image builds rely on in deploy/Dockerfile and its ignore file, checked without an engine."""
from __future__ import annotations

from deploy.cluster.paths import IGNOREFILE
from tests.deploy import topology as topo


def test_the_build_context_leaves_out_venvs_models_and_build_outputs():
    """buildah reads this file only through --ignorefile (deploy/cluster/images.py passes it); Docker reads it
    by name."""
    ignored = set(IGNOREFILE.read_text().split())
    assert {".venv", "models", "build", "gen"} <= ignored


def test_the_offline_pip_steps_take_the_wheels_context_only():
    text = topo.DOCKERFILE.read_text()
    assert "FROM scratch AS wheels" in text  # no wheels unless --build-context wheels=DIR replaces it
    pip_steps = [step for step in text.split("\nRUN ")[1:] if "pip install" in step]
    assert len(pip_steps) == 2
    for step in pip_steps:
        assert step.startswith("--mount=type=bind,from=wheels,target=/wheels")
        assert 'if [ "$WHEELS" = local ]; then export PIP_NO_INDEX=1 PIP_FIND_LINKS=/wheels; fi' in step
