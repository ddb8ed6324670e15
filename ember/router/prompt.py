"""What a request's prompt starts with: chained hashes of its leading character blocks.

The router hashes characters of a canonical rendering of the request, not tokens. It fronts
replicas that may serve different models with different tokenizers and chat templates, and it
sits on every request's path on a couple of CPU cores: loading a tokenizer and running BPE per
request would cost far more than hashing a few kilobytes. Only a predictor is needed, not the
replica's exact block boundaries: every chat template renders messages in order, so two
requests whose renderings share their first k character blocks share about k * block_chars / 4
tokens of prompt, and the replica that served one most likely still caches that prefix.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

ROLE_SEP = "\x1e"
MESSAGE_SEP = "\x1f"


def render(body: dict[str, Any]) -> str | None:
    """A canonical text of the prompt the body asks for, or None when it holds no prompt."""
    head = f"{body.get('model', '')}{MESSAGE_SEP}"
    messages = body.get("messages")
    if isinstance(messages, list):
        tools = body.get("tools")
        if tools:
            head += _compact(tools) + MESSAGE_SEP
        return head + "".join(_render_message(m) for m in messages)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of prompts: route by the first
    if isinstance(prompt, str):
        return head + prompt
    if isinstance(prompt, list):
        return head + ",".join(str(t) for t in prompt)
    if "input" in body:  # the Responses API
        value = body["input"]
        return head + (value if isinstance(value, str) else _compact(value))
    return None


def _render_message(message: Any) -> str:
    if not isinstance(message, dict):
        return _compact(message) + MESSAGE_SEP
    content = message.get("content")
    if isinstance(content, list):
        content = "".join(part.get("text", "") if isinstance(part, dict) and "text" in part
                          else _compact(part) for part in content)
    text = f"{message.get('role', '')}{ROLE_SEP}{content or ''}"
    if message.get("tool_calls"):
        text += _compact(message["tool_calls"])
    return text + MESSAGE_SEP


def _compact(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def block_hashes(text: str, block_chars: int, max_blocks: int) -> list[int]:
    """Chained 64-bit hashes of the leading full blocks: hash i covers characters
    [0, (i + 1) * block_chars), so equal hashes mean equal prefixes."""
    hashes: list[int] = []
    previous = b""
    for start in range(0, min(len(text) // block_chars, max_blocks) * block_chars, block_chars):
        block = text[start:start + block_chars].encode()
        previous = hashlib.blake2b(previous + block, digest_size=8).digest()
        hashes.append(int.from_bytes(previous, "big"))
    return hashes
