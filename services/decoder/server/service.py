"""DecoderService over gRPC: prompt building, validation, streaming, engine stats.

The model loads after the server starts, so health says NOT_SERVING while
loading; calls made before then get UNAVAILABLE.
"""
from __future__ import annotations

import asyncio
import logging
import os
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import torch
from prometheus_client import Counter, Gauge, Histogram

from services.common import compute
from services.common.dtypes import to_torch
from services.common.errors import (
    AdapterNotFound,
    ContextLengthExceeded,
    Internal,
    InvalidArgument,
    ModelNotFound,
    Unavailable,
    Unsupported,
    grpc_errors,
)
from services.common.metrics import LATENCY_BUCKETS
from services.common.pb import common_pb2, decoder_pb2, decoder_pb2_grpc
from services.common.server import Server, Started
from services.decoder.engine.config import EngineConfig, SpeculativeConfig
from services.decoder.engine.engine_core import EngineCore
from services.decoder.engine.hashing import salt_keys
from services.decoder.engine.output import EngineStats, RequestOutput
from services.decoder.engine.request import AdapterRef
from services.decoder.grammar.compiled import Grammar
from services.decoder.grammar.compiler import GrammarCompiler
from services.decoder.grammar.spec import GrammarSpec
from services.decoder.lora.registry import check_name
from services.decoder.model.config import ModelConfig
from services.decoder.model.gguf_file import GGUFModel, is_gguf
from services.decoder.model.loader import check_folder, check_gguf, model_config
from services.decoder.multimodal.request import place_images, request_images
from services.decoder.runner.runner import Runner
from services.decoder.server.adapters import Adapters, adapter_info
from services.decoder.server.async_engine import AsyncEngine, EngineDescription
from services.decoder.server.config import DecoderConfig, DecoderServerConfig
from services.decoder.server.messages import template_messages, template_tools
from services.decoder.server.structured_output import grammar_spec
from services.decoder.server.validation import Limits, check_images, check_prompt, check_tools, sampling_params
from services.decoder.text import gguf_tokenizer
from services.decoder.text.chat_template import ChatTemplate
from services.decoder.text.choice import Choice, prompt_info
from services.decoder.text.tokenizer import Tokenizer

log = logging.getLogger("tessera.decoder")
SERVICE_NAME = decoder_pb2.DESCRIPTOR.services_by_name["DecoderService"].full_name

_RUNNING = Gauge("tessera_decoder_running_requests", "requests running in the engine")
_WAITING = Gauge("tessera_decoder_waiting_requests", "requests waiting for admission")
_KV_USAGE = Gauge("tessera_decoder_kv_usage_ratio", "fraction of KV blocks in use")
_PREFIX_QUERIES = Gauge("tessera_decoder_prefix_cache_queries_tokens", "prompt tokens looked up in the prefix cache")
_PREFIX_HITS = Gauge("tessera_decoder_prefix_cache_hits_tokens", "prompt tokens served from the prefix cache")
_PREEMPTIONS = Gauge("tessera_decoder_preemptions", "requests preempted so far")
_TTFT = Histogram("tessera_decoder_time_to_first_token_seconds", "time to first token", buckets=LATENCY_BUCKETS)
_ITL = Histogram("tessera_decoder_inter_token_latency_seconds", "time between tokens", buckets=LATENCY_BUCKETS)
_REQUESTS = Counter("tessera_decoder_requests", "finished requests by finish reason", ["reason"])
_GRAMMARS = Counter("tessera_decoder_grammar_requests", "structured-output requests by compile cache result",
                    ["cache"])
_DRAFTED = Gauge("tessera_decoder_spec_draft_tokens", "speculative decoding: draft tokens proposed so far")
_ACCEPTED = Gauge("tessera_decoder_spec_accepted_tokens", "speculative decoding: draft tokens accepted so far")
_VERIFICATIONS = Gauge("tessera_decoder_spec_verifications", "speculative decoding: chunks verified with drafts")
_ACCEPTANCE = Gauge("tessera_decoder_spec_acceptance_rate", "speculative decoding: accepted / drafted tokens")
_ACCEPTED_LENGTH = Gauge("tessera_decoder_spec_mean_accepted_length",
                         "speculative decoding: accepted drafts per verification")
_GRAMMAR_CACHE_BYTES = Gauge("tessera_decoder_grammar_cache_bytes", "bytes of compiled grammars cached "
                             "(bounded by --grammar-cache-mb)")
_GRAMMAR_OVERDUE = Gauge("tessera_decoder_grammar_overdue_compiles", "compiles past --grammar-compile-timeout-s "
                         "whose thread still runs (xgrammar cannot be interrupted)")
_GRAMMAR_WAIT = Histogram("tessera_decoder_grammar_wait_seconds", "time a request waited for its grammar "
                          "(compile, or a cache hit)", buckets=LATENCY_BUCKETS)


def _export(stats: EngineStats, _outputs: list[RequestOutput]) -> None:
    _RUNNING.set(stats.num_running)
    _WAITING.set(stats.num_waiting)
    _KV_USAGE.set(stats.kv_usage)
    _PREFIX_QUERIES.set(stats.prefix_queries)
    _PREFIX_HITS.set(stats.prefix_hits)
    _PREEMPTIONS.set(stats.num_preemptions)
    _DRAFTED.set(stats.num_draft_tokens)
    _ACCEPTED.set(stats.num_accepted_tokens)
    _VERIFICATIONS.set(stats.num_verifications)
    _ACCEPTANCE.set(stats.acceptance_rate)
    _ACCEPTED_LENGTH.set(stats.mean_accepted_length)


def kv_blocks(model_cfg: ModelConfig, cfg: DecoderConfig) -> int:
    """Blocks that fit --kv-cache-gb, unless --num-blocks is given."""
    if cfg.num_blocks:
        return cfg.num_blocks
    itemsize = torch.empty((), dtype=to_torch(cfg.dtype)).element_size()
    per_block = 2 * model_cfg.num_layers * cfg.block_size * model_cfg.num_kv_heads * model_cfg.head_dim * itemsize
    return max(1, int(cfg.kv_cache_gb * 2**30) // per_block)


@dataclass
class Loaded:
    """Everything the servicer needs once the model is up."""

    name: str
    engine: AsyncEngine
    tokenizer: Tokenizer
    template: ChatTemplate | None
    engine_config: EngineConfig
    info: EngineDescription              # the model and its runner, as the engine describes them
    grammars: GrammarCompiler
    adapters: Adapters | None = None     # None with --max-loras 0


def check(cfg: DecoderConfig) -> None:
    """--model and --tokenizer read before anything starts (services/common/process.py): a folder or GGUF file the
    decoder cannot serve (model/loader.py check_folder and check_gguf), or no tokenizer (no tokenizer.json in the
    tokenizer folder; a GGUF file without one in its metadata and no --tokenizer) is refused in one line naming
    the file, the key, the tensor type."""
    gguf = is_gguf(cfg.model)
    check_gguf(cfg.model) if gguf else check_folder(cfg.model)
    if cfg.tokenizer or not gguf:
        folder = cfg.tokenizer or cfg.model
        if not (Path(folder) / "tokenizer.json").is_file():
            flag = "--tokenizer" if cfg.tokenizer else "--model"
            raise FileNotFoundError(f"{flag} {folder} has no tokenizer.json (the decoder reads a tokenizers-format "
                                    "file)")
    elif not GGUFModel.open(cfg.model).has_vocabulary:
        raise FileNotFoundError(f"{cfg.model} has no tokenizer in its metadata: name a tokenizer folder with "
                                "--tokenizer DIR")


def load(cfg: DecoderConfig) -> Loaded:
    """Build tokenizer, runner and engine core (blocking; run it off the event loop)."""
    folder = Path(cfg.model)
    if not is_gguf(folder) and not (folder / "config.json").is_file():
        raise FileNotFoundError(f"{folder}: no config.json (is --model an HF model folder?)")
    model_cfg = model_config(folder)
    num_blocks = kv_blocks(model_cfg, cfg)
    runner = Runner.from_folder(folder, cfg.dtype, cfg.block_size, num_blocks, cfg.device, cfg.seed, cfg.fast_paths,
                                cfg.quantization, cfg.matmul_precision)
    with tempfile.TemporaryDirectory(prefix="tessera-gguf-tokenizer-") as scratch:
        text = Path(cfg.tokenizer) if cfg.tokenizer else \
            gguf_tokenizer.write_folder(folder, Path(scratch)) if is_gguf(folder) else folder
        tokenizer = Tokenizer.from_folder(text)
        template = ChatTemplate.from_folder(text, tokenizer)
    if cfg.enable_auto_tool_choice and (template is None or not template.supports_tools):
        # Parsing calls the template never asks for would invent a format the model was not taught.
        raise ValueError(f"--enable-auto-tool-choice: {folder}'s chat template does not render tools, so the model "
                         f"has no tool-call format to parse; serve a tool-capable model (Qwen2.5, Qwen3) or leave "
                         f"auto tool choice off (tool_choice required or named still works)")
    eos = tuple(dict.fromkeys((*runner.eos_token_ids, *tokenizer.stop_token_ids)))
    engine_cfg = EngineConfig(
        block_size=cfg.block_size, num_blocks=num_blocks, max_num_batched_tokens=cfg.max_num_batched_tokens,
        max_num_seqs=cfg.max_num_seqs, max_model_len=cfg.max_model_len or runner.max_position_embeddings,
        enable_prefix_caching=cfg.enable_prefix_caching, eos_token_ids=eos, speculative=cfg.speculative,
        vocab_size=runner.vocab_size)
    # Its vocabulary builds on its own pool from here on; serving does not wait for it.
    grammars = GrammarCompiler(tokenizer.backend, vocab_size=runner.vocab_size, stop_token_ids=eos,
                               special_token_ids=tokenizer.all_special_ids, threads=cfg.grammar_threads,
                               cache_size=cfg.grammar_cache_size, cache_bytes=int(cfg.grammar_cache_mb * 2**20),
                               deadline_s=cfg.grammar_compile_timeout_s)
    _GRAMMAR_CACHE_BYTES.set_function(lambda: grammars.cache.nbytes)
    _GRAMMAR_OVERDUE.set_function(lambda: grammars.pool.overdue)
    # From here on the server reaches the runner and the scheduler only through the AsyncEngine.
    engine = AsyncEngine(EngineCore(runner, engine_cfg), on_step=_export)
    adapters = Adapters(cfg, engine) if cfg.max_loras else None
    if cfg.fault_fail_at_step:
        engine.inject_fault(cfg.fault_fail_at_step)
    name = cfg.served_model_name or (folder.stem if is_gguf(folder) else folder.resolve().name)
    log.info("loaded %s (%s, %s, RoPE %s): %d KV blocks of %d tokens, max_model_len %d, chat template: %s, "
             "speculative decoding: %s", name, model_cfg.family, cfg.dtype,
             model_cfg.rope.describe() if model_cfg.rope else "default", num_blocks, cfg.block_size,
             engine_cfg.max_model_len, template is not None,
             engine_cfg.speculative.to_json() if engine_cfg.speculative else "off")
    if adapters is not None:
        def on_step(stats: EngineStats, outputs: list[RequestOutput]) -> None:
            _export(stats, outputs)
            adapters.export(engine)
        engine.on_step = on_step
    return Loaded(name, engine, tokenizer, template, engine_cfg, engine.describe(), grammars, adapters)


def _speculative(spec: SpeculativeConfig | None) -> decoder_pb2.SpeculativeDecoding | None:
    """GetModelInfo's speculative_decoding: the config's keys as typed fields; None (unset) when off."""
    return None if spec is None else decoder_pb2.SpeculativeDecoding(**{k: getattr(spec, k) for k in spec.KEYS})


class DecoderServicer(decoder_pb2_grpc.DecoderServiceServicer):
    def __init__(self, cfg: DecoderConfig):
        self.cfg = cfg
        self.state: Loaded | None = None

    def close(self, timeout: float | None = None) -> bool:
        """Stop the engine, then the grammar compiler (waiting up to timeout s, default the compile deadline):
        whether no xgrammar call is left running, since a process must not exit under one (grammar/pool.py)."""
        if self.state is None:
            return True
        self.state.engine.stop()
        return self.state.grammars.close(timeout)

    def _ready(self) -> Loaded:
        if self.state is None:
            raise Unavailable("the model is still loading")
        return self.state

    # -- prompt ------------------------------------------------------------------

    def _prompt(self, st: Loaded, request, limits: Limits) -> list[int]:
        """The request's prompt ids. Blocking (the template, the tokenizer): Generate runs it on a worker
        thread. A text certainly max_model_len tokens or longer is refused from a prefix of it, before the
        rest is tokenized (services/common/token_budget.py), so a 15 MB prompt costs what its first few
        kilobytes do."""
        max_model_len = limits.max_model_len
        kind = request.WhichOneof("prompt")
        if kind == "text":
            if not request.text:
                raise InvalidArgument("the prompt is empty", param="prompt")
            return self._within(st, request.text, max_model_len, add_special_tokens=True)
        if kind == "token_ids":
            if len(request.token_ids.ids) >= max_model_len:    # before each id is checked
                raise ContextLengthExceeded(f"the prompt has {len(request.token_ids.ids)} tokens; the maximum "
                                            f"context length is {max_model_len}", param="prompt")
            return st.tokenizer.validate_ids(list(request.token_ids.ids), limit=st.info.vocab_size)
        if kind == "chat":
            return self._chat_ids(st, request.chat, limits=limits)
        raise InvalidArgument("a prompt (text, token ids or messages) is required", param="prompt")

    @staticmethod
    def _within(st: Loaded, text: str, max_model_len: int, add_special_tokens: bool) -> list[int]:
        """text's ids, or ContextLengthExceeded as soon as a prefix of it holds max_model_len of them (the
        rulebook's bound: check_prompt refuses the same prompts, counted whole)."""
        ids, whole = st.tokenizer.encode_leading(text, max_model_len, add_special_tokens=add_special_tokens)
        if not whole:
            raise ContextLengthExceeded(f"the prompt has at least {len(ids)} tokens; the maximum context length "
                                        f"is {max_model_len}", param="prompt")
        return ids

    @classmethod
    def _chat_ids(cls, st: Loaded, chat, add_special_tokens: bool = False, limits: Limits | None = None
                  ) -> list[int]:
        """ChatMessages -> the rendered template's token ids (Generate and Tokenize share this, so they
        agree). Generate adds no special tokens: the template writes its own; it passes its limits: the
        tools are counted, and a text of max_model_len tokens or more is refused from a prefix (_within)."""
        if st.template is None:
            raise InvalidArgument(f"model {st.name!r} has no chat template; send a prompt instead",
                                  param="messages")
        messages, tools = template_messages(chat), template_tools(chat)
        if limits is not None:
            check_tools(len(tools or ()), limits)
        text = st.template.render(messages, add_generation_prompt=chat.add_generation_prompt, tools=tools)
        if limits is not None:
            return cls._within(st, text, limits.max_model_len, add_special_tokens)
        return st.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def _limits(self, st: Loaded) -> Limits:
        """The rulebook's numbers for this server, as GetModelInfo publishes them."""
        return Limits.of(self.cfg, st.engine_config.max_model_len)

    @staticmethod
    def _check_model(st: Loaded, model: str) -> None:
        if model and model != st.name:
            raise ModelNotFound(f"model {model!r} is not served here (serving {st.name!r})", param="model")

    # -- RPCs ----------------------------------------------------------------------

    @grpc_errors
    async def Generate(self, request, context):
        st = self._ready()
        self._check_model(st, request.model)
        if not request.adapter:
            async for msg in self._generate(st, request, None, ()):
                yield msg
            return
        # The adapter's content digest salts the request's block hashes; the slot is leased at admission.
        # A cold adapter loads here first (--lora-on-demand), before the engine sees the request.
        async with self._lora(st, request.adapter).on_demand.use(request.adapter) as (adapter, lora_keys):
            async for msg in self._generate(st, request, adapter, lora_keys):
                yield msg

    async def _generate(self, st: Loaded, request, adapter: AdapterRef | None, lora_keys: tuple):
        # Images are checked before rendering and expanded after it, before any length check
        # (docs/design.md, invariant 1).
        # Every semantic rule is the rulebook's (services/decoder/server/validation.py).
        limits = self._limits(st)
        check_images(len(request.images), limits)
        images = request_images(request, st.info.model, model=st.name)
        # Off the event loop: rendering and tokenizing a long prompt must not hold up other streams.
        ids = await asyncio.to_thread(self._prompt, st, request, limits)
        placed = place_images(ids, images, st.info.model)
        prompt = placed.token_ids
        check_prompt(prompt, limits)
        params, include_stop = sampling_params(request.sampling, prompt_len=len(prompt),
                                               vocab_size=st.info.vocab_size, limits=limits)
        spec = grammar_spec(request.sampling, limits)
        start = last = time.monotonic()        # time to first token includes the grammar's compile
        # Compiled here, on the grammar pool, before the engine sees the request: a slow schema delays
        # only its own request (bounded by --grammar-compile-timeout-s), and one that does not compile is
        # refused with nothing queued.
        grammar = await self._grammar(st, spec) if spec is not None else None
        rid = request.request_id or uuid.uuid4().hex
        choices = [Choice(i, st.tokenizer, params.stop, include_stop, params.logprobs is not None,
                          params.min_tokens) for i in range(params.n)]
        completion = [0] * params.n
        cached = 0
        first = True
        async for out in st.engine.generate(rid, prompt, params, images=placed.images, adapter=adapter,
                                            grammar=grammar, span_keys=placed.span_keys,
                                            extra_keys=lora_keys + salt_keys(request.cache_salt)):
            if out.finish_reason == "error":
                raise Internal(f"generation failed (request_id={rid}): {out.error}")
            choice = choices[out.index]
            cached = max(cached, out.num_cached_tokens)
            if choice.done:
                continue                # ended by a stop string: the engine's later tokens are not the choice's
            msg = choice.delta(out)
            # A stop string ends the count at the token that completed it, even inside a speculative run.
            completion[out.index] = choice.num_tokens if choice.stopped_by_string else out.num_completion_tokens
            if out.first:               # the choice's first message says what its prompt was
                msg = msg or decoder_pb2.GenerateResponse(index=out.index)
                # Spelling a long prompt's tokens and alternatives is off the event loop, as tokenizing it was.
                info = prompt_info(out, prompt, st.tokenizer) if out.prompt_logprobs is None else \
                    await asyncio.to_thread(prompt_info, out, prompt, st.tokenizer)
                msg.prompt.CopyFrom(info)
            if msg is None:
                continue
            now = time.monotonic()
            if msg.token_ids:
                (_TTFT.observe(now - start) if first else _ITL.observe(now - last))
                first, last = False, now
            if choice.stopped_by_string and not out.finished:
                st.engine.finish(rid, out.index)
            if msg.finish_reason:
                _REQUESTS.labels(decoder_pb2.FinishReason.Name(msg.finish_reason)).inc()
            yield msg
        yield decoder_pb2.GenerateResponse(usage=common_pb2.Usage(
            prompt_tokens=len(prompt), completion_tokens=sum(completion),
            total_tokens=len(prompt) + sum(completion), cached_tokens=cached))

    @staticmethod
    async def _grammar(st: Loaded, spec: GrammarSpec) -> Grammar:
        start = time.monotonic()
        hit = False
        try:
            grammar, hit = await st.grammars.lookup(spec)
            return grammar
        finally:
            _GRAMMARS.labels("hit" if hit else "miss").inc()
            _GRAMMAR_WAIT.observe(time.monotonic() - start)

    @grpc_errors
    async def GetModelInfo(self, request, context):
        st = self._ready()
        s = st.engine.stats()
        return decoder_pb2.GetModelInfoResponse(
            name=st.name, max_model_len=st.engine_config.max_model_len, vocab_size=st.info.vocab_size,
            eos_token_ids=list(st.engine_config.eos_token_ids), has_chat_template=st.template is not None,
            supports_images=st.info.model.vision is not None, block_size=st.engine_config.block_size,
            dtype=self.cfg.dtype,
            lora_backend=st.info.lora_backend, execution_plan=st.info.plan.to_proto(),
            speculative_decoding=_speculative(st.engine_config.speculative),
            tool_call_parser=self.cfg.tool_call_parser, quantization=st.info.quantization,
            max_loras=self.cfg.max_loras if st.adapters else 0, max_lora_rank=self.cfg.max_lora_rank,
            lora_on_demand=bool(st.adapters) and self.cfg.lora_on_demand,
            limits=self._limits(st).to_proto(),
            stats=decoder_pb2.EngineStats(
                free_blocks=s.num_free_blocks, total_blocks=s.num_total_blocks, running=s.num_running,
                waiting=s.num_waiting, preemptions=s.num_preemptions, prefix_queries=s.prefix_queries,
                prefix_hits=s.prefix_hits,
                adapter_refs=st.adapters.registry.total_refs if st.adapters else 0,
                draft_tokens=s.num_draft_tokens, accepted_tokens=s.num_accepted_tokens,
                verifications=s.num_verifications))

    @grpc_errors
    async def Tokenize(self, request, context):
        """The ids Generate would run: the same tokenizer, and for chat the same template call."""
        st = self._ready()
        self._check_model(st, request.model)
        if request.adapter:
            # It must exist (or, loaded on demand, be found); it tokenizes as its base.
            self._lora(st, request.adapter).on_demand.check(request.adapter)
        kind = request.WhichOneof("prompt")
        if kind == "text":
            ids = st.tokenizer.encode(request.text, add_special_tokens=request.add_special_tokens)
        elif kind == "chat":
            # An image's length is its grid after merge, known only from the vision service's answer.
            if any(p.WhichOneof("kind") == "image_index" for m in request.chat.messages for p in m.content):
                raise InvalidArgument("image parts cannot be tokenized: their token count depends on the "
                                      "image's grid; send the conversation's text parts only", param="messages")
            ids = self._chat_ids(st, request.chat, request.add_special_tokens)
        else:
            raise InvalidArgument("a prompt (text or messages) is required", param="prompt")
        strs = [st.tokenizer.id_to_token(i) or "" for i in ids] if request.return_token_strs else []
        return decoder_pb2.TokenizeResponse(token_ids=ids, max_model_len=st.engine_config.max_model_len,
                                            token_strs=strs)

    @grpc_errors
    async def Detokenize(self, request, context):
        st = self._ready()
        self._check_model(st, request.model)
        if request.adapter:
            self._lora(st, request.adapter).on_demand.check(request.adapter)
        ids = st.tokenizer.validate_ids(list(request.token_ids), limit=st.info.vocab_size, param="token_ids")
        return decoder_pb2.DetokenizeResponse(text=st.tokenizer.decode(ids, skip_special_tokens=False))

    # -- adapters (services/decoder/server/adapters.py) ------------------------------------

    @staticmethod
    def _lora(st: Loaded, adapter: str = "") -> Adapters:
        """The adapters; without LoRA a request naming `adapter` is a 404, an admin call a 400."""
        if st.adapters is None:
            if adapter:
                raise AdapterNotFound(f"adapter {adapter!r} is not loaded (LoRA is disabled: --max-loras 0)",
                                      param="model")
            raise Unsupported("LoRA is disabled on this decoder (started with --max-loras 0)", param="lora_name")
        return st.adapters

    @grpc_errors
    async def ListAdapters(self, request, context):
        st = self._ready()
        listed = await st.engine.call(st.adapters.registry.list) if st.adapters else []
        return decoder_pb2.ListAdaptersResponse(base_model=st.name, adapters=[adapter_info(a) for a in listed])

    @grpc_errors
    async def LoadAdapter(self, request, context):
        """Validate the folder fully off the engine thread, then register it there (between steps)."""
        st = self._ready()
        adapters = self._lora(st)
        check_name(request.name)
        if request.name == st.name:
            raise InvalidArgument(f"adapter name {request.name!r} is the base model's name", param="lora_name")
        folder = adapters.resolve_path(request.path)
        weights = await compute.in_own_thread(adapters.read, folder)

        def register():
            status = adapters.registry.register(request.name, weights)
            adapters.on_demand.forget(request.name)     # the operator's now: never evicted
            adapters.export_registry()
            return status
        status = await st.engine.call(register)
        log.info("loaded adapter %s from %s: rank %d on %s, slot %d, digest %s", status.name, request.path,
                 status.rank, ",".join(status.targets), status.slot, status.digest[:12])
        return decoder_pb2.LoadAdapterResponse(adapter=adapter_info(status))

    @grpc_errors
    async def UnloadAdapter(self, request, context):
        st = self._ready()
        adapters = self._lora(st)

        def unregister():
            adapters.registry.unregister(request.name)
            adapters.export_registry()
        await st.engine.call(unregister)
        log.info("unloaded adapter %s", request.name)
        return decoder_pb2.UnloadAdapterResponse()


async def start(server_cfg: DecoderServerConfig, cfg: DecoderConfig) -> tuple[Server, DecoderServicer]:
    """Start the server (NOT_SERVING), load the model off the loop, then report SERVING."""
    servicer = DecoderServicer(cfg)
    server = Server(server_cfg, lambda s: decoder_pb2_grpc.add_DecoderServiceServicer_to_server(servicer, s),
                    [SERVICE_NAME])
    await server.start()
    try:
        state = await compute.in_own_thread(load, cfg)   # its OpenMP team leaves with it (services/common/compute.py)
    except BaseException:
        await server.stop(0)    # a model that cannot be served: unbind before the error ends the process
        raise
    # A dead engine must not look healthy to a load balancer.
    state.engine.on_failure = lambda reason: asyncio.ensure_future(server.set_serving(False))
    state.engine.start()
    servicer.state = state
    await server.ready()
    return server, servicer


async def launch(server_cfg: DecoderServerConfig, cfg: DecoderConfig) -> Started:
    """`start` for the shared process start-up (services/common/process.py): closing stops the engine and
    the grammar compiler once the server has drained."""
    server, servicer = await start(server_cfg, cfg)

    async def close() -> None:
        if not servicer.close():
            # A written-off compile is still inside xgrammar's C++, and exiting under it aborts the process
            # (services/decoder/grammar/pool.py): the server has drained, so leave without destructors.
            log.warning("a structured-output compile is still running at exit; exiting without cleanup")
            logging.shutdown()
            os._exit(0)
    return Started(server, close)
