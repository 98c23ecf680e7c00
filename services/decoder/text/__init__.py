"""Text handling: tokenizer, chat template, incremental detokenisation, stop strings, one choice's text stream."""
