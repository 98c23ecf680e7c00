"""Build a CausalLM from an HF folder or a GGUF file without materialising random weights first.

Modules are created on the meta device (no storage), then each parameter is replaced by
the tensor read from the safetensors files (memory-mapped by safe_open), cast to the
serving dtype. A checkpoint with missing or unexpected tensors, or wrong shapes, is
refused: loading it anyway would serve a different model. A GGUF file (model/gguf_file.py)
loads the same way, its quantized matrices as grouped weights (load_gguf).
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from services.common import dtypes
from services.common.errors import InvalidArgument, TesseraError, Unsupported
from services.decoder.model.config import ModelConfig
from services.decoder.model.decoder import CausalLM, StoredPart
from services.decoder.model.families import model_class
from services.decoder.model.gguf_file import GGUFModel, is_gguf
from services.decoder.model.grouped import GroupedWeight
from services.decoder.model.grouped_embedding import GroupedEmbedding
from services.decoder.model.linear import Linear

_CPU_DTYPES = (torch.float32, torch.bfloat16)


def resolve_dtype(name: str | torch.dtype, device: torch.device) -> torch.dtype:
    try:
        dtype = name if isinstance(name, torch.dtype) else dtypes.to_torch(name)
    except ValueError as exc:
        raise InvalidArgument(str(exc)) from None
    if device.type == "cpu" and dtype not in _CPU_DTYPES:
        raise Unsupported(f"dtype {dtype} is not supported on CPU (use fp32 or bf16)")
    return dtype


def checkpoint_files(folder: Path) -> list[Path]:
    """The safetensors files of a folder: the sharded index's files, or model.safetensors."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [folder / n for n in names]
    single = folder / "model.safetensors"
    if single.is_file():
        return [single]
    raise InvalidArgument(f"{folder} has no model.safetensors or model.safetensors.index.json")


def check_folder(folder: str | Path) -> ModelConfig:
    """What load_model refuses about a folder before it reads a weight: no folder, no config.json, a config
    it does not implement (model/config.py), no safetensors files. Each refusal is one line that names the
    folder and the file or the config key."""
    folder = Path(folder)
    if not folder.is_dir():
        raise InvalidArgument(f"{folder} is not a folder")
    if not (folder / "config.json").is_file():
        raise InvalidArgument(f"{folder} has no config.json (is it a Hugging Face model folder?)")
    try:
        cfg = ModelConfig.from_folder(folder)
    except TesseraError as exc:
        raise type(exc)(f"{folder}: {exc.message}", param=exc.param) from None
    checkpoint_files(folder)
    return cfg


def model_config(model: str | Path) -> ModelConfig:
    """--model's ModelConfig: a folder's config.json, or a GGUF file's metadata (model/gguf_file.py)."""
    return GGUFModel.open(model).config if is_gguf(model) else ModelConfig.from_folder(model)


def load_model(folder: str | Path, dtype: str | torch.dtype = "fp32",
               device: str | torch.device = "cpu") -> CausalLM:
    """The model of an HF folder, or of a GGUF file (a path ending in .gguf), on device in dtype."""
    if is_gguf(folder):
        return load_gguf(folder, dtype, device)
    folder, device = Path(folder), torch.device(device)
    dtype = resolve_dtype(dtype, device)
    cfg = ModelConfig.from_folder(folder)
    with torch.device("meta"):
        model = model_class(cfg)(cfg)
    expected = {name: p.shape for name, p in model.named_parameters()}
    if cfg.tie_word_embeddings:
        expected.pop("lm_head.weight")
    loaded: set[str] = set()
    assembled: dict[str, tuple[torch.Tensor, set[str], int]] = {}   # param -> (tensor, parts filled, of parts)
    for path in checkpoint_files(folder):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for stored in f.keys():
                name = _text_model_name(stored) if cfg.vision is not None else stored
                if name is None:
                    continue  # the vision tower's tensors: the vision service loads those
                if name == "lm_head.weight" and cfg.tie_word_embeddings:
                    continue  # transformers ties it to the embedding and ignores the stored copy
                part = model.stored_part(name)
                if part is not None and part.param in expected:
                    _assemble(assembled, part, expected[part.param], f.get_tensor(stored), name, dtype, device)
                    continue
                for ours, tensor in _ours(type(model), name, f.get_tensor(stored), expected, path, cfg.family):
                    _set_parameter(model, ours, tensor.to(device=device, dtype=dtype))
                    loaded.add(ours)
    for param, (tensor, filled, parts) in assembled.items():
        if len(filled) == parts:
            _set_parameter(model, param, tensor)
            loaded.add(param)
    missing = sorted(set(expected) - loaded)
    if missing:
        raise InvalidArgument(f"checkpoint in {folder} lacks {len(missing)} tensors, e.g. {missing[:3]}")
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.setup_rotary(device)
    return model.eval()


def check_gguf(path: str | Path) -> ModelConfig:
    """What load_gguf refuses before it reads a weight: not a GGUF file, an architecture or a metadata value we
    do not implement, a tensor type we do not load (each in one line naming the key, type or tensor)."""
    gguf = GGUFModel.open(path)
    gguf.check_types()
    return gguf.config


def load_gguf(path: str | Path, dtype: str | torch.dtype = "fp32", device: str | torch.device = "cpu") -> CausalLM:
    """A GGUF file's model: float tensors in dtype as a folder's; each quantized matrix of a Linear as its grouped
    weight (model/grouped.py), never through floats; a quantized embedding table grouped too, each lookup's rows
    dequantized (model/grouped_embedding.py), and when the head is tied to it, the head as the same grouped
    weight."""
    device = torch.device(device)
    dtype = resolve_dtype(dtype, device)
    gguf = GGUFModel.open(path)
    gguf.check_types()
    cfg = gguf.config
    if device.type != "cpu" and any(t.quantized for t in gguf.tensors()):
        raise Unsupported(f"{gguf.path.name}: quantized GGUF tensors run on CPU only (--device cpu)")
    with torch.device("meta"):
        model = model_class(cfg)(cfg)
    expected = {name: p.shape for name, p in model.named_parameters()}
    if cfg.tie_word_embeddings:
        expected.pop("lm_head.weight")
    loaded: set[str] = set()
    tied_head: GroupedWeight | None = None
    for stored in gguf.tensors():
        name = stored.name
        if name not in expected:
            raise InvalidArgument(f"unexpected GGUF tensor {stored.stored!r} in {gguf.path.name} for a {cfg.family} "
                                  "model")
        if stored.shape != tuple(expected[name]):
            raise InvalidArgument(f"GGUF tensor {stored.stored!r} has shape {stored.shape}, expected "
                                  f"{tuple(expected[name])}")
        owner = model.get_submodule(name.rpartition(".")[0])
        if stored.quantized and isinstance(owner, Linear):
            place_grouped(owner, stored.grouped(), dtype)
        elif stored.quantized:      # the embedding table: rows dequantized as a step looks them up
            gw = stored.grouped()
            model.model.embed_tokens = GroupedEmbedding(gw, dtype)
            tied_head = gw if cfg.tie_word_embeddings else None
        else:
            _set_parameter(model, name, stored.dense().to(device=device, dtype=dtype))
        loaded.add(name)
    missing = sorted(set(expected) - loaded)
    if missing:
        raise InvalidArgument(f"{gguf.path.name} lacks {len(missing)} tensors, e.g. {missing[:3]}")
    if tied_head is not None:
        place_grouped(model.lm_head, tied_head, dtype)
    elif cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.setup_rotary(device)
    return model.eval()


def place_grouped(linear: Linear, weight: GroupedWeight, dtype: torch.dtype) -> None:
    """Give a Linear (still on meta) a GGUF weight as its grouped weight; its dense weight is empty, in dtype (the
    dtype of its activations). Grouped weights live on CPU (load_gguf refuses another device for them)."""
    linear.set_grouped(weight, release=True, dtype=dtype)


# Qwen2-VL checkpoints: transformers 5 keeps the text model under model.language_model. in memory but
# save_pretrained writes the legacy names (model.layers.*, visual.*); both spellings are accepted.
_VISION_PREFIXES = ("visual.", "model.visual.")
_TEXT_PREFIX = "model.language_model."


def _text_model_name(stored: str) -> str | None:
    """A vision-language checkpoint key -> our CausalLM name, or None for a vision-tower tensor."""
    if stored.startswith(_VISION_PREFIXES):
        return None
    if stored.startswith(_TEXT_PREFIX):
        return "model." + stored[len(_TEXT_PREFIX):]
    return stored


def _ours(family: type[CausalLM], name: str, tensor: torch.Tensor, expected: dict[str, torch.Size], path: Path,
          kind: str) -> list[tuple[str, torch.Tensor]]:
    """A stored tensor -> our (name, tensor) pairs: itself, or a fused projection's rows split into ours
    (CausalLM.checkpoint_fused), each checked against the shape our module expects."""
    owner, _, param = name.rpartition(".")
    prefix, _, module = owner.rpartition(".")
    parts = family.checkpoint_fused.get(module)
    if parts is None:
        if name not in expected:
            raise InvalidArgument(f"unexpected tensor {name!r} in {path.name} for a {kind} model")
        if tensor.shape != expected[name]:
            raise InvalidArgument(f"tensor {name!r} has shape {tuple(tensor.shape)}, expected {tuple(expected[name])}")
        return [(name, tensor)]
    names = [f"{prefix}.{p}.{param}" for p in parts]
    if any(n not in expected for n in names):
        raise InvalidArgument(f"unexpected tensor {name!r} in {path.name} for a {kind} model")
    rows = [expected[n][0] for n in names]
    want = (sum(rows), *expected[names[0]][1:])
    if tuple(tensor.shape) != want:
        raise InvalidArgument(f"tensor {name!r} has shape {tuple(tensor.shape)}, expected {want} "
                              f"({' | '.join(parts)} rows)")
    return list(zip(names, tensor.split(rows), strict=True))


def _assemble(assembled: dict, part: StoredPart, shape: torch.Size, tensor: torch.Tensor, name: str,
              dtype: torch.dtype, device: torch.device) -> None:
    """Copy a checkpoint tensor into its place in the parameter it is a part of (model.stored_part)."""
    if part.param not in assembled:
        assembled[part.param] = (torch.empty(shape, dtype=dtype, device=device), set(), part.parts)
    target, filled, _ = assembled[part.param]
    piece = target[part.index]
    if tensor.shape != piece.shape:
        raise InvalidArgument(f"tensor {name!r} has shape {tuple(tensor.shape)}, expected {tuple(piece.shape)}")
    piece.copy_(tensor)
    filled.add(repr(part.index))


def _set_parameter(model: nn.Module, name: str, tensor: torch.Tensor) -> None:
    owner, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(owner), leaf, nn.Parameter(tensor, requires_grad=False))
