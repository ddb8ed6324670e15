"""Drive one endpoint with a workload: concurrency, Poisson arrivals, request count or duration.

Sessions are planned before the clock starts when the run is bounded by a request count, so
every endpoint gets the same requests and no tokenization competes with the measurement.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from ember.bench.client import ChatClient, RequestResult
from ember.bench.config import BenchConfig, Endpoint
from ember.bench.workloads import Messages, Session, Stream, Workload

WARMUP_MESSAGES: Messages = [{"role": "user", "content": "Say hello in five words."}]


@dataclass
class Sent:
    """One request of a run: what went out and what came back."""

    stream: str
    session_id: str
    turn: int
    messages: Messages
    max_tokens: int
    affinity: str | None
    result: RequestResult


@dataclass
class EndpointRun:
    endpoint: Endpoint
    model: str
    measured_stream: str
    requests: list[Sent] = field(default_factory=list)
    start: float = 0.0
    end: float = 0.0
    cancelled: int = 0  # background requests still running when the measured stream ended


def plan_sessions(stream: Stream, num_requests: int) -> list[Session]:
    """The first sessions of a stream holding exactly num_requests requests in all."""
    planned: list[Session] = []
    left = num_requests
    while left > 0:
        session = next(stream.sessions)
        planned.append(session if session.turns <= left else session.truncated(left))
        left -= planned[-1].turns
    return planned


def run_endpoint(config: BenchConfig, endpoint: Endpoint, model: str, workload: Workload,
                 on_done: Callable[[Sent], None] | None = None,
                 client: ChatClient | None = None) -> EndpointRun:
    """Run the workload against one endpoint; `client` replaces the HTTP client (tests)."""
    return asyncio.run(_Run(config, endpoint, model, workload, on_done, client).main())


class _Run:
    def __init__(self, config: BenchConfig, endpoint: Endpoint, model: str, workload: Workload,
                 on_done: Callable[[Sent], None] | None, client: ChatClient | None) -> None:
        self.config = config
        self.workload = workload
        self.on_done = on_done
        self.run = EndpointRun(endpoint, model, workload.measured.name)
        self.deadline: float | None = None
        self.sessions: Iterable[Session] = workload.measured.sessions
        if config.num_requests is not None:
            self.sessions = plan_sessions(workload.measured, config.num_requests)
        connections = workload.measured.concurrency + (
            workload.background.concurrency if workload.background else 0)
        self.client = client or ChatClient(endpoint, model, config.api_key,
                                           config.request_timeout, connections)

    async def main(self) -> EndpointRun:
        try:
            for _ in range(self.config.warmup):
                await self.client.chat(WARMUP_MESSAGES, 4, self.config.temperature)
            self.run.start = time.perf_counter()
            if self.config.duration is not None:
                self.deadline = self.run.start + self.config.duration
            background = None
            if self.workload.background is not None:
                background = asyncio.create_task(self._background(self.workload.background))
            await self._measured(self.workload.measured)
            self.run.end = time.perf_counter()
            if background is not None:
                background.cancel()
                await asyncio.gather(background, return_exceptions=True)
        finally:
            await self.client.aclose()
        return self.run

    def _expired(self) -> bool:
        return self.deadline is not None and time.perf_counter() >= self.deadline

    async def _measured(self, stream: Stream) -> None:
        """Start sessions as arrivals and free slots allow; wait for all of them."""
        slots = asyncio.Semaphore(stream.concurrency)
        arrivals = random.Random(f"{self.config.seed}:arrivals")
        next_arrival = self.run.start
        tasks: list[asyncio.Task[None]] = []
        for session in self.sessions:
            if stream.rate is not None:
                next_arrival += arrivals.expovariate(stream.rate)
                await asyncio.sleep(max(0.0, next_arrival - time.perf_counter()))
            await slots.acquire()
            if self._expired():
                slots.release()
                break
            task = asyncio.create_task(self._session(stream.name, session))
            task.add_done_callback(lambda _: slots.release())
            tasks.append(task)
        await asyncio.gather(*tasks)

    async def _background(self, stream: Stream) -> None:
        """Background sessions one slot at a time until they run out or get cancelled."""
        slots = asyncio.Semaphore(stream.concurrency)
        tasks: list[asyncio.Task[None]] = []
        try:
            for session in stream.sessions:
                await slots.acquire()
                task = asyncio.create_task(self._session(stream.name, session))
                task.add_done_callback(lambda _: slots.release())
                tasks.append(task)
            await asyncio.gather(*tasks)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _session(self, stream: str, session: Session) -> None:
        history = list(session.messages)
        for turn in range(session.turns):
            if self._expired():
                return
            try:
                result = await self.client.chat(
                    history, session.max_tokens[turn], self.config.temperature,
                    self.config.ignore_eos, session.affinity)
            except asyncio.CancelledError:
                self.run.cancelled += 1
                raise
            sent = Sent(stream, session.session_id, turn, list(history),
                        session.max_tokens[turn], session.affinity, result)
            self.run.requests.append(sent)
            if self.on_done is not None and stream == self.run.measured_stream:
                self.on_done(sent)
            if not result.ok:
                return
            if turn + 1 < session.turns:
                history += [{"role": "assistant", "content": result.text},
                            {"role": "user", "content": session.followups[turn]}]
