"""Engine layer: requests, KV blocks, scheduling, model execution and sampling."""

from inferd.engine.llm_engine import LLMEngine, RequestOutput
from inferd.engine.sampling_params import SamplingParams

__all__ = ["LLMEngine", "RequestOutput", "SamplingParams"]
