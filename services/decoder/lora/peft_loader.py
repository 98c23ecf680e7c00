"""Read a PEFT LoRA folder (adapter_config.json + adapter_model.safetensors) into LoraWeights.

Key names are the ones peft 0.21 writes for a CausalLM:
    base_model.model.<module>.lora_A.weight   [r, in]
    base_model.model.<module>.lora_B.weight   [out, r]
with <module> like "model.layers.0.self_attn.q_proj" (our module names equal HF's). A family whose
checkpoint stores projections fused (Phi-3's qkv_proj = q | k | v rows, gate_up_proj = gate | up;
CausalLM.checkpoint_fused) has adapters on the fused modules: their lora_B rows are split across our
projections, each keeping the shared lora_A, so B_q A x | B_k A x | B_v A x is exactly B A x.

Only plain LoRA is served: y = W x + (alpha / r) B A x. Every config feature that
would change that formula, or the base weights it assumes, is refused with a message
naming it, rather than loaded into something that silently computes another model.
"""
from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from services.common.errors import AdapterNotFound, InvalidArgument, Unsupported
from services.decoder.lora.weights import TARGETS, LoraWeights, leaf, prepare_weights

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_PREFIX = "base_model.model."
_KEY = re.compile(r"^base_model\.model\.(?P<module>.+)\.lora_(?P<part>[AB])\.weight$")
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")

# Features that change the forward or the base weights: (key, why). Refused when set.
_REFUSED = (
    ("use_dora", "DoRA (use_dora) adds a learned magnitude vector"),
    ("use_rslora", "rank-stabilised LoRA (use_rslora) scales by alpha/sqrt(r)"),
    ("modules_to_save", "modules_to_save replaces whole modules"),
    ("fan_in_fan_out", "fan_in_fan_out (Conv1D-style transposed weights)"),
    ("lora_bias", "a trained LoRA bias (lora_bias)"),
    ("layer_replication", "layer_replication changes the base model's layer stack"),
    ("use_qalora", "QALoRA (use_qalora)"),
    ("alora_invocation_tokens", "activated LoRA (alora_invocation_tokens)"),
    ("trainable_token_indices", "trainable token embeddings (trainable_token_indices)"),
    ("target_parameters", "LoRA on parameters (target_parameters)"),
    ("use_bdlora", "block-diagonal LoRA (use_bdlora)"),
    ("arrow_config", "Arrow routing (arrow_config)"),
    ("kasa_config", "KaSA (kasa_config)"),
    ("velora_config", "VeLoRA (velora_config)"),
    ("monteclora_config", "MonteCLoRA (monteclora_config)"),
    ("loftq_config", "LoftQ (loftq_config) assumes quantised, rewritten base weights"),
)
# Per-module ranks and alphas: refused where a pattern names a module the adapter has tensors for. peft 0.21
# writes patterns for modules of its own weight conversions (".*\\.gate_up_proj" for a mixture's stacked
# experts, whenever gate_proj or up_proj is a target) that match none of them; they change nothing it saved.
_PATTERNS = (("rank_pattern", "per-module ranks (rank_pattern)"),
             ("alpha_pattern", "per-module alphas (alpha_pattern)"))
# Keys that carry no meaning for inference (metadata, or how weights were initialised
# before training). Any other key with a non-empty value is refused, so a feature added
# by a newer peft is never silently ignored.
_HARMLESS = {
    "peft_type", "r", "lora_alpha", "target_modules", "exclude_modules", "bias", "init_lora_weights",
    "layers_to_transform", "layers_pattern", "lora_dropout", "inference_mode", "task_type", "peft_version",
    "auto_mapping", "base_model_name_or_path", "revision", "megatron_config", "megatron_core",
    "qalora_group_size", "ensure_weight_tying", "eva_config", "corda_config", "lora_ga_config",
    *(key for key, _ in _REFUSED), *(key for key, _ in _PATTERNS),
}
# Initialisations that rewrite the base weights (W - B A) before training.
_BASE_REWRITING_INITS = ("pissa", "olora", "corda", "loftq")


def read_config(folder: Path) -> dict[str, Any]:
    """adapter_config.json as a dict; AdapterNotFound / InvalidArgument when absent or malformed."""
    if not folder.is_dir():
        raise AdapterNotFound(f"adapter folder {folder.name!r} does not exist", param="lora_path")
    path = folder / CONFIG_FILE
    if not path.is_file():
        raise InvalidArgument(f"{folder.name}: no {CONFIG_FILE} (is this a PEFT adapter folder?)",
                              param="lora_path")
    try:
        config = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InvalidArgument(f"{folder.name}/{CONFIG_FILE} is not valid JSON: {exc}", param="lora_path") from None
    if not isinstance(config, dict):
        raise InvalidArgument(f"{folder.name}/{CONFIG_FILE} must hold a JSON object", param="lora_path")
    return config


def check_config(config: Mapping[str, Any], source: str) -> tuple[int, float]:
    """Refuse every unsupported feature; returns (r, lora_alpha)."""
    def refuse(msg: str) -> Unsupported:
        return Unsupported(f"{source}: {msg} is not supported; tessera serves plain LoRA only", param="lora_path")

    if config.get("peft_type") != "LORA":
        raise refuse(f"peft_type {config.get('peft_type')!r} (expected 'LORA')")
    for key, why in _REFUSED:
        if config.get(key):
            raise refuse(why)
    if config.get("bias", "none") != "none":
        raise refuse(f"a trained bias (bias={config.get('bias')!r})")
    init = config.get("init_lora_weights", True)
    if isinstance(init, str) and init.lower().startswith(_BASE_REWRITING_INITS):
        raise refuse(f"init_lora_weights={init!r}, which rewrites the base weights")
    for key in sorted(set(config) - _HARMLESS):
        if config[key] not in (None, False, "", {}, [], 0):
            raise refuse(f"the config key {key!r}={config[key]!r}")
    r, alpha = config.get("r"), config.get("lora_alpha")
    if isinstance(r, bool) or not isinstance(r, int) or r < 1:
        raise InvalidArgument(f"{source}: r must be a positive integer, got {r!r}", param="lora_path")
    if isinstance(alpha, bool) or not isinstance(alpha, int | float) or not math.isfinite(alpha):
        raise InvalidArgument(f"{source}: lora_alpha must be a finite number, got {alpha!r}", param="lora_path")
    return r, float(alpha)


def _matches(name: str, spec: Any, source: str, key: str) -> bool:
    """peft's module matching: a list matches by exact name or dotted suffix, a str is a full regex."""
    if spec is None:
        return False
    if isinstance(spec, str):
        if spec == "all-linear":
            return True
        try:
            return re.fullmatch(spec, name) is not None
        except re.error as exc:
            raise InvalidArgument(f"{source}: {key} is not a valid regex: {exc}", param="lora_path") from None
    if isinstance(spec, list | tuple) and all(isinstance(t, str) for t in spec):
        return any(name == t or name.endswith("." + t) for t in spec)
    raise InvalidArgument(f"{source}: {key} must be a list of module names or a regex", param="lora_path")


def check_patterns(config: Mapping[str, Any], modules: Iterable[str], source: str) -> None:
    """Refuse a rank_pattern or alpha_pattern key that applies to one of `modules` (the adapter's), by peft's
    own rule: the key, as a regex, matches the module's name or a dotted suffix of it."""
    modules = list(modules)
    for key, why in _PATTERNS:
        patterns = config.get(key) or {}
        if not isinstance(patterns, dict):
            raise InvalidArgument(f"{source}: {key} must be an object of module patterns", param="lora_path")
        for pattern in patterns:
            try:
                hit = next((m for m in modules if re.match(rf"(.*\.)?({pattern})$", m)), None)
            except re.error as exc:
                raise InvalidArgument(f"{source}: {key} {pattern!r} is not a valid regex: {exc}",
                                      param="lora_path") from None
            if hit is not None:
                raise Unsupported(f"{source}: {why} for {hit} is not supported; tessera serves plain LoRA only",
                                  param="lora_path")


def checkpoint_modules(layers: Mapping[str, tuple[int, int]], fused: Mapping[str, tuple[str, ...]]
                       ) -> tuple[dict[str, tuple[int, int]], dict[str, tuple[str, ...]]]:
    """The wrapped modules as the checkpoint (and so peft) names them: ours, except that the parts of a fused
    checkpoint projection become that one module, named where all its parts are wrapped and absent otherwise.
    Returns (name -> (in, out), fused name -> our part names in row order)."""
    names: dict[str, tuple[int, int]] = {}
    groups: dict[str, tuple[str, ...]] = {}
    for name, shape in layers.items():
        kind = leaf(name)
        owner = next((f for f, parts in fused.items() if kind in parts), None)
        if owner is None:
            names[name] = shape
            continue
        prefix = name[:-len(kind)]
        parts = tuple(prefix + p for p in fused[owner])
        if all(p in layers for p in parts):
            names[prefix + owner] = (shape[0], sum(layers[p][1] for p in parts))
            groups[prefix + owner] = parts
    return names, groups


def expected_modules(config: Mapping[str, Any], layers: Mapping[str, tuple[int, int]], source: str,
                     kinds: tuple[str, ...] = TARGETS) -> set[str]:
    """The wrapped modules this config adapts (layers: named as the checkpoint names them). Refuses targets
    that are not projections tessera adapts (kinds), and projections this server does not wrap (--lora-targets)."""
    spec = config.get("target_modules")
    if not spec:
        raise InvalidArgument(f"{source}: target_modules is empty", param="lora_path")
    if isinstance(spec, list | tuple):
        wrapped = {leaf(n) for n in layers}
        for t in spec:
            kind = leaf(str(t))
            if kind not in kinds:
                raise Unsupported(f"{source}: target {t!r} is not supported; adapters may target only "
                                  f"{', '.join(kinds)}", param="lora_path")
            if kind not in wrapped:
                raise InvalidArgument(f"{source}: target {t!r} is not enabled on this server (--lora-targets "
                                      f"{','.join(sorted(wrapped))})", param="lora_path")
    only = config.get("layers_to_transform")
    if isinstance(only, int) and not isinstance(only, bool):
        only = [only]
    out = set()
    for name in layers:
        if not _matches(name, spec, source, "target_modules"):
            continue
        if _matches(name, config.get("exclude_modules"), source, "exclude_modules"):
            continue
        if only is not None:
            m = _LAYER.search(name)
            if m is None or int(m.group(1)) not in only:
                continue
        out.add(name)
    return out


def read_tensors(folder: Path, source: str) -> dict[str, torch.Tensor]:
    path = folder / WEIGHTS_FILE
    if not path.is_file():
        other = " (pickled adapter_model.bin is refused: convert it to safetensors)" \
            if (folder / "adapter_model.bin").exists() else ""
        raise InvalidArgument(f"{source}: no {WEIGHTS_FILE}{other}", param="lora_path")
    try:
        return load_file(str(path), device="cpu")
    except (SafetensorError, OSError, ValueError) as exc:
        raise InvalidArgument(f"{source}: {WEIGHTS_FILE} cannot be read: {exc}", param="lora_path") from None


def load_peft(folder: str | Path, *, layers: Mapping[str, tuple[int, int]], max_rank: int,
              dtype: torch.dtype, fused: Mapping[str, tuple[str, ...]] | None = None) -> LoraWeights:
    """Validate a PEFT LoRA folder completely and return its effective weights (host side).

    layers: the bank's module name -> (in, out). fused: the base family's checkpoint_fused (the bank's
    `fused`), whose names the adapter uses in place of their parts. Raises AdapterNotFound (no folder),
    Unsupported (a refused PEFT feature or target) or InvalidArgument (anything else
    wrong: files, tensor names, missing or extra tensors, rank, shapes, NaN/Inf).
    """
    folder = Path(folder)
    source = f"adapter {folder.name!r}"
    config = read_config(folder)
    r, alpha = check_config(config, source)
    fused = fused or {}
    named, groups = checkpoint_modules(layers, fused)
    kinds = tuple(t for t in TARGETS if not any(t in parts for parts in fused.values())) + tuple(fused)
    expected = expected_modules(config, named, source, kinds)
    tensors = read_tensors(folder, source)
    found: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        m = _KEY.match(key)
        if m is None:
            raise InvalidArgument(f"{source}: unexpected tensor {key!r} (only "
                                  f"{_PREFIX}<module>.lora_A/lora_B.weight are served)", param="lora_path")
        found.setdefault(m["module"], {})[m["part"]] = tensor
    check_patterns(config, found, source)
    extra = sorted(set(found) - expected)
    if extra:
        raise InvalidArgument(f"{source}: tensors for modules its config does not target (or this server does "
                              f"not wrap): {extra[:3]}", param="lora_path")
    missing = sorted(expected - set(found)) + sorted(n for n, parts in found.items() if len(parts) != 2)
    if missing:
        raise InvalidArgument(f"{source}: missing lora_A/lora_B tensors for {len(missing)} modules, e.g. "
                              f"{missing[:3]}", param="lora_path")
    for name, parts in found.items():
        if parts["A"].dim() != 2 or parts["A"].shape[0] != r:
            raise InvalidArgument(f"{source}: {name}.lora_A has shape {tuple(parts['A'].shape)}; config r={r}",
                                  param="lora_path")
    raw = {}
    for name, parts in found.items():
        members = groups.get(name)
        if members is None:
            raw[name] = (parts["A"], parts["B"])
            continue
        b, rows = parts["B"], [layers[m][1] for m in members]
        if b.dim() != 2 or b.shape[0] != sum(rows):
            raise InvalidArgument(f"{source}: {name}.lora_B has shape {tuple(b.shape)}; the fused projection has "
                                  f"{sum(rows)} rows ({' | '.join(leaf(m) for m in members)})", param="lora_path")
        for member, part in zip(members, b.split(rows), strict=True):
            raw[member] = (parts["A"], part)
    return prepare_weights(raw, layers=layers, max_rank=max_rank, dtype=dtype, alpha=alpha, source=source)
