"""Config: flags > environment > defaults, validated at start with a clear message, frozen."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

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
