"""Every decoder family x every engine feature, against transformers and peft.

One checkpoint per family (the first case of that family in tests/decoder/model/checkpoints.py CASES, so
a family gets this whole matrix as soon as its checkpoint case and its registry entry exist) goes through
the engine with each feature: chunked prefill, prefix caching and preemption (greedy tokens equal
transformers', fast paths pinned on and off), n > 1 and seeded sampling (reproducible through chunks and
preemption, logprobs equal transformers' log_softmax), LoRA adapters on the family's own projections in
a mixed batch (equal peft's generate, with and without speculation), structured outputs (a JSON schema and
a regex over a character tokenizer: the output parses and matches), n-gram speculative decoding (the
greedy tokens without it), bf16 (tracks fp32), int8 and int4 (each its dequantized reference).

A family declines a feature only by naming it with the reason in its `CausalLM.refused_features()`
(model/decoder.py: bf16, int8, int4 or LoRA, each refused at load); for a declined feature the feature's test
checks that asking for it is refused with that reason instead of its parity.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import pytest
import torch

from services.common.errors import Unsupported
from services.decoder.engine.config import EngineConfig, SpeculativeConfig
from services.decoder.engine.engine_core import EngineCore
from services.decoder.engine.step import SamplingParams, StepInput
from services.decoder.grammar.compiler import GrammarCompiler
from services.decoder.grammar.spec import GrammarSpec
from services.decoder.lora import adapter_request
from services.decoder.lora.weights import TARGETS
from services.decoder.model import load_model
from services.decoder.model.decoder import DECLINABLE
from services.decoder.model.families import MODELS
from services.decoder.model.moe_decoder import MoeCausalLM
from services.decoder.model.quantization import GEMMS, unusable
from services.decoder.runner import Runner
from tests.decoder.drive import drive, token_ids
from tests.decoder.families.routing import force_routing, reference_routing
from tests.decoder.families.tokenizer import SPECIALS, STOP_IDS, char_tokenizer
from tests.decoder.lora.adapters import (
    Spec,
    assert_distinct_batch_equals_peft,
    derived_adapter,
    lora_engine,
    peft_mixed,
    register,
    write_adapter,
)
from tests.decoder.model.checkpoints import (
    CASES,
    TINY_INT8_SHAPE,
    TINY_SHAPE,
    VOCAB,
    build,
    greedy_reference,
    load_reference,
)
from tests.decoder.model.test_int4 import dequantized_reference as int4_reference
from tests.decoder.model.test_quantization import dequantized_reference
from tests.decoder.runner.driver import BlockAllocator, Seq
from tests.tolerance import assert_close, rel_tol

pytestmark = pytest.mark.numerics

# The first checkpoint case of each family.
FAMILY_CASES: dict[str, str] = {}
for _name, (_family, _, _) in CASES.items():
    FAMILY_CASES.setdefault(_family, _name)

BLOCK = 4
# Fast paths pinned on (the decode stack timed: pinned on it refuses families it does not compute) and off.
PLANS = {"fast": "gemv=on,glue=cpp,attention=cpp,screen=on,grammar_mask=xgrammar",
         "reference": "linear=plain,gemv=off,glue=torch,attention=torch,decode_stack=off,screen=off,"
                      "grammar_mask=unpacked,huge_pages=off"}
MAX_TOKENS = 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
# Prompts that repeat, so the n-gram drafter proposes from the prompt as well as from the output's loops.
PROMPTS = [[5, 9, 14, 3, 77, 21, 8] * 2, [40, 41] * 4, list(range(10, 33)), [7] * 9, [99, 3, 150, 12, 64, 99, 3]]
SPEC = SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_max=3, prompt_lookup_min=1,
                         disable_by_batch_size=64)


def test_every_family_has_a_checkpoint_case():
    """A family registered without a tiny checkpoint would escape this whole matrix."""
    assert set(FAMILY_CASES) == set(MODELS)


# -- per family: the checkpoint, transformers' model and answers, one runner per plan ----------------------

@pytest.fixture(scope="module", params=list(FAMILY_CASES))
def family(request):
    return request.param


@pytest.fixture(scope="module")
def folder(family, tmp_path_factory):
    return build(tmp_path_factory.mktemp(f"features_{family}"), FAMILY_CASES[family], seed=7)


@pytest.fixture(scope="module")
def reference(folder):
    return load_reference(folder)


@pytest.fixture(scope="module")
def expected(folder):
    return greedy_reference(folder, PROMPTS, MAX_TOKENS)


@pytest.fixture(scope="module")
def runners(folder):
    """fp32 runners with the fast paths pinned on and off; engines below take turns on them (a fresh engine
    reads no block it has not written)."""
    return {plan: Runner.from_folder(folder, "fp32", BLOCK, 256, fast_paths=pins) for plan, pins in PLANS.items()}


@pytest.fixture(scope="module")
def declined(folder):
    return load_model(folder).refused_features()


def refuses(folder, declined: dict[str, str], feature: str) -> bool:
    """Whether the family declines `feature`; if it does, check that asking for it is refused with the reason."""
    assert feature in DECLINABLE
    if feature not in declined:
        return False
    why = declined[feature]
    assert why.strip(), feature
    with pytest.raises(Unsupported, match=re.escape(why)):
        if feature == "lora":
            lora_engine(folder)
        else:
            Runner.from_folder(folder, "bf16" if feature == "bf16" else "fp32", BLOCK, 16,
                               quantization=feature if feature in ("int8", "int4") else "none")
    return True


def engine(runner, *, num_blocks=256, budget=512, prefix_caching=True, speculative=None, max_len=64,
           eos=()) -> EngineCore:
    return EngineCore(runner, EngineConfig(block_size=BLOCK, num_blocks=num_blocks, max_num_batched_tokens=budget,
                                           max_num_seqs=8, max_model_len=max_len, eos_token_ids=eos,
                                           enable_prefix_caching=prefix_caching, speculative=speculative))


def greedy_tokens(core: EngineCore, stagger: int = 1) -> list[list[int]]:
    return token_ids(drive(core, PROMPTS, GREEDY, stagger=stagger), len(PROMPTS))


# -- chunked prefill, prefix caching, preemption, n > 1 ---------------------------------------------------

@pytest.mark.parametrize("plan", list(PLANS))
def test_chunked_prefill_and_preemption_equal_transformers(runners, expected, plan):
    runner = runners[plan]
    # Staggered arrivals in chunks of at most 5 tokens.
    assert greedy_tokens(engine(runner, budget=5), stagger=3) == expected
    # A pool small enough to preempt (and recompute) running requests.
    core = engine(runner, num_blocks=12, budget=16, prefix_caching=False)
    assert greedy_tokens(core) == expected and core.stats().num_preemptions > 0


def test_prefix_hit_gives_the_same_tokens(runners, expected):
    core = engine(runners["fast"], budget=64)
    got = []
    for rid in ("a", "b"):
        core.add_request(rid, PROMPTS[2], GREEDY)
        toks, cached = [], 0
        while core.has_unfinished():
            for out in core.step():
                toks.extend(out.new_token_ids)
                cached = max(cached, out.num_cached_tokens)
        got.append((toks, cached))
    assert got == [(expected[2], 0), (expected[2], 20)]      # 23 prompt tokens: 5 full blocks of 4 hit
    core.check_idle()


def test_greedy_choices_share_the_prompt_and_equal_transformers(runners, expected):
    sampling = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, n=2)
    tokens = drive(engine(runners["fast"]), PROMPTS, sampling)
    for i, want in enumerate(expected):
        assert [t.token_id for t in tokens[(i, 0)]] == [t.token_id for t in tokens[(i, 1)]] == want


# -- seeded sampling and logprobs -------------------------------------------------------------------------

def test_seeded_choices_are_reproducible_and_logprobs_equal_transformers(runners, reference):
    sampling = SamplingParams(temperature=0.9, top_p=0.95, seed=11, n=3, max_tokens=8, ignore_eos=True,
                              logprobs=0)
    roomy = drive(engine(runners["fast"]), PROMPTS[:3], sampling)
    # Chunks of at most 16 tokens in a pool small enough to preempt, even where sliding windows return blocks.
    squeezed_core = engine(runners["reference"], num_blocks=12, budget=16, prefix_caching=False)
    squeezed = drive(squeezed_core, PROMPTS[:3], sampling)
    assert squeezed_core.stats().num_preemptions > 0
    ids = {key: [t.token_id for t in run] for key, run in roomy.items()}
    assert ids == {key: [t.token_id for t in run] for key, run in squeezed.items()}
    # Choice i draws with seed + i: the three choices of a prompt are not one answer.
    for i in range(3):
        assert len({tuple(ids[(i, c)]) for c in range(3)}) > 1, ids
    for (i, c), run in roomy.items():
        full = torch.tensor([PROMPTS[i] + ids[(i, c)]])
        with torch.no_grad():
            want = torch.log_softmax(reference(full).logits[0].float(), -1)
        n = len(PROMPTS[i])
        want = [float(want[n - 1 + j, t]) for j, t in enumerate(ids[(i, c)])]
        assert_close([t.logprob for t in run], want, **TINY_SHAPE, what=f"prompt {i} choice {c}")
        assert_close([t.logprob for t in squeezed[(i, c)]], want, **TINY_SHAPE)


# -- speculative decoding ---------------------------------------------------------------------------------

@pytest.mark.parametrize("plan,budget", [("fast", 512), ("reference", 5)])
def test_speculation_gives_the_greedy_tokens(runners, expected, plan, budget):
    core = engine(runners[plan], budget=budget, speculative=SPEC)
    assert greedy_tokens(core) == expected
    stats = core.stats()
    assert stats.num_accepted_tokens > 0, stats


# -- LoRA adapters ----------------------------------------------------------------------------------------

def adapter_modules(reference, family: str) -> list[str]:
    """The full names of the projections a PEFT adapter may target in this family's transformers model: each
    nn.Linear whose name is one of the bank's TARGETS, or a fused checkpoint projection the family splits into
    them (CausalLM.checkpoint_fused, where a family has one). Full names, so that peft adapts exactly these
    modules (not, say, a mixture's stacked experts under a shared leaf name)."""
    fused = dict(getattr(MODELS[family], "checkpoint_fused", {}))
    kinds = {t for t in TARGETS if not any(t in parts for parts in fused.values())} | set(fused)
    return [name for name, m in reference.named_modules()
            if isinstance(m, torch.nn.Linear) and name.rsplit(".", 1)[-1] in kinds]


@pytest.fixture(scope="module")
def adapters(family, folder, reference, declined, tmp_path_factory):
    """Two PEFT adapters on the family's own projections (the attention's, then the rest) and their
    expected greedy tokens per LORA_WORK request, from peft one request at a time; None when the family
    declines LoRA (and is refused it)."""
    if refuses(folder, declined, "lora"):
        return None
    modules = adapter_modules(reference, family)
    attention = tuple(m for m in modules if ".self_attn." in m)
    rest = tuple(m for m in modules if m not in attention)
    assert attention, modules
    out = tmp_path_factory.mktemp("features_adapters")
    folders = {"attn": write_adapter(folder, out, Spec("attn", 4, 8.0, attention, 31))}
    folders["rest"] = write_adapter(folder, out, Spec("rest", 2, 4.0, rest or attention, 32))
    if json.loads((folders["rest"] / "adapter_config.json").read_text()).get("target_parameters"):
        # peft put these on a mixture's stacked routed experts (its weight conversion does so for any
        # gate/up/down target of such a model): the bank refuses LoRA there; the rest adapter then takes
        # the projections that stay modules.
        core, registry = lora_engine(folder)
        with pytest.raises(Unsupported, match="target_parameters"):
            register(registry, "rest", folders["rest"])
        kept = tuple(m for m in rest if m.rsplit(".", 1)[-1] not in ("gate_proj", "up_proj", "down_proj"))
        folders["rest"] = write_adapter(folder, tmp_path_factory.mktemp("features_adapters"),
                                        Spec("rest", 2, 4.0, kept or attention, 32))
    peft = peft_mixed(folder, folders)
    want = []
    with torch.no_grad():
        for p, a in LORA_WORK:
            ids = torch.tensor([PROMPTS[p]])
            kwargs = dict(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_TOKENS,
                          do_sample=False, eos_token_id=None, pad_token_id=0)
            if a is None:
                with peft.disable_adapter():
                    gen = peft.generate(**kwargs)
            else:
                peft.set_adapter(a)
                gen = peft.generate(**kwargs)
            want.append(gen[0, ids.shape[1]:].tolist())
    assert want[0] != want[3], "the adapter does not change the tokens: the test could not see it lost"
    return folders, want


LORA_WORK = [(0, "attn"), (1, None), (2, "rest"), (0, None), (4, "attn"), (3, "rest")]


# The CPU service's store (the pool) with and without drafts; the slot bank (the CUDA store) without.
@pytest.mark.parametrize(("speculative", "store"), [(None, "bank"), (None, "pool"), (SPEC, "pool")],
                         ids=["plain-bank", "plain-pool", "speculative-pool"])
def test_mixed_adapter_batch_equals_peft(folder, adapters, speculative, store):
    if adapters is None:
        return                               # declined, and refused with the reason (the fixture checked)
    folders, want = adapters
    core, registry = lora_engine(folder, budget=5, speculative=speculative,
                                 pool_bytes=2**24 if store == "pool" else None)
    digests = {n: register(registry, n, f).digest for n, f in folders.items()}
    got = {str(i): [] for i in range(len(LORA_WORK))}
    pending, steps = list(enumerate(LORA_WORK)), 0
    while pending or core.has_unfinished():
        if pending and steps % 2 == 0:
            i, (p, a) = pending.pop(0)
            adapter, keys = adapter_request(a, digests[a]) if a else (None, ())
            core.add_request(str(i), PROMPTS[p], GREEDY, extra_keys=keys, adapter=adapter)
        for out in core.step():
            assert out.finish_reason in (None, "length"), out
            got[out.request_id].extend(out.new_token_ids)
        steps += 1
    assert [got[str(i)] for i in range(len(LORA_WORK))] == want
    if speculative is not None:
        assert core.stats().num_accepted_tokens > 0
    core.check_idle()
    assert registry.total_refs == 0


# Many adapters in one batch: every row on its own adapter (the CPU pool's promise, docs/adapters.md), ranks 2
# to 8 mixed, on the attention's projections, the rest, or both; two base rows beside them.
MANY_ROWS = 64
MANY_TOKENS = 3


def batch_first(reference, modules: tuple[str, ...]) -> tuple[str, ...]:
    """The modules among `modules` whose input has the batch as its first dimension. peft's mixed batch
    (adapter_names) splits a module's input by batch row, so it serves only these: not, say, a mixture's shared
    expert, which sees the tokens flattened."""
    firsts = {}

    def record(name):
        def hook(_, args):
            firsts.setdefault(name, args[0].shape[0])     # returns None: the input goes on unchanged
        return hook
    hooks = [reference.get_submodule(m).register_forward_pre_hook(record(m)) for m in modules]
    with torch.no_grad():
        reference(input_ids=torch.full((2, 3), 5))
    for hook in hooks:
        hook.remove()
    return tuple(m for m in modules if firsts.get(m) == 2)


@pytest.fixture(scope="module")
def many_adapters(folder, reference, adapters, tmp_path_factory):
    """(MANY_ROWS adapter folders, peft holding them all): on the attn adapter's targets, the rest adapter's
    (both of which the adapters fixture fitted to the family) or both, each kept to what peft's mixed batch
    serves; None when the family declines LoRA."""
    if adapters is None:
        return None
    folders, _ = adapters
    out = tmp_path_factory.mktemp("features_many")
    targets = [batch_first(reference, tuple(json.loads((folders[n] / "adapter_config.json").read_text())
                                            ["target_modules"])) for n in ("attn", "rest")]
    assert targets[0], "no attention projection that peft's mixed batch serves"
    specs = [Spec("attn", 8, 8.0, targets[0], 33), Spec("rest", 8, 8.0, targets[1] or targets[0], 34),
             Spec("both", 8, 8.0, tuple(sorted(set(sum(targets, ())))), 35)]
    templates = [write_adapter(folder, out, spec) for spec in specs]
    # alpha / r of 0.5 to 1: a correction beside the base projection's output rather than several times it,
    # so the shared tolerance (scaled to the logits) bounds the arithmetic, not amplified activations.
    ranks = [(2, 4, 6, 8)[i % 4] for i in range(MANY_ROWS)]
    many = {f"m{i:02d}": derived_adapter(templates[i % 3], out / f"m{i:02d}", r, r * (0.5 + 0.25 * (i % 3)), 200 + i)
            for i, r in enumerate(ranks)}
    return many, peft_mixed(folder, many)


def test_mixed_adapter_batch_of_many_distinct_adapters_equals_peft(folder, many_adapters):
    """MANY_ROWS rows, each on its own adapter, with two base rows: one forward as peft's mixed batch, and
    greedy tokens through the engine (all admitted at once) as peft's generate, in the CPU pool."""
    if many_adapters is None:
        return                               # declined, and refused with the reason (the adapters fixture checked)
    folders, peft = many_adapters
    core, registry = lora_engine(folder, max_rank=8, pool_bytes=2**26, cpu_loras=MANY_ROWS, num_blocks=1024,
                                 budget=512, max_seqs=MANY_ROWS)
    assert_distinct_batch_equals_peft(core, registry, folders, peft, MANY_TOKENS, BLOCK)


# -- structured outputs -----------------------------------------------------------------------------------

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99},
                                           "c": {"enum": ["red", "blue"]}}, "required": ["n", "c"]}
REGEX = r"[a-z]{3,8}@[a-z]{2,6}\.(com|org)"
@pytest.fixture(scope="module")
def grammars():
    compiler = GrammarCompiler(char_tokenizer(), vocab_size=VOCAB, stop_token_ids=STOP_IDS,
                               special_token_ids=frozenset(range(len(SPECIALS))), cache_size=8)
    yield {"schema": compiler.compile_now(GrammarSpec.json_schema(json.dumps(SCHEMA))),
           "regex": compiler.compile_now(GrammarSpec.regex(REGEX))}
    compiler.close()


def valid(kind: str, text: str) -> bool:
    if kind == "schema":
        jsonschema.validate(json.loads(text), SCHEMA)
        return True
    return re.fullmatch(REGEX, text) is not None


def test_structured_outputs_parse_and_match(runners, grammars):
    tok = char_tokenizer()
    prompt = tok.encode('Answer as {"n": number, "c": colour}:').ids
    jobs = {f"{kind}-{how}": (grammar, params) for kind, grammar in grammars.items() for how, params in (
        ("greedy", SamplingParams(temperature=0.0, max_tokens=40)),
        ("seeded", SamplingParams(temperature=1.0, seed=3, max_tokens=40, n=2)))}
    results = []
    squeezed = dict(num_blocks=20, budget=5, prefix_caching=False)
    for core in (engine(runners["fast"], eos=STOP_IDS, max_len=128),
                 engine(runners["reference"], **squeezed, eos=STOP_IDS, max_len=128)):
        got = {}
        for rid, (grammar, params) in jobs.items():
            core.add_request(rid, prompt, params, grammar=grammar)
        while core.has_unfinished():
            for out in core.step():
                entry = got.setdefault((out.request_id, out.index), [[], None])
                entry[0].extend(out.new_token_ids)
                if out.finished:
                    entry[1] = out.finish_reason
                    if out.stop_token_id is not None:
                        entry[0].pop()
        core.check_idle()
        results.append(got)
    assert results[0] == results[1]              # chunked and preempted: the matcher saw each token once
    for (rid, _), (tokens, finish) in results[0].items():
        text = tok.decode(tokens)
        assert finish == "stop" and valid(rid.split("-")[0], text), (rid, text)


# -- bf16 and int8 ----------------------------------------------------------------------------------------

def chunked_logits(runner, tokens: list[int], decode: int,
                   then: list[int] | None = None) -> tuple[list[torch.Tensor], list[int]]:
    """Prefill `tokens` in chunks of 5, then `decode` steps, each feeding its greedy token or, given `then`, the
    next of those: (logits at each sampled row, all tokens)."""
    alloc, seq, rows = BlockAllocator(64), Seq("a", list(tokens)), []
    while seq.computed < len(seq.tokens):
        logits, batch = runner.logits(StepInput([seq.chunk(5, alloc, BLOCK)]))
        if batch.sampled:
            rows.append(logits[0])
            if len(rows) <= decode:
                seq.tokens.append(int(logits[0].argmax()) if then is None else then[len(rows) - 1])
    return rows, seq.tokens


def test_bf16_tracks_transformers_fp32(folder, reference, declined):
    if refuses(folder, declined, "bf16"):
        return
    runner = Runner.from_folder(folder, "bf16", BLOCK, 64)
    assert runner.cache.k[0].dtype == torch.bfloat16
    prompt = PROMPTS[2][:13]
    if isinstance(runner.model, MoeCausalLM):
        # bf16 may swap near-tied experts (tests/decoder/families/routing.py): route as transformers' fp32 model
        # does over its own greedy continuation, fed to ours in place of our argmax.
        then = greedy_reference(folder, [prompt], 3)[0]
        force_routing(runner.model, reference_routing(reference, prompt + then))
        rows, tokens = chunked_logits(runner, prompt, 3, then)
    else:
        rows, tokens = chunked_logits(runner, prompt, 3)
    with torch.no_grad():
        want = reference(torch.tensor([tokens])).logits[0, 12:]
    for i, got in enumerate(rows):
        assert_close(got, want[i], dtype=torch.bfloat16, **TINY_SHAPE, what=f"row {i}")
    top = want[0].topk(2).values
    if float(top[0] - top[1]) > 2 * rel_tol(torch.bfloat16, **TINY_SHAPE) * float(want[0].abs().max()):
        assert int(rows[0].argmax()) == int(want[0].argmax())
    if isinstance(runner.model, MoeCausalLM):       # its routers back to their own choice
        runner = Runner.from_folder(folder, "bf16", BLOCK, 64)
    # Through the engine: every request runs to its length and leaves the pool idle (drive checks both).
    drive(engine(runner, num_blocks=64, budget=5), PROMPTS, GREEDY)


# int8 timed, and each many-row int8 matmul pinned (it runs the prefill's chunks of 5 rows).
INT8_PLANS = ["", *(f"int8_gemm={gemm}" for gemm in GEMMS)]


@pytest.mark.parametrize("pins", INT8_PLANS)
def test_int8_matches_the_dequantized_reference(folder, declined, pins):
    if "int8_gemm=" in pins and (why := unusable(pins.rsplit("=", 1)[1], torch.float32)):
        pytest.skip(f"{pins} is refused at load here: {why}")
    if refuses(folder, declined, "int8"):
        return
    runner = Runner.from_folder(folder, "fp32", BLOCK, 64, quantization="int8", fast_paths=pins)
    assert runner.quantization.startswith("int8: ")
    if pins:
        assert runner.plan.chosen("int8_gemm") == pins.rsplit("=", 1)[1]
    ref = dequantized_reference(folder)
    prompt = PROMPTS[4]
    if isinstance(runner.model, MoeCausalLM):
        # int8 rounding may swap near-tied experts as bf16 does (tests/decoder/families/routing.py): route as the
        # reference does over its own greedy continuation, fed to ours in place of our argmax.
        then = []
        with torch.no_grad():
            for _ in range(4):
                then.append(int(ref(torch.tensor([prompt + then])).logits[0, -1].argmax()))
        force_routing(runner.model, reference_routing(ref, prompt + then))
        rows, tokens = chunked_logits(runner, prompt, 4, then)
        runner = Runner.from_folder(folder, "fp32", BLOCK, 64, quantization="int8", fast_paths=pins)
    else:
        rows, tokens = chunked_logits(runner, prompt, 4)
    with torch.no_grad():
        want = ref(torch.tensor([tokens])).logits[0, len(prompt) - 1:]
    for i, got in enumerate(rows):
        assert_close(got, want[i], dtype=torch.int8, **TINY_INT8_SHAPE, what=f"row {i}")
    drive(engine(runner, num_blocks=64, budget=5), PROMPTS, GREEDY)


def test_int4_matches_the_dequantized_reference(folder, declined):
    """Prefill on the many-row path, decode steps on the few-row kernel (x rounded to int8 per group: int8's
    bound); then the engine runs every request to its length."""
    if refuses(folder, declined, "int4"):
        return
    runner = Runner.from_folder(folder, "fp32", BLOCK, 64, quantization="int4")
    assert runner.quantization.startswith("int4: ")
    ref = int4_reference(folder)
    rows, tokens = chunked_logits(runner, PROMPTS[4], 3)
    with torch.no_grad():
        want = ref(torch.tensor([tokens])).logits[0, len(PROMPTS[4]) - 1:]
    for i, got in enumerate(rows):
        assert_close(got, want[i], dtype=torch.int8, **TINY_INT8_SHAPE, what=f"row {i}")
    drive(engine(runner, num_blocks=64, budget=5), PROMPTS[:2], GREEDY)


# -- docs/models.md's table of features per family ---------------------------------------------------------

# Its columns: each feature this file tests, in the table's order.
COLUMNS = ("chunked prefill", "prefix caching", "preemption", "n > 1", "seeded sampling", "logprobs", "LoRA",
           "structured outputs", "speculative decoding", "bf16", "int8", "int4")
DECLINABLE_COLUMNS = {"LoRA": "lora", "bf16": "bf16", "int8": "int8", "int4": "int4"}


def features_table() -> dict[str, list[str]]:
    """docs/models.md's features table: model_type -> its cells, after checking the header."""
    text = (Path(__file__).resolve().parents[3] / "docs" / "models.md").read_text()
    section = text.split("## Engine features per decoder family", 1)[1].split("\n## ", 1)[0]
    lines = [[cell.strip() for cell in line.strip().strip("|").split("|")] for line in section.splitlines()
             if line.startswith("| `")]
    (header, *rows) = lines
    assert tuple(header) == ("`model_type`", *COLUMNS)
    return {row[0].strip("`"): row[1:] for row in rows}


def test_features_table_names_every_family():
    assert set(features_table()) == set(FAMILY_CASES)


def test_features_table_row_says_what_the_family_declines(family, declined):
    assert set(DECLINABLE_COLUMNS.values()) == set(DECLINABLE)
    want = [f"no: {declined[DECLINABLE_COLUMNS[c]]}" if DECLINABLE_COLUMNS.get(c) in declined else "yes"
            for c in COLUMNS]
    assert features_table()[family] == want


# -- what a family declines -------------------------------------------------------------------------------

def test_a_declined_feature_is_refused_at_load(tmp_path):
    """The declaration is enforced: a model that declines bf16, int8 and LoRA cannot be loaded so, and the
    one-line refusal carries the family's reason."""
    from services.decoder.lora import AdapterBank
    folder = build(tmp_path, FAMILY_CASES["llama"])
    reasons = {"bf16": "bf16 reason", "int8": "int8 reason", "int4": "int4 reason", "lora": "lora reason"}
    assert set(reasons) == set(DECLINABLE)

    def declining(dtype="fp32"):
        model = load_model(folder, dtype)
        model.refused_features = lambda: reasons
        return model
    with pytest.raises(Unsupported, match="--dtype bf16: bf16 reason"):
        Runner(declining("bf16"), BLOCK, 16)
    with pytest.raises(Unsupported, match="--quantization int8: int8 reason"):
        Runner(declining(), BLOCK, 16, quantization="int8")
    with pytest.raises(Unsupported, match="--quantization int4: int4 reason"):
        Runner(declining(), BLOCK, 16, quantization="int4")
    with pytest.raises(Unsupported, match="LoRA adapters: lora reason"):
        AdapterBank(Runner(declining(), BLOCK, 16).model, TARGETS)
