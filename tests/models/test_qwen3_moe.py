"""Qwen3-MoE (softmax top-k routing, no shared expert, QK-norm) against transformers."""

from __future__ import annotations

from ember.layers.moe import GatedMLP
from ember.models.qwen3_moe import Qwen3MoeForCausalLM


def test_logits_match_transformers(moe_kit, tmp_path):
    from transformers import Qwen3MoeConfig
    from transformers import Qwen3MoeForCausalLM as HFQwen3Moe

    config = Qwen3MoeConfig(vocab_size=moe_kit.VOCAB, hidden_size=64, intermediate_size=96,
                            moe_intermediate_size=32, num_hidden_layers=3,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                            num_experts=16, num_experts_per_tok=4, norm_topk_prob=True,
                            mlp_only_layers=[1], max_position_embeddings=256,
                            initializer_range=0.1)
    hf = moe_kit.build_model(HFQwen3Moe, config)
    model = moe_kit.load_ember(Qwen3MoeForCausalLM, moe_kit.save_checkpoint(hf, tmp_path))
    assert isinstance(model.layers[1].mlp, GatedMLP)
    assert sorted(model.moe_blocks()) == [0, 2]
    assert model.layers[0].mlp.shared_experts is None
    moe_kit.check_paged_parity(model, hf)
    assert int(model.layers[0].mlp.expert_counts.sum()) == 4 * (23 + 15)
