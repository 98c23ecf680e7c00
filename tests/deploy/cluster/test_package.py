"""The shape of deploy/cluster/, read from its source: each concern in one module, imports pointing one way.

Each rule is a function of one module's source, so each test also builds a violation and shows the rule
finds it.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

import deploy.cluster

PACKAGE = Path(deploy.cluster.__file__).parent
MAX_LINES = 300
# module -> rank: a module imports only modules of a lower rank (cli at the top, paths and config at the bottom).
RANK = {"cli": 7, "lifecycle": 6, "health": 5, "images": 5, "wheelhouse": 5, "engine": 4, "podman": 3,
        "compose": 3, "timings": 3, "commands": 2, "config": 1, "paths": 1}
OWNER = {"env": "config", "root": "podman", "yaml": "compose"}


def sources() -> dict[str, str]:
    return {p.stem: p.read_text() for p in sorted(PACKAGE.glob("*.py")) if p.stem not in ("__init__", "__main__")}


def too_long(module: str, source: str) -> list[str]:
    n = len(source.splitlines())
    return [f"{module}: {n} lines"] if n > MAX_LINES else []


def imports_against_rank(module: str, source: str) -> list[str]:
    bad = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            names = [node.module] if node.module else [a.name for a in node.names]
            bad += [f"{module} imports {n}" for n in names if RANK[n.split(".")[0]] >= RANK[module]]
    return bad


def env_reads(module: str, source: str) -> list[str]:
    """`X.get("TESSERA_...")`, `getenv("TESSERA_...")`, `X["TESSERA_..."]`: a read of a project variable."""
    def named(node: ast.AST) -> bool:
        return isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith("TESSERA_")
    bad = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
                node.func.attr in ("get", "getenv") and node.args and named(node.args[0]):
            bad.append(f"{module}:{node.lineno} reads {node.args[0].value}")
        elif isinstance(node, ast.Subscript) and named(node.slice):
            bad.append(f"{module}:{node.lineno} reads {node.slice.value}")
    return bad if module != OWNER["env"] else []


def root_code(module: str, source: str) -> list[str]:
    """apt-get as a command word, or a question about being root."""
    bad = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Constant) and node.value == "apt-get":
            bad.append(f"{module}:{node.lineno} runs apt-get")
        elif isinstance(node, ast.Attribute) and node.attr == "geteuid":
            bad.append(f"{module}:{node.lineno} asks for root")
    return bad if module != OWNER["root"] else []


def yaml_readers(module: str, source: str) -> list[str]:
    found = [n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.Import) and
             any(a.name == "yaml" for a in n.names)]
    return [f"{module} imports yaml"] if found and module != OWNER["yaml"] else []


RULES = [too_long, imports_against_rank, env_reads, root_code, yaml_readers]


def test_every_module_has_a_rank():
    assert set(sources()) == set(RANK)


@pytest.mark.parametrize("rule", RULES, ids=lambda r: r.__name__)
def test_the_package_keeps_the_rule(rule):
    bad = [v for module, source in sources().items() for v in rule(module, source)]
    assert not bad, bad


VIOLATIONS = {
    too_long: ("health", "x = 1\n" * (MAX_LINES + 1)),
    imports_against_rank: ("engine", "from .lifecycle import up\n"),
    env_reads: ("lifecycle", "import os\nkeep = os.environ.get('TESSERA_CLUSTER_KEEP')\n"),
    root_code: ("images", "import os, subprocess\nsubprocess.run(['apt-get', 'install', 'x'])\n"),
    yaml_readers: ("health", "import yaml\n"),
}


@pytest.mark.parametrize("rule", RULES, ids=lambda r: r.__name__)
def test_each_rule_sees_a_violation_built_for_it(rule):
    module, source = VIOLATIONS[rule]
    assert rule(module, source)


def test_a_subscript_read_and_a_root_check_are_violations_too():
    assert env_reads("cli", "import os\nx = os.environ['TESSERA_OFFLINE_WHEELS']\n")
    assert root_code("engine", "import os\nroot = os.geteuid() == 0\n")
    assert not env_reads("config", "import os\nx = os.environ['TESSERA_OFFLINE_WHEELS']\n")
