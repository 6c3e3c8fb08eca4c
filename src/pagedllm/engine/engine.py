"""Engine: the request loop. ``add_request`` -> ``step()`` (schedule, run, update) -> outputs.

Owns the scheduler (and through it the KV cache manager), the model runner, the tokenizer and
each live request's output state (``RequestState``, or a ``BeamGroup`` for beam search).
Validates a request completely before it enters the queue, so a bad request never disturbs the
others. A step is transactional for the requests outside it: if the model step raises, the
requests in it (and those whose KV blocks it was moving) finish with ``finish_reason="error"``
and free their blocks, and every other request continues (see ``_fail_step``).
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass

import torch

from pagedllm import cpu_features
from pagedllm.attention.base import AttentionBackend
from pagedllm.config import EngineConfig, ModelConfig
from pagedllm.dtypes import torch_dtype
from pagedllm.engine.beam_search import BeamGroup, BeamSearchParams
from pagedllm.engine.detokenizer import IncrementalDetokenizer
from pagedllm.engine.input_processor import InputProcessor
from pagedllm.engine.model_runner import ModelRunner
from pagedllm.engine.output_processor import RequestState, SequenceState
from pagedllm.engine.outputs import RequestOutput
from pagedllm.engine.request import Request, RequestStatus
from pagedllm.engine.request_owner import RequestOwner
from pagedllm.engine.sampling_params import SamplingParams
from pagedllm.engine.scheduler import Scheduler, SchedulerOutput
from pagedllm.engine.speculative.drafter import Drafter
from pagedllm.engine.structured_output import StructuredOutputManager
from pagedllm.errors import ConfigError, EngineStopped, InvalidRequest
from pagedllm.kvcache.block_map import block_map
from pagedllm.kvcache.factory import make_kv_manager
from pagedllm.kvcache.kv_events import KVEventLog
from pagedllm.kvstore.host_tier import HostTier
from pagedllm.kvstore.spec import KVSpec, kv_spec_for
from pagedllm.kvstore.storage import KVCacheStorage, num_blocks_for, static_kv_scales
from pagedllm.models.kernel_plan import KernelPlan
from pagedllm.models.llama import LlamaForCausalLM
from pagedllm.models.tokenizer import Tokenizer

log = logging.getLogger(__name__)





@dataclass
class KVPool:
    """One rank's KV tensors: ``storage`` of ``num_blocks`` blocks, and the host tier of
    ``num_host_blocks`` for swapping (None without swap)."""

    storage: KVCacheStorage
    num_blocks: int
    num_host_blocks: int
    host: HostTier | None

    @classmethod
    def allocate(cls, config: EngineConfig, model: ModelConfig, backend: AttentionBackend,
                 tensor_parallel=None) -> KVPool:
        """Sized for ``model`` (the rank's shard: its KV heads only) in the pool's format;
        ``tensor_parallel``: the ranks agree on the smallest block count (``agree_num_blocks``)."""
        dtype = torch_dtype(config.dtype)
        cc = config.cache
        spec = kv_spec_for(model, cc.block_size, cc.kv_cache_dtype, dtype)
        backend.check_kv_spec(spec, dtype)
        num_blocks = num_blocks_for(spec, cc, config.device)
        if tensor_parallel is not None:
            num_blocks = tensor_parallel.agree_num_blocks(num_blocks)
        swapping = config.scheduler.preemption_mode == "swap" and cc.kv_layout == "paged"
        num_host_blocks = cc.swap_space // spec.bytes_per_block if swapping else 0
        if tensor_parallel is not None and num_host_blocks:
            num_host_blocks = tensor_parallel.agree_num_blocks(num_host_blocks)
        rank, world = (0, 1) if tensor_parallel is None else (tensor_parallel.rank, tensor_parallel.world_size)
        storage = KVCacheStorage.allocate(spec, num_blocks, config.device, static_kv_scales(cc, spec, rank, world))
        host = HostTier(storage, num_host_blocks) if num_host_blocks else None
        return cls(storage, num_blocks, num_host_blocks, host)


class Engine:
    """Continuous-batching inference engine over a paged KV cache."""

    def __init__(self, config: EngineConfig, model: LlamaForCausalLM, tokenizer: Tokenizer | None,
                 backend: AttentionBackend, tensor_parallel=None) -> None:
        """``model`` finalised for ``backend`` (``LlamaForCausalLM.finalize``; ``build_engine`` does both).
        ``tensor_parallel``: rank 0's handle on the other ranks (``parallel/ranks.py``): ``model`` is
        then rank 0's shard, the pool holds its KV heads, the block count is the ranks' smallest, and
        the runner sends each step to the workers before running it."""
        self.config = config
        self.tokenizer = tokenizer
        self.tensor_parallel = tensor_parallel
        self.dead: str | None = None  # why a tensor-parallel engine stopped (a failed step is fatal there)
        pool = KVPool.allocate(config, model.config, backend, tensor_parallel)
        self.kv_manager = make_kv_manager(config.cache, pool.num_blocks, config.scheduler.max_model_len,
                                          pool.num_host_blocks)
        self.scheduler = Scheduler(config.scheduler, self.kv_manager)
        self.kv_event_listeners: list = []  # called on the engine thread with each step's KV events
        self.kv_event_publisher = None
        if config.events.kv_events_endpoint is not None:
            self._start_kv_events(config)
        self.inputs = InputProcessor(tokenizer, config.model.vocab_size, config.scheduler.max_logprobs, self.scheduler)
        device = torch.device(config.device)
        if tensor_parallel is None:
            self.runner = ModelRunner(model, pool.storage, backend, device, pool.host)
        else:
            self.runner = tensor_parallel.make_runner(model, pool.storage, backend, device, pool.host)
        eos = set(config.model.eos_token_ids)
        if tokenizer is not None and tokenizer.eos_token_id is not None:
            eos.add(tokenizer.eos_token_id)
        self.eos_token_ids = frozenset(eos)
        # grammars and matchers of structured-output requests (llguidance is imported on first use)
        self.structured = StructuredOutputManager(tokenizer, config.model.vocab_size, self.eos_token_ids)
        if config.speculative is not None:  # guesses proposed by the scheduler's drafter, verified here
            self.scheduler.drafter = Drafter(config.speculative, self.structured.validate_guesses)
        self._requests: dict[str, RequestOwner] = {}  # user request id -> its owner (RequestState, BeamGroup)
        self._owner: dict[str, RequestOwner] = {}     # live scheduler request id -> its owner
        self._stepped_always: dict[str, RequestOwner] = {}  # owners whose end_step runs every step
        self._counter = itertools.count()
        self.num_steps = 0     # steps that ran the model (or moved KV blocks)
        self.kernel_plan: KernelPlan | None = None  # the CPU matmul kernels build_engine chose
        self._seed_rng = torch.Generator().manual_seed(config.seed)

    def _start_kv_events(self, config: EngineConfig) -> None:
        """Record the prefix cache's events and publish them (``engine/kv_event_publisher.py``)."""
        import zmq

        from pagedllm.engine.kv_event_publisher import ZmqKVEventPublisher

        if config.cache.kv_layout != "paged":
            raise ConfigError("kv_events_endpoint: KV-cache events come from the prefix cache: kv_layout=paged only")
        ev = config.events
        try:
            self.kv_event_publisher = ZmqKVEventPublisher(ev.kv_events_endpoint, ev.kv_events_replay_endpoint,
                                                          ev.kv_events_topic)
        except zmq.ZMQError as e:
            raise ConfigError(f"kv_events_endpoint: cannot bind {ev.kv_events_endpoint} or "
                              f"{ev.kv_events_replay_endpoint}: {e}") from None
        self.enable_kv_event_log()

    def enable_kv_event_log(self) -> None:
        """Record KV-cache events for in-process listeners (``kv_event_listeners``) even without a
        publisher (the router of ``cluster/``, tests)."""
        if self.kv_manager.events is None:
            self.kv_manager.events = KVEventLog("GPU" if self.config.device.startswith("cuda") else "CPU")

    def _emit_kv_events(self) -> None:
        events = self.kv_manager.events.take()
        if not events:
            return
        if self.kv_event_publisher is not None:
            self.kv_event_publisher.publish(events)
        for listener in self.kv_event_listeners:
            listener(events)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block (vLLM's ``reset_prefix_cache``): False while requests hold blocks."""
        if self.config.cache.kv_layout != "paged":
            return False  # the contiguous baseline caches nothing
        done = self.kv_manager.reset_prefix_cache()
        if self.kv_manager.events is not None:
            self._emit_kv_events()
        return done

    def kernels_line(self) -> str:
        """The CPU family and the matmul kernels chosen for it (the start lines and ``bench step``
        print it); on a GPU, the device."""
        if self.kernel_plan is None:
            return f"device {self.config.device}"
        line = f"CPU {cpu_features.current().describe()}: {self.kernel_plan.describe(self.config.quantization)}"
        rows = getattr(self.runner.backend, "dense_prefill_rows", 0)
        return line + (f"; fresh prefills of >= {rows} rows attend through SDPA" if rows else "")

    # -- requests -------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: str | list[int] | dict,
                    params: SamplingParams | BeamSearchParams | None = None) -> Request:
        """Validate and queue a request. Raises InvalidRequest/RequestTooLong without side effects.
        ``BeamSearchParams`` make it a beam search (see ``engine/beam_search.py``)."""
        if self.dead is not None:
            raise EngineStopped(self.dead)
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams | BeamSearchParams):
            raise InvalidRequest(f"sampling params must be SamplingParams, got {type(params).__name__}")
        if not isinstance(request_id, str) or not request_id:
            raise InvalidRequest("a request id must be a non-empty string")
        if request_id in self._requests:
            raise InvalidRequest(f"request id {request_id!r} is already in use")
        text, ids, salt = self.inputs.tokenize_prompt(prompt)
        if isinstance(params, BeamSearchParams):
            return self._add_beam_search(request_id, text, ids, salt, params)
        params = self.inputs.resolve_logprobs(params)
        max_tokens = self.inputs.check_length(len(ids), params.max_tokens)
        if params.min_tokens > max_tokens:  # only when max_tokens was None: SamplingParams checks a given one
            raise InvalidRequest(f"min_tokens ({params.min_tokens}) must be at most max_tokens ({max_tokens}: what "
                                 f"max_model_len ({self.config.scheduler.max_model_len}) leaves after the prompt)")
        bad_words = self.inputs.check_params(params)
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
        self.inputs.check_length(len(ids), params.max_tokens)
        group = BeamGroup(request_id, text, ids, params, self.eos_token_ids, time.monotonic(), salt)
        root = group.start(self.scheduler)
        self._requests[request_id] = group
        self._stepped_always[request_id] = group
        self._owner[root.request_id] = group
        return root

    def new_request_id(self) -> str:
        return str(next(self._counter))

    def abort(self, request_id: str) -> bool:
        """Drop a request (all its sequences or beams) wherever it is; its blocks are freed.
        False if unknown or already finished."""
        owner = self._requests.get(request_id)
        if owner is None:
            return False
        self.retire(owner)
        owner.abort(self)
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # -- what a request owner may call (engine/request_owner.py) -------------------------------
    def release(self, rid: str) -> None:
        """Scheduler request ``rid`` left: free its runner and grammar state."""
        self.runner.release(rid)
        self.structured.release(rid)
        self._owner.pop(rid, None)

    def adopt(self, rid: str, owner: RequestOwner) -> None:
        self._owner[rid] = owner

    def retire(self, owner: RequestOwner) -> None:
        self._requests.pop(owner.request_id, None)
        self._stepped_always.pop(owner.request_id, None)

    # -- one iteration ------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule, run the model once, and return the outputs owed to callers (by output kind);
        the step's KV-cache events go to the publisher and the listeners, failed step or not."""
        outputs = self._step()
        if self.kv_manager.events is not None:
            self._emit_kv_events()
        return outputs

    def _step(self) -> list[RequestOutput]:
        if self.dead is not None:
            raise EngineStopped(self.dead)
        sched_out = self.scheduler.schedule()
        if sched_out.is_empty:
            return self._check_progress()
        self.num_steps += 1
        try:
            result = self.runner.execute(sched_out, self.scheduler.requests, self.structured.bitmask(sched_out))
        except Exception as exc:  # noqa: BLE001 - a failed step fails its own requests, not the engine
            return self._fail_step(sched_out, exc)
        owners = self._owner
        for rid, entries in result.prompt_logprobs.items():
            if (owner := owners.get(rid)) is not None:
                owner.take_prompt_logprobs(entries, self.tokenizer)
        touched: dict[str, RequestOwner] = dict(self._stepped_always)  # then those with tokens, in order
        logprobs = result.logprobs

        def take_token(req: Request, i: int) -> None:  # the scheduler appended req's i-th token of the step
            if (owner := owners.get(req.request_id)) is not None:
                lps = logprobs.get(req.request_id)
                owner.take_token(self, req, None if lps is None else lps[i])
                touched[owner.request_id] = owner

        self.scheduler.update(sched_out, result.tokens, take_token)
        for rid, lps in logprobs.items():
            if (owner := owners.get(rid)) is not None:
                owner.take_logprobs(rid, lps[0])
        outputs: list[RequestOutput] = []
        for owner in touched.values():
            owner.end_step(self, outputs)
        return outputs

    # -- failures -----------------------------------------------------------------------------------
    def _fail_step(self, out: SchedulerOutput, exc: Exception) -> list[RequestOutput]:
        """The model step raised: fail every request whose KV the step touched (computed, copied or
        swapped), free their blocks, and leave everything else as it was."""
        self.runner.recover()  # no copy may still be writing into blocks about to be freed
        if self.tensor_parallel is not None:
            return self._stop(self.tensor_parallel.explain(exc), exc)
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

    def _stop(self, cause: str, exc: BaseException | None = None) -> list[RequestOutput]:
        """Under tensor parallelism a failed step is fatal (the ranks' collectives would no longer
        match): fail every request, stop the workers, and refuse all that comes (``EngineStopped``)."""
        self.dead = f"tensor parallel: {cause}; the engine stopped (the ranks cannot resume in step)"
        log.error("%s (failing every request)", self.dead, exc_info=exc)
        self.tensor_parallel.stop(graceful=False)
        owners = {id(o): o for o in [*self._owner.values(), *self._requests.values()]}
        return self._fail(list(owners.values()), self.dead)

    def check_workers(self) -> list[RequestOutput]:
        """Between steps: if a tensor-parallel worker has died, stop the engine (failing every request,
        whose outputs are returned). Nothing to do on one rank."""
        tp = self.tensor_parallel
        if tp is None or self.dead is not None:
            return []
        try:
            tp.check()
        except RuntimeError as e:
            return self._stop(str(e))
        return []

    def shutdown(self) -> None:
        """Stop the KV event publisher and the tensor-parallel workers (if any); a tensor-parallel
        engine takes no more steps after it."""
        if self.kv_event_publisher is not None:
            self.kv_event_publisher.close()
            self.kv_event_publisher = None
        if self.tensor_parallel is not None:
            self.tensor_parallel.stop()
            if self.dead is None:
                self.dead = "the engine was shut down"

    def _fail(self, owners: list[RequestOwner], message: str) -> list[RequestOutput]:
        outputs: list[RequestOutput] = []
        for owner in owners:
            owner.fail(self, message, outputs)
        return outputs

    def _check_progress(self) -> list[RequestOutput]:
        """A step scheduled nothing. When the scheduler is stalled (twice in a row with requests
        unfinished: nothing ever will run, a bug never expected), fail them with a clear error
        instead of spinning."""
        if not self.scheduler.stalled:
            return []
        self.scheduler.empty_steps = 0  # counted afresh for the requests that come next
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

    # -- what the server, the metrics and the dashboard read (on the engine thread where noted) ----
    @property
    def kv_spec(self) -> KVSpec:
        """The KV format of the pool."""
        return self.runner.kv.spec

    @property
    def attention_backend(self) -> str:
        return self.runner.backend.name

    @property
    def max_model_len(self) -> int:
        return self.config.scheduler.max_model_len

    @property
    def max_num_seqs(self) -> int:
        return self.config.scheduler.max_num_seqs

    @property
    def max_logprobs(self) -> int:
        return self.config.scheduler.max_logprobs

    @property
    def vocab_size(self) -> int:
        return self.config.model.vocab_size

    def compile_grammar(self, spec):
        """Compile (and cache) a structured-output constraint; any thread (see StructuredOutputManager)."""
        return self.structured.compile(spec)

    def stats(self) -> dict:
        """The one source of the engine's counts: the KV pool's (``kv_cache_stats``), the queues'
        and the steps'. Engine thread."""
        stats = self.kv_cache_stats()
        sched = self.scheduler
        stats.update(num_requests_running=len(sched.running),
                     num_requests_waiting=len(sched.waiting) + len(sched.swapped),
                     num_requests_swapped=len(sched.swapped), num_steps=self.num_steps)
        if sched.drafter is not None:
            stats.update(sched.drafter.stats.as_dict())
        return stats

    def kv_block_map(self) -> tuple[bytearray, dict[str, list[int]]]:
        """Each block's state code and each request's blocks (``kvcache/block_map.py``). Engine thread."""
        return block_map(self.kv_manager)

    def request_queues(self) -> tuple[list[Request], list[Request]]:
        """(running, waiting then swapped) scheduler requests. Engine thread."""
        sched = self.scheduler
        return list(sched.running), [*sched.waiting, *sched.swapped]
