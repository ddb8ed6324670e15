"""GGUF files of every supported tensor type load to the weights transformers sees."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from ember import LLM, SamplingParams
from ember.executor.checkpoint import default_model_path, open_checkpoint
from ember.executor.gguf_reader import GGUFFile


def permute_for_gguf(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's converter permutation of Q/K rows (the inverse of ember's unpermute)."""
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def write_llama_gguf(path: Path, hf_model, qtype_name: str, with_tokenizer: bool = True) -> None:
    """Write a transformers Llama as a llama-arch GGUF; 2-D weights in qtype_name.

    The tokenizer (the default model's) is optional: its 49k strings make every reader slow.
    """
    import gguf

    cfg = hf_model.config
    qtype = gguf.GGMLQuantizationType[qtype_name]
    tok = GGUFFile(default_model_path())
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_rope_freq_base(cfg.rope_theta if hasattr(cfg, "rope_theta") else 10000.0)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    if with_tokenizer:
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre(tok.get("tokenizer.ggml.pre"))
        writer.add_token_list(tok.get("tokenizer.ggml.tokens"))
        writer.add_token_types(tok.get("tokenizer.ggml.token_type"))
        writer.add_token_merges(tok.get("tokenizer.ggml.merges"))
    else:
        writer.add_vocab_size(cfg.vocab_size)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    names = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
             "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
             "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
    for name, tensor in hf_model.state_dict().items():
        data = tensor.float().numpy()
        if name == "model.embed_tokens.weight":
            gname = "token_embd.weight"
        elif name == "model.norm.weight":
            gname = "output_norm.weight"
        elif name == "lm_head.weight":
            gname = "output.weight"
        else:
            parts = name.split(".")
            gname = f"blk.{parts[2]}.{names['.'.join(parts[3:-1])]}.weight"
        if gname.endswith("attn_q.weight"):
            data = permute_for_gguf(data, cfg.num_attention_heads)
        elif gname.endswith("attn_k.weight"):
            data = permute_for_gguf(data, cfg.num_key_value_heads)
        if data.ndim == 2 and qtype_name != "F32":
            if qtype_name == "F16":
                writer.add_tensor(gname, data.astype(np.float16))
                continue
            raw = gguf.quants.quantize(data, qtype)
            writer.add_tensor(gname, raw, raw_shape=raw.shape, raw_dtype=qtype)
        else:
            writer.add_tensor(gname, data.astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module")
def hf_llama(tiny_llama_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), dtype=torch.float32)


@pytest.mark.parametrize("qtype", ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1"])
def test_each_tensor_type_loads_like_transformers(qtype, hf_llama, tmp_path):
    from transformers import AutoModelForCausalLM

    path = tmp_path / f"tiny-{qtype}.gguf"
    write_llama_gguf(path, hf_llama, qtype, with_tokenizer=False)
    ours = dict(open_checkpoint(str(path)).tensors())
    theirs = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=path.name,
                                                  dtype=torch.float32)
    for name, ref in theirs.state_dict().items():
        torch.testing.assert_close(ours[name], ref.float(), rtol=0, atol=1e-6, msg=name)
    # quantization error stays small against the original weights
    q_ref = hf_llama.state_dict()["model.layers.0.self_attn.q_proj.weight"]
    q = ours["model.layers.0.self_attn.q_proj.weight"]
    assert (q - q_ref).abs().max() < (0.02 if qtype.startswith("Q4") else 2e-3)


def test_f32_gguf_generates_exactly_like_the_original(hf_llama, tmp_path):
    path = tmp_path / "tiny-f32.gguf"
    write_llama_gguf(path, hf_llama, "F32")
    llm = LLM(str(path), dtype="float32", num_kv_blocks=64)
    prompt = list(range(100, 140))
    [out] = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    ref = hf_llama.generate(torch.tensor([prompt]), max_new_tokens=8, min_new_tokens=8,
                            do_sample=False)[0, len(prompt):].tolist()
    assert out.outputs[0].token_ids == ref
    assert llm.get_tokenizer().encode("hello world") == [28120, 905]


def test_default_model_metadata_reads_into_an_hf_config():
    config = open_checkpoint(None).hf_config
    assert config["model_type"] == "llama"
    assert (config["num_hidden_layers"], config["hidden_size"]) == (30, 576)
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (9, 3)
    assert config["tie_word_embeddings"] is True and config["vocab_size"] == 49152


def test_not_a_gguf_file_is_a_clear_error(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"NOPE" + bytes(64))
    with pytest.raises(ValueError, match="not a GGUF file"):
        open_checkpoint(str(bad))
    with pytest.raises(FileNotFoundError, match="never downloads"):
        open_checkpoint(str(tmp_path / "missing"))
