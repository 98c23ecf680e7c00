"""The house rules on imports, read from the source: who may import whom, and no circles.

- The gateway talks to the services over gRPC only: it imports nothing from services/ but
  services/common.
- In the decoder, dependencies point one way: server -> engine -> runner -> model/lora -> kernels
  (text/ is used by the server only; multimodal/ sits beside the runner; grammar/ is used by the
  server and the runner, never the engine), except for the engine's contract types, which both
  sides of it share.
- No two modules import each other, directly or through others, type-checking imports included.
"""
from __future__ import annotations

import ast
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


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(path: Path, known: set[str]) -> set[str]:
    """The project modules `path` imports (every import statement, at any depth)."""
    here = module_name(path)
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


def graph() -> dict[str, set[str]]:
    files = [p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")]
    known = {module_name(p) for p in files}
    return {module_name(p): imports_of(p, known) for p in files}


def test_gateway_imports_only_services_common():
    bad = {(m, d) for m, deps in graph().items() if m.startswith("gateway")
           for d in deps if d.startswith("services.") and not d.startswith("services.common")}
    assert not bad, f"the gateway reaches into service code: {sorted(bad)}"


def test_decoder_dependencies_point_one_way():
    bad = []
    for m, deps in graph().items():
        parts = m.split(".")
        if parts[:2] != ["services", "decoder"] or len(parts) < 3 or parts[2] not in DECODER_ABOVE:
            continue
        for d in deps - ENGINE_CONTRACT:
            dparts = d.split(".")
            if dparts[:2] == ["services", "decoder"] and len(dparts) > 2 and dparts[2] in DECODER_ABOVE[parts[2]]:
                bad.append((m, d))
    assert not bad, f"imports against the direction server -> engine -> runner -> model/lora -> kernels: {bad}"


def test_no_import_cycles():
    g = graph()
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
    assert not cycles, f"import circles: {cycles}"


def test_the_rules_see_a_violation(tmp_path):
    """The graph is not empty and a known edge is found, so the checks above can fail."""
    g = graph()
    assert "services.common.errors" in g["gateway.errors"] or any("services.common" in d for d in g["gateway.errors"])
    assert "services.decoder.lora.layer" in g["services.decoder.lora.bank"]
