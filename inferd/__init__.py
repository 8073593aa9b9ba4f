"""inferd: an inference engine and server (paged KV cache, continuous batching, OpenAI API)."""

from inferd.config import EngineConfig
from inferd.engine.sampling_params import SamplingParams
from inferd.entrypoints.llm import LLM

__all__ = ["LLM", "EngineConfig", "SamplingParams"]
__version__ = "0.1.0"
