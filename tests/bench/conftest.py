import pytest

from ember.bench.corpus import Corpus
from ember.bench.tokenizer import BenchTokenizer, load_tokenizer


@pytest.fixture(scope="session")
def tokenizer() -> BenchTokenizer:
    """The default model's tokenizer (converted from the GGUF once, then cached on disk)."""
    return load_tokenizer(None)


@pytest.fixture(scope="session")
def corpus(tokenizer: BenchTokenizer) -> Corpus:
    return Corpus(tokenizer)
