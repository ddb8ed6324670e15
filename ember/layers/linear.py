"""Tensor-parallel building blocks: column- and row-parallel linear layers, a fused q/k/v
projection with head sharding, and the vocabulary-parallel embedding and LM head.

Each layer keeps only its rank's shard and loads it with `load_weight(leaf, source, shard)`,
narrowing the full checkpoint tensor to that shard before reading it (a lazy safetensors slice
reads only those bytes). On a group of one every layer is its plain torch counterpart: same
parameter names and shapes, same forward, no collectives.

On CPU, `pack_for_cpu` gives each layer a copy of its fp32 weight reordered for oneDNN's GEMM,
which runs the small-batch shapes of decoding 1.2-2.5x faster than the default BLAS call; the
original weight stays for loading, embedding lookups and state dicts.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from ember.distributed.comm import GroupComm
from ember.distributed.layout import split_range


class WeightSource(Protocol):
    """A checkpoint tensor, possibly not read yet: a torch.Tensor, or a lazy file slice that
    also has load() -> torch.Tensor (executor/weight_slices.py)."""

    @property
    def shape(self) -> Sequence[int]: ...

    def narrow(self, dim: int, start: int, length: int) -> WeightSource: ...


def materialize(source: WeightSource) -> torch.Tensor:
    return source if isinstance(source, torch.Tensor) else source.load()


def copy_weight(param: torch.Tensor, source: WeightSource, name: str) -> None:
    """param[...] = source, after checking shapes (reads a lazy source only here)."""
    if tuple(param.shape) != tuple(source.shape):
        raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(source.shape)}, "
                         f"expected {tuple(param.shape)}")
    with torch.no_grad():
        param.copy_(materialize(source))


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
           packed: torch.Tensor | None) -> torch.Tensor:
    """x W^T + b, through the pre-packed CPU weight when there is one."""
    if packed is not None:
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    return F.linear(x, weight, bias)


class Linear(nn.Linear):
    """nn.Linear whose forward can use a weight pre-packed by `pack_for_cpu`."""

    packed_weight: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.packed_weight)


def _split(total: int, group: GroupComm, what: str) -> int:
    if total % group.size:
        raise ValueError(f"tensor_parallel_size: {group.size} ranks cannot split {what} "
                         f"({total}) evenly")
    return total // group.size


class ColumnParallelLinear(Linear):
    """y = x W^T + b with W's output rows split over the group; the output stays split."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 group: GroupComm | None = None) -> None:
        group = group or GroupComm.single()
        super().__init__(in_features, _split(out_features, group, "output features"), bias)
        self.group = group

    def load_weight(self, leaf: str, source: WeightSource, shard: int | str | None = None
                    ) -> None:
        start, size = split_range(source.shape[0], self.group.size, self.group.rank)
        copy_weight(self.get_parameter(leaf), source.narrow(0, start, size), leaf)


class MergedColumnParallelLinear(Linear):
    """Several column-parallel outputs stacked in one matrix (gate and up): every rank keeps
    its slice of each, in order, so a local chunk() still separates them."""

    def __init__(self, in_features: int, output_sizes: Sequence[int], bias: bool = False,
                 group: GroupComm | None = None) -> None:
        group = group or GroupComm.single()
        local = [_split(n, group, "output features") for n in output_sizes]
        super().__init__(in_features, sum(local), bias)
        self.group = group
        self.output_sizes = list(output_sizes)
        self.offsets = [sum(local[:i]) for i in range(len(local))]

    def load_weight(self, leaf: str, source: WeightSource, shard: int | str | None = None
                    ) -> None:
        if not isinstance(shard, int) or not 0 <= shard < len(self.output_sizes):
            raise ValueError(f"shard: must be an output index < {len(self.output_sizes)}")
        start, size = split_range(self.output_sizes[shard], self.group.size, self.group.rank)
        target = self.get_parameter(leaf).narrow(0, self.offsets[shard], size)
        copy_weight(target, source.narrow(0, start, size), leaf)


class QKVParallelLinear(Linear):
    """q, k and v projections in one matrix, split by attention heads. With fewer KV heads
    than ranks each KV head is replicated on tensor_parallel_size / num_kv_heads ranks."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int,
                 bias: bool = False, group: GroupComm | None = None) -> None:
        group = group or GroupComm.single()
        self.num_heads = _split(num_heads, group, "attention heads")
        if num_kv_heads >= group.size:
            self.num_kv_heads = _split(num_kv_heads, group, "key/value heads")
            self.kv_head_start = group.rank * self.num_kv_heads
        elif group.size % num_kv_heads:
            raise ValueError(f"tensor_parallel_size: {group.size} ranks cannot share "
                             f"{num_kv_heads} key/value heads evenly")
        else:
            self.num_kv_heads = 1
            self.kv_head_start = group.rank // (group.size // num_kv_heads)
        self.head_dim = head_dim
        self.q_size = self.num_heads * head_dim
        self.kv_size = self.num_kv_heads * head_dim
        super().__init__(hidden_size, self.q_size + 2 * self.kv_size, bias)
        self.group = group

    def load_weight(self, leaf: str, source: WeightSource, shard: int | str | None = None
                    ) -> None:
        """shard: "q", "k" or "v"."""
        d = self.head_dim
        if shard == "q":
            src = (self.group.rank * self.q_size, self.q_size)
            dst = (0, self.q_size)
        elif shard in ("k", "v"):
            src = (self.kv_head_start * d, self.kv_size)
            dst = (self.q_size + (shard == "v") * self.kv_size, self.kv_size)
        else:
            raise ValueError(f"shard: must be 'q', 'k' or 'v', got {shard!r}")
        copy_weight(self.get_parameter(leaf).narrow(0, *dst), source.narrow(0, *src),
                    f"{shard}_proj.{leaf}")


class RowParallelLinear(Linear):
    """y = x W^T + b with W's input columns split over the group: each rank multiplies its
    slice of x (a column-parallel output) and the partial sums are all-reduced."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 group: GroupComm | None = None, reduce_output: bool = True) -> None:
        group = group or GroupComm.single()
        super().__init__(_split(in_features, group, "input features"), out_features, bias)
        self.group = group
        self.reduce_output = reduce_output  # False: the caller reduces (fused with more sums)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.group.size == 1:
            return linear(x, self.weight, self.bias, self.packed_weight)
        y = linear(x, self.weight, None, self.packed_weight)
        if self.reduce_output:
            self.group.all_reduce(y)
        if self.bias is not None and (self.reduce_output or self.group.rank == 0):
            y = y + self.bias
        return y

    def load_weight(self, leaf: str, source: WeightSource, shard: int | str | None = None
                    ) -> None:
        if leaf == "bias":
            copy_weight(self.bias, source, leaf)
            return
        start, size = split_range(source.shape[1], self.group.size, self.group.rank)
        copy_weight(self.weight, source.narrow(1, start, size), leaf)


class VocabParallelEmbedding(nn.Embedding):
    """Embedding rows split over the group (the vocabulary padded to a multiple of its size);
    a rank embeds the ids in its range, zeros the rest, and the group sums."""

    packed_weight: torch.Tensor | None = None  # for logits(), see pack_for_cpu

    def __init__(self, vocab_size: int, hidden_size: int, group: GroupComm | None = None
                 ) -> None:
        group = group or GroupComm.single()
        per_rank = -(-vocab_size // group.size)
        super().__init__(per_rank, hidden_size)
        self.group = group
        self.vocab_size = vocab_size
        self.vocab_start = group.rank * per_rank
        self.num_local = max(0, min(per_rank, vocab_size - self.vocab_start))  # unpadded rows

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.group.size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.num_local)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out.masked_fill_(outside.unsqueeze(-1), 0.0)
        return self.group.all_reduce(out)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """fp32 logits over the whole vocabulary on the group's first rank (None elsewhere):
        each rank scores its rows, the first rank gathers."""
        local = linear(hidden, self.weight, None, self.packed_weight).float()
        if self.group.size == 1:
            return local
        full = self.group.gather(local, dim=-1)
        return None if full is None else full[..., :self.vocab_size]

    def load_weight(self, leaf: str, source: WeightSource, shard: int | str | None = None
                    ) -> None:
        if self.group.size == 1:
            copy_weight(self.weight, source, leaf)
            return
        if source.shape[0] != self.vocab_size:
            raise ValueError(f"checkpoint tensor {leaf!r} has {source.shape[0]} rows, "
                             f"expected {self.vocab_size}")
        with torch.no_grad():
            self.weight[self.num_local:].zero_()
        copy_weight(self.weight[:self.num_local], source.narrow(0, self.vocab_start,
                                                                self.num_local), leaf)


class ParallelLMHead(VocabParallelEmbedding):
    """The output projection, split by vocabulary rows like the embedding (`logits()`)."""


def pack_for_cpu(model: nn.Module) -> int:
    """Give every fp32 CPU linear layer (and LM head) a oneDNN-packed copy of its weight;
    returns how many were packed. Call after the weights are loaded: later loads bypass it."""
    if not torch.backends.mkldnn.is_available():
        return 0
    packed = 0
    for module in model.modules():
        if not isinstance(module, (Linear, VocabParallelEmbedding)):
            continue
        weight = module.weight.detach()
        if weight.device.type != "cpu" or weight.dtype != torch.float32:
            continue
        # the batch-size hint picks the packed layout; 64 suits decode batches and prefill alike
        module.packed_weight = torch.ops.mkldnn._reorder_linear_weight(weight, 64)
        packed += 1
    return packed


def load_into(module: nn.Module, leaf: str, source: WeightSource, name: str,
              shard: int | str | None = None) -> None:
    """Load a checkpoint tensor into `module.<leaf>`: through the layer's shard loader for
    parallel layers, as a whole tensor for replicated ones (norms, routers)."""
    if isinstance(module, PARALLEL_LAYERS):
        module.load_weight(leaf, source, shard)
    elif shard is not None:
        raise ValueError(f"checkpoint tensor {name!r}: {type(module).__name__} is not stacked")
    else:
        copy_weight(module.get_parameter(leaf), source, name)


PARALLEL_LAYERS = (ColumnParallelLinear, MergedColumnParallelLinear, QKVParallelLinear,
                   RowParallelLinear, VocabParallelEmbedding)
