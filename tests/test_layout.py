"""The house rules on layout, read from the source, each proven able to fail on a violation built here.

- The gateway talks to the services over gRPC only: it imports nothing from services/ but
  services/common.
- In the decoder, dependencies point one way: server -> engine -> runner -> model/lora -> kernels
  (text/ is used by the server only; multimodal/ sits beside the runner; grammar/ is used by the
  server and the runner, never the engine), except for the engine's contract types, which both
  sides of it share.
- No two modules import each other, directly or through others, type-checking imports included.
- Each service is its own: a service imports or #includes nothing of another service but
  services/common, and no C++ source #includes a .cpp (shared code lives in headers).
- Modules stay small enough to read in one go: under MAX_LINES lines in services/, gateway/, deploy/.
- Only config modules read TESSERA_* environment variables, and no request state travels as a
  string-keyed `features` dict: each concern has one owner, and a reader finds it by its type.
- Comments point inside the tree: none cites a design file outside the repository, an issue
  number or a commit; the project's own record is docs/design.md.

Each rule is a function of a source root, so the same code that checks the tree checks a small tree
with one violation written under tmp_path (the tests at the end), and a rule that could never fail
would fail there.
"""
from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("gateway", "services", "deploy", "bench")

# Decoder subpackage -> the decoder subpackages it must never import (the layers above it).
DECODER_ABOVE = {
    "kernels": {"server", "engine", "runner", "model", "lora", "multimodal", "text", "grammar"},
    "model": {"server", "engine", "runner", "lora", "multimodal", "text", "grammar"},
    "lora": {"server", "engine", "runner", "multimodal", "text", "grammar"},
    "runner": {"server", "engine", "text"},
    # Structured outputs: the server compiles, the runner's sampler masks; the engine never sees a grammar.
    "grammar": {"server", "engine", "runner", "model", "lora", "kernels", "multimodal", "text"},
    "engine": {"server", "text", "runner", "model", "lora", "kernels", "multimodal", "grammar"},
    "text": {"server", "engine", "runner", "model", "lora", "kernels", "multimodal", "grammar"},
}
# The engine core's torch-free data types and hooks: the contract it hands the runner (StepInput,
# SamplingParams), reports upward (RequestOutput) and calls hooks with (Request). Layers on both
# sides use them; the engine's machinery (scheduler, core, KV manager) stays the server's alone.
ENGINE_CONTRACT = {"services.decoder.engine.step", "services.decoder.engine.output", "services.decoder.engine.request"}

CPP_SUFFIXES = {".cpp", ".h", ".hpp"}
INCLUDE = re.compile(r'^\s*#\s*include\s*"([^"]+)"', re.M)
SIZED_DIRS = ("services", "gateway", "deploy")
MAX_LINES = 500

# Where comments live: every source, build and deploy file of the project, and the tests.
CITATION_DIRS = ("services", "gateway", "deploy", "bench", "tests", "protos")
CITATION_FILES = ("Makefile", "pyproject.toml")
CITATION_SUFFIXES = {".py", ".cpp", ".h", ".hpp", ".proto", ".sh", ".yml", ".yaml", ".toml", ".Containerfile"}
# A design file outside the tree, an issue or PR number, or a commit named as the reason for the code.
# (The words are split so that this file does not cite them itself.)
OUTSIDE = re.compile("|".join((
    r"\bDESIGN(?:\.md|\s+invariant)",
    r"\.\./shared/",
    r"\b[Ii]ssues?\s+#?\d+",
    r"(?:^|[^&\w])#\d+\b",
    r"\bcommits?\s+[0-9a-f]{7,40}\b",
)))


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(path: Path, known: set[str], root: Path = ROOT) -> set[str]:
    """The project modules `path` imports (every import statement, at any depth)."""
    here = module_name(path, root)
    package = here if path.name == "__init__.py" else here.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            names = [base] + [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        for name in names:
            # The longest known prefix: `from a.b import c` is module a.b.c when that exists, else a.b.
            while name and name not in known:
                name = name.rpartition(".")[0]
            if name and name != here:
                found.add(name)
    return found


def graph(root: Path = ROOT) -> dict[str, set[str]]:
    """Module name -> the project modules it imports, for every .py under PACKAGES."""
    files = [p for pkg in PACKAGES if (root / pkg).is_dir() for p in (root / pkg).rglob("*.py")]
    known = {module_name(p, root) for p in files}
    return {module_name(p, root): imports_of(p, known, root) for p in files}


# ---------------------------------------------------------------------------------------------- the rules
# Each takes a source root and returns its violations, empty when the rule holds.

def gateway_reaches_into_services(root: Path = ROOT) -> list[tuple[str, str]]:
    return sorted((m, d) for m, deps in graph(root).items() if m.startswith("gateway")
                  for d in deps if d.startswith("services.") and not d.startswith("services.common"))


def decoder_imports_upward(root: Path = ROOT) -> list[tuple[str, str]]:
    bad = []
    for m, deps in graph(root).items():
        parts = m.split(".")
        if parts[:2] != ["services", "decoder"] or len(parts) < 3 or parts[2] not in DECODER_ABOVE:
            continue
        for d in deps - ENGINE_CONTRACT:
            dparts = d.split(".")
            if dparts[:2] == ["services", "decoder"] and len(dparts) > 2 and dparts[2] in DECODER_ABOVE[parts[2]]:
                bad.append((m, d))
    return sorted(bad)


def import_cycles(root: Path = ROOT) -> list[list[str]]:
    g = graph(root)
    state: dict[str, int] = {}       # 1: on the current path, 2: done
    cycles = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for dep in sorted(g.get(node, ())):
            # A package's __init__ re-exporting its own modules is not a circle between modules.
            if node.startswith(dep + ".") or dep.startswith(node + "."):
                continue
            if state.get(dep) == 1:
                cycles.append(path[path.index(dep):] + [dep])
            elif dep not in state:
                visit(dep, path + [dep])
        state[node] = 2

    for node in sorted(g):
        if node not in state:
            visit(node, [node])
    return cycles


def service_of(path: Path, root: Path) -> str | None:
    """'decoder' for services/decoder/..., None outside services/."""
    parts = path.resolve().relative_to(root.resolve()).parts if path.resolve().is_relative_to(root.resolve()) else ()
    return parts[1] if len(parts) > 2 and parts[0] == "services" else None


def services_reaching_into_each_other(root: Path = ROOT) -> list[tuple[str, str]]:
    """(importer, imported) across two services, Python imports and C++ #includes alike."""
    bad = []
    for m, deps in graph(root).items():
        parts = m.split(".")
        if parts[0] != "services" or len(parts) < 3:
            continue
        for d in deps:
            dparts = d.split(".")
            if dparts[0] == "services" and len(dparts) > 1 and dparts[1] not in (parts[1], "common"):
                bad.append((m, d))
    for src in cpp_sources(root):
        for target in INCLUDE.findall(src.read_text()):
            there, here = service_of(src.parent / target, root), service_of(src, root)
            if here and there and there not in (here, "common"):
                bad.append((str(src.relative_to(root)), target))
    return sorted(bad)


def cpp_sources(root: Path) -> list[Path]:
    return sorted(p for d in SIZED_DIRS if (root / d).is_dir() for p in (root / d).rglob("*")
                  if p.is_file() and p.suffix in CPP_SUFFIXES)


def cpp_including_cpp(root: Path = ROOT) -> list[tuple[str, str]]:
    """(source, included .cpp): one translation unit pasting another's source in."""
    return [(str(src.relative_to(root)), target) for src in cpp_sources(root)
            for target in INCLUDE.findall(src.read_text()) if target.endswith(".cpp")]


def oversized_modules(root: Path = ROOT) -> list[tuple[str, int]]:
    """(path, lines) for every .py or C++ source in SIZED_DIRS of MAX_LINES lines or more."""
    found = [p for d in SIZED_DIRS if (root / d).is_dir() for p in sorted((root / d).rglob("*"))
             if p.is_file() and (p.suffix == ".py" or p.suffix in CPP_SUFFIXES)]
    sizes = ((str(p.relative_to(root)), len(p.read_text(errors="replace").splitlines())) for p in found)
    return [(path, n) for path, n in sizes if n >= MAX_LINES]


def is_config_module(path: Path) -> bool:
    return path.name == "config.py" or "config" in path.parent.parts


def _env_name(node: ast.AST) -> ast.AST | None:
    """The name an environment read looks up: os.environ[x], os.environ.get(x), os.getenv(x), x in os.environ."""
    if isinstance(node, ast.Call) and node.args and \
            ast.unparse(node.func).endswith(("environ.get", "getenv", "environ.setdefault", "environ.pop")):
        return node.args[0]
    if isinstance(node, ast.Subscript) and ast.unparse(node.value).endswith("environ"):
        return node.slice
    if isinstance(node, ast.Compare) and isinstance(node.ops[0], (ast.In, ast.NotIn)) and \
            ast.unparse(node.comparators[0]).endswith("environ"):
        return node.left
    return None


def env_reads_outside_config(root: Path = ROOT) -> list[str]:
    """'path:line: name' for each read of a TESSERA_* variable (by its literal name) outside a config module."""
    bad = []
    for path in sorted(p for d in SIZED_DIRS if (root / d).is_dir() for p in (root / d).rglob("*.py")):
        if is_config_module(path):
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            name = _env_name(node)
            if isinstance(name, (ast.Constant, ast.JoinedStr)) and "TESSERA_" in ast.unparse(name):
                bad.append(f"{path.relative_to(root)}:{node.lineno}: {ast.unparse(name)}")
    return bad


def string_keyed_features(root: Path = ROOT) -> list[str]:
    """'path:line: expr' for each `...features["key"]` in services/ and gateway/."""
    bad = []
    for path in sorted(p for d in ("services", "gateway") if (root / d).is_dir() for p in (root / d).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Subscript) and ast.unparse(node.value).split(".")[-1].endswith("features") \
                    and isinstance(node.slice, ast.Constant) and isinstance(node.slice.value, str):
                bad.append(f"{path.relative_to(root)}:{node.lineno}: {ast.unparse(node)}")
    return bad


def citations_outside_the_tree(root: Path = ROOT) -> list[str]:
    """'path:line: text' for every line that cites a design file outside the tree, an issue number or a commit."""
    files = [root / name for name in CITATION_FILES if (root / name).is_file()]
    files += [p for d in CITATION_DIRS if (root / d).is_dir() for p in sorted((root / d).rglob("*"))
              if p.is_file() and p.suffix in CITATION_SUFFIXES and p.resolve() != Path(__file__).resolve()]
    bad = []
    for path in files:
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if OUTSIDE.search(line):
                bad.append(f"{path.relative_to(root)}:{number}: {line.strip()}")
    return bad


# -------------------------------------------------------------------------------------- the tree obeys them

def test_gateway_imports_only_services_common():
    bad = gateway_reaches_into_services()
    assert not bad, f"the gateway reaches into service code: {bad}"


def test_decoder_dependencies_point_one_way():
    bad = decoder_imports_upward()
    assert not bad, f"imports against the direction server -> engine -> runner -> model/lora -> kernels: {bad}"


def test_no_import_cycles():
    cycles = import_cycles()
    assert not cycles, f"import circles: {cycles}"


def test_comments_cite_only_the_tree():
    bad = citations_outside_the_tree()
    assert not bad, "cite docs/design.md (with the invariant number) or say why instead:\n" + "\n".join(bad)


def test_services_keep_to_themselves():
    bad = services_reaching_into_each_other()
    assert not bad, f"a service reaches into another service's sources (share through services/common): {bad}"


def test_no_cpp_includes_a_cpp():
    bad = cpp_including_cpp()
    assert not bad, f"C++ sources pasted into others (move what they share into a header): {bad}"


def test_modules_are_small():
    bad = oversized_modules()
    assert not bad, f"modules of {MAX_LINES} lines or more (split them by noun): {bad}"


def test_only_config_modules_read_the_environment():
    bad = env_reads_outside_config()
    assert not bad, "read TESSERA_* variables in the service's config module and pass the value down:\n" + \
        "\n".join(bad)


def test_no_string_keyed_request_state():
    bad = string_keyed_features()
    assert not bad, "give the state a typed field instead of a string key:\n" + "\n".join(bad)


def test_the_rules_read_the_real_tree():
    """The graph is the project's own: a known edge of each kind the rules look at is found."""
    g = graph()
    assert any(d.startswith("services.common") for d in g["gateway.errors"])
    assert "services.decoder.lora.layer" in g["services.decoder.lora.bank"]
    assert len(g) > 100
    assert len(cpp_sources(ROOT)) >= 5


# ------------------------------------------------------------------------ each rule fails on a violation

def write(root: Path, files: dict[str, str]) -> Path:
    """A source tree under `root`: relative path -> text (packages get an empty __init__.py)."""
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        for parent in path.relative_to(root).parents:
            if parent != Path(".") and parent.parts[0] in PACKAGES:
                (root / parent / "__init__.py").touch()
        path.write_text(text)
    return root


def test_a_gateway_import_of_service_code_is_seen(tmp_path):
    root = write(tmp_path, {
        "services/common/errors.py": "",
        "services/decoder/engine/scheduler.py": "",
        "gateway/ok.py": "from services.common import errors\n",
        "gateway/bad.py": "def f():\n    from services.decoder.engine.scheduler import x\n",
    })
    assert gateway_reaches_into_services(root) == [("gateway.bad", "services.decoder.engine.scheduler")]


def test_an_upward_decoder_import_is_seen(tmp_path):
    root = write(tmp_path, {
        "services/decoder/engine/step.py": "",
        "services/decoder/engine/scheduler.py": "",
        "services/decoder/runner/runner.py": "from services.decoder.engine.step import StepInput\n",
        "services/decoder/kernels/gemv.py": "from ..runner.runner import Runner\n",
        "services/decoder/server/service.py": "from services.decoder.engine import scheduler\n",
    })
    # The runner may use the engine's contract types; a kernel may not reach up to the runner.
    assert decoder_imports_upward(root) == [("services.decoder.kernels.gemv", "services.decoder.runner.runner")]


def test_an_import_cycle_is_seen(tmp_path):
    root = write(tmp_path, {
        "deploy/a.py": "import deploy.b\n",
        "deploy/b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from deploy.c import C\n",
        "deploy/c.py": "from deploy import a\n",
        "deploy/d.py": "import deploy.a\n",
    })
    assert import_cycles(root) == [["deploy.a", "deploy.b", "deploy.c", "deploy.a"]]


def test_a_citation_outside_the_tree_is_seen(tmp_path):
    design, issue = "DESIGN" + " invariant 4", "is" + "sue 10"
    # Each citation is built from parts, so this test's own lines cite nothing.
    outside = "../shared/" + "DESIGN.md"
    root = write(tmp_path, {
        "services/decoder/ok.py": '"""Salted by the digest (docs/design.md, invariant 4)."""\nx = "#ff0000"\n',
        "services/decoder/a.py": f'"""Salted by the digest ({design})."""\n',
        "services/decoder/k.cpp": f"// streams each weight row once ({issue})\n#include <cmath>\n",
        "gateway/b.py": f"# see {outside}\n",
        "deploy/c.yml": "# fixes #" + "12\n",
        "Makefile": "# since com" + "mit 55dc973\n",
    })
    assert [line.split(":")[0] for line in citations_outside_the_tree(root)] == [
        "Makefile", "services/decoder/a.py", "services/decoder/k.cpp", "gateway/b.py", "deploy/c.yml"]


def test_a_service_reaching_into_another_is_seen(tmp_path):
    root = write(tmp_path, {
        "services/common/native.py": "",
        "services/decoder/kernels/gemv.py": "from services.common import native\n",
        "services/pooling/packed.py": "import services.decoder.kernels.gemv\n",
        "services/common/vec.h": "",
        "services/decoder/kernels/vec.h": "",
        "services/pooling/attention.cpp": '#include "../common/vec.h"\n#include "../decoder/kernels/vec.h"\n',
        "services/decoder/kernels/glue.cpp": '#include "vec.h"\n#include <torch/extension.h>\n',
    })
    assert services_reaching_into_each_other(root) == [
        ("services.pooling.packed", "services.decoder.kernels.gemv"),
        ("services/pooling/attention.cpp", "../decoder/kernels/vec.h")]


def test_a_cpp_including_a_cpp_is_seen(tmp_path):
    root = write(tmp_path, {
        "services/decoder/kernels/vec.h": "",
        "services/decoder/kernels/gemv.cpp": '#include "vec.h"\n',
        "services/decoder/kernels/stack.cpp": '#include "vec.h"\n  #  include "gemv.cpp"\n',
    })
    assert cpp_including_cpp(root) == [("services/decoder/kernels/stack.cpp", "gemv.cpp")]


def test_an_oversized_module_is_seen(tmp_path):
    root = write(tmp_path, {
        "deploy/cluster.py": "x = 1\n" * MAX_LINES,
        "deploy/images.py": "x = 1\n" * (MAX_LINES - 1),
        "gateway/app.py": "",
        "services/decoder/kernels/gemv.cpp": "//\n" * (MAX_LINES + 3),
        "tests/test_big.py": "x = 1\n" * (2 * MAX_LINES),
    })
    assert oversized_modules(root) == [("services/decoder/kernels/gemv.cpp", MAX_LINES + 3),
                                       ("deploy/cluster.py", MAX_LINES)]


def test_an_environment_read_outside_config_is_seen(tmp_path):
    root = write(tmp_path, {
        "services/decoder/server/config.py": 'import os\nX = os.environ.get("TESSERA_DECODER_PORT")\n',
        "deploy/cluster/config.py": 'import os\nKEEP = "TESSERA_CLUSTER_KEEP" in os.environ\n',
        "services/decoder/runner/attention.py": 'import os\nmode = os.environ.get("TESSERA_ATTENTION", "auto")\n',
        "services/common/arena.py": 'from os import environ\nhuge = environ["TESSERA_HUGE_PAGES"]\n',
        "gateway/app.py": 'import os\nif "TESSERA_API_KEY" in os.environ:\n    pass\n',
        "deploy/launcher.py": 'import os\nsvc = "DECODER"\nx = os.getenv(f"TESSERA_{svc}_PORT")\n'
                              'home = os.environ.get("HOME")\n',
    })
    assert [line.rsplit(":", 1)[0] for line in env_reads_outside_config(root)] == [
        "deploy/launcher.py:3", "gateway/app.py:2", "services/common/arena.py:2",
        "services/decoder/runner/attention.py:2"]


def test_string_keyed_request_state_is_seen(tmp_path):
    root = write(tmp_path, {
        "services/decoder/runner/batch.py": 'def f(c):\n    return c.features["lora_slot"]\n',
        "services/decoder/server/service.py": 'features = {}\nfeatures["grammar"] = 1\nrows = {}\nrows["a"] = 2\n',
        "services/decoder/engine/step.py": 'def g(c, LORA):\n    return c.features[LORA], c.image.slot\n',
    })
    assert string_keyed_features(root) == [
        "services/decoder/runner/batch.py:2: c.features['lora_slot']",
        "services/decoder/server/service.py:2: features['grammar']"]
