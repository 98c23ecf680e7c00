"""One choice's text stream: detokenise new tokens, cut at stop strings, build deltas; and the prompt's report."""
from __future__ import annotations

from collections.abc import Sequence

from services.common.pb import decoder_pb2
from services.decoder.engine.output import RequestOutput
from services.decoder.text.detokenizer import IncrementalDetokenizer
from services.decoder.text.stop import StopMatcher
from services.decoder.text.tokenizer import Tokenizer

FINISH = {"stop": decoder_pb2.FINISH_REASON_STOP, "length": decoder_pb2.FINISH_REASON_LENGTH,
          "abort": decoder_pb2.FINISH_REASON_ABORT}


class Choice:
    """Text state of choice `index`. done: nothing more will be sent for it. num_tokens: the tokens
    sent so far (with a stop string, up to the one that completed it: what usage counts)."""

    def __init__(self, index: int, tokenizer: Tokenizer, stop: tuple[str, ...], include_stop: bool,
                 want_logprobs: bool, min_tokens: int = 0):
        self.index = index
        # Stop strings are judged only in text that arrives once more than min_tokens tokens exist.
        self.min_tokens = min_tokens
        self.num_tokens = 0
        self.tokenizer = tokenizer
        self.detok = IncrementalDetokenizer(tokenizer)
        self.matcher = StopMatcher(stop, include_stop)
        self.want_logprobs = want_logprobs
        self.done = False
        self.stopped_by_string = False

    def delta(self, out: RequestOutput) -> decoder_pb2.GenerateResponse | None:
        """The message for one engine output, or None when there is nothing to send."""
        if self.done:
            return None
        tokens = out.new_tokens
        # The eos / stop token that ended the choice is counted but not shown as text.
        text_tokens = tokens[:-1] if out.stop_token_id is not None and tokens else tokens
        # One token at a time: in a run of several (speculative decoding), a stop string ends the
        # choice at the token that completed it, and the tokens after it are neither sent nor counted.
        text, stopped = "", False
        for k, t in enumerate(text_tokens):
            self.num_tokens += 1
            result = self.matcher.feed(self.detok.add([t.token_id]), judge=self.num_tokens > self.min_tokens)
            text += result.text
            if result.stop is not None:
                tokens, stopped = tokens[:k + 1], True
                break
        else:
            self.num_tokens += len(tokens) - len(text_tokens)
        reason = None
        if stopped:
            self.stopped_by_string = True
            reason = decoder_pb2.FINISH_REASON_STOP
        elif out.finished:
            text += self.matcher.feed(self.detok.finish(), judge=self.num_tokens > self.min_tokens).text
            text += self.matcher.flush()
            reason = FINISH[out.finish_reason]
        msg = decoder_pb2.GenerateResponse(index=self.index, token_ids=[t.token_id for t in tokens], text=text)
        if self.want_logprobs:
            msg.logprobs.extend(self._logprobs(tokens))
        if reason is not None:
            msg.finish_reason = reason
            self.done = True
        if not (msg.token_ids or msg.text or reason is not None):
            return None
        return msg

    def _logprobs(self, tokens) -> list[decoder_pb2.TokenLogprob]:
        decode = self.tokenizer.decode
        return [decoder_pb2.TokenLogprob(
            token_id=t.token_id, token=decode([t.token_id], skip_special_tokens=False),
            logprob=t.logprob if t.logprob is not None else 0.0,
            top=[decoder_pb2.TopLogprob(token_id=i, token=decode([i], skip_special_tokens=False), logprob=lp)
                 for i, lp in (t.top_logprobs or [])]) for t in tokens]


def prompt_info(out: RequestOutput, prompt: Sequence[int], tokenizer: Tokenizer) -> decoder_pb2.PromptInfo:
    """What a choice's first message says of its prompt (out.first): the counts and, when the request asked,
    one TokenLogprob per prompt token (the first without a logprob: it has no context)."""
    info = decoder_pb2.PromptInfo(prompt_tokens=out.num_prompt_tokens, cached_tokens=out.num_cached_tokens)
    if out.prompt_logprobs is None:
        return info
    spelled: dict[int, str] = {}

    def token(i: int) -> str:
        text = spelled.get(i)
        if text is None:
            text = spelled[i] = tokenizer.decode([i], skip_special_tokens=False)
        return text

    info.logprobs.append(decoder_pb2.TokenLogprob(token_id=prompt[0], token=token(prompt[0])))
    info.logprobs.extend(decoder_pb2.TokenLogprob(
        token_id=e.token_id, token=token(e.token_id), logprob=e.logprob, rank=e.rank,
        top=[decoder_pb2.TopLogprob(token_id=i, token=token(i), logprob=lp) for i, lp in e.top])
        for e in out.prompt_logprobs[1:])
    return info
