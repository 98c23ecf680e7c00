"""The model runner: StepInput in, StepOutput out.

One forward pass per step over every scheduled token (all requests, prefill and decode
rows alike), the LM head only over the rows that are sampled, then the sampler; or, for a step
whose rows are all plain greedy, the argmax screen in place of the fp32 head (model/screen.py).
Chunks that score their prompt (prompt_logprobs) also run the head over their prompt rows, piece by
piece (runner/prompt_scores.py).
"""
from __future__ import annotations

import logging
import math
from contextlib import nullcontext
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from services.common.errors import InvalidArgument, TesseraError, Unsupported
from services.common.plan import DECODER as DECODER_PATHS
from services.common.plan import ExecutionPlan, Pins
from services.decoder.engine.step import ScheduledChunk, StepInput, StepOutput
from services.decoder.lora.pool import AdapterPool
from services.decoder.model.decoder import CausalLM
from services.decoder.model.glue import choose as choose_glue
from services.decoder.model.linear import pack_linears, quantize_linears, split_linears
from services.decoder.model.loader import load_model
from services.decoder.model.matmul_choice import (
    choose_bf16_row,
    choose_gemv,
    choose_gemv_prefetch,
    choose_gemv_streams,
    choose_grouped_loop,
    choose_grouped_matmul,
    choose_int8_gemm,
)
from services.decoder.model.screen import build as build_screen
from services.decoder.runner import verify_cost
from services.decoder.runner.attention import CPP, TORCH, PagedAttention, Workspace, choose_decode_backend
from services.decoder.runner.batch import StepBatch
from services.decoder.runner.fused_decode import FusedDecode
from services.decoder.runner.kv_cache import KVCache
from services.decoder.runner.prompt_scores import score_prompts
from services.decoder.runner.sampler import Sampler, check_sampling
from services.decoder.runner.windows import Windows, binding

if TYPE_CHECKING:
    from services.decoder.lora.store import AdapterStore

log = logging.getLogger("tessera.runner")


class Runner:
    def __init__(self, model: CausalLM, block_size: int, num_blocks: int, seed: int | None = None,
                 fast_paths: str | Pins | None = None, quantization: str = "none", matmul_precision: str = "highest"):
        """fast_paths: what --fast-paths pins (services/common/plan.py); every other path is timed here.
        matmul_precision: highest, or high to let fp32 matmuls split their products in bf16 halves
        (services/common/split_products.py)."""
        self.model = model
        declined = model.refused_features()
        for feature, asked, key in (("bf16", model.lm_head.weight.dtype == torch.bfloat16, "dtype"),
                                    ("int8", quantization == "int8", "quantization"),
                                    ("int4", quantization == "int4", "quantization")):
            if asked and feature in declined:
                raise Unsupported(f"--{key} {feature}: {declined[feature]}", param=key)
        # Every load-time choice of a fast path, made under the pins and reported by GetModelInfo.
        self.plan = plan = ExecutionPlan(fast_paths, DECODER_PATHS)
        huge_pages = plan.pinned("huge_pages") != "off"
        model.fuse_projections()
        # Weight-only int8 first (model/quantization.py): the Linears it takes need no matmul path.
        self.quantization = quantize_linears(model, quantization)
        # Then every weight into one arena of 2 MiB pages, before anything packs or holds them: a decode
        # step streams them all, bound by memory (services/common/arena.py).
        weight_pages = model.place_weights(huge_pages)
        # The matmul path per weight shape, chosen by timing at load (model/linear.py) unless pinned
        # (linear=packed or plain).
        pack_linears(model, plan)
        # Under --matmul-precision high, fp32 matmuls on the tile unit from the rows where they beat that path.
        split_linears(model, plan, matmul_precision)
        # int8 and grouped (4-bit) weights: their matmul above the few-row kernel's rows, per shape by
        # timing at many rows; before choose_gemv, which times the kernel against it.
        choose_int8_gemm(model, plan)
        choose_grouped_matmul(model, plan)
        # The few-row kernel's loop over grouped weights (two orders of work), by timing both at this model's.
        choose_grouped_loop(model, plan)
        # Whether the few-row kernel asks for dense weights ahead of the row it reads, by timing both.
        choose_gemv_prefetch(model, plan)
        # And the order each thread reads its weight rows in (one stream or two), by timing both with that choice.
        choose_gemv_streams(model, plan)
        # Then the few-row kernel where it beats that path (decode at batch 1 to 4), by timing.
        choose_gemv(model, plan)
        # And its loop for bf16 activations over bf16 weights, by timing both at this model's weights.
        choose_bf16_row(model, plan)
        # RMSNorm and SiLU(gate) * up by the C++ row ops or torch's, per op by timing (model/glue.py).
        choose_glue(model, plan)
        self.config = cfg = model.config
        param = model.lm_head.weight
        self.device, self.dtype = param.device, param.dtype
        self.block_size, self.num_blocks = block_size, num_blocks
        self.cache = KVCache(cfg.num_layers, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim,
                             self.dtype, self.device, huge_pages)
        # Where the weights and the KV cache live (not timed: on unless pinned off), what the kernel granted.
        plan.record("huge_pages", "on" if huge_pages else "off",
                    reason=f"weights: {weight_pages}; KV cache: {self.cache.pages}")
        self.workspace = Workspace()
        # Each layer's sliding window and the soft-cap: every attention path honours them (runner/windows.py).
        self.windows = Windows(binding(cfg.layer_windows, num_blocks * block_size), cfg.attn_softcap)
        # Decode attention: the C++ operator over the paged cache or the torch gather path,
        # timed at this model's heads at load (runner/attention.py); CUDA runs the torch path.
        attention = choose_decode_backend(plan, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, block_size,
                                          self.dtype, self.device)
        # Decode steps: every layer in one C++ call, up to the row count where it beat the layers at
        # load (runner/fused_decode.py). The stack attends by itself but its steps carry the operator's
        # paged metadata, so it is built and timed whenever the operator is available, even where the
        # layers' attention alone timed faster in torch (not pinned): one layer's decode attention is a
        # small part of a step, and on a Zen 3 (family 25 model 1) the two were level within the noise
        # while the stack's 1 B-shaped int4 step took 38 ms against the layers' 47.
        timed_torch = attention == TORCH and bool(plan.get("attention").timings)  # not pinned, operator built
        self.fused_decode, _ = FusedDecode.build(model, self.cache, CPP if timed_torch else attention, plan)
        self.attention_backend = CPP if timed_torch and self.fused_decode is not None else attention
        if self.attention_backend != attention:
            plan.record("attention", "cpp", plan.get("attention").timings,
                        "the decode stack runs, and its steps need the operator's paged metadata (the layers' "
                        "attention alone timed faster in torch)")
        self.sampler = Sampler(seed)
        # Greedy rows of an fp32 head: their argmax through a bf16 screen of it, where that was faster
        # at load (model/screen.py).
        self.screen, _ = build_screen(
            model.lm_head, model.logits, math.sqrt(cfg.hidden_size) * float(model.model.norm.weight.abs().mean()),
            plan, huge_pages, model.unsupported().get("screen", ""))
        # How constrained rows get their grammar masks applied, chosen by timing at the real width.
        self.sampler.grammars.choose(cfg.vocab_size, self.device, plan)
        # The adapter store installed on self.model, if any (attach_lora): the CUDA slot bank or the CPU
        # pool (lora/store.py); chunks with a lora_slot (a store handle) need it.
        self.lora: AdapterStore | None = None

    def verify_seconds(self, max_drafts: int) -> tuple[float, ...] | None:
        """Seconds of a one-request decode step with k = 0..max_drafts drafts, timed now (runner/verify_cost.py)
        for the engine's draft gate; None when --fast-paths speculation=always turns the gate off."""
        return verify_cost.measure(self, max_drafts, self.plan)

    def attach_lora(self, bank: AdapterStore) -> None:
        """Use `bank` (an adapter store already installed on self.model) for chunks with a lora_slot."""
        name, slots = next(iter(bank.layers.items()))
        if self.model.get_submodule(name).lora is not slots:
            raise ValueError("the adapter store is not installed on this runner's model")
        self.lora = bank
        if isinstance(bank, AdapterPool):
            # How its adapter rows are read (split over the threads, asked for ahead), timed here (lora/pool.py);
            # the decode stack's the same.
            bank.choose_reading(self.plan)
        if self.fused_decode is not None:
            self.fused_decode.attach_lora(bank)

    @classmethod
    def from_folder(cls, folder: str | Path, dtype: str | torch.dtype = "fp32", block_size: int = 16,
                    num_blocks: int = 1024, device: str | torch.device = "cpu",
                    seed: int | None = None, fast_paths: str | Pins | None = None,
                    quantization: str = "none", matmul_precision: str = "highest") -> Runner:
        return cls(load_model(folder, dtype, device), block_size, num_blocks, seed, fast_paths, quantization,
                   matmul_precision)

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    @property
    def max_position_embeddings(self) -> int:
        return self.config.max_position_embeddings

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self.config.eos_token_ids

    @property
    def attention_reach(self) -> int | None:
        """Keys a query reads back when every layer slides (the largest window), else None: the engine
        returns a request's blocks before position p - reach + 1 once its next query is at p."""
        return self.windows.reach

    @torch.inference_mode()
    def logits(self, step: StepInput) -> tuple[torch.Tensor, StepBatch]:
        """Run the step; fp32 logits [R, vocab] of the sampled rows: per sampled chunk (batch.sampled
        order) its last known token's row and one row per draft."""
        hidden, batch = self.hidden(step)
        return self.model.logits(hidden), batch

    @torch.inference_mode()
    def hidden(self, step: StepInput) -> tuple[torch.Tensor, StepBatch]:
        """Run the step; the final hidden states [R, hidden] of the rows logits() would return."""
        hidden, batch = self.forward(step)
        return hidden.index_select(0, batch.sample_rows), batch

    @torch.inference_mode()
    def forward(self, step: StepInput) -> tuple[torch.Tensor, StepBatch]:
        """Run the step; the final hidden states [N, hidden] of every row, chunk after chunk."""
        for c in step.chunks:
            fault = self.refusal(c)
            if fault is not None:
                raise fault
        batch = StepBatch.build(step, self.block_size, self.device, self.config.mrope_sections,
                                self.attention_backend, self.windows)
        embeds = self.model.embed(batch.input_ids)
        if batch.image_rows:
            rows, values = zip(*batch.image_rows, strict=True)
            embeds[list(rows)] = torch.stack(values).to(embeds)
        # The per-step adapter grouping is built once here and shared by every layer.
        scope = self.lora.activate(batch.lora_spans, len(batch.input_ids)) if self.lora is not None \
            else nullcontext()
        with scope as adapters:
            if self.fused_decode is not None and self.fused_decode.applies(batch):
                hidden = self.fused_decode(embeds, batch.positions, batch.plan, adapters)
            else:
                hidden = self.model(embeds, batch.positions, PagedAttention(self.cache, batch.plan, self.workspace))
        return hidden, batch

    def refusal(self, chunk: ScheduledChunk) -> TesseraError | None:
        """Why this runner cannot run `chunk`'s request, or None. Request-shaped faults only (the
        server refuses them before the engine; this is the last line): a token id outside the
        vocabulary, an adapter handle without a store, images the model cannot place, bad sampling."""
        ids = chunk.token_ids
        if not ids:
            return InvalidArgument("a chunk needs at least one token")
        if min(ids) < 0 or max(ids) >= self.vocab_size:
            return InvalidArgument(f"token ids must be in [0, {self.vocab_size})", param="prompt")
        if chunk.lora_slot is not None:
            if self.lora is None:
                return Unsupported("LoRA adapters need an adapter bank; this runner has none (--max-loras 0)")
            if not self.lora.valid(chunk.lora_slot):
                return InvalidArgument(f"adapter handle {chunk.lora_slot} is not placed in the adapter store")
        images = chunk.images
        if images is not None:
            sections = self.config.mrope_sections
            if sections is None:
                return Unsupported("this model has no M-RoPE sections; it cannot take image positions")
            if images.sections is not None and tuple(images.sections) != tuple(sections):
                return InvalidArgument(f"M-RoPE sections {tuple(images.sections)} differ from the model's {sections}")
        if chunk.sample:
            try:
                check_sampling(chunk.sampling)
            except TesseraError as exc:
                return exc
        return None

    @torch.inference_mode()
    def execute(self, step: StepInput) -> StepOutput:
        """One engine step: write KV for every chunk, sample one token per chunk with sample=True
        (after the drafts it accepted, if it had any).

        A chunk this runner refuses (`refusal`) is left out of the forward and named in
        StepOutput.failed; the step's other chunks run as if it had not been scheduled."""
        self.sampler.grammars.states.forget(step.finished_request_ids)
        failed = {}
        for c in step.chunks:
            fault = self.refusal(c)
            if fault is not None:
                failed[c.request_id] = f"{type(fault).__name__}: {fault.message}"
        if failed:
            step = replace(step, chunks=[c for c in step.chunks if c.request_id not in failed])
            if not step.chunks:
                return StepOutput({}, failed=failed)
        hidden, batch = self.forward(step)
        # Prompt logprobs come from the rows inside prompts, before the step keeps only its sampled rows.
        scores = score_prompts(hidden, step.chunks, self.model.logits, self.vocab_size) \
            if any(c.prompt_logprobs is not None for c in step.chunks) else {}
        hidden = hidden.index_select(0, batch.sample_rows)
        runs = None
        if self.screen is not None and 0 < hidden.shape[0] <= self.screen.max_rows \
                and self.sampler.plain_greedy(batch.sampled):
            tokens = self.screen.argmax(hidden)
            if tokens is not None:
                runs = self.sampler.greedy_runs(tokens.tolist(), batch.sampled)
        if runs is None:
            runs = self.sampler.run(self.model.logits(hidden), batch.sampled) if batch.sampled else []
        return StepOutput({c.request_id: run[-1] for c, run in zip(batch.sampled, runs, strict=True)},
                          {c.request_id: run[:-1] for c, run in zip(batch.sampled, runs, strict=True) if len(run) > 1},
                          failed, scores)
