"""Llama-family variants at logits parity with transformers through paged steps."""

from __future__ import annotations

import pytest
import torch

from ember.models.llama import LlamaForCausalLM

SMALL = dict(vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)


def llama(rope_scaling=None, **extra):
    from transformers import LlamaConfig
    from transformers import LlamaForCausalLM as HF

    return HF, LlamaConfig(**SMALL, rope_scaling=rope_scaling, **extra)


def qwen2():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    return Qwen2ForCausalLM, Qwen2Config(**SMALL, tie_word_embeddings=True)


def qwen3():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    return Qwen3ForCausalLM, Qwen3Config(**SMALL, head_dim=24)


VARIANTS = {
    "llama": lambda: llama(),
    "llama3 rope": lambda: llama({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                  "high_freq_factor": 4.0,
                                  "original_max_position_embeddings": 16}),
    "linear rope": lambda: llama({"rope_type": "linear", "factor": 2.0}),
    "yarn rope": lambda: llama({"rope_type": "yarn", "factor": 4.0,
                                "original_max_position_embeddings": 16}),
    "attention bias": lambda: llama(attention_bias=True),
    "qwen2 (qkv bias, tied)": qwen2,
    "qwen3 (qk-norm, head_dim)": qwen3,
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_logits_match_transformers(variant, moe_kit, tmp_path):
    hf_cls, config = VARIANTS[variant]()
    hf = moe_kit.build_model(hf_cls, config)
    folder = moe_kit.save_checkpoint(hf, tmp_path)
    ember = moe_kit.load_ember(LlamaForCausalLM, folder)
    moe_kit.check_paged_parity(ember, hf)


def test_missing_and_misshapen_tensors_are_errors(moe_kit, tmp_path):
    hf_cls, config = llama()
    model = LlamaForCausalLM.from_hf_config(config.to_dict())
    with pytest.raises(ValueError, match="has no place"):
        model.load_weights([("model.layers.0.self_attn.nope.weight", torch.zeros(1))])
    with pytest.raises(ValueError, match="shape"):
        model.load_weights([("model.norm.weight", torch.zeros(3))])


def test_unsupported_rope_type_names_the_field():
    with pytest.raises(ValueError, match="rope_scaling"):
        LlamaForCausalLM.from_hf_config({**SMALL, "model_type": "llama",
                                         "rope_scaling": {"rope_type": "longrope"}})
