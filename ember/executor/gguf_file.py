"""GGUF files: metadata to an HF-style config, tensors dequantized to float with `gguf`.

llama.cpp's converter stores Q and K projections permuted for its interleaved rotary layout;
they are permuted back here so that the checkpoint matches Hugging Face's half-split rotary.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ember.executor.gguf_reader import GGUFFile

SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K",
                   "Q6_K", "Q2_K", "Q3_K")
ARCH_TO_MODEL_TYPE = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "mistral": "llama"}

_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm",
                 "output": "lm_head"}


def gguf_config(reader: GGUFFile) -> dict[str, Any]:
    arch = reader.get("general.architecture")
    if arch not in ARCH_TO_MODEL_TYPE:
        raise ValueError(f"model: GGUF architecture {arch!r} is not supported "
                         f"(supported: {', '.join(ARCH_TO_MODEL_TYPE)})")

    def get(key: str, default: Any = None) -> Any:
        return reader.get(f"{arch}.{key}", default)

    heads = get("attention.head_count")
    hidden = get("embedding_length")
    tensor_names = {t.name for t in reader.tensors}
    vocab = get("vocab_size") or len(reader.get("tokenizer.ggml.tokens", []))
    config: dict[str, Any] = {
        "model_type": ARCH_TO_MODEL_TYPE[arch],
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": get("feed_forward_length"),
        "num_hidden_layers": get("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": get("attention.head_count_kv", heads),
        "head_dim": get("attention.key_length") or hidden // heads,
        "rms_norm_eps": get("attention.layer_norm_rms_epsilon", 1e-6),
        "rope_theta": get("rope.freq_base", 10000.0),
        "max_position_embeddings": get("context_length", 4096),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "attention_bias": "blk.0.attn_q.bias" in tensor_names
        and (arch == "qwen2" or "blk.0.attn_output.bias" in tensor_names),
        "bos_token_id": reader.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": reader.get("tokenizer.ggml.eos_token_id"),
    }
    scaling_type = get("rope.scaling.type")
    if scaling_type in ("linear", "yarn"):
        config["rope_scaling"] = {
            "rope_type": scaling_type,
            "factor": get("rope.scaling.factor"),
            "original_max_position_embeddings": get("rope.scaling.original_context_length"),
        }
    return config


def hf_name(gguf_name: str) -> str:
    match = re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|bias)", gguf_name)
    if match:
        layer, part, kind = match.groups()
        if part not in _LAYER_NAMES:
            raise ValueError(f"GGUF tensor {gguf_name!r} is not understood")
        return f"model.layers.{layer}.{_LAYER_NAMES[part]}.{kind}"
    base, _, kind = gguf_name.rpartition(".")
    if base not in _GLOBAL_NAMES:
        raise ValueError(f"GGUF tensor {gguf_name!r} is not understood")
    return f"{_GLOBAL_NAMES[base]}.{kind}"


def unpermute_rotary(weight: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's permutation of Q/K rows for interleaved rotary."""
    dim = weight.shape[0] // n_head // 2
    w = weight.reshape(n_head, dim, 2, *weight.shape[1:])
    return w.swapaxes(2, 1).reshape(weight.shape)


def read_gguf(path: Path) -> tuple[dict[str, Any],
                                   Callable[[], Iterator[tuple[str, torch.Tensor]]]]:
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    reader = GGUFFile(path)
    config = gguf_config(reader)
    for tensor in reader.tensors:
        if GGMLQuantizationType(tensor.ggml_type).name not in SUPPORTED_TYPES:
            raise ValueError(f"GGUF tensor {tensor.name!r} has unsupported type "
                             f"{GGMLQuantizationType(tensor.ggml_type).name}")
    # only llama-arch converters permute Q/K (qwen2/qwen3 use neox rotary in ggml too)
    permuted = reader.get("general.architecture") in ("llama", "mistral")

    def tensors() -> Iterator[tuple[str, torch.Tensor]]:
        for tensor in reader.tensors:
            qtype = GGMLQuantizationType(tensor.ggml_type)
            data = np.asarray(dequantize(tensor.data, qtype), dtype=np.float32)
            data = data.reshape(tensor.shape)
            if permuted and ".attn_q." in tensor.name:
                data = unpermute_rotary(data, config["num_attention_heads"])
            elif permuted and ".attn_k." in tensor.name:
                data = unpermute_rotary(data, config["num_key_value_heads"])
            if not data.flags.writeable:  # F32 tensors come back as views of the mmap
                data = data.copy()
            yield hf_name(tensor.name), torch.from_numpy(np.ascontiguousarray(data))

    return config, tensors
