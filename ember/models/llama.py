"""Llama-family decoder (Llama 2/3, Mistral, Qwen2, Qwen3 dense, SmolLM2) in plain PyTorch.

Parameter names follow Hugging Face checkpoints, except that q/k/v and gate/up projections
are stacked into one matrix each (one GEMM instead of three or two); `load_weights` fills
the stacked matrices from the separate checkpoint tensors.

Under tensor parallelism (a `ParallelContext` with a tensor-parallel group of several ranks)
the projections are column/row-parallel, attention heads and the vocabulary are split, and
each rank loads only its shard; with one rank the layers are plain linear layers.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ember.distributed.comm import GroupComm
from ember.distributed.parallel_state import ParallelContext
from ember.layers.attention import AttentionMetadata, paged_attention
from ember.layers.linear import (
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    WeightSource,
    load_into,
)
from ember.layers.norms import RMSNorm
from ember.layers.rotary import RotaryEmbedding


@dataclass
class LlamaArgs:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # biases on q/k/v
    o_proj_bias: bool
    qk_norm: bool
    partial_rotary_factor: float = 1.0

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> LlamaArgs:
        model_type = cfg.get("model_type", "llama")
        heads = cfg["num_attention_heads"]
        rope_params = cfg.get("rope_parameters") or {}
        scaling = cfg.get("rope_scaling") or (rope_params if rope_params.get("rope_type") not in
                                               (None, "default") else None)
        return cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=cfg.get("rope_theta") or rope_params.get("rope_theta") or 10000.0,
            rope_scaling=scaling,
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            attention_bias=model_type == "qwen2" or cfg.get("attention_bias", False),
            o_proj_bias=model_type != "qwen2" and cfg.get("attention_bias", False),
            qk_norm=model_type == "qwen3",
            partial_rotary_factor=cfg.get("partial_rotary_factor", 1.0),
        )


class LlamaAttention(nn.Module):
    def __init__(self, args: LlamaArgs, rotary: RotaryEmbedding,
                 tp: GroupComm | None = None) -> None:
        super().__init__()
        self.head_dim = args.head_dim
        self.qkv_proj = QKVParallelLinear(args.hidden_size, args.head_dim,
                                          args.num_attention_heads, args.num_key_value_heads,
                                          bias=args.attention_bias, group=tp)
        # this rank's heads (all of them on one rank)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.q_size, self.kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        self.o_proj = RowParallelLinear(args.num_attention_heads * args.head_dim,
                                        args.hidden_size, bias=args.o_proj_bias, group=tp)
        self.q_norm = RMSNorm(self.head_dim, args.rms_norm_eps) if args.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, args.rms_norm_eps) if args.qk_norm else None
        self.rotary = rotary
        self.scale = self.head_dim ** -0.5

    def forward(self, x: torch.Tensor, cos_sin: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q = self.rotary.apply(q, cos_sin)
        k = self.rotary.apply(k, cos_sin)
        out = paged_attention(q, k, v, kv_cache, meta, self.scale)
        return self.o_proj(out.reshape(t, self.q_size))


class LlamaMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int,
                 tp: GroupComm | None = None) -> None:
        super().__init__()
        self.intermediate_size = intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size] * 2,
                                                       group=tp)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, group=tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate).mul_(up))  # in place: one less activation-sized pass


class LlamaDecoderLayer(nn.Module):
    def __init__(self, args: LlamaArgs, rotary: RotaryEmbedding,
                 tp: GroupComm | None = None) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(args, rotary, tp)
        self.mlp = LlamaMLP(args.hidden_size, args.intermediate_size, tp)
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos_sin: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos_sin, kv_cache, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaForCausalLM(nn.Module):
    def __init__(self, args: LlamaArgs, parallel: ParallelContext | None = None) -> None:
        super().__init__()
        self.args = args
        tp = parallel.tp if parallel is not None else None
        rotary_dim = int(args.head_dim * args.partial_rotary_factor)
        self.rotary = RotaryEmbedding(rotary_dim, args.max_position_embeddings, args.rope_theta,
                                      args.rope_scaling)
        self.embed_tokens = VocabParallelEmbedding(args.vocab_size, args.hidden_size, tp)
        self.layers = nn.ModuleList(LlamaDecoderLayer(args, self.rotary, tp)
                                    for _ in range(args.num_hidden_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.lm_head = (None if args.tie_word_embeddings
                        else ParallelLMHead(args.vocab_size, args.hidden_size, tp))

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any],
                       parallel: ParallelContext | None = None) -> LlamaForCausalLM:
        return cls(LlamaArgs.from_hf(cfg), parallel)

    def kv_cache_shape(self, num_slots: int) -> tuple[int, ...]:
        """Shape of one layer's cache (this rank's KV heads): K and V, head-major so a gather
        yields [H, L, D]."""
        return (2, self.layers[0].self_attn.num_kv_heads, num_slots, self.args.head_dim)

    @property
    def num_kv_layers(self) -> int:
        return self.args.num_hidden_layers

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[torch.Tensor], meta: AttentionMetadata) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        cos_sin = self.rotary.cos_sin(positions, x.dtype)
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            x = layer(x, cos_sin, kv_cache, meta)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """fp32 logits; under tensor parallelism only the group's first rank gets them."""
        head = self.embed_tokens if self.lm_head is None else self.lm_head
        return head.logits(hidden)

    def load_weights(self, weights: Iterable[tuple[str, WeightSource]]) -> set[str]:
        """Copy checkpoint tensors (HF names) into parameters, each rank its shard; returns
        the names loaded."""
        params = dict(self.named_parameters())
        stacked = {"q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"),
                   "v_proj": ("qkv_proj", "v"), "gate_proj": ("gate_up_proj", 0),
                   "up_proj": ("gate_up_proj", 1)}
        loaded: set[str] = set()
        for name, tensor in weights:
            name = name.removeprefix("model.")
            if "rotary_emb" in name or (name == "lm_head.weight" and self.lm_head is None):
                continue
            parts = name.split(".")
            target = name
            shard = None
            if len(parts) >= 2 and parts[-2] in stacked:
                fused, shard = stacked[parts[-2]]
                target = ".".join(parts[:-2] + [fused, parts[-1]])
            if target not in params:
                raise ValueError(
                    f"checkpoint tensor {name!r} has no place in {type(self).__name__}")
            module_name, _, leaf = target.rpartition(".")
            load_into(self.get_submodule(module_name), leaf, tensor, name, shard)
            loaded.add(target)
        return loaded
