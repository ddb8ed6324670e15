"""Paged decode attention: the compiled CPU kernel against SDPA over the gathered context."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ember.layers.attention import AttentionMetadata, paged_attention
from ember.layers.cpu_attention import cpu_kernel_available, paged_decode_attention


def reference(q: torch.Tensor, cache: torch.Tensor, tables: torch.Tensor, lens: list[int],
              block_size: int, scale: float) -> torch.Tensor:
    """Each sequence's context gathered slot by slot, then plain SDPA (fp32)."""
    outs = []
    hq, hkv = q.shape[1], cache.shape[1]
    for b, n in enumerate(lens):
        pos = torch.arange(n)
        slots = tables[b, pos // block_size] * block_size + pos % block_size
        k = cache[0][:, slots].float().repeat_interleave(hq // hkv, dim=0)  # [Hq, L, D]
        v = cache[1][:, slots].float().repeat_interleave(hq // hkv, dim=0)
        outs.append(F.scaled_dot_product_attention(q[b].float().unsqueeze(1), k, v,
                                                   scale=scale).squeeze(1))
    return torch.stack(outs)


def random_layout(lens: list[int], block_size: int, seed: int) -> tuple[torch.Tensor, int]:
    """Block tables over a shuffled pool, padded with block 0, and the pool's block count."""
    gen = torch.Generator().manual_seed(seed)
    needed = [-(-n // block_size) for n in lens]
    num_blocks = sum(needed) + 3
    perm = torch.randperm(num_blocks, generator=gen)
    tables = torch.zeros(len(lens), max(needed), dtype=torch.long)
    used = 0
    for i, k in enumerate(needed):
        tables[i, :k] = perm[used:used + k]
        used += k
    return tables, num_blocks


def test_kernel_builds_here() -> None:
    assert cpu_kernel_available()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim", "block_size"),
                         [(9, 3, 64, 16), (4, 4, 32, 1), (8, 1, 128, 4)])
def test_kernel_matches_reference(dtype: torch.dtype, heads: int, kv_heads: int,
                                  head_dim: int, block_size: int) -> None:
    lens = [1, 5, 16, 17, 200, 63]
    tables, num_blocks = random_layout(lens, block_size, seed=heads)
    gen = torch.Generator().manual_seed(1)
    cache = torch.randn(2, kv_heads, num_blocks * block_size, head_dim, generator=gen).to(dtype)
    q = torch.randn(len(lens), heads, head_dim, generator=gen)
    scale = head_dim ** -0.5
    got = paged_decode_attention(q, cache, tables, torch.tensor(lens), block_size, scale)
    torch.testing.assert_close(got, reference(q, cache, tables, lens, block_size, scale),
                               atol=2e-6, rtol=1e-5)


def test_kernel_rejects_malformed_inputs() -> None:
    cache = torch.zeros(2, 2, 32, 16)
    q = torch.zeros(2, 3, 16)  # 3 query heads over 2 KV heads
    with pytest.raises(RuntimeError, match="multiple of KV heads"):
        paged_decode_attention(q, cache, torch.zeros(2, 2, dtype=torch.long),
                               torch.ones(2, dtype=torch.long), 16, 1.0)


def decode_step(lens: list[int], block_size: int) -> tuple[torch.Tensor, ...]:
    tables, num_blocks = random_layout(lens, block_size, seed=7)
    gen = torch.Generator().manual_seed(3)
    cache = torch.randn(2, 2, num_blocks * block_size, 32, generator=gen)
    q, k, v = (torch.randn(len(lens), h, 32, generator=gen) for h in (4, 2, 2))
    last = torch.tensor(lens) - 1
    slot_mapping = tables[torch.arange(len(lens)), last // block_size] * block_size + (
        last % block_size)
    meta = AttentionMetadata(slot_mapping=slot_mapping, decode_rows=torch.arange(len(lens)),
                             decode_block_tables=tables, decode_seq_lens=torch.tensor(lens),
                             decode_max_len=max(lens), block_size=block_size, prefills=[])
    return q, k, v, cache, meta


def test_torch_fallback_matches_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """EMBER_CPU_KERNELS=0 path (gather + masked matmul) gives the kernel's answer, and both
    write the new token's K/V before attending to it."""
    lens = [3, 40, 17]
    q, k, v, cache, meta = decode_step(lens, block_size=8)
    with_kernel = paged_attention(q, k, v, cache.clone(), meta, 0.2)
    monkeypatch.setattr("ember.layers.attention.cpu_kernel_available", lambda: False)
    q, k, v, cache, meta = decode_step(lens, block_size=8)
    fallback = paged_attention(q, k, v, cache, meta, 0.2)
    torch.testing.assert_close(with_kernel, fallback, atol=2e-6, rtol=1e-5)
    # the new token is at the last slot: a sequence of length 1 would attend only to it
    one_q, one_k, one_v, one_cache, one_meta = decode_step([1], block_size=8)
    out = paged_attention(one_q, one_k, one_v, one_cache, one_meta, 0.2)
    torch.testing.assert_close(out, one_v.repeat_interleave(2, dim=1))
