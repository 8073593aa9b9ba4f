"""Continuous-batching scheduler with chunked prefill, prefix caching and preemption by recompute.

There are no prefill and decode phases (vLLM v1's design): every request has ``num_computed_tokens`` and
``num_tokens``, and each step shares a budget of ``max_num_batched_tokens`` among the requests that still
have tokens to compute — running ones first (so decodes keep flowing while a long prompt is split over
several steps), then waiting ones by priority class (higher first) and, within a class, in arrival order
(first come, first served). While requests are decoding, a step computes at most
``L * W + D`` tokens of long prompts (over ``long_prefill_token_threshold`` tokens), where L is
``max_prefill_tokens_with_decodes``, W the long prompts being prefilled or waiting to be (of no lower priority
than the decoding requests) and D the requests decoding, and never so many that a decode row goes without its token
(stall-free batching, Agrawal et al. 2024, "Taming Throughput-Latency Tradeoff in LLM Inference with
Sarathi-Serve", OSDI). Where a step's cost grows with its rows (a CPU's GEMMs are compute-bound beyond a few
rows), one long prompt (W = 1) then adds at most about one decode step to a step, so running streams keep their
inter-token latency while it is prefilled beside them (benchmarks/chunked_prefill.py); a backlog of long prompts
gets a share of each step in proportion, so that it drains instead of being prefilled L + D tokens a step while
the decode batch stays small (docs/performance.md, stop 39). Short prompts are not held back: under a small
limit, a wave of them arriving while a few requests still decode would wait many steps. When the KV cache runs
out of blocks, the most recently admitted running request is preempted: its blocks are freed and it is
put back at the head of its class in the waiting queue, to be recomputed (Kwon et al. 2023, section 4.5).
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from dataclasses import dataclass, field

from inferd.engine.block_manager import BlockManager
from inferd.engine.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledSequence:
    seq: Sequence
    num_new_tokens: int


@dataclass
class SchedulerOutput:
    """What one engine step computes.

    Attributes:
        scheduled: sequences and how many of their tokens to compute this step, in batch order.
        preempted: sequences preempted while scheduling.
    """

    scheduled: list[ScheduledSequence] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)


class Scheduler:
    """Decides which tokens of which requests run in each step.

    Args:
        block_manager: the KV-cache block manager.
        max_num_batched_tokens: token budget per step.
        max_num_seqs: most running requests.
        max_prefill_tokens_with_decodes: L, in tokens: in a step with D decode rows (D > 0), tokens of long prompts
            are at most ``L * W + D`` and at most ``max_num_batched_tokens - D``, W the long prompts running with
            prompt tokens left or waiting to be admitted (at least 1, see ``_num_long_prompts``); 0 = no limit but
            ``max_num_batched_tokens``. Inter-token latency grows with W: the limit is for one long prompt at a time,
            a backlog drains at about L tokens per step per prompt.
        long_prefill_token_threshold: prompts of more tokens than this are long.
    """

    def __init__(self, block_manager: BlockManager, max_num_batched_tokens: int, max_num_seqs: int,
                 max_prefill_tokens_with_decodes: int = 0, long_prefill_token_threshold: int = 256) -> None:
        self.block_manager = block_manager
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_prefill_tokens_with_decodes = max_prefill_tokens_with_decodes
        self.long_prefill_token_threshold = long_prefill_token_threshold
        self.max_num_seqs = max_num_seqs
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        """Queue a new request behind the waiting ones of its priority class or higher."""
        i = len(self.waiting)
        while i > 0 and self.waiting[i - 1].priority < seq.priority:
            i -= 1
        self.waiting.insert(i, seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        """Pick this step's work. Every scheduled sequence has blocks for its new tokens."""
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        num_decode = sum(1 for s in self.running if s.is_decoding)
        # Tokens of long prompts this step may still compute (unbounded with nothing decoding).
        limit = self.max_prefill_tokens_with_decodes
        long_budget = budget
        if limit and num_decode:
            # Never the budget's last D tokens: a long prompt ahead of them in the running list must leave every
            # decode row its token.
            long_budget = max(0, min(limit * self._num_long_prompts(budget // limit + 1) + num_decode,
                                     budget - num_decode))
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            long = self._is_long(seq)
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget, long_budget if long else budget)
            if num_new == 0:  # a long prompt waiting for the next step's budget
                i += 1
                continue
            while not self.block_manager.allocate_slots(seq, num_new):
                victim = self.running.pop()
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    num_new = 0
                    break
            if num_new == 0:
                continue
            out.scheduled.append(ScheduledSequence(seq, num_new))
            budget -= num_new
            if long:
                long_budget -= num_new
            i += 1

        if out.preempted:
            return out
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            long = self._is_long(seq)
            if long and long_budget <= 0:
                break  # first come, first served: no one passes it
            # A request that wants prompt logprobs must compute every prompt position.
            computed = (self.block_manager.get_computed_blocks(seq)
                        if not seq.block_table and seq.params.prompt_logprobs is None else [])
            num_cached = len(computed) * self.block_manager.block_size
            num_new = min(seq.num_tokens - seq.num_computed_tokens - num_cached, budget,
                          long_budget if long else budget)
            if not self.block_manager.allocate_slots(seq, num_new, computed):
                break
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            if seq.scheduled_time is None:
                seq.scheduled_time = time.monotonic()
            self.running.append(seq)
            out.scheduled.append(ScheduledSequence(seq, num_new))
            budget -= num_new
            if long:
                long_budget -= num_new
        return out

    def _num_long_prompts(self, cap: int) -> int:
        """W, at least 1 and at most ``cap``: the long prompts running with more than one prompt token left, and
        those waiting that this step could admit — among the first ``max_num_seqs - len(running)`` in line, and of
        no lower priority than the decoding requests (a backlog of background work does not slow their tokens)."""
        n = sum(map(self._is_long, self.running))
        floor = max(s.priority for s in self.running if s.is_decoding)
        for seq in itertools.islice(self.waiting, max(0, min(cap, self.max_num_seqs - len(self.running)))):
            if n >= cap or seq.priority < floor:
                break
            n += self._is_long(seq)
        return min(max(n, 1), cap)

    def _is_long(self, seq: Sequence) -> bool:
        """Whether the sequence's next tokens are part of a long prompt (recomputed output tokens count); one
        token left is a decode row's worth and does not count."""
        return (seq.num_prompt_tokens > self.long_prefill_token_threshold
                and seq.num_computed_tokens < seq.num_tokens - 1)

    def _preempt(self, seq: Sequence) -> None:
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        seq.status = SequenceStatus.WAITING
        i = 0
        while i < len(self.waiting) and self.waiting[i].priority > seq.priority:
            i += 1
        self.waiting.insert(i, seq)
        self.num_preemptions += 1

    def finish(self, seq: Sequence, reason: str) -> None:
        """Remove a running or waiting sequence and free its blocks."""
        if seq.status == SequenceStatus.FINISHED:
            return
        if seq.status == SequenceStatus.RUNNING:
            self.running.remove(seq)
        else:
            try:
                self.waiting.remove(seq)
            except ValueError:
                pass
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
