"""deploy/models.py leaves every model folder readable by others: the containers read /models as uid 10001,
not as whoever ran `make models`, and mkdtemp's 0700 folder (with a writer's 0600 files) kept three of the
four models from them."""
from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from deploy import models


def fake_build(dest: Path, out: Path) -> None:
    """Writes the way the real writers did: a private subfolder and 0600 files (safetensors' own mode)."""
    (dest / "sub").mkdir()
    for path in (dest / "model.safetensors", dest / "sub" / "config.json"):
        path.write_text("{}")
        path.chmod(0o600)
    (dest / "sub").chmod(0o700)
    (dest / "run.sh").write_text("#!/bin/sh\n")
    (dest / "run.sh").chmod(0o700)


def modes(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): stat.S_IMODE(p.stat().st_mode) for p in [root, *root.rglob("*")]}


def assert_readable_by_others(root: Path) -> None:
    for name, mode in modes(root).items():
        need = 0o755 if (root / name).is_dir() else 0o644
        assert mode & need == need, f"{name} is {mode:o}"


@pytest.fixture
def strict_umask():
    """A umask that alone would make everything private: the modes must not depend on the caller's."""
    old = os.umask(0o077)
    yield
    os.umask(old)


def test_prepare_writes_folders_and_files_readable_by_others(tmp_path, monkeypatch, strict_umask):
    monkeypatch.setattr(models, "STEPS", (models.Step("m", fake_build, "a model"),
                                          models.Step(f"{models.ADAPTERS_DIR}/a", fake_build, "an adapter")))
    out = tmp_path / "models"
    done = models.prepare(out)
    assert [p.relative_to(out).as_posix() for p in done] == ["m", "adapters/a"]
    assert_readable_by_others(out)
    got = modes(out)
    # Exactly 0755 / 0644: nothing becomes writable by others, and an executable keeps its bit.
    assert got["m"] == 0o755 and got["m/sub"] == 0o755 and got["adapters"] == 0o755
    assert got["m/model.safetensors"] == 0o644 and got["adapters/a/sub/config.json"] == 0o644
    assert got["m/run.sh"] == 0o744


def test_a_folder_written_before_the_rule_is_repaired(tmp_path, monkeypatch):
    monkeypatch.setattr(models, "STEPS", (models.Step("m", fake_build, "a model"),))
    out = tmp_path / "models"
    (out / "m").mkdir(parents=True)
    fake_build(out / "m", out)
    (out / "m").chmod(0o700)  # what mkdtemp + rename left behind
    models.prepare(out)
    assert_readable_by_others(out)
