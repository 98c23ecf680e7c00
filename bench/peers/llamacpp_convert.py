"""SmolLM2 (HF folder) -> F32, BF16 and Q8_0 GGUF for the llama.cpp peer; run by `make bench-peers`. With
--name and --outtypes, another folder to the GGUF files it names (bench/decoder.py (g): the MoE checkpoint).

Runs in build/peers/.venv-convert (the vendored gguf package, transformers 4.x): the main venv's
transformers 5.x writes a folder that 4.x cannot read as is, so the converter works on a copy:
  - tokenizer_config.json: "tokenizer_class" is transformers-5's "TokenizersBackend"; 4.x needs
    a class it knows, and SmolLM2's tokenizer.json is a GPT-2 style BPE: GPT2TokenizerFast;
  - config.json: rope_theta lives only in 5.x's "rope_parameters"; 4.x would default it to 10000,
    so it is copied to the top level too.
The weights are linked, not copied, and the source folder is never written.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

OUTTYPES = {"f32": "SmolLM2-135M-Instruct-F32.gguf", "bf16": "SmolLM2-135M-Instruct-BF16.gguf",
            "q8_0": "SmolLM2-135M-Instruct-Q8_0.gguf"}


def gguf_name(stem: str, outtype: str) -> str:
    """The GGUF file name of stem in outtype, as OUTTYPES names SmolLM2's."""
    return f"{stem}-{outtype.upper()}.gguf"


def patched_copy(src: Path, dst: Path) -> None:
    if dst.exists():
        shutil.rmtree(dst)
    dst.mkdir(parents=True)
    for f in src.iterdir():
        if f.is_file() and f.suffix == ".safetensors":
            os.symlink(f.resolve(), dst / f.name)
        elif f.is_file():
            shutil.copy2(f, dst / f.name)
    tok_path = dst / "tokenizer_config.json"
    tok = json.loads(tok_path.read_text())
    if tok.get("tokenizer_class") not in (None, "GPT2Tokenizer", "GPT2TokenizerFast"):
        tok["tokenizer_class"] = "GPT2TokenizerFast"
    tok_path.write_text(json.dumps(tok, indent=2))
    cfg_path = dst / "config.json"
    cfg = json.loads(cfg_path.read_text())
    rope = cfg.get("rope_parameters") or {}
    if "rope_theta" not in cfg and "rope_theta" in rope:
        cfg["rope_theta"] = rope["rope_theta"]
    cfg_path.write_text(json.dumps(cfg, indent=2))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--src", required=True, type=Path, help="the HF folder (models/SmolLM2-135M-Instruct)")
    ap.add_argument("--out", required=True, type=Path, help="where the GGUF files go")
    ap.add_argument("--converter", required=True, type=Path, help="vendored convert_hf_to_gguf.py")
    ap.add_argument("--name", help="file stem of the GGUF files (default: SmolLM2's names)")
    ap.add_argument("--outtypes", default=",".join(OUTTYPES), help="comma list of f32,bf16,q8_0")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    work = args.out / f"hf-transformers4-{args.name or 'smollm2'}"
    patched_copy(args.src, work)
    for outtype in args.outtypes.split(","):
        name = OUTTYPES[outtype] if args.name is None else gguf_name(args.name, outtype)
        target = args.out / name
        tmp = target.with_suffix(".gguf.part")
        subprocess.run([sys.executable, str(args.converter), str(work), "--outtype", outtype, "--outfile", str(tmp)],
                       check=True)
        tmp.replace(target)
        print(f"wrote {target} ({target.stat().st_size / 2**20:.0f} MiB)")
    shutil.rmtree(work)


if __name__ == "__main__":
    main()
