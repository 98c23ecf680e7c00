"""The C++ sources' include graph: headers only, no service reaching into another, every header in the build key."""
from __future__ import annotations

import re
from pathlib import Path

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
