"""The registry of decoder families: config.json's model_type -> the CausalLM class that computes it.

A family is one module read top to bottom (model/granite.py, model/olmo2.py, model/phi3.py, model/gemma.py) built
from the shared layers of model/layers.py; Llama, Qwen2 and Qwen3 differ only in what model/config.py reads (biases,
per-head q/k norms), so they share CausalLM itself. config.FAMILIES names the same model types: a
config is refused before any weight is read, and tests/decoder/families checks the two agree.
"""
from __future__ import annotations

from services.decoder.model.config import ModelConfig
from services.decoder.model.decoder import CausalLM
from services.decoder.model.gemma import Gemma2, Gemma3
from services.decoder.model.granite import Granite
from services.decoder.model.moe_decoder import MoeCausalLM
from services.decoder.model.olmo2 import Olmo2
from services.decoder.model.phi3 import Phi3

MODELS: dict[str, type[CausalLM]] = {
    "llama": CausalLM,
    "qwen2": CausalLM,
    "qwen3": CausalLM,
    "granite": Granite,
    "olmo2": Olmo2,
    "phi3": Phi3,
    "mistral": CausalLM,      # Llama's layer; its sliding window is config.layer_windows, honoured by attention
    "qwen3_moe": MoeCausalLM,
    "qwen2_moe": MoeCausalLM,
    "mixtral": MoeCausalLM,
    "gemma2": Gemma2,
    "gemma3_text": Gemma3,
}


def model_class(cfg: ModelConfig) -> type[CausalLM]:
    """The class that computes cfg's family (config.py has refused every other model_type)."""
    return MODELS[cfg.family]
