"""Paged attention over a flat slot-indexed KV cache, for mixed prefill/decode batches.

The model runner flattens a step's tokens into one batch of T rows and describes it with
`AttentionMetadata`. Each layer's cache is a tensor with a slot dimension (here
[2, Hkv, slots, D]; MLA keeps [slots, latent]), where slot = block_id * block_size + offset.
New tokens' K/V are written at `slot_mapping`.

Sequences with one new token (decodes) are described by their block tables and lengths. On CPU
the compiled kernel (cpu_attention.py) reads their context in place; elsewhere, or without a
compiler, the context is gathered with index_select and attended in one batched, masked call.
Sequences with several new tokens (prefill chunks, possibly after a prefix hit) get one SDPA
call each.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ember.layers.cpu_attention import cpu_kernel_available, paged_decode_attention


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
    decode_block_tables: torch.Tensor  # [Bd, max_blocks] block ids, padded with block 0
    decode_seq_lens: torch.Tensor  # [Bd] context length, the new token included
    decode_max_len: int  # max of decode_seq_lens (0 without decodes)
    block_size: int
    prefills: list[PrefillSpan]

    @classmethod
    def empty(cls, block_size: int, device: torch.device) -> AttentionMetadata:
        none = torch.zeros(0, dtype=torch.long, device=device)
        return cls(slot_mapping=none, decode_rows=none,
                   decode_block_tables=torch.zeros(0, 1, dtype=torch.long, device=device),
                   decode_seq_lens=none, decode_max_len=0, block_size=block_size, prefills=[])

    @property
    def num_decodes(self) -> int:
        return int(self.decode_rows.numel())

    @functools.cached_property
    def decode_kv_slots(self) -> torch.Tensor:
        """[Bd, max_len] context slots of each decode, padded with slot 0 (for gathers)."""
        pos = torch.arange(self.decode_max_len, device=self.decode_seq_lens.device)
        slots = (self.decode_block_tables[:, pos // self.block_size] * self.block_size
                 + pos % self.block_size)
        return slots.masked_fill(~self._decode_valid, 0)

    @functools.cached_property
    def decode_kv_mask(self) -> torch.Tensor:
        """[Bd, 1, 1, max_len] fp32 additive mask: 0 for context, -inf for padding."""
        mask = torch.zeros(self._decode_valid.shape, device=self.decode_seq_lens.device)
        return mask.masked_fill(~self._decode_valid, float("-inf"))[:, None, None, :]

    @functools.cached_property
    def _decode_valid(self) -> torch.Tensor:
        pos = torch.arange(self.decode_max_len, device=self.decode_seq_lens.device)
        return pos.unsqueeze(0) < self.decode_seq_lens.unsqueeze(1)


def causal_mask(q_len: int, kv_len: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Additive mask letting query i (at position kv_len - q_len + i) see keys 0..its position."""
    offset = kv_len - q_len
    q_pos = torch.arange(q_len, device=device).unsqueeze(1) + offset
    k_pos = torch.arange(kv_len, device=device).unsqueeze(0)
    mask = torch.zeros(q_len, kv_len, dtype=dtype, device=device)
    return mask.masked_fill(k_pos > q_pos, float("-inf"))


def write_slots(cache: torch.Tensor, slots: torch.Tensor, values: torch.Tensor,
                dim: int = 0) -> None:
    """cache[slots] = values along dim, via index_copy_ (much faster than index_put on CPU)."""
    cache.index_copy_(dim, slots, values.to(cache.dtype))


def gather_slots(cache: torch.Tensor, slots: torch.Tensor, dim: int = 0) -> torch.Tensor:
    """cache[slots] along dim for a slot tensor of any shape, via index_select (~10x faster
    than advanced indexing on CPU); the slot dimensions replace dim."""
    flat = cache.index_select(dim, slots.reshape(-1))
    return flat.view(*cache.shape[:dim], *slots.shape, *cache.shape[dim + 1:])


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """One query per sequence: q [B, Hq, D], k/v [Hkv, B, L, D], mask [B, 1, 1, L] -> [B, Hq, D].

    Query heads that share a KV head form one matmul row block (batched over KV heads and
    sequences), which beats SDPA's flash kernel on CPU for a single query.
    """
    b, hq, d = q.shape
    hkv = k.shape[0]
    qh = q.view(b, hkv, hq // hkv, d).transpose(0, 1)  # [Hkv, B, G, D]
    scores = torch.matmul(qh, k.transpose(-1, -2)) * scale + mask.view(1, b, 1, -1)
    out = torch.matmul(scores.softmax(-1), v)  # [Hkv, B, G, Dv]
    return out.transpose(0, 1).reshape(b, hq, v.shape[-1])


def attention_dtype(dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """Attention (and the KV cache) dtype. On CPU it is fp32: torch's bf16 batched small
    matmuls there are ~20x slower, and keeping the cache in fp32 saves a conversion per step."""
    return torch.float32 if device.type == "cpu" else dtype


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """q [T, Hq, D], k/v [T, Hkv, D], kv_cache [2, Hkv, slots, D] -> out [T, Hq, D]."""
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    write_slots(k_cache, meta.slot_mapping, k.transpose(0, 1), dim=1)
    write_slots(v_cache, meta.slot_mapping, v.transpose(0, 1), dim=1)
    compute = attention_dtype(q.dtype, q.device)
    if meta.num_decodes and not meta.prefills:  # a pure decode step: every row, in order
        return _decode(q, kv_cache, meta, scale).to(q.dtype)
    out = torch.empty(q.shape, dtype=compute, device=q.device)
    if meta.num_decodes:
        out[meta.decode_rows] = _decode(q[meta.decode_rows], kv_cache, meta, scale)
    gqa = q.shape[1] != k.shape[1]
    for span in meta.prefills:
        # a leading batch dim of 1: torch picks its flash kernel on CPU only for 4-D inputs
        qp = q[span.start:span.end].transpose(0, 1).to(compute)[None]  # [1, Hq, S, D]
        if span.num_context == 0:
            kp = k[span.start:span.end].transpose(0, 1).to(compute)[None]
            vp = v[span.start:span.end].transpose(0, 1).to(compute)[None]
            op = F.scaled_dot_product_attention(qp, kp, vp, is_causal=True, scale=scale,
                                                enable_gqa=gqa)
        else:
            kp = gather_slots(k_cache, span.kv_slots, dim=1).to(compute)[None]  # [1, Hkv, L, D]
            vp = gather_slots(v_cache, span.kv_slots, dim=1).to(compute)[None]
            mask = causal_mask(qp.shape[2], kp.shape[2], compute, q.device)
            op = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=mask, scale=scale,
                                                enable_gqa=gqa)
        out[span.start:span.end] = op[0].transpose(0, 1)
    return out.to(q.dtype)


def _decode(q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
            scale: float) -> torch.Tensor:
    """Attention of the decode rows q [Bd, Hq, D] over their paged context, in fp32 on CPU."""
    if kv_cache.device.type == "cpu" and kv_cache.shape[-1] % 16 == 0 and cpu_kernel_available():
        return paged_decode_attention(q, kv_cache, meta.decode_block_tables,
                                      meta.decode_seq_lens, meta.block_size, scale)
    compute = attention_dtype(q.dtype, q.device)
    kd = gather_slots(kv_cache[0], meta.decode_kv_slots, dim=1).to(compute)  # [Hkv, Bd, L, D]
    vd = gather_slots(kv_cache[1], meta.decode_kv_slots, dim=1).to(compute)
    return decode_attention(q.to(compute), kd, vd, meta.decode_kv_mask.to(compute), scale)
