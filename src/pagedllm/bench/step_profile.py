"""``pagedllm bench step``: where one decode step's time goes, at a given batch size.

Fills the engine with ``batch`` requests, prefills them, then times ``steps`` decode steps and
splits the step time into: matmuls (dense ``aten::mm``/``addmm``, oneDNN's prepacked
``mkldnn::_linear_pointwise`` and the int4 weight-only matmul from the torch profiler, plus the
C++ Q8_0 and 4-bit kernels, timed), attention (the backend's fused call,
with RoPE and the K/V store where it fuses them), the other ops (norms and activations, in C++ or
torch, argmax, ...), and the rest: Python in the model, scheduler, runner, sampler and detokenizer,
taken as the unprofiled step's time minus the measured ops (the profiler's own cost per recorded
op would otherwise count as Python). Where the C++ decoder stack runs the layers
(``models/decoder_stack.py``), its calls of our ops reach the profiler as ``pagedllm::*`` records.
"""

from __future__ import annotations

import argparse
import json
import time
from contextlib import contextmanager

import torch
from torch.profiler import ProfilerActivity, profile

from pagedllm.bench.timers import time_calls

ROUNDS = 4  # alternations of plain and profiled steps
STACK_ATTENTION = "pagedllm::rope_store_attend"  # the C++ decoder stack's RECORD_FUNCTION names: pagedllm::*
# our C++ matmul kernels (layer ops): timed when Python calls them, pagedllm::NAME records when the stack does
CPP_MATMULS = ("q8_0_linear", "q4_linear", "q4_tiles_linear", "q8_0_tiles_linear", "panel_linear")
MATMUL_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::_weight_int4pack_mm_for_cpu",
              "mkldnn::_linear_pointwise", *(f"pagedllm::{name}" for name in CPP_MATMULS))


@contextmanager
def timing(timers):
    """``time_calls`` on each (object, method, bucket) for the block, the methods restored after."""
    for obj, name, bucket in timers:
        time_calls(obj, name, bucket)
    try:
        yield
    finally:
        for obj, name, _ in timers:
            delattr(obj, name)  # the instance's wrapper: the class's method shows through again


def main(args) -> dict:
    from pagedllm import LLM, SamplingParams

    llm = LLM(model=args.model, dtype=args.dtype, attention_backend=args.attention_backend,
              quantization=args.quantization,
              block_size=args.block_size, kv_cache_memory=args.kv_cache_memory, max_num_seqs=max(64, args.batch),
              layer_loop=args.layer_loop)
    engine = llm.engine
    gen = torch.Generator().manual_seed(0)
    vocab = engine.config.model.vocab_size
    for i in range(args.batch):
        engine.add_request(str(i), torch.randint(100, vocab, (args.context,), generator=gen).tolist(),
                           SamplingParams(temperature=0, max_tokens=2 * args.steps + 8, ignore_eos=True))
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.requests.values()):
        engine.step()
    for _ in range(3):
        engine.step()
    attention, cpp_matmul, cpp_other, model_s = [0.0], [0.0], [0.0], [0.0]
    backend, model = engine.runner.backend, engine.runner.model
    layer_ops = model.layer_ops
    # C++ ops called from Python are invisible to the torch profiler, so they are timed by wrappers,
    # installed for the profiled blocks only (their own cost would otherwise land in the plain steps)
    op_timers = [(backend, "rope_store_attend" if backend.fuses_rope else "store_and_attend", attention)]
    if hasattr(layer_ops, "q8_0_linear"):
        op_timers += [(layer_ops, name, cpp_matmul) for name in CPP_MATMULS if hasattr(layer_ops, name)]
        op_timers += [(layer_ops, name, cpp_other) for name in ("rms_norm", "add_rms_norm", "silu_mul")]
    # the plain blocks time the model's forward and LM head: what the step spends outside them
    # (scheduler, runner, sampler, outputs) needs no profiler
    model_timers = [(model, "forward", model_s), (model, "compute_logits", model_s)]
    # Profiled and plain blocks of steps alternate (ROUNDS of each), so that the machine's drift
    # (+-30% within minutes here) lands on both sides instead of between them.
    per_round = max(1, args.steps // ROUNDS)
    ops: dict[str, float] = {}
    timed = {"attention": 0.0, "cpp_matmul": 0.0, "cpp_other": 0.0}
    profiled_s = plain_s = 0.0
    for _ in range(ROUNDS):
        with timing(model_timers):
            t1 = time.perf_counter()
            for _ in range(per_round):
                engine.step()
            plain_s += time.perf_counter() - t1
        before = {"attention": attention[0], "cpp_matmul": cpp_matmul[0], "cpp_other": cpp_other[0]}
        with timing(op_timers):
            t0 = time.perf_counter()
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                for _ in range(per_round):
                    engine.step()
            profiled_s += time.perf_counter() - t0
        for k, bucket in (("attention", attention), ("cpp_matmul", cpp_matmul), ("cpp_other", cpp_other)):
            timed[k] += bucket[0] - before[k]
        for e in prof.key_averages():
            ops[e.key] = ops.get(e.key, 0.0) + e.self_cpu_time_total / 1e6
    n = per_round * ROUNDS
    total, plain = profiled_s / n, plain_s / n
    ops = {k: v / n for k, v in ops.items()}
    matmul = sum(v for k, v in ops.items() if k in MATMUL_OPS) + timed["cpp_matmul"] / n
    # the C++ decoder stack (models/decoder_stack.py) calls our ops from C++, named for the profiler
    stack_attention = ops.get(STACK_ATTENTION, 0.0)
    other_ops = sum(v for k, v in ops.items() if (k.startswith("aten::") and k not in MATMUL_OPS)
                    or (k.startswith("pagedllm::") and k not in (STACK_ATTENTION, *MATMUL_OPS))) + (
        timed["cpp_other"] / n)
    attention_s = timed["attention"] / n + stack_attention
    # The profiler's own bookkeeping (microseconds per recorded op, between the ops) inflates the
    # profiled step by a fifth at batch 1: Python and glue is what the unprofiled step spends
    # outside the measured ops, and every share is of the unprofiled step.
    glue = max(0.0, plain - matmul - attention_s - other_ops)
    parts = {"matmul (linear layers, LM head)": matmul, "attention (write K/V + paged attention)": attention_s,
             "other ops (norms, activations, argmax...)": max(0.0, other_ops), "Python and glue": glue}
    stack = model.decoder_stack(backend) is not None
    outside = max(0.0, plain - model_s[0] / n)
    report = {"batch": args.batch, "context": args.context, "dtype": engine.config.dtype,
              "layer_loop": "C++ decoder stack" if stack else "Python", "kernels": engine.kernels_line(),
              "backend": backend.name, "quantization": engine.config.quantization, "step_ms": round(plain * 1000, 2),
              "tokens_per_s": round(args.batch / plain, 1),
              "profiled_step_ms": round(total * 1000, 2),
              "parts_ms": {k: round(v * 1000, 2) for k, v in parts.items()},
              "shares": {k: round(v / plain, 3) for k, v in parts.items()},
              "outside_model_ms": round(outside * 1000, 2), "outside_model_share": round(outside / plain, 3)}
    print(f"batch {args.batch}, context ~{args.context}, {engine.config.dtype}, {backend.name} attention, "
          f"quantization {engine.config.quantization}, {report['layer_loop']} layer loop: "
          f"{report['step_ms']} ms per decode step = {report['tokens_per_s']} tok/s")
    print(report["kernels"])
    print(f"{'part':<42}{'ms/step':>9}{'share':>8}   (op times from a profiled run of "
          f"{report['profiled_step_ms']} ms per step)")
    for k, v in parts.items():
        print(f"{k:<42}{v * 1000:>9.2f}{100 * v / plain:>7.1f}%")
    print(f"outside the model's forward and LM head (scheduler, runner, sampler, outputs; timed without the "
          f"profiler): {outside * 1000:.2f} ms = {100 * outside / plain:.1f}%")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return report


def add_cli_args(p: argparse.ArgumentParser) -> None:
    """``pagedllm bench step``'s flags."""
    p.add_argument("--attention-backend", default="auto", choices=["auto", "cpu", "reference"])
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--layer-loop", default="auto", choices=["auto", "python"],
                   help="auto: the C++ decoder stack where it applies; python: the Python layer loop (for A/B)")
