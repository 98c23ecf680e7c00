"""vLLM side of bench/decoder.py; runs inside .venv-peers. Prompts (token ids) on stdin, JSON result last."""
import argparse
import json
import sys
import time


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--dtype", default="fp32")
    ap.add_argument("--max-tokens", type=int, default=128)
    args = ap.parse_args()
    batch = json.loads(sys.stdin.read())
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    llm = LLM(model=args.model, dtype={"fp32": "float32", "bf16": "bfloat16"}[args.dtype],
              max_model_len=4096, enable_prefix_caching=True)
    sp = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    llm.generate([TokensPrompt(prompt_token_ids=batch[0])], SamplingParams(max_tokens=4), use_tqdm=False)
    start = time.perf_counter()
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in batch], sp, use_tqdm=False)
    seconds = time.perf_counter() - start
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    print(json.dumps({"tok_s": sum(map(len, tokens)) / seconds, "seconds": seconds, "outputs": tokens}))


if __name__ == "__main__":
    main()
