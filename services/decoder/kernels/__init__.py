"""Decoder kernels. Each kernel file holds its @triton.jit kernels, a launcher and a torch *_ref."""
from .bgmv import bgmv, bgmv_ref
from .lora import backend_name, grouped_lora_ref, lora_apply, lora_torch
from .lora_meta import LoraBatchMeta, build_lora_meta
from .sgmv import sgmv, sgmv_ref

__all__ = ["LoraBatchMeta", "backend_name", "bgmv", "bgmv_ref", "build_lora_meta", "grouped_lora_ref",
           "lora_apply", "lora_torch", "sgmv", "sgmv_ref"]
