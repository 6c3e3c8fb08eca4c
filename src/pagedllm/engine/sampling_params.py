"""vLLM-compatible ``SamplingParams`` and ``RequestOutputKind``, validated when built.

Defaults and meanings follow vLLM: ``max_tokens=16``, ``temperature=1.0``; a temperature below
``1e-5`` means greedy; ``top_k`` of ``0`` or ``-1`` disables top-k, ``top_p=1`` nucleus sampling and
``min_p=0`` min-p filtering. Penalties: ``presence_penalty`` and ``frequency_penalty`` in [-2, 2]
act on the generated tokens (OpenAI's definition), ``repetition_penalty`` > 0 on prompt and
generated tokens (1 = off). ``logit_bias`` adds to the logits of the given token ids (clamped to
[-100, 100] as OpenAI does); ``allowed_token_ids`` keeps only those tokens; ``bad_words`` are
never generated; ``min_tokens`` holds back EOS, stop token ids and stop strings until that many
tokens exist. ``logprob_token_ids`` (vLLM's): the log-probabilities of exactly these tokens at each
generated position (with their ranks), in place of the top ``logprobs``. Token-id ranges are
checked against the model's vocabulary by the engine.
``structured_outputs`` (``StructuredOutputsParams``) constrains the output to a JSON schema, any
JSON object, a regex, one of a list of strings or a grammar (``engine/structured_output.py``).
"""

from __future__ import annotations

import enum
import json
import operator
from dataclasses import dataclass, field

from pagedllm.errors import InvalidRequest

SAMPLING_EPS = 1e-5  # temperatures below this are greedy, as in vLLM
MAX_LOGPROB_TOKEN_IDS = 128  # the most tokens logprob_token_ids may name, as vLLM


def logprobs_count(name: str, value: int, max_logprobs: int, vocab_size: int) -> int:
    """A logprobs count (``logprobs``, ``top_logprobs``, ``prompt_logprobs``) as vLLM takes it: -1
    is the vocabulary's size (and no count exceeds it), and the result must be within
    ``max_logprobs`` (-1: no limit), else an ``InvalidRequest`` naming ``name``. One rule for the
    engine (``LLM``) and the server, which checks first so its formatting has the same count."""
    count = vocab_size if value == -1 else min(value, vocab_size)
    if max_logprobs != -1 and count > max_logprobs:
        asked = f"-1 (the whole vocabulary, {vocab_size})" if value == -1 else str(value)
        raise InvalidRequest(f"{name}: {asked} is more than max_logprobs ({max_logprobs}) allows "
                             "(--max-logprobs; -1 lifts the limit)")
    return count


class RequestOutputKind(enum.Enum):
    """What each ``RequestOutput`` of a request carries (vLLM's ``RequestOutputKind``)."""

    CUMULATIVE = 0   # everything so far, every step
    DELTA = 1        # only what is new since the previous output
    FINAL_ONLY = 2   # one output, when the request finishes


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: object) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and v == v  # NaN != NaN


# the sampler divides or multiplies float32 logits by the repetition penalty: past these bounds they
# overflow to inf (or, below float32's least value, the penalty rounds to 0 and -inf x 0 is NaN), so
# a masked token could be drawn; no sensible penalty lies outside them
REPETITION_MIN, REPETITION_MAX = 1e-3, 1e3

# the sampler holds top_k in an int64 tensor and clamps it to the vocabulary: bounded to int32 so any
# accepted value fits (a larger one would fail the step of every request batched with it)
TOP_K_MAX = 2**31 - 1
# the most parallel samples of one prompt: the engine makes a request per sample when the prompt is
# added, so an unbounded n (2**40) would hang the caller building them; the server caps n lower (128,
# as OpenAI)
N_MAX = 4096


def _token_id(v: object, name: str) -> int:
    """An int, numpy or torch integer as a plain non-negative int; ValueError naming ``name``."""
    if isinstance(v, bool):
        raise ValueError(f"{name} must hold integer token ids, got {v!r}")
    try:
        t = operator.index(v)
    except TypeError:
        raise ValueError(f"{name} must hold integer token ids, got {v!r}") from None
    if t < 0:
        raise ValueError(f"{name} must hold non-negative token ids, got {t}")
    return t


STRUCTURED_KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass
class StructuredOutputsParams:
    """vLLM's structured-output constraint: exactly one of ``json`` (a JSON schema: a dict, its JSON
    text, or a pydantic model class), ``json_object=True`` (any JSON object), ``regex``, ``choice``
    (exactly one of these strings) or ``grammar`` (Lark, or llama.cpp's GBNF). With
    ``disable_any_whitespace`` JSON has no whitespace outside strings (by default any is allowed).
    Checked here for shape; the engine compiles it when the request is added (an invalid schema,
    regex or grammar is an ``InvalidRequest`` then). Raises ``ValueError`` naming a bad field."""

    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.json, type) and hasattr(self.json, "model_json_schema"):  # a pydantic model
            self.json = self.json.model_json_schema()
        if self.json_object is not None and not isinstance(self.json_object, bool):
            raise ValueError(f"structured_outputs.json_object must be a bool, got {self.json_object!r}")
        if not isinstance(self.disable_any_whitespace, bool):
            raise ValueError(f"structured_outputs.disable_any_whitespace must be a bool, "
                             f"got {self.disable_any_whitespace!r}")
        given = [k for k in STRUCTURED_KINDS if getattr(self, k) is not None and getattr(self, k) is not False]
        if not given:
            raise ValueError(f"structured_outputs needs one of {', '.join(STRUCTURED_KINDS)}")
        if len(given) > 1:
            raise ValueError(f"structured_outputs takes one constraint, got {' and '.join(given)}")
        if self.json is not None:
            self.json = self._schema(self.json)
        for name in ("regex", "grammar"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, str) or not v):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string, got {v!r}")
        if self.choice is not None:
            if (isinstance(self.choice, str) or not isinstance(self.choice, list | tuple) or not self.choice
                    or not all(isinstance(c, str) and c for c in self.choice)):
                raise ValueError(f"structured_outputs.choice must be a non-empty list of non-empty strings, "
                                 f"got {self.choice!r}")
            self.choice = list(self.choice)

    @staticmethod
    def _schema(value: object) -> dict | str:
        """A JSON schema as given (dict, or JSON text of an object); its details are checked when compiled."""
        if isinstance(value, str):
            try:
                parsed = json.loads(value)
            except ValueError as e:
                raise ValueError(f"structured_outputs.json is not valid JSON: {e}") from None
            if not isinstance(parsed, dict):
                raise ValueError(f"structured_outputs.json must be a JSON schema object, got {value!r}")
            return value
        if not isinstance(value, dict):
            raise ValueError(f"structured_outputs.json must be a JSON schema (a dict or its JSON text), "
                             f"got {type(value).__name__}")
        try:
            json.dumps(value)
        except (TypeError, ValueError) as e:
            raise ValueError(f"structured_outputs.json must be JSON-serialisable: {e}") from None
        return value

    @property
    def kind(self) -> str:
        """Which constraint: one of ``STRUCTURED_KINDS``."""
        return next(k for k in STRUCTURED_KINDS if getattr(self, k) is not None and getattr(self, k) is not False)


@dataclass
class SamplingParams:
    """How to sample one request's completion(s). Raises ``ValueError`` naming a bad field."""

    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None         # top-k log-probabilities of each generated token (+ the chosen one);
    prompt_logprobs: int | None = None  # the same for each prompt token (the first is None); -1: the whole
    #                                     vocabulary, where the engine's max_logprobs allows it (-1 too)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    logprob_token_ids: list[int] | None = None  # logprobs of exactly these tokens at each generated position
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    structured_outputs: StructuredOutputsParams | None = None  # JSON schema / json_object / regex / choice / grammar
    speculative_decoding: bool = True  # False: this request never guesses tokens (an engine with speculative_config)
    _stop_list: list[str] = field(default_factory=list, init=False, repr=False)

    def __post_init__(self) -> None:
        if not _is_int(self.n) or not 1 <= self.n <= N_MAX:
            raise ValueError(f"n must be an integer in 1..{N_MAX} (parallel samples of the prompt), got {self.n!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not _is_number(v) or not -2.0 <= v <= 2.0:
                raise ValueError(f"{name} must be a number in [-2, 2], got {v!r}")
        if not _is_number(self.repetition_penalty) or not REPETITION_MIN <= self.repetition_penalty <= REPETITION_MAX:
            raise ValueError(f"repetition_penalty must be a number in [{REPETITION_MIN:g}, {REPETITION_MAX:g}], "
                             f"got {self.repetition_penalty!r}")
        if not _is_number(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a number >= 0, got {self.temperature!r}")
        if not _is_number(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or not -1 <= self.top_k <= TOP_K_MAX:
            raise ValueError(f"top_k must be -1 or 0 (disabled) or in 1..{TOP_K_MAX}, got {self.top_k!r}")
        if not _is_number(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if self.seed is not None and not _is_int(self.seed):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise ValueError(f"min_tokens must be an integer >= 0, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must be at most max_tokens ({self.max_tokens})")
        for name in ("logprobs", "prompt_logprobs"):  # their upper limit is the engine's max_logprobs
            v = getattr(self, name)
            if v is not None and (not _is_int(v) or v < -1):
                raise ValueError(f"{name} must be an integer >= 0, or -1 for the whole vocabulary, got {v!r}")
        self._stop_list = self._string_list(self.stop, "stop")
        self.bad_words = self._string_list(self.bad_words, "bad_words")
        self.stop_token_ids = self._id_list(self.stop_token_ids, "stop_token_ids")
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = self._id_list(self.allowed_token_ids, "allowed_token_ids")
            if not self.allowed_token_ids:
                raise ValueError("allowed_token_ids must not be empty")
        if self.logprob_token_ids is not None:
            self.logprob_token_ids = self._id_list(self.logprob_token_ids, "logprob_token_ids")
            if not 1 <= len(self.logprob_token_ids) <= MAX_LOGPROB_TOKEN_IDS:
                raise ValueError(f"logprob_token_ids must name 1..{MAX_LOGPROB_TOKEN_IDS} tokens, "
                                 f"got {len(self.logprob_token_ids)}")
            if self.logprobs is not None and self.logprobs != len(self.logprob_token_ids):
                raise ValueError(f"logprob_token_ids: with logprobs too, logprobs must equal their number "
                                 f"({len(self.logprob_token_ids)}), got {self.logprobs}")
        if self.logit_bias is not None:
            self.logit_bias = self._bias(self.logit_bias)
        if not isinstance(self.output_kind, RequestOutputKind):
            raise ValueError(f"output_kind must be a RequestOutputKind, got {self.output_kind!r}")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise ValueError(f"structured_outputs must be a StructuredOutputsParams, got {self.structured_outputs!r}")
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens", "speculative_decoding"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")

    @staticmethod
    def _string_list(value: object, name: str) -> list[str]:
        if value is None:
            return []
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, list | tuple) or not all(isinstance(s, str) for s in value):
            raise ValueError(f"{name} must be a string or a list of strings, got {value!r}")
        if any(s == "" for s in value):
            raise ValueError(f"{name} strings must not be empty")
        return list(value)

    @staticmethod
    def _id_list(value: object, name: str) -> list[int]:
        if value is None:
            return []
        if isinstance(value, str | bytes) or not hasattr(value, "__iter__"):
            raise ValueError(f"{name} must be a list of token ids, got {value!r}")
        return [_token_id(t, name) for t in value]

    @staticmethod
    def _bias(value: object) -> dict[int, float]:
        if not isinstance(value, dict):
            raise ValueError(f"logit_bias must be a dict of token id -> bias, got {value!r}")
        out = {}
        for k, v in value.items():
            try:
                token = _token_id(int(k) if isinstance(k, str) else k, "logit_bias")
            except ValueError:
                raise ValueError(f"logit_bias keys must be token ids, got {k!r}") from None
            if not _is_number(v):
                raise ValueError(f"logit_bias values must be numbers, got {v!r} for token {k!r}")
            out[token] = max(-100.0, min(100.0, float(v)))
        return out

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS

    @property
    def stop_strings(self) -> list[str]:
        return self._stop_list

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    @property
    def has_logits_processors(self) -> bool:
        """Anything that changes the logits before sampling, besides temperature/top-k/top-p/min-p."""
        return bool(self.has_penalties or self.logit_bias or self.allowed_token_ids or self.bad_words
                    or self.min_tokens)

    @property
    def takes_raw_argmax(self) -> bool:
        """Greedy with nothing that reads or changes the logits first: its token is the arg-max of
        the model's logits as computed, in whatever dtype (widening to float32 keeps the order)."""
        return self.greedy and not self.has_logits_processors and not self.wants_logprobs

    @property
    def wants_logprobs(self) -> bool:
        """Log-probabilities at each generated position: the top ``logprobs`` or ``logprob_token_ids``."""
        return self.logprobs is not None or self.logprob_token_ids is not None

    def token_ids_to_check(self) -> list[tuple[str, int]]:
        """Every token id the request names, with the field naming it (for the engine's vocabulary check)."""
        return [(name, t) for name in ("stop_token_ids", "allowed_token_ids", "logit_bias", "logprob_token_ids")
                for t in getattr(self, name) or ()]
