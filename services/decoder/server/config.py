"""The decoder service's configuration: server, model, engine sizes and request limits."""
from __future__ import annotations

from dataclasses import dataclass

from services.common import dtypes
from services.common import plan as plan_mod
from services.common.config import option
from services.common.server import ServerConfig
from services.common.tool_parsers import HELP as TOOL_CALL_PARSERS_HELP
from services.common.tool_parsers import NAMES as TOOL_CALL_PARSERS
from services.decoder.engine.config import SpeculativeConfig

# Every variable this service reads is TESSERA_DECODER_<FLAG> (services/common/config.py).
ENV_PREFIX = "TESSERA_DECODER_"

# services.decoder.model.quantization.MODES/HELP (not imported: it imports torch).
QUANTIZATION_MODES = ("none", "int8", "int4")
QUANTIZATION_HELP = ("weight quantization of the projections and LM head: int8 keeps int8 weights with one "
                     "scale per output channel (a quarter of fp32's weight bytes, for batch-1 latency on CPU; "
                     "steps of up to 8 rows round the activations to int8 in blocks of 32, as llama.cpp's Q8_0, "
                     "larger ones to bf16 or to two int8 parts, by the matmul --fast-paths int8_gemm chose); "
                     "int4 keeps 4-bit codes with an fp16 scale and offset per group of 32 "
                     "inputs (5 bits a weight; few rows round the activations to int8 per group); none keeps the "
                     "--dtype weights")

# The projections an adapter may target (services.decoder.lora.weights.TARGETS; not
# imported here so reading the config never imports torch).
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class DecoderServerConfig(ServerConfig):
    """process and gRPC server options"""

    port: int = option(50052, "port to bind; 0 picks a free one")


@dataclass(frozen=True)
class DecoderConfig:
    """model and engine options"""

    model: str = option("", "HF model folder (config.json, safetensors, tokenizer.json), or a GGUF file "
                        "(FILE.gguf: llama or qwen2; F32, F16, BF16 and the Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, "
                        "Q5_K, Q6_K quantizations; docs/models.md)", metavar="PATH")
    tokenizer: str = option("", "HF tokenizer folder (tokenizer.json, tokenizer_config.json, chat template); "
                            "default: --model's folder, or for a GGUF file the tokenizer and chat template "
                            "in its metadata", metavar="DIR")
    served_model_name: str = option("", "name clients use in `model`; default: the folder's (or GGUF file's) "
                                    "name")
    dtype: str = option("fp32", "weights and KV dtype; float32, bfloat16 and float16 are accepted too (bf16 on a "
                        "CPU without AVX-512 bf16 support runs slower plain matmuls, logged at load)",
                        choices=dtypes.names())
    fast_paths: str = option("", plan_mod.help_for(plan_mod.DECODER), metavar="NAME=PATH,...")
    quantization: str = option("none", QUANTIZATION_HELP, choices=QUANTIZATION_MODES)
    matmul_precision: str = option("highest", dtypes.MATMUL_PRECISION_HELP,
                                   choices=dtypes.MATMUL_PRECISIONS)
    device: str = option("cpu", "torch device: cpu or cuda")
    block_size: int = option(16, "tokens per KV block")
    num_blocks: int = option(0, "KV blocks in the pool; 0 sizes it from --kv-cache-gb")
    kv_cache_gb: float = option(1.0, "KV cache memory in GiB when --num-blocks is 0")
    max_num_batched_tokens: int = option(2048, "token budget of one engine step (prefill chunk size)")
    max_num_seqs: int = option(64, "requests running at once")
    max_model_len: int = option(0, "longest prompt + output; 0 uses the model's max_position_embeddings")
    enable_prefix_caching: bool = option(True, "reuse KV blocks of identical prompt prefixes")
    max_n: int = option(16, "largest `n` (choices per request)")
    max_logprobs: int = option(20, "largest number of top logprobs per token (logprobs and prompt_logprobs)")
    seed: int = option(0, "base seed for unseeded sampling")
    fault_fail_at_step: int = option(0, "TESTING ONLY: make the forward of engine step N raise, to exercise "
                                        "failure handling (requests fail, health goes NOT_SERVING); 0 disables")
    max_images: int = option(8, "most images per request (vision-language models); more get 413")
    max_tools: int = option(128, "most tools in one chat request (OpenAI's limit); more get 413, from the gateway"
                                 " before it validates them (it reads the number from GetModelInfo)")
    max_logit_bias: int = option(1024, "most logit_bias entries in one request; more get 413, from the gateway"
                                       " before it validates them (it reads the number from GetModelInfo)")
    max_image_bytes: int = option(10 * 2**20, "largest compressed image per request, in bytes; the gateway reads it "
                                              "from GetModelInfo and refuses larger data: URIs with 413")
    # Structured outputs (services/decoder/grammar): compiled off the engine thread, cached by text.
    grammar_threads: int = option(2, "threads that compile structured-output grammars (JSON schema, regex, "
                                     "choice, EBNF) off the engine thread")
    grammar_cache_size: int = option(256, "compiled grammars kept at most (least recently used dropped first); "
                                          "--grammar-cache-mb bounds their bytes too")
    grammar_cache_mb: float = option(256.0, "MiB of compiled grammars kept at most (xgrammar's token-mask caches; "
                                            "least recently used dropped first; one larger alone is used, not "
                                            "kept)", metavar="MB")
    grammar_compile_timeout_s: float = option(10.0, "longest one grammar compile may run: past it the request gets"
                                                    " 400 naming its field, and the same constraint is refused at "
                                                    "once for 10 minutes; a compile not started within it (every "
                                                    "thread busy) gets 429", metavar="SECONDS")
    max_schema_bytes: int = option(128 * 1024, "largest JSON schema of a structured output (response_format, "
                                               "structured_outputs, a forced tool call's parameters), in UTF-8 "
                                               "bytes; larger gets 413")
    max_regex_bytes: int = option(8 * 1024, "largest structured-output regex, in UTF-8 bytes; larger gets 413")
    max_grammar_bytes: int = option(64 * 1024, "largest structured-output EBNF grammar, or choice list (its "
                                               "strings together), in UTF-8 bytes; larger gets 413")
    # Tool calls: "required" and a named function are forced by a grammar and need nothing here; "auto" (the
    # default with tools) parses the model's own call format, so the model's decoder names it (as vLLM does).
    enable_auto_tool_choice: bool = option(False, "accept tool_choice \"auto\" (the default with tools): the "
                                                  "gateway parses the model's own tool calls with --tool-call-parser;"
                                                  " the chat template must render tools")
    tool_call_parser: str = option("", f"the model's tool-call format, named as in vLLM: {TOOL_CALL_PARSERS_HELP};"
                                       f" needs --enable-auto-tool-choice", metavar="NAME")
    # LoRA adapters (services/decoder/lora). --max-loras 0 installs no adapter store at all; on CPU the
    # adapters live in a byte-budgeted pool (lora/pool.py), on CUDA in --max-loras fixed slots (lora/bank.py).
    max_loras: int = option(4, "0 disables LoRA. CUDA: adapter slots on the device, each padded to "
                               "--max-lora-rank: the most distinct adapters in one batch (a request whose "
                               "adapter has no slot waits in the queue for one). CPU: any value >= 1 only turns "
                               "LoRA on; adapters share the --lora-memory-gb pool, with no count per batch")
    max_lora_rank: int = option(16, "largest adapter rank; on CUDA every slot is padded to it, on CPU it only "
                                    "bounds ranks")
    lora_memory_gb: float = option(1.0, "CPU: GiB that resident adapters may take (each adapter costs its rank "
                                        "times (in + out) of every projection it covers, in the serving dtype; "
                                        "idle ones are evicted least recently used first when a request needs "
                                        "room; a request whose adapter finds no room waits in the queue). "
                                        "Unused on CUDA (--max-loras slots)", metavar="GB")
    max_cpu_loras: int = option(16, "most adapters registered at once (--lora, LoadAdapter, --lora-on-demand), "
                                    "their weights kept in host memory: past it a registration is refused, or "
                                    "an on-demand load evicts the least recently used idle on-demand adapter. "
                                    "CUDA: they take turns in the --max-loras slots, so it must be >= "
                                    "--max-loras; CPU: a registered adapter enters the --lora-memory-gb pool "
                                    "when a request needs it")
    lora_targets: tuple[str, ...] = option(LORA_TARGETS, "projections that can carry adapters (repeatable)",
                                           metavar="PROJ")
    lora_root: str = option("", "folder that LoadAdapter paths (and --lora-on-demand names) are confined to; "
                                "empty refuses runtime loads",
                            metavar="DIR")
    lora: tuple[str, ...] = option((), "preload an adapter at start: NAME=DIR (repeatable)", metavar="NAME=DIR")
    lora_on_demand: bool = option(False, "load an adapter that a request names and nobody registered from "
                                         "--lora-root/NAME on first use, as LoRAX and vLLM's filesystem resolver "
                                         "do: read off the engine thread, two at a time, while other requests "
                                         "run; with --max-cpu-loras registered, the least recently used idle "
                                         "adapter loaded this way is unregistered first (never a --lora or "
                                         "LoadAdapter one). Off by default: it lets every client, not only the "
                                         "admin, load any adapter folder under --lora-root")
    # Speculative decoding (services/decoder/engine/drafter.py), vLLM's flag and keys.
    speculative_config: str = option(
        "", 'n-gram (prompt lookup) speculative decoding as JSON, e.g. \'{"method": "ngram", '
            '"num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 1}\'; optional '
            '"disable_by_batch_size" (default 4): no drafts in a step with that many running requests. '
            'Empty: off', metavar="JSON")

    def __post_init__(self):
        plan_mod.Pins.parse(self.fast_paths, plan_mod.DECODER)   # a bad pin is a usage error at start
        if not self.model:
            raise ValueError("--model DIR is required")
        object.__setattr__(self, "dtype", dtypes.canonical(self.dtype))   # one spelling from here on
        for name in ("block_size", "max_num_batched_tokens", "max_num_seqs", "max_n", "max_images",
                     "max_image_bytes", "max_tools", "max_logit_bias", "grammar_threads", "grammar_cache_size",
                     "max_schema_bytes", "max_regex_bytes", "max_grammar_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1")
        for name in ("num_blocks", "max_model_len", "max_logprobs"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0")
        if self.kv_cache_gb <= 0:
            raise ValueError("kv_cache_gb must be positive")
        if not (self.grammar_cache_mb > 0 and self.grammar_compile_timeout_s > 0):
            raise ValueError("grammar_cache_mb and grammar_compile_timeout_s must be positive")
        self._check_lora()
        self._check_tools()
        if self.speculative_config.strip():
            SpeculativeConfig.from_json(self.speculative_config)    # a bad value is a usage error at start

    def _check_tools(self) -> None:
        if self.tool_call_parser and self.tool_call_parser not in TOOL_CALL_PARSERS:
            raise ValueError(f"tool_call_parser {self.tool_call_parser!r}: choose from {', '.join(TOOL_CALL_PARSERS)}")
        if self.enable_auto_tool_choice and not self.tool_call_parser:
            raise ValueError("enable_auto_tool_choice needs --tool-call-parser NAME (the model's tool-call format)")
        if self.tool_call_parser and not self.enable_auto_tool_choice:
            # Without it the parser would never be used: say so rather than start with a flag that does nothing.
            raise ValueError("tool_call_parser is used by tool_choice \"auto\" only: add --enable-auto-tool-choice")

    def _check_lora(self) -> None:
        if self.max_loras < 0 or self.max_lora_rank < 1:
            raise ValueError("max_loras must be >= 0 and max_lora_rank at least 1")
        if not self.lora_memory_gb > 0:
            raise ValueError("lora_memory_gb must be positive")
        # The CUDA bank's --max-loras slots are filled from the registry, so fewer registered adapters than
        # slots would leave slots no adapter can fill; the CPU pool has no slots (--max-loras only turns it on).
        if self.device.partition(":")[0] != "cpu" and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be at least max_loras ({self.max_loras}) "
                             f"on {self.device}: a slot for each")
        bad = sorted(set(self.lora_targets) - set(LORA_TARGETS))
        if bad or not self.lora_targets:
            raise ValueError(f"lora_targets {bad or '(empty)'}: choose from {', '.join(LORA_TARGETS)}")
        names = [item.partition("=")[0] for item in self.lora]
        if any("=" not in item or not n or not item.partition("=")[2] for item, n in zip(self.lora, names,
                                                                                     strict=True)):
            raise ValueError(f"lora: expected NAME=DIR, got {list(self.lora)}")
        if len(set(names)) != len(names):
            raise ValueError(f"lora: a name is given twice in {names}")
        if self.lora and not self.max_loras:
            raise ValueError("lora: preloading adapters needs --max-loras >= 1")
        if self.lora_on_demand and not (self.lora_root and self.max_loras):
            raise ValueError("lora_on_demand loads adapters from --lora-root DIR: set it, and --max-loras >= 1")

    @property
    def speculative(self) -> SpeculativeConfig | None:
        """The parsed --speculative-config, or None when it is off. ValueError on a bad value."""
        return SpeculativeConfig.from_json(self.speculative_config) if self.speculative_config.strip() else None

    @property
    def preload_adapters(self) -> list[tuple[str, str]]:
        """(name, folder) of every --lora NAME=DIR."""
        return [tuple(item.split("=", 1)) for item in self.lora]
