"""Many LoRA adapters in one base-model batch: slot bank, PEFT loading, registry and leases."""
from services.decoder.lora.bank import AdapterBank
from services.decoder.lora.leases import AdapterLeases, adapter_request
from services.decoder.lora.peft_loader import load_peft
from services.decoder.lora.registry import AdapterRegistry, AdapterStatus
from services.decoder.lora.weights import TARGETS, LoraWeights, prepare_weights

__all__ = ["TARGETS", "AdapterBank", "AdapterLeases", "AdapterRegistry", "AdapterStatus", "LoraWeights",
           "adapter_request", "load_peft", "prepare_weights"]
