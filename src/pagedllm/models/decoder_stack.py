"""The decoder's layer loop in one C++ call per step (``models/csrc/decoder_stack_cpu.cpp``).

The Python loop of ``LlamaForCausalLM.forward`` crosses into C++ about nine times per layer
(norms, four projections, the fused attention, SiLU-and-multiply): at batch 1 those crossings
cost more than the norms and activations they call. ``DecoderStack`` holds the same weights and
kernels and runs the same calls in the same order from C++, so its hidden states are bit-identical
to the Python loop's (tested); Python then makes one call per step.

It applies where every part of a layer already runs in our C++ or in torch ops callable from C++:
the C++ layer ops (``CpuLayerOps``), the C++ attention backend (``CpuBackend``, RoPE fused), and
projections whose kernels are the dense ones of ``Linear`` (oneDNN's, the AVX2 panel GEMM,
``at::linear``, the int8 weight dequantized per call) or a 4-bit / Q8_0 / int8 small-batch kernel.
``build_decoder_stack`` returns None anywhere else (another backend, a GPU, torch layer ops, a
kernel it does not know, a plain float32 copy of a widened weight where oneDNN packs nothing), and
the model keeps its Python loop.
"""

from __future__ import annotations

import logging
from pathlib import Path

from pagedllm.cpu_extension import CppExtension
from pagedllm.models.layer_ops import CpuLayerOps
from pagedllm.models.quantized_linear import (
    Int4BlockMatmul,
    Int4Matmul,
    Int4TileMatmul,
    Int8BlockMatmul,
    Int8ChannelMatmul,
    Int8TileMatmul,
    Linear,
)

log = logging.getLogger(__name__)

EXTENSION = CppExtension("pagedllm_decoder_stack", Path(__file__).parent / "csrc" / "decoder_stack_cpu.cpp",
                         "the C++ decoder stack", "running the layer loop in Python")

# the C++ side's codes (Projection::Dense, Projection::Small)
DENSE_PLAIN, DENSE_PACKED, DENSE_PACKED_WIDENED, DENSE_PANELS_WIDENED, DENSE_INT8 = 0, 1, 2, 3, 4
SMALL_NONE, SMALL_INT4, SMALL_Q8_0, SMALL_Q4, SMALL_INT8, SMALL_Q4_TILES, SMALL_Q8_0_TILES = 0, 1, 2, 3, 4, 5, 6


def describe_projection(module, linear: Linear, dtype):
    """``linear``'s kernels as a C++ ``Projection`` for a ``dtype`` model, or None if one of them is
    not one the stack runs."""
    small, a, b = SMALL_NONE, None, None
    kernel = linear.small_batch
    if isinstance(kernel, Int8ChannelMatmul):  # b: its block scales where float32/float16 rows run q8_0_linear
        b = kernel.blocks.scale if kernel.runs_blocks(dtype) else kernel.scales_for(dtype)
        small, a = SMALL_INT8, kernel.codes
    elif isinstance(kernel, Int4Matmul):
        small, a, b = SMALL_INT4, kernel.packed, kernel.scales_and_zeros
    elif isinstance(kernel, Int8BlockMatmul):
        small, a, b = SMALL_Q8_0, kernel.codes, kernel.scale
    elif isinstance(kernel, Int4BlockMatmul):
        small, a, b = SMALL_Q4, kernel.codes, kernel.scale_min
    elif isinstance(kernel, Int4TileMatmul):
        small, a, b = SMALL_Q4_TILES, kernel.codes, kernel.scale_min
    elif isinstance(kernel, Int8TileMatmul):
        small, a, b = SMALL_Q8_0_TILES, kernel.codes, kernel.scales
    elif kernel is not None:
        return None
    if linear.int8_weight is not None:
        dense, weight, bias = DENSE_INT8, linear.int8_weight.codes, linear.small_batch_bias
    elif linear.panels is not None:
        dense, weight, bias = DENSE_PANELS_WIDENED, linear.panels, linear.packed_bias
    elif linear.packed is not None:
        dense = DENSE_PACKED if linear.widen is None else DENSE_PACKED_WIDENED
        weight, bias = linear.packed, linear.packed_bias
    elif linear.weight is not None:
        dense, weight = DENSE_PLAIN, linear.weight.detach()
        bias = None if linear.bias is None else linear.bias.detach()
    else:
        return None
    return module.Projection(dense, weight, bias, small, linear.max_rows, a, b, linear.small_batch_bias,
                             linear.out_features)


def _refused(why: str) -> None:
    log.debug("the C++ decoder stack does not apply, the Python layer loop runs: %s", why)
    return None


def build_decoder_stack(model, backend):
    """A C++ ``DecoderStack`` over ``model``'s layers (as loaded, quantized and prepacked now) for
    ``backend``, or None where the Python loop has to run (see the module docstring)."""
    if not isinstance(model.layer_ops, CpuLayerOps):
        return _refused("the layer ops are torch's, not the C++ ones")
    if not getattr(backend, "fuses_rope", False):
        return _refused(f"the {getattr(backend, 'name', backend)} attention backend has no fused C++ attention")
    attend = getattr(getattr(backend, "ops", None), "rope_store_attend_fn", None)
    if attend is None or model.rotary.cos.device.type != "cpu":
        return _refused("the attention extension hands no C++ function here (or the model is not on the CPU)")
    module = EXTENSION.load()
    if module is None:
        return _refused(f"the extension is unavailable: {EXTENSION.failure}")
    layers = []
    for i, layer in enumerate(model.layers):
        attention, mlp = layer.self_attn, layer.mlp
        named = {"qkv_proj": attention.qkv_proj, "o_proj": attention.o_proj, "gate_up_proj": mlp.gate_up_proj,
                 "down_proj": mlp.down_proj}
        parts = [describe_projection(module, p, model.dtype) for p in named.values()]
        if any(p is None for p in parts):
            name, linear = next((n, lin) for (n, lin), p in zip(named.items(), parts, strict=True) if p is None)
            kernel = type(linear.small_batch).__name__ if linear.small_batch is not None else "its dense layout"
            return _refused(f"layer {i}'s {name} runs a kernel the stack does not know ({kernel})")
        ln1, ln2 = layer.input_layernorm, layer.post_attention_layernorm
        layers.append(module.Layer(ln1.weight.detach(), ln1.eps, ln2.weight.detach(), ln2.eps, *parts))
    first = model.layers[0].self_attn
    return module.DecoderStack(layers, model.norm.weight.detach(), model.norm.eps, first.num_heads, first.q_size,
                               backend.scale, attend)
