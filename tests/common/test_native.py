"""The C++ sources' include graph (headers only, no service reaching into another, every header in the build key)
and `make kernels`' list of operators and exit statuses."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from services.common import config, native

ROOT = Path(__file__).resolve().parents[2]
SOURCES = sorted(p for p in (ROOT / "services").rglob("*") if p.suffix in (".cpp", ".h"))
INCLUDE = re.compile(r'^#include "([^"]+)"', re.M)


def quoted_includes(path: Path) -> list[Path]:
    return [(path.parent / name).resolve() for name in INCLUDE.findall(path.read_text())]


def test_sources_include_headers_only_and_no_other_services_files():
    assert SOURCES, "no C++ sources found"
    for source in SOURCES:
        service = source.relative_to(ROOT / "services").parts[0]
        for included in quoted_includes(source):
            assert included.suffix == ".h", f"{source.name} includes {included.name}: include a header"
            assert included.is_file(), f"{source.name}: {included} does not exist"
            owner = included.relative_to(ROOT / "services").parts[0]
            assert owner in (service, "common"), f"{source.name} ({service}) includes {owner}'s {included.name}"


def test_a_shared_header_is_part_of_every_build_key_that_includes_it():
    vec = (ROOT / "services/common/kernels/vec.h").resolve()
    for source in (ROOT / "services/pooling/attention_cpu.cpp", ROOT / "services/decoder/kernels/decode_stack_cpu.cpp",
                   ROOT / "services/decoder/kernels/paged_attention_cpu.cpp"):
        assert vec in native._local_includes(source), source.name
    # Through another header: gemv_cpu.cpp includes gemv.h, which includes gemv_bf16.h, which includes vec.h.
    gemv = native._local_includes(ROOT / "services/decoder/kernels/gemv_cpu.cpp")
    assert vec in gemv and (ROOT / "services/decoder/kernels/gemv_bf16.h").resolve() in gemv
    assert vec not in native._local_includes(ROOT / "services/decoder/kernels/tile_gemm_cpu.cpp")


def test_the_build_directory_comes_from_the_config_module(monkeypatch, tmp_path):
    monkeypatch.setenv(config.KERNELS_DIR_ENV, str(tmp_path))
    assert native.build_dir() == tmp_path
    monkeypatch.setenv(config.KERNELS_DIR_ENV, "")
    assert native.build_dir() == native.REPO / "build" / "torch_extensions"


def test_make_kernels_builds_every_operator_and_fails_on_a_compile_error(tmp_path, monkeypatch, capsys):
    # Every module that declares an Operator is in the Makefile's list, so none is left to compile at a service's
    # start, and a failed build is told apart from a machine with nothing to build with (its exit status).
    declared = sorted(".".join(p.relative_to(ROOT).with_suffix("").parts)
                      for p in (ROOT / "services").rglob("*.py") if "native.Operator(" in p.read_text())
    makefile = (ROOT / "Makefile").read_text().replace("\\\n", " ")
    listed = re.search(r"^KERNEL_MODULES = (.*)$", makefile, re.M).group(1).split()
    assert sorted(listed) == declared
    monkeypatch.setenv(config.KERNELS_DIR_ENV, str(tmp_path))
    source = tmp_path / "op.cpp"
    source.write_text("// built by no one: _compile below fails\n")
    codes = []
    for error in (native.BuildError("error: 'x' was not declared"), native.ToolchainMissing("no C++ compiler")):
        def fail(*_, error=error):
            raise error
        monkeypatch.setattr(native, "_compile", fail)
        with pytest.raises(SystemExit) as exited:
            native.Operator("op", source).main()
        codes.append(exited.value.code)
        assert f"op: not built: {error}" in capsys.readouterr().err
    assert codes == [2, native.NO_TOOLCHAIN]
