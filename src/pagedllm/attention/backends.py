"""Pick an attention backend by name and device. Every backend has the same two methods:
``write_kv(kv, key, value, meta)`` and ``forward(query, kv, meta)``, ``kv`` one layer's ``LayerKV``.

``auto``: Triton on CUDA; the C++ kernel on CPU when it builds, else the pure-torch reference.
"""

from __future__ import annotations

from pagedllm.attention.reference import ReferenceBackend

BACKENDS = ("auto", "reference", "cpu", "triton")


def get_backend(name: str, device: str, head_dim: int):
    if name not in BACKENDS:
        raise ValueError(f"attention_backend must be one of {BACKENDS}, got {name!r}")
    scale = head_dim ** -0.5
    if name == "reference":
        return ReferenceBackend(scale)
    if name == "triton" or (name == "auto" and device.startswith("cuda")):
        from pagedllm.attention.triton_kernel import TritonBackend

        return TritonBackend(scale)
    if name == "cpu" or device == "cpu":
        from pagedllm.attention.cpu_kernel import CpuBackend, load_cpu_kernel

        if name == "cpu" or load_cpu_kernel() is not None:
            return CpuBackend(scale)
    return ReferenceBackend(scale)
