"""Pick an attention backend by name and device. Every backend has the same two methods:
``write_kv(k_cache, v_cache, key, value, meta)`` and ``forward(query, k_cache, v_cache, meta)``.
"""

from __future__ import annotations

from pagedllm.attention.reference import ReferenceBackend

BACKENDS = ("auto", "reference")


def get_backend(name: str, device: str, head_dim: int):
    if name not in BACKENDS:
        raise ValueError(f"attention_backend must be one of {BACKENDS}, got {name!r}")
    return ReferenceBackend(scale=head_dim ** -0.5)
