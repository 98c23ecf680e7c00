"""The decoder's rulebook: every semantic rule a request must meet, and the numbers behind them.

    limits = Limits.of(cfg, max_model_len)        # published as GetModelInfoResponse.limits
    check_messages(chat)                          # roles and tool calls, before the template renders
    check_images(len(request.images), limits)     # before the rows are decoded
    check_tools(len(tools), limits)               # once tools_json is parsed, before the template renders
    check_prompt(prompt_ids, limits)              # after rendering and image expansion
    check_constraint_size(so, limits)             # a structured output's text, before it is parsed
    params, include_stop = sampling_params(request.sampling, prompt_len=..., vocab_size=..., limits=limits)

Callers in front of the decoder check JSON shape and their own size limits only; whatever needs the
model's meaning (ranges, roles, lengths) is judged here, so a rule has one wording and one error kind
wherever it is hit. A caller that must check early, before spending work elsewhere (the gateway, before
it sends images to the vision service), reads these numbers from GetModelInfo rather than keeping
defaults of its own (docs/design.md, invariant 11). Every refusal is a TesseraError naming the request's field
(param), which the server turns into its gRPC status; nothing here touches the engine.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from services.common.errors import ContextLengthExceeded, InvalidArgument, TooLarge
from services.common.pb import decoder_pb2
from services.decoder.engine.step import SamplingParams
from services.decoder.text.stop import MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS, validate_stop_strings

MAX_TEMPERATURE = 100.0
MAX_PENALTY = 2.0
MAX_LOGIT_BIAS = 100.0    # OpenAI's range: -100 bans a token, 100 makes it all but certain
IMAGES_PARAM = "images"
CONSTRAINT_PARAM = "structured_output"    # services.decoder.grammar.spec.PARAM (that package imports xgrammar)


@dataclass(frozen=True)
class Limits:
    """The numbers of the rules (RequestLimits in decoder.proto); one per rule, for the whole fleet."""

    max_images: int          # images in one request
    max_image_bytes: int     # one compressed image; enforced where the bytes are (gateway, vision)
    max_n: int               # choices per request
    max_logprobs: int        # top alternatives per token
    max_model_len: int       # prompt + output tokens
    max_stop_strings: int = MAX_STOP_STRINGS
    max_stop_string_chars: int = MAX_STOP_STRING_CHARS
    # UTF-8 bytes of a structured output's text. Checked here only, before anything parses it (not
    # published: the gateway has no earlier work to save, it forwards the text as it came).
    max_schema_bytes: int = 128 * 1024      # a JSON schema (response_format's, or the tools' forced call)
    max_regex_bytes: int = 8 * 1024
    max_grammar_bytes: int = 64 * 1024      # an EBNF grammar, or a choice list (its strings together)
    max_tools: int = 128     # tools in one chat request
    max_logit_bias: int = 1024   # logit_bias entries

    @classmethod
    def of(cls, cfg, max_model_len: int) -> Limits:
        """The limits a DecoderConfig sets, for an engine whose context is max_model_len tokens."""
        return cls(max_images=cfg.max_images, max_image_bytes=cfg.max_image_bytes, max_n=cfg.max_n,
                   max_logprobs=cfg.max_logprobs, max_model_len=max_model_len, max_tools=cfg.max_tools,
                   max_logit_bias=cfg.max_logit_bias, max_schema_bytes=cfg.max_schema_bytes,
                   max_regex_bytes=cfg.max_regex_bytes, max_grammar_bytes=cfg.max_grammar_bytes)

    def to_proto(self) -> decoder_pb2.RequestLimits:
        return decoder_pb2.RequestLimits(
            max_images=self.max_images, max_image_bytes=self.max_image_bytes, max_n=self.max_n,
            max_logprobs=self.max_logprobs, max_model_len=self.max_model_len,
            max_stop_strings=self.max_stop_strings, max_stop_string_chars=self.max_stop_string_chars,
            max_tools=self.max_tools, max_logit_bias=self.max_logit_bias)


# -- prompt and images --------------------------------------------------------------------------------

def check_images(given: int, limits: Limits) -> None:
    """At most limits.max_images images. Past it: TooLarge (413), the kind every tier answers a
    count over its bound with (docs/api.md, errors)."""
    if given > limits.max_images:
        raise TooLarge(f"{given} images in one request; at most {limits.max_images} per request", param=IMAGES_PARAM)


def check_prompt(prompt: list[int], limits: Limits) -> None:
    """A prompt (after rendering and image expansion) that leaves room for at least one output token."""
    if not prompt:
        raise InvalidArgument("the prompt is empty", param="prompt")
    if len(prompt) >= limits.max_model_len:
        raise ContextLengthExceeded(f"the prompt has {len(prompt)} tokens; the maximum context length is "
                                    f"{limits.max_model_len}", param="prompt")


def check_constraint_size(so, limits: Limits) -> None:
    """A decoder_pb2.StructuredOutput's text within its kind's byte limit, checked before it is parsed or
    compiled. Past it: TooLarge (413) naming structured_output (the gateway renames it to the field sent:
    response_format, structured_outputs or tools). A small text can still compile slowly: the compile
    deadline (--grammar-compile-timeout-s) bounds that."""
    kind = so.WhichOneof("kind")
    if kind == "json_schema":
        size, limit, what, flag = len(so.json_schema.encode()), limits.max_schema_bytes, "JSON schema", "schema"
    elif kind == "regex":
        size, limit, what, flag = len(so.regex.encode()), limits.max_regex_bytes, "regex", "regex"
    elif kind == "grammar":
        size, limit, what, flag = len(so.grammar.encode()), limits.max_grammar_bytes, "grammar", "grammar"
    elif kind == "choice":
        size = sum(len(c.encode()) for c in so.choice.choices)
        limit, what, flag = limits.max_grammar_bytes, "choice list", "grammar"
    else:
        return
    if size > limit:
        raise TooLarge(f"the {what} has {size} bytes; structured outputs take at most {limit} "
                       f"(the decoder's --max-{flag}-bytes)", param=CONSTRAINT_PARAM)


def check_tools(given: int, limits: Limits) -> None:
    """At most limits.max_tools tools in one chat request; past it TooLarge, as for images."""
    if given > limits.max_tools:
        raise TooLarge(f"{given} tools in one request; at most {limits.max_tools} per request", param="tools")


# -- messages -----------------------------------------------------------------------------------------

def check_messages(chat) -> None:
    """The role rules of a decoder_pb2.ChatMessages (OpenAI's), each refused with param messages:
    tool_calls only on assistant messages; tool_call_id on tool messages only, and required there;
    content required except on an assistant message with tool_calls; each tool message answers a call
    an earlier assistant message made. Roles and content beyond these are the template's to judge."""
    if not chat.messages:
        raise InvalidArgument("messages must not be empty", param="messages")
    made: set[str] = set()
    for i, m in enumerate(chat.messages):
        where = f"messages[{i}]"
        if m.tool_calls and m.role != "assistant":
            raise InvalidArgument(f"{where}: only assistant messages carry tool_calls", param="messages")
        if m.role == "tool" and not m.tool_call_id:
            raise InvalidArgument(f"{where}: tool messages need a tool_call_id (the id of the call they answer)",
                                  param="messages")
        if m.tool_call_id and m.role != "tool":
            raise InvalidArgument(f"{where}: only tool messages carry tool_call_id", param="messages")
        if not m.content and not m.tool_calls:
            raise InvalidArgument(f"{where}: content is required (it may be omitted only on an assistant message"
                                  f" with tool_calls)", param="messages")
        made.update(call.id for call in m.tool_calls)
        if m.role == "tool" and m.tool_call_id not in made:
            raise InvalidArgument(f"{where}: tool_call_id {m.tool_call_id!r} answers no tool call of an earlier"
                                  f" assistant message", param="messages")


# -- sampling -----------------------------------------------------------------------------------------

def _finite(value: float, name: str) -> float:
    if not math.isfinite(value):
        raise InvalidArgument(f"{name} must be a finite number", param=name)
    return value


def sampling_params(msg, *, prompt_len: int, vocab_size: int, limits: Limits) -> tuple[SamplingParams, bool]:
    """(SamplingParams, include_stop_str_in_output) from a decoder_pb2.SamplingParams, every range checked.

    Unset max_tokens means "up to the context length" (at least 1); 0 only with prompt_logprobs. The engine
    and the sampler trust what this returns: their own checks are assertions, not a second rulebook.
    """
    temperature = _finite(msg.temperature, "temperature") if msg.HasField("temperature") else 1.0
    if not 0.0 <= temperature <= MAX_TEMPERATURE:
        raise InvalidArgument(f"temperature must be in [0, {MAX_TEMPERATURE:g}], got {temperature:g}",
                              param="temperature")
    top_p = _finite(msg.top_p, "top_p") if msg.HasField("top_p") else 1.0
    if not 0.0 < top_p <= 1.0:
        raise InvalidArgument(f"top_p must be in (0, 1], got {top_p:g}", param="top_p")
    # vLLM's convention: 0 and -1 both disable top-k.
    if msg.top_k < -1:
        raise InvalidArgument(f"top_k must be -1, 0 (both disable it) or positive, got {msg.top_k}", param="top_k")
    min_p = _finite(msg.min_p, "min_p") if msg.HasField("min_p") else 0.0
    if not 0.0 <= min_p <= 1.0:
        raise InvalidArgument(f"min_p must be in [0, 1], got {min_p:g}", param="min_p")
    repetition = _finite(msg.repetition_penalty, "repetition_penalty") if msg.HasField("repetition_penalty") \
        else 1.0
    if not repetition > 0.0:
        raise InvalidArgument(f"repetition_penalty must be > 0 (1 disables it), got {repetition:g}",
                              param="repetition_penalty")
    n = msg.n if msg.HasField("n") else 1
    if not 1 <= n <= limits.max_n:
        raise InvalidArgument(f"n must be between 1 and {limits.max_n}, got {n}", param="n")
    logprobs, prompt_logprobs = None, None
    for name in ("logprobs", "prompt_logprobs"):
        if msg.HasField(name):
            value = getattr(msg, name)
            if not 0 <= value <= limits.max_logprobs:
                raise InvalidArgument(f"{name} must be between 0 and {limits.max_logprobs}, got {value}", param=name)
            if name == "logprobs":
                logprobs = value
            else:
                prompt_logprobs = value
    if msg.HasField("max_tokens"):
        max_tokens = msg.max_tokens
        # A scored prompt may generate nothing (lm-evaluation-harness's log-likelihood request).
        least = 0 if prompt_logprobs is not None else 1
        if max_tokens < least:
            raise InvalidArgument(f"max_tokens must be at least {least}"
                                  f"{'' if least else ' (0 only with prompt_logprobs)'}, got {max_tokens}",
                                  param="max_tokens")
    else:
        max_tokens = max(1, limits.max_model_len - prompt_len)
    for name in ("presence_penalty", "frequency_penalty"):
        value = _finite(getattr(msg, name), name)
        if not -MAX_PENALTY <= value <= MAX_PENALTY:
            raise InvalidArgument(f"{name} must be in [-2, 2], got {value:g}", param=name)
    stop_ids = tuple(int(t) for t in msg.stop_token_ids)
    if any(not 0 <= t < vocab_size for t in stop_ids):
        raise InvalidArgument(f"stop_token_ids must be in [0, {vocab_size})", param="stop_token_ids")
    if not 0 <= msg.min_tokens <= max_tokens:
        raise InvalidArgument(f"min_tokens must be between 0 and max_tokens ({max_tokens}), got {msg.min_tokens}",
                              param="min_tokens")
    params = SamplingParams(
        temperature=temperature, top_p=top_p, top_k=max(msg.top_k, 0), min_p=min_p,
        seed=msg.seed if msg.HasField("seed") else None, max_tokens=max_tokens,
        stop=validate_stop_strings(list(msg.stop)), stop_token_ids=stop_ids, n=n, logprobs=logprobs,
        presence_penalty=msg.presence_penalty, frequency_penalty=msg.frequency_penalty,
        ignore_eos=msg.ignore_eos, logit_bias=logit_bias(msg.logit_bias, vocab_size, limits.max_logit_bias),
        repetition_penalty=repetition, min_tokens=msg.min_tokens, prompt_logprobs=prompt_logprobs)
    return params, msg.include_stop_str_in_output


def logit_bias(entries, vocab_size: int, most: int | None = None) -> tuple[tuple[int, float], ...]:
    """The proto map -> sorted (id, bias) pairs; ids in [0, vocab_size), biases in [-100, 100]; at most `most`
    entries (limits.max_logit_bias; TooLarge past it, counted before any is read)."""
    if most is not None and len(entries) > most:
        raise TooLarge(f"logit_bias has {len(entries)} entries; at most {most} per request", param="logit_bias")
    out = []
    for token, bias in sorted(entries.items()):
        if not 0 <= token < vocab_size:
            raise InvalidArgument(f"logit_bias: token id {token} is outside the vocabulary [0, {vocab_size})",
                                  param="logit_bias")
        if not -MAX_LOGIT_BIAS <= _finite(bias, "logit_bias") <= MAX_LOGIT_BIAS:
            raise InvalidArgument(f"logit_bias: the bias of token {token} must be in [-100, 100], got {bias:g}",
                                  param="logit_bias")
        out.append((int(token), float(bias)))
    return tuple(out)
