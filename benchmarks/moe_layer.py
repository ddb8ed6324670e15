"""Time one MoE layer forward: ember's SparseMoeBlock against a per-expert loop and against
transformers' DeepseekV3MoE (its eager, grouped_mm and batched_mm expert implementations), all
holding the same weights, on the same inputs, in the same run.

    python benchmarks/moe_layer.py                       # tiny test model, fp32
    python benchmarks/moe_layer.py --preset small --dtype bfloat16 --tokens 1 32 256

Prints the command, the shapes and, per token count, the median milliseconds per forward of
each implementation (rounds interleave the implementations, so machine load hits all alike)
and its max abs difference from transformers' eager output over that output's max abs value.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from ember.layers.moe import MoEConfig, SparseMoeBlock

PRESETS = {
    # the tests' tiny DeepSeek-V3 / Kimi K2 shape
    "tiny": dict(hidden_size=64, moe_intermediate_size=32, n_routed_experts=16,
                 num_experts_per_tok=4, n_group=4, topk_group=2, n_shared_experts=1),
    # Kimi K2's routing (384 experts, top-8, one group) at a width a laptop holds
    "small": dict(hidden_size=1024, moe_intermediate_size=256, n_routed_experts=384,
                  num_experts_per_tok=8, n_group=1, topk_group=1, n_shared_experts=1),
}


def per_expert_loop(block: SparseMoeBlock) -> Callable[[torch.Tensor], torch.Tensor]:
    """The textbook formulation: for every expert, find its tokens, run it, scatter back."""
    experts = block.experts

    def forward(x: torch.Tensor) -> torch.Tensor:
        weights, ids = block.gate(x)
        out = torch.zeros_like(x)
        for e in range(experts.num_experts):
            token, slot = torch.where(ids == e)
            gate, up = F.linear(x[token], experts.gate_up_proj[e]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, experts.down_proj[e])
            out.index_add_(0, token, y * weights[token, slot, None].to(x.dtype))
        return out + block.shared_experts(x)

    return forward


def build(preset: str, dtype: torch.dtype) -> tuple[dict[str, Callable], int]:
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

    cfg = DeepseekV3Config(routed_scaling_factor=2.5, norm_topk_prob=True, **PRESETS[preset])
    torch.manual_seed(0)
    ref = DeepseekV3MoE(cfg)
    with torch.no_grad():
        for p in ref.parameters():
            p.normal_(0, 0.05)
        ref.gate.e_score_correction_bias.normal_(0, 0.05)
    ref = ref.to(dtype).eval()
    ref.gate.float()  # transformers keeps the router in fp32
    block = SparseMoeBlock(MoEConfig.from_hf(cfg.to_dict(), scoring_func="sigmoid",
                                             topk_method="noaux_tc", correction_bias=True,
                                             norm_topk_prob=True)).to(dtype).eval()
    for name, t in list(ref.named_parameters()) + list(ref.named_buffers()):
        block.load(name, t)

    def hf(impl: str) -> Callable[[torch.Tensor], torch.Tensor]:
        def forward(x: torch.Tensor) -> torch.Tensor:
            cfg._experts_implementation = impl
            return ref(x.unsqueeze(0)).squeeze(0)
        return forward

    def ember(use_grouped_mm: bool) -> Callable[[torch.Tensor], torch.Tensor]:
        def forward(x: torch.Tensor) -> torch.Tensor:
            weights, ids = block.gate(x)
            out, _ = block.experts(x, weights, ids, use_grouped_mm=use_grouped_mm)
            return out + block.shared_experts(x)
        return forward

    impls = {
        "ember SparseMoeBlock (its policy)": block,
        "ember, grouped_mm always": ember(True),
        "ember, loop over non-empty experts": ember(False),
        "per-expert loop (all experts)": per_expert_loop(block),
        "transformers eager": hf("eager"),
        "transformers grouped_mm": hf("grouped_mm"),
        "transformers batched_mm": hf("batched_mm"),
    }
    return impls, cfg.hidden_size


def time_all(impls: dict[str, Callable], x: torch.Tensor, rounds: int,
             min_seconds: float) -> dict[str, float]:
    """Median ms per forward over `rounds` interleaved rounds of >= min_seconds each."""
    samples: dict[str, list[float]] = {name: [] for name in impls}
    for fn in impls.values():  # warm up
        fn(x)
    for _ in range(rounds):
        for name, fn in impls.items():
            fn(x)  # untimed: recover from whatever the previous implementation left in caches
            n, start = 0, time.perf_counter()
            while True:
                fn(x)
                n += 1
                elapsed = time.perf_counter() - start
                if elapsed >= min_seconds:
                    break
            samples[name].append(elapsed / n * 1e3)
    return {name: statistics.median(v) for name, v in samples.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 128, 512])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--min-seconds", type=float, default=0.2)
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads (default: torch's choice)")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    if args.threads:
        torch.set_num_threads(args.threads)

    print("$ python " + " ".join(sys.argv))
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.dtype}, "
          f"preset {args.preset}: {PRESETS[args.preset]}")
    with torch.inference_mode():
        impls, hidden = build(args.preset, dtype)
        for tokens in args.tokens:
            x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(tokens))
            x = x.to(dtype)
            reference = impls["transformers eager"](x).float()
            scale = reference.abs().max().item()
            diffs = {name: (fn(x).float() - reference).abs().max().item() / scale
                     for name, fn in impls.items()}
            times = time_all(impls, x, args.rounds, args.min_seconds)
            base = times["transformers eager"]
            print(f"\ntokens={tokens}")
            print(f"  {'implementation':40s} {'ms/forward':>11s} {'vs HF eager':>12s} "
                  f"{'rel. diff':>10s}")
            for name, ms in times.items():
                print(f"  {name:40s} {ms:11.3f} {base / ms:11.2f}x {diffs[name]:10.2e}")


if __name__ == "__main__":
    main()
