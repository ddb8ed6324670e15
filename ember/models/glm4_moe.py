"""GLM-4.5 / 4.6 / 4.7 MoE: grouped-query attention (partial rotary, optional QK-norm and
q/k/v bias) + DeepSeek-style MoE (sigmoid scores, correction bias, shared expert).

Attention is Llama's (q/k/v stacked in one projection, paged K/V cache); the MoE block and the
decoder skeleton are shared with DeepSeek-V3 (models/moe_base.py).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from torch import nn

from ember.distributed.parallel_state import ParallelContext
from ember.layers.expert_parallel import make_moe_block
from ember.layers.linear import WeightSource
from ember.layers.moe import GatedMLP, MoEConfig
from ember.layers.rotary import RotaryEmbedding
from ember.models.llama import LlamaArgs, LlamaAttention
from ember.models.moe_base import DecoderLayer, MoEForCausalLM, text_config


@dataclass
class Glm4MoeArgs:
    attn: LlamaArgs  # attention, rotary and embedding shapes; intermediate_size = dense layers
    first_k_dense_replace: int
    moe: MoEConfig

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> Glm4MoeArgs:
        cfg = text_config(cfg)
        rope_params = cfg.get("rope_parameters") or {}
        partial = cfg.get("partial_rotary_factor") or rope_params.get("partial_rotary_factor")
        attn = dataclasses.replace(LlamaArgs.from_hf(cfg), qk_norm=cfg.get("use_qk_norm", False),
                                   o_proj_bias=False, partial_rotary_factor=partial or 0.5)
        return cls(attn=attn, first_k_dense_replace=cfg.get("first_k_dense_replace") or 0,
                   moe=MoEConfig.from_hf(cfg, scoring_func="sigmoid", topk_method="noaux_tc",
                                         correction_bias=True, norm_topk_prob=True))

    def is_moe_layer(self, index: int) -> bool:
        return index >= self.first_k_dense_replace


class Glm4MoeForCausalLM(MoEForCausalLM):
    args_class: type = Glm4MoeArgs

    def __init__(self, args: Glm4MoeArgs, parallel: ParallelContext | None = None) -> None:
        a = args.attn
        tp = parallel.tp if parallel is not None else None
        rotary = RotaryEmbedding(int(a.head_dim * a.partial_rotary_factor),
                                 a.max_position_embeddings, a.rope_theta, a.rope_scaling)
        layers = []
        for i in range(a.num_hidden_layers):
            mlp = (make_moe_block(args.moe, parallel) if args.is_moe_layer(i)
                   else GatedMLP(a.hidden_size, a.intermediate_size, group=tp))
            layers.append(DecoderLayer(LlamaAttention(a, rotary, tp), mlp, a.hidden_size,
                                       a.rms_norm_eps))
        super().__init__(a.vocab_size, a.hidden_size, a.rms_norm_eps, a.tie_word_embeddings,
                         rotary, layers, parallel)
        self.args = args

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any],
                       parallel: ParallelContext | None = None) -> Glm4MoeForCausalLM:
        return cls(cls.args_class.from_hf(cfg), parallel)

    def kv_cache_shape(self, num_slots: int) -> tuple[int, ...]:
        """K and V (this rank's KV heads), head-major, as Llama's paged attention keeps them."""
        return (2, self.layers[0].self_attn.num_kv_heads, num_slots, self.args.attn.head_dim)

    def _load_attention(self, attn: nn.Module, name: str, tensor: WeightSource) -> str | None:
        proj, _, leaf = name.partition(".")
        if proj not in ("q_proj", "k_proj", "v_proj"):
            return None
        attn.qkv_proj.load_weight(leaf, tensor, proj[0])
        return f"qkv_proj.{leaf}"
