"""inferd: an inference engine and server (paged KV cache, continuous batching, OpenAI API)."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from inferd.config import EngineConfig
    from inferd.engine.sampling_params import SamplingParams
    from inferd.entrypoints.llm import LLM

__all__ = ["LLM", "EngineConfig", "SamplingParams"]
__version__ = "0.1.0"

# Imported on first use (PEP 562), so that ``inferd serve`` can refuse a bad flag before torch's ~2 s import.
_EXPORTS = {"LLM": "inferd.entrypoints.llm", "EngineConfig": "inferd.config",
            "SamplingParams": "inferd.engine.sampling_params"}


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'inferd' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
