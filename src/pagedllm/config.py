"""Configuration: frozen objects, validated when built (a bad value raises naming its field).

``ModelConfig`` describes the network (filled by ``models.loader``). The options users set are
defined once, here, with their defaults, choices and help text: ``LoadOptions`` (which model, how
to run it), ``SchedulerConfig`` (batching limits) and ``CacheConfig`` (the KV pool). Together they
form ``EngineOptions``, from which ``LLM(...)``, ``build_engine``, the CLI flags
(``cli.add_option_args``) and the option table in docs/api.md (``options_markdown``) are all made.
They are pydantic dataclasses: validation (and byte sizes such as ``"512MiB"``) by pydantic.
``EngineConfig`` ties the resolved pieces together for one engine.
"""

from __future__ import annotations

import types
import typing
from dataclasses import dataclass, field
from typing import Annotated, Literal

from pydantic import ByteSize, ConfigDict, Field, PlainValidator, TypeAdapter, ValidationError
from pydantic.dataclasses import dataclass as pydantic_dataclass

from pagedllm.errors import ConfigError

DEFAULT_MAX_LOGPROBS = 20  # the most logprobs a request may ask for by default, as vLLM's max_logprobs

MIN_BLOCK_SIZE = 8
MAX_BLOCK_SIZE = 128
QUANTIZATIONS = ("auto", "none", "gguf", "awq", "int8")
DEFAULT_STEP_TOKENS = 1024  # max_num_batched_tokens where no CPU family measured better (models/kernel_plan.py)
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}  # the one dtype table: names and element sizes
SUPPORTED_DTYPES = ("auto", *DTYPE_BYTES)
ATTENTION_BACKENDS = ("auto", "cpu", "triton", "reference")
# KV formats' scales (kvstore/spec.py): none, per block and KV head, or per token row and KV head
KV_SCALE_LAYOUTS = ("none", "per_block_head", "per_token_head")
# the KV cache's formats (kvstore/quant.py): the model's dtype, a float dtype, or a quantized one
KV_CACHE_DTYPES = ("auto", *DTYPE_BYTES, "int8", "fp8_e4m3", "fp8_e5m2", "int4")
KV_CODE_BYTES = {"int8": 1.0, "fp8_e4m3": 1.0, "fp8_e5m2": 1.0, "int4": 0.5}  # a quantized value's bytes
KV_SCALE_BYTES = 2  # a quantized format's bfloat16 scale, one per token and KV head


def kv_element_bytes(kv_cache_dtype: str, model_dtype: str, head_dim: int) -> float:
    """Bytes one cached K (or V) value costs, its row's scale shared out: what the simulator and
    the planner size pools with (``kvstore/spec.py``'s ``bytes_per_block`` counts the same)."""
    if kv_cache_dtype == "auto":
        return DTYPE_BYTES[model_dtype]
    if kv_cache_dtype in DTYPE_BYTES:
        return DTYPE_BYTES[kv_cache_dtype]
    if kv_cache_dtype not in KV_CODE_BYTES:
        raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {kv_cache_dtype!r}")
    return KV_CODE_BYTES[kv_cache_dtype] + KV_SCALE_BYTES / head_dim
LAYER_LOOPS = ("auto", "python")  # who runs the decoder layers: the C++ stack where it applies, or Python
EVICTION_POLICIES = ("lru", "lfu", "lru-lfu", "size-weighted")  # kvcache/eviction.py
HASH_ALGOS = ("xxh3_128", "sha256")  # prefix-cache block hashes (kvcache/hashing.py)
RESERVATIONS = ("max_model_len", "request")  # what a contiguous request reserves (kvcache/contiguous.py)

PositiveInt = Annotated[int, Field(strict=True, ge=1)]
BlockSize = Annotated[int, Field(strict=True, ge=MIN_BLOCK_SIZE, le=MAX_BLOCK_SIZE)]
Bytes = Annotated[ByteSize, Field(gt=0)]  # an int, or a string such as "512MiB" / "2GB"


_BYTE_SIZE = TypeAdapter(ByteSize)


def parse_memory_budget(value):
    """Bytes (an int, "512MiB", "2GB") as a ``ByteSize``, or a share of free memory ("25 %" ->
    "25%"), with one plain message when it is neither (a union of the two types would report
    both branches' errors; and ByteSize alone reads "25%" as 25 bytes)."""
    if isinstance(value, str) and value.strip().endswith("%"):
        try:
            share = float(value.strip()[:-1])
        except ValueError:
            raise ValueError(f"{value!r} is not a share of free memory such as 25%") from None
        if not 0 < share <= 100:
            raise ValueError(f"a share of free memory must be above 0% and at most 100%, got {value!r}")
        return f"{share:g}%"
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise ValueError("give bytes (e.g. 512MiB, 2GB, 1073741824) or a share of free memory (e.g. 25%)")
    try:
        size = _BYTE_SIZE.validate_python(value)
    except ValidationError as e:
        raise ValueError(f"{e.errors()[0]['msg']}: give e.g. 512MiB, 2GB or 25%") from None
    if size <= 0:
        raise ValueError("must be more than 0 bytes")
    return size


# bytes, or a share of the device's free memory when the engine is built, such as "25%"
MemoryBudget = Annotated[ByteSize | str, PlainValidator(parse_memory_budget)]
_STRICT = ConfigDict(validate_default=True, extra="forbid")


@pydantic_dataclass(frozen=True, config=_STRICT)
class LoadOptions:
    """Which model, in which precision, on which device, with which kernels."""

    model: str | None = Field(None, description="a local .gguf file or HF folder (config.json + safetensors); "
                                                "default: the embedded SmolLM2-135M-Instruct (GGUF Q4_1)")
    dtype: Literal[SUPPORTED_DTYPES] = Field("auto", description="weights and KV cache; auto: bfloat16 on CUDA "
                                                                 "and on x86 CPUs with AVX2 or more, else float32")
    quantization: Literal[QUANTIZATIONS] = Field(
        "auto", description="gguf: small steps (up to 8-32 token rows, per CPU family and dtype) read a GGUF's own "
                            "Q4_0/Q4_1/Q8_0 blocks; awq: an AWQ checkpoint's 4-bit groups, the same way; "
                            "int8: weight-only int8 per output channel, quantized when loaded (no float copy); "
                            "auto: gguf or awq for such a checkpoint on CPU in bf16/fp16, else none; "
                            "see docs/weight_quantization.md")
    device: str = Field("cpu", description="cpu or cuda")
    attention_backend: Literal[ATTENTION_BACKENDS] = Field(
        "auto", description="cpu (C++ kernel), triton (GPU), reference (pure torch); auto picks by device")
    seed: Annotated[int, Field(strict=True)] = Field(0, description="seeds the sampling of requests without a seed")
    layer_loop: Literal[LAYER_LOOPS] = Field(
        "auto", description="auto: the C++ decoder stack runs the layers where it applies; python: the Python "
                            "layer loop (for A/B)")
    tensor_parallel_size: PositiveInt = Field(
        1, description="ranks the model is split over by attention heads and MLP channels (worker processes "
                       "on torch.distributed, gloo on CPU); must divide the model's query and KV heads; see "
                       "docs/tensor_parallel.md")


@pydantic_dataclass(frozen=True, config=_STRICT)
class SchedulerConfig:
    """Continuous-batching limits for one engine step."""

    max_num_seqs: PositiveInt = Field(64, description="most sequences running in one step")
    max_num_batched_tokens: PositiveInt = Field(DEFAULT_STEP_TOKENS,
                                                description="token budget of one step (prefill is chunked)")
    max_model_len: PositiveInt = Field(2048, description="longest prompt + output")
    preemption_mode: Literal["recompute", "swap"] = Field(
        "recompute", description="what happens to a request preempted when blocks run out")
    max_logprobs: Annotated[int, Field(strict=True, ge=-1)] = Field(
        DEFAULT_MAX_LOGPROBS, description="most logprobs / prompt_logprobs a request may ask for; -1: no limit. "
                                          "A request's -1 means the whole vocabulary (as vLLM)")


@pydantic_dataclass(frozen=True, config=_STRICT)
class CacheConfig:
    """The paged KV pool: block size, its size (bytes or blocks), caching, eviction, layout, swap."""

    block_size: BlockSize = Field(16, description=f"tokens per KV block ({MIN_BLOCK_SIZE}..{MAX_BLOCK_SIZE})")
    kv_cache_memory: MemoryBudget = Field(
        "512MiB", description="KV pool size, e.g. 512MiB or 2GB, or a share of the device's free memory, e.g. 25%")
    num_kv_blocks: PositiveInt | None = Field(None, description="KV pool size in blocks (overrides kv_cache_memory)")
    enable_prefix_caching: Annotated[bool, Field(strict=True)] = Field(
        True, description="reuse cached full blocks of earlier prompts (paged layout only)")
    prefix_caching_hash_algo: Literal[HASH_ALGOS] = Field(
        "xxh3_128", description="block hash: xxh3_128 (keyed with a per-process random seed) or sha256")
    prefix_caching_hash_seed: Annotated[int, Field(strict=True, ge=0, lt=2**64)] | None = Field(
        None, description="the xxh3_128 key of the prefix-cache block hashes: give every replica of a cluster the "
                          "same secret number so a router can compute the hashes they cache; default: a random key "
                          "per process (docs/kv_events.md)")
    eviction_policy: Literal[EVICTION_POLICIES] = Field(
        "lru", description="reuse order of free cached blocks, and choice of preemption victims")
    kv_layout: Literal["paged", "contiguous"] = Field(
        "paged", description="contiguous: the pre-PagedAttention baseline (one reservation per request)")
    contiguous_reservation: Literal[RESERVATIONS] = Field(
        "max_model_len", description="contiguous layout: reserve max_model_len or prompt + max_tokens per request")
    swap_space: Bytes = Field("256MiB", description="host memory for preempted KV blocks (preemption_mode=swap)")
    kv_cache_dtype: Literal[KV_CACHE_DTYPES] = Field(
        "auto", description="KV cache format: auto (the model's dtype), float32, bfloat16, float16, or int8, "
                            "fp8_e4m3, fp8_e5m2, int4 (Hadamard-rotated), scaled per token and KV head; "
                            "see docs/kv_quantization.md")
    kv_cache_scales: Annotated[float, Field(gt=0, allow_inf_nan=False)] | str | None = Field(
        None, description="static scales for a quantized KV format instead of one computed per row on write: "
                          "a number (every layer's K and V) or a JSON file {\"k_scale\": ..., \"v_scale\": ...} "
                          "(a number, one per layer, or one per layer and KV head); x ~= code * scale, as vLLM's "
                          "k_scale/v_scale")


def _zmq_endpoint(value):
    """None, or a ZMQ endpoint to bind: tcp://host:port (``*`` for every interface), ipc://path, inproc://name."""
    if value is None:
        return None
    if not isinstance(value, str) or not value.startswith(("tcp://", "ipc://", "inproc://")):
        raise ValueError(f"must be a ZMQ endpoint such as tcp://*:5557, ipc:///tmp/kv or inproc://kv, got {value!r}")
    return value


ZmqEndpoint = Annotated[str | None, PlainValidator(_zmq_endpoint)]


@pydantic_dataclass(frozen=True, config=_STRICT)
class EventsConfig:
    """KV-cache events (BlockStored, BlockRemoved, AllBlocksCleared) published as vLLM does."""

    kv_events_endpoint: ZmqEndpoint = Field(
        None, description="publish KV-cache events in vLLM's schema on this ZMQ PUB endpoint, e.g. tcp://*:5557 "
                          "(see docs/kv_events.md); default: none published")
    kv_events_replay_endpoint: ZmqEndpoint = Field(
        None, description="a ZMQ ROUTER endpoint, e.g. tcp://*:5558, that resends buffered event batches to a "
                          "subscriber that missed some")
    kv_events_topic: str = Field("", description="the topic frame of every KV event message (vLLM's default: empty)")


SPECULATIVE_METHODS = ("ngram", "suffix")  # engine/speculative/: guesses taken from text already seen


@pydantic_dataclass(frozen=True, config=_STRICT)
class SpeculativeConfig:
    """Speculative decoding without a draft model (vLLM's ``speculative_config`` where it fits; see
    docs/speculative.md): each step a running request may verify up to ``num_speculative_tokens``
    guessed tokens in one chunk, accepted while they equal the tokens the model samples."""

    method: Literal[SPECULATIVE_METHODS] = Field(
        description="ngram: prompt lookup (the last n tokens found earlier in the request's own tokens); "
                    "suffix: a suffix tree over the request's tokens and recent requests' outputs")
    num_speculative_tokens: PositiveInt = Field(7, description="most tokens guessed per request and step")
    prompt_lookup_min: PositiveInt = Field(2, description="ngram: the shortest n-gram matched")
    prompt_lookup_max: PositiveInt = Field(5, description="ngram: the longest n-gram matched (tried first)")
    suffix_decoding_max_tree_depth: PositiveInt = Field(
        24, description="suffix: the longest suffix (pattern + guess) the trees hold")
    suffix_decoding_max_cached_requests: Annotated[int, Field(strict=True, ge=0)] = Field(
        1000, description="suffix: finished requests whose outputs the global tree keeps (oldest dropped)")
    suffix_decoding_max_spec_factor: Annotated[float, Field(gt=0, allow_inf_nan=False)] = Field(
        1.0, description="suffix: a guess is at most this factor times the matched pattern's length")
    suffix_decoding_min_token_prob: Annotated[float, Field(ge=0, le=1)] = Field(
        0.1, description="suffix: a guess stops at a token whose estimated probability falls below this")
    disable_by_batch_size: PositiveInt | None = Field(
        4, description="no guesses in a step with more running requests than this (measured: docs/speculative.md)")

    def __post_init__(self) -> None:
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"prompt_lookup_min ({self.prompt_lookup_min}) must be at most "
                             f"prompt_lookup_max ({self.prompt_lookup_max})")


def parse_speculative_config(value):
    """A ``SpeculativeConfig`` from itself, a dict, or a JSON object string (the CLI's
    ``--speculative-config '{"method": "ngram"}'``); None stays None."""
    import json

    if value is None or isinstance(value, SpeculativeConfig):
        return value
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"not a JSON object: {e}") from None
    if not isinstance(value, dict):
        raise ValueError('give a dict or a JSON object such as {"method": "ngram"}')
    try:
        return SpeculativeConfig(**value)
    except ValidationError as e:
        raise ValueError(describe_error(e)) from None
    except TypeError as e:
        raise ValueError(str(e)) from None


SpeculativeOption = Annotated[SpeculativeConfig | None, PlainValidator(parse_speculative_config)]


@pydantic_dataclass(frozen=True, config=_STRICT)
class SpeculationOptions:
    """Speculative decoding (engine/speculative/)."""

    speculative_config: SpeculativeOption = Field(
        None, description='speculative decoding without a draft model, e.g. {"method": "ngram"} or '
                          '{"method": "suffix", "num_speculative_tokens": 7} (JSON on the command line); '
                          "see docs/speculative.md")


@pydantic_dataclass(frozen=True, config=_STRICT)
class EngineOptions(SpeculationOptions, EventsConfig, CacheConfig, SchedulerConfig, LoadOptions):
    """Every option of an engine, in one flat object (``LLM(**options)``, CLI flags, docs table)."""

    max_model_len: PositiveInt | None = Field(None, description="longest prompt + output; default: the model's "
                                                                "context length")
    max_num_batched_tokens: PositiveInt | None = Field(
        None, description="token budget of one step (prefill is chunked); default: per CPU family, 2048 for a "
                          "bf16 model on AMX, else 1024")

    def cache_config(self) -> CacheConfig:
        return CacheConfig(**{name: getattr(self, name) for name in option_fields(CacheConfig)})

    def events_config(self) -> EventsConfig:
        return EventsConfig(**{name: getattr(self, name) for name in option_fields(EventsConfig)})

    def scheduler_config(self, max_model_len: int, step_tokens: int = DEFAULT_STEP_TOKENS) -> SchedulerConfig:
        """The scheduler's config: ``max_model_len`` and ``step_tokens`` fill the options left None
        (the model's context length; the CPU family's step budget, ``KernelPlan.step_tokens``)."""
        values = {name: getattr(self, name) for name in option_fields(SchedulerConfig)}
        budget = self.max_num_batched_tokens if self.max_num_batched_tokens is not None else step_tokens
        return SchedulerConfig(**{**values, "max_model_len": max_model_len, "max_num_batched_tokens": budget})


def option_fields(cls=EngineOptions) -> dict:
    """Field name -> pydantic ``FieldInfo`` (default, description, annotation) of an options class."""
    return dict(cls.__pydantic_fields__)


def option_choices(annotation) -> tuple | None:
    """The allowed values of a ``Literal`` option (also inside ``X | None``), else None."""
    args = typing.get_args(annotation) if isinstance(annotation, types.UnionType) or typing.get_origin(
        annotation) is typing.Union else (annotation,)
    for a in args:
        if typing.get_origin(a) is Literal:
            return typing.get_args(a)
    return None


def options_markdown() -> str:
    """The option table of docs/api.md, made from ``EngineOptions``."""
    rows = ["| option | default | meaning |", "|---|---|---|"]
    for name, info in option_fields().items():
        choices = option_choices(info.annotation)
        meaning = info.description + (f" (one of {', '.join(f'`{c}`' for c in choices)})" if choices else "")
        rows.append(f"| `{name}` | `{info.default}` | {meaning} |")
    return "\n".join(rows) + "\n"


def check_block_size(value) -> int:
    """``value`` if the engine takes it as ``block_size`` (``CacheConfig``'s rule), else ``ConfigError``
    with the engine's message; for tools that take a block size without building an engine."""
    try:
        return CacheConfig(block_size=value).block_size
    except ValidationError as e:
        raise ConfigError(describe_error(e)) from None


def describe_error(error: ValidationError) -> str:
    """A pydantic error as one line per field: ``block_size: Input should be ... (got 7)``."""
    parts = []
    for e in error.errors():
        where = ".".join(str(p) for p in e["loc"]) or "options"
        if e["type"] == "unexpected_keyword_argument":
            parts.append(f"unknown option {where!r}")
        else:
            parts.append(f"{where}: {e['msg']} (got {e['input']!r})")
    return "; ".join(parts)


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling: ``none``, ``linear`` or ``llama3`` (Llama 3.1 style)."""

    kind: str = "none"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self) -> None:
        if self.kind not in ("none", "linear", "llama3"):
            raise ValueError(f"rope_scaling.kind must be none, linear or llama3, got {self.kind!r}")
        if self.factor <= 0:
            raise ValueError(f"rope_scaling.factor must be positive, got {self.factor}")


Dimension = Annotated[int, Field(gt=0)]


@pydantic_dataclass(frozen=True, config=ConfigDict(extra="forbid"))
class ModelConfig:
    """Shape of a Llama-family decoder (Llama 2/3, SmolLM2, Mistral, Qwen2)."""

    vocab_size: Dimension
    hidden_size: Dimension
    intermediate_size: Dimension
    num_layers: Dimension
    num_heads: Dimension
    num_kv_heads: Dimension
    head_dim: Dimension
    max_position_embeddings: Dimension
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    attention_bias: bool = False
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    architecture: str = "llama"

    def __post_init__(self) -> None:  # after pydantic's field checks
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"ModelConfig.num_heads ({self.num_heads}) must be a multiple of "
                f"num_kv_heads ({self.num_kv_heads})")


@pydantic_dataclass(frozen=True, config=ConfigDict(extra="forbid"))
class EngineConfig:
    """Everything an ``Engine`` needs besides the loaded weights (options resolved: no ``auto``)."""

    model: ModelConfig
    cache: CacheConfig
    scheduler: SchedulerConfig
    dtype: Literal[SUPPORTED_DTYPES[1:]] = "float32"
    device: str = "cpu"
    seed: int = 0
    quantization: Literal[QUANTIZATIONS[1:]] = "none"  # resolved (see build_engine for "auto")
    tensor_parallel_size: int = 1  # ranks the model is split over (parallel/)
    events: EventsConfig = field(default_factory=EventsConfig)  # KV-cache events (engine/kv_event_publisher.py)
    speculative: SpeculativeConfig | None = None  # speculative decoding (engine/speculative/)


if __name__ == "__main__":  # python -m pagedllm.config: the option table for docs/api.md
    print(options_markdown(), end="")
