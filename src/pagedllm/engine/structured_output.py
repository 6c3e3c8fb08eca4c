"""Structured output: constrain sampling to a JSON schema, any JSON object, a regex, a choice of
strings or a Lark / GBNF grammar, with llguidance (``docs/design.md``, "Structured output", says
why llguidance and not xgrammar: measured by ``pagedllm bench grammar-libs``).

Owns, per engine (``StructuredOutputManager``): llguidance's view of the engine's tokenizer (built
once, on the first structured request), a small LRU of compiled grammars (a pristine matcher per
(kind, spec text, options), deep-copied for each new sequence) and one matcher per live sequence
that has a grammar. Per step it fills the allowed-token bitmask of the sequences that sample
(``GrammarBitmask``: plain data the model runner hands to the sampler, which applies it with
``BitmaskApplier``), and after sampling feeds each such sequence its new token.

Invariants:
- a request's grammar compiles (within ``compile_timeout`` seconds) before it is queued; a bad
  spec raises ``InvalidRequest`` and registers nothing;
- a sequence's matcher has consumed exactly its output tokens, each once: tokens are fed when the
  scheduler appends them, and recomputing a preempted sequence appends none;
- a step whose sampling sequences have no grammar builds no bitmask (``bitmask`` returns None);
- matchers live exactly as long as their sequence (``release`` when it finishes or is aborted).

Only the engine thread calls ``add``, ``bitmask``, ``accept`` and ``release``; ``compile`` may also be
called from another thread (a server can compile a request's grammar before handing it to the
engine thread, whose ``add_request`` then finds it in the cache and never waits on a compile).
"""

from __future__ import annotations

import json
import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from pagedllm.errors import InvalidRequest

if TYPE_CHECKING:
    from pagedllm.engine.sampling_params import StructuredOutputsParams
    from pagedllm.engine.scheduler import SchedulerOutput
    from pagedllm.models.tokenizer import Tokenizer

GRAMMAR_REJECTED = "structured output: the grammar rejected token"  # starts RequestOutput.error then
COMPILE_TIMEOUT_S = 10.0  # default limit on compiling one request's grammar (Engine.structured.compile_timeout)
GRAMMAR_CACHE_SIZE = 64   # compiled grammars kept (least recently used dropped first)


@dataclass
class GrammarBitmask:
    """One step's allowed tokens: row ``rows[request_id]`` of ``bitmask`` (int32 [len(rows), ceil(V / 32)],
    bit i of word j set = token 32 j + i allowed) for each sampling sequence that has a grammar; with
    speculative guesses, row ``rows[(request_id, j)]`` for the position after its first j guesses."""

    rows: dict[str | tuple[str, int], int]
    bitmask: torch.Tensor


class AcceptResult(NamedTuple):
    completed: bool    # the grammar is complete: nothing but EOS may follow
    error: str | None  # the matcher rejected the token (the sequence fails with this message)


class BitmaskApplier:
    """Applies token bitmasks to rows of logits, reusing its scratch buffers from step to step."""

    def __init__(self) -> None:
        self._table: torch.Tensor | None = None
        self._index = torch.empty(0, dtype=torch.long)
        self._bias = torch.empty(0)

    def apply(self, logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | None = None) -> None:
        """Set to -inf, in place, the logits [R, V] of the tokens whose bit is 0 in ``bitmask`` (int32
        [R, W], ``GrammarBitmask``'s layout, which is xgrammar's and llguidance's); tokens past 32 W
        are disallowed. With ``rows`` (long [G]), bitmask row g applies to logits row ``rows[g]`` and
        the other rows are left alone. Each mask byte indexes a [256, 8] table of 0 / -inf, then one
        add: exact (x + 0 == x) and, on CPU, several times faster than ``masked_fill`` or
        xgrammar's own kernel."""
        vocab = logits.shape[1]
        count = bitmask.shape[0]
        device, dtype = logits.device, logits.dtype
        if self._table is None or self._table.device != device or self._table.dtype != dtype:
            bits = (torch.arange(256).unsqueeze(1) >> torch.arange(8)) & 1
            self._table = torch.zeros(256, 8, dtype=dtype).masked_fill_(bits == 0, float("-inf")).to(device)
            self._index = torch.empty(0, dtype=torch.long, device=device)
            self._bias = torch.empty(0, dtype=dtype, device=device)
        width = bitmask.shape[1] * 4  # mask bytes per row (little-endian: byte k of word j = tokens 32 j + 8 k...)
        n = count * width
        if self._index.numel() < n:
            self._index = torch.empty(n, dtype=torch.long, device=device)
            self._bias = torch.empty(n, 8, dtype=dtype, device=device)
        index, bias = self._index[:n], self._bias[:n]
        index.view(count, width).copy_(bitmask.contiguous().view(torch.uint8))
        torch.index_select(self._table, 0, index, out=bias)
        bias = bias.view(count, -1)
        if width * 8 < vocab:  # the mask is narrower than the logits: the rest is disallowed
            bias = torch.cat([bias, bias.new_full((count, vocab - width * 8), float("-inf"))], dim=1)
        bias = bias[:, :vocab]
        if rows is None:
            logits += bias
        else:
            logits.index_add_(0, rows, bias)


def grammar_spec(params: StructuredOutputsParams) -> tuple[str, str]:
    """(kind, spec text) of a constraint: the LRU key, and what ``llguidance`` compiles."""
    kind = params.kind
    if kind == "json":
        spec = params.json if isinstance(params.json, str) else json.dumps(params.json)
    elif kind == "json_object":
        spec = '{"type": "object"}'
    elif kind == "choice":
        spec = json.dumps(params.choice)
    else:
        spec = getattr(params, kind)
    return kind, spec


def _llguidance_grammar(kind: str, spec: str, any_whitespace: bool) -> str:
    """The llguidance grammar for a constraint (as vLLM's ``guidance`` backend builds it)."""
    import llguidance

    if kind in ("json", "json_object"):
        return llguidance.LLMatcher.grammar_from_json_schema(spec, defaults={"whitespace_flexible": any_whitespace})
    return llguidance.grammar_from({"grammar": "grammar", "regex": "regex", "choice": "choice"}[kind], spec)


_FIELD = {"json": "structured_outputs.json", "json_object": "structured_outputs.json_object",
          "regex": "structured_outputs.regex", "choice": "structured_outputs.choice",
          "grammar": "structured_outputs.grammar"}


class StructuredOutputManager:
    """Grammar compilation, per-sequence matchers and per-step bitmasks for one engine."""

    def __init__(self, tokenizer: Tokenizer | None, vocab_size: int, eos_token_ids: Iterable[int],
                 compile_timeout: float = COMPILE_TIMEOUT_S, cache_size: int = GRAMMAR_CACHE_SIZE) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = sorted(eos_token_ids)
        self.compile_timeout = compile_timeout
        self.cache_size = cache_size
        self._llg_tokenizer = None  # llguidance.LLTokenizer, built on the first structured request
        self._executor = None       # llguidance.LLExecutor: fills a batch of masks on its threads
        self._cache: OrderedDict[tuple[str, str, bool], Any] = OrderedDict()  # key -> pristine LLMatcher
        self._matchers: dict[str, Any] = {}  # live sequence id -> its LLMatcher
        self._lock = threading.Lock()  # guards the cache and the lazy tokenizer view (compile is thread-safe)
        self.num_compiled = 0  # grammars compiled (cache misses), for tests and stats

    # -- requests ------------------------------------------------------------------------------
    def compile(self, params: StructuredOutputsParams):
        """The request's compiled grammar (from the LRU, or compiled now within ``compile_timeout``
        seconds); raises ``InvalidRequest`` naming the field and the problem."""
        kind, spec = grammar_spec(params)
        key = (kind, spec, not params.disable_any_whitespace)
        with self._lock:
            cached = self._cache.get(key)
            if cached is not None:
                self._cache.move_to_end(key)
                return cached
        if self.tokenizer is None:
            raise InvalidRequest(f"{_FIELD[kind]} needs a tokenizer; this model has none")
        tokenizer = self._tokenizer()
        width = (self.vocab_size + 31) // 32

        def build():
            import llguidance

            matcher = llguidance.LLMatcher(tokenizer, _llguidance_grammar(kind, spec, key[2]), log_level=0)
            if not matcher.is_error():  # also build what the first mask needs (llguidance is lazy)
                scratch = torch.empty(1, width, dtype=torch.int32)
                matcher.unsafe_compute_mask_ptr(scratch.data_ptr(), width * 4)
            if matcher.is_error():
                raise ValueError(matcher.get_error())
            return matcher

        matcher = self._with_time_limit(build, kind)
        with self._lock:
            self.num_compiled += 1
            self._cache[key] = matcher
            if len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return matcher

    def _with_time_limit(self, build: Callable[[], Any], kind: str):
        """Run ``build`` on a daemon thread (llguidance releases the GIL) and wait at most
        ``compile_timeout`` s; a compile that overruns is left to finish alone, its result dropped."""
        box: dict[str, Any] = {}
        done = threading.Event()

        def run() -> None:
            try:
                box["value"] = build()
            except Exception as e:  # noqa: BLE001 - reported to the caller below
                box["error"] = e
            finally:
                done.set()

        threading.Thread(target=run, name="pagedllm-grammar-compile", daemon=True).start()
        if not done.wait(self.compile_timeout):
            raise InvalidRequest(f"{_FIELD[kind]}: compiling the grammar took longer than the "
                                 f"{self.compile_timeout:g} s limit")
        if "error" in box:
            message = str(box["error"]).strip() or type(box["error"]).__name__
            raise InvalidRequest(f"{_FIELD[kind]} is invalid: {message}")
        return box["value"]

    def add(self, sequence_ids: list[str], grammar) -> None:
        """Give each sequence its own matcher, at the grammar's start (n > 1 siblings each need one)."""
        for sid in sequence_ids:
            self._matchers[sid] = grammar.deep_copy()

    def release(self, sequence_id: str) -> None:
        self._matchers.pop(sequence_id, None)

    def __contains__(self, sequence_id: str) -> bool:
        return sequence_id in self._matchers

    def __len__(self) -> int:
        return len(self._matchers)

    # -- one step -------------------------------------------------------------------------------
    def bitmask(self, out: SchedulerOutput) -> GrammarBitmask | None:
        """Allowed tokens of the sequences that sample in this step and have a grammar (a chunk's
        request and its forks, in the runner's order); None, at no cost, when there are none."""
        if not self._matchers:
            return None
        rows: dict[str, int] = {}
        for chunk in out.chunks:
            if chunk.sample:
                for sid in (chunk.request_id, *chunk.fork_ids):
                    if sid in self._matchers:
                        rows[sid] = len(rows)
        if not rows:
            return None
        guessed = [(c.request_id, c.draft_token_ids) for c in out.chunks
                   if c.draft_token_ids and c.request_id in rows]
        num_rows = len(rows) + sum(len(g) for _, g in guessed)
        width = (self.vocab_size + 31) // 32
        bitmask = torch.empty(num_rows, width, dtype=torch.int32)
        if len(rows) == 1:
            (sid,) = rows
            self._matchers[sid].unsafe_compute_mask_ptr(bitmask.data_ptr(), width * 4)
        else:
            self._executor.unsafe_compute_mask_ptr([(self._matchers[sid], i) for sid, i in rows.items()],
                                                   bitmask.data_ptr(), width * 4, len(rows))
        for sid, guesses in guessed:  # row (sid, j): the mask after the first j guesses
            matcher = self._matchers[sid]
            for j, token in enumerate(guesses, start=1):
                if not matcher.consume_token(token):  # validate_guesses cut the guesses at the first it rejects
                    raise RuntimeError(f"structured output: guess {token} of {sid} was not valid after all")
                rows[(sid, j)] = index = len(rows)
                matcher.unsafe_compute_mask_ptr(bitmask[index].data_ptr(), width * 4)
            matcher.rollback(len(guesses))
        return GrammarBitmask(rows, bitmask)

    def validate_guesses(self, sequence_id: str, guesses: list[int]) -> int:
        """How many leading ``guesses`` (speculative decoding) the sequence's grammar accepts; all of
        them for a sequence without one. The matcher is left as it was."""
        matcher = self._matchers.get(sequence_id)
        return len(guesses) if matcher is None else matcher.validate_tokens(guesses)

    def accept(self, sequence_id: str, token: int) -> AcceptResult:
        """Feed a sequence's newly sampled token to its matcher."""
        matcher = self._matchers[sequence_id]
        if not matcher.consume_token(token):
            return AcceptResult(False, f"{GRAMMAR_REJECTED} {token}: "
                                       f"{matcher.get_error() or 'not allowed here'}")
        return AcceptResult(matcher.is_stopped(), None)

    # -- internals ----------------------------------------------------------------------------------
    def _tokenizer(self):
        with self._lock:
            return self._tokenizer_locked()

    def _tokenizer_locked(self):
        if self._llg_tokenizer is None:
            import llguidance
            import llguidance.hf  # not llguidance.torch: importing it compiles a kernel with torch.compile

            self._llg_tokenizer = llguidance.hf.from_tokenizer(self.tokenizer.hf, n_vocab=self.vocab_size,
                                                               eos_token=self.eos_token_ids)
            self._executor = llguidance.LLExecutor(num_threads=max(1, min(8, os.cpu_count() or 1)))
        return self._llg_tokenizer
