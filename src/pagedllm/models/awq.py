"""AWQ checkpoints (AutoAWQ's GEMM packing) read as the 4-bit blocks that serve GGUF's Q4 weights.

An AWQ-quantized linear layer ``<name>`` is stored as three tensors (AutoAWQ's ``WQLinear_GEMM``,
which vLLM's ``awq`` method reads too), for a weight of ``in`` inputs and ``out`` outputs:

  ``<name>.qweight``  int32 [in, out / 8]       eight 4-bit codes per int32: nibble i (bits 4i..4i+3)
                                               holds output column ``8c + PACK_ORDER[i]``
  ``<name>.qzeros``   int32 [in / g, out / 8]   each group's zero point, packed alike
  ``<name>.scales``   float16 [in / g, out]     each group's scale

with ``w[o, i] = (q[i, o] - z[i // g, o]) * s[i // g, o]`` and group size g (``quantization_config``'s
``group_size``, 128 usually). ``awq_blocks`` turns them into a ``BlockQuantized`` [out, in] with
blocks of 32: a group of g inputs is g / 32 blocks sharing its scale, ``scale = s`` and
``minimum = -s * z``, so ``scale * q + minimum`` is ``s * (q - z)`` exactly (in float32 both
products of a float16 and a 4-bit integer are exact, and so is their difference). Embeddings, norms,
biases and the LM head stay as stored (AWQ does not quantize them).
"""

from __future__ import annotations

import torch

from pagedllm.errors import ModelLoadError
from pagedllm.models.gguf_quant import BLOCK, BlockQuantized

PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of an int32 holds column PACK_ORDER[i] of its eight
SUPPORTED_CONFIG = "quant_method awq, bits 4, zero_point true, version gemm, group_size a multiple of 32 or -1"


def unpack_columns(packed: torch.Tensor) -> torch.Tensor:
    """int32 [R, C / 8] packed as above -> uint8 codes [R, C] in column order."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    nibbles = (packed[..., None] >> shifts) & 0xF  # [R, C / 8, 8], nibble i
    columns = torch.empty_like(nibbles)
    columns[..., list(PACK_ORDER)] = nibbles
    return columns.reshape(packed.shape[0], -1).to(torch.uint8)


def pack_columns(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes [R, C] (0..15) -> int32 [R, C / 8] packed as above: ``unpack_columns``' inverse."""
    packed = torch.zeros(codes.shape[0], codes.shape[1] // 8, dtype=torch.int64)
    for nibble, column in enumerate(PACK_ORDER):
        packed |= codes[:, column::8].to(torch.int64) << (4 * nibble)
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


def round_to_groups(weight: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A float weight [out, in] rounded to nearest per group of ``group`` inputs, asymmetric (AWQ's
    storage without its scale search): codes uint8 [in, out], zeros uint8 [in / group, out] and
    float16 scales [in / group, out], as ``awq_blocks`` reads them once packed."""
    w = weight.t().float()  # [in, out]
    groups = w.reshape(w.shape[0] // group, group, -1)
    low, high = groups.amin(dim=1), groups.amax(dim=1)
    scales = ((high - low) / 15).clamp(min=1e-4).half()
    zeros = torch.round(-low / scales.float()).clamp(0, 15)
    codes = torch.round(groups / scales.float()[:, None] + zeros[:, None]).clamp(0, 15)
    return codes.reshape(w.shape).to(torch.uint8), zeros.to(torch.uint8), scales


def check_awq_config(config: dict) -> int:
    """The group size of a ``quantization_config`` AWQ checkpoint this loader reads; ``ModelLoadError``
    naming what differs otherwise."""
    bits, version = config.get("bits", config.get("w_bit")), str(config.get("version", "gemm")).lower()
    group = config.get("group_size", config.get("q_group_size"))
    zero_point = config.get("zero_point", True)
    if bits != 4 or version != "gemm" or not zero_point or not isinstance(group, int) or \
            (group != -1 and (group <= 0 or group % BLOCK)):
        raise ModelLoadError(f"AWQ checkpoint with bits={bits}, version={version!r}, zero_point={zero_point}, "
                             f"group_size={group} is not supported (supported: {SUPPORTED_CONFIG})")
    return group


def awq_blocks(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group_size: int,
               name: str = "weight") -> BlockQuantized:
    """One AWQ layer's tensors -> its weight [out, in] as 4-bit blocks of 32 (see the module docstring);
    ``group_size`` -1: one group over all inputs. Shapes that do not fit are a ``ModelLoadError``."""
    if qweight.dtype != torch.int32 or qzeros.dtype != torch.int32:
        raise ModelLoadError(f"{name}: AWQ qweight/qzeros must be int32, got {qweight.dtype}/{qzeros.dtype}")
    codes = unpack_columns(qweight)  # [in, out]
    inputs, outputs = codes.shape
    group = inputs if group_size == -1 else group_size
    groups = inputs // group if group and inputs % group == 0 else -1
    if group % BLOCK or groups < 1 or scales.shape != (groups, outputs) or qzeros.shape != (groups, outputs // 8):
        raise ModelLoadError(f"{name}: AWQ shapes qweight {tuple(qweight.shape)}, qzeros {tuple(qzeros.shape)}, "
                             f"scales {tuple(scales.shape)} do not fit group size {group_size}")
    zeros = unpack_columns(qzeros).float()  # [groups, out]
    scale = scales.float()
    per_group = group // BLOCK
    return BlockQuantized(codes.t().contiguous(),
                          scale.t().repeat_interleave(per_group, dim=1).contiguous(),
                          (-scale * zeros).t().repeat_interleave(per_group, dim=1).contiguous())


def read_awq_state(state: dict[str, torch.Tensor], group_size: int) -> dict[str, BlockQuantized]:
    """Replace every ``<name>.qweight/.qzeros/.scales`` triple in ``state`` by ``<name>.weight``
    (dequantized, float32) and return the blocks by that weight's name."""
    blocks: dict[str, BlockQuantized] = {}
    for key in [k for k in state if k.endswith(".qweight")]:
        prefix = key.removesuffix(".qweight")
        missing = [s for s in (".qzeros", ".scales") if prefix + s not in state]
        if missing:
            raise ModelLoadError(f"AWQ layer {prefix} has a qweight but no {', '.join(missing)}")
        b = awq_blocks(state.pop(key), state.pop(prefix + ".qzeros"), state.pop(prefix + ".scales"), group_size,
                       prefix)
        blocks[prefix + ".weight"] = b
        state[prefix + ".weight"] = b.dequantize()
    if not blocks:
        raise ModelLoadError("the checkpoint says it is AWQ-quantized but holds no .qweight tensors")
    return blocks
