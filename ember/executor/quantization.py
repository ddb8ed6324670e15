"""Dequantize quantized checkpoints on load, so any device can run them in bf16 / fp32.

Two on-disk formats, as the checkpoints that matter store them:

- Block FP8 (DeepSeek-V3/R1, Kimi K2 Instruct; `quant_method: fp8`, `weight_block_size`):
  `X.weight` is float8_e4m3fn [out, in] and `X.weight_scale_inv` float32
  [ceil(out/128), ceil(in/128)]; the real weight is weight * scale_inv of its 128x128 block.
- compressed-tensors `pack-quantized` (Kimi K2-Thinking / K2.5; `quant_method:
  compressed-tensors`): `X.weight_packed` int32 [out, ceil(in/8)] holds eight 4-bit values per
  int32, value j of a word in bits 4j..4j+3, stored with an offset of 8 (unsigned 0..15 for
  signed -8..7); `X.weight_scale` [out, in/group_size] (bf16); `X.weight_shape` [2] the
  unpacked shape. The real weight is value * scale of its group of 32 along `in`.

Layers a checkpoint leaves unquantized (norms, router, embeddings, often attention) pass
through untouched. `dequantize_checkpoint` wraps the checkpoint's (name, tensor) iterator and
buffers a quantized weight's parts until all of them have been seen (they are usually adjacent).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

logger = logging.getLogger(__name__)

FP8_DTYPES = (torch.float8_e4m3fn,)
FP8_PARTS = frozenset({"weight", "weight_scale_inv"})
PACKED_PARTS = frozenset({"weight_packed", "weight_scale", "weight_shape"})


@dataclass(frozen=True)
class QuantConfig:
    method: str  # "fp8_block" or "pack_quantized"
    block_size: tuple[int, int] = (128, 128)  # fp8_block: scale block [rows, cols]
    num_bits: int = 4  # pack_quantized
    group_size: int | None = 32  # pack_quantized; None = one scale per output row

    @property
    def parts(self) -> frozenset[str]:
        return FP8_PARTS if self.method == "fp8_block" else PACKED_PARTS

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> QuantConfig | None:
        """Read `quantization_config` (top level or inside `text_config`); None if absent."""
        q = cfg.get("quantization_config") or (cfg.get("text_config") or {}).get(
            "quantization_config")
        if not q:
            return None
        method = q.get("quant_method")
        if method == "fp8":
            block = q.get("weight_block_size")
            if not block or len(block) != 2:
                raise ValueError("quantization_config.weight_block_size: only block-wise FP8 "
                                 f"(e.g. [128, 128]) is supported, got {block!r}")
            if q.get("fmt", "e4m3") != "e4m3":
                raise ValueError(f"quantization_config.fmt {q['fmt']!r} is not supported (e4m3)")
            return cls("fp8_block", block_size=(int(block[0]), int(block[1])))
        if method == "compressed-tensors":
            return cls._from_compressed_tensors(q)
        raise ValueError(f"quantization_config.quant_method {method!r} is not supported "
                         "(supported: fp8 with weight_block_size, compressed-tensors "
                         "pack-quantized)")

    @classmethod
    def _from_compressed_tensors(cls, q: dict[str, Any]) -> QuantConfig:
        if q.get("format") != "pack-quantized":
            raise ValueError(f"quantization_config.format {q.get('format')!r} is not supported "
                             "(pack-quantized)")
        schemes = [g.get("weights") or {} for g in (q.get("config_groups") or {}).values()]
        if not schemes or any(s != schemes[0] for s in schemes):
            raise ValueError("quantization_config.config_groups: expected one weight scheme, "
                             f"got {len(schemes)} different ones")
        w = schemes[0]
        if w.get("type") != "int" or w.get("num_bits") not in (4, 8):
            raise ValueError("quantization_config.config_groups: weights must be int4 or int8, "
                             f"got {w.get('type')} {w.get('num_bits')} bits")
        if not w.get("symmetric", True):
            raise ValueError("quantization_config.config_groups: only symmetric weights "
                             "(no zero point) are supported")
        strategy = w.get("strategy")
        if strategy not in ("group", "channel"):
            raise ValueError(f"quantization_config.config_groups: strategy {strategy!r} is not "
                             "supported (group, channel)")
        group_size = w.get("group_size") if strategy == "group" else None
        return cls("pack_quantized", num_bits=w["num_bits"], group_size=group_size)


def dequantize_fp8_block(weight: torch.Tensor, scale_inv: torch.Tensor,
                         block_size: tuple[int, int] = (128, 128)) -> torch.Tensor:
    """float8 weight [out, in] * per-block scale [ceil(out/b0), ceil(in/b1)] -> float32."""
    rows, cols = weight.shape
    b0, b1 = block_size
    expected = (math.ceil(rows / b0), math.ceil(cols / b1))
    if tuple(scale_inv.shape) != expected:
        raise ValueError(f"weight_scale_inv has shape {tuple(scale_inv.shape)}, expected "
                         f"{expected} for a {rows}x{cols} weight in {b0}x{b1} blocks")
    scale = scale_inv.float().repeat_interleave(b0, 0)[:rows].repeat_interleave(b1, 1)[:, :cols]
    return weight.float() * scale


def unpack_int32(packed: torch.Tensor, num_bits: int, cols: int) -> torch.Tensor:
    """int32 [rows, ceil(cols * num_bits / 32)] -> signed int8 values [rows, cols]."""
    per_word = 32 // num_bits
    shifts = torch.arange(per_word, dtype=torch.int32, device=packed.device) * num_bits
    values = (packed.unsqueeze(-1) >> shifts) & ((1 << num_bits) - 1)
    return (values.flatten(1)[:, :cols] - (1 << (num_bits - 1))).to(torch.int8)


def dequantize_packed(packed: torch.Tensor, scale: torch.Tensor, shape: torch.Tensor,
                      num_bits: int = 4, group_size: int | None = 32) -> torch.Tensor:
    """compressed-tensors pack-quantized weight -> float32 [out, in]."""
    rows, cols = (int(v) for v in shape.tolist())
    if packed.dtype != torch.int32 or packed.shape[0] != rows:
        raise ValueError(f"weight_packed: expected int32 with {rows} rows, got "
                         f"{packed.dtype} {tuple(packed.shape)}")
    group = group_size or cols
    if tuple(scale.shape) != (rows, math.ceil(cols / group)):
        raise ValueError(f"weight_scale has shape {tuple(scale.shape)}, expected "
                         f"{(rows, math.ceil(cols / group))} for groups of {group}")
    values = unpack_int32(packed, num_bits, cols).float()
    return values * scale.float().repeat_interleave(group, 1)[:, :cols]


def dequantize_checkpoint(tensors: Iterable[tuple[str, torch.Tensor]], quant: QuantConfig | None,
                          dtype: torch.dtype = torch.float32) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield the checkpoint's (name, tensor) pairs with quantized weights replaced by
    `{module}.weight` in `dtype`; other tensors pass through unchanged."""
    if quant is None:
        yield from tensors
        return
    pending: dict[str, dict[str, torch.Tensor]] = {}
    count = 0
    for name, tensor in tensors:
        module, _, part = name.rpartition(".")
        if part not in quant.parts or (part == "weight" and tensor.dtype not in FP8_DTYPES):
            yield name, tensor
            continue
        group = pending.setdefault(module, {})
        group[part] = tensor
        if quant.parts <= group.keys():
            del pending[module]
            yield f"{module}.weight", _dequantize(group, quant).to(dtype)
            count += 1
    if pending:
        module, group = next(iter(pending.items()))
        raise ValueError(f"checkpoint: quantized weight {module!r} has only "
                         f"{sorted(group)} (needs {sorted(quant.parts)}); "
                         f"{len(pending)} incomplete in all")
    logger.info("dequantized %d %s weights to %s", count, quant.method, dtype)


def _dequantize(parts: dict[str, torch.Tensor], quant: QuantConfig) -> torch.Tensor:
    if quant.method == "fp8_block":
        return dequantize_fp8_block(parts["weight"], parts["weight_scale_inv"], quant.block_size)
    return dequantize_packed(parts["weight_packed"], parts["weight_scale"], parts["weight_shape"],
                             quant.num_bits, quant.group_size)
