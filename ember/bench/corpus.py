"""Real text available offline: the Python standard library's sources, cut to exact token counts."""

from __future__ import annotations

import sysconfig
from pathlib import Path

from ember.bench.tokenizer import BenchTokenizer

_SKIPPED_DIRS = frozenset({"site-packages", "test", "tests", "idle_test", "__pycache__"})
# How many start positions to try when a cut does not survive decode -> encode unchanged.
_MAX_SHIFTS = 64


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


class Corpus:
    """Sorted stdlib .py files, tokenized on demand; excerpts are exactly n tokens long.

    A cut at token boundaries almost always re-encodes to the same tokens; where a merge
    differs at an edge, the start moves by a token until the count is exact.
    """

    def __init__(self, tokenizer: BenchTokenizer, root: Path | None = None) -> None:
        self.tokenizer = tokenizer
        self.root = root or stdlib_root()
        self.files = sorted(
            p for p in self.root.rglob("*.py")
            if not _SKIPPED_DIRS & set(p.relative_to(self.root).parts[:-1])
        )
        if not self.files:
            raise FileNotFoundError(f"corpus: no .py files under {self.root}")
        self._tokens: dict[int, list[int]] = {}

    def __len__(self) -> int:
        return len(self.files)

    def name(self, index: int) -> str:
        return self.files[index % len(self.files)].relative_to(self.root).as_posix()

    def file_tokens(self, index: int) -> list[int]:
        index %= len(self.files)
        if index not in self._tokens:
            text = self.files[index].read_text(encoding="utf-8", errors="replace")
            self._tokens[index] = self.tokenizer.encode(text)
        return self._tokens[index]

    def excerpt(self, n: int, file_index: int, position: float = 0.0) -> str:
        """Exactly n tokens of text starting in file `file_index` at `position` (0..1) of
        the room left; files that follow are appended when one is too short."""
        if n < 1:
            raise ValueError(f"excerpt: n must be >= 1, got {n}")
        stream: list[int] = []
        index = file_index
        while len(stream) < n + _MAX_SHIFTS:
            stream += self.file_tokens(index) + self.tokenizer.encode("\n\n")
            index += 1
        start = int(position * (len(stream) - n - _MAX_SHIFTS))
        for shift in range(_MAX_SHIFTS):
            text = self.tokenizer.decode(stream[start + shift:start + shift + n])
            if self.tokenizer.count(text) == n:
                return text
        raise RuntimeError(f"corpus: no exact {n}-token cut near {self.name(file_index)}")
