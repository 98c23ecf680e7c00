"""Config: flags > environment > defaults, validated at start with a clear message, frozen."""
from __future__ import annotations

import ast
import dataclasses
from dataclasses import dataclass
from pathlib import Path

import pytest

from services.common.config import load, option
from services.common.server import ServerConfig


@dataclass(frozen=True)
class Demo:
    """demo options"""

    name: str = option("x", "a name")
    count: int = option(2, "how many")
    ratio: float = option(0.5, "a ratio")
    enabled: bool = option(True, "a switch")
    mode: str = option("a", "a mode", choices=("a", "b"))
    tags: tuple[str, ...] = option((), "repeatable")

    def __post_init__(self):
        if self.count < 0:
            raise ValueError("count must be >= 0")


def parse(argv, env=None):
    (cfg,) = load((Demo,), argv, prog="demo", description="d", env_prefix="T_", environ=env or {})
    return cfg


def test_defaults_env_and_flags_in_that_order():
    assert parse([]) == Demo()
    env = {"T_COUNT": "5", "T_ENABLED": "false", "T_TAGS": "a,b", "T_RATIO": "0.25"}
    assert parse([], env) == Demo(count=5, enabled=False, tags=("a", "b"), ratio=0.25)
    got = parse(["--count", "7", "--enabled", "--tags", "z"], env)
    assert got == Demo(count=7, enabled=True, tags=("z",), ratio=0.25)


def test_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        parse([]).count = 3


@pytest.mark.parametrize("argv, env", [
    (["--count", "-1"], {}), (["--count", "two"], {}), (["--mode", "c"], {}), ([], {"T_MODE": "c"}),
    ([], {"T_ENABLED": "maybe"}), ([], {"T_COUNT": "1.5"}),
])
def test_invalid_values_exit_2_with_a_message(argv, env, capsys):
    with pytest.raises(SystemExit) as info:
        parse(argv, env)
    assert info.value.code == 2
    assert "error" in capsys.readouterr().err


def test_help_names_every_flag_default_and_env(capsys):
    with pytest.raises(SystemExit):
        parse(["--help"])
    out = capsys.readouterr().out
    for flag, env in [("--name", "T_NAME"), ("--count", "T_COUNT"), ("--enabled", "T_ENABLED"),
                      ("--tags", "T_TAGS")]:
        assert flag in out and env in out
    assert "default: 2" in out


def test_server_config_validation():
    with pytest.raises(ValueError):
        ServerConfig(port=70000)
    with pytest.raises(ValueError):
        ServerConfig(max_message_mb=0)


ROOT = Path(__file__).resolve().parents[2]
CONFIG_MODULES = {"services/common/config.py", "services/decoder/server/config.py", "services/vision/config.py",
                  "services/pooling/config.py", "gateway/config.py"}


def reads_tessera_env(source: str) -> bool:
    """Whether a module reads the environment and names a TESSERA_ variable in code (docstrings aside)."""
    tree = ast.parse(source)
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                  and node.body and isinstance(node.body[0], ast.Expr)
                  and isinstance(node.body[0].value, ast.Constant)}
    names = any(isinstance(n, ast.Constant) and isinstance(n.value, str) and n.value.startswith("TESSERA_")
                and id(n) not in docstrings for n in ast.walk(tree))
    reads = any(isinstance(n, ast.Attribute) and n.attr in ("environ", "getenv") for n in ast.walk(tree))
    return names and reads


def test_only_the_config_modules_read_tessera_variables():
    assert reads_tessera_env('import os\nENV = "TESSERA_X"\nmode = os.environ.get(ENV)\n')     # the rule bites
    assert not reads_tessera_env('"""Set TESSERA_X."""\nimport os\nos.environ.get("HOME")\n')
    offenders = [str(p.relative_to(ROOT)) for top in ("services", "gateway") for p in (ROOT / top).rglob("*.py")
                 if str(p.relative_to(ROOT)) not in CONFIG_MODULES and reads_tessera_env(p.read_text())]
    assert offenders == []


def test_a_renamed_variable_is_refused_only_when_the_new_one_is_unset(capsys):
    @dataclass(frozen=True)
    class Moved:
        """moved"""

        key: str = option("", "a key", formerly="OLD_KEY")

    def parse_moved(env):
        return load((Moved,), [], prog="m", description="m", env_prefix="NEW_", environ=env)[0]

    assert parse_moved({"NEW_KEY": "k", "OLD_KEY": "stale"}).key == "k"
    with pytest.raises(SystemExit):
        parse_moved({"OLD_KEY": "k"})
    assert "OLD_KEY is no longer read: set NEW_KEY instead" in capsys.readouterr().err
    # former_prefix: every field's old PREFIX name
    with pytest.raises(SystemExit):
        load((Demo,), [], prog="d", description="d", env_prefix="T_", environ={"OLD_COUNT": "3"}, former_prefix="OLD_")
    assert "OLD_COUNT is no longer read: set T_COUNT instead" in capsys.readouterr().err
