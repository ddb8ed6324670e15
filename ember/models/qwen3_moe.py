"""Qwen3-MoE: Qwen3 attention (QK-norm, full rotary) + softmax top-k routing, no shared
expert. Structurally a GLM-4 MoE with a different router and sparse-layer pattern."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from ember.layers.moe import MoEConfig
from ember.models.glm4_moe import Glm4MoeArgs, Glm4MoeForCausalLM
from ember.models.llama import LlamaArgs
from ember.models.moe_base import text_config


@dataclass
class Qwen3MoeArgs(Glm4MoeArgs):
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] = field(default_factory=list)

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> Qwen3MoeArgs:
        cfg = text_config(cfg)
        attn = dataclasses.replace(LlamaArgs.from_hf(cfg), qk_norm=True, partial_rotary_factor=1.0)
        moe = MoEConfig.from_hf({**cfg, "n_shared_experts": 0}, scoring_func="softmax",
                                topk_method="greedy", correction_bias=False, norm_topk_prob=False)
        return cls(attn=attn, first_k_dense_replace=0, moe=moe,
                   decoder_sparse_step=cfg.get("decoder_sparse_step") or 1,
                   mlp_only_layers=list(cfg.get("mlp_only_layers") or []))

    def is_moe_layer(self, index: int) -> bool:
        return (index not in self.mlp_only_layers
                and (index + 1) % self.decoder_sparse_step == 0)


class Qwen3MoeForCausalLM(Glm4MoeForCausalLM):
    args_class = Qwen3MoeArgs
