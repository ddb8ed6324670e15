"""Request bodies of the OpenAI API (plus vLLM-style extras), validated strictly.

Strict mode means a JSON string is never coerced into a number or a boolean: a wrong type is
the client's bug and is answered with 400, as OpenAI does. Unknown fields are ignored so that
clients sending vendor extensions keep working. Validators raise APIError (not a ValueError)
where they know the OpenAI `param`; pydantic lets it through unchanged.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from ember.core.request import Lane
from ember.core.sampling_params import SamplingParams
from ember.server.errors import bad_request

INT64 = 2**63


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Strict):
    include_usage: bool = False


class GenerationRequest(_Strict):
    """What chat and completions requests share."""

    model: str
    n: int = Field(1, ge=1, le=128)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=-INT64, lt=INT64)
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # extras, named as vLLM names them
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0, le=1)
    repetition_penalty: float | None = Field(None, gt=0, le=10)
    min_tokens: int = Field(0, ge=0)
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    priority: int = Field(0, ge=-(2**31), lt=2**31)
    lane: Literal["interactive", "batch"] | None = None

    @model_validator(mode="after")
    def _unsupported(self) -> GenerationRequest:
        if self.logit_bias:
            raise bad_request("logit_bias is not supported", "logit_bias")
        if self.stream_options is not None and not self.stream:
            raise bad_request("stream_options is only allowed with stream: true",
                              "stream_options")
        return self

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def lane_enum(self, header: str | None) -> Lane:
        """The body's `lane` wins over the x-ember-lane header; interactive by default."""
        name = self.lane or header or "interactive"
        if name not in ("interactive", "batch"):
            raise bad_request(f"x-ember-lane must be 'interactive' or 'batch', got {name!r}",
                              "lane")
        return Lane.BATCH if name == "batch" else Lane.INTERACTIVE

    def sampling_params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        """Raises ValueError naming the field when a value is out of range."""
        return SamplingParams(
            n=self.n,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k or 0,
            min_p=self.min_p or 0.0,
            seed=self.seed,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            stop=[self.stop] if isinstance(self.stop, str) else list(self.stop or []),
            stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens,
        )


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    """One message; fields beyond these (reasoning_content, ...) pass through to the template."""

    model_config = ConfigDict(strict=True, extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None

    @model_validator(mode="after")
    def _content_required(self) -> ChatMessage:
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError(f"a {self.role} message needs content")
        return self

    def for_template(self) -> dict[str, Any]:
        """A plain dict with text parts joined, as HF chat templates expect."""
        out = self.model_dump(exclude_none=True)
        if isinstance(self.content, list):
            out["content"] = "\n".join(part.text for part in self.content)
        return out


class ChatCompletionRequest(GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    # tools and structured output; rendering and parsing them is the chat handler's business
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True

    @model_validator(mode="after")
    def _logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise bad_request("top_logprobs requires logprobs: true", "top_logprobs")
        return self

    @property
    def max_output_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(GenerationRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1)

    @model_validator(mode="after")
    def _supported(self) -> CompletionRequest:
        if self.suffix:
            raise bad_request("suffix is not supported", "suffix")
        if self.best_of is not None and self.best_of != self.n:
            raise bad_request("best_of other than n is not supported", "best_of")
        if self.echo and self.logprobs is not None:
            raise bad_request("echo with logprobs is not supported", "echo")
        if isinstance(self.prompt, list) and not self.prompt:
            raise bad_request("prompt must not be empty", "prompt")
        return self

    def prompts(self) -> list[str | list[int]]:
        """The batch of prompts: each a string or a list of token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if all(isinstance(x, int) for x in p):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]
