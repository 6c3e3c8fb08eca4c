"""The attention backends by name (a registry), and the choice of one for a device.

Every backend has the same methods: ``write_kv(kv, key, value, meta)`` and ``forward(query, kv,
meta)``, ``kv`` one layer's ``LayerKV`` (``attention/base.py``). ``REGISTRY`` maps a name to a
factory ``(scale) -> backend`` that imports its module only when asked (Triton needs a GPU stack;
the C++ backend builds its kernel on first use). ``auto``: Triton on CUDA; the C++ kernel on CPU
when it builds, else the pure-torch reference. A new backend is a new entry (``register_backend``),
named in ``config.ATTENTION_BACKENDS`` (the option's choices; a test keeps the two lists equal).
"""

from __future__ import annotations

from collections.abc import Callable

from pagedllm.attention.base import AttentionBackend


def _reference(scale: float) -> AttentionBackend:
    from pagedllm.attention.reference import ReferenceBackend

    return ReferenceBackend(scale)


def _cpu(scale: float) -> AttentionBackend:
    from pagedllm.attention.cpu_kernel import CpuBackend

    return CpuBackend(scale)


def _triton(scale: float) -> AttentionBackend:
    from pagedllm.attention.triton_kernel import TritonBackend

    return TritonBackend(scale)


REGISTRY: dict[str, Callable[[float], AttentionBackend]] = {"reference": _reference, "cpu": _cpu, "triton": _triton}


def register_backend(name: str, factory: Callable[[float], AttentionBackend]) -> None:
    """Add (or replace) a backend under ``name``."""
    REGISTRY[name] = factory


def auto_backend(device: str) -> str:
    """What ``auto`` means on ``device``."""
    if device.startswith("cuda"):
        return "triton"
    if device == "cpu":
        from pagedllm.attention.cpu_kernel import load_cpu_kernel

        if load_cpu_kernel() is not None:
            return "cpu"
    return "reference"


def get_backend(name: str, device: str, head_dim: int) -> AttentionBackend:
    if name != "auto" and name not in REGISTRY:
        raise ValueError(f"attention_backend must be one of {('auto', *REGISTRY)}, got {name!r}")
    return REGISTRY[auto_backend(device) if name == "auto" else name](head_dim ** -0.5)
