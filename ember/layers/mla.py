"""Multi-head latent attention (DeepSeek-V2/V3, Kimi K2) over a paged latent cache.

Per token and layer the cache holds only the compressed latent: the normalised KV latent
c [kv_lora_rank] and the shared rotary key k_pe [qk_rope_head_dim], one row of
kv_lora_rank + qk_rope_head_dim values per slot. `kv_b_proj` holds the up-projections
W_UK [H, nope, r] and W_UV [H, v, r].

- Decodes use weight absorption: q_nope @ W_UK gives a query in latent space, attention runs
  directly over the cached latents (one shared "key/value head" for all query heads), and
  W_UV maps the attended latent to each head's value. Reads stay at the latent's size.
- Prefill chunks up-project their whole context to per-head K and V and run causal SDPA;
  with many queries this costs fewer FLOPs than absorption.

Under tensor parallelism the heads are split (q_proj / q_b_proj / kv_b_proj column-parallel,
o_proj row-parallel); the latent projections are replicated, so every rank caches the same
latent.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ember.distributed.comm import GroupComm
from ember.layers.attention import AttentionMetadata, causal_mask, gather_slots, write_slots
from ember.layers.linear import ColumnParallelLinear, RowParallelLinear
from ember.layers.norms import RMSNorm
from ember.layers.rotary import RotaryEmbedding


def apply_rotary_interleaved(x: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [T, H, D] whose rotary pairs are interleaved (x0, x1), (x2, x3), ...

    The output is laid out de-interleaved (all first elements of the pairs, then all second),
    as transformers does; queries and keys are permuted alike, so dot products are unchanged.
    """
    half = cos_sin.shape[-1] // 2
    cos, sin = cos_sin[0, ..., :half], cos_sin[1, ..., :half]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class MLAttention(nn.Module):
    def __init__(self, hidden_size: int, num_heads: int, q_lora_rank: int | None,
                 kv_lora_rank: int, qk_nope_head_dim: int, qk_rope_head_dim: int,
                 v_head_dim: int, rotary: RotaryEmbedding, scale: float,
                 rope_interleave: bool = True, attention_bias: bool = False,
                 rms_norm_eps: float = 1e-6, tp: GroupComm | None = None) -> None:
        super().__init__()
        self.kv_lora_rank = kv_lora_rank
        self.qk_nope_head_dim = qk_nope_head_dim
        self.qk_rope_head_dim = qk_rope_head_dim
        self.v_head_dim = v_head_dim
        self.qk_head_dim = qk_nope_head_dim + qk_rope_head_dim
        self.rotary = rotary
        self.rope_interleave = rope_interleave
        self.scale = scale
        q_out = num_heads * self.qk_head_dim
        if tp is not None and num_heads % tp.size:
            raise ValueError(f"tensor_parallel_size: {tp.size} ranks cannot split "
                             f"{num_heads} attention heads evenly")
        if q_lora_rank is None:
            self.q_proj = ColumnParallelLinear(hidden_size, q_out, group=tp)
        else:
            self.q_a_proj = nn.Linear(hidden_size, q_lora_rank, bias=attention_bias)
            self.q_a_layernorm = RMSNorm(q_lora_rank, rms_norm_eps)
            self.q_b_proj = ColumnParallelLinear(q_lora_rank, q_out, group=tp)
        self.q_lora_rank = q_lora_rank
        self.kv_a_proj_with_mqa = nn.Linear(hidden_size, kv_lora_rank + qk_rope_head_dim,
                                            bias=attention_bias)
        self.kv_a_layernorm = RMSNorm(kv_lora_rank, rms_norm_eps)
        self.kv_b_proj = ColumnParallelLinear(kv_lora_rank,
                                              num_heads * (qk_nope_head_dim + v_head_dim),
                                              group=tp)
        self.o_proj = RowParallelLinear(num_heads * v_head_dim, hidden_size,
                                        bias=attention_bias, group=tp)
        self.num_heads = self.kv_b_proj.out_features // (qk_nope_head_dim + v_head_dim)

    def _rope(self, x: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
        if self.rope_interleave:
            return apply_rotary_interleaved(x, cos_sin)
        return RotaryEmbedding.apply(x, cos_sin)

    def _up_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """W_UK [H, nope, r] and W_UV [H, v, r], views of kv_b_proj."""
        w = self.kv_b_proj.weight.view(self.num_heads, self.qk_nope_head_dim + self.v_head_dim,
                                       self.kv_lora_rank)
        return w[:, :self.qk_nope_head_dim], w[:, self.qk_nope_head_dim:]

    def forward(self, x: torch.Tensor, cos_sin: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        """x [T, hidden]; kv_cache [slots, kv_lora_rank + qk_rope_head_dim] -> [T, hidden]."""
        t = x.shape[0]
        if self.q_lora_rank is None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(t, self.num_heads, self.qk_head_dim)
        q_nope, q_pe = q.split([self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
        q_pe = self._rope(q_pe, cos_sin)
        c, k_pe = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.qk_rope_head_dim],
                                                   dim=-1)
        k_pe = self._rope(k_pe.unsqueeze(1), cos_sin).squeeze(1)
        write_slots(kv_cache, meta.slot_mapping, torch.cat((self.kv_a_layernorm(c), k_pe), dim=-1))

        out = x.new_empty(t, self.num_heads, self.v_head_dim)
        if meta.num_decodes:
            rows = meta.decode_rows
            out[rows] = self._decode(q_nope[rows], q_pe[rows], kv_cache, meta)
        for span in meta.prefills:
            latent = gather_slots(kv_cache, span.kv_slots)  # [L, r + rope], new tokens included
            out[span.start:span.end] = self._prefill(q_nope[span.start:span.end],
                                                     q_pe[span.start:span.end], latent)
        return self.o_proj(out.flatten(1))

    def _decode(self, q_nope: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        """Absorbed attention for Bd single-token queries -> [Bd, H, v].

        All H query heads share one latent key/value head, so per sequence the scores are one
        [H, r + rope] x [r + rope, L] matmul. Attention runs in the cache's dtype (fp32 on CPU).
        """
        w_uk, w_uv = self._up_weights()
        q_latent = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)  # [Bd, H, r]
        qd = torch.cat((q_latent, q_pe), dim=-1).to(kv_cache.dtype)  # [Bd, H, r + rope]
        kv = gather_slots(kv_cache, meta.decode_kv_slots)  # [Bd, L, r + rope]
        scores = torch.bmm(qd, kv.transpose(1, 2)) * self.scale + meta.decode_kv_mask.view(
            kv.shape[0], 1, -1).to(kv.dtype)
        o_latent = torch.bmm(scores.softmax(-1), kv[..., :self.kv_lora_rank])  # [Bd, H, r]
        o_latent = o_latent.transpose(0, 1).to(w_uv.dtype)  # [H, Bd, r]
        return torch.bmm(o_latent, w_uv.transpose(1, 2)).transpose(0, 1)

    def _prefill(self, q_nope: torch.Tensor, q_pe: torch.Tensor,
                 latent: torch.Tensor) -> torch.Tensor:
        """S queries over their L-token context latent [L, r + rope] -> [S, H, v]; the
        up-projection runs in the model's dtype, attention in the cache's."""
        s, length = q_nope.shape[0], latent.shape[0]
        compute = latent.dtype
        c, k_pe = latent.split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        kv = self.kv_b_proj(c.to(q_nope.dtype)).view(length, self.num_heads, -1).to(compute)
        k_nope, v = kv.split([self.qk_nope_head_dim, self.v_head_dim], dim=-1)
        k = torch.cat((k_nope, k_pe.unsqueeze(1).expand(-1, self.num_heads, -1)), dim=-1)
        q = torch.cat((q_nope, q_pe), dim=-1)
        q, k, v = (t.transpose(0, 1).to(compute) for t in (q, k, v))
        if s == length:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale)
        else:
            mask = causal_mask(s, length, compute, q.device)
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale)
        return o.transpose(0, 1).to(q_nope.dtype)
