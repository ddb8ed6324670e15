"""Shared fixtures: tiny random checkpoints built with transformers, saved as safetensors.

The tiny checkpoints reuse the default model's tokenizer (converted once from its GGUF), so
text round-trips like the real model's while the weights stay a few MB.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from ember.executor.checkpoint import open_checkpoint
from ember.engine.tokenizer import load_tokenizer

TINY_VOCAB = 49152  # the default model's tokenizer


def save_tokenizer(folder: Path) -> None:
    load_tokenizer(open_checkpoint(None)).hf.save_pretrained(str(folder))


def build_tiny_checkpoint(folder: Path, config: object, model_cls: type, seed: int = 0) -> Path:
    """Save a seeded random transformers model plus the default tokenizer into folder."""
    torch.manual_seed(seed)
    model = model_cls(config).to(torch.float32)
    model.save_pretrained(str(folder), safe_serialization=True)
    save_tokenizer(folder)
    return folder


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=2048, rope_theta=10000.0,
                         tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny_llama"), config, LlamaForCausalLM)


@pytest.fixture(scope="session")
def tiny_qwen3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=32, max_position_embeddings=2048, rope_theta=1000000.0,
                         tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny_qwen3"), config, Qwen3ForCausalLM)


def read_config(folder: Path) -> dict:
    return json.loads((folder / "config.json").read_text())
