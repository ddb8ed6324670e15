import random

import pytest


def test_corpus_is_the_stdlib_without_tests(corpus):
    names = [corpus.name(i) for i in range(len(corpus))]
    assert "json/decoder.py" in names and "asyncio/tasks.py" in names
    assert not any(n.startswith("test/") or "/tests/" in n or "site-packages" in n
                   for n in names)


def test_excerpts_have_exact_token_counts(corpus, tokenizer):
    rng = random.Random(1)
    for _ in range(30):
        n = rng.choice([1, 2, 7, 64, 333, 2000])
        text = corpus.excerpt(n, rng.randrange(len(corpus)), rng.random())
        assert tokenizer.count(text) == n


def test_excerpts_are_deterministic_and_start_files_at_position_zero(corpus):
    index = next(i for i in range(len(corpus)) if corpus.name(i) == "json/decoder.py")
    assert corpus.excerpt(50, index, 0.3) == corpus.excerpt(50, index, 0.3)
    assert corpus.excerpt(50, index, 0.3) != corpus.excerpt(50, index, 0.6)
    source = corpus.files[index].read_text()
    assert source.startswith(corpus.excerpt(40, index))


def test_excerpt_spans_files_when_one_is_too_short(corpus, tokenizer):
    index = next(i for i in range(len(corpus)) if len(corpus.file_tokens(i)) < 100)
    n = len(corpus.file_tokens(index)) + 500
    assert tokenizer.count(corpus.excerpt(n, index)) == n
    with pytest.raises(ValueError, match="n must be >= 1"):
        corpus.excerpt(0, index)
