"""`python -m deploy.cluster`: its messages and exit statuses where no engine runs, and where a step fails."""
from __future__ import annotations

import subprocess
import sys

import pytest

from deploy.cluster import NOT_AVAILABLE, Engine, lifecycle, main
from deploy.cluster.paths import ROOT


@pytest.fixture
def no_engine(monkeypatch):
    monkeypatch.setattr(lifecycle, "engine_if_present", lambda: None)


def test_status_without_an_engine_is_not_available(no_engine, capsys):
    assert main(["status"]) == NOT_AVAILABLE
    assert capsys.readouterr().out == "[cluster] no container engine here\n"


def test_down_without_an_engine_has_nothing_to_take_down(no_engine, capsys):
    assert main(["down"]) == 0
    assert capsys.readouterr().out == "[cluster] no container engine here: nothing to take down\n"


def test_a_failed_step_is_one_failed_line_on_stderr_and_exit_1(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(lifecycle, "find_engine", lambda install, chosen: Engine("docker", ["true"]))
    monkeypatch.setattr(lifecycle, "MODELS", tmp_path / "models")
    assert main(["up", "--no-install"]) == 1
    err = capsys.readouterr().err
    assert err == "cluster: FAILED: models/ is missing: run `make models`\n"


def test_a_model_file_the_containers_cannot_read_is_named(monkeypatch, tmp_path):
    models = tmp_path / "models"
    (models / "m").mkdir(parents=True, mode=0o755)
    models.chmod(0o755)  # mkdir's mode is masked by the umask
    (models / "m").chmod(0o755)
    (models / "m" / "w.bin").write_bytes(b"")
    (models / "m" / "w.bin").chmod(0o600)
    monkeypatch.setattr(lifecycle, "MODELS", models)
    with pytest.raises(lifecycle.ClusterError, match=r"w.bin is mode 600: the containers' user cannot read it"):
        lifecycle.check_models()


def test_the_module_runs_as_a_program():
    done = subprocess.run([sys.executable, "-m", "deploy.cluster", "--help"], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0 and "{up,down,status}" in done.stdout
    done = subprocess.run([sys.executable, "-m", "deploy.cluster", "sideways"], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 2 and "invalid choice: 'sideways'" in done.stderr
