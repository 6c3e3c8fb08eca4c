"""Engine: the request loop. ``add_request`` -> ``step()`` (schedule, run, update) -> outputs.

Owns the scheduler (and through it the KV cache manager), the model runner, the tokenizer and
each live request's output state (``RequestState``, or a ``BeamGroup`` for beam search).
Validates a request completely before it enters the queue, so a bad request never disturbs the
others. A step is transactional for the requests outside it: if the model step raises, the
requests in it (and those whose KV blocks it was moving) finish with ``finish_reason="error"``
and free their blocks, and every other request continues (see ``_fail_step``).
"""

from __future__ import annotations

import atexit
import dataclasses
import gc
import itertools
import logging
import operator
import time

import torch
from pydantic import ValidationError

from pagedllm import cpu_features
from pagedllm.attention.backends import get_backend
from pagedllm.config import DEFAULT_STEP_TOKENS, QUANTIZATIONS, EngineConfig, EngineOptions, describe_error
from pagedllm.engine.beam_search import BeamGroup, BeamSearchParams
from pagedllm.engine.detokenizer import IncrementalDetokenizer
from pagedllm.engine.model_runner import ModelRunner
from pagedllm.engine.output_processor import RequestState, SequenceState, to_logprob_dict
from pagedllm.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from pagedllm.engine.request import Request, RequestStatus
from pagedllm.engine.sampling_params import SamplingParams, logprobs_count
from pagedllm.engine.scheduler import Scheduler, SchedulerOutput
from pagedllm.engine.structured_output import StructuredOutputManager
from pagedllm.errors import ConfigError, InvalidRequest, RequestTooLong, require_utf8
from pagedllm.kvcache.factory import make_kv_manager
from pagedllm.kvstore.host_tier import HostTier
from pagedllm.kvstore.spec import KVSpec
from pagedllm.kvstore.storage import KVCacheStorage, num_blocks_for
from pagedllm.models import decoder_stack
from pagedllm.models.kernel_plan import KernelPlan, plan_kernels
from pagedllm.models.layer_ops import CpuLayerOps, get_layer_ops
from pagedllm.models.llama import LlamaForCausalLM
from pagedllm.models.loader import LoadedWeights, load_weights, resolve_dtype, resolve_model_path
from pagedllm.models.tokenizer import Tokenizer

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_quantization(quantization: str, weights: LoadedWeights, dtype: str, device: str) -> str:
    """``auto`` -> ``gguf`` for a GGUF with Q4_0/Q4_1/Q8_0 tensors on CPU in bf16/fp16 (the fast
    path), else ``none``; an explicit ``gguf`` that cannot apply is an error."""
    if quantization not in QUANTIZATIONS:
        raise ConfigError(f"quantization must be one of {QUANTIZATIONS}, got {quantization!r}")
    usable = bool(weights.quantized) and device == "cpu"
    if quantization == "auto":
        return "gguf" if usable and dtype != "float32" else "none"
    if quantization == "gguf" and not usable:
        why = "runs on CPU only" if weights.quantized else "needs a GGUF model with Q4_0, Q4_1 or Q8_0 tensors"
        raise ConfigError(f"quantization='gguf' {why}")
    return quantization


class Engine:
    """Continuous-batching inference engine over a paged KV cache."""

    def __init__(self, config: EngineConfig, model: LlamaForCausalLM, tokenizer: Tokenizer | None,
                 attention_backend: str = "auto") -> None:
        self.config = config
        self.tokenizer = tokenizer
        dtype = _DTYPES[config.dtype]
        cc = config.cache
        spec = KVSpec.for_model(config.model, cc.block_size, dtype)
        backend = get_backend(attention_backend, config.device, config.model.head_dim)
        backend.check_kv_spec(spec, dtype)
        num_blocks = num_blocks_for(spec, cc, config.device)
        swapping = config.scheduler.preemption_mode == "swap" and cc.kv_layout == "paged"
        num_host_blocks = cc.swap_space // spec.bytes_per_block if swapping else 0
        self.kv_manager = make_kv_manager(cc, num_blocks, config.scheduler.max_model_len, num_host_blocks)
        self.scheduler = Scheduler(config.scheduler, self.kv_manager)
        storage = KVCacheStorage.allocate(spec, num_blocks, config.device)
        host = HostTier(storage, num_host_blocks) if num_host_blocks else None
        self.runner = ModelRunner(model, storage, backend, torch.device(config.device), host)
        eos = set(config.model.eos_token_ids)
        if tokenizer is not None and tokenizer.eos_token_id is not None:
            eos.add(tokenizer.eos_token_id)
        self.eos_token_ids = frozenset(eos)
        # grammars and matchers of structured-output requests (llguidance is imported on first use)
        self.structured = StructuredOutputManager(tokenizer, config.model.vocab_size, self.eos_token_ids)
        self._requests: dict[str, RequestState | BeamGroup] = {}  # user request id -> its state
        self._owner: dict[str, RequestState | BeamGroup] = {}     # live scheduler request id -> its owner
        self._counter = itertools.count()
        self._empty_steps = 0  # consecutive steps that scheduled nothing while requests were unfinished
        self.num_steps = 0     # steps that ran the model (or moved KV blocks)
        self.kernel_plan: KernelPlan | None = None  # the CPU matmul kernels from_options chose
        self._seed_rng = torch.Generator().manual_seed(config.seed)

    # -- construction ------------------------------------------------------------------------
    @classmethod
    def from_options(cls, options: EngineOptions | None = None, **overrides) -> Engine:
        """Load a model and build an engine from ``EngineOptions`` (or its fields as keywords; see
        ``pagedllm.config`` for what each option means). A bad option raises ``ConfigError``."""
        try:
            if options is None:
                options = EngineOptions(**overrides)
            elif overrides:
                options = dataclasses.replace(options, **overrides)
        except ValidationError as e:
            raise ConfigError(describe_error(e)) from None
        device, dtype = options.device, options.dtype
        cache = options.cache_config()
        if cache.kv_layout != "paged" and cache.enable_prefix_caching:
            cache = dataclasses.replace(cache, enable_prefix_caching=False)
        layer_ops = get_layer_ops(device)  # may compile C++ on first use: not part of the load time
        if isinstance(layer_ops, CpuLayerOps):
            decoder_stack.EXTENSION.load()  # the same, for the C++ layer loop the model builds on its first step
        t0 = time.perf_counter()
        path = resolve_model_path(options.model)
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
        plan = plan_kernels(cpu_features.current(), _DTYPES[resolved_dtype]) if device == "cpu" else None
        if plan is not None and plan.dense_kernel == "panels" and not (
                isinstance(layer_ops, CpuLayerOps) and layer_ops.ops.has_panel_linear()):
            plan = dataclasses.replace(plan, dense_kernel="onednn")  # the panel GEMM lives in the C++ layer ops
        scheduler = options.scheduler_config(max_model_len, plan.step_tokens if plan else DEFAULT_STEP_TOKENS)
        config = EngineConfig(model=mcfg, cache=cache, scheduler=scheduler,
                              dtype=resolved_dtype, device=device, seed=options.seed,
                              quantization=resolve_quantization(options.quantization, weights, resolved_dtype, device))
        with torch.device("meta"):
            net = LlamaForCausalLM(mcfg, _DTYPES[config.dtype], max_model_len, device=device, layer_ops=layer_ops)
        net.load_hf_state_dict(weights.state_dict)
        if config.quantization == "gguf":
            net.use_gguf_quantized(weights.quantized, plan)
        if plan is not None:
            net.prepack_weights(plan)
        net.eval()
        del weights
        tokenizer = Tokenizer.load(path, path.suffix == ".gguf")
        load_seconds = time.perf_counter() - t0  # weights + tokenizer; not the kernel build
        engine = cls(config, net, tokenizer, options.attention_backend)
        engine.load_seconds = load_seconds
        engine.kernel_plan = plan
        engine.model_path = path
        # Everything alive now lives as long as the engine: keep it out of the cyclic GC's scans
        # (hundreds of thousands of objects after importing torch and transformers), as vLLM does.
        gc.collect()
        gc.freeze()
        atexit.unregister(gc.unfreeze)  # registered once per process
        atexit.register(gc.unfreeze)    # let interpreter shutdown collect them as usual
        return engine

    def kernels_line(self) -> str:
        """The CPU family and the matmul kernels chosen for it (the start lines and ``bench step``
        print it); on a GPU, the device."""
        if self.kernel_plan is None:
            return f"device {self.config.device}"
        line = f"CPU {cpu_features.current().describe()}: {self.kernel_plan.describe()}"
        rows = getattr(self.runner.backend, "dense_prefill_rows", 0)
        return line + (f"; fresh prefills of >= {rows} rows attend through SDPA" if rows else "")

    # -- requests -------------------------------------------------------------------------------
    PROMPT_KEYS = ("prompt", "prompt_token_ids", "cache_salt")

    def tokenize_prompt(self, prompt: str | list[int] | dict) -> tuple[str | None, list[int], str | None]:
        """Normalise a prompt (text, token ids, or a {'prompt'|'prompt_token_ids'[, 'cache_salt']} dict)
        into (text, token ids, cache salt). Token ids may be Python, numpy or torch integers."""
        salt = None
        text: str | None = None
        if isinstance(prompt, dict):
            unknown = sorted(str(k) for k in prompt if k not in self.PROMPT_KEYS)
            if unknown:
                raise InvalidRequest(f"unknown key {unknown[0]!r} in a prompt dict "
                                     f"(expected one of {', '.join(self.PROMPT_KEYS)})")
            salt = prompt.get("cache_salt")
            if salt is not None and not isinstance(salt, str):
                raise InvalidRequest("cache_salt must be a string")
            if salt is not None:
                require_utf8(salt, "cache_salt")  # it is encoded when block hashes are computed
            if "prompt_token_ids" in prompt:
                text = prompt.get("prompt") if isinstance(prompt.get("prompt"), str) else None
                prompt = prompt["prompt_token_ids"]
                if isinstance(prompt, str):
                    raise InvalidRequest("prompt_token_ids must be a list of token ids, not a string")
            elif "prompt" in prompt:
                prompt = prompt["prompt"]
                if not isinstance(prompt, str):
                    raise InvalidRequest(f"'prompt' must be a string, got {type(prompt).__name__}")
            else:
                raise InvalidRequest("a prompt dict needs 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, str):
            require_utf8(prompt, "prompt")
            if self.tokenizer is None:
                raise InvalidRequest("this model has no tokenizer: pass token ids as the prompt")
            ids = self.tokenizer.encode(prompt)
            text = prompt
        elif isinstance(prompt, bytes | bytearray) or not hasattr(prompt, "__iter__") or hasattr(prompt, "keys"):
            raise InvalidRequest(f"a prompt must be a string or a list of token ids, got {type(prompt).__name__}")
        else:
            ids = self._token_ids(prompt)
        if not ids:
            raise InvalidRequest("the prompt is empty: it must have at least one token")
        return text, ids, salt

    def _token_ids(self, values) -> list[int]:
        vocab = self.config.model.vocab_size
        try:
            values = list(values)
            ids = [operator.index(t) for t in values if not isinstance(t, bool)]
        except TypeError:
            ids = [-1]
        if len(ids) != len(values) or not all(0 <= t < vocab for t in ids):
            raise InvalidRequest(f"prompt token ids must be integers in [0, {vocab})")
        return ids

    def _check_length(self, num_prompt: int, max_tokens: int | None) -> int:
        """The request's max_tokens (filled in up to max_model_len when None); raises RequestTooLong
        if it cannot fit max_model_len or the whole block pool."""
        limit = self.config.scheduler.max_model_len
        if num_prompt >= limit:
            raise RequestTooLong(f"prompt ({num_prompt} tokens) must be shorter than max_model_len ({limit}) "
                                 "to leave room for at least one generated token")
        if max_tokens is None:
            max_tokens = limit - num_prompt
        if num_prompt + max_tokens > limit:
            raise RequestTooLong(
                f"prompt ({num_prompt} tokens) + max_tokens ({max_tokens}) = {num_prompt + max_tokens} tokens "
                f"exceeds max_model_len ({limit})")
        need = self.kv_manager.max_blocks_for_request(num_prompt + max_tokens)
        if need > self.kv_manager.num_blocks:
            raise RequestTooLong(
                f"prompt + max_tokens = {num_prompt + max_tokens} tokens needs {need} KV blocks of "
                f"{self.kv_manager.block_size} ({self.kv_manager.layout} layout), more than the whole pool "
                f"(num_kv_blocks={self.kv_manager.num_blocks})")
        return max_tokens

    def _resolve_logprobs(self, params: SamplingParams) -> SamplingParams:
        """``logprobs`` / ``prompt_logprobs`` with -1 (the whole vocabulary) as the vocabulary's size,
        within ``max_logprobs`` (-1: no limit; InvalidRequest naming the field), as vLLM checks them,
        on a copy of the params (the caller's are left as they were)."""
        limit, vocab = self.config.scheduler.max_logprobs, self.config.model.vocab_size
        resolved = {name: logprobs_count(name, getattr(params, name), limit, vocab)
                    for name in ("logprobs", "prompt_logprobs") if getattr(params, name) is not None}
        changed = {name: count for name, count in resolved.items() if count != getattr(params, name)}
        return dataclasses.replace(params, **changed) if changed else params

    def _check_params(self, params: SamplingParams) -> list[list[int]]:
        """Token ids named by the params must exist; returns the bad words as token-id sequences."""
        vocab = self.config.model.vocab_size
        bad = [(name, t) for name, t in params.token_ids_to_check() if t >= vocab]
        if bad:
            raise InvalidRequest(f"{bad[0][0]}: token id {bad[0][1]} is outside the vocabulary [0, {vocab})")
        if not params.bad_words:
            return []
        if self.tokenizer is None:
            raise InvalidRequest("bad_words needs a tokenizer; this model has none")
        words: list[list[int]] = []
        for word in params.bad_words:  # as vLLM: the word alone, and as a new word after a space
            for text in (word.lstrip(), " " + word.lstrip()):
                ids = self.tokenizer.encode(text, add_special_tokens=False)
                if ids and ids not in words:
                    words.append(ids)
        return words

    def add_request(self, request_id: str, prompt: str | list[int] | dict,
                    params: SamplingParams | BeamSearchParams | None = None) -> Request:
        """Validate and queue a request. Raises InvalidRequest/RequestTooLong without side effects.
        ``BeamSearchParams`` make it a beam search (see ``engine/beam_search.py``)."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams | BeamSearchParams):
            raise InvalidRequest(f"sampling params must be SamplingParams, got {type(params).__name__}")
        if not isinstance(request_id, str) or not request_id:
            raise InvalidRequest("a request id must be a non-empty string")
        if request_id in self._requests:
            raise InvalidRequest(f"request id {request_id!r} is already in use")
        text, ids, salt = self.tokenize_prompt(prompt)
        if isinstance(params, BeamSearchParams):
            return self._add_beam_search(request_id, text, ids, salt, params)
        params = self._resolve_logprobs(params)
        max_tokens = self._check_length(len(ids), params.max_tokens)
        if params.min_tokens > max_tokens:  # only when max_tokens was None: SamplingParams checks a given one
            raise InvalidRequest(f"min_tokens ({params.min_tokens}) must be at most max_tokens ({max_tokens}: what "
                                 f"max_model_len ({self.config.scheduler.max_model_len}) leaves after the prompt)")
        bad_words = self._check_params(params)
        grammar = None if params.structured_outputs is None else self.structured.compile(params.structured_outputs)
        seqs = []
        for i in range(params.n):
            seq_id = request_id if params.n == 1 else f"{request_id}#{i}"
            if params.seed is not None:  # sibling i draws from its own stream derived from the seed
                seed = (params.seed if i == 0 else params.seed * 1_000_003 + i) % 2**63  # any int is a seed
            else:
                seed = int(torch.randint(0, 2**62, (1,), generator=self._seed_rng))
            req = Request(seq_id, ids, params, max_tokens=max_tokens, eos_token_ids=self.eos_token_ids,
                          sampling_seed=seed, cache_salt=salt, bad_words_token_ids=bad_words)
            detok = None if self.tokenizer is None else IncrementalDetokenizer(self.tokenizer, ids,
                                                                                params.skip_special_tokens)
            seqs.append(SequenceState(req, i, detok))
        state = RequestState(request_id, text, ids, seqs, params.output_kind, seqs[0].request.arrival_time)
        if grammar is not None:
            self.structured.add([s.request.request_id for s in seqs], grammar)
        self.scheduler.add(seqs[0].request, [s.request for s in seqs[1:]])
        self._requests[request_id] = state
        for s in seqs:
            self._owner[s.request.request_id] = state
        return seqs[0].request

    def _add_beam_search(self, request_id: str, text: str | None, ids: list[int], salt: str | None,
                         params: BeamSearchParams) -> Request:
        self._check_length(len(ids), params.max_tokens)
        group = BeamGroup(request_id, text, ids, params, self.eos_token_ids, time.monotonic(), salt)
        root = group.start(self.scheduler)
        self._requests[request_id] = group
        self._owner[root.request_id] = group
        return root

    def new_request_id(self) -> str:
        return str(next(self._counter))

    def abort(self, request_id: str) -> bool:
        """Drop a request (all its sequences or beams) wherever it is; its blocks are freed.
        False if unknown or already finished."""
        owner = self._requests.pop(request_id, None)
        if owner is None:
            return False
        for rid in self._live_ids(owner):
            self.scheduler.finish(rid, RequestStatus.FINISHED_ABORTED)
            self._release(rid)
        if isinstance(owner, BeamGroup):
            owner.abort(self.scheduler)
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def _live_ids(self, owner: RequestState | BeamGroup) -> list[str]:
        if isinstance(owner, BeamGroup):
            return list(owner.live)
        return [s.request.request_id for s in owner.seqs if not s.finished]

    def _release(self, rid: str) -> None:
        self.runner.release(rid)
        self.structured.release(rid)
        self._owner.pop(rid, None)

    # -- one iteration ------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule, run the model once, and return the outputs owed to callers (by output kind)."""
        sched_out = self.scheduler.schedule()
        if sched_out.is_empty:
            return self._check_progress()
        self._empty_steps = 0
        self.num_steps += 1
        try:
            result = self.runner.execute(sched_out, self.scheduler.requests, self.structured.bitmask(sched_out))
        except Exception as exc:  # noqa: BLE001 - a failed step fails its own requests, not the engine
            return self._fail_step(sched_out, exc)
        progressed = self.scheduler.update(sched_out, result.tokens)
        changed: dict[str, set[int]] = {}
        for rid, entries in result.prompt_logprobs.items():
            owner = self._owner.get(rid)
            if isinstance(owner, RequestState):
                owner.add_prompt_logprobs(entries, self.tokenizer)
        for req in progressed:
            owner = self._owner.get(req.request_id)
            if isinstance(owner, RequestState):
                seq = self._process(owner, req, result.logprobs.get(req.request_id))
                changed.setdefault(owner.request_id, set()).add(seq.index)
        outputs = []
        for rid, lp in result.logprobs.items():
            owner = self._owner.get(rid)
            if isinstance(owner, BeamGroup):
                owner.deliver(rid, lp)
        for owner in [o for o in self._requests.values() if isinstance(o, BeamGroup)]:
            self._step_beams(owner, outputs)
        for request_id, seqs in changed.items():
            state = self._requests.get(request_id)
            if state is not None:
                self._emit(state, outputs, seqs)
        return outputs

    def _process(self, state: RequestState, req: Request, lp) -> SequenceState:
        seq = next(s for s in state.seqs if s.request is req)
        token = req.output_token_ids[-1]
        grammar_done = req.request_id in self.structured and self._accept_grammar(state, req, token)
        stop = seq.add_token(token, None if lp is None else to_logprob_dict(lp, self.tokenizer))
        if stop is not None and not req.status.finished:
            self.scheduler.finish(req.request_id, RequestStatus.FINISHED_STOPPED)
        if grammar_done and not seq.finished:  # the grammar is complete: only EOS could follow
            self.scheduler.finish(req.request_id, RequestStatus.FINISHED_STOPPED)
            seq.finish("stop")
        if seq.finished:
            self._release(req.request_id)
        return seq

    def _accept_grammar(self, state: RequestState, req: Request, token: int) -> bool:
        """Feed a structured-output sequence its new token; True when its grammar is complete. A token
        the grammar rejects fails this sequence alone (``finish_reason="error"``)."""
        completed, error = self.structured.accept(req.request_id, token)
        if error is not None:
            log.error("request %s: %s", req.request_id, error)
            state.error = error
            self.scheduler.finish(req.request_id, RequestStatus.FINISHED_ERROR)
        return completed

    def _emit(self, state: RequestState, outputs: list[RequestOutput], changed: set[int] | None = None) -> None:
        out = state.output(changed)
        if state.finished:
            self._requests.pop(state.request_id, None)
        if out is not None:
            outputs.append(out)

    def _step_beams(self, group: BeamGroup, outputs: list[RequestOutput]) -> None:
        for rid in group.step(self.scheduler):
            self._release(rid)
        for rid in group.live:
            self._owner[rid] = group
        if group.finished:
            self._requests.pop(group.request_id, None)
            outputs.append(self._beam_output(group))

    def _beam_output(self, group: BeamGroup) -> RequestOutput:
        n = len(group.prompt_token_ids)
        completions = []
        for i, seq in enumerate(group.ranked()):
            generated = seq.tokens[n:]
            text = None if self.tokenizer is None else self.tokenizer.decode(generated)
            completions.append(CompletionOutput(i, text, generated, seq.finish_reason, None, seq.cum_logprob))
        metrics = RequestMetrics(group.arrival_time, None, time.monotonic())
        return RequestOutput(group.request_id, group.prompt, group.prompt_token_ids, completions, True, metrics,
                             error=group.error)

    # -- failures -----------------------------------------------------------------------------------
    def _fail_step(self, out: SchedulerOutput, exc: Exception) -> list[RequestOutput]:
        """The model step raised: fail every request whose KV the step touched (computed, copied or
        swapped), free their blocks, and leave everything else as it was."""
        self.runner.recover()  # no copy may still be writing into blocks about to be freed
        touched = {c.request_id for c in out.chunks} | {f for c in out.chunks for f in c.fork_ids}
        touched |= set(out.swapped_in)
        touched |= {rid for rid in out.preempted
                    if (r := self.scheduler.requests.get(rid)) is not None and r.status is RequestStatus.SWAPPED}
        copied = {dst for _, dst in out.copies}
        if copied:
            touched |= {rid for rid, t in self.kv_manager.tables.items() if copied.intersection(t.block_ids)}
        owners = {id(o): o for rid in touched if (o := self._owner.get(rid)) is not None}
        message = f"the model step failed: {type(exc).__name__}: {exc}"
        log.error("%s (failing %d request(s); the engine continues)", message, len(owners), exc_info=exc)
        return self._fail(list(owners.values()), message)

    def _fail(self, owners: list[RequestState | BeamGroup], message: str) -> list[RequestOutput]:
        outputs: list[RequestOutput] = []
        for owner in owners:
            for rid in self._live_ids(owner):
                self.scheduler.finish(rid, RequestStatus.FINISHED_ERROR)
                self._release(rid)
            self._requests.pop(owner.request_id, None)
            if isinstance(owner, BeamGroup):
                owner.abort(self.scheduler, RequestStatus.FINISHED_ERROR)
                owner.error = message
                outputs.append(self._beam_output(owner))
            else:
                owner.fail(message)
                self._emit(owner, outputs)
        return outputs

    def _check_progress(self) -> list[RequestOutput]:
        """A step scheduled nothing. Twice in a row with requests unfinished means nothing ever will
        (a bug, never expected): fail them with a clear error instead of spinning."""
        if not self.scheduler.has_unfinished():
            return []
        self._empty_steps += 1
        if self._empty_steps < 2:
            return []
        self._empty_steps = 0
        owners = {id(o): o for o in self._owner.values()}
        kv = self.kv_manager
        return self._fail(list(owners.values()), "the scheduler could not make progress with the KV blocks left "
                                                 f"({kv.num_free_blocks} free of {kv.num_blocks})")

    # -- introspection --------------------------------------------------------------------------
    def kv_cache_stats(self) -> dict[str, float | int]:
        stats = self.kv_manager.stats()
        if self.runner.host is not None:
            stats.update(self.runner.host.stats())
        return stats
