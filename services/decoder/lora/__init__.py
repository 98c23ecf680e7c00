"""Many LoRA adapters in one base-model batch: adapter stores (CUDA slot bank, CPU pool), PEFT loading,
registry and leases."""
from services.decoder.lora.bank import AdapterBank
from services.decoder.lora.leases import AdapterLeases, adapter_request
from services.decoder.lora.peft_loader import load_peft
from services.decoder.lora.pool import AdapterPool
from services.decoder.lora.registry import AdapterRegistry, AdapterStatus
from services.decoder.lora.store import AdapterStore
from services.decoder.lora.weights import TARGETS, LoraWeights, prepare_weights

__all__ = ["TARGETS", "AdapterBank", "AdapterLeases", "AdapterPool", "AdapterRegistry", "AdapterStatus", "AdapterStore",
           "LoraWeights",
           "adapter_request", "load_peft", "prepare_weights"]
