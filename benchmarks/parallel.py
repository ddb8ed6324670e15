"""Tensor and expert parallelism against one process on the same tiny MoE model (GLM-4 MoE
shape: GQA attention, 32 routed experts + a shared one), offline, greedy.

    python benchmarks/parallel.py                    # fp32, 8 prompts x 64 tokens, 32 out
    python benchmarks/parallel.py --prompts 16 --output-tokens 64 --threads 1

For each configuration it prints the best wall time of --repeat runs, output tokens per
second, each rank's resident parameter MB and, for that run, the communication share of step
time: seconds inside torch.distributed collectives (waiting for peers included) over seconds
inside the workers' execute(), summed over the ranks. Workers run with --threads
torch threads each; one process runs with --threads and with tp x threads, so both sides use
the same cores.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

CONFIGS = [  # (label, tensor_parallel_size, expert_parallel_size, data_parallel_size)
    ("TP=2", 2, 1, 1),
    ("TP=2, EP=2", 2, 2, 1),
    ("DP=2, EP=2", 1, 2, 2),
]


def build_model(folder: Path, hidden: int) -> None:
    from transformers import Glm4MoeConfig, Glm4MoeForCausalLM

    config = Glm4MoeConfig(vocab_size=4096, hidden_size=hidden, intermediate_size=2 * hidden,
                           moe_intermediate_size=hidden // 2, num_hidden_layers=4,
                           num_attention_heads=hidden // 32, num_key_value_heads=4, head_dim=32,
                           n_shared_experts=1, n_routed_experts=32, num_experts_per_tok=4,
                           n_group=1, topk_group=1, first_k_dense_replace=1,
                           max_position_embeddings=1024, bos_token_id=0, eos_token_id=1)
    torch.manual_seed(0)
    Glm4MoeForCausalLM(config).float().save_pretrained(str(folder))
    write_tokenizer(folder, 4096)


def write_tokenizer(folder: Path, vocab_size: int) -> None:
    """A word-level tokenizer ("t0".."tN"): nothing to download, loads in milliseconds."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t2"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="t0", eos_token="t1",
                            unk_token="t2").save_pretrained(str(folder))


def run(model: Path, args: argparse.Namespace, threads: int, tp: int = 1, ep: int = 1,
        dp: int = 1) -> dict:
    from ember import LLM, SamplingParams

    os.environ["EMBER_NUM_THREADS"] = str(threads)
    torch.set_num_threads(threads)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(2, 4096, (args.prompt_tokens,), generator=gen).tolist()
               for _ in range(args.prompts)]
    llm = LLM(str(model), dtype=args.dtype, num_kv_blocks=256, tensor_parallel_size=tp,
              expert_parallel_size=ep, data_parallel_size=dp)
    params = SamplingParams(temperature=0, max_tokens=args.output_tokens, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=2))  # warm up
    runner, engine = llm.engine.runner, llm.engine
    best: dict = {}
    for _ in range(args.repeat):
        before = dict(runner.step_stats) if tp * dp > 1 else {}
        steps_before, step_time_before = engine.num_steps, engine.step_time_s
        start = time.perf_counter()
        outputs = llm.generate(prompts, params)
        wall = time.perf_counter() - start
        if best and wall >= best["wall"]:
            continue
        steps = engine.num_steps - steps_before
        best = {"wall": wall, "tokens": [o.outputs[0].token_ids for o in outputs],
                "tok_s": sum(len(o.outputs[0].token_ids) for o in outputs) / wall,
                "wall_ms": 1e3 * wall / steps}
        if tp * dp == 1:
            best["param_mb"], best["comm_share"] = [runner.param_bytes / 1e6], 0.0
            best["execute_ms"] = 1e3 * (engine.step_time_s - step_time_before) / steps
        else:
            stats = runner.step_stats.items()
            step = sum(s.step_seconds - before[r].step_seconds for r, s in stats)
            comm = sum(s.comm_seconds - before[r].comm_seconds for r, s in stats)
            best["param_mb"] = [runner.ready[r].param_bytes / 1e6 for r in sorted(runner.ready)]
            best["comm_share"] = comm / step
            best["execute_ms"] = 1e3 * step / len(runner.step_stats) / steps
    llm.shutdown()
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--output-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--hidden-size", type=int, default=256,
                        help="model width (heads, experts' and MLP widths scale with it)")
    parser.add_argument("--repeat", type=int, default=3, help="runs per configuration (best)")
    args = parser.parse_args()
    print("$ python " + " ".join(sys.argv))
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp)
        build_model(model, args.hidden_size)
        rows = [("one process", args.threads, run(model, args, args.threads)),
                ("one process", 2 * args.threads, run(model, args, 2 * args.threads))]
        for label, tp, ep, dp in CONFIGS:
            rows.append((label, args.threads, run(model, args, args.threads, tp, ep, dp)))
    reference = rows[0][2]["tokens"]
    print(f"\nhidden {args.hidden_size}; {args.prompts} prompts x {args.prompt_tokens} tokens, "
          f"{args.output_tokens} output tokens each, {args.dtype}\n")
    print("| configuration | threads per process | wall s | output tok/s | ms per step: wall / "
          "in execute | comm share of execute | params per rank (MB) | same tokens |")
    print("|---|---|---|---|---|---|---|---|")
    for label, threads, r in rows:
        mb = " / ".join(f"{m:.1f}" for m in r["param_mb"])
        print(f"| {label} | {threads} | {r['wall']:.2f} | {r['tok_s']:.0f} | "
              f"{r['wall_ms']:.1f} / {r['execute_ms']:.1f} | {100 * r['comm_share']:.0f}% | "
              f"{mb} | {r['tokens'] == reference} |")


if __name__ == "__main__":
    main()
