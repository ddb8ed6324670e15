"""Parallel layers on two real gloo ranks against their one-process counterparts: each rank
loads only its shard from the full tensor, and the combined result equals the dense layer."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import torch

from ember.distributed.comm import GroupComm
from ember.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)

from ..conftest import REPO_ROOT, free_port

RANK_PROGRAM = textwrap.dedent('''
    import os, torch
    import torch.nn.functional as F
    from ember.distributed.layout import RankLayout
    from ember.distributed.parallel_state import init_distributed
    from ember.layers.linear import (ColumnParallelLinear, MergedColumnParallelLinear,
        QKVParallelLinear, RowParallelLinear, VocabParallelEmbedding)

    rank = int(os.environ["RANK"])  # torchrun's environment: MASTER_ADDR/PORT, RANK, WORLD_SIZE
    ctx = init_distributed(RankLayout(rank, tensor_parallel_size=2), "env://",
                           torch.device("cpu"))
    tp = ctx.tp
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 8, generator=g)
    w, b = torch.randn(6, 8, generator=g), torch.randn(6, generator=g)

    col = ColumnParallelLinear(8, 6, bias=True, group=tp)
    col.load_weight("weight", w); col.load_weight("bias", b)
    full = tp.all_gather(col(x), dim=-1)
    torch.testing.assert_close(full, F.linear(x, w, b))

    row = RowParallelLinear(8, 6, bias=True, group=tp)
    row.load_weight("weight", w); row.load_weight("bias", b)
    torch.testing.assert_close(row(x[:, 4 * rank:4 * rank + 4]), F.linear(x, w, b))

    gate, up = torch.randn(4, 8, generator=g), torch.randn(4, 8, generator=g)
    merged = MergedColumnParallelLinear(8, [4, 4], group=tp)
    merged.load_weight("weight", gate, 0); merged.load_weight("weight", up, 1)
    g_local, u_local = merged(x).chunk(2, dim=-1)
    torch.testing.assert_close(g_local, F.linear(x, gate)[:, 2 * rank:2 * rank + 2])
    torch.testing.assert_close(u_local, F.linear(x, up)[:, 2 * rank:2 * rank + 2])

    for kv_heads in (2, 1):  # split KV heads, then one KV head replicated on both ranks
        q, k, v = (torch.randn(n * 3, 8, generator=g) for n in (4, kv_heads, kv_heads))
        qkv = QKVParallelLinear(8, 3, 4, kv_heads, group=tp)
        for shard, t in zip("qkv", (q, k, v)):
            qkv.load_weight("weight", t, shard)
        lq, lk, lv = qkv(x).split([qkv.q_size, qkv.kv_size, qkv.kv_size], dim=-1)
        kv_rows = slice(qkv.kv_head_start * 3, qkv.kv_head_start * 3 + qkv.kv_size)
        torch.testing.assert_close(lq, F.linear(x, q)[:, 6 * rank:6 * rank + 6])
        torch.testing.assert_close(lk, F.linear(x, k)[:, kv_rows])
        torch.testing.assert_close(lv, F.linear(x, v)[:, kv_rows])

    table = torch.randn(11, 8, generator=g)  # 11 rows: the second rank's shard is padded
    emb = VocabParallelEmbedding(11, 8, group=tp)
    emb.load_weight("weight", table)
    ids = torch.tensor([0, 5, 6, 10, 3])
    torch.testing.assert_close(emb(ids), F.embedding(ids, table))
    logits = emb.logits(x)
    if rank == 0:
        torch.testing.assert_close(logits, F.linear(x, table))
    else:
        assert logits is None

    rows, counts = ctx.dp.all_gather_rows(x[:rank + 2])  # a group of one: unchanged
    assert counts == [rank + 2] and rows.shape[0] == rank + 2
    rows, counts = tp.all_gather_rows(x[:rank + 2])
    assert counts == [2, 3]
    torch.testing.assert_close(rows, torch.cat([x[:2], x[:3]]))
    mine, theirs = torch.full((3,), float(rank)), torch.empty(3)
    tp.exchange([(mine, 1 - rank)], [(theirs, 1 - rank)])
    assert theirs.tolist() == [float(1 - rank)] * 3
    assert ctx.stats.calls > 0 and ctx.stats.seconds > 0
    print("ok", rank)
''')


def test_parallel_layers_on_two_gloo_ranks_match_dense_layers(tmp_path: Path) -> None:
    program = tmp_path / "rank.py"
    program.write_text(RANK_PROGRAM)
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
           "WORLD_SIZE": "2", "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, str(program)], cwd=REPO_ROOT,
                              env={**env, "RANK": str(rank)}, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for rank in range(2)]
    outputs = []
    try:
        for p in procs:
            outputs.append(p.communicate(timeout=120)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for rank, (p, out) in enumerate(zip(procs, outputs, strict=True)):
        assert p.returncode == 0 and f"ok {rank}" in out, out[-3000:]


def test_groups_of_one_are_the_plain_layers() -> None:
    single = GroupComm.single()
    qkv = QKVParallelLinear(8, 2, 4, 2, bias=True, group=single)
    assert (qkv.in_features, qkv.out_features) == (8, 16)
    assert isinstance(qkv, torch.nn.Linear)
    row = RowParallelLinear(8, 6, bias=True)
    x = torch.randn(3, 8)
    torch.testing.assert_close(row(x), torch.nn.functional.linear(x, row.weight, row.bias))
    emb = VocabParallelEmbedding(11, 4)
    assert emb.weight.shape == (11, 4)
    merged = MergedColumnParallelLinear(8, [4, 4])
    assert merged.weight.shape == (8, 8)
