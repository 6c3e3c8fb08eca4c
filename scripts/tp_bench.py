"""Tensor parallelism on this machine: KV blocks per rank and output tokens/s at N ranks against
one (docs/tensor_parallel.md, "Measured"). Each configuration is built, warmed up with one short
request, then timed on the same prompts (greedy, fixed lengths, prefix caching off so no run is
served by an earlier one's cache); configurations alternate over ``--rounds`` rounds and the
medians are reported.

    .venv/bin/python scripts/tp_bench.py --rounds 3                 # the default model, N = 1 and 3
    .venv/bin/python scripts/tp_bench.py --tiny --rounds 3          # a tiny random Llama, N = 1 and 2

The default model runs at float32 (its float32 C++ decoder stack at N=1, and the Python layer loop
at N=1 too: what N=3 runs per rank).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

from pagedllm import LLM, SamplingParams


def tiny_checkpoint(folder: str) -> str:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=4096, hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
                      num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=2048)
    LlamaForCausalLM(cfg).save_pretrained(folder)
    return folder


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--kv-cache-memory", default="64MiB")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    model = tiny_checkpoint(tempfile.mkdtemp()) if args.tiny else None
    sizes = (1, 2) if args.tiny else (1, 3)
    configs = {f"N={n}": {"tensor_parallel_size": n} for n in sizes}
    configs["N=1 python loop"] = {"tensor_parallel_size": 1, "layer_loop": "python"}
    engines = {name: LLM(model=model, dtype="float32", kv_cache_memory=args.kv_cache_memory,
                         enable_prefix_caching=False, **opts) for name, opts in configs.items()}
    vocab = engines["N=1"].engine.vocab_size
    prompts = [{"prompt_token_ids": [(7 + 31 * i + 17 * j) % (vocab - 10) + 5 for j in range(args.prompt_len)]}
               for i in range(args.requests)]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    times: dict[str, list[float]] = {name: [] for name in engines}
    for llm in engines.values():
        llm.generate(prompts[:1], SamplingParams(max_tokens=4), use_tqdm=False)
    for _ in range(args.rounds):
        for name, llm in engines.items():
            t0 = time.perf_counter()
            llm.generate(prompts, params, use_tqdm=False)
            times[name].append(time.perf_counter() - t0)
    tokens = args.requests * args.max_tokens
    report = {"model": "tiny Llama (hidden 512, 8 layers, 8 heads, 4 KV heads)" if args.tiny else "SmolLM2-135M",
              "requests": args.requests, "prompt_len": args.prompt_len, "max_tokens": args.max_tokens,
              "kv_cache_memory": args.kv_cache_memory, "rows": {}}
    for name, llm in engines.items():
        median = statistics.median(times[name])
        report["rows"][name] = {"blocks_per_rank": llm.engine.kv_manager.num_blocks,
                                "kv_heads_per_rank": llm.engine.kv_spec.num_kv_heads,
                                "output_tokens_per_s": round(tokens / median, 1),
                                "seconds": [round(t, 2) for t in times[name]]}
        print(f"{name:<16} KV heads/rank {llm.engine.kv_spec.num_kv_heads}  blocks/rank "
              f"{llm.engine.kv_manager.num_blocks:>5}  {tokens / median:7.1f} out tok/s (median of {args.rounds})")
    for llm in engines.values():
        llm.shutdown()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
