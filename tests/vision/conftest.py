"""Vision fixtures: a tiny Qwen2-VL checkpoint, a demo encoder, real photos, an in-process server."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from tests.loops import LoopThread
from tests.vision.checkpoints import write_qwen2_vl

PHOTOS = ("astronaut.png", "chelsea.png", "coffee.png", "rocket.jpg")


def skimage_data() -> Path:
    """scikit-image's data folder, found without importing skimage (only its files are installed)."""
    spec = importlib.util.find_spec("skimage")
    if spec is None or spec.origin is None:
        pytest.fail("scikit-image's data files are missing: run `make install`")
    return Path(spec.origin).parent / "data"


@pytest.fixture(scope="session")
def photos() -> dict[str, bytes]:
    return {name: (skimage_data() / name).read_bytes() for name in PHOTOS}


@pytest.fixture(scope="session")
def qwen_ckpt(tmp_path_factory) -> Path:
    return write_qwen2_vl(tmp_path_factory.mktemp("vision") / "tiny-qwen2-vl")


@pytest.fixture(scope="session")
def demo_ckpt(tmp_path_factory) -> Path:
    from services.vision import demo
    return demo.save(tmp_path_factory.mktemp("vision") / "demo")




@pytest.fixture
def vision_server():
    """A factory: start(VisionConfig) -> (address, servicer, loop) of a real server on an ephemeral port."""
    from services.vision.config import VisionServerConfig
    from services.vision.service import start
    loop = LoopThread()
    started = []

    def _start(cfg):
        server, servicer = loop.run(start(VisionServerConfig(host="127.0.0.1", port=0, reflection=True), cfg))
        started.append((server, servicer))
        return f"127.0.0.1:{server.port}", servicer, loop

    yield _start
    for server, servicer in started:
        loop.run(server.stop(0))
        if servicer.cache is not None:
            loop.run(servicer.cache.close())
    loop.close()
