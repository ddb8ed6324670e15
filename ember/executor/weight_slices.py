"""Checkpoint tensors as lazy slices, so a rank reads only its shard from the files.

`weight_sources(checkpoint)` yields (hf_name, source) pairs. For plain safetensors folders a
source is a `SafetensorsSlice`: `narrow()` only narrows the index, and `load()` reads just those
bytes (safetensors' get_slice). GGUF files and quantized checkpoints are dequantized whole, one
tensor at a time, before their rows are narrowed. `ReadCounter` counts the bytes read, which is
how tests check that no rank reads the whole model.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from ember.executor.checkpoint import Checkpoint, safetensors_files
from ember.executor.quantization import QuantConfig


@dataclass
class ReadCounter:
    bytes: int = 0


class SafetensorsSlice:
    def __init__(self, handle: object, index: tuple[slice, ...], counter: ReadCounter) -> None:
        self._handle = handle  # safetensors PySafeSlice (it keeps the file mapped)
        self._index = index
        self._counter = counter

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(s.stop - s.start for s in self._index)

    def narrow(self, dim: int, start: int, length: int) -> SafetensorsSlice:
        dim = dim % len(self._index)
        old = self._index[dim]
        if start < 0 or length < 0 or start + length > old.stop - old.start:
            raise ValueError(f"narrow({dim}, {start}, {length}) is outside shape {self.shape}")
        index = list(self._index)
        index[dim] = slice(old.start + start, old.start + start + length)
        return SafetensorsSlice(self._handle, tuple(index), self._counter)

    def load(self) -> torch.Tensor:
        tensor = self._handle[self._index]
        self._counter.bytes += tensor.numel() * tensor.element_size()
        return tensor


def _lazy_safetensors(checkpoint: Checkpoint, counter: ReadCounter
                      ) -> Iterator[tuple[str, SafetensorsSlice]]:
    from safetensors import safe_open

    for file in safetensors_files(checkpoint.path):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                handle = f.get_slice(name)
                index = tuple(slice(0, n) for n in handle.get_shape())
                yield name, SafetensorsSlice(handle, index, counter)


def _counted(checkpoint: Checkpoint, counter: ReadCounter) -> Iterator[tuple[str, torch.Tensor]]:
    for name, tensor in checkpoint.tensors():
        counter.bytes += tensor.numel() * tensor.element_size()
        yield name, tensor


def weight_sources(checkpoint: Checkpoint, counter: ReadCounter | None = None
                   ) -> Iterator[tuple[str, SafetensorsSlice | torch.Tensor]]:
    counter = counter if counter is not None else ReadCounter()
    if checkpoint.is_gguf or QuantConfig.from_hf(checkpoint.hf_config) is not None:
        return _counted(checkpoint, counter)
    return _lazy_safetensors(checkpoint, counter)
