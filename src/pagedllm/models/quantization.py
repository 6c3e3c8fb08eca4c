"""Weight quantization methods by name (a registry): whether one applies here, and applying it.

``QUANTIZATION_METHODS`` maps each ``quantization`` option value but ``auto`` to a method that
says why it cannot apply to loaded weights on a device (None: it can), whether ``auto`` picks it,
and applies it to the loaded network. ``auto`` picks the first method that says so, else
``none``. A new method (AWQ, int8 weights) is a new entry, named in ``config.QUANTIZATIONS``
(the option's choices; a test keeps the two lists equal).
"""

from __future__ import annotations

from pagedllm.errors import ConfigError
from pagedllm.models.kernel_plan import DEFAULT_INT8_ROWS, KernelPlan
from pagedllm.models.loader import LoadedWeights


class NoQuantization:
    """The weights as loaded (dequantized from GGUF where they came so)."""

    def unusable_reason(self, weights: LoadedWeights, device: str) -> str | None:
        return None

    def picked_by_auto(self, weights: LoadedWeights, dtype: str, device: str) -> bool:
        return False

    def apply(self, net, weights: LoadedWeights, plan: KernelPlan | None) -> None:
        pass


class KeptBlocks:
    """A checkpoint's own 4/8-bit blocks kept as they are and run by the int4/int8 kernels for small
    steps (``models/quantized_linear.py``); CPU only. ``gguf``: GGUF's Q4_0/Q4_1/Q8_0 blocks;
    ``awq``: an AWQ checkpoint's 4-bit groups (``models/awq.py``), the same 4-bit path."""

    def __init__(self, source: str, needs: str) -> None:
        self.source, self.needs = source, needs

    def unusable_reason(self, weights: LoadedWeights, device: str) -> str | None:
        if weights.quant_format != self.source:
            return f"needs {self.needs}"
        return None if device == "cpu" else "runs on CPU only"

    def picked_by_auto(self, weights: LoadedWeights, dtype: str, device: str) -> bool:
        return self.unusable_reason(weights, device) is None and dtype != "float32"  # the fast path

    def apply(self, net, weights: LoadedWeights, plan: KernelPlan | None) -> None:
        net.use_gguf_quantized(weights.quantized, plan)


class Int8Weights:
    """``int8``: weight-only, per output channel, quantized from the loaded float weights
    (``LlamaForCausalLM.use_int8_weights``): an HF safetensors model's, or a GGUF's as dequantized
    (then its own blocks are not used); CPU only. The plan's ``int8_rows`` says up to how many rows
    its int8 kernel runs, larger steps dequantize per call."""

    def unusable_reason(self, weights: LoadedWeights, device: str) -> str | None:
        if weights.quant_format == "awq":
            return "needs float weights (an AWQ checkpoint is already 4-bit: quantization=awq)"
        return None if device == "cpu" else "runs on CPU only"

    def picked_by_auto(self, weights: LoadedWeights, dtype: str, device: str) -> bool:
        return False  # a choice of accuracy: asked for by name

    def apply(self, net, weights: LoadedWeights, plan: KernelPlan | None) -> None:
        cpp = plan is not None and plan.int8_kernel == "cpp"
        net.use_int8_weights(DEFAULT_INT8_ROWS if plan is None else plan.int8_rows, cpp_kernel=cpp)


QUANTIZATION_METHODS = {
    "none": NoQuantization(),
    "gguf": KeptBlocks("gguf", "a GGUF model with Q4_0, Q4_1 or Q8_0 tensors"),
    "awq": KeptBlocks("awq", "an AWQ checkpoint (config.json's quantization_config.quant_method awq)"),
    "int8": Int8Weights(),
}


def resolve_quantization(quantization: str, weights: LoadedWeights, dtype: str, device: str) -> str:
    """``auto`` -> the first method ``auto`` picks (``gguf`` for a GGUF with Q4_0/Q4_1/Q8_0 tensors,
    ``awq`` for an AWQ checkpoint, on CPU in bf16/fp16), else ``none``; an explicit method that
    cannot apply is a ``ConfigError``."""
    if quantization != "auto" and quantization not in QUANTIZATION_METHODS:
        raise ConfigError(f"quantization must be one of {('auto', *QUANTIZATION_METHODS)}, got {quantization!r}")
    if quantization == "auto":
        return next((name for name, method in QUANTIZATION_METHODS.items()
                     if method.picked_by_auto(weights, dtype, device)), "none")
    why = QUANTIZATION_METHODS[quantization].unusable_reason(weights, device)
    if why is not None:
        raise ConfigError(f"quantization={quantization!r} {why}")
    return quantization
