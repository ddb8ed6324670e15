"""Workloads: seeded streams of sessions built from the stdlib corpus.

A session is one or more turns sent in order; turn k+1 appends turn k's answer and a tool
result. Every workload has one measured stream and may have a background stream that runs
only while the measured one does (interference).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from ember.bench.config import BenchConfig, LengthDist
from ember.bench.corpus import Corpus
from ember.bench.tokenizer import BenchTokenizer

Messages = list[dict[str, str]]

CHAT_INSTRUCTION = "Explain what the following Python code does, briefly.\n\n"
AGENT_SYSTEM = (
    "You are a code-review agent. You read one Python file, call the tools read_file, grep "
    "and run_tests when you need them, and report concrete bugs with line references. Keep "
    "answers short.\n\nReference material for this project follows.\n\n"
)
# Tokens kept free below the context length, for servers that count a token or two more.
CONTEXT_MARGIN = 8


@dataclass
class Session:
    """What to send: the first request's messages, then one tool result per later turn."""

    session_id: str
    affinity: str | None
    messages: Messages
    followups: list[str]
    max_tokens: list[int]

    @property
    def turns(self) -> int:
        return len(self.max_tokens)

    def truncated(self, turns: int) -> Session:
        return Session(self.session_id, self.affinity, self.messages,
                       self.followups[:turns - 1], self.max_tokens[:turns])


@dataclass
class Stream:
    name: str
    sessions: Iterator[Session]
    concurrency: int
    rate: float | None


@dataclass
class Workload:
    measured: Stream
    background: Stream | None
    parameters: dict[str, Any]


def fit_prompt(build: Callable[[int, int], Messages], target: int, tokenizer: BenchTokenizer,
               field_name: str) -> Messages:
    """Messages whose chat prompt is exactly `target` tokens; build(k, attempt) puts a k-token
    excerpt in the template, and a new attempt draws the excerpt elsewhere."""
    overhead = tokenizer.count_chat(build(1, 0)) - 1
    if target <= overhead:
        raise ValueError(f"{field_name}: {target} tokens leaves no room for text; the chat "
                         f"template and instruction alone take {overhead}")
    for attempt in range(4):
        k = target - overhead
        for _ in range(4):
            messages = build(k, attempt)
            total = tokenizer.count_chat(messages)
            if total == target:
                return messages
            k += target - total
            if k < 1:
                break
    raise RuntimeError(f"{field_name}: could not cut a prompt of exactly {target} tokens")


def build_workload(config: BenchConfig, corpus: Corpus, context_length: int | None) -> Workload:
    """The streams of config.workload; long prompts need the server's context length."""
    if config.workload == "chat":
        sessions = _chat_sessions(config, corpus, "chat", config.input_len, config.output_len,
                                  "input_len")
        return Workload(Stream("chat", sessions, config.concurrency, config.rate), None, {
            "input_len": config.input_len.describe(), "output_len": config.output_len.describe(),
        })
    if config.workload == "agent":
        return Workload(Stream("agent", _agent_sessions(config, corpus), config.concurrency,
                               config.rate), None, {
            "turns": config.turns, "system_len": config.system_len, "file_len": config.file_len,
            "tool_result_len": config.tool_result_len,
            "output_len": config.output_len.describe(),
        })
    if context_length is None:
        raise ValueError("context_length: the server reports none; pass --context-length")
    if config.workload == "long-context":
        long_len = context_length - config.output_len.upper() - CONTEXT_MARGIN
        sessions = _chat_sessions(config, corpus, "long", LengthDist("fixed", long_len),
                                  config.output_len, "context_length")
        return Workload(Stream("long", sessions, config.concurrency, config.rate), None, {
            "context_length": context_length, "input_len": long_len,
            "output_len": config.output_len.describe(),
        })
    long_len = context_length - 1 - CONTEXT_MARGIN
    short = _chat_sessions(config, corpus, "short", config.input_len, config.output_len,
                           "input_len")
    long = _chat_sessions(config, corpus, "long", LengthDist("fixed", long_len),
                          LengthDist("fixed", 1), "context_length")
    background = [next(long) for _ in range(config.long_requests)]
    return Workload(Stream("short", short, config.concurrency, config.rate),
                    Stream("long", iter(background), 1, None), {
        "context_length": context_length, "input_len": config.input_len.describe(),
        "output_len": config.output_len.describe(), "long_input_len": long_len,
        "long_requests": config.long_requests,
    })


def _chat_sessions(config: BenchConfig, corpus: Corpus, stream: str, input_len: LengthDist,
                   output_len: LengthDist, field_name: str) -> Iterator[Session]:
    """Independent one-turn prompts: an instruction and a stdlib excerpt, input_len tokens in
    all as the server counts them (chat template included)."""
    rng = random.Random(f"{config.seed}:{config.workload}:{stream}")
    index = 0
    while True:
        target = input_len.sample(rng)
        max_tokens = output_len.sample(rng)
        file_index, position = rng.randrange(len(corpus)), rng.random()

        def build(k: int, attempt: int, file_index: int = file_index,
                  position: float = position) -> Messages:
            text = corpus.excerpt(k, file_index + attempt, position)
            return [{"role": "user", "content": CHAT_INSTRUCTION + text}]

        messages = fit_prompt(build, target, corpus.tokenizer, field_name)
        yield Session(f"{stream}-{index}", None, messages, [], [max_tokens])
        index += 1


def _agent_sessions(config: BenchConfig, corpus: Corpus) -> Iterator[Session]:
    """Sessions sharing one system prompt, each reviewing its own stdlib file over several
    turns; every request carries the session's x-session-affinity."""
    rng = random.Random(f"{config.seed}:agent")
    system = AGENT_SYSTEM + corpus.excerpt(config.system_len, rng.randrange(len(corpus)),
                                           rng.random())
    index = 0
    while True:
        file_index = rng.randrange(len(corpus))
        name = corpus.name(file_index)
        code = corpus.excerpt(config.file_len, file_index)
        messages = [
            {"role": "system", "content": system},
            {"role": "user", "content": f"Review `{name}` and find its bugs.\n\n"
                                        f"```python\n{code}\n```"},
        ]
        followups = [
            f"Tool result (run_tests {name}):\n"
            f"{corpus.excerpt(config.tool_result_len, rng.randrange(len(corpus)), rng.random())}"
            f"\n\nContinue the review."
            for _ in range(config.turns - 1)
        ]
        max_tokens = [config.output_len.sample(rng) for _ in range(config.turns)]
        session_id = f"agent-{index}"
        yield Session(session_id, f"bench-{config.seed}-{session_id}", messages, followups,
                      max_tokens)
        index += 1
