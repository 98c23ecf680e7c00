"""PEFT folders: what loads, and every refused feature or bad weight, with nothing written.

Each bad folder is a copy of a real peft 0.21 adapter with one thing changed. The load
is attempted both as a new name and as a replacement of a registered name; afterwards
the registry and every slot buffer must be exactly as before.
"""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from services.common.errors import AdapterNotFound, InvalidArgument, TesseraError, Unsupported
from services.decoder.lora import AdapterBank, AdapterRegistry, load_peft
from services.decoder.lora.peft_loader import CONFIG_FILE, WEIGHTS_FILE
from services.decoder.model.loader import load_model
from tests.decoder.lora.adapters import Spec, write_adapter
from tests.decoder.model.checkpoints import build

QV = "base_model.model.model.layers.{}.self_attn.{}_proj.lora_{}.weight"


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    root = tmp_path_factory.mktemp("loader")
    folder = build(root, "llama_mha_untied")
    good = write_adapter(folder, root / "adapters", Spec("good", 4, 8.0, ("q_proj", "v_proj"), 11))
    other = write_adapter(folder, root / "adapters", Spec("other", 4, 8.0, ("q_proj", "v_proj"), 12))
    big = write_adapter(folder, root / "adapters", Spec("big", 16, 16.0, ("q_proj",), 13))
    layer1 = write_adapter(folder, root / "adapters",
                           Spec("layer1", 2, 2.0, ("k_proj", "down_proj"), 14, {"layers_to_transform": [1]}))
    return folder, {"good": good, "other": other, "big": big, "layer1": layer1}


@pytest.fixture
def registry(base):
    folder, adapters = base
    bank = AdapterBank(load_model(folder), num_slots=2, max_rank=8)
    reg = AdapterRegistry(bank, 4)
    reg.register("x", read(reg, adapters["other"]))
    return reg


def read(reg, folder):
    b = reg.bank
    return load_peft(folder, layers=b.shapes, max_rank=b.max_rank, dtype=b.dtype)


def snapshot(reg):
    return ([(n, e.digest, e.refs) for n, e in reg.entries.items()], dict(reg.resident),
            {n: (m.lora_A.clone(), m.lora_B.clone()) for n, m in reg.bank.layers.items()})


def assert_unchanged(reg, before):
    after = snapshot(reg)
    assert after[:2] == before[:2]
    for name, (a, b) in before[2].items():
        assert torch.equal(after[2][name][0], a) and torch.equal(after[2][name][1], b), name


def test_peft_keys_load_with_scale_folded(registry, base):
    _, adapters = base
    w = read(registry, adapters["good"])
    raw = load_file(str(adapters["good"] / WEIGHTS_FILE))
    assert w.rank == 4 and w.targets == ("q_proj", "v_proj") and len(w.modules) == 4
    a, b = w.modules["model.layers.1.self_attn.v_proj"]
    assert torch.equal(a, raw[QV.format(1, "v", "A")])
    assert torch.equal(b, raw[QV.format(1, "v", "B")] * 2.0)    # lora_alpha / r = 8 / 4 folded into B: exact
    layer1 = read(registry, adapters["layer1"])
    assert sorted(layer1.modules) == ["model.layers.1.mlp.down_proj", "model.layers.1.self_attn.k_proj"]
    assert read(registry, adapters["good"]).digest == w.digest != read(registry, adapters["other"]).digest


def _config(**changes):
    def edit(folder):
        path = folder / CONFIG_FILE
        cfg = json.loads(path.read_text())
        cfg.update(changes)
        path.write_text(json.dumps(cfg))
    return edit


def _tensors(fn):
    def edit(folder):
        path = folder / WEIGHTS_FILE
        tensors = load_file(str(path))
        fn(tensors)
        save_file(tensors, str(path))
    return edit


def _set(key, value):
    return _tensors(lambda t: t.__setitem__(key, value))


def _poison(key, value):
    def fn(t):
        t[key] = t[key].clone()
        t[key][0, 0] = value
    return _tensors(fn)


CASES = {
    "dora": (_config(use_dora=True), Unsupported, "DoRA"),
    "rslora": (_config(use_rslora=True), Unsupported, "rank-stabilised"),
    "bias_all": (_config(bias="all"), Unsupported, "trained bias"),
    "bias_lora_only": (_config(bias="lora_only"), Unsupported, "trained bias"),
    "lora_bias": (_config(lora_bias=True), Unsupported, "lora_bias"),
    "modules_to_save": (_config(modules_to_save=["lm_head"]), Unsupported, "modules_to_save"),
    "rank_pattern": (_config(rank_pattern={"q_proj": 2}), Unsupported, "rank_pattern"),
    "alpha_pattern": (_config(alpha_pattern={"q_proj": 32}), Unsupported, "alpha_pattern"),
    "rank_pattern_regex": (_config(rank_pattern={r".*\.v_proj": 2}), Unsupported,
                           "rank_pattern.* for model.layers.0.self_attn.v_proj"),
    "bad_pattern": (_config(alpha_pattern={"q_proj(": 2}), InvalidArgument, "not a valid regex"),
    "not_lora": (_config(peft_type="IA3"), Unsupported, "peft_type 'IA3'"),
    "fan_in_fan_out": (_config(fan_in_fan_out=True), Unsupported, "fan_in_fan_out"),
    "pissa_init": (_config(init_lora_weights="pissa"), Unsupported, "rewrites the base weights"),
    "unknown_feature": (_config(some_future_feature=True), Unsupported, "some_future_feature"),
    "unknown_target": (_config(target_modules=["q_proj", "lm_head"]), Unsupported, "'lm_head' is not supported"),
    "bad_r": (_config(r=8), InvalidArgument, "config r=8"),
    "bad_alpha": (_config(lora_alpha="big"), InvalidArgument, "lora_alpha"),
    "missing_tensor": (_tensors(lambda t: t.pop(QV.format(1, "q", "B"))), InvalidArgument, "missing"),
    "extra_tensor": (_set("base_model.model.model.layers.0.self_attn.k_proj.lora_A.weight", torch.zeros(4, 64)),
                     InvalidArgument, "does not target"),
    "foreign_tensor": (_set("base_model.model.lm_head.weight", torch.zeros(160, 64)), InvalidArgument,
                       "unexpected tensor"),
    "wrong_shape": (_set(QV.format(0, "q", "A"), torch.zeros(4, 65)), InvalidArgument, "do not fit"),
    "wrong_b_shape": (_set(QV.format(0, "v", "B"), torch.zeros(63, 4)), InvalidArgument, "do not fit"),
    "nan": (_poison(QV.format(0, "q", "A"), float("nan")), InvalidArgument, "NaN or Inf"),
    "inf": (_poison(QV.format(1, "v", "B"), float("inf")), InvalidArgument, "NaN or Inf"),
    "bad_json": (lambda f: (f / CONFIG_FILE).write_text("{not json"), InvalidArgument, "not valid JSON"),
    "no_weights": (lambda f: (f / WEIGHTS_FILE).unlink(), InvalidArgument, "no adapter_model.safetensors"),
    "corrupt_weights": (lambda f: (f / WEIGHTS_FILE).write_bytes(b"\x00" * 64), InvalidArgument, "cannot be read"),
    "no_config": (lambda f: (f / CONFIG_FILE).unlink(), InvalidArgument, "no adapter_config.json"),
    "missing_folder": (lambda f: shutil.rmtree(f), AdapterNotFound, "does not exist"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_refused_and_nothing_written(case, registry, base, tmp_path):
    edit, error, message = CASES[case]
    folder = tmp_path / case
    shutil.copytree(base[1]["good"], folder)
    edit(folder)
    before = snapshot(registry)
    for name in ("new", "x"):     # a new name, and replacing a registered one
        with pytest.raises(error, match=message) as info:
            registry.register(name, read(registry, folder))
        assert info.value.row.code.name in ("INVALID_ARGUMENT", "NOT_FOUND")
        assert_unchanged(registry, before)


def test_patterns_for_modules_the_adapter_lacks_change_nothing(registry, base, tmp_path):
    """peft 0.21 writes rank and alpha patterns for its weight conversions' modules (a mixture's stacked
    experts, `.*\\.gate_up_proj`) into adapters that have none of them: such an adapter is the plain one."""
    folder = tmp_path / "patterns"
    shutil.copytree(base[1]["good"], folder)
    _config(rank_pattern={r".*\.gate_up_proj": 2}, alpha_pattern={r".*\.gate_up_proj": 4, "k_proj": 1})(folder)
    assert read(registry, folder).digest == read(registry, base[1]["good"]).digest


def test_rank_over_maximum(registry, base):
    before = snapshot(registry)
    with pytest.raises(InvalidArgument, match="rank 16 exceeds the server's --max-lora-rank 8"):
        read(registry, base[1]["big"])
    assert_unchanged(registry, before)


def test_target_not_enabled_on_server(base):
    folder, adapters = base
    bank = AdapterBank(load_model(folder), targets=("q_proj", "o_proj"), num_slots=1, max_rank=8)
    with pytest.raises(InvalidArgument, match="'v_proj' is not enabled on this server"):
        load_peft(adapters["good"], layers=bank.shapes, max_rank=8, dtype=bank.dtype)


def test_every_error_is_typed(registry, base):
    """Nothing escapes as a bare exception: a folder that is a file is still a typed error."""
    f = base[1]["good"] / CONFIG_FILE
    with pytest.raises(TesseraError):
        read(registry, f)
