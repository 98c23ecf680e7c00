"""One choice's stream when the engine emits several tokens at once (a speculative run): a stop
string ends the choice at the token that completed it, and nothing after it is sent or counted."""
from __future__ import annotations

from services.common.pb import decoder_pb2
from services.decoder.engine.output import RequestOutput
from services.decoder.engine.step import SampledToken
from services.decoder.text.choice import Choice
from services.decoder.text.tokenizer import Tokenizer

TEXT = "The quick brown fox jumps over the lazy dog."


def _out(ids, finish=None):
    return RequestOutput("r", 0, new_tokens=[SampledToken(t, -0.5) for t in ids], finish_reason=finish)


def test_a_stop_string_inside_a_run_cuts_the_run_at_its_token(smollm2_dir):
    tok = Tokenizer.from_folder(smollm2_dir)
    ids = tok.encode(TEXT, add_special_tokens=False)
    pieces = [tok.decode(ids[:k + 1]) for k in range(len(ids))]
    cut = next(k for k, p in enumerate(pieces) if p.endswith(" fox"))     # the token that completes " fox"
    choice = Choice(0, tok, (" fox",), include_stop=False, want_logprobs=True)
    first = choice.delta(_out(ids[:2]))
    msg = choice.delta(_out(ids[2:]))                                       # one run to the end
    assert first.text + msg.text == TEXT[:TEXT.index(" fox")]
    assert list(first.token_ids) + list(msg.token_ids) == ids[:cut + 1]
    assert len(msg.logprobs) == len(msg.token_ids) and msg.finish_reason == decoder_pb2.FINISH_REASON_STOP
    assert choice.num_tokens == cut + 1 and choice.stopped_by_string and choice.done
    assert choice.delta(_out(ids[:1], "stop")) is None                    # the engine's late tokens are dropped


def test_a_run_gives_the_same_text_as_one_token_at_a_time(smollm2_dir):
    tok = Tokenizer.from_folder(smollm2_dir)
    ids = tok.encode(TEXT, add_special_tokens=False)
    one = Choice(0, tok, ("lazy",), include_stop=True, want_logprobs=False)
    texts = [one.delta(_out([t])) for t in ids]
    run = Choice(0, tok, ("lazy",), include_stop=True, want_logprobs=False)
    whole = run.delta(_out(ids[:3])).text + run.delta(_out(ids[3:])).text
    assert "".join(m.text for m in texts if m is not None) == whole == TEXT[:TEXT.index("lazy") + 4]
    assert one.num_tokens == run.num_tokens
