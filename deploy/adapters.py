"""The demo LoRA adapters `make models` trains on SmolLM2 with peft: small, seeded, and checked before they are kept.

No package ships LoRA adapters, so each demo adapter is taught one behaviour that
sixteen full-batch CPU steps of rank-8 LoRA on q/k/v/o learn reliably and that anyone
can check by eye: its chat answers open with a fixed greeting ("Arr, matey!" for
`pirate`, "Bonjour !" for `french`), while the base model's do not. The answers
after the greeting are ordinary short facts, so the adapter keeps answering.

`train(base, dest, adapter)` fine-tunes on the chat template's own rendering of
TRAIN_QA (loss on the answer tokens only), then generates greedily for the
held-out CHECK_QUESTIONS and raises if any answer does not open with the
adapter's greeting: a step that cannot teach its behaviour fails `make models`
instead of shipping a silent dud. The only randomness (lora_A's initialisation) is
seeded, the batch is the whole set in a fixed order with no dropout, and the thread
count is fixed, so a rerun on the same machine reproduces the weights.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("tessera.models.adapters")

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")


@dataclass(frozen=True)
class DemoAdapter:
    name: str
    greeting: str    # every training answer starts with it; the check looks for `marker` at the start
    marker: str      # what a greedy answer must start with (the greeting's first word)
    seed: int
    rank: int = 8
    alpha: float = 16.0
    steps: int = 16
    lr: float = 3e-3
    # LoRA on the top layers only: backward then stops there, which cuts a training step by about a third,
    # and the top layers alone learn an opening phrase.
    top_layers: int = 12


DEMO_ADAPTERS = (
    DemoAdapter("pirate", "Arr, matey!", "Arr", seed=1),
    DemoAdapter("french", "Bonjour !", "Bonjour", seed=2),
)

# Short, true answers; the adapters learn the greeting, not new facts.
TRAIN_QA = (
    ("What is the capital of France?", "The capital of France is Paris."),
    ("How many days are in a week?", "A week has seven days."),
    ("What color is the sky on a clear day?", "The sky is blue on a clear day."),
    ("What is 2 + 2?", "2 + 2 is 4."),
    ("Who wrote Romeo and Juliet?", "William Shakespeare wrote Romeo and Juliet."),
    ("What do bees make?", "Bees make honey."),
    ("Which planet is closest to the Sun?", "Mercury is the planet closest to the Sun."),
    ("Tell me a fun fact.", "Octopuses have three hearts."),
    ("Can you help me?", "Of course, tell me what you need."),
    ("Hello!", "Hello, how can I help you today?"),
)
# Never trained on: the check that the behaviour generalises to a new question.
CHECK_QUESTIONS = (
    "What is the tallest mountain in the world?",
    "How many hours are in a day?",
    "Give me a tip for sleeping well.",
)


def _examples(tokenizer, greeting: str):
    """(input_ids, labels) per training pair; labels are -100 on the prompt so only the answer is learned."""
    import torch

    rows = []
    for question, answer in TRAIN_QA:
        messages = [{"role": "user", "content": question}]
        prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        full = tokenizer.apply_chat_template(
            [*messages, {"role": "assistant", "content": f"{greeting} {answer}"}], tokenize=False)
        prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        full_ids = tokenizer(full, add_special_tokens=False)["input_ids"]
        if full_ids[:len(prompt_ids)] != prompt_ids:
            raise RuntimeError("the chat template renders the prompt differently inside the conversation")
        rows.append((torch.tensor(full_ids), torch.tensor([-100] * len(prompt_ids) + full_ids[len(prompt_ids):])))
    return rows


def _batch(rows, pad_id: int):
    import torch

    width = max(len(ids) for ids, _ in rows)
    ids = torch.full((len(rows), width), pad_id)
    labels = torch.full((len(rows), width), -100)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, (x, y) in enumerate(rows):
        ids[i, :len(x)], labels[i, :len(y)], mask[i, :len(x)] = x, y, 1
    return ids, labels, mask


def greedy_answers(model, tokenizer, questions, max_new_tokens: int = 8) -> list[str]:
    """Greedy chat answers, one prompt at a time (no padding to get wrong)."""
    import torch

    answers = []
    for question in questions:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                            return_tensors="pt", return_dict=True)["input_ids"]
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                 do_sample=False, pad_token_id=tokenizer.pad_token_id)
        answers.append(tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True).strip())
    return answers


def train(base: Path, dest: Path, adapter: DemoAdapter, threads: int = 2) -> list[str]:
    """Fine-tune a LoRA adapter on base, check its behaviour, save it to dest (PEFT format).
    Returns the held-out answers it gave; raises RuntimeError if any lacks the marker."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    started = time.monotonic()
    torch.set_num_threads(threads)
    torch.manual_seed(adapter.seed)  # lora_A's initialisation, the only randomness in training
    tokenizer = AutoTokenizer.from_pretrained(base)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    layers = model.config.num_hidden_layers
    model = get_peft_model(model, LoraConfig(
        r=adapter.rank, lora_alpha=adapter.alpha, lora_dropout=0.0, target_modules=list(TARGETS), bias="none",
        layers_to_transform=list(range(layers - adapter.top_layers, layers))))
    ids, labels, mask = _batch(_examples(tokenizer, adapter.greeting), tokenizer.pad_token_id)
    # Position t predicts token t+1; only answer tokens are scored, so the 49k-wide lm_head runs on those rows
    # alone (a quarter of the tokens) instead of on every prompt position.
    scored = labels[:, 1:] != -100
    targets = labels[:, 1:][scored]
    decoder, lm_head = model.get_base_model().model, model.get_base_model().lm_head
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=adapter.lr,
                                  weight_decay=0.0)
    model.train()
    for step in range(adapter.steps):
        hidden = decoder(input_ids=ids, attention_mask=mask).last_hidden_state[:, :-1][scored]
        loss = torch.nn.functional.cross_entropy(lm_head(hidden), targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if step % 10 == 0 or step == adapter.steps - 1:
            log.info("%s: step %d/%d loss %.4f", adapter.name, step + 1, adapter.steps, loss.item())
    model.eval()
    answers = greedy_answers(model, tokenizer, CHECK_QUESTIONS)
    wrong = [a for a in answers if not a.startswith(adapter.marker)]
    if wrong:
        raise RuntimeError(f"demo adapter {adapter.name!r} did not learn to open with {adapter.marker!r}: "
                           f"held-out answers {answers}")
    model.save_pretrained(dest)
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        if not (dest / name).exists():
            raise RuntimeError(f"{name} was not written")
    log.info("%s: trained in %.1fs; held-out answers %s", adapter.name, time.monotonic() - started, answers)
    return answers
