"""Lazy checkpoint slices: a rank reads only the rows or columns it narrows to."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from ember.executor.checkpoint import open_checkpoint
from ember.executor.weight_slices import ReadCounter, SafetensorsSlice, weight_sources
from ember.layers.linear import copy_weight, materialize


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    save_file({"w": torch.arange(24, dtype=torch.float32).view(4, 6),
               "s": torch.tensor(2.0)}, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    return tmp_path


def test_narrowed_slices_read_only_their_bytes(folder: Path) -> None:
    counter = ReadCounter()
    sources = dict(weight_sources(open_checkpoint(str(folder)), counter))
    # the iterator is consumed, but each slice keeps its file open until collected
    w = sources["w"]
    assert isinstance(w, SafetensorsSlice) and w.shape == (4, 6)
    part = w.narrow(0, 1, 2).narrow(1, 3, 3)
    assert part.shape == (2, 3) and counter.bytes == 0
    full = torch.arange(24, dtype=torch.float32).view(4, 6)
    assert torch.equal(materialize(part), full[1:3, 3:6])
    assert counter.bytes == 6 * 4
    assert materialize(sources["s"]).item() == 2.0
    with pytest.raises(ValueError, match="outside shape"):
        w.narrow(1, 4, 3)


def test_copy_weight_checks_the_shape_before_reading(folder: Path) -> None:
    counter = ReadCounter()
    w = dict(weight_sources(open_checkpoint(str(folder)), counter))["w"]
    target = torch.empty(3, 6)
    with pytest.raises(ValueError, match=r"'w' has shape \(4, 6\), expected \(3, 6\)"):
        copy_weight(target, w, "w")
    assert counter.bytes == 0
    copy_weight(target, w.narrow(0, 1, 3), "w")
    assert torch.equal(target, torch.arange(6, 24, dtype=torch.float32).view(3, 6))
