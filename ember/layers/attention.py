"""Paged attention over a flat slot-indexed KV cache, for mixed prefill/decode batches.

The model runner flattens a step's tokens into one batch of T rows and describes it with
`AttentionMetadata`. Each layer's cache is a tensor whose first (or second) dimension is
the slot: slot = block_id * block_size + offset. New tokens' K/V are written at
`slot_mapping`; attention then reads each sequence's context back through its slots.

Sequences with one new token (decodes) are attended in one batched, masked call; sequences
with several new tokens (prefill chunks, possibly after a prefix hit) get one call each.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class PrefillSpan:
    """A sequence computing several tokens: rows start..end of the batch."""

    start: int
    end: int
    kv_slots: torch.Tensor  # [L] cache slots of the whole context, new tokens included
    num_context: int  # tokens already in the cache before this chunk (L - (end - start))


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] slot of each new token
    decode_rows: torch.Tensor  # [Bd] batch rows of the single-token sequences
    decode_kv_slots: torch.Tensor  # [Bd, Lmax] context slots, padded with slot 0
    decode_kv_mask: torch.Tensor  # [Bd, 1, 1, Lmax] additive mask: 0 real, -inf padding
    prefills: list[PrefillSpan]

    @property
    def num_decodes(self) -> int:
        return int(self.decode_rows.numel())


def causal_mask(q_len: int, kv_len: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Additive mask letting query i (at position kv_len - q_len + i) see keys 0..its position."""
    offset = kv_len - q_len
    q_pos = torch.arange(q_len, device=device).unsqueeze(1) + offset
    k_pos = torch.arange(kv_len, device=device).unsqueeze(0)
    mask = torch.zeros(q_len, kv_len, dtype=dtype, device=device)
    return mask.masked_fill(k_pos > q_pos, float("-inf"))


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """q [T, Hq, D], k/v [T, Hkv, D], kv_cache [2, slots, Hkv, D] -> out [T, Hq, D]."""
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    k_cache[meta.slot_mapping] = k.to(k_cache.dtype)
    v_cache[meta.slot_mapping] = v.to(v_cache.dtype)
    out = torch.empty_like(q)
    gqa = q.shape[1] != k.shape[1]
    if meta.num_decodes:
        qd = q[meta.decode_rows].unsqueeze(2)  # [Bd, Hq, 1, D]
        kd = k_cache[meta.decode_kv_slots].transpose(1, 2)  # [Bd, Hkv, L, D]
        vd = v_cache[meta.decode_kv_slots].transpose(1, 2)
        mask = meta.decode_kv_mask.to(q.dtype)
        od = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=mask, scale=scale,
                                            enable_gqa=gqa)
        out[meta.decode_rows] = od.squeeze(2)
    for span in meta.prefills:
        qp = q[span.start:span.end].transpose(0, 1)  # [Hq, S, D]
        if span.num_context == 0:
            kp = k[span.start:span.end].transpose(0, 1)
            vp = v[span.start:span.end].transpose(0, 1)
            op = F.scaled_dot_product_attention(qp, kp, vp, is_causal=True, scale=scale,
                                                enable_gqa=gqa)
        else:
            kp = k_cache[span.kv_slots].transpose(0, 1).to(q.dtype)
            vp = v_cache[span.kv_slots].transpose(0, 1).to(q.dtype)
            mask = causal_mask(qp.shape[1], kp.shape[1], q.dtype, q.device)
            op = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=mask, scale=scale,
                                                enable_gqa=gqa)
        out[span.start:span.end] = op.transpose(0, 1)
    return out
