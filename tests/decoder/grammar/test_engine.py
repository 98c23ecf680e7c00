"""Structured outputs through the real engine (core + runner + sampler) on the tiny random chat model: whatever
the engine does to a request (chunked prefill, preemption and recompute, n > 1, prefix hits, a LoRA row in
the batch), each choice's matcher follows exactly its accepted tokens, so the output is valid and equals the
output of a run with room to spare."""
from __future__ import annotations

import json
import re

import jsonschema
import pytest

from services.decoder.engine.config import EngineConfig, SpeculativeConfig
from services.decoder.engine.engine_core import EngineCore
from services.decoder.engine.step import SamplingParams
from services.decoder.grammar.spec import GrammarSpec
from services.decoder.runner.runner import Runner
from tests.decoder.grammar.cases import CHOICES, REGEX, SCHEMA
from tests.decoder.grammar.conftest import EOS
from tests.decoder.server.conftest import tiny_chat_model  # noqa: F401 - the fixture

GRAMMAR = 'root ::= "(" num ("+" num){0,3} ")"\nnum ::= [0-9]{1,3}'
PROMPT = "Tell me about a person, as JSON, in one line please."


@pytest.fixture(scope="module")
def grammars(compiler):
    return {"schema": compiler.compile_now(GrammarSpec.json_schema(json.dumps(SCHEMA))),
            "regex": compiler.compile_now(GrammarSpec.regex(REGEX)),
            "choice": compiler.compile_now(GrammarSpec.choice(CHOICES)),
            "grammar": compiler.compile_now(GrammarSpec.grammar(GRAMMAR))}


def valid(kind: str, text: str) -> bool:
    if kind == "schema":
        jsonschema.validate(json.loads(text), SCHEMA)
        return True
    if kind == "regex":
        return re.fullmatch(REGEX, text) is not None
    if kind == "choice":
        return text in CHOICES
    return re.fullmatch(r"\(\d{1,3}(\+\d{1,3}){0,3}\)", text) is not None


@pytest.fixture(scope="module")
def runner(tiny_chat_model):  # noqa: F811
    """One runner for every engine here (building one times its matmul paths); each test's engine uses at
    most its 512 blocks, and a fresh engine reads no block it has not written."""
    return Runner.from_folder(tiny_chat_model, "fp32", 4, 512, fast_paths="screen=on,speculation=always")


def core_for(runner, num_blocks=512, budget=64, prefix_caching=True, speculative=None) -> EngineCore:
    return EngineCore(runner, EngineConfig(block_size=4, num_blocks=num_blocks, max_num_batched_tokens=budget,
                                           max_num_seqs=8, max_model_len=256, enable_prefix_caching=prefix_caching,
                                           eos_token_ids=(EOS,), speculative=speculative))


def run(core: EngineCore, jobs: dict) -> dict:
    """jobs: rid -> (prompt ids, SamplingParams, grammar or None) -> {(rid, index): (tokens, finish, cached)}."""
    got = {}
    for rid, (prompt, params, grammar) in jobs.items():
        core.add_request(rid, prompt, params, grammar=grammar)
        for i in range(params.n):
            got[(rid, i)] = [[], None, 0]
    for _ in range(5000):
        if not core.has_unfinished():
            break
        for out in core.step():
            entry = got[(out.request_id, out.index)]
            entry[0].extend(out.new_token_ids)
            entry[2] = max(entry[2], out.num_cached_tokens)
            if out.finished:
                entry[1] = out.finish_reason
                if out.stop_token_id is not None:
                    entry[0].pop()                  # the stop token is counted, not shown
    core.check_idle()
    return {k: tuple(v) for k, v in got.items()}


def jobs_for(tokenizer, grammars, max_tokens=80) -> dict:
    prompt = tokenizer.encode(PROMPT)
    jobs = {}
    for kind, grammar in grammars.items():
        jobs[f"{kind}-seeded"] = (prompt, SamplingParams(temperature=1.0, seed=5, max_tokens=max_tokens),
                                  grammar)
    jobs["schema-greedy"] = (prompt, SamplingParams(temperature=0, max_tokens=max_tokens),
                             grammars["schema"])
    jobs["free"] = (prompt, SamplingParams(temperature=1.0, seed=2, max_tokens=24, ignore_eos=True), None)
    return jobs


def test_valid_through_chunked_prefill_and_preemption(runner, tokenizer, grammars):
    jobs = jobs_for(tokenizer, grammars)
    roomy = run(core_for(runner), jobs)
    # Prefill in chunks of <= 5 tokens, and no prefix sharing, so the pool runs out while objects are open.
    squeezed_core = core_for(runner, num_blocks=24, budget=5, prefix_caching=False)
    squeezed = run(squeezed_core, jobs)
    assert squeezed_core.stats().num_preemptions > 0
    # Preempted mid-object and recomputed: the same tokens, so the matcher was fed each token exactly once.
    assert {k: v[:2] for k, v in squeezed.items()} == {k: v[:2] for k, v in roomy.items()}
    for (rid, _), (tokens, finish, _) in roomy.items():
        if rid != "free":
            text = tokenizer.decode(tokens)
            assert finish == "stop" and valid(rid.split("-")[0], text), (rid, text)
    # The unconstrained request beside them is untouched by their masks.
    alone = run(core_for(runner), {"free": jobs["free"]})
    assert alone[("free", 0)][0] == roomy[("free", 0)][0]


def test_speculative_drafts_pass_the_mask_and_leave_the_matcher_on_the_emitted_tokens(runner, tokenizer, grammars):
    """Drafts the grammar forbids are rejected, accepted ones advance the matcher once: with speculation on
    (and squeezed into chunks and preemptions too) every choice equals the run without it."""
    jobs = jobs_for(tokenizer, grammars)
    plain = run(core_for(runner), jobs)
    spec = SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_max=3, prompt_lookup_min=1,
                             disable_by_batch_size=16)
    for core in (core_for(runner, speculative=spec),
                 core_for(runner, num_blocks=24, budget=5, prefix_caching=False, speculative=spec)):
        got = run(core, jobs)
        assert {k: v[:2] for k, v in got.items()} == {k: v[:2] for k, v in plain.items()}
        stats = core.stats()
        assert stats.num_accepted_tokens > 0 and stats.num_draft_tokens > stats.num_accepted_tokens, stats


def test_each_choice_of_n_has_its_own_matcher(runner, tokenizer, grammars):
    prompt = tokenizer.encode(PROMPT)
    got = run(core_for(runner), {
        "n": (prompt, SamplingParams(temperature=1.0, seed=11, n=3, max_tokens=80), grammars["schema"])})
    texts = [tokenizer.decode(got[("n", i)][0]) for i in range(3)]
    for text in texts:
        assert valid("schema", text), text
    assert len(set(texts)) > 1                       # seed + i per choice: they differ


def test_prefix_hits_and_max_tokens(runner, tokenizer, grammars):
    core = core_for(runner)
    prompt = tokenizer.encode(PROMPT)
    job = (prompt, SamplingParams(temperature=0, max_tokens=80), grammars["schema"])
    first = run(core, {"a": job})[("a", 0)]
    again = run(core, {"b": job})[("b", 0)]
    assert first[2] == 0 and again[2] > 0 and again[:2] == first[:2]
    cut = run(core, {"c": (prompt, SamplingParams(temperature=0, max_tokens=12), grammars["schema"])})
    tokens, finish, _ = cut[("c", 0)]
    assert finish == "length" and len(tokens) == 12 and first[0][:12] == tokens   # cut mid-object
    with pytest.raises(json.JSONDecodeError):
        json.loads(tokenizer.decode(tokens))


def test_stop_token_ids_still_end_a_constrained_choice(runner, tokenizer, grammars):
    prompt = tokenizer.encode(PROMPT)
    full = run(core_for(runner), {"a": (prompt, SamplingParams(temperature=0, max_tokens=80),
                                                 grammars["grammar"])})[("a", 0)][0]
    stop_id = full[3]
    got = run(core_for(runner), {"a": (prompt, SamplingParams(temperature=0, max_tokens=80,
                                                                       stop_token_ids=(stop_id,)),
                                                grammars["grammar"])})[("a", 0)]
    assert got[0] == full[:full.index(stop_id)] and got[1] == "stop"     # an unfinished expression
