"""Prompt rendering and chained character-block hashes."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from ember.router.prompt import block_hashes, render

SYSTEM = {"role": "system", "content": "You review code. " * 40}


def chat(*messages: dict, **extra: object) -> dict:
    return {"model": "m", "messages": list(messages), **extra}


def test_a_later_turn_renders_as_an_extension_of_the_earlier_one():
    turn1 = chat(SYSTEM, {"role": "user", "content": "review a.py"})
    turn2 = chat(SYSTEM, {"role": "user", "content": "review a.py"},
                 {"role": "assistant", "content": "looks fine"},
                 {"role": "user", "content": "tool result: ok " * 20})
    assert render(turn2).startswith(render(turn1))
    first, second = block_hashes(render(turn1), 64, 100), block_hashes(render(turn2), 64, 100)
    assert len(second) > len(first) > 4
    assert second[:len(first)] == first


def test_model_tools_and_content_parts_change_the_rendering():
    base = chat({"role": "user", "content": "hi"})
    assert render({**base, "model": "other"}) != render(base)
    assert render({**base, "tools": [{"type": "function", "function": {"name": "f"}}]}) \
        != render(base)
    parts = chat({"role": "user", "content": [{"type": "text", "text": "hi"}]})
    assert render(parts) == render(base)


def test_completion_prompts_and_bodies_without_a_prompt():
    assert render({"model": "m", "prompt": "abc"}).endswith("abc")
    assert render({"model": "m", "prompt": ["abc", "def"]}) == render({"model": "m",
                                                                       "prompt": "abc"})
    assert render({"model": "m", "prompt": [1, 2, 3]}).endswith("1,2,3")
    assert render({"model": "m", "input": "hello"}).endswith("hello")
    assert render({"model": "m"}) is None


def test_only_full_blocks_count_and_max_blocks_caps():
    assert block_hashes("a" * 63, 64, 10) == []
    assert len(block_hashes("a" * 640, 64, 10)) == 10
    assert len(block_hashes("a" * 6400, 64, 10)) == 10
    # Chained: the same block text at different positions hashes differently.
    hashes = block_hashes("a" * 256, 64, 10)
    assert len(set(hashes)) == 4


@given(st.text(min_size=0, max_size=400), st.text(min_size=1, max_size=400),
       st.text(min_size=1, max_size=400))
def test_hashes_agree_exactly_on_the_blocks_before_the_first_difference(common, left, right):
    if left[0] == right[0]:
        right = chr(ord(left[0]) + 1) + right[1:]
    a, b = block_hashes(common + left, 16, 100), block_hashes(common + right, 16, 100)
    shared = len(common) // 16
    assert a[:shared] == b[:shared]
    if len(a) > shared and len(b) > shared:
        assert a[shared] != b[shared]
