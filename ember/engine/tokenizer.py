"""Tokenizer and chat template, from a checkpoint folder or a GGUF file's metadata.

Uses transformers' tokenizer classes (local files only; nothing is fetched).
"""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path
from typing import Any

from ember import envs
from ember.executor.checkpoint import Checkpoint


class Tokenizer:
    """What the engine and server need of a tokenizer, with stop ids and the chat template."""

    def __init__(self, hf_tokenizer: Any, eos_token_ids: list[int]) -> None:
        self.hf = hf_tokenizer
        self.eos_token_ids = eos_token_ids

    @property
    def eos_token_id(self) -> int | None:
        return self.eos_token_ids[0] if self.eos_token_ids else None

    @property
    def vocab_size(self) -> int:
        return len(self.hf)

    @property
    def chat_template(self) -> str | None:
        return getattr(self.hf, "chat_template", None)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.hf.encode(text, add_special_tokens=add_special_tokens)

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, token_ids: list[int]) -> list[str]:
        return self.hf.convert_ids_to_tokens(token_ids)

    def apply_chat_template(self, messages: list[dict[str, Any]],
                            add_generation_prompt: bool = True, **kwargs: Any) -> str:
        if not self.chat_template:
            raise ValueError("messages: this model has no chat template; use completions")
        return self.hf.apply_chat_template(messages, tokenize=False,
                                           add_generation_prompt=add_generation_prompt, **kwargs)


def load_tokenizer(checkpoint: Checkpoint) -> Tokenizer:
    from transformers import AutoTokenizer

    path: Path = checkpoint.path
    if checkpoint.is_gguf:
        hf = _gguf_tokenizer(path)
    else:
        hf = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    eos = checkpoint.hf_config.get("eos_token_id")
    if eos is None:
        eos = hf.eos_token_id
    eos_ids = [e for e in (eos if isinstance(eos, list) else [eos]) if e is not None]
    return Tokenizer(hf, eos_ids)


def _gguf_tokenizer(path: Path) -> Any:
    """Converting a GGUF vocabulary takes seconds, so the result is kept in the cache folder."""
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
        tmp.rename(cached)
    except OSError:  # another process cached it first
        shutil.rmtree(tmp, ignore_errors=True)
    return hf
