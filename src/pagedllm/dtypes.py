"""Dtype names (``config.DTYPE_BYTES``, the one table) as torch dtypes.

Kept apart from ``config`` so the control plane, which imports ``config``, never imports torch.
"""

from __future__ import annotations

import torch

from pagedllm.config import DTYPE_BYTES


def torch_dtype(name: str) -> torch.dtype:
    """``"bfloat16"`` -> ``torch.bfloat16``; a name outside the table raises ValueError."""
    if name not in DTYPE_BYTES:
        raise ValueError(f"dtype must be one of {tuple(DTYPE_BYTES)}, got {name!r}")
    return getattr(torch, name)
