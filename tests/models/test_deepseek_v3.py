"""DeepSeek-V3 / Kimi K2 (MLA + MoE) against transformers' DeepseekV3ForCausalLM, plain and
from block-FP8 / INT4 pack-quantized checkpoints."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from ember.executor.checkpoint import open_checkpoint
from ember.layers.moe import GatedMLP, SparseMoeBlock
from ember.models.deepseek_v3 import DeepseekV3ForCausalLM
from ember.models.registry import model_class

MAX_TOKENS = 8
CHUNKED = dict(max_num_batched_tokens=16, num_kv_blocks=64)


@pytest.fixture(scope="module")
def deepseek_dir(moe_kit, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import DeepseekV3ForCausalLM as HFDeepseek

    model = moe_kit.build_model(HFDeepseek, moe_kit.deepseek_config(q_lora_rank=24))
    return moe_kit.save_checkpoint(model, tmp_path_factory.mktemp("deepseek_v3"))


@pytest.mark.parametrize("q_lora_rank", [24, None], ids=["q_lora", "no_q_lora"])
def test_logits_match_transformers(moe_kit, q_lora_rank, tmp_path):
    from transformers import DeepseekV3ForCausalLM as HFDeepseek

    hf = moe_kit.build_model(HFDeepseek, moe_kit.deepseek_config(q_lora_rank=q_lora_rank),
                             seed=q_lora_rank or 7)
    folder = moe_kit.save_checkpoint(hf, tmp_path)
    model = moe_kit.load_ember(model_class(moe_kit.read_config(folder)), folder)
    moe_kit.check_paged_parity(model, hf)

    blocks = model.moe_blocks()
    assert sorted(blocks) == [1, 2]  # first_k_dense_replace = 1
    assert isinstance(model.layers[0].mlp, GatedMLP)
    for block in blocks.values():
        counts = block.expert_counts
        # every token of every step was routed to num_experts_per_tok experts
        assert int(counts.sum()) == 4 * (23 + 15)
        assert (counts > 0).sum() > 4  # grouped routing still spreads over many experts


def test_latent_cache_holds_one_row_per_token(moe_kit, deepseek_dir):
    cfg = moe_kit.read_config(deepseek_dir)
    model = DeepseekV3ForCausalLM.from_hf_config(cfg)
    assert model.kv_cache_shape(10) == (10, cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"])
    assert model.num_kv_layers == cfg["num_hidden_layers"]


def test_kimi_k25_nested_config_prefixed_weights_and_mtp_layer(moe_kit, deepseek_dir, caplog):
    """Kimi K2.5 nests the text config and prefixes the text weights with `language_model.`;
    vision-tower and multi-token-prediction weights are skipped with one log line each."""
    text = dict(moe_kit.read_config(deepseek_dir), model_type="kimi_k2")
    cfg = {"model_type": "kimi_k25", "architectures": ["KimiK25ForConditionalGeneration"],
           "text_config": text, "vision_config": {"hidden_size": 8}}
    state = load_file(str(deepseek_dir / "model.safetensors"))
    n = text["num_hidden_layers"]
    renamed = {f"language_model.{k}": v for k, v in state.items()}
    mtp = {k.replace("layers.1.", f"layers.{n}."): v for k, v in renamed.items()
           if ".layers.1." in k}
    vision = {"vision_tower.patch_embed.proj.weight": torch.zeros(8, 3),
              "mm_projector.proj.0.weight": torch.zeros(8, 8)}
    model = model_class(cfg).from_hf_config(cfg).eval()
    with caplog.at_level(logging.INFO, logger="ember.models.moe_base"):
        loaded = model.load_weights({**renamed, **mtp, **vision}.items())
    assert loaded == set(dict(model.named_parameters()))
    messages = [r.getMessage() for r in caplog.records]
    assert sum("multi-token-prediction" in m and str(n) in m for m in messages) == 1
    assert sum("vision_tower" in m for m in messages) == 1

    reference = moe_kit.load_ember(DeepseekV3ForCausalLM, deepseek_dir)
    for name, param in reference.named_parameters():
        torch.testing.assert_close(model.get_parameter(name), param, atol=0, rtol=0)


def test_unknown_or_misshapen_tensor_is_an_error(moe_kit, deepseek_dir):
    model = DeepseekV3ForCausalLM.from_hf_config(moe_kit.read_config(deepseek_dir))
    with pytest.raises(ValueError, match="no place"):
        model.load_weights([("model.layers.0.self_attn.k_proj.weight", torch.zeros(4, 4))])
    with pytest.raises(ValueError, match="shape"):
        model.load_weights([("model.layers.1.mlp.experts.3.up_proj.weight", torch.zeros(4, 4))])


def test_router_stays_fp32_in_a_bf16_model(moe_kit, deepseek_dir):
    model = DeepseekV3ForCausalLM.from_hf_config(moe_kit.read_config(deepseek_dir))
    block = model.to(torch.bfloat16).layers[1].mlp
    assert isinstance(block, SparseMoeBlock)
    assert block.gate.weight.dtype == torch.float32
    assert block.gate.e_score_correction_bias.dtype == torch.float32
    assert block.experts.gate_up_proj.dtype == torch.bfloat16


def test_engine_greedy_matches_transformers_and_kimi_k2_alias(moe_kit, deepseek_dir, tmp_path):
    """Full engine (prefix caching, chunked prefill, preemption) gives transformers' greedy
    tokens; the same weights as model_type kimi_k2 give the same tokens; the engine's KV
    report is the latent size."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(deepseek_dir), dtype=torch.float32)
    expected = moe_kit.hf_greedy(hf, moe_kit.engine_prompts(), MAX_TOKENS)
    llm = moe_kit.check_engine_greedy(deepseek_dir, expected, MAX_TOKENS)
    cfg = moe_kit.read_config(deepseek_dir)
    latent = cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"]
    assert llm.stats().kv_bytes_per_token == latent * cfg["num_hidden_layers"] * 4

    kimi = tmp_path / "kimi"
    kimi.mkdir()
    for f in deepseek_dir.iterdir():
        (kimi / f.name).write_bytes(f.read_bytes())
    moe_kit.update_config(kimi, model_type="kimi_k2", architectures=["DeepseekV3ForCausalLM"])
    moe_kit.check_engine_greedy(kimi, expected, MAX_TOKENS,
                                variants={"kimi_k2, chunked": CHUNKED})


# -- quantized checkpoints ---------------------------------------------------------------------

def bf16_checkpoint(moe_kit, folder: Path) -> Path:
    """A tiny DeepSeek-V3 saved in bf16, as the quantized releases start from."""
    from transformers import DeepseekV3ForCausalLM as HFDeepseek

    # intermediate_size 192: dense MLP weights span two 128-blocks along one side
    hf = moe_kit.build_model(HFDeepseek, moe_kit.deepseek_config(intermediate_size=192), seed=5)
    hf.to(torch.bfloat16).save_pretrained(str(folder), safe_serialization=True)
    moe_kit.write_tokenizer(folder)
    return folder


def check_against_reference(moe_kit, folder: Path, reference_dir: Path) -> None:
    """The engine's loader yields exactly the dequantized reference weights, and greedy tokens
    through the engine equal transformers' on the reference checkpoint."""
    from transformers import AutoModelForCausalLM

    reference = load_file(str(reference_dir / "model.safetensors"))
    loaded = dict(open_checkpoint(str(folder)).tensors())
    assert loaded.keys() == reference.keys()
    for name, t in reference.items():
        assert torch.equal(loaded[name].float(), t), name
    hf = AutoModelForCausalLM.from_pretrained(str(reference_dir), dtype=torch.float32)
    expected = moe_kit.hf_greedy(hf.eval(), moe_kit.engine_prompts(), MAX_TOKENS)
    llm = moe_kit.check_engine_greedy(
        folder, expected, MAX_TOKENS, variants={"chunked": CHUNKED})
    cfg = moe_kit.read_config(folder)
    latent = cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"]
    assert llm.stats().kv_bytes_per_token == latent * cfg["num_hidden_layers"] * 4


def test_fp8_block_checkpoint_matches_dequantized_reference(moe_kit, tmp_path):
    folder = bf16_checkpoint(moe_kit, tmp_path / "fp8")
    linear = ("_proj.weight", "kv_a_proj_with_mqa.weight")

    def should_quantize(name: str, t: torch.Tensor) -> bool:  # layer linears, not the router
        return name.startswith("model.layers.") and name.endswith(linear) and t.dim() == 2

    moe_kit.quantize_checkpoint(folder, tmp_path / "ref", moe_kit.fp8_quantize, should_quantize,
                                moe_kit.FP8_CONFIG)
    on_disk = load_file(str(folder / "model.safetensors"))
    assert on_disk["model.layers.0.mlp.gate_proj.weight"].dtype == torch.float8_e4m3fn
    assert on_disk["model.layers.0.mlp.gate_proj.weight_scale_inv"].shape == (2, 1)
    check_against_reference(moe_kit, folder, tmp_path / "ref")


def test_int4_pack_quantized_kimi_checkpoint_matches_dequantized_reference(moe_kit, tmp_path):
    folder = bf16_checkpoint(moe_kit, tmp_path / "int4")

    def should_quantize(name: str, t: torch.Tensor) -> bool:  # routed experts only, as Kimi
        return ".mlp.experts." in name and name.endswith("_proj.weight")

    moe_kit.quantize_checkpoint(folder, tmp_path / "ref", moe_kit.int4_quantize,
                                should_quantize, moe_kit.INT4_CONFIG, model_type="kimi_k2")
    on_disk = load_file(str(folder / "model.safetensors"))
    assert on_disk["model.layers.1.mlp.experts.0.down_proj.weight_packed"].dtype == torch.int32
    assert on_disk["model.layers.1.mlp.shared_experts.down_proj.weight"].dtype == torch.bfloat16
    check_against_reference(moe_kit, folder, tmp_path / "ref")
