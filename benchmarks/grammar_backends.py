"""Grammar libraries for structured output, measured on the default model's 49k vocabulary.

For xgrammar, llguidance and outlines-core: the one-time tokenizer preparation, the compile
time of `json_object` and of a 7-property JSON schema, and the time to compute each token's
mask while walking a valid 71-token instance. Then ember's own path (StructuredOutputManager:
mask computed, unpacked and applied to a logits row, token accepted) per token.

Only llguidance is a dependency of ember; install the others beside it to compare:
    pip install --target /tmp/gram --no-deps xgrammar apache-tvm-ffi outlines-core
    PYTHONPATH=/tmp/gram python benchmarks/grammar_backends.py
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from ember.core.sampling_params import StructuredOutputSpec
from ember.engine.tokenizer import load_tokenizer
from ember.executor.checkpoint import open_checkpoint
from ember.executor.structured_output import StructuredOutputManager

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "email": {"type": "string"},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
        "address": {"type": "object", "properties": {
            "city": {"type": "string"}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["city", "zip"], "additionalProperties": False},
        "role": {"enum": ["admin", "user", "guest"]},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "email", "tags", "address", "role", "active"],
    "additionalProperties": False,
}
INSTANCE = {"name": "Ada Lovelace", "age": 36, "email": "ada@example.org",
            "tags": ["math", "engines", "poetry"], "address": {"city": "London", "zip": "12345"},
            "role": "admin", "active": True}


def timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    start = time.perf_counter()
    result = fn()
    return result, (time.perf_counter() - start) * 1e3


def row(name: str, prep_ms: float, json_ms: float, schema_ms: float,
        mask_ms: list[float]) -> None:
    mask_ms = sorted(mask_ms)
    print(f"| {name} | {prep_ms:.0f} | {json_ms:.1f} | {schema_ms:.1f} | "
          f"{statistics.median(mask_ms):.3f} | {mask_ms[int(len(mask_ms) * 0.9)]:.3f} | "
          f"{mask_ms[-1]:.2f} |")


def bench_xgrammar(hf: Any, vocab: int, eos: int, ids: list[int]) -> None:
    import xgrammar as xgr

    info, prep = timed(lambda: xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab))
    compiler = xgr.GrammarCompiler(info, max_threads=1)
    _, json_ms = timed(compiler.compile_builtin_json_grammar)
    grammar, schema_ms = timed(lambda: compiler.compile_json_schema(json.dumps(SCHEMA)))
    matcher = xgr.GrammarMatcher(grammar)
    bitmask = xgr.allocate_token_bitmask(1, vocab)
    times = []
    for token in ids + [eos]:
        _, ms = timed(lambda: matcher.fill_next_token_bitmask(bitmask))
        times.append(ms)
        matcher.accept_token(token)
    row("xgrammar", prep, json_ms, schema_ms, times)


def bench_llguidance(hf: Any, vocab: int, eos: int, ids: list[int]) -> None:
    import llguidance
    import llguidance.hf
    import llguidance.numpy

    tok, prep = timed(lambda: llguidance.hf.from_tokenizer(hf, n_vocab=vocab, eos_token=eos))
    compile_ = llguidance.LLMatcher.grammar_from_json_schema
    # llguidance compiles lazily: the first mask is part of the compile
    bitmask = llguidance.numpy.allocate_token_bitmask(1, vocab)

    def compiled(schema: Any) -> Any:
        matcher = llguidance.LLMatcher(tok, compile_(schema))
        llguidance.numpy.fill_next_token_bitmask(matcher, bitmask)
        return matcher

    _, json_ms = timed(lambda: compiled({"type": "object"}))
    matcher, schema_ms = timed(lambda: compiled(SCHEMA))
    times = []
    for i, token in enumerate(ids + [eos]):
        if i:
            _, ms = timed(lambda: llguidance.numpy.fill_next_token_bitmask(matcher, bitmask))
            times.append(ms)
        matcher.consume_token(token)
    row("llguidance", prep, json_ms, schema_ms, times)


def bench_outlines(hf: Any, vocab: int, eos: int, ids: list[int]) -> None:
    import outlines_core as oc

    # GPT-2 byte-level token text back to bytes
    byte_values = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    chars, extra = list(byte_values), 0
    for b in range(256):
        if b not in byte_values:
            byte_values.append(b)
            chars.append(256 + extra)
            extra += 1
    to_byte = {chr(c): b for b, c in zip(byte_values, chars, strict=True)}

    def vocabulary() -> Any:
        tokens: dict[bytes, list[int]] = {}
        special = set(hf.all_special_ids)
        for text, idx in hf.get_vocab().items():
            if idx not in special:
                tokens.setdefault(bytes(to_byte[c] for c in text), []).append(idx)
        return oc.Vocabulary(eos, tokens)

    voc, prep = timed(vocabulary)
    regex = oc.json_schema.build_regex_from_schema
    _, json_ms = timed(lambda: oc.Index(regex('{"type": "object"}'), voc))
    index, schema_ms = timed(lambda: oc.Index(regex(json.dumps(SCHEMA)), voc))
    guide = oc.Guide(index)
    mask = torch.zeros((vocab + 31) // 32, dtype=torch.int32)
    times = []
    for token in ids:
        _, ms = timed(lambda: guide.write_mask_into(mask.data_ptr(), mask.numel(), 4))
        times.append(ms)
        guide.advance(token)
    row("outlines-core", prep, json_ms, schema_ms, times)


def bench_ember(hf: Any, vocab: int, eos: int, ids: list[int]) -> None:
    manager, prep = timed(lambda: StructuredOutputManager(hf, vocab, [eos]))
    spec = StructuredOutputSpec("json_schema", json.dumps(SCHEMA))
    logits = torch.zeros(1, vocab)
    _, first = timed(lambda: manager.mask_logits(logits, [(0, "r", spec)]))
    manager.accept("r", ids[0])
    times = []
    for token in ids[1:] + [eos]:
        _, ms = timed(lambda: manager.mask_logits(logits, [(0, "r", spec)]))
        _, accept_ms = timed(lambda t=token: manager.accept("r", t))
        times.append(ms + accept_ms)
    row("ember (llguidance + numpy apply + accept)", prep, float("nan"), first, times)


def main() -> None:
    torch.set_num_threads(1)
    tokenizer = load_tokenizer(open_checkpoint(None))
    hf, vocab, eos = tokenizer.hf, len(tokenizer.hf), tokenizer.eos_token_id
    ids = hf.encode(json.dumps(INSTANCE), add_special_tokens=False)
    print(f"vocabulary {vocab}, instance {len(ids)} tokens\n")
    print("| library | tokenizer prep ms | compile json_object ms | compile schema ms | "
          "mask median ms | mask p90 ms | mask max ms |")
    print("|---|---|---|---|---|---|---|")
    for bench in (bench_xgrammar, bench_llguidance, bench_outlines, bench_ember):
        try:
            bench(hf, vocab, eos, ids)
        except ImportError as e:
            print(f"| {bench.__name__.removeprefix('bench_')} | not installed ({e.name}) |")


if __name__ == "__main__":
    main()
