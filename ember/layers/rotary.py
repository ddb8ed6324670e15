"""Rotary position embeddings: default, linear, llama3 and YaRN frequency schedules.

Rotation uses the half-split ("neox") layout that Hugging Face checkpoints use. Only the first
`rotary_dim` features of each head rotate (partial rotary); the rest pass through.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn


def _default_inv_freq(base: float, dim: int) -> torch.Tensor:
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def _llama3_inv_freq(base: float, dim: int, p: dict[str, Any]) -> torch.Tensor:
    inv_freq = _default_inv_freq(base, dim)
    factor = p["factor"]
    low, high = p["low_freq_factor"], p["high_freq_factor"]
    old_len = p["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn_inv_freq(base: float, dim: int, p: dict[str, Any],
                   max_position: int) -> tuple[torch.Tensor, float]:
    orig = p.get("original_max_position_embeddings") or max_position
    factor = p.get("factor") or max_position / orig
    attention_factor = p.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = p.get("mscale"), p.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = yarn_mscale(factor)
    beta_fast = p.get("beta_fast") or 32
    beta_slow = p.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(orig / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation = 1.0 / pos_freqs
    interpolation = 1.0 / (factor * pos_freqs)
    keep = 1 - ramp
    return interpolation * (1 - keep) + extrapolation * keep, float(attention_factor)


def rope_parameters(rope_type: str, base: float, rotary_dim: int, scaling: dict[str, Any] | None,
                    max_position: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and the cos/sin scale for one rope type."""
    p = scaling or {}
    if rope_type == "default":
        return _default_inv_freq(base, rotary_dim), 1.0
    if rope_type == "linear":
        return _default_inv_freq(base, rotary_dim) / p["factor"], 1.0
    if rope_type == "llama3":
        return _llama3_inv_freq(base, rotary_dim, p), 1.0
    if rope_type == "yarn":
        return _yarn_inv_freq(base, rotary_dim, p, max_position)
    raise ValueError(f"rope_scaling: rope type {rope_type!r} is not supported "
                     "(supported: default, linear, llama3, yarn)")


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class RotaryEmbedding(nn.Module):
    def __init__(self, rotary_dim: int, max_position: int, base: float,
                 scaling: dict[str, Any] | None = None) -> None:
        super().__init__()
        rope_type = (scaling or {}).get("rope_type") or (scaling or {}).get("type") or "default"
        # computed on the CPU even while a model is built on the meta device; the cos/sin
        # table moves to the compute device on first use
        with torch.device("cpu"):
            self.inv_freq, self.attention_scaling = rope_parameters(
                rope_type, base, rotary_dim, scaling, max_position)
        self.rotary_dim = rotary_dim
        self._cos_sin: torch.Tensor | None = None

    def _table(self, n: int, device: torch.device) -> torch.Tensor:
        if self._cos_sin is None or self._cos_sin.shape[0] < n or self._cos_sin.device != device:
            size = max(n, 4096)
            pos = torch.arange(size, dtype=torch.float32, device=device)
            freqs = torch.outer(pos, self.inv_freq.to(device))
            emb = torch.cat((freqs, freqs), dim=-1)
            self._cos_sin = torch.stack((emb.cos(), emb.sin())) * self.attention_scaling
        return self._cos_sin

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """[2, T, 1, rotary_dim] cos and sin for the given positions."""
        table = self._table(int(positions.max()) + 1 if positions.numel() else 1,
                            positions.device)
        return table[:, positions].unsqueeze(2).to(dtype)

    @staticmethod
    def apply(x: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
        """Rotate x [T, H, D] in place of its first rotary_dim features."""
        cos, sin = cos_sin[0], cos_sin[1]
        rd = cos.shape[-1]
        if rd == x.shape[-1]:
            return x * cos + rotate_half(x) * sin
        rot, rest = x[..., :rd], x[..., rd:]
        return torch.cat((rot * cos + rotate_half(rot) * sin, rest), dim=-1)
