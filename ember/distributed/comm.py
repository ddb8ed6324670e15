"""Collectives on one process group, timed so that step time can be split into compute and
communication. A group of one never calls torch.distributed: its collectives are identities."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class CommStats:
    """Seconds spent in collectives and their count, summed over every group of a rank."""

    seconds: float = 0.0
    calls: int = 0
    bytes: int = 0

    def reset(self) -> None:
        self.seconds, self.calls, self.bytes = 0.0, 0, 0


class GroupComm:
    def __init__(self, ranks: list[int], rank: int, group: dist.ProcessGroup | None,
                 stats: CommStats | None = None,
                 synchronize: Callable[[], None] | None = None) -> None:
        self.ranks = ranks  # global ranks, in group order
        self.rank = ranks.index(rank)  # this process's index in the group
        self.group = group
        self.stats = stats if stats is not None else CommStats()
        self._synchronize = synchronize  # set on GPUs, where collectives are asynchronous

    @classmethod
    def single(cls) -> GroupComm:
        return cls([0], 0, None)

    @property
    def size(self) -> int:
        return len(self.ranks)

    @contextmanager
    def _timed(self, tensor: torch.Tensor) -> Iterator[None]:
        if self._synchronize is not None:
            self._synchronize()
        start = time.perf_counter()
        yield
        if self._synchronize is not None:
            self._synchronize()
        self.stats.seconds += time.perf_counter() - start
        self.stats.calls += 1
        self.stats.bytes += tensor.numel() * tensor.element_size()

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over the group, in place; returns x."""
        if self.size > 1:
            with self._timed(x):
                dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """Concatenate every rank's equally shaped x along dim, in group order."""
        if self.size == 1:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)]
        with self._timed(x):
            dist.all_gather(parts, x, group=self.group)
        return torch.cat(parts, dim=dim)

    def all_gather_rows(self, x: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
        """Concatenate every rank's rows (counts may differ); returns (rows, count per rank)."""
        if self.size == 1:
            return x, [x.shape[0]]
        counts = self.all_gather(torch.tensor([x.shape[0]], device=x.device)).tolist()
        longest = max(counts)
        padded = x.new_zeros(longest, *x.shape[1:])
        padded[:x.shape[0]] = x
        gathered = self.all_gather(padded.unsqueeze(0))
        return torch.cat([gathered[i, :n] for i, n in enumerate(counts)]), counts

    def gather(self, x: torch.Tensor, dim: int = 0) -> torch.Tensor | None:
        """Concatenation of every rank's x along dim on the group's first rank; None elsewhere."""
        if self.size == 1:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)] if self.rank == 0 else None
        with self._timed(x):
            dist.gather(x, parts, dst=self.ranks[0], group=self.group)
        return torch.cat(parts, dim=dim) if parts is not None else None

    def broadcast(self, x: torch.Tensor, src: int) -> torch.Tensor:
        """x from group index src to every rank, in place."""
        if self.size > 1:
            with self._timed(x):
                dist.broadcast(x, src=self.ranks[src], group=self.group)
        return x

    def exchange(self, sends: list[tuple[torch.Tensor, int]],
                 recvs: list[tuple[torch.Tensor, int]]) -> None:
        """Point to point: send each tensor to its group rank and receive each buffer from its
        group rank; both sides must list a pair's transfers in the same order."""
        ops = [dist.P2POp(dist.isend, t.contiguous(), self.ranks[r], self.group)
               for t, r in sends]
        ops += [dist.P2POp(dist.irecv, t, self.ranks[r], self.group) for t, r in recvs]
        if not ops:
            return
        with self._timed(torch.empty(0)):
            for request in dist.batch_isend_irecv(ops):
                request.wait()
