"""Building and loading the C++ operators (torch.utils.cpp_extension), once per machine: the decoder's
kernels (services/decoder/kernels) and the pooling service's encoder attention.

An operator is compiled with -O3 -march=native, so its binary is only valid on the CPU that built
it. Each build therefore lands in <build dir>/<name>_<key>.so, where key hashes the source (with
the headers it includes by quote, e.g. services/common/kernels/vec.h), the flags, the torch and
Python versions and the CPU's model and flags: a changed source or a tree shared with another CPU
gets a build of its own, never a binary that would die of SIGILL. Loading an existing .so imports it
directly (no compiler, no ninja), so only the first load on a machine pays the compile, and `make
kernels` pays it at install time.

Build dir: config.KERNELS_DIR_ENV (TESSERA_KERNELS_DIR), else build/torch_extensions under the repository
(gitignored).
"""
from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import logging
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import torch

from . import config

log = logging.getLogger("tessera.kernels")

REPO = Path(__file__).resolve().parents[2]
# -fopenmp makes at::parallel_for parallel (it is a header template) and links the libgomp torch has already
# loaded. -fno-trapping-math lets the vectoriser compute both sides of a select where one side is only needed
# sometimes (vec.h's exp clamps its input, and GCC then folds the clamp's constant into the product after it):
# without it GCC 12 kept the SiLU and softmax loops scalar for -march=znver3 and znver4 (SiLU(g) * u over
# [16, 8192] took 594 us against torch's 130 on a Zen 3; 80 us with it). It changes no value computed: the
# kernels never read the floating-point exception flags, and it allows no reassociation.
CFLAGS = ("-O3", "-march=native", "-fopenmp", "-fno-trapping-math")
LDFLAGS = ("-fopenmp",)


# `make kernels` tells "nothing to build with" (a WARNING, torch paths) from a failed build (an error) by this exit
# status of Operator.main; Python's own failures exit 1.
NO_TOOLCHAIN = 3


class BuildError(RuntimeError):
    """The operator could not be compiled or loaded here; the message says why."""


class ToolchainMissing(BuildError):
    """No compiler (or no ninja) on this machine: nothing to build with, as opposed to a failed build."""


def build_dir() -> Path:
    return Path(config.kernels_dir() or REPO / "build" / "torch_extensions")


def _cpu_identity() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            lines = [ln for ln in f if ln.startswith(("model name", "flags", "Features", "CPU part"))]
        return "".join(dict.fromkeys(lines))
    except OSError:
        return platform.processor() or platform.machine()


def _compiler_version() -> str:
    cxx = os.environ.get("CXX", "c++")
    try:
        return subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as e:
        raise ToolchainMissing(f"no C++ compiler ({cxx}): {e}") from e


def _local_includes(source: Path) -> list[Path]:
    """source and, recursively, the headers it #includes "by quote" (paths relative to the including
    file), in order."""
    seen: list[Path] = []
    todo = [source.resolve()]
    while todo:
        path = todo.pop(0)
        if path in seen:
            continue
        seen.append(path)
        for line in path.read_text().splitlines():
            if line.startswith('#include "'):
                todo.append((path.parent / line.split('"')[1]).resolve())
    return seen


def _key(source: Path) -> str:
    # A header's edit must rebuild every operator that includes it (vec.h: the decoder's and pooling's).
    h = hashlib.sha256(b"".join(p.read_bytes() for p in _local_includes(source)))
    for part in (CFLAGS, LDFLAGS, torch.__version__, sys.version, _cpu_identity()):
        h.update(repr(part).encode())
    return h.hexdigest()[:12]


def _import(name: str, path: Path) -> ModuleType:
    loader = importlib.machinery.ExtensionFileLoader(name, str(path))
    spec = importlib.util.spec_from_file_location(name, path, loader=loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def load(name: str, source: Path, *, build: bool = True) -> ModuleType:
    """The compiled module of `source` (a .cpp with a PYBIND11_MODULE(TORCH_EXTENSION_NAME, ...)).

    Imports <build dir>/<name>_<key>.so when present; otherwise compiles it (build=True) or
    raises BuildError (build=False). Every failure, compiler missing or compile error, raises
    BuildError with the reason; callers decide whether a fallback may run.
    """
    key = _key(source)
    module_name = f"{name}_{key}"
    root = build_dir()
    target = root / f"{module_name}.so"
    if not target.exists():
        if not build:
            raise BuildError(f"{target} is not built (make kernels)")
        return _compile(module_name, source, root, target)
    try:
        return _import(module_name, target)
    except ImportError as e:
        raise BuildError(f"cannot import {target}: {e}") from e


class Operator:
    """One C++ operator (a .cpp next to its launcher): built or found on first use, then kept."""

    def __init__(self, name: str, source: Path):
        self.name, self.source = name, source
        self._module: ModuleType | None = None

    def load(self, build: bool = True) -> ModuleType:
        """The compiled module; raises BuildError with the reason when it cannot be had."""
        if self._module is None:
            self._module = load(self.name, self.source, build=build)
        return self._module

    def main(self) -> None:
        """`make kernels`: build (or find) the operator. Exits with the reason: NO_TOOLCHAIN where there is
        nothing to build with (the services then run their torch paths), 2 where the build failed (a fault to fix)."""
        try:
            self.load()
        except BuildError as e:
            print(f"{self.name}: not built: {e}", file=sys.stderr)
            sys.exit(NO_TOOLCHAIN if isinstance(e, ToolchainMissing) else 2)
        print(f"{self.name}: built, {build_dir()}")


def _compile(module_name: str, source: Path, root: Path, target: Path) -> ModuleType:
    from torch.utils import cpp_extension

    compiler = _compiler_version()
    if not shutil.which("ninja") and not (Path(sys.executable).parent / "ninja").exists():
        raise ToolchainMissing("ninja is not on PATH (torch.utils.cpp_extension needs it)")
    # Build in a directory of our own, then move the .so into place in one rename: a process
    # that loads concurrently sees either no file or the whole library, never a partial one.
    work = root / f"{module_name}.build-{os.getpid()}"
    try:
        work.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise BuildError(f"cannot create the build directory {work}: {e}") from e
    log.info("compiling %s with %s (%s), once per machine", source.name, compiler.splitlines()[0] if compiler
             else "c++", " ".join(CFLAGS))
    try:
        module = cpp_extension.load(module_name, [str(source)], extra_cflags=list(CFLAGS),
                                    extra_ldflags=list(LDFLAGS), build_directory=str(work), verbose=False)
    except Exception as e:  # cpp_extension raises RuntimeError, OSError or CalledProcessError
        tail = "\n".join(str(e).strip().splitlines()[-20:])
        raise BuildError(f"compiling {source.name} failed (build dir {work}): {tail}") from e
    built = work / f"{module_name}{_lib_suffix()}"
    if not built.exists():
        raise BuildError(f"compiling {source.name} produced no {built.name} in {work}")
    os.replace(built, target)
    shutil.rmtree(work, ignore_errors=True)
    # Earlier builds of this operator (older sources) are never loaded again. (A build dir shared
    # by two CPUs then rebuilds on the other one once; config.KERNELS_DIR_ENV can keep them apart.)
    name = module_name.rsplit("_", 1)[0]
    for old in root.glob(f"{name}_*.so"):
        if old != target and len(old.stem) == len(module_name):
            old.unlink(missing_ok=True)
    return module


def _lib_suffix() -> str:
    # cpp_extension names its library <name>.so on Linux/macOS and <name>.pyd on Windows.
    return ".pyd" if sys.platform == "win32" else ".so"

