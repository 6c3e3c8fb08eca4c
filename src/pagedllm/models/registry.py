"""Model architectures by name (a registry): GGUF's ``general.architecture`` or HF's ``model_type``
-> the class that runs it. Llama, Mistral and Qwen2 share one decoder (``models/llama.py``: GQA,
RoPE, optional q/k/v bias); a new family is a new entry (``register_architecture``)."""

from __future__ import annotations

from pagedllm.errors import ModelLoadError
from pagedllm.models.llama import LlamaForCausalLM

ARCHITECTURES: dict[str, type] = {"llama": LlamaForCausalLM, "mistral": LlamaForCausalLM, "qwen2": LlamaForCausalLM}


def register_architecture(name: str, model_class: type) -> None:
    ARCHITECTURES[name] = model_class


def model_class(architecture: str) -> type:
    """The class that runs ``architecture``; ``ModelLoadError`` naming those supported otherwise."""
    try:
        return ARCHITECTURES[architecture]
    except KeyError:
        raise ModelLoadError(f"architecture {architecture!r} is not supported (supported: "
                             f"{tuple(ARCHITECTURES)})") from None
