"""Engine construction: options resolved, weights loaded and finalised, the engine built around them.

``build_engine`` turns ``EngineOptions`` (or their fields as keywords) into a running ``Engine``:
the model path and weights, the dtype and quantization each resolved for this device, the CPU
family's kernel plan (``models/kernel_plan.py``), the scheduler's limits, the network built on the
meta device and loaded, the tokenizer. A bad option raises ``ConfigError`` before anything loads.
Everything alive when it returns lives as long as the engine, so it is moved out of the cyclic
GC's scans (as vLLM does); that is the builder's business, not the engine's.
"""

from __future__ import annotations

import atexit
import dataclasses
import functools
import gc
import logging
import time

import torch
from pydantic import ValidationError

from pagedllm import cpu_features
from pagedllm.attention.backends import get_backend
from pagedllm.attention.cpu_kernel import load_cpu_kernel
from pagedllm.config import DEFAULT_STEP_TOKENS, EngineConfig, EngineOptions, describe_error
from pagedllm.dtypes import torch_dtype
from pagedllm.engine.engine import Engine
from pagedllm.errors import ConfigError
from pagedllm.kvstore.quant import accuracy_warning
from pagedllm.kvstore.spec import kv_spec_for
from pagedllm.models import decoder_stack
from pagedllm.models.kernel_plan import plan_kernels
from pagedllm.models.layer_ops import CpuLayerOps, get_layer_ops
from pagedllm.models.loader import load_weights, resolve_dtype, resolve_model_path
from pagedllm.models.quantization import QUANTIZATION_METHODS, resolve_quantization
from pagedllm.models.quantized_linear import Linear
from pagedllm.models.registry import model_class
from pagedllm.models.tokenizer import Tokenizer

log = logging.getLogger(__name__)


def choose_backend(name: str, device: str, model, cache, dtype: torch.dtype):
    """The attention backend ``name`` gives on ``device``; with ``auto``, the reference where the
    chosen one cannot read ``cache.kv_cache_dtype`` (said once in the log). A named backend that
    cannot read it raises ``ConfigError`` when the engine is built."""
    backend = get_backend(name, device, model.head_dim)
    if name != "auto" or backend.name == "reference":
        return backend
    try:
        backend.check_kv_spec(kv_spec_for(model, cache.block_size, cache.kv_cache_dtype, dtype), dtype)
    except ConfigError as e:
        log.warning("attention: %s; kv_cache_dtype=%s runs on the reference backend", e, cache.kv_cache_dtype)
        return get_backend("reference", device, model.head_dim)
    return backend


@dataclasses.dataclass
class LoadedShard:
    """One rank's model, ready to run: its ``EngineConfig`` (the whole model's shape), the network
    (the shard's shape, finalised), its backend and kernel plan."""

    config: EngineConfig
    net: object
    backend: object
    plan: object
    path: object
    load_seconds: float


def resolve_options(options: EngineOptions | None = None, overrides: dict | None = None) -> EngineOptions:
    """``EngineOptions`` from options and/or keyword overrides; a bad option raises ``ConfigError``."""
    try:
        if options is None:
            return EngineOptions(**(overrides or {}))
        return dataclasses.replace(options, **overrides) if overrides else options
    except ValidationError as e:
        raise ConfigError(describe_error(e)) from None


def load_shard(options: EngineOptions, tensor_parallel=None, weights=None) -> LoadedShard:
    """Load and finalise the model per ``options``: the whole of it, or with ``tensor_parallel``
    (``parallel/ranks.py``'s ``RankHandle``: ``rank``, ``world_size``, ``shard(weights)``,
    ``all_reduce_``) this rank's share, whose row-parallel outputs it sums over the ranks.
    ``weights``: already loaded (else read from the model path)."""
    device, dtype = options.device, options.dtype
    cache = options.cache_config()
    if cache.kv_layout != "paged" and cache.enable_prefix_caching:
        cache = dataclasses.replace(cache, enable_prefix_caching=False)
    layer_ops = get_layer_ops(device)  # may compile C++ on first use: not part of the load time
    if isinstance(layer_ops, CpuLayerOps):
        decoder_stack.EXTENSION.load()  # the same, for the C++ layer loop finalize builds
        load_cpu_kernel()  # and the C++ attention kernel
    t0 = time.perf_counter()
    path = resolve_model_path(options.model)
    if weights is None:
        weights = load_weights(path)
    mcfg = weights.config
    max_model_len = options.max_model_len
    if max_model_len is None:
        max_model_len = mcfg.max_position_embeddings
    elif max_model_len > mcfg.max_position_embeddings:
        raise ConfigError(f"max_model_len={max_model_len} exceeds the model's context length "
                          f"({mcfg.max_position_embeddings})")
    resolved_dtype = resolve_dtype(dtype, device)
    # the kernels this CPU family runs best (kernel_plan): e.g. bf16/fp16 GEMMs in float32 on
    # CPUs without native bf16/fp16 dot products (3-4x faster), each family's crossovers, and the
    # step budget its GEMMs run best at
    plan = plan_kernels(cpu_features.current(), torch_dtype(resolved_dtype)) if device == "cpu" else None
    if plan is not None and plan.dense_kernel == "panels" and not (
            isinstance(layer_ops, CpuLayerOps) and layer_ops.ops.has_panel_linear()):
        plan = dataclasses.replace(plan, dense_kernel="onednn")  # the panel GEMM lives in the C++ layer ops
    scheduler = options.scheduler_config(max_model_len, plan.step_tokens if plan else DEFAULT_STEP_TOKENS)
    config = EngineConfig(model=mcfg, cache=cache, scheduler=scheduler,
                          dtype=resolved_dtype, device=device, seed=options.seed,
                          quantization=resolve_quantization(options.quantization, weights, resolved_dtype, device),
                          tensor_parallel_size=options.tensor_parallel_size, events=options.events_config(),
                          speculative=options.speculative_config)
    if tensor_parallel is not None:
        weights = tensor_parallel.shard(weights)  # the rank's slices, its config the shard's shape
    with torch.device("meta"):
        net = model_class(mcfg.architecture)(weights.config, torch_dtype(config.dtype), max_model_len, device=device,
                                             layer_ops=layer_ops)
    net.load_hf_state_dict(weights.state_dict)
    net.eval()
    if tensor_parallel is not None:
        net.reduce_partial = tensor_parallel.all_reduce_
    backend = choose_backend(options.attention_backend, device, weights.config, cache, torch_dtype(config.dtype))
    quantize = functools.partial(QUANTIZATION_METHODS[config.quantization].apply, weights=weights, plan=plan)
    net.finalize(backend, options.layer_loop, plan=plan, quantize=quantize)  # the end of loading
    del quantize, weights  # free the unfused weights before the KV pool is sized and allocated
    return LoadedShard(config, net, backend, plan, path, time.perf_counter() - t0)


INERT_SPECULATION = "speculation inert"  # the start warning's first words where the row limit is under 2


def exact_row_limit(net) -> int | None:
    """The most rows a step may have and still run every projection's small-step quantized kernel
    (GGUF / AWQ / int8 weights), which computes each row alone, bit for bit whatever the rows
    beside it; None where no projection has one."""
    limits = [m.max_rows for m in net.modules() if isinstance(m, Linear) and m.small_batch is not None]
    return min(limits) if limits else None


def build_engine(options: EngineOptions | None = None, tensor_parallel=None, weights=None, **overrides) -> Engine:
    """Load a model and build an engine from ``EngineOptions`` (or its fields as keywords; see
    ``pagedllm.config`` for what each option means). A bad option raises ``ConfigError``.
    ``tensor_parallel_size > 1`` is started by ``pagedllm.parallel.launch.build_engine`` (``LLM``, the
    CLI and the server use it), which passes rank 0's handle as ``tensor_parallel``."""
    options = resolve_options(options, overrides)
    if options.tensor_parallel_size > 1 and tensor_parallel is None:
        raise ConfigError("tensor_parallel_size > 1 starts worker processes: build the engine with "
                          "pagedllm.parallel.launch.build_engine (LLM, the CLI and the server do)")
    shard = load_shard(options, tensor_parallel, weights)
    t0 = time.perf_counter()
    tokenizer = Tokenizer.load(shard.path, shard.path.suffix == ".gguf")
    load_seconds = shard.load_seconds + time.perf_counter() - t0  # weights + tokenizer; not the kernel builds
    engine = Engine(shard.config, shard.net, tokenizer, shard.backend, tensor_parallel)
    if (warning := accuracy_warning(engine.kv_spec.kv_cache_dtype)) is not None:
        log.warning(warning)
    config = shard.config
    if config.cache.kv_cache_scales is not None:
        heads = engine.runner.kv.layers[0].static_scales
        log.info("kv_cache_scales: %s KV rows encoded with static scales (layer 0: K %s, V %s)",
                 engine.kv_spec.kv_cache_dtype, heads[0].tolist(), heads[1].tolist())
    if tensor_parallel is not None and options.layer_loop == "auto" and shard.plan is not None:
        log.warning("tensor_parallel_size=%d: the C++ decoder stack has no all-reduce between its layers, so each "
                    "rank runs the Python layer loop (docs/tensor_parallel.md gives the cost)",
                    options.tensor_parallel_size)
    engine.load_seconds = load_seconds
    engine.kernel_plan = shard.plan
    if engine.scheduler.drafter is not None:  # guesses keep a step within its rows' exact kernels
        limit = exact_row_limit(shard.net)
        engine.scheduler.drafter.row_limit = limit
        if limit is not None and limit < 2:
            log.warning("%s: speculative decoding will make no guesses with this model here: its small-step "
                        "kernels compute rows alone only %d at a time, and a guess is verified only in a step "
                        "whose every row is (docs/speculative.md)", INERT_SPECULATION,
                        limit)
    engine.model_path = shard.path
    # Everything alive now lives as long as the engine: keep it out of the cyclic GC's scans
    # (hundreds of thousands of objects after importing torch and transformers), as vLLM does.
    gc.collect()
    gc.freeze()
    atexit.unregister(gc.unfreeze)  # registered once per process
    atexit.register(gc.unfreeze)    # let interpreter shutdown collect them as usual
    return engine
