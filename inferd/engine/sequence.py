"""One request's state inside the engine."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from inferd.engine.detokenizer import IncrementalDetokenizer
from inferd.engine.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Sequence:
    """A request being served.

    Attributes:
        prompt_token_ids: the prompt, in tokens.
        output_token_ids: generated tokens so far.
        num_computed_tokens: tokens whose K/V are in the cache (vLLM v1's only progress counter:
            prefill, chunked prefill, decode and recompute after preemption are all "compute the tokens
            from num_computed_tokens to num_tokens").
        num_cached_tokens: prompt tokens served from the prefix cache when first scheduled.
        block_table: KV-cache block ids holding this sequence's tokens, in order.
        generator: per-request RNG (seeded from the request's seed, or from the engine's RNG).
        finish_reason: ``stop``, ``length``, ``abort`` or ``error`` once finished.
        prompt_logprobs: with ``params.prompt_logprobs``, one entry per prompt token (None first).
        priority: scheduling class; among waiting requests a higher one is scheduled first.
        scheduled_time: ``time.monotonic()`` when first scheduled (its queueing ended), or None.
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    max_tokens: int
    detokenizer: IncrementalDetokenizer
    generator: torch.Generator
    arrival_time: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    num_preemptions: int = 0
    prompt_logprobs: list = field(default_factory=list)  # TokenLogprobs per prompt position (first: None)
    priority: int = 0
    scheduled_time: float | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def is_decoding(self) -> bool:
        """Whether the next step of this sequence is one decode row: its prompt is computed and one token is
        left, the one it sampled last (a recomputation after preemption is prefill rows)."""
        return (self.num_computed_tokens >= len(self.prompt_token_ids)
                and self.num_tokens - self.num_computed_tokens == 1)

    def tokens(self, start: int, end: int) -> list[int]:
        """Token ids of positions [start, end) across prompt and output."""
        p = len(self.prompt_token_ids)
        if end <= p:
            return self.prompt_token_ids[start:end]
        return (self.prompt_token_ids + self.output_token_ids)[start:end]

    @property
    def finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED
