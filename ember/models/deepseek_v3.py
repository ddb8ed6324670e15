"""DeepSeek-V3 architecture: multi-head latent attention + DeepSeek MoE. Serves DeepSeek-V3/R1
and Kimi K2 / K2.5 (`model_type` kimi_k2; K2.5 nests the text config under `text_config`).

Each layer caches kv_lora_rank + qk_rope_head_dim values per token (see layers/mla.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ember.distributed.parallel_state import ParallelContext
from ember.layers.expert_parallel import make_moe_block
from ember.layers.mla import MLAttention
from ember.layers.moe import GatedMLP, MoEConfig
from ember.layers.rotary import RotaryEmbedding, yarn_mscale
from ember.models.moe_base import DecoderLayer, MoEForCausalLM, rope_from_hf, text_config


@dataclass
class DeepseekV3Args:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    rope_interleave: bool
    attention_bias: bool
    tie_word_embeddings: bool
    first_k_dense_replace: int
    moe_layer_freq: int
    moe: MoEConfig

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> DeepseekV3Args:
        cfg = text_config(cfg)
        theta, scaling = rope_from_hf(cfg)
        args = cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=cfg["num_attention_heads"],
            q_lora_rank=cfg.get("q_lora_rank"),
            kv_lora_rank=cfg["kv_lora_rank"],
            qk_nope_head_dim=cfg["qk_nope_head_dim"],
            qk_rope_head_dim=cfg["qk_rope_head_dim"],
            v_head_dim=cfg["v_head_dim"],
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            rope_interleave=cfg.get("rope_interleave", True),
            attention_bias=cfg.get("attention_bias", False),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            first_k_dense_replace=cfg.get("first_k_dense_replace") or 0,
            moe_layer_freq=cfg.get("moe_layer_freq") or 1,
            moe=MoEConfig.from_hf(cfg, scoring_func="sigmoid", topk_method="noaux_tc",
                                  correction_bias=True, norm_topk_prob=True),
        )
        if cfg.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {cfg['hidden_act']!r} is not supported (silu only)")
        return args

    def is_moe_layer(self, index: int) -> bool:
        return index >= self.first_k_dense_replace and index % self.moe_layer_freq == 0

    @property
    def softmax_scale(self) -> float:
        """qk_head_dim^-0.5, times yarn_mscale(factor, mscale_all_dim)^2 under YaRN."""
        scale = (self.qk_nope_head_dim + self.qk_rope_head_dim) ** -0.5
        rope = self.rope_scaling or {}
        if rope.get("mscale_all_dim"):
            factor = rope.get("factor") or (self.max_position_embeddings
                                            / rope["original_max_position_embeddings"])
            scale *= yarn_mscale(factor, rope["mscale_all_dim"]) ** 2
        return scale


class DeepseekV3ForCausalLM(MoEForCausalLM):
    def __init__(self, args: DeepseekV3Args, parallel: ParallelContext | None = None) -> None:
        tp = parallel.tp if parallel is not None else None
        rotary = RotaryEmbedding(args.qk_rope_head_dim, args.max_position_embeddings,
                                 args.rope_theta, args.rope_scaling)
        layers = []
        for i in range(args.num_hidden_layers):
            attn = MLAttention(args.hidden_size, args.num_attention_heads, args.q_lora_rank,
                               args.kv_lora_rank, args.qk_nope_head_dim, args.qk_rope_head_dim,
                               args.v_head_dim, rotary, args.softmax_scale,
                               rope_interleave=args.rope_interleave,
                               attention_bias=args.attention_bias,
                               rms_norm_eps=args.rms_norm_eps, tp=tp)
            mlp = (make_moe_block(args.moe, parallel) if args.is_moe_layer(i)
                   else GatedMLP(args.hidden_size, args.intermediate_size, group=tp))
            layers.append(DecoderLayer(attn, mlp, args.hidden_size, args.rms_norm_eps))
        super().__init__(args.vocab_size, args.hidden_size, args.rms_norm_eps,
                         args.tie_word_embeddings, rotary, layers, parallel)
        self.args = args

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any],
                       parallel: ParallelContext | None = None) -> DeepseekV3ForCausalLM:
        return cls(DeepseekV3Args.from_hf(cfg), parallel)

    def kv_cache_shape(self, num_slots: int) -> tuple[int, ...]:
        """One latent row per slot: kv_lora_rank + qk_rope_head_dim values."""
        return (num_slots, self.args.kv_lora_rank + self.args.qk_rope_head_dim)
