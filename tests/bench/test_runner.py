import asyncio
import json
import random

import httpx

from ember.bench.client import ChatClient
from ember.bench.config import BenchConfig, Endpoint, LengthDist
from ember.bench.runner import run_endpoint
from ember.bench.workloads import build_workload

ENDPOINT = Endpoint("stub", "http://stub:1")


class StubServer:
    """An in-process OpenAI stream: answers "turn N" word by word, tracking concurrency."""

    def __init__(self, delay=0.01, long_delay=None):
        self.delay = delay
        self.long_delay = long_delay
        self.in_flight = 0
        self.max_in_flight = 0
        self.bodies = []
        self.headers = []

    async def __call__(self, request):
        body = json.loads(request.content)
        self.bodies.append(body)
        self.headers.append(request.headers)
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            if self.long_delay and body["max_tokens"] == 1:
                await asyncio.sleep(self.long_delay)
            await asyncio.sleep(self.delay)
        finally:
            self.in_flight -= 1
        turn = sum(m["role"] == "assistant" for m in body["messages"])
        chunks = [{"choices": [{"index": 0, "delta": {"content": w}}]}
                  for w in (f"turn {turn}").split(" ")]
        chunks.append({"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 2}})
        text = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
        return httpx.Response(200, content=text.encode())

    def client(self):
        return ChatClient(ENDPOINT, "m", None, 30.0, 8, transport=httpx.MockTransport(self))


def run(corpus, server, **kwargs):
    kwargs.setdefault("input_len", LengthDist.parse("60", "input_len"))
    kwargs.setdefault("output_len", LengthDist.parse("4", "output_len"))
    config = BenchConfig([ENDPOINT], **kwargs)
    workload = build_workload(config, corpus, 200)
    done = []
    result = run_endpoint(config, ENDPOINT, "m", workload, done.append, server.client())
    return result, done


def test_closed_loop_keeps_concurrency_and_sends_exactly_n(corpus):
    server = StubServer()
    result, done = run(corpus, server, concurrency=3, num_requests=10)
    assert len(result.requests) == 10 == len(done) == len(server.bodies)
    assert server.max_in_flight == 3
    assert all(s.result.ok and s.result.usage["completion_tokens"] == 2 for s in result.requests)
    assert result.end >= max(s.result.end for s in result.requests)


def test_agent_turns_append_the_answer_and_a_tool_result(corpus):
    server = StubServer()
    result, _ = run(corpus, server, workload="agent", concurrency=2, num_requests=6, turns=3,
                    system_len=20, file_len=30, tool_result_len=10)
    by_session = {}
    for sent in result.requests:
        by_session.setdefault(sent.session_id, []).append(sent)
    assert sorted(len(v) for v in by_session.values()) == [3, 3]
    for turns in by_session.values():
        turns.sort(key=lambda s: s.turn)
        last = turns[2].messages
        assert len(last) == 6 and last[:2] == turns[0].messages
        assert [m["content"] for m in last if m["role"] == "assistant"] == ["turn0", "turn1"]
        assert last[-1]["content"].startswith("Tool result")
    assert {h["x-session-affinity"] for h in server.headers} == {
        s.affinity for s in result.requests}


def test_background_long_prefills_are_cancelled_when_the_measured_stream_ends(corpus):
    server = StubServer(long_delay=30.0)
    result, done = run(corpus, server, workload="interference", concurrency=2, num_requests=4,
                       long_requests=3)
    assert len(done) == 4 and {s.stream for s in result.requests} == {"short"}
    assert result.cancelled == 1  # one long request in flight, the other two never sent
    assert sum(b["max_tokens"] == 1 for b in server.bodies) == 1


def test_rate_arrivals_follow_the_seeded_poisson_process(corpus):
    server = StubServer(delay=0.0)
    result, _ = run(corpus, server, concurrency=8, num_requests=6, rate=50.0, seed=5)
    arrivals, t = [], 0.0
    rng = random.Random("5:arrivals")
    for _ in range(6):
        t += rng.expovariate(50.0)
        arrivals.append(t)
    starts = sorted(s.result.start - result.start for s in result.requests)
    assert all(start >= arrival - 1e-3 for start, arrival in zip(starts, arrivals, strict=True))


def test_duration_stops_starting_requests(corpus):
    server = StubServer(delay=0.05)
    result, _ = run(corpus, server, concurrency=2, duration=0.3)
    assert 2 <= len(result.requests) <= 20
    assert all(s.result.start - result.start < 0.3 for s in result.requests)
