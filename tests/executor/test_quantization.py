"""Dequantization of block-FP8 and compressed-tensors INT4 pack-quantized weights against
block-by-block / bit-by-bit references, the buffering stream wrapper and config parsing.
(Whole quantized checkpoints through the engine: tests/models/test_deepseek_v3.py.)"""

from __future__ import annotations

import logging

import pytest
import torch

from ember.executor.quantization import (
    QuantConfig,
    dequantize_checkpoint,
    dequantize_fp8_block,
    dequantize_packed,
    unpack_int32,
)

FP8 = {"quantization_config": {"quant_method": "fp8", "fmt": "e4m3",
                               "activation_scheme": "dynamic", "weight_block_size": [128, 128]}}
INT4_WEIGHTS = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
                "group_size": 32, "observer_kwargs": {}}
INT4 = {"quant_method": "compressed-tensors", "format": "pack-quantized",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": INT4_WEIGHTS}}}


def random_fp8(rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random float8 weight and per-128-block scales spanning several orders of magnitude."""
    q = (torch.randn(rows, cols) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    scales = torch.logspace(-4, 0, ((rows + 127) // 128) * ((cols + 127) // 128))
    return q, scales.view((rows + 127) // 128, (cols + 127) // 128)


def fp8_reference(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    out = torch.empty(q.shape)
    for r in range(q.shape[0]):
        for c in range(0, q.shape[1], 128):
            out[r, c:c + 128] = q[r, c:c + 128].float() * scales[r // 128, c // 128]
    return out


def pack_bits(values: list[list[int]]) -> torch.Tensor:
    """Bit by bit: signed 4-bit value k of each group of eight goes to bits 4k..4k+3 of one
    word, stored with an offset of 8; a partial last word is zero-padded."""
    words = []
    for row in values:
        row_words = []
        for start in range(0, len(row), 8):
            word = 0
            for k, v in enumerate(row[start:start + 8]):
                word |= (v + 8) << (4 * k)
            row_words.append(word - (1 << 32) if word >= 1 << 31 else word)  # as int32
        words.append(row_words)
    return torch.tensor(words, dtype=torch.int32)


def test_fp8_block_dequant_ragged_blocks():
    torch.manual_seed(0)
    q, scales = random_fp8(200, 300)  # 2 x 3 blocks, the last ones partial
    assert torch.equal(dequantize_fp8_block(q, scales), fp8_reference(q, scales))
    with pytest.raises(ValueError, match="weight_scale_inv"):
        dequantize_fp8_block(q, scales.t())


def test_int4_unpack_and_group_dequant():
    torch.manual_seed(1)
    values = torch.randint(-8, 8, (5, 70), dtype=torch.int8)  # 70 is not a whole word count
    packed = pack_bits(values.tolist())
    assert packed.shape == (5, 9)
    assert torch.equal(unpack_int32(packed, 4, 70), values)

    values = torch.randint(-8, 8, (6, 96), dtype=torch.int8)
    scale = torch.rand(6, 3).to(torch.bfloat16)
    got = dequantize_packed(pack_bits(values.tolist()), scale, torch.tensor([6, 96]))
    expected = torch.tensor([[values[r, c].item() * scale[r, c // 32].float().item()
                              for c in range(96)] for r in range(6)])
    assert torch.equal(got, expected)
    with pytest.raises(ValueError, match="weight_scale"):
        dequantize_packed(pack_bits(values.tolist()), scale[:, :2], torch.tensor([6, 96]))


def test_stream_buffers_parts_in_any_order_and_passes_others_through(caplog):
    torch.manual_seed(2)
    q1, s1 = random_fp8(130, 64)
    q2, s2 = random_fp8(64, 64)
    norm = torch.randn(64)
    bf16 = torch.randn(8, 64).bfloat16()  # an unquantized linear (e.g. the router)
    stream = [("a.q_proj.weight_scale_inv", s1), ("norm.weight", norm),
              ("b.o_proj.weight", q2), ("gate.weight", bf16), ("a.q_proj.weight", q1),
              ("b.o_proj.weight_scale_inv", s2)]
    with caplog.at_level(logging.INFO, logger="ember.executor.quantization"):
        out = list(dequantize_checkpoint(stream, QuantConfig.from_hf(FP8)))
    assert [n for n, _ in out] == ["norm.weight", "gate.weight", "a.q_proj.weight",
                                   "b.o_proj.weight"]
    got = dict(out)
    assert got["norm.weight"] is norm and got["gate.weight"] is bf16
    assert torch.equal(got["a.q_proj.weight"], fp8_reference(q1, s1))
    assert torch.equal(got["b.o_proj.weight"], fp8_reference(q2, s2))
    assert any("dequantized 2" in r.getMessage() for r in caplog.records)

    with pytest.raises(ValueError, match="'b.o_proj'"):
        list(dequantize_checkpoint(stream[:-1], QuantConfig.from_hf(FP8)))


def test_packed_stream_yields_weight_in_requested_dtype():
    values = torch.randint(-8, 8, (4, 32), dtype=torch.int8)
    stream = [("e.up_proj.weight_shape", torch.tensor([4, 32])),
              ("e.up_proj.weight_packed", pack_bits(values.tolist())),
              ("e.up_proj.weight_scale", torch.ones(4, 1, dtype=torch.bfloat16))]
    out = dict(dequantize_checkpoint(stream, QuantConfig.from_hf({"quantization_config": INT4}),
                                     dtype=torch.bfloat16))
    assert out["e.up_proj.weight"].dtype == torch.bfloat16
    assert torch.equal(out["e.up_proj.weight"], values.to(torch.bfloat16))


def test_quant_config_parsing():
    assert QuantConfig.from_hf({}) is None
    assert QuantConfig.from_hf(FP8).block_size == (128, 128)
    int4 = QuantConfig.from_hf({"text_config": {"quantization_config": INT4}})
    assert (int4.method, int4.num_bits, int4.group_size) == ("pack_quantized", 4, 32)
    bad = [({**FP8["quantization_config"], "weight_block_size": None}, "weight_block_size"),
           ({"quant_method": "gptq"}, "quant_method"),
           ({**INT4, "format": "float-quantized"}, "format"),
           ({**INT4, "config_groups": {"g": {"weights": {**INT4_WEIGHTS, "symmetric": False}}}},
            "symmetric")]
    for q, field in bad:
        with pytest.raises(ValueError, match=field):
            QuantConfig.from_hf({"quantization_config": q})
