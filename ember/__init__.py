"""ember: an LLM serving engine for MoE and dense models.

The offline API is imported lazily, so tools that never touch the engine (`ember bench`,
`ember route`, `ember cost`) start without importing torch.
"""

from __future__ import annotations

from typing import Any

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]

_EXPORTS = {
    "LLM": "ember.engine.llm",
    "SamplingParams": "ember.core.sampling_params",
    "RequestOutput": "ember.engine.outputs",
    "CompletionOutput": "ember.engine.outputs",
}


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'ember' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(_EXPORTS[name]), name)
