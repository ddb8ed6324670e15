"""Shared skeleton of the MoE decoders (DeepSeek-V3 / Kimi K2, GLM-4 MoE, Qwen3-MoE).

Each family differs only in its attention module, its KV cache layout and which layers are
sparse; embedding, pre-norm residual blocks, the final norm, the LM head and checkpoint-name
handling (multimodal prefixes, multi-token-prediction layers, tied embeddings) live here.

Under parallelism (a ParallelContext) the embedding and LM head are vocabulary-parallel over
the tensor-parallel group, attention and dense MLPs tensor-parallel, and MoE blocks expert-
parallel over every rank (layers/expert_parallel.py); each rank loads only its shard.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from ember.distributed.parallel_state import ParallelContext
from ember.layers.attention import AttentionMetadata
from ember.layers.linear import ParallelLMHead, VocabParallelEmbedding, WeightSource, load_into
from ember.layers.moe import SparseMoeBlock
from ember.layers.norms import RMSNorm
from ember.layers.rotary import RotaryEmbedding

logger = logging.getLogger(__name__)

# Checkpoint prefixes of multimodal wrappers (Kimi K2.5) around the text model.
TEXT_PREFIXES = ("language_model.", "model.")
NON_TEXT_PREFIXES = ("vision_tower.", "mm_projector.", "multi_modal_projector.")


def text_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """The text model's config: a nested `text_config` (Kimi K2.5) overrides the outer keys."""
    inner = cfg.get("text_config")
    return {**cfg, **inner} if isinstance(inner, dict) else cfg


def rope_from_hf(cfg: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, scaling dict or None) from legacy `rope_scaling` or v5 `rope_parameters`."""
    params = cfg.get("rope_parameters") or {}
    scaling = cfg.get("rope_scaling") or params
    rope_type = scaling.get("rope_type") or scaling.get("type") or "default"
    theta = cfg.get("rope_theta") or params.get("rope_theta") or 10000.0
    return float(theta), (scaling if rope_type != "default" else None)


class DecoderLayer(nn.Module):
    def __init__(self, self_attn: nn.Module, mlp: nn.Module, hidden_size: int,
                 eps: float) -> None:
        super().__init__()
        self.self_attn = self_attn
        self.mlp = mlp
        self.input_layernorm = RMSNorm(hidden_size, eps)
        self.post_attention_layernorm = RMSNorm(hidden_size, eps)

    def forward(self, x: torch.Tensor, cos_sin: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos_sin, kv_cache, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class MoEForCausalLM(nn.Module):
    """Subclasses build `layers` (DecoderLayer each) and implement `kv_cache_shape` and
    `_load_attention`; everything else is shared."""

    def __init__(self, vocab_size: int, hidden_size: int, rms_norm_eps: float,
                 tie_word_embeddings: bool, rotary: RotaryEmbedding,
                 layers: list[DecoderLayer], parallel: ParallelContext | None = None) -> None:
        super().__init__()
        tp = parallel.tp if parallel is not None else None
        self.rotary = rotary
        self.embed_tokens = VocabParallelEmbedding(vocab_size, hidden_size, tp)
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(hidden_size, rms_norm_eps)
        self.lm_head = (None if tie_word_embeddings
                        else ParallelLMHead(vocab_size, hidden_size, tp))

    @property
    def num_kv_layers(self) -> int:
        return len(self.layers)

    def kv_cache_shape(self, num_slots: int) -> tuple[int, ...]:
        raise NotImplementedError

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

    def moe_blocks(self) -> dict[int, SparseMoeBlock]:
        """Sparse layers by index; each keeps its per-expert token counts (`expert_counts`)."""
        return {i: layer.mlp for i, layer in enumerate(self.layers)
                if isinstance(layer.mlp, SparseMoeBlock)}

    def load_weights(self, weights: Iterable[tuple[str, WeightSource]]) -> set[str]:
        """Copy checkpoint tensors (HF names) into parameters, each rank its shard; returns the
        parameter names written. Multi-token-prediction layers (index >= num layers) and
        vision-tower weights are skipped with one log line each."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        skipped: dict[str, set[str]] = {"multi-token-prediction": set(), "non-text": set()}
        for hf_name, tensor in weights:
            name = hf_name
            for prefix in TEXT_PREFIXES:
                name = name.removeprefix(prefix)
            if name.startswith(NON_TEXT_PREFIXES):
                skipped["non-text"].add(name.split(".")[0])
                continue
            if "rotary_emb" in name or (name == "lm_head.weight" and self.lm_head is None):
                continue
            parts = name.split(".")
            if parts[0] == "layers" and len(parts) > 2:
                index, rest = int(parts[1]), ".".join(parts[2:])
                if index >= len(self.layers):
                    skipped["multi-token-prediction"].add(parts[1])
                    continue
                layer = self.layers[index]
                if parts[2] == "mlp":
                    target = layer.mlp.load(".".join(parts[3:]), tensor)
                    loaded.add(f"layers.{index}.mlp.{target}")
                    continue
                if parts[2] == "self_attn":
                    target = self._load_attention(layer.self_attn, ".".join(parts[3:]), tensor)
                    if target is not None:
                        loaded.add(f"layers.{index}.self_attn.{target}")
                        continue
                name = f"layers.{index}.{rest}"
            if name not in params:
                raise ValueError(f"checkpoint tensor {hf_name!r} has no place in "
                                 f"{type(self).__name__}")
            module_name, _, leaf = name.rpartition(".")
            load_into(self.get_submodule(module_name), leaf, tensor, hf_name)
            loaded.add(name)
        for what, items in skipped.items():
            if items:
                logger.info("skipped %s weights (%s) not used by %s", what,
                            ", ".join(sorted(items)), type(self).__name__)
        return loaded

    def _load_attention(self, attn: nn.Module, name: str, tensor: WeightSource) -> str | None:
        """Load a tensor that does not map 1:1 onto a parameter of `attn`; returns the
        parameter name written, or None to copy it by name."""
        return None

