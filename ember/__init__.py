"""ember: an LLM serving engine for MoE and dense models."""

from ember.core.sampling_params import SamplingParams
from ember.engine.llm import LLM
from ember.engine.outputs import CompletionOutput, RequestOutput

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]
