"""Generated protobuf modules, built by `make protos` into the gitignored gen/ folder.

Import them from here so that a missing build fails with one clear message:

    from services.common.pb import common_pb2, pooling_pb2, pooling_pb2_grpc
"""
import importlib
import sys
from pathlib import Path

GEN_DIR = Path(__file__).resolve().parents[2] / "gen"

if not (GEN_DIR / "tessera").is_dir():
    raise ImportError(f"generated protos missing at {GEN_DIR}: run `make protos`")
if str(GEN_DIR) not in sys.path:
    sys.path.insert(0, str(GEN_DIR))


def _load(package: str, module: str):
    return importlib.import_module(f"tessera.{package}.v1.{module}")


common_pb2 = _load("common", "common_pb2")
pooling_pb2 = _load("pooling", "pooling_pb2")
pooling_pb2_grpc = _load("pooling", "pooling_pb2_grpc")
vision_pb2 = _load("vision", "vision_pb2")
vision_pb2_grpc = _load("vision", "vision_pb2_grpc")
decoder_pb2 = _load("decoder", "decoder_pb2")
decoder_pb2_grpc = _load("decoder", "decoder_pb2_grpc")
