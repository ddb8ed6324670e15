"""Helpers for the MoE / MLA model tests: tiny transformers checkpoints (plain and quantized),
a paged step driver, logits and greedy-token references.

Test modules reach them through the `moe_kit` fixture (this module): with
--import-mode=importlib a conftest cannot be imported by name.
"""

from __future__ import annotations

import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import pytest
import torch

from ember.layers.attention import AttentionMetadata, PrefillSpan


@pytest.fixture(scope="session")
def moe_kit() -> ModuleType:
    return sys.modules[__name__]


VOCAB = 320
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
        "beta_fast": 32, "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 1.0}


def deepseek_config(q_lora_rank: int | None = 24, **overrides: Any) -> Any:
    """Several layers (first dense), 16 experts in 4 groups, top-2 groups, YaRN, tiny shapes."""
    from transformers import DeepseekV3Config

    kwargs = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96,
                  moe_intermediate_size=32, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=4, n_shared_experts=1, n_routed_experts=16,
                  num_experts_per_tok=4, n_group=4, topk_group=2, first_k_dense_replace=1,
                  routed_scaling_factor=2.5, norm_topk_prob=True, kv_lora_rank=32,
                  q_lora_rank=q_lora_rank, qk_rope_head_dim=8, qk_nope_head_dim=16,
                  v_head_dim=16, max_position_embeddings=256, rope_theta=10000.0,
                  rope_scaling=dict(YARN), initializer_range=0.1, bos_token_id=0,
                  eos_token_id=1, num_nextn_predict_layers=0)
    kwargs.update(overrides)
    return DeepseekV3Config(**kwargs)


def glm4_moe_config(**overrides: Any) -> Any:
    """GQA with partial rotary (0.5), QK-norm, q/k/v bias; 16 experts, grouped routing, YaRN."""
    from transformers import Glm4MoeConfig

    kwargs = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96,
                  moe_intermediate_size=32, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=32, n_shared_experts=1, n_routed_experts=16,
                  num_experts_per_tok=4, n_group=4, topk_group=2, first_k_dense_replace=1,
                  routed_scaling_factor=1.5, norm_topk_prob=True, use_qk_norm=True,
                  attention_bias=True, partial_rotary_factor=0.5,
                  max_position_embeddings=256, initializer_range=0.1, bos_token_id=0,
                  eos_token_id=1, num_nextn_predict_layers=0,
                  rope_parameters={**YARN, "rope_theta": 10000.0, "partial_rotary_factor": 0.5})
    kwargs.update(overrides)
    return Glm4MoeConfig(**kwargs)


def build_model(model_cls: type, config: Any, seed: int = 0) -> Any:
    """A seeded random transformers model in fp32 with non-zero routing correction biases
    (zeros would leave selection-only bias handling untested)."""
    torch.manual_seed(seed)
    model = model_cls(config).to(torch.float32).eval()
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.normal_(0.0, 0.1)
    return model


def write_tokenizer(folder: Path, vocab_size: int = VOCAB) -> None:
    """A word-level tokenizer ("t0".."tN") so the engine can load the folder in milliseconds."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t2"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="t0", eos_token="t1",
                            unk_token="t2").save_pretrained(str(folder))


def save_checkpoint(model: Any, folder: Path, **config_updates: Any) -> Path:
    """save_pretrained (safetensors) + tokenizer; `config_updates` edit config.json."""
    model.save_pretrained(str(folder), safe_serialization=True)
    write_tokenizer(folder)
    if config_updates:
        update_config(folder, **config_updates)
    return folder


def read_config(folder: Path) -> dict[str, Any]:
    return json.loads((folder / "config.json").read_text())


def update_config(folder: Path, **updates: Any) -> None:
    cfg = read_config(folder)
    cfg.update(updates)
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))


def load_ember(model_cls: type, folder: Path) -> torch.nn.Module:
    from safetensors.torch import load_file

    model = model_cls.from_hf_config(read_config(folder)).eval()
    state = {}
    for file in sorted(folder.glob("*.safetensors")):
        state.update(load_file(str(file)))
    loaded = model.load_weights(state.items())
    missing = set(dict(model.named_parameters())) - loaded
    if missing:
        raise AssertionError(f"not loaded: {sorted(missing)}")
    return model


@dataclass
class Chunk:
    """Run tokens start..start+n of sequence `seq` in one step."""

    seq: int
    start: int
    n: int


class PagedRunner:
    """Drives an ember model step by step like the engine's runner: each sequence owns
    scattered cache slots; a step mixes prefill chunks and single-token decodes."""

    def __init__(self, model: torch.nn.Module, sequences: list[list[int]],
                 num_slots: int = 256, seed: int = 0) -> None:
        self.model = model
        self.sequences = sequences
        self.caches = [torch.zeros(model.kv_cache_shape(num_slots))
                       for _ in range(model.num_kv_layers)]
        perm = torch.randperm(num_slots, generator=torch.Generator().manual_seed(seed))
        self.slots, used = [], 0
        for seq in sequences:
            self.slots.append(perm[used:used + len(seq)])
            used += len(seq)

    def step(self, chunks: list[Chunk]) -> list[torch.Tensor]:
        """Returns fp32 logits [n, vocab] for each chunk."""
        ids, pos, slot_mapping = [], [], []
        decode_rows, decode_slots, prefills, row = [], [], [], 0
        for c in chunks:
            end = c.start + c.n
            ids += self.sequences[c.seq][c.start:end]
            pos.append(torch.arange(c.start, end))
            slot_mapping.append(self.slots[c.seq][c.start:end])
            if c.n == 1:
                decode_rows.append(row)
                decode_slots.append(self.slots[c.seq][:end])
            else:
                prefills.append(PrefillSpan(row, row + c.n, self.slots[c.seq][:end], c.start))
            row += c.n
        # each sequence's slots are scattered, so its block table is its slot list (block size 1)
        width = max((len(s) for s in decode_slots), default=1)
        tables = torch.zeros(len(decode_slots), width, dtype=torch.long)
        for i, s in enumerate(decode_slots):
            tables[i, :len(s)] = s
        lens = [len(s) for s in decode_slots]
        meta = AttentionMetadata(slot_mapping=torch.cat(slot_mapping),
                                 decode_rows=torch.tensor(decode_rows, dtype=torch.long),
                                 decode_block_tables=tables,
                                 decode_seq_lens=torch.tensor(lens, dtype=torch.long),
                                 decode_max_len=max(lens, default=0), block_size=1,
                                 prefills=prefills)
        with torch.no_grad():
            hidden = self.model(torch.tensor(ids), torch.cat(pos), self.caches, meta)
            logits = self.model.compute_logits(hidden)
        return list(logits.split([c.n for c in chunks]))


def hf_logits(hf_model: Any, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(torch.tensor([tokens])).logits[0].float()


def check_paged_parity(ember_model: torch.nn.Module, hf_model: Any, atol: float = 1e-4) -> None:
    """Prefill, chunked prefill after cached context, mixed prefill+decode steps and batched
    decodes of unequal lengths (padded mask) all give transformers' logits."""
    gen = torch.Generator().manual_seed(1)
    a = torch.randint(0, VOCAB, (23,), generator=gen).tolist()
    b = torch.randint(0, VOCAB, (15,), generator=gen).tolist()
    runner = PagedRunner(ember_model, [a, b])
    ref_a, ref_b = hf_logits(hf_model, a), hf_logits(hf_model, b)
    got_a, got_b = {}, {}
    schedule = [
        [Chunk(0, 0, 9)],  # A: first prefill chunk
        [Chunk(0, 9, 11), Chunk(1, 0, 12)],  # A: chunk over 9 cached tokens; B: prefill
        [Chunk(0, 20, 1), Chunk(1, 12, 1)],  # two decodes, 21 and 13 tokens of context
        [Chunk(1, 13, 1), Chunk(0, 21, 2)],  # B decode + A two-token chunk in one step
        [Chunk(1, 14, 1)],
    ]
    for chunks in schedule:
        for c, logits in zip(chunks, runner.step(chunks), strict=True):
            store = got_a if c.seq == 0 else got_b
            for i in range(c.n):
                store[c.start + i] = logits[i]
    assert sorted(got_a) == list(range(len(a))) and sorted(got_b) == list(range(len(b)))
    for ref, got in ((ref_a, got_a), (ref_b, got_b)):
        ours = torch.stack([got[i] for i in range(len(got))])
        assert ref.abs().max() > 0.5  # logits big enough for the tolerance to mean something
        torch.testing.assert_close(ours, ref, atol=atol, rtol=0)


def hf_greedy(hf_model: Any, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    out = []
    for ids in prompts:
        gen = hf_model.generate(torch.tensor([ids]), max_new_tokens=max_tokens,
                                min_new_tokens=max_tokens, do_sample=False)
        out.append(gen[0, len(ids):].tolist())
    return out


def engine_prompts() -> list[list[int]]:
    """Four prompts; three share a growing prefix so the prefix cache has hits."""
    gen = torch.Generator().manual_seed(2)
    shared = torch.randint(2, VOCAB, (40,), generator=gen).tolist()
    other = torch.randint(2, VOCAB, (27,), generator=gen).tolist()
    return [shared[:17], shared[:33], other, shared]


ENGINE_VARIANTS = {
    "prefix cache, one step per prefill": dict(max_num_batched_tokens=512, num_kv_blocks=64),
    "prefix cache, chunked prefill, preemption": dict(max_num_batched_tokens=16, block_size=4,
                                                      num_kv_blocks=16),
}


def check_engine_greedy(folder: Path, expected: list[list[int]], max_tokens: int,
                        variants: dict[str, dict[str, Any]] | None = None) -> Any:
    """Greedy tokens through the full engine (prefix caching on) equal `expected` in every
    variant; the second variant chunks prefills and runs out of KV blocks (preempts)."""
    from ember import LLM, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    prompts = engine_prompts()
    llm = None
    for name, kwargs in (variants or ENGINE_VARIANTS).items():
        llm = LLM(str(folder), dtype="float32", enable_prefix_caching=True, **kwargs)
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        assert got == expected, name
        again = llm.generate(prompts, params)
        assert [o.outputs[0].token_ids for o in again] == expected, f"{name}, cached"
        stats = llm.stats()
        assert stats.prefix_hits > 0, name
        if "preemption" in name:
            assert stats.num_preemptions > 0, name
        llm.engine.check_integrity()
    return llm


# -- quantized checkpoints in their on-disk formats, written independently of ember ----------

FP8_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
              "weight_block_size": [128, 128]}
INT4_CONFIG = {  # Kimi K2-Thinking's quantization_config
    "quant_method": "compressed-tensors", "format": "pack-quantized",
    "quantization_status": "compressed", "kv_cache_scheme": None,
    "config_groups": {"group_0": {
        "targets": ["Linear"], "input_activations": None, "output_activations": None,
        "weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
                    "group_size": 32, "dynamic": False, "actorder": None,
                    "observer": "minmax", "observer_kwargs": {}, "block_structure": None}}},
    "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*",
               "re:.*mlp\\.(gate|up|gate_up|down)_proj.*"],
}


def fp8_quantize(w: torch.Tensor, block: int = 128) -> dict[str, torch.Tensor]:
    """Block by block: float8_e4m3fn `weight`, float32 `weight_scale_inv` per 128x128 block,
    and `deq`, the exact weight a loader must reconstruct."""
    rows, cols = w.shape
    q = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    scales = torch.empty(math.ceil(rows / block), math.ceil(cols / block))
    deq = torch.empty(rows, cols)
    for i in range(scales.shape[0]):
        for j in range(scales.shape[1]):
            rs, cs = slice(i * block, (i + 1) * block), slice(j * block, (j + 1) * block)
            scale = w[rs, cs].float().abs().max().clamp(min=1e-12) / 448.0
            q[rs, cs] = (w[rs, cs].float() / scale).to(torch.float8_e4m3fn)
            scales[i, j] = scale
            deq[rs, cs] = q[rs, cs].float() * scale
    return {"weight": q, "weight_scale_inv": scales, "deq": deq}


def int4_pack(values: torch.Tensor) -> torch.Tensor:
    """Signed 4-bit values [rows, cols] -> int32 words: value k of a word in bits 4k..4k+3,
    offset by 8, zero-padded to whole words (compressed-tensors' pack_to_int32)."""
    v = values.numpy().astype(np.uint32) + 8
    rows, cols = v.shape
    padded = np.zeros((rows, math.ceil(cols / 8) * 8), dtype=np.uint32)
    padded[:, :cols] = v
    words = np.zeros((rows, padded.shape[1] // 8), dtype=np.uint32)
    for k in range(8):
        words |= padded[:, k::8] << np.uint32(4 * k)
    return torch.from_numpy(words.view(np.int32))


def int4_quantize(w: torch.Tensor, group: int = 32) -> dict[str, torch.Tensor]:
    """Symmetric int4 per group of 32 along `in`: weight_packed / weight_scale (bf16) /
    weight_shape, and `deq`, the exact weight a loader must reconstruct."""
    rows, cols = w.shape
    grouped = w.float().view(rows, cols // group, group)
    scale = (grouped.abs().amax(-1) / 7.0).clamp(min=1e-8).to(torch.bfloat16)
    q = torch.round(grouped / scale.float().unsqueeze(-1)).clamp(-8, 7)
    deq = (q * scale.float().unsqueeze(-1)).view(rows, cols)
    return {"weight_packed": int4_pack(q.view(rows, cols).to(torch.int8)),
            "weight_scale": scale, "weight_shape": torch.tensor([rows, cols]), "deq": deq}


def quantize_checkpoint(folder: Path, reference_dir: Path, quantize, should_quantize,
                        quant_config: dict[str, Any], **config_updates: Any) -> None:
    """Rewrite folder's weights, quantizing the ones `should_quantize(name, tensor)` picks;
    save the exact dequantized weights as a plain fp32 checkpoint in reference_dir."""
    from safetensors.torch import load_file, save_file

    disk, reference = {}, {}
    for name, t in load_file(str(folder / "model.safetensors")).items():
        if should_quantize(name, t):
            parts = quantize(t)
            reference[name] = parts.pop("deq")
            disk.update({f"{name.removesuffix('.weight')}.{k}": v for k, v in parts.items()})
        else:
            disk[name] = t
            reference[name] = t.float()
    reference_dir.mkdir()
    save_file(reference, str(reference_dir / "model.safetensors"))
    (reference_dir / "config.json").write_text((folder / "config.json").read_text())
    update_config(reference_dir, dtype="float32")
    save_file(disk, str(folder / "model.safetensors"))
    update_config(folder, quantization_config=quant_config, **config_updates)
