"""``pagedllm simulate --calibrate``: fit the step-time model to the real engine on this machine,
then check it on workloads the fit did not see.

The engine runs a calibration trace (all requests at t=0); every step's FLOPs, bytes and sequence
count (``StepTimeModel.features`` of the step's ``SchedulerOutput``) and its measured seconds
become one sample. A least-squares fit of ``seconds = a * FLOPs + b * bytes + d * sequences``
(coefficients kept non-negative; ``fit``) gives this CPU's ``Device``: 1 / a FLOP/s, 1 / b bytes/s,
d seconds per sequence, compute and memory adding up (``overlap=False``). Held-out traces are
then run both ways -- the engine, and the simulator with the fitted device on the same scheduler
and pool -- and the output tokens/s compared.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np

from pagedllm.config import DTYPE_BYTES
from pagedllm.sim.engine_replay import replay
from pagedllm.sim.shapes import Device, ModelShape, get_device
from pagedllm.sim.simulator import StepTimeModel, simulate
from pagedllm.workloads.traces import TraceRequest, make_trace


def shape_of(model_config) -> ModelShape:
    c = model_config
    return ModelShape(c.architecture, c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim,
                      c.intermediate_size, c.vocab_size, tied_embeddings=c.tie_word_embeddings)


def at_once(trace: list[TraceRequest]) -> list[TraceRequest]:
    return [r.model_copy(update={"arrival": 0.0}) for r in trace]


def run_engine(llm, trace: list[TraceRequest], timing: StepTimeModel) -> dict:
    """Run ``trace`` (all at once) through the engine; per-step features and seconds, and tokens/s."""
    samples = []
    result = replay(llm.engine, trace, 0.0, on_step=lambda out, dt: samples.append((*timing.features(out), dt)))
    s = result.summary()
    return {"samples": samples, "seconds": s["makespan_s"], "output_tokens_per_s": s["output_tokens_per_s"]}


def fit(samples: list[tuple[float, float, int, float]], base: Device) -> Device:
    """Non-negative least squares of seconds over (FLOPs, bytes, sequences), no intercept: the
    weights' bytes are read every step, so the bytes term already carries the fixed part (an
    intercept beside it is nearly collinear and made the fit unstable). Drops the most negative
    coefficient and refits until none is negative. The device's rates become the fitted ones
    (``peak_flops`` = 1 / a, ``bandwidth`` = 1 / b, efficiencies 1): a rate per nominal byte, as
    ``StepTimeModel`` counts the weights at the model dtype whatever kernel reads them."""
    x = np.array([[f, b, n] for f, b, n, _ in samples], dtype=float)
    y = np.array([s for *_, s in samples])
    scale = x.max(axis=0)
    scale[scale == 0] = 1.0
    active = [0, 1, 2]
    while True:
        coef, *_ = np.linalg.lstsq(x[:, active] / scale[active], y, rcond=None)
        if (coef >= 0).all() or len(active) == 1:
            break
        active.pop(int(np.argmin(coef)))
    full = np.zeros(3)
    full[active] = np.maximum(coef, 0) / scale[active]
    a, b, d = full
    unbounded = 1e30  # a term the fit dropped: it costs nothing
    return dataclasses.replace(
        base, name="this CPU (fitted)", peak_flops=1 / a if a > 0 else unbounded,
        bandwidth=1 / b if b > 0 else unbounded, compute_efficiency=1.0, bandwidth_efficiency=1.0,
        step_overhead_s=0.0, seq_overhead_s=float(d), overlap=False)


def predicted_tokens_per_s(llm, trace: list[TraceRequest], timing: StepTimeModel) -> float:
    cfg = llm.engine.config
    res = simulate(trace, timing, cfg.cache, cfg.scheduler, llm.engine.kv_manager.num_blocks,
                   vocab_size=cfg.model.vocab_size)
    return res.summary()["output_tokens_per_s"]


def main(args) -> dict:
    from pagedllm import LLM

    llm = LLM(model=args.engine_model, dtype=args.dtype, block_size=args.block_size,
              max_num_seqs=args.max_num_seqs or 64, max_num_batched_tokens=args.max_num_batched_tokens or 1024)
    cfg = llm.engine.config
    shape = shape_of(cfg.model)
    base = get_device("this-cpu")
    dtype_bytes = DTYPE_BYTES[cfg.dtype]
    timing = StepTimeModel(shape, base, dtype_bytes, dtype_bytes)
    n = args.calibration_requests
    calibration = at_once(make_trace(args.calibration_workload, n, seed=args.seed))
    llm.generate([{"prompt_token_ids": [5, 6, 7]}], use_tqdm=False)  # warm-up
    measured = run_engine(llm, calibration, timing)
    device = fit(measured["samples"], base)
    fitted = dataclasses.replace(timing, device=device)
    report = {"engine": {"dtype": cfg.dtype, "block_size": cfg.cache.block_size,
                         "max_num_seqs": cfg.scheduler.max_num_seqs,
                         "max_num_batched_tokens": cfg.scheduler.max_num_batched_tokens},
              "calibration": {"workload": args.calibration_workload, "requests": n,
                              "steps": len(measured["samples"]),
                              "engine_tokens_per_s": round(measured["output_tokens_per_s"], 1),
                              "simulated_tokens_per_s": predicted_tokens_per_s(llm, calibration, fitted)},
              "device": dataclasses.asdict(device),
              "held_out": {}}
    for workload in args.validate.split(","):
        trace = at_once(make_trace(workload, n, seed=args.seed + 1))
        real = run_engine(llm, trace, timing)["output_tokens_per_s"]
        sim = predicted_tokens_per_s(llm, trace, fitted)
        report["held_out"][workload] = {"engine_tokens_per_s": round(real, 1), "simulated_tokens_per_s": sim,
                                        "error": round(sim / real - 1, 3)}
    d = report["device"]
    print(f"fitted on {n} {args.calibration_workload} requests ({report['calibration']['steps']} steps): "
          f"{d['peak_flops'] / 1e9:.1f} GFLOP/s + {d['bandwidth'] / 1e9:.2f} GB/s (weights at the model dtype, "
          f"K/V) + {1e3 * d['seq_overhead_s']:.3f} ms per sequence, added up")
    print(f"{'workload':<12}{'engine tok/s':>14}{'simulated':>12}{'error':>8}")
    c = report["calibration"]
    print(f"{args.calibration_workload + '*':<12}{c['engine_tokens_per_s']:>14}{c['simulated_tokens_per_s']:>12}"
          f"{c['simulated_tokens_per_s'] / c['engine_tokens_per_s'] - 1:>8.1%}")
    for w, r in report["held_out"].items():
        print(f"{w:<12}{r['engine_tokens_per_s']:>14}{r['simulated_tokens_per_s']:>12}{r['error']:>8.1%}")
    print("(* the calibration workload; the others are held out)")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return report
