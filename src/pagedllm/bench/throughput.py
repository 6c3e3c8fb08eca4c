"""``pagedllm bench throughput``: the same requests through pagedllm and through HF transformers.

pagedllm serves all requests at once with continuous batching. HF transformers runs
``generate`` in padded batches (left padding, ``batch_size`` requests each) of the same model
(loaded from the same file) in the same dtype; a batch runs until its longest request is done.
Both count *useful* generated tokens: what each request asked for (EOS ignored on both sides).
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from dataclasses import asdict, dataclass

import torch

from pagedllm.workloads.synthetic import BenchRequest, random_workload


@dataclass
class ThroughputResult:
    system: str
    seconds: float
    useful_tokens: int
    computed_tokens: int

    @property
    def tokens_per_s(self) -> float:
        return self.useful_tokens / self.seconds


def run_pagedllm(llm, requests: list[BenchRequest]) -> ThroughputResult:
    from pagedllm import SamplingParams

    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in requests]
    params = [SamplingParams(temperature=0.0, max_tokens=r.output_len, ignore_eos=True) for r in requests]
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    dt = time.perf_counter() - t0
    n = sum(len(o.outputs[0].token_ids) for o in outs)
    assert n == sum(r.output_len for r in requests)
    return ThroughputResult("pagedllm", dt, n, n)


def run_hf(model, requests: list[BenchRequest], batch_size: int, pad_id: int) -> ThroughputResult:
    t0 = time.perf_counter()
    computed = 0
    for i in range(0, len(requests), batch_size):
        batch = requests[i:i + batch_size]
        width = max(len(r.prompt_token_ids) for r in batch)
        ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for j, r in enumerate(batch):
            ids[j, width - len(r.prompt_token_ids):] = torch.tensor(r.prompt_token_ids)
            mask[j, width - len(r.prompt_token_ids):] = 1
        new = max(r.output_len for r in batch)
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=new,
                                 min_new_tokens=new, pad_token_id=pad_id, eos_token_id=None)
        computed += (out.shape[1] - width) * len(batch)
    dt = time.perf_counter() - t0
    return ThroughputResult("hf-transformers", dt, sum(r.output_len for r in requests), computed)


def load_hf_model(model_path, dtype: str):
    """A plain (dense) HF transformers model holding exactly the weights pagedllm serves.

    For a GGUF, transformers' own loader may keep weights packed and dequantize in every matmul,
    which would handicap it; so the HF model is built from the same dequantized tensors instead.
    """
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    from pagedllm.models.loader import load_weights

    if not str(model_path).endswith(".gguf"):
        return AutoModelForCausalLM.from_pretrained(str(model_path), dtype=getattr(torch, dtype)).eval()
    loaded = load_weights(model_path)
    c = loaded.config
    if c.rope_scaling.kind != "none":
        raise ValueError("the HF comparison supports GGUF models without RoPE scaling")
    common = dict(vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
                  num_hidden_layers=c.num_layers, num_attention_heads=c.num_heads,
                  num_key_value_heads=c.num_kv_heads, head_dim=c.head_dim,
                  max_position_embeddings=c.max_position_embeddings, rms_norm_eps=c.rms_norm_eps,
                  rope_theta=c.rope_theta, tie_word_embeddings=c.tie_word_embeddings)
    if c.architecture == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**common))
    else:
        model = LlamaForCausalLM(LlamaConfig(**common, attention_bias=c.attention_bias))
    missing, unexpected = model.load_state_dict(loaded.state_dict, strict=False)
    if unexpected or [m for m in missing if not (c.tie_word_embeddings and m == "lm_head.weight")]:
        raise RuntimeError(f"HF model weights mismatch: missing {missing}, unexpected {unexpected}")
    if c.tie_word_embeddings:
        model.tie_weights()
    return model.to(getattr(torch, dtype)).eval()


def main(args) -> dict:
    from pagedllm import LLM
    from pagedllm.workloads.synthetic import parse_range

    prompt_len = parse_range(args.prompt_len, "--prompt-len")
    output_len = parse_range(args.output_len, "--output-len")
    llm = LLM(model=args.model, dtype=args.dtype, block_size=args.block_size,
              kv_cache_memory=args.kv_cache_memory, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens, quantization=args.quantization)
    cfg = llm.engine.config
    requests = random_workload(args.num_requests, prompt_len, output_len, cfg.model.vocab_size, args.seed)
    warm = random_workload(2, (16, 16), (4, 4), cfg.model.vocab_size, args.seed + 1)
    run_pagedllm(llm, warm)
    results = [run_pagedllm(llm, requests)]
    print(f"pagedllm: {results[0].useful_tokens} tokens in {results[0].seconds:.2f}s", flush=True)
    stats = llm.kv_cache_stats()
    if not args.skip_hf:
        hf = load_hf_model(llm.engine.model_path, cfg.dtype)
        pad = next(iter(llm.engine.eos_token_ids), 0)
        run_hf(hf, warm, args.hf_batch_size, pad)
        results.append(run_hf(hf, requests, args.hf_batch_size, pad))
    report = {
        "machine": f"{platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}",
        "model": str(llm.engine.model_path.name), "dtype": cfg.dtype,
        "attention_backend": llm.engine.runner.backend.name,
        "num_requests": args.num_requests, "prompt_len": args.prompt_len, "output_len": args.output_len,
        "hf_batch_size": args.hf_batch_size, "block_size": cfg.cache.block_size,
        "num_kv_blocks": stats["num_blocks"], "num_preemptions": stats["num_preemptions"],
        "results": [{**asdict(r), "tokens_per_s": round(r.tokens_per_s, 1)} for r in results],
    }
    print(f"model {report['model']}  dtype {cfg.dtype}  backend {report['attention_backend']}  "
          f"{args.num_requests} requests, prompt {args.prompt_len}, output {args.output_len}")
    print(f"{'system':<18}{'seconds':>9}{'useful tok':>12}{'computed tok':>14}{'tok/s':>9}")
    for r in results:
        print(f"{r.system:<18}{r.seconds:>9.2f}{r.useful_tokens:>12}{r.computed_tokens:>14}{r.tokens_per_s:>9.1f}")
    if len(results) == 2:
        ratio = results[0].tokens_per_s / results[1].tokens_per_s
        report["ratio_pagedllm_over_hf"] = round(ratio, 2)
        print(f"pagedllm / HF transformers: {ratio:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return report


def add_cli_args(p: argparse.ArgumentParser) -> None:
    """``pagedllm bench throughput``'s flags."""
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--prompt-len", default="32:512", help="N or MIN:MAX (uniform)")
    p.add_argument("--output-len", default="16:256", help="N or MIN:MAX (uniform)")
    p.add_argument("--hf-batch-size", type=int, default=32)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=1024)
    p.add_argument("--skip-hf", action="store_true", help="measure pagedllm only")
