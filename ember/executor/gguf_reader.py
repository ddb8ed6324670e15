"""A lean GGUF (v2/v3) parser: metadata and tensor locations, read with struct and numpy.

The `gguf` package's reader builds an object per vocabulary string and takes seconds on a
49k-token vocabulary; this one reads scalar arrays with numpy in one call and keeps tensor
data memory-mapped. Dequantization is still the `gguf` package's.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

MAGIC = b"GGUF"
# GGUF value type id -> numpy dtype for scalars
_SCALARS = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32,
            6: np.float32, 7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}
_STRING, _ARRAY = 8, 9


@dataclass
class GGUFTensorInfo:
    name: str
    shape: tuple[int, ...]  # as PyTorch sees it (GGUF stores dimensions reversed)
    ggml_type: int
    data: np.ndarray  # raw bytes, memory-mapped


class GGUFFile:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.metadata: dict[str, Any] = {}
        self.tensors: list[GGUFTensorInfo] = []
        with open(path, "rb") as f:
            if f.read(4) != MAGIC:
                raise ValueError(f"model: {path} is not a GGUF file")
            version, n_tensors, n_kv = struct.unpack("<IQQ", f.read(20))
            if version not in (2, 3):
                raise ValueError(f"model: GGUF version {version} is not supported")
            for _ in range(n_kv):
                key = _read_str(f)
                (vtype,) = struct.unpack("<I", f.read(4))
                self.metadata[key] = _read_value(f, vtype)
            infos = []
            for _ in range(n_tensors):
                name = _read_str(f)
                (n_dims,) = struct.unpack("<I", f.read(4))
                dims = struct.unpack(f"<{n_dims}Q", f.read(8 * n_dims))
                ggml_type, offset = struct.unpack("<IQ", f.read(12))
                infos.append((name, dims, ggml_type, offset))
            alignment = int(self.metadata.get("general.alignment", 32))
            data_start = -(-f.tell() // alignment) * alignment
        raw = np.memmap(path, dtype=np.uint8, mode="r")
        ends = sorted(offset for *_, offset in infos)[1:] + [len(raw) - data_start]
        end_of = dict(zip(sorted(offset for *_, offset in infos), ends, strict=True))
        for name, dims, ggml_type, offset in infos:
            data = raw[data_start + offset:data_start + end_of[offset]]
            self.tensors.append(GGUFTensorInfo(name, tuple(int(d) for d in reversed(dims)),
                                               ggml_type, data))

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)


def _read_str(f: BinaryIO) -> str:
    (n,) = struct.unpack("<Q", f.read(8))
    return f.read(n).decode("utf-8", errors="replace")


def _read_value(f: BinaryIO, vtype: int) -> Any:
    if vtype == _STRING:
        return _read_str(f)
    if vtype == _ARRAY:
        elem_type, count = struct.unpack("<IQ", f.read(12))
        if elem_type in _SCALARS:
            dtype = np.dtype(_SCALARS[elem_type])
            return np.frombuffer(f.read(dtype.itemsize * count), dtype=dtype).tolist()
        return [_read_value(f, elem_type) for _ in range(count)]
    if vtype not in _SCALARS:
        raise ValueError(f"GGUF metadata value type {vtype} is not understood")
    dtype = np.dtype(_SCALARS[vtype])
    value = np.frombuffer(f.read(dtype.itemsize), dtype=dtype)[0]
    return value.item()
