"""Frontend side of the engine: text, stop strings and n > 1 fan-out over core token outputs.

A request with n completions becomes n core requests ("id#i", seed + i when seeded); their
outputs are gathered back under the parent id.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from ember.core.sampling_params import SamplingParams
from ember.engine.detokenizer import IncrementalDetokenizer
from ember.engine.engine_core import EngineCoreOutput
from ember.engine.outputs import CompletionOutput, RequestOutput, TokenLogprob
from ember.engine.tokenizer import Tokenizer


@dataclass
class _Completion:
    index: int
    detokenizer: IncrementalDetokenizer
    text: str = ""  # everything decoded so far (may run past a stop string)
    sent: int = 0  # characters of text already handed out
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class _Parent:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    completions: dict[str, _Completion]
    num_cached_tokens: int = 0


def child_request_id(request_id: str, index: int, n: int) -> str:
    return request_id if n == 1 else f"{request_id}#{index}"


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._parents: dict[str, _Parent] = {}
        self._child_to_parent: dict[str, str] = {}

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    prompt: str | None = None) -> list[tuple[str, SamplingParams]]:
        """Register a request; return the (core request id, params) pairs to submit."""
        if request_id in self._parents:
            raise ValueError(f"request_id {request_id!r} is already in use")
        children = []
        completions = {}
        for i in range(params.n):
            child_id = child_request_id(request_id, i, params.n)
            child_params = params if params.n == 1 else replace(
                params, n=1, seed=None if params.seed is None else params.seed + i)
            children.append((child_id, child_params))
            completions[child_id] = _Completion(i, IncrementalDetokenizer(
                self.tokenizer, prompt_token_ids, params.skip_special_tokens))
            self._child_to_parent[child_id] = request_id
        self._parents[request_id] = _Parent(request_id, prompt, list(prompt_token_ids), params,
                                            completions)
        return children

    def child_ids(self, request_id: str) -> list[str]:
        parent = self._parents.get(request_id)
        return list(parent.completions) if parent else []

    def has_request(self, request_id: str) -> bool:
        return request_id in self._parents

    def process(self, core_outputs: list[EngineCoreOutput]
                ) -> tuple[list[RequestOutput], list[str]]:
        """Fold a step's core outputs in; return parent outputs and core ids to stop early."""
        touched: dict[str, set[str]] = {}
        to_abort: list[str] = []
        for out in core_outputs:
            parent_id = self._child_to_parent.get(out.request_id)
            if parent_id is None:
                continue
            parent = self._parents[parent_id]
            parent.num_cached_tokens = max(parent.num_cached_tokens, out.num_cached_tokens)
            comp = parent.completions[out.request_id]
            if comp.finish_reason is not None:
                continue
            self._append(parent.params, comp, out)
            if comp.finish_reason is not None and out.finish_reason is None:
                to_abort.append(out.request_id)  # stopped by a stop string
            touched.setdefault(parent_id, set()).add(out.request_id)
        results = [self._emit(self._parents[pid], changed) for pid, changed in touched.items()]
        return results, to_abort

    def abort(self, request_id: str) -> RequestOutput | None:
        """Finish every open completion of a request as aborted; return its last output."""
        parent = self._parents.get(request_id)
        if parent is None:
            return None
        changed = set()
        for child_id, comp in parent.completions.items():
            if comp.finish_reason is None:
                comp.finish_reason = "abort"
                changed.add(child_id)
        return self._emit(parent, changed)

    def _append(self, params: SamplingParams, comp: _Completion, out: EngineCoreOutput) -> None:
        for i, token in enumerate(out.new_token_ids):
            comp.token_ids.append(token)
            if i < len(out.new_logprobs):
                lp, top = out.new_logprobs[i]
                comp.logprobs.append(TokenLogprob(token, lp, top))
            hide = (out.finish_reason == "stop" and out.stop_reason is None
                    and not params.ignore_eos) or token in params.stop_token_ids
            if not hide or params.include_stop_str_in_output:
                comp.text += comp.detokenizer.add(token)
        if params.stop and self._apply_stop_strings(params, comp):
            return
        if out.finish_reason is not None:
            comp.finish_reason = out.finish_reason
            comp.stop_reason = out.stop_reason

    def _apply_stop_strings(self, params: SamplingParams, comp: _Completion) -> bool:
        longest = max(len(s) for s in params.stop)
        search_from = max(0, comp.sent - longest + 1)
        best: tuple[int, str] | None = None
        for stop in params.stop:
            idx = comp.text.find(stop, search_from)
            if idx != -1 and (best is None or idx < best[0]):
                best = (idx, stop)
        if best is None:
            return False
        idx, stop = best
        comp.text = comp.text[:idx + len(stop) if params.include_stop_str_in_output else idx]
        comp.finish_reason = "stop"
        comp.stop_reason = stop
        return True

    def _emit(self, parent: _Parent, changed: set[str]) -> RequestOutput:
        holdback = max((len(s) for s in parent.params.stop), default=1) - 1
        outputs = []
        for child_id, comp in parent.completions.items():
            delta_text, delta_ids, delta_lps = "", [], []
            if child_id in changed:
                visible = len(comp.text) if comp.finish_reason else max(
                    comp.sent, len(comp.text) - holdback)
                delta_text = comp.text[comp.sent:visible]
                comp.sent = visible
                delta_ids = comp.token_ids[-1:] if comp.token_ids else []
                delta_lps = comp.logprobs[-1:] if comp.logprobs else []
            outputs.append(CompletionOutput(
                index=comp.index, text=comp.text[:comp.sent], token_ids=list(comp.token_ids),
                logprobs=list(comp.logprobs) if parent.params.logprobs is not None else None,
                finish_reason=comp.finish_reason, stop_reason=comp.stop_reason,
                delta_text=delta_text, delta_token_ids=delta_ids, delta_logprobs=delta_lps))
        finished = all(c.finish_reason is not None for c in parent.completions.values())
        if finished:
            del self._parents[parent.request_id]
            for child_id in parent.completions:
                self._child_to_parent.pop(child_id, None)
        return RequestOutput(parent.request_id, parent.prompt_token_ids, outputs,
                             parent.num_cached_tokens, finished, parent.prompt)
