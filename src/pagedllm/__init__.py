"""pagedllm: LLM inference over a block-paged KV cache with continuous batching.

Public API (imported lazily so ``import pagedllm`` stays cheap): ``LLM``, ``SamplingParams``,
``RequestOutputKind``, ``RequestOutput``, ``CompletionOutput``, ``Logprob``, ``BeamSearchParams``,
``StructuredOutputsParams``, ``EngineOptions``, and the errors in ``pagedllm.errors``.
"""

from __future__ import annotations

import importlib
import os

from pagedllm.build_record import emulated_family

# PAGEDLLM_CPU_FAMILY (build_record): cap torch's own kernels to that family too. ATen and oneDNN
# read these at their first dispatch, so this holds wherever pagedllm is imported before any op ran.
for _name, _value in (_family.torch_env if (_family := emulated_family()) else ()):
    os.environ.setdefault(_name, _value)

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "RequestOutputKind", "RequestOutput", "CompletionOutput", "Logprob",
           "BeamSearchParams", "StructuredOutputsParams", "EngineOptions"]

_LAZY = {
    "LLM": "pagedllm.llm",
    "SamplingParams": "pagedllm.engine.sampling_params",
    "RequestOutputKind": "pagedllm.engine.sampling_params",
    "StructuredOutputsParams": "pagedllm.engine.sampling_params",
    "Logprob": "pagedllm.engine.outputs",
    "EngineOptions": "pagedllm.config",
    "RequestOutput": "pagedllm.engine.outputs",
    "CompletionOutput": "pagedllm.engine.outputs",
    "BeamSearchParams": "pagedllm.engine.beam_search",
}


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'pagedllm' has no attribute {name!r}")
