import numpy as np
import pytest

from ember.bench.client import RequestResult
from ember.bench.config import Prices
from ember.bench.report import (
    RequestRecord,
    comparison,
    distribution,
    format_table,
    percentile,
    ratios,
    summarize,
    to_record,
)
from ember.bench.runner import Sent

PRICES = Prices(0.60, 0.10, 3.00)


def record(start, e2e, ttft, prompt, completion, cached=0, itl=(), error=None, status=200,
           stream="chat"):
    return RequestRecord(stream=stream, session="s", turn=0, start_s=start, e2e_s=e2e,
                         ttft_s=ttft, itl_s=list(itl), prompt_tokens=prompt,
                         completion_tokens=completion, cached_tokens=cached, error=error,
                         status=status)


@pytest.mark.parametrize("q", [0, 1, 50, 90, 99, 100])
def test_percentile_matches_numpy_linear(q):
    values = list(np.random.default_rng(q).exponential(size=37))
    assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)))


def test_percentile_and_distribution_by_hand():
    assert percentile([4.0, 1.0, 3.0, 2.0], 50) == 2.5
    assert percentile([4.0, 1.0, 3.0, 2.0], 90) == pytest.approx(3.7)
    assert percentile([7.0], 99) == 7.0
    with pytest.raises(ValueError):
        percentile([], 50)
    dist = distribution([1.0, 2.0, 3.0])
    assert dist == {"count": 3, "mean": 2.0, "min": 1.0, "max": 3.0, "p50": 2.0, "p90": 2.8,
                    "p99": pytest.approx(2.98)}
    assert distribution([])["p99"] is None


def test_summary_arithmetic():
    records = [
        record(0.0, 2.0, 0.5, prompt=100, completion=10, cached=0, itl=[0.1, 0.2]),
        record(1.0, 3.0, 1.0, prompt=300, completion=30, cached=200, itl=[0.3]),
        record(2.0, 0.5, None, prompt=0, completion=0, error="boom", status=500),
        record(2.5, 0.1, None, prompt=0, completion=0, error="refused", status=None),
    ]
    s = summarize(records, PRICES)
    assert s["requests"] == 4 and s["succeeded"] == 2 and s["failed"] == 2
    assert s["error_rate"] == 0.5
    assert s["errors_by_status"] == {"500": 1, "transport": 1}
    assert s["duration_s"] == 4.0  # first start 0.0, last end 1.0 + 3.0
    assert s["requests_per_s"] == 0.5
    assert s["output_tokens_per_s"] == 40 / 4
    assert s["total_tokens_per_s"] == 440 / 4
    assert (s["prompt_tokens"], s["completion_tokens"], s["cached_tokens"]) == (400, 40, 200)
    assert s["cached_fraction"] == 0.5
    assert s["ttft_s"]["p50"] == 0.75 and s["ttft_s"]["count"] == 2
    assert s["itl_s"]["count"] == 3 and s["itl_s"]["p50"] == 0.2
    assert s["e2e_s"]["max"] == 3.0
    # tpot: (2.0 - 0.5) / 9 and (3.0 - 1.0) / 29
    assert s["tpot_s"]["min"] == pytest.approx(2.0 / 29)
    cost = (100 * 0.6 + 10 * 3.0 + 100 * 0.6 + 200 * 0.1 + 30 * 3.0) / 1e6
    assert s["cost"]["usd"] == pytest.approx(cost)
    assert s["cost"]["usd_per_request"] == pytest.approx(cost / 2)
    assert s["cost"]["saved_by_cache_usd"] == pytest.approx(200 * 0.5 / 1e6)


def test_ratios_are_other_over_baseline_and_none_for_zero_baselines():
    base = summarize([record(0.0, 1.0, 0.2, 100, 10), record(0.0, 2.0, 0.4, 100, 10)], PRICES)
    other = summarize([record(0.0, 0.5, 0.1, 100, 10, cached=50),
                       record(0.0, 1.0, 0.2, 100, 10, cached=50)], PRICES)
    r = ratios(base, other)
    assert r["output_tokens_per_s"] == pytest.approx(2.0)
    assert r["ttft_s.p50"] == pytest.approx(0.5)
    assert r["cached_fraction"] is None  # baseline 0
    assert r["error_rate"] is None
    endpoints = [{"name": "ember", "summary": base}, {"name": "peer", "summary": other}]
    report = {"endpoints": endpoints, "comparison": comparison(endpoints)}
    assert report["comparison"]["baseline"] == "ember"
    table = format_table(report)
    assert "peer/ember" in table.splitlines()[0]
    assert "2.00x" in next(line for line in table.splitlines()
                           if line.startswith("output_tokens_per_s"))


class CountingTokenizer:
    """Counts words: enough to check which source to_record takes its numbers from."""

    def count(self, text):
        return len(text.split())

    def count_chat(self, messages):
        return 3 + sum(self.count(m["content"]) for m in messages)


def sent(result):
    return Sent("agent", "agent-0", 1, [{"role": "user", "content": "a b c d"}], 8, "aff", result)


def test_record_takes_usage_from_the_server():
    result = RequestResult(start=10.0, end=12.0, status=200, chunk_times=[10.5, 10.7, 11.0],
                           text="x y", finish_reason="length", affinity_echo="aff",
                           usage={"prompt_tokens": 40, "completion_tokens": 3,
                                  "prompt_tokens_details": {"cached_tokens": 32}})
    r = to_record(sent(result), 9.0, CountingTokenizer())
    assert (r.start_s, r.e2e_s, r.ttft_s) == (1.0, 2.0, 0.5)
    assert r.itl_s == pytest.approx([0.2, 0.3])
    assert (r.prompt_tokens, r.completion_tokens, r.cached_tokens) == (40, 3, 32)
    assert r.expected_prompt_tokens == 7 and r.usage_source == "server"
    assert r.tpot_s == pytest.approx(0.75)


def test_record_counts_tokens_itself_without_usage():
    result = RequestResult(start=1.0, end=2.0, status=200, chunk_times=[1.5], text="one two")
    r = to_record(sent(result), 0.0, CountingTokenizer())
    assert (r.prompt_tokens, r.completion_tokens, r.cached_tokens) == (7, 2, 0)
    assert r.usage_source == "tokenizer"
    assert r.itl_s == [] and r.tpot_s == pytest.approx(0.5)
