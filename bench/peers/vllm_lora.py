"""vLLM side of bench/lora.py; runs inside .venv-peers. Input JSON on stdin, result as the last JSON line.

stdin: {"prompts": [[token ids]...], "adapters": [row's adapter name or null], "folders": {name: path}},
optionally "max_loras" (8), "max_cpu_loras" (vLLM's default: max_loras) and "max_lora_rank" (16).
One LLM with enable_lora=True and those limits; each row gets its own LoRARequest. The same batch is also
run with no LoRARequest at all (vLLM's own adapter overhead, for the record).
"""
import argparse
import json
import sys
import time


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--max-tokens", type=int, default=64)
    args = ap.parse_args()
    job = json.loads(sys.stdin.read())
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.lora.request import LoRARequest

    ids = {name: i + 1 for i, name in enumerate(sorted(job["folders"]))}  # lora_int_id must be >= 1
    requests = {name: LoRARequest(name, ids[name], path) for name, path in job["folders"].items()}
    max_loras = job.get("max_loras", 8)
    llm = LLM(model=args.model, dtype="float32", max_model_len=2048, enable_lora=True, max_loras=max_loras,
              max_cpu_loras=job.get("max_cpu_loras") or max_loras, max_lora_rank=job.get("max_lora_rank", 16),
              max_num_seqs=64, enable_prefix_caching=False)
    prompts = [TokensPrompt(prompt_token_ids=p) for p in job["prompts"]]
    sp = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    # Warm-up: every adapter loaded into its slot, and the engine's first-call costs paid, before timing.
    warm = sorted(requests)[:max_loras]
    llm.generate(prompts[:len(warm)], SamplingParams(max_tokens=2), lora_request=[requests[n] for n in warm],
                 use_tqdm=False)
    result = {}
    for label, lora in (("lora", [requests[a] if a else None for a in job["adapters"]]), ("base", None)):
        start = time.perf_counter()
        outs = llm.generate(prompts, sp, lora_request=lora, use_tqdm=False)
        seconds = time.perf_counter() - start
        tokens = [list(o.outputs[0].token_ids) for o in outs]
        result[label] = {"tok_s": sum(map(len, tokens)) / seconds, "seconds": seconds, "outputs": tokens}
    print(json.dumps({"tok_s": result["lora"]["tok_s"], **result}))


if __name__ == "__main__":
    main()
