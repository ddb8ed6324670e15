"""Turns a step's logits into next tokens: penalties, temperature, top-k/top-p/min-p, seeds.

Sampling uses the exponential-race form of categorical sampling (argmax of p / E with
E ~ Exp(1)), so each seeded request draws its noise from its own generator and its tokens do
not depend on what else is in the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ember.core.sampling_params import SamplingParams


@dataclass
class SamplingRow:
    params: SamplingParams
    generator: torch.Generator | None  # set for seeded requests
    prompt_token_ids: list[int]  # filled only when the request has penalties
    output_token_ids: list[int]


@dataclass
class SamplerOutput:
    token_ids: list[int]
    # per row: (logprob of the chosen token, top-N {token: logprob}) when logprobs were asked
    logprobs: list[tuple[float, dict[int, float]] | None]


def apply_penalties(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    for i, row in enumerate(rows):
        p = row.params
        if not p.has_penalties:
            continue
        vocab = logits.shape[1]
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(row.prompt_token_ids + row.output_token_ids)),
                                dtype=torch.long)
            seen = seen[seen < vocab]
            vals = logits[i, seen]
            logits[i, seen] = torch.where(vals > 0, vals / p.repetition_penalty,
                                          vals * p.repetition_penalty)
        if row.output_token_ids and (p.frequency_penalty or p.presence_penalty):
            out = torch.tensor(row.output_token_ids, dtype=torch.long)
            counts = torch.bincount(out[out < vocab], minlength=vocab).to(logits.dtype)
            logits[i] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0)


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """Mask (to -inf) tokens outside top-k, the top-p nucleus and below min_p * max prob."""
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = sorted_logits.softmax(-1)
        cum = probs.cumsum(-1)
        drop_sorted = cum - probs > top_p  # keep the first token that crosses top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    if min_p > 0.0:
        probs = logits.softmax(-1)
        limit = probs.max(-1, keepdim=True).values * min_p
        logits = logits.masked_fill(probs < limit, float("-inf"))
    return logits


def sample(logits: torch.Tensor, rows: list[SamplingRow],
           generator: torch.Generator | None = None) -> SamplerOutput:
    """logits [N, V] float32, one row per request that needs a token this step."""
    apply_penalties(logits, rows)
    want_logprobs = [r.params.logprobs is not None for r in rows]
    logprobs_all = logits.log_softmax(-1) if any(want_logprobs) else None
    tokens = logits.argmax(-1)
    for i, row in enumerate(rows):
        p = row.params
        if p.greedy:
            continue
        row_logits = filter_logits(logits[i] / p.temperature, p.top_k, p.top_p, p.min_p)
        probs = row_logits.softmax(-1)
        noise = torch.empty_like(probs).exponential_(generator=row.generator or generator)
        tokens[i] = (probs / noise).argmax()
    token_list = tokens.tolist()
    logprobs: list[tuple[float, dict[int, float]] | None] = []
    for i, row in enumerate(rows):
        if logprobs_all is None or row.params.logprobs is None:
            logprobs.append(None)
            continue
        lp = logprobs_all[i]
        top: dict[int, float] = {}
        if row.params.logprobs > 0:
            values, ids = lp.topk(row.params.logprobs)
            top = dict(zip(ids.tolist(), values.tolist(), strict=True))
        logprobs.append((float(lp[token_list[i]]), top))
    return SamplerOutput(token_list, logprobs)
