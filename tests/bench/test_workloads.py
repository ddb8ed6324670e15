import pytest

from ember.bench.config import BenchConfig, Endpoint, LengthDist
from ember.bench.runner import plan_sessions
from ember.bench.workloads import build_workload, fit_prompt


def config(**kwargs):
    return BenchConfig([Endpoint("a", "http://h")], **kwargs)


def test_chat_prompts_are_exactly_input_len_as_the_server_counts_them(corpus, tokenizer):
    cfg = config(input_len=LengthDist.parse("uniform:40:300", "input_len"),
                 output_len=LengthDist.parse("uniform:4:9", "output_len"), seed=3)
    sessions = plan_sessions(build_workload(cfg, corpus, None).measured, 12)
    lengths = [tokenizer.count_chat(s.messages) for s in sessions]
    assert all(40 <= n <= 300 for n in lengths) and len(set(lengths)) > 6
    assert all(s.turns == 1 and s.affinity is None for s in sessions)
    assert all(4 <= s.max_tokens[0] <= 9 for s in sessions)
    again = plan_sessions(build_workload(cfg, corpus, None).measured, 12)
    assert [s.messages for s in again] == [s.messages for s in sessions]
    other_seed = plan_sessions(build_workload(config(seed=4, input_len=cfg.input_len), corpus,
                                              None).measured, 12)
    assert [s.messages for s in other_seed] != [s.messages for s in sessions]


def test_agent_sessions_share_a_system_prompt_and_carry_affinity(corpus, tokenizer):
    cfg = config(workload="agent", turns=3, system_len=100, file_len=200, tool_result_len=30)
    sessions = plan_sessions(build_workload(cfg, corpus, None).measured, 7)
    assert [s.turns for s in sessions] == [3, 3, 1]  # exactly 7 requests
    assert len({s.messages[0]["content"] for s in sessions}) == 1
    assert len({s.messages[1]["content"] for s in sessions}) == 3
    assert len({s.affinity for s in sessions}) == 3 and all(s.affinity for s in sessions)
    first = sessions[0]
    assert len(first.followups) == 2 and all("Tool result" in f for f in first.followups)
    code = first.messages[1]["content"].split("```python\n")[1].rsplit("\n```", 1)[0]
    assert tokenizer.count(code) == 200


def test_long_context_fills_the_context_and_needs_its_length(corpus, tokenizer):
    cfg = config(workload="long-context", output_len=LengthDist.parse("uniform:2:6", "o"))
    sessions = plan_sessions(build_workload(cfg, corpus, 400).measured, 2)
    assert all(tokenizer.count_chat(s.messages) == 400 - 6 - 8 for s in sessions)
    with pytest.raises(ValueError, match="^context_length: "):
        build_workload(cfg, corpus, None)


def test_interference_has_a_short_measured_stream_and_long_background(corpus, tokenizer):
    cfg = config(workload="interference", concurrency=3, long_requests=2)
    workload = build_workload(cfg, corpus, 300)
    assert workload.measured.name == "short" and workload.measured.concurrency == 3
    background = list(workload.background.sessions)
    assert len(background) == 2 and workload.background.concurrency == 1
    assert all(tokenizer.count_chat(s.messages) == 300 - 1 - 8 and s.max_tokens == [1]
               for s in background)
    assert background[0].messages != background[1].messages


def test_fit_prompt_rejects_targets_below_the_template(corpus, tokenizer):
    def build(k, attempt):
        return [{"role": "user", "content": corpus.excerpt(k, attempt)}]

    with pytest.raises(ValueError, match="^input_len: 5 tokens leaves no room"):
        fit_prompt(build, 5, tokenizer, "input_len")
    assert tokenizer.count_chat(fit_prompt(build, 77, tokenizer, "input_len")) == 77
