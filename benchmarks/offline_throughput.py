"""Offline throughput: ember against transformers' batched generate, same prompts, one run.

64 prompts cut from standard-library sources (mixed lengths), 128 output tokens each,
bf16, greedy, EOS ignored so both sides produce exactly the same number of tokens.
transformers runs the same dequantized weights as a plain LlamaForCausalLM in bf16 (the
comparison the engine issue asks for) and in fp32 (what ember computes in on a CPU without
native bf16 matmul, see executor/model_runner.compute_dtype).
Also reports ember's pure decode step time against the memory-bandwidth floor of the weights
(bytes of the weights as held / DRAM bandwidth) and the compute floor (FLOPs / GEMM peak).

    python benchmarks/offline_throughput.py [--num-prompts 64] [--output-len 128]
"""

from __future__ import annotations

import argparse
import inspect
import json
import sys
import time

import torch

from ember import LLM, SamplingParams
from ember.executor.checkpoint import open_checkpoint

DRAM_GBPS = 40.0  # the development machines' measured DRAM bandwidth


def gemm_peak_gflops(dtype: torch.dtype) -> float:
    """This machine's GEMM rate at a decode-sized shape (64 x 576 x 3072), as torch runs it."""
    x, w = torch.randn(64, 576, dtype=dtype), torch.randn(3072, 576, dtype=dtype)
    torch.nn.functional.linear(x, w)
    start = time.perf_counter()
    for _ in range(20):
        torch.nn.functional.linear(x, w)
    return 2 * 64 * 576 * 3072 * 20 / (time.perf_counter() - start) / 1e9


def make_prompts(tokenizer, n: int) -> list[list[int]]:
    import textwrap

    ids = tokenizer.encode(inspect.getsource(json.decoder) + inspect.getsource(textwrap))
    return [ids[(i * 37) % 1500:][:32 + (i * 13) % 96] for i in range(n)]


def run_ember(llm: LLM, prompts: list[list[int]], output_len: int) -> tuple[float, float]:
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=2))  # warm up
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return tokens / elapsed, elapsed


def decode_step_time(llm: LLM, prompts: list[list[int]], steps: int = 10) -> float:
    for p in prompts:
        llm.add_request(p, SamplingParams(temperature=0, max_tokens=steps + 2, ignore_eos=True))
    sched = llm.engine.scheduler
    while sched.waiting or any(r.num_output_tokens == 0 for r in sched.running):
        llm.step()
    start = time.perf_counter()
    for _ in range(steps):
        llm.step()
    elapsed = (time.perf_counter() - start) / steps
    while llm.has_unfinished():
        llm.step()
    return elapsed


def run_transformers(prompts: list[list[int]], output_len: int, pad_id: int,
                     dtype: torch.dtype) -> tuple[float, float]:
    from transformers import LlamaConfig, LlamaForCausalLM

    # the same dequantized weights as ember's, in a plain bf16 transformers model
    checkpoint = open_checkpoint(None)
    model = LlamaForCausalLM(LlamaConfig(**checkpoint.hf_config))
    model.load_state_dict(dict(checkpoint.tensors()), strict=False)  # lm_head is tied
    model = model.to(dtype).eval()
    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    attention = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):  # left padding, as decoder-only generation needs
        input_ids[i, width - len(p):] = torch.tensor(p)
        attention[i, width - len(p):] = 1
    kwargs = dict(max_new_tokens=output_len, min_new_tokens=output_len, do_sample=False,
                  pad_token_id=pad_id)
    with torch.inference_mode():
        model.generate(input_ids[:2, -8:], attention_mask=attention[:2, -8:],
                       **{**kwargs, "max_new_tokens": 2, "min_new_tokens": 2})
        start = time.perf_counter()
        out = model.generate(input_ids, attention_mask=attention, **kwargs)
        elapsed = time.perf_counter() - start
    tokens = (out.shape[1] - width) * len(prompts)
    return tokens / elapsed, elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--skip-transformers", action="store_true")
    args = parser.parse_args()
    print("command: python " + " ".join(sys.argv), f"(torch threads {torch.get_num_threads()})")

    llm = LLM(dtype="bfloat16", max_num_seqs=args.num_prompts, enable_prefix_caching=False)
    tokenizer = llm.get_tokenizer()
    prompts = make_prompts(tokenizer, args.num_prompts)
    ember_tps, ember_s = run_ember(llm, prompts, args.output_len)
    print(f"ember        {ember_tps:8.1f} output tok/s  ({ember_s:.1f} s)")
    step = decode_step_time(llm, prompts)
    runner = llm.engine.runner
    params = sum(p.numel() for p in runner.model.parameters())
    weight_bytes = params * runner.dtype.itemsize
    bandwidth_floor = weight_bytes / (DRAM_GBPS * 1e9)
    peak = gemm_peak_gflops(runner.dtype)
    compute_floor = 2 * params * args.num_prompts / (peak * 1e9)
    print(f"ember decode step at batch {args.num_prompts}: {step * 1e3:.1f} ms; weights "
          f"{weight_bytes / 1e6:.0f} MB {runner.dtype} -> bandwidth floor "
          f"{bandwidth_floor * 1e3:.1f} ms; {2 * params * args.num_prompts / 1e9:.1f} GFLOP at "
          f"{peak:.0f} GFLOP/s (torch GEMM here) -> compute floor {compute_floor * 1e3:.1f} ms "
          f"({step / max(bandwidth_floor, compute_floor):.1f}x the higher floor)")
    if not args.skip_transformers:
        del llm
        for dtype in (torch.bfloat16, torch.float32):
            hf_tps, hf_s = run_transformers(prompts, args.output_len,
                                            tokenizer.eos_token_id or 0, dtype)
            print(f"transformers {str(dtype):15} {hf_tps:8.1f} output tok/s  ({hf_s:.1f} s); "
                  f"ember / transformers: {ember_tps / hf_tps:.2f}x")


if __name__ == "__main__":
    main()
