"""Maps a checkpoint's config (model_type / architectures) to the model class that runs it."""

from __future__ import annotations

from typing import Any

from torch import nn

from ember.models.deepseek_v3 import DeepseekV3ForCausalLM
from ember.models.glm4_moe import Glm4MoeForCausalLM
from ember.models.llama import LlamaForCausalLM
from ember.models.qwen3_moe import Qwen3MoeForCausalLM

# model_type -> model class; each class offers from_hf_config(dict), kv_cache_shape(num_slots),
# num_kv_layers, forward(input_ids, positions, kv_caches, meta), compute_logits(hidden) and
# load_weights(iterable of (hf_name, tensor)) -> set of loaded parameter names.
MODEL_TYPES: dict[str, type[nn.Module]] = {
    "llama": LlamaForCausalLM,
    "mistral": LlamaForCausalLM,
    "qwen2": LlamaForCausalLM,
    "qwen3": LlamaForCausalLM,
    "deepseek_v3": DeepseekV3ForCausalLM,
    "kimi_k2": DeepseekV3ForCausalLM,
    "kimi_k25": DeepseekV3ForCausalLM,  # multimodal wrapper; the text model is served
    "glm4_moe": Glm4MoeForCausalLM,
    "qwen3_moe": Qwen3MoeForCausalLM,
}


def model_class(hf_config: dict[str, Any]) -> type[nn.Module]:
    model_type = hf_config.get("model_type")
    if model_type not in MODEL_TYPES:
        raise ValueError(f"model_type {model_type!r} is not supported; "
                         f"supported: {', '.join(sorted(MODEL_TYPES))}")
    return MODEL_TYPES[model_type]
