"""vLLM side of bench/decoder.py and bench/speculative.py; runs inside .venv-peers. Prompts (token ids) on
stdin, JSON result last. --speculative-config passes vLLM's own; --sequential runs one prompt at a time."""
import argparse
import json
import sys
import time


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--dtype", default="fp32")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--speculative-config", default="")
    ap.add_argument("--sequential", action="store_true")
    args = ap.parse_args()
    batch = json.loads(sys.stdin.read())
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    extra = {"speculative_config": json.loads(args.speculative_config)} if args.speculative_config else {}
    llm = LLM(model=args.model, dtype={"fp32": "float32", "bf16": "bfloat16"}[args.dtype],
              max_model_len=4096, enable_prefix_caching=True, **extra)
    sp = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    llm.generate([TokensPrompt(prompt_token_ids=batch[0])], SamplingParams(max_tokens=4), use_tqdm=False)
    start = time.perf_counter()
    groups = [[p] for p in batch] if args.sequential else [batch]
    outs = [o for g in groups for o in llm.generate([TokensPrompt(prompt_token_ids=p) for p in g], sp, use_tqdm=False)]
    seconds = time.perf_counter() - start
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    print(json.dumps({"tok_s": sum(map(len, tokens)) / seconds, "seconds": seconds, "outputs": tokens}))


if __name__ == "__main__":
    main()
