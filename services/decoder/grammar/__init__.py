"""Structured outputs: constraints (JSON schema, any JSON object, regex, choice, EBNF) compiled with
xgrammar and enforced by masking the sampler's logits.

    spec.py      GrammarSpec: what a request asks for, checked (no xgrammar)
    compiler.py  GrammarCompiler: spec -> Grammar on compile threads with a deadline, cached (server side)
    pool.py      CompilePool: the compile threads; one past the deadline is written off and replaced
    cache.py     FutureCache: one compile per spec, an LRU bounded by entries and bytes
    compiled.py  Grammar (shared, read-only) and the vocabulary's static token bits
    state.py     GrammarState: one request's matcher; GrammarStates: the runner's, by request id
    mask.py      GrammarMasks: one step's masks, filled in a batch and applied (sampler side)

Why xgrammar 0.2.8 and not llguidance 1.9.1, measured on SmolLM2-135M-Instruct's tokenizer with the
model's logits width (config vocab_size 49,152), 2 threads, a nested schema (an object with a string,
an integer, an array of strings, an enum and a nested object), walking a 55-token document:

    median                          xgrammar          llguidance (numpy path)
    compile + first mask            4.6 ms            0.6-0.9 ms
    1 row:   mask fill              0.001-0.025 ms    0.011-0.09 ms
    64 rows: mask fill (batched)    0.5-0.8 ms        1.4-2.9 ms
    64 rows: accept tokens          0.14-0.4 ms       0.25-0.67 ms
    64 rows: apply to logits        7-12 ms (C++)     9.4-10.5 ms (numpy)

(random masks for "apply"; on real schema masks, mostly a few allowed tokens, xgrammar's C++ kernel
takes 8.2 ms and our unpacked torch.where 1.3 ms: mask.py times both at load and keeps the faster.)
The per-step cost is paid on every token of every constrained row, the compile once per distinct
schema (and cached), so the per-step fill decides; xgrammar also brings a CPU (and Triton) kernel
that masks only the listed rows of the batch. Its extra dependency is apache-tvm-ffi; it imports
torch and transformers, which the decoder has already.
"""
