"""What /v1/completions and /v1/chat/completions share: sampling fields, the decoder calls, choices, usage.

A request becomes one decoder Generate call per prompt (completions fans a list of prompts out).
`Generation.start` waits for every call's first message, so a refused request is a plain HTTP error
before any byte of the answer is sent; after that the calls' messages arrive merged, as
(prompt index, GenerateResponse). Choice `j` of prompt `i` is choice `i * n + j` of the answer, as
OpenAI numbers them. Closing a Generation cancels every call still running, which makes the decoder
abort those requests and free their KV blocks.

The merged messages wait in a queue of at most QUEUE_PER_CALL per call. When the reader falls behind (a client
that reads slowly, or not at all, until gateway/limits.py's send timeout) the calls' pumps wait on the full
queue and stop reading their gRPC streams, so HTTP/2 flow control pushes back on the decoder instead of the
gateway buffering everything it generates. Pumps only put and the reader only gets, so a full queue can
delay a call but never deadlock: the reader frees a place with every message it takes.

Each call goes to a replica chosen by gateway/routing.py; a replica that answers UNAVAILABLE before the
call's first message is replaced by the next candidate, and after the first message nothing is retried.

Each call gets its own decoder request id, `<HTTP request id>-<random>`: the HTTP id may come from the
caller (x-request-id), and two live calls under one id would collide in the engine.
"""
from __future__ import annotations

import asyncio
import logging
import re
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Annotated

from pydantic import Field, field_validator, model_validator

from services.common.errors import Internal, TesseraError, Unavailable
from services.common.pb import decoder_pb2

from .backends import GENERATION, Backend
from .counts import check_counts
from .routes.common import INT32_MAX, INT32_MIN, INT64_MAX, INT64_MIN, StrictBody
from .routing import Route, prefix_key
from .structured_output import DECODER_PARAM, StructuredFields

log = logging.getLogger("tessera.gateway.generation")

UINT64_MAX = 2**64 - 1
_TOKEN_ID = re.compile(r"-?[0-9]{1,19}")
# Messages (about one token of one choice each) held per call between the decoder and the HTTP response.
QUEUE_PER_CALL = 16
FINISH_REASONS = {decoder_pb2.FINISH_REASON_STOP: "stop", decoder_pb2.FINISH_REASON_LENGTH: "length",
                  decoder_pb2.FINISH_REASON_ABORT: "abort"}


class StreamOptions(StrictBody):
    include_usage: bool = Field(False, description="end the stream with a chunk carrying usage (choices: [])")


class SamplingFields(StructuredFields):
    """The request fields both generation endpoints take; ranges are judged by the decoder (one rule book).
    The structured-output fields come from gateway/structured_output.py."""

    model: str | None = Field(None, description="a model from /v1/models; omitted: the served language model")
    n: int = Field(1, ge=1, le=INT32_MAX, description="choices per prompt (the decoder's --max-n bounds it)")
    temperature: float | None = Field(None, description="0 is greedy; omitted: 1")
    top_p: float | None = Field(None, description="nucleus mass in (0, 1]; omitted: 1")
    seed: int | None = Field(None, ge=0, le=UINT64_MAX, description="makes sampling reproducible")
    stop: str | list[str] | None = Field(None, description="up to 16 strings of at most 256 characters;"
                                                           " the text ends before the first one generated")
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = Field(
        None, description="token id (as a string, OpenAI's JSON) -> bias in [-100, 100] added to its logit"
                          " before penalties and temperature")
    # vLLM's extra sampling fields (the openai client sends them through extra_body).
    top_k: int | None = Field(None, ge=INT32_MIN, le=INT32_MAX, description="keep the k most likely tokens;"
                                                                            " 0 or -1 disables it (vLLM)")
    min_p: float | None = Field(None, description="in [0, 1]: drop tokens less likely than min_p times the"
                                                  " most likely one; omitted or 0: disabled")
    repetition_penalty: float | None = Field(None, description="> 0, over prompt and generated tokens: positive"
                                                               " logits divided, negative multiplied; 1: off")
    min_tokens: int = Field(0, ge=INT32_MIN, le=INT32_MAX,
                            description="EOS, stop_token_ids and stop strings cannot end a choice before this"
                                        " many tokens; at most max_tokens")
    stop_token_ids: list[Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)]] | None = Field(
        None, description="token ids that end a choice like EOS (the id is counted, not shown)")
    ignore_eos: bool = Field(False, description="vLLM's: the model's EOS does not end a choice (as benchmarks"
                                                " send it); max_tokens, stop strings and stop_token_ids still do")
    cache_salt: str | None = Field(None, min_length=1, max_length=256,
                                   description="vLLM's: requests with different salts never share prefix-cache"
                                               " blocks, so usage.prompt_tokens_details.cached_tokens says nothing"
                                               " about another salt's prompts (give each tenant its own)")
    stream: bool = Field(False, description="answer as server-sent events, ending with `data: [DONE]`")
    stream_options: StreamOptions | None = None
    # Accepted because their only correct effect is none; anything that would ask for more is refused.
    user: str | None = Field(None, description="accepted for OpenAI compatibility; not used")
    store: bool | None = Field(None, description="only false: tessera stores no completions")
    metadata: dict[str, str] | None = Field(None, description="accepted for OpenAI compatibility and ignored"
                                                              " (nothing is stored): at most 16 pairs, keys"
                                                              " up to 64 and values up to 512 characters")
    service_tier: str | None = Field(None, description="only auto: tessera has one tier")
    prompt_logprobs: int | None = Field(None, ge=INT32_MIN, le=INT32_MAX,
                                        description="vLLM's: every prompt token's logprob and this many top"
                                                    " alternatives (one dict per prompt token, the first null),"
                                                    " from one forward over the prompt; such a prompt is not"
                                                    " served from the prefix cache")

    @model_validator(mode="before")
    @classmethod
    def _counted(cls, data):
        return check_counts(data, GENERATION)    # before anything is validated (gateway/counts.py)

    @model_validator(mode="after")
    def _options_need_stream(self):
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        return self

    @field_validator("logit_bias")
    @classmethod
    def _token_keys(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        # The keys become int64 map keys; their range against the vocabulary is the decoder's to judge.
        for key in value or {}:
            if not _TOKEN_ID.fullmatch(key) or not INT64_MIN <= int(key) <= INT64_MAX:
                raise ValueError(f"keys must be token ids (integers written as strings), got {key!r}")
        return value

    @field_validator("store")
    @classmethod
    def _nothing_stored(cls, value: bool | None) -> bool | None:
        if value:
            raise ValueError("store: true is not supported: tessera keeps no completions (send false or omit it)")
        return value

    @field_validator("metadata")
    @classmethod
    def _metadata_limits(cls, value: dict[str, str] | None) -> dict[str, str] | None:
        # OpenAI's limits, so a program that works here also works there.
        if value is not None and (len(value) > 16 or any(len(k) > 64 or len(v) > 512 for k, v in value.items())):
            raise ValueError("at most 16 pairs, keys up to 64 and values up to 512 characters")
        return value

    @field_validator("service_tier")
    @classmethod
    def _one_tier(cls, value: str | None) -> str | None:
        if value is not None and value != "auto":
            raise ValueError(f"only 'auto' is supported (tessera has one service tier), got {value!r}")
        return value

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def sampling(self, max_tokens: int | None, logprobs: int | None,
                 prompt_logprobs: int | None = None) -> decoder_pb2.SamplingParams:
        """The decoder's SamplingParams; None leaves a field unset (the decoder's default). prompt_logprobs:
        what the decoder scores the prompt with (the body's field, or more for completions' echo)."""
        params = decoder_pb2.SamplingParams(
            n=self.n, stop=[self.stop] if isinstance(self.stop, str) else self.stop or [],
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            top_k=self.top_k or 0, min_tokens=self.min_tokens, stop_token_ids=self.stop_token_ids or [],
            ignore_eos=self.ignore_eos,
            logit_bias={int(k): v for k, v in (self.logit_bias or {}).items()})
        for name, value in (("temperature", self.temperature), ("top_p", self.top_p), ("seed", self.seed),
                            ("max_tokens", max_tokens), ("logprobs", logprobs), ("min_p", self.min_p),
                            ("repetition_penalty", self.repetition_penalty), ("prompt_logprobs", prompt_logprobs)):
            if value is not None:
                setattr(params, name, value)
        constraint = self.structured_output()
        if constraint is not None:
            params.structured_output.CopyFrom(constraint)
        return params

    def error_fields(self, fields: dict[str, str] | None = None) -> dict[str, str]:
        """fields plus the renaming of the decoder's structured_output param to the body field sent."""
        out = dict(fields or {})
        if self.constraint_field is not None:
            out[DECODER_PARAM] = self.constraint_field
        return out


def finish_reason(message: decoder_pb2.GenerateResponse) -> str | None:
    return FINISH_REASONS.get(message.finish_reason)


@dataclass
class Usage:
    """Token counts summed over a request's calls. A chat with images also says how many it sent and how many
    the vision service answered from its feature cache (prompt_tokens_details.images / .cached_images, beside
    OpenAI's cached_tokens, which counts prefix-cache hits)."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    images: int = 0
    cached_images: int = 0
    # Tokens seen in deltas: a call cancelled midway (its client left) never sends its usage.
    streamed: int = 0

    def add(self, usage) -> None:
        self.prompt_tokens += usage.prompt_tokens
        self.completion_tokens += usage.completion_tokens
        self.cached_tokens += usage.cached_tokens

    def spent(self) -> int:
        """Tokens to debit from the caller's token rate (gateway/limits.py): the prompt's and the completion's
        as reported, or the completion tokens seen so far where a call ended before reporting."""
        return self.prompt_tokens + max(self.completion_tokens, self.streamed)

    def to_json(self) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": self.cached_tokens,
                                          **({"images": self.images, "cached_images": self.cached_images}
                                             if self.images else {})}}


@dataclass
class Collected:
    """One whole choice: its text, its tokens' logprobs (decoder TokenLogprob) and why it ended."""

    text: list[str] = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    finish_reason: str | None = None


class Generation:
    """The Generate calls of one HTTP request, merged. Use: `await start()`, iterate, always `aclose()`."""

    def __init__(self, route: Route, requests: list[decoder_pb2.GenerateRequest], request_id: str,
                 n: int, fields: dict[str, str] | None = None):
        """route (gateway/routing.py): its candidates are tried in order while they answer UNAVAILABLE before
        their first message."""
        self.n = n
        self.usage = Usage()
        for request in requests:
            request.request_id = f"{request_id}-{uuid.uuid4().hex[:12]}"
        self._requests = requests
        self._route = route
        self._request_id = request_id
        self._fields = fields
        self._streams: list = []   # every stream opened, so aclose cancels each
        self._queue: asyncio.Queue = asyncio.Queue(maxsize=QUEUE_PER_CALL * len(requests))
        self._tasks: list[asyncio.Task] = []
        # Choice index -> what the decoder said of its prompt (PromptInfo: counts, prompt logprobs), from the
        # choice's first message; every call's first choice has it once start() returns.
        self.prompts: dict[int, decoder_pb2.PromptInfo] = {}

    @property
    def num_choices(self) -> int:
        return len(self._requests) * self.n

    def _open(self, backend: Backend, request: decoder_pb2.GenerateRequest):
        stream = backend.stream(backend.decoder.Generate, request, self._request_id, self._fields)
        self._streams.append(stream)
        return stream

    async def _first(self, request: decoder_pb2.GenerateRequest):
        """(first message or None, its stream): each candidate at most once while it answers UNAVAILABLE
        before its first message, which is when a retry cannot duplicate or lose any output."""
        key = prefix_key(request)
        candidates = await self._route.candidates(key)
        for i, backend in enumerate(candidates):
            stream = self._open(backend, request)
            try:
                first = await anext(stream, None)
            except Unavailable as err:
                await stream.aclose()
                self._route.failed(backend)
                if i + 1 == len(candidates):
                    raise
                log.warning("%s before the first token (request_id=%s); retrying on %s", err.message,
                            request.request_id, candidates[i + 1].label)
                continue
            self._route.answered(backend, key)
            return first, stream
        raise Internal("no decoder replica to call")  # unreachable: candidates is never empty

    async def start(self) -> None:
        """Wait for every call's first message; if any call is refused, cancel the rest and raise its error."""
        try:
            opened = await asyncio.gather(*(self._first(r) for r in self._requests), return_exceptions=True)
        except asyncio.CancelledError:
            await self.aclose()
            raise
        failed = next((f for f in opened if isinstance(f, BaseException)), None)
        if failed is not None:
            await self.aclose()
            raise failed
        for i, (first, _) in enumerate(opened):
            self._note_prompt(i, first)
        self._tasks = [asyncio.create_task(self._pump(i, first, stream))
                       for i, (first, stream) in enumerate(opened)]

    def _note_prompt(self, prompt: int, message) -> None:
        if message is not None and message.HasField("prompt"):
            self.prompts.setdefault(prompt * self.n + message.index, message.prompt)

    async def _pump(self, prompt: int, first, stream) -> None:
        try:
            if first is None:
                raise Internal("the decoder ended a generation without answering")
            await self._queue.put((prompt, first))
            async for message in stream:
                await self._queue.put((prompt, message))
            await self._queue.put((prompt, None))
        except TesseraError as err:
            await self._queue.put((prompt, err))

    async def __aiter__(self) -> AsyncIterator[tuple[int, decoder_pb2.GenerateResponse]]:
        """(choice index, delta) for each delta; usage messages are summed into self.usage and prompt reports
        kept in self.prompts, not yielded."""
        live = len(self._tasks)
        while live:
            prompt, item = await self._queue.get()
            if item is None:
                live -= 1
            elif isinstance(item, TesseraError):
                raise item
            else:
                self.usage.streamed += len(item.token_ids)
                self._note_prompt(prompt, item)
                if item.HasField("usage"):
                    self.usage.add(item.usage)
                if not (item.token_ids or item.text or item.finish_reason or item.logprobs):
                    continue  # the call's closing message (usage only), or a choice's prompt report alone
                yield prompt * self.n + item.index, item

    async def collect(self) -> list[Collected]:
        """Every choice whole (the non-streaming answer)."""
        choices = [Collected() for _ in range(self.num_choices)]
        async for index, delta in self:
            choice = choices[index]
            choice.text.append(delta.text)
            choice.logprobs.extend(delta.logprobs)
            choice.finish_reason = finish_reason(delta) or choice.finish_reason
        return choices

    async def aclose(self) -> None:
        """Cancel whatever still runs (a no-op for calls that ended)."""
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for stream in self._streams:
            await stream.aclose()
