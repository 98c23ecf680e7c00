"""Tiny random checkpoints of the pooling service's families, written with transformers' save_pretrained,
each with a byte-level tokenizer (no training, no hub) whose special tokens and template follow the family's
real tokenizer, and wrapped as sentence-transformers folders the way real embedding models ship."""
from __future__ import annotations

from pathlib import Path

import torch

# Widths shared by every family here.
HIDDEN, HEADS, INTERMEDIATE, LAYERS = 32, 4, 64, 2
# The longest input the folders declare (sentence_bert_config max_seq_length).
MAX_SEQ = 120
# Accumulation shape for tests/tolerance.py: k = 128 positions of attention at most (over MAX_SEQ and the
# intermediate width); depth = the most layers here (ModernBERT's 2 * LAYERS) + 1 for embedding and pooling.
SHAPE = {"k": 128, "depth": 2 * LAYERS + 1}


def write_tokenizer(folder: Path, specials: list[str], single: str, pair: str | None, *, first: bool,
                    **hf) -> dict[str, int]:
    """A byte-level BPE without merges (one token per byte) plus `specials`, before the 256 byte tokens
    (first, as XLM-R and BERT number theirs) or after them (as Qwen and ModernBERT do), with the template
    processor `single` / `pair`. hf: PreTrainedTokenizerFast's token names and padding side. Returns the
    special tokens' ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import PreTrainedTokenizerFast

    byte_chars = sorted(ByteLevel.alphabet(), key=ord)
    names = specials + byte_chars if first else byte_chars + specials
    vocab = {name: i for i, name in enumerate(names)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(specials)
    ids = {name: vocab[name] for name in specials}
    used = [name for name in specials if name in single or (pair and name in pair)]
    tok.post_processor = processors.TemplateProcessing(single=single, pair=pair,
                                                       special_tokens=[(name, ids[name]) for name in used])
    PreTrainedTokenizerFast(tokenizer_object=tok, **hf).save_pretrained(folder)
    return ids


def write_sentence_transformer(source: Path, folder: Path, pooling: str, normalize: bool = True) -> Path:
    """source (a transformers folder) as a sentence-transformers folder: Transformer, Pooling, [Normalize]."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Normalize, Pooling, Transformer
    modules = [Transformer(str(source), max_seq_length=MAX_SEQ), Pooling(HIDDEN, pooling_mode=pooling)]
    SentenceTransformer(modules=modules + [Normalize()] * normalize, device="cpu").save(str(folder))
    return folder


XLMR_SPECIALS = ["<s>", "<pad>", "</s>", "<unk>", "<mask>"]


def _xlmr_config(ids: dict[str, int], model_type: str = "xlm-roberta", **extra):
    from transformers import RobertaConfig, XLMRobertaConfig
    # Positions count from pad_token_id + 1, so the table holds MAX_SEQ + 2 rows and more.
    config = XLMRobertaConfig if model_type == "xlm-roberta" else RobertaConfig
    return config(vocab_size=256 + len(ids), hidden_size=HIDDEN, num_hidden_layers=LAYERS,
                  num_attention_heads=HEADS, intermediate_size=INTERMEDIATE,
                  max_position_embeddings=MAX_SEQ + 8, type_vocab_size=1, pad_token_id=ids["<pad>"],
                  bos_token_id=ids["<s>"], eos_token_id=ids["</s>"], **extra)


def _xlmr_tokenizer(folder: Path) -> dict[str, int]:
    # XLM-R's template: <s> A </s> and <s> A </s> </s> B </s>, one segment id; no token_type_ids input.
    return write_tokenizer(folder, XLMR_SPECIALS, "<s> $A </s>", "<s> $A </s> </s> $B </s>", first=True,
                           bos_token="<s>", eos_token="</s>", unk_token="<unk>", pad_token="<pad>",
                           cls_token="<s>", sep_token="</s>", mask_token="<mask>",
                           model_input_names=["input_ids", "attention_mask"])


def write_xlm_roberta(folder: Path, seed: int = 0, model_type: str = "xlm-roberta") -> Path:
    """An XLMRobertaModel, or with model_type "roberta" a RobertaModel (the same layers and tokenizer template)."""
    from transformers import RobertaModel, XLMRobertaModel
    ids = _xlmr_tokenizer(folder)
    torch.manual_seed(seed)
    model = XLMRobertaModel if model_type == "xlm-roberta" else RobertaModel
    model(_xlmr_config(ids, model_type)).save_pretrained(folder)
    return folder


def write_xlm_roberta_reranker(folder: Path, seed: int = 1, model_type: str = "xlm-roberta") -> Path:
    from transformers import RobertaForSequenceClassification, XLMRobertaForSequenceClassification
    ids = _xlmr_tokenizer(folder)
    torch.manual_seed(seed)
    model = XLMRobertaForSequenceClassification if model_type == "xlm-roberta" else RobertaForSequenceClassification
    model(_xlmr_config(ids, model_type, num_labels=1)).save_pretrained(folder)
    return folder


def write_qwen3(folder: Path, seed: int = 2, model_type: str = "qwen3") -> Path:
    """A Qwen3ForCausalLM whose tokenizer appends <|endoftext|> and pads on the left, as Qwen3-Embedding's; with
    model_type "qwen2" a Qwen2ForCausalLM (gte-Qwen2's family: biased Q/K/V, no q/k norms) with the same."""
    from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM
    config, model = (Qwen3Config, Qwen3ForCausalLM) if model_type == "qwen3" else (Qwen2Config, Qwen2ForCausalLM)
    ids = write_tokenizer(folder, ["<|endoftext|>", "<|im_start|>", "<|im_end|>"], "$A <|endoftext|>", None,
                          first=False, eos_token="<|endoftext|>", pad_token="<|endoftext|>", padding_side="left")
    torch.manual_seed(seed)
    cfg = config(vocab_size=256 + len(ids), hidden_size=HIDDEN, intermediate_size=INTERMEDIATE,
                 num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=2,
                 max_position_embeddings=MAX_SEQ + 8, pad_token_id=ids["<|endoftext|>"],
                 eos_token_id=ids["<|endoftext|>"], tie_word_embeddings=True,
                 **({"head_dim": 16} if model_type == "qwen3" else {}))
    model(cfg).save_pretrained(folder)
    return folder


def write_modernbert(folder: Path, seed: int = 3) -> Path:
    """A ModernBertModel with global attention on every other layer and a window of 8 tokens on the rest,
    so that the test sentences (longer than 8 bytes) reach past it."""
    from transformers import ModernBertConfig, ModernBertModel
    ids = write_tokenizer(folder, ["[UNK]", "[CLS]", "[SEP]", "[PAD]", "[MASK]"], "[CLS] $A [SEP]",
                          "[CLS] $A [SEP] $B [SEP]", first=False, unk_token="[UNK]", cls_token="[CLS]",
                          sep_token="[SEP]", pad_token="[PAD]", mask_token="[MASK]",
                          model_input_names=["input_ids", "attention_mask"])
    torch.manual_seed(seed)
    cfg = ModernBertConfig(vocab_size=256 + len(ids), hidden_size=HIDDEN, intermediate_size=INTERMEDIATE,
                           num_hidden_layers=2 * LAYERS, num_attention_heads=HEADS, global_attn_every_n_layers=2,
                           local_attention=8, max_position_embeddings=MAX_SEQ + 8, pad_token_id=ids["[PAD]"],
                           bos_token_id=ids["[CLS]"], eos_token_id=ids["[SEP]"], cls_token_id=ids["[CLS]"],
                           sep_token_id=ids["[SEP]"])
    ModernBertModel(cfg).save_pretrained(folder)
    return folder
