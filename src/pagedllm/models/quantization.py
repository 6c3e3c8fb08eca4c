"""Weight quantization methods by name (a registry): whether one applies here, and applying it.

``QUANTIZATION_METHODS`` maps each ``quantization`` option value but ``auto`` to a method that
says why it cannot apply to loaded weights on a device (None: it can), whether ``auto`` picks it,
and applies it to the loaded network. ``auto`` picks the first method that says so, else
``none``. A new method (AWQ, int8 weights) is a new entry, named in ``config.QUANTIZATIONS``
(the option's choices; a test keeps the two lists equal).
"""

from __future__ import annotations

from pagedllm.errors import ConfigError
from pagedllm.models.kernel_plan import KernelPlan
from pagedllm.models.loader import LoadedWeights


class NoQuantization:
    """The weights as loaded (dequantized from GGUF where they came so)."""

    def unusable_reason(self, weights: LoadedWeights, device: str) -> str | None:
        return None

    def picked_by_auto(self, weights: LoadedWeights, dtype: str, device: str) -> bool:
        return False

    def apply(self, net, weights: LoadedWeights, plan: KernelPlan | None) -> None:
        pass


class GGUFBlocks:
    """GGUF's Q4_0/Q4_1/Q8_0 blocks kept as they are and run by the int4/int8 kernels for small
    steps (``models/quantized_linear.py``); CPU only."""

    def unusable_reason(self, weights: LoadedWeights, device: str) -> str | None:
        if not weights.quantized:
            return "needs a GGUF model with Q4_0, Q4_1 or Q8_0 tensors"
        return None if device == "cpu" else "runs on CPU only"

    def picked_by_auto(self, weights: LoadedWeights, dtype: str, device: str) -> bool:
        return self.unusable_reason(weights, device) is None and dtype != "float32"  # the fast path

    def apply(self, net, weights: LoadedWeights, plan: KernelPlan | None) -> None:
        net.use_gguf_quantized(weights.quantized, plan)


QUANTIZATION_METHODS = {"none": NoQuantization(), "gguf": GGUFBlocks()}


def resolve_quantization(quantization: str, weights: LoadedWeights, dtype: str, device: str) -> str:
    """``auto`` -> the first method ``auto`` picks (``gguf`` for a GGUF with Q4_0/Q4_1/Q8_0 tensors on
    CPU in bf16/fp16), else ``none``; an explicit method that cannot apply is a ``ConfigError``."""
    if quantization != "auto" and quantization not in QUANTIZATION_METHODS:
        raise ConfigError(f"quantization must be one of {('auto', *QUANTIZATION_METHODS)}, got {quantization!r}")
    if quantization == "auto":
        return next((name for name, method in QUANTIZATION_METHODS.items()
                     if method.picked_by_auto(weights, dtype, device)), "none")
    why = QUANTIZATION_METHODS[quantization].unusable_reason(weights, device)
    if why is not None:
        raise ConfigError(f"quantization={quantization!r} {why}")
    return quantization
