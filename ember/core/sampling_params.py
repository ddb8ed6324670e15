"""Per-request sampling settings, validated on construction (torch-free)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

STRUCTURED_OUTPUT_KINDS = ("json", "json_schema", "regex", "grammar")
# JSON is written like Python's json.dumps and without free whitespace, which a model could
# otherwise fill without end. A schema's own "x-guidance" options take precedence.
JSON_GRAMMAR_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ",
                        "key_separator": ": "}


@dataclass(frozen=True)
class StructuredOutputSpec:
    """A constraint on the output, enforced token by token while decoding.

    kind "json": any JSON object (spec unused); "json_schema": spec is a JSON schema text;
    "regex": spec is a regular expression; "grammar": spec is a Lark grammar in llguidance's
    dialect (which adds `%json {schema}` and special tokens written `<|name|>`).
    The grammar is checked on construction, so an invalid one never reaches the engine.
    """

    kind: str
    spec: str = ""

    def __post_init__(self) -> None:
        _check(self.kind in STRUCTURED_OUTPUT_KINDS, "kind",
               f"must be one of {STRUCTURED_OUTPUT_KINDS}", self.kind)
        _check(isinstance(self.spec, str), "spec", "must be a string", self.spec)
        if self.kind == "json_schema":
            try:
                schema = json.loads(self.spec)
            except json.JSONDecodeError as e:
                raise ValueError(f"spec: not valid JSON ({e})") from None
            _check(isinstance(schema, dict | bool), "spec",
                   "must be a JSON schema (an object or a boolean)", self.spec)
        if self.kind in ("regex", "grammar"):
            _check(bool(self.spec), "spec", f"must not be empty for kind {self.kind!r}",
                   self.spec)
        from llguidance import LLMatcher

        error = LLMatcher.validate_grammar(self.grammar())
        if error:
            raise ValueError(f"spec: invalid {self.kind}: {error.strip()}")

    def grammar(self) -> str:
        """The constraint as an llguidance grammar (what the executor compiles)."""
        from llguidance import LLMatcher

        if self.kind in ("json", "json_schema"):
            schema = self.spec if self.kind == "json_schema" else '{"type": "object"}'
            return LLMatcher.grammar_from_json_schema(
                schema, defaults=JSON_GRAMMAR_OPTIONS)  # type: ignore[arg-type]
        if self.kind == "regex":
            return LLMatcher.grammar_from_regex(self.spec)
        return LLMatcher.grammar_from_lark(self.spec)


@dataclass
class SamplingParams:
    """How to pick each next token and when to stop; mirrors vLLM's SamplingParams.

    temperature 0 means greedy. Every invalid value raises ValueError naming its field.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    structured_output: StructuredOutputSpec | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        _check(isinstance(self.n, int) and self.n >= 1, "n", "must be an integer >= 1", self.n)
        _check(_is_number(self.temperature) and self.temperature >= 0, "temperature",
               "must be >= 0", self.temperature)
        _check(_is_number(self.top_p) and 0 < self.top_p <= 1, "top_p", "must be in (0, 1]",
               self.top_p)
        _check(isinstance(self.top_k, int) and self.top_k >= -1, "top_k",
               "must be an integer >= 0 (0 or -1 disables it)", self.top_k)
        _check(_is_number(self.min_p) and 0 <= self.min_p <= 1, "min_p", "must be in [0, 1]",
               self.min_p)
        _check(self.seed is None or isinstance(self.seed, int), "seed", "must be an integer",
               self.seed)
        _check(self.max_tokens is None or (isinstance(self.max_tokens, int)
                                           and self.max_tokens >= 1),
               "max_tokens", "must be an integer >= 1", self.max_tokens)
        _check(isinstance(self.min_tokens, int) and self.min_tokens >= 0, "min_tokens",
               "must be an integer >= 0", self.min_tokens)
        _check(all(isinstance(s, str) and s for s in self.stop), "stop",
               "must be non-empty strings", self.stop)
        _check(all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids), "stop_token_ids",
               "must be non-negative integers", self.stop_token_ids)
        _check(self.logprobs is None or (isinstance(self.logprobs, int)
                                         and 0 <= self.logprobs <= 20),
               "logprobs", "must be an integer in [0, 20]", self.logprobs)
        _check(_is_number(self.presence_penalty) and -2 <= self.presence_penalty <= 2,
               "presence_penalty", "must be in [-2, 2]", self.presence_penalty)
        _check(_is_number(self.frequency_penalty) and -2 <= self.frequency_penalty <= 2,
               "frequency_penalty", "must be in [-2, 2]", self.frequency_penalty)
        _check(_is_number(self.repetition_penalty) and 0 < self.repetition_penalty <= 10,
               "repetition_penalty", "must be in (0, 10]", self.repetition_penalty)
        _check(self.structured_output is None
               or isinstance(self.structured_output, StructuredOutputSpec), "structured_output",
               "must be a StructuredOutputSpec or None", self.structured_output)
        if self.top_k == -1:
            self.top_k = 0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _check(ok: bool, name: str, rule: str, value: object) -> None:
    if not ok:
        raise ValueError(f"{name} {rule}, got {value!r}")
