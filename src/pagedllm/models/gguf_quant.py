"""GGUF's block-quantized weights kept as codes and scales (Q4_0, Q4_1, Q8_0).

A ``BlockQuantized`` tensor is an [N, K] weight in blocks of 32 along K:
``w = scale * code + minimum`` per block, with 4-bit codes 0..15 (``uint8``) or signed 8-bit codes
(``int8``, minimum 0). It is decoded straight from the GGUF bytes (ggml's block layouts below)
and dequantizes to exactly what ``gguf.quants.dequantize`` gives: products of an fp16 scale and a
small integer are exact in float32, and Q4_1 adds its minimum with one rounding, as ggml does.

ggml block layouts (little-endian; 32 weights each):
  Q4_0: fp16 d, 16 bytes of nibbles                -> w = d * (q - 8)
  Q4_1: fp16 d, fp16 m, 16 bytes of nibbles        -> w = d * q + m
  Q8_0: fp16 d, 32 int8                            -> w = d * q
Nibble j of a block's byte i holds weight i (low) or i + 16 (high).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

BLOCK = 32
SUPPORTED = ("Q4_0", "Q4_1", "Q8_0")


@dataclass(frozen=True)
class BlockQuantized:
    codes: torch.Tensor            # [N, K] uint8 (4-bit, 0..15) or int8 (8-bit)
    scale: torch.Tensor            # [N, K // 32] float32
    minimum: torch.Tensor | None   # [N, K // 32] float32 for 4-bit codes; None for 8-bit

    def __post_init__(self) -> None:
        n, k = self.codes.shape
        if k % BLOCK or self.scale.shape != (n, k // BLOCK):
            raise ValueError(f"codes {tuple(self.codes.shape)} and scales {tuple(self.scale.shape)} do not match")
        if (self.codes.dtype == torch.uint8) != (self.minimum is not None):
            raise ValueError("4-bit (uint8) codes need a minimum per block; 8-bit (int8) codes have none")

    @property
    def bits(self) -> int:
        return 4 if self.codes.dtype == torch.uint8 else 8

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)

    def dequantize(self) -> torch.Tensor:
        n, k = self.codes.shape
        blocks = self.codes.view(n, k // BLOCK, BLOCK).float() * self.scale[..., None]
        if self.minimum is not None:
            blocks = blocks + self.minimum[..., None]
        return blocks.view(n, k)

    def map_rows(self, fn) -> BlockQuantized:
        """Apply the same row transform (e.g. llama.cpp's Q/K un-permutation) to codes and scales."""
        return BlockQuantized(fn(self.codes), fn(self.scale), None if self.minimum is None else fn(self.minimum))

    @staticmethod
    def cat(parts: list[BlockQuantized]) -> BlockQuantized | None:
        """Stack along rows (fusing q/k/v or gate/up); None when the parts' kinds differ."""
        if len({p.bits for p in parts}) != 1 or len({p.shape[1] for p in parts}) != 1:
            return None
        minimum = None if parts[0].minimum is None else torch.cat([p.minimum for p in parts])
        return BlockQuantized(torch.cat([p.codes for p in parts]), torch.cat([p.scale for p in parts]), minimum)

    def tensors(self, name: str) -> dict[str, torch.Tensor]:
        """Flat entries for a safetensors file (``from_tensors`` reads them back)."""
        out = {f"{name}.codes": self.codes, f"{name}.scale": self.scale}
        if self.minimum is not None:
            out[f"{name}.min"] = self.minimum
        return out

    @staticmethod
    def from_tensors(entries: dict[str, torch.Tensor]) -> dict[str, BlockQuantized]:
        """Collect ``<name>.codes/.scale/.min`` entries (removed from ``entries``) into tensors by name."""
        names = [k.removesuffix(".codes") for k in list(entries) if k.endswith(".codes")]
        return {n: BlockQuantized(entries.pop(f"{n}.codes"), entries.pop(f"{n}.scale"), entries.pop(f"{n}.min", None))
                for n in names}


def _fp16(raw: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(raw).view(np.float16).astype(np.float32)[..., 0])


def decode_blocks(kind: str, data: np.ndarray, rows: int, cols: int) -> BlockQuantized:
    """Codes and scales of a GGUF tensor from its raw bytes (``ReaderTensor.data``, [rows, bytes])."""
    if kind not in SUPPORTED:
        raise ValueError(f"{kind} blocks are not kept quantized (supported: {SUPPORTED})")
    blocks = np.asarray(data, dtype=np.uint8).reshape(rows, cols // BLOCK, -1)
    scale = _fp16(blocks[..., 0:2])
    if kind == "Q8_0":
        codes = torch.from_numpy(np.ascontiguousarray(blocks[..., 2:34]).view(np.int8).reshape(rows, cols))
        return BlockQuantized(codes, scale, None)
    offset = 4 if kind == "Q4_1" else 2
    packed = blocks[..., offset:offset + 16]
    nibbles = np.concatenate([packed & 0x0F, packed >> 4], axis=-1)  # weights 0..15, then 16..31
    codes = torch.from_numpy(np.ascontiguousarray(nibbles).reshape(rows, cols))
    minimum = _fp16(blocks[..., 2:4]) if kind == "Q4_1" else -8.0 * scale
    return BlockQuantized(codes, scale, minimum)
