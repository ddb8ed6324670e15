"""A generation request as the scheduler and KV cache see it (torch-free)."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from ember.core.sampling_params import SamplingParams


class Lane(enum.IntEnum):
    """Service class. Lower values are served first and preempted last."""

    INTERACTIVE = 0
    BATCH = 1


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH,
                        RequestStatus.FINISHED_ABORTED)


@dataclass
class Request:
    """Tokens in and out, and how far the model has computed them.

    The scheduler's single rule: each step, `num_computed_tokens` catches up with
    `num_tokens` under a token budget. That covers prefill, chunked prefill, prefix-cache
    hits (which start it above zero) and decode (one new token a step) alike.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    lane: Lane = Lane.INTERACTIVE
    priority: int = 0
    session_id: str | None = None
    max_model_len: int | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    status: RequestStatus = RequestStatus.WAITING
    stop_reason: int | str | None = None
    block_hashes: list[bytes] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.prompt_token_ids:
            raise ValueError("prompt_token_ids must not be empty")

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    @property
    def sort_key(self) -> tuple[int, int, float]:
        """Admission order: lane, then priority, then arrival."""
        return (int(self.lane), self.priority, self.arrival_time)

    def token_ids_slice(self, start: int, end: int) -> list[int]:
        n_prompt = len(self.prompt_token_ids)
        if end <= n_prompt:
            return self.prompt_token_ids[start:end]
        return self.all_token_ids[start:end]

    def check_stop(self) -> bool:
        """Apply the token-level stop rules after a new output token; True if finished."""
        params = self.sampling_params
        last = self.output_token_ids[-1]
        if self.num_output_tokens >= params.min_tokens:
            if not params.ignore_eos and last in self.eos_token_ids:
                self.status = RequestStatus.FINISHED_STOPPED
                return True
            if last in params.stop_token_ids:
                self.status = RequestStatus.FINISHED_STOPPED
                self.stop_reason = last
                return True
        if params.max_tokens is not None and self.num_output_tokens >= params.max_tokens:
            self.status = RequestStatus.FINISHED_LENGTH
            return True
        if self.max_model_len is not None and self.num_tokens >= self.max_model_len:
            self.status = RequestStatus.FINISHED_LENGTH
            return True
        return False
