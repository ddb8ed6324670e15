"""Constrained decoding: grammar matchers that mask disallowed tokens before sampling.

Built on llguidance, chosen by measurement over xgrammar and outlines-core
(benchmarks/grammar_backends.py). One matcher per constrained request follows the tokens it
samples; compiled grammars are cached by spec, and a new request's matcher is a cheap copy of
the cached one. The end-of-sequence tokens are allowed exactly when the grammar is complete, and
are the only tokens allowed once nothing can extend it, so the grammar's end ends the request.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import torch

from ember.core.sampling_params import StructuredOutputSpec

logger = logging.getLogger(__name__)

GRAMMAR_CACHE_SIZE = 128


class StructuredOutputManager:
    def __init__(self, hf_tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int],
                 grammar_cache_size: int = GRAMMAR_CACHE_SIZE) -> None:
        import llguidance.hf

        if not eos_token_ids:
            raise ValueError("eos_token_ids: structured output needs at least one EOS token")
        self.vocab_size = vocab_size
        self._tokenizer = llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=vocab_size,
                                                       eos_token=list(eos_token_ids))
        self._cache_size = grammar_cache_size
        self._compiled: OrderedDict[StructuredOutputSpec, Any] = OrderedDict()
        self._matchers: dict[str, Any] = {}
        self._words = (vocab_size + 31) // 32
        eos_bits = np.zeros(self._words * 32, dtype=np.uint8)
        eos_bits[[t for t in eos_token_ids if t < vocab_size]] = 1
        self._eos_only = np.packbits(eos_bits, bitorder="little").view(np.int32)

    @property
    def num_matchers(self) -> int:
        return len(self._matchers)

    def _compiled_matcher(self, spec: StructuredOutputSpec) -> Any:
        from llguidance import LLMatcher

        matcher = self._compiled.get(spec)
        if matcher is None:
            matcher = LLMatcher(self._tokenizer, spec.grammar())
            if matcher.is_error():
                logger.warning("structured output: grammar failed to compile: %s",
                               matcher.get_error())
            self._compiled[spec] = matcher
            if len(self._compiled) > self._cache_size:
                self._compiled.popitem(last=False)
        else:
            self._compiled.move_to_end(spec)
        return matcher

    def matcher(self, request_id: str, spec: StructuredOutputSpec) -> Any:
        matcher = self._matchers.get(request_id)
        if matcher is None:
            matcher = self._compiled_matcher(spec).deep_copy()
            self._matchers[request_id] = matcher
        return matcher

    def mask_logits(self, logits: torch.Tensor,
                    rows: Sequence[tuple[int, str, StructuredOutputSpec]]) -> None:
        """Set to -inf, in place, every token the grammar forbids; rows: (row, request, spec).

        The masks are built and, for CPU logits, applied with numpy: small multi-threaded
        torch ops stall for milliseconds when the cores are busy, numpy's do not.
        """
        import llguidance.numpy as llg_numpy

        bitmask = np.empty((len(rows), self._words), dtype=np.int32)
        for i, (_, request_id, spec) in enumerate(rows):
            matcher = self.matcher(request_id, spec)
            if matcher.is_error() or matcher.is_stopped():
                bitmask[i] = self._eos_only
            else:
                llg_numpy.fill_next_token_bitmask(matcher, bitmask, i)
        width = logits.shape[-1]
        forbidden = np.unpackbits(bitmask.view(np.uint8), axis=-1, bitorder="little")[:, :width]
        forbidden = forbidden == 0
        if logits.device.type == "cpu" and logits.dtype == torch.float32:
            view = logits.numpy()
            for i, (row, _, _) in enumerate(rows):
                view[row][forbidden[i]] = -np.inf
        else:
            index = torch.tensor([row for row, _, _ in rows], device=logits.device)
            mask = torch.from_numpy(forbidden).to(logits.device)
            logits[index] = logits[index].masked_fill(mask, float("-inf"))

    def accept(self, request_id: str, token_id: int) -> None:
        """Advance the request's matcher past a sampled token."""
        matcher = self._matchers.get(request_id)
        if matcher is None or matcher.is_stopped() or matcher.is_error():
            return
        if not matcher.consume_token(token_id):
            logger.warning("structured output: request %s: token %d rejected: %s",
                           request_id, token_id, matcher.get_error())

    def free(self, request_ids: Iterable[str]) -> None:
        for request_id in request_ids:
            self._matchers.pop(request_id, None)
