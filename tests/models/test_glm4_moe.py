"""GLM-4.x MoE (GQA, partial rotary, QK-norm, q/k/v bias, DeepSeek-style MoE) against
transformers' Glm4MoeForCausalLM."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ember.models.glm4_moe import Glm4MoeArgs, Glm4MoeForCausalLM
from ember.models.registry import model_class

MAX_TOKENS = 8


@pytest.fixture(scope="module")
def glm_dir(moe_kit, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import Glm4MoeForCausalLM as HFGlm

    model = moe_kit.build_model(HFGlm, moe_kit.glm4_moe_config())
    return moe_kit.save_checkpoint(model, tmp_path_factory.mktemp("glm4_moe"))


def test_logits_match_transformers(moe_kit, glm_dir):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(glm_dir), dtype=torch.float32).eval()
    model = moe_kit.load_ember(model_class(moe_kit.read_config(glm_dir)), glm_dir)
    assert isinstance(model, Glm4MoeForCausalLM)
    assert model.rotary.rotary_dim == 16  # head_dim 32 x partial_rotary_factor 0.5
    assert sorted(model.moe_blocks()) == [1, 2]
    moe_kit.check_paged_parity(model, hf)


def test_config_defaults_and_legacy_keys():
    """Legacy top-level rope keys and GLM's defaults (partial rotary 0.5, sigmoid routing with
    a correction bias) when the config leaves them out."""
    cfg = {"model_type": "glm4_moe", "vocab_size": 32, "hidden_size": 16,
           "intermediate_size": 32, "moe_intermediate_size": 8, "num_hidden_layers": 2,
           "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 8,
           "n_routed_experts": 4, "num_experts_per_tok": 2, "first_k_dense_replace": 1,
           "rope_theta": 1e6, "rope_scaling": {"type": "yarn", "factor": 2.0,
                                               "original_max_position_embeddings": 64}}
    args = Glm4MoeArgs.from_hf(cfg)
    assert args.attn.partial_rotary_factor == 0.5 and args.attn.rope_theta == 1e6
    assert args.attn.rope_scaling["type"] == "yarn"
    assert args.moe.scoring_func == "sigmoid" and args.moe.correction_bias
    assert args.moe.num_shared_experts == 0
    with pytest.raises(ValueError, match="n_group"):
        Glm4MoeArgs.from_hf({**cfg, "n_group": 3})


def test_engine_greedy_matches_transformers(moe_kit, glm_dir):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(glm_dir), dtype=torch.float32)
    expected = moe_kit.hf_greedy(hf, moe_kit.engine_prompts(), MAX_TOKENS)
    llm = moe_kit.check_engine_greedy(glm_dir, expected, MAX_TOKENS)
    cfg = moe_kit.read_config(glm_dir)
    per_layer = 2 * cfg["num_key_value_heads"] * cfg["head_dim"]
    assert llm.stats().kv_bytes_per_token == per_layer * cfg["num_hidden_layers"] * 4
