"""Engine: the request loop. ``add_request`` -> ``step()`` (schedule, run, update) -> outputs.

Owns the scheduler (and through it the KV cache manager), the model runner, the tokenizer and
each live request's output state (detokenizer, stop strings). Validates a request completely
before it enters the queue, so a bad request never disturbs the others.
"""

from __future__ import annotations

import atexit
import gc
import itertools
import logging
import time
from dataclasses import dataclass, field

import torch

from pagedllm.attention.backends import get_backend
from pagedllm.config import QUANTIZATIONS, CacheConfig, EngineConfig, SchedulerConfig, parse_bytes
from pagedllm.engine.model_runner import ModelRunner
from pagedllm.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from pagedllm.engine.request import Request, RequestStatus
from pagedllm.engine.sampler import TokenLogprobs
from pagedllm.engine.sampling_params import SamplingParams
from pagedllm.engine.scheduler import Scheduler
from pagedllm.errors import InvalidRequest, RequestTooLong
from pagedllm.kvcache.contiguous import ContiguousKVCacheManager
from pagedllm.kvcache.manager import KVCacheManager
from pagedllm.kvstore.host_tier import HostTier
from pagedllm.kvstore.storage import KVCacheStorage, bytes_per_block, num_blocks_for
from pagedllm.models.layer_ops import get_layer_ops
from pagedllm.models.llama import LlamaForCausalLM
from pagedllm.models.loader import LoadedWeights, load_weights, resolve_dtype, resolve_model_path
from pagedllm.models.tokenizer import IncrementalDetokenizer, Tokenizer

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class _OutputState:
    """Per-sequence output bookkeeping: the detokenized completion and how it finished."""

    request: Request
    index: int
    detok: IncrementalDetokenizer | None
    text: str = ""
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[dict[int, float]] | None = None
    cumulative_logprob: float | None = None
    max_stop_len: int = field(init=False)

    def __post_init__(self) -> None:
        self.max_stop_len = max((len(s) for s in self.request.sampling_params.stop_strings), default=0)

    def completion(self) -> CompletionOutput:
        return CompletionOutput(self.index, self.text, list(self.request.output_token_ids), self.finish_reason,
                                self.stop_reason, self.cumulative_logprob,
                                None if self.logprobs is None else list(self.logprobs))

    def add_logprobs(self, token: int, lp: TokenLogprobs) -> None:
        if self.logprobs is None:
            self.logprobs, self.cumulative_logprob = [], 0.0
        self.logprobs.append({**lp.top, token: lp.token_logprob})
        self.cumulative_logprob += lp.token_logprob


@dataclass
class _Group:
    """One user request: its prompt and its n sequences (n > 1 for parallel sampling)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    seqs: list[_OutputState]
    arrival_time: float

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.seqs)


def resolve_quantization(quantization: str, weights: LoadedWeights, dtype: str, device: str) -> str:
    """``auto`` -> ``gguf`` for a GGUF with Q4_0/Q4_1/Q8_0 tensors on CPU in bf16/fp16 (the fast
    path), else ``none``; an explicit ``gguf`` that cannot apply is an error."""
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {quantization!r}")
    usable = bool(weights.quantized) and device == "cpu"
    if quantization == "auto":
        return "gguf" if usable and dtype != "float32" else "none"
    if quantization == "gguf" and not usable:
        why = "runs on CPU only" if weights.quantized else "needs a GGUF model with Q4_0, Q4_1 or Q8_0 tensors"
        raise ValueError(f"quantization='gguf' {why}")
    return quantization


class Engine:
    """Continuous-batching inference engine over a paged KV cache."""

    def __init__(self, config: EngineConfig, model: LlamaForCausalLM, tokenizer: Tokenizer | None,
                 attention_backend: str = "auto") -> None:
        self.config = config
        self.tokenizer = tokenizer
        dtype = _DTYPES[config.dtype]
        num_blocks = num_blocks_for(config.model, config.cache, dtype)
        cc = config.cache
        swapping = config.scheduler.preemption_mode == "swap" and cc.kv_layout == "paged"
        num_host_blocks = parse_bytes(cc.swap_space, "swap_space") // bytes_per_block(
            config.model, cc.block_size, dtype) if swapping else 0
        if cc.kv_layout == "contiguous":
            self.kv_manager = ContiguousKVCacheManager(num_blocks, cc.block_size, config.scheduler.max_model_len,
                                                       cc.contiguous_reservation)
        else:
            self.kv_manager = KVCacheManager(num_blocks, cc.block_size, cc.enable_prefix_caching, cc.eviction_policy,
                                             num_host_blocks)
        self.scheduler = Scheduler(config.scheduler, self.kv_manager)
        storage = KVCacheStorage.allocate(config.model, num_blocks, config.cache.block_size, dtype, config.device)
        backend = get_backend(attention_backend, config.device, config.model.head_dim)
        host = HostTier(storage, num_host_blocks) if num_host_blocks else None
        self.runner = ModelRunner(model, storage, backend, torch.device(config.device), host)
        eos = set(config.model.eos_token_ids)
        if tokenizer is not None and tokenizer.eos_token_id is not None:
            eos.add(tokenizer.eos_token_id)
        self.eos_token_ids = frozenset(eos)
        self._groups: dict[str, _Group] = {}        # user request id -> its sequences
        self._seq_group: dict[str, _Group] = {}     # live sequence id -> its group
        self._counter = itertools.count()
        self._seed_rng = torch.Generator().manual_seed(config.seed)

    # -- construction ------------------------------------------------------------------------
    @classmethod
    def from_options(cls, model: str | None = None, dtype: str = "auto", block_size: int = 16,
                     kv_cache_memory: int | str = "512MiB", num_kv_blocks: int | None = None,
                     max_num_seqs: int = 64, max_num_batched_tokens: int = 1024,
                     max_model_len: int | None = None, seed: int = 0, device: str = "cpu",
                     attention_backend: str = "auto", enable_prefix_caching: bool = True,
                     eviction_policy: str = "lru", kv_layout: str = "paged",
                     contiguous_reservation: str = "max_model_len", preemption_mode: str = "recompute",
                     swap_space: int | str = "256MiB", quantization: str = "auto") -> Engine:
        """Load a model and build an engine; see ``LLM`` for what each option means."""
        cache = CacheConfig(block_size=block_size, kv_cache_memory=kv_cache_memory, num_kv_blocks=num_kv_blocks,
                            enable_prefix_caching=enable_prefix_caching and kv_layout == "paged",
                            eviction_policy=eviction_policy, kv_layout=kv_layout,
                            contiguous_reservation=contiguous_reservation, swap_space=swap_space)
        if dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be auto, float32, bfloat16 or float16, got {dtype!r}")
        layer_ops = get_layer_ops(device)  # may compile C++ on first use: not part of the load time
        t0 = time.perf_counter()
        path = resolve_model_path(model)
        weights = load_weights(path)
        mcfg = weights.config
        if max_model_len is None:
            max_model_len = mcfg.max_position_embeddings
        elif max_model_len > mcfg.max_position_embeddings:
            raise ValueError(f"max_model_len={max_model_len} exceeds the model's context length "
                             f"({mcfg.max_position_embeddings})")
        sched = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                                max_model_len=max_model_len, preemption_mode=preemption_mode)
        resolved_dtype = resolve_dtype(dtype, device)
        config = EngineConfig(model=mcfg, cache=cache, scheduler=sched, dtype=resolved_dtype,
                              device=device, seed=seed,
                              quantization=resolve_quantization(quantization, weights, resolved_dtype, device))
        with torch.device("meta"):
            net = LlamaForCausalLM(mcfg, _DTYPES[config.dtype], max_model_len, device=device, layer_ops=layer_ops)
        net.load_hf_state_dict(weights.state_dict)
        if config.quantization == "gguf":
            net.use_gguf_quantized(weights.quantized)
        net.prepack_weights()
        net.eval()
        del weights
        tokenizer = Tokenizer.load(path, path.suffix == ".gguf")
        load_seconds = time.perf_counter() - t0  # weights + tokenizer; not the kernel build
        engine = cls(config, net, tokenizer, attention_backend)
        engine.load_seconds = load_seconds
        engine.model_path = path
        # Everything alive now lives as long as the engine: keep it out of the cyclic GC's scans
        # (hundreds of thousands of objects after importing torch and transformers), as vLLM does.
        gc.collect()
        gc.freeze()
        atexit.unregister(gc.unfreeze)  # registered once per process
        atexit.register(gc.unfreeze)    # let interpreter shutdown collect them as usual
        return engine

    # -- requests -------------------------------------------------------------------------------
    def tokenize_prompt(self, prompt: str | list[int] | dict) -> tuple[str | None, list[int], str | None]:
        """Normalise a prompt (text, token ids, or a {'prompt'|'prompt_token_ids'[, 'cache_salt']} dict)
        into (text, token ids, cache salt)."""
        salt = None
        if isinstance(prompt, dict):
            salt = prompt.get("cache_salt")
            if salt is not None and not isinstance(salt, str):
                raise InvalidRequest("cache_salt must be a string")
            if "prompt_token_ids" in prompt:
                prompt = list(prompt["prompt_token_ids"])
            elif "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise InvalidRequest("a prompt dict needs 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidRequest("this model has no tokenizer: pass token ids as the prompt")
            ids = self.tokenizer.encode(prompt)
            text: str | None = prompt
        elif isinstance(prompt, list | tuple):
            ids = list(prompt)
            text = None
        else:
            raise InvalidRequest(f"a prompt must be a string or a list of token ids, got {type(prompt).__name__}")
        if not ids:
            raise InvalidRequest("the prompt is empty: it must have at least one token")
        vocab = self.config.model.vocab_size
        if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in ids):
            raise InvalidRequest(f"prompt token ids must be integers in [0, {vocab})")
        return text, ids, salt

    def add_request(self, request_id: str, prompt: str | list[int] | dict,
                    params: SamplingParams | None = None) -> Request:
        """Validate and queue a request. Raises InvalidRequest/RequestTooLong without side effects."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise InvalidRequest(f"sampling params must be SamplingParams, got {type(params).__name__}")
        if request_id in self._groups:
            raise InvalidRequest(f"request id {request_id!r} is already in use")
        text, ids, salt = self.tokenize_prompt(prompt)
        limit = self.config.scheduler.max_model_len
        max_tokens = params.max_tokens if params.max_tokens is not None else limit - len(ids)
        if len(ids) + max_tokens > limit:
            raise RequestTooLong(
                f"prompt ({len(ids)} tokens) + max_tokens ({max_tokens}) = {len(ids) + max_tokens} tokens "
                f"exceeds max_model_len ({limit})")
        need = self.kv_manager.max_blocks_for_request(len(ids) + max_tokens)
        if need > self.kv_manager.num_blocks:
            raise RequestTooLong(
                f"prompt + max_tokens = {len(ids) + max_tokens} tokens needs {need} KV blocks of "
                f"{self.kv_manager.block_size} ({self.kv_manager.layout} layout), more than the whole pool "
                f"(num_kv_blocks={self.kv_manager.num_blocks})")
        seqs = []
        for i in range(params.n):
            seq_id = request_id if params.n == 1 else f"{request_id}#{i}"
            if params.seed is not None:  # sibling i draws from its own stream derived from the seed
                seed = params.seed if i == 0 else (params.seed * 1_000_003 + i) % 2**63
            else:
                seed = int(torch.randint(0, 2**62, (1,), generator=self._seed_rng))
            req = Request(seq_id, ids, params, max_tokens=max_tokens, eos_token_ids=self.eos_token_ids,
                          sampling_seed=seed, cache_salt=salt)
            detok = None if self.tokenizer is None else IncrementalDetokenizer(self.tokenizer,
                                                                                params.skip_special_tokens)
            seqs.append(_OutputState(req, i, detok))
        group = _Group(request_id, text, ids, seqs, seqs[0].request.arrival_time)
        self.scheduler.add(seqs[0].request, [s.request for s in seqs[1:]])
        self._groups[request_id] = group
        for s in seqs:
            self._seq_group[s.request.request_id] = group
        return seqs[0].request

    def new_request_id(self) -> str:
        return str(next(self._counter))

    def abort(self, request_id: str) -> bool:
        """Drop a request (all its sequences) wherever it is; its blocks are freed.
        False if unknown or already finished."""
        group = self._groups.pop(request_id, None)
        if group is None:
            return False
        for s in group.seqs:
            rid = s.request.request_id
            self.scheduler.finish(rid, RequestStatus.FINISHED_ABORTED)
            self.runner.release(rid)
            self._seq_group.pop(rid, None)
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # -- one iteration ------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule, run the model once, and return outputs of requests that progressed."""
        sched_out = self.scheduler.schedule()
        if sched_out.is_empty:
            return []
        result = self.runner.execute(sched_out, self.scheduler.requests)
        progressed = self.scheduler.update(sched_out, result.tokens)
        groups: dict[str, _Group] = {}
        for req in progressed:
            group = self._seq_group.get(req.request_id)
            if group is not None:
                state = group.seqs[self._seq_index(group, req)]
                lp = result.logprobs.get(req.request_id)
                if lp is not None:
                    state.add_logprobs(req.output_token_ids[-1], lp)
                self._process(state, req)
                groups[group.request_id] = group
        return [self._output(g) for g in groups.values()]

    @staticmethod
    def _seq_index(group: _Group, req: Request) -> int:
        return next(i for i, s in enumerate(group.seqs) if s.request is req)

    def _process(self, state: _OutputState, req: Request) -> None:
        token = req.output_token_ids[-1]
        if state.detok is not None:
            delta = state.detok.add(token)
            state.text += delta
            if delta and state.max_stop_len and not req.status.finished:
                self._check_stop_strings(state, len(delta))
        if req.status.finished and state.finish_reason is None:
            state.finish_reason = req.status.value
            if req.status is RequestStatus.FINISHED_STOPPED:
                state.stop_reason = None if token in self.eos_token_ids else token
        if state.finish_reason is not None:
            self.runner.release(req.request_id)
            self._seq_group.pop(req.request_id, None)

    def _output(self, group: _Group) -> RequestOutput:
        finished = group.finished
        if finished:
            self._groups.pop(group.request_id, None)
        first = min((s.request.first_token_time for s in group.seqs if s.request.first_token_time), default=None)
        metrics = RequestMetrics(group.arrival_time, first, time.monotonic() if finished else None,
                                 sum(s.request.num_preemptions for s in group.seqs))
        return RequestOutput(group.request_id, group.prompt, group.prompt_token_ids,
                             [s.completion() for s in group.seqs], finished, metrics)

    def _check_stop_strings(self, state: _OutputState, delta_len: int) -> None:
        params = state.request.sampling_params
        start = max(0, len(state.text) - delta_len - state.max_stop_len + 1)
        hits = [(idx, s) for s in params.stop_strings if (idx := state.text.find(s, start)) >= 0]
        if not hits:
            return
        idx, stop = min(hits)
        state.text = state.text[: idx + len(stop)] if params.include_stop_str_in_output else state.text[:idx]
        state.finish_reason, state.stop_reason = "stop", stop
        self.scheduler.finish(state.request.request_id, RequestStatus.FINISHED_STOPPED)

    # -- introspection --------------------------------------------------------------------------
    def kv_cache_stats(self) -> dict[str, float | int]:
        stats = self.kv_manager.stats()
        if self.runner.host is not None:
            stats.update(self.runner.host.stats())
        return stats
