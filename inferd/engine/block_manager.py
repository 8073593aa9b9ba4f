"""KV-cache block manager: free list, reference counts and prefix caching.

Blocks of ``block_size`` tokens are allocated from a free queue and returned to it when no sequence
references them. A full block is identified by a chained hash of its tokens and its parent block's hash
(vLLM's automatic prefix caching), so two requests with the same prefix share the same physical blocks.
A freed block keeps its hash and content until it is handed out again: freed blocks with a hash go to
the tail of the queue (evicted last, least recently used first), blocks without one to the head.

A sequence takes its blocks a run at a time: what it needs now and up to ``RUN_BLOCKS`` more (as far as its
``max_tokens`` can reach), starting at the queue's head (the oldest free block) and following its free successors
by id, then the next oldest's, sorted; the rest of the run is its reserve for the decode steps to come. Decode attention reads a sequence's blocks in table order, one head's block (``block_size``
keys) at a time: blocks handed out one at a time to 32 sequences growing together end up, once the queue has been
through a few thousand requests, in no order at all, and that pattern was read 1.13-1.36x slower than the same
tables in runs (docs/performance.md, stop 38). A reserve is still free: it counts in ``num_free_blocks``, its
blocks keep their hash and can be revived by a prefix hit, a sequence that finds the queue empty takes blocks from
the largest other reserve, and what is left returns to the queue's head when the sequence is freed.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict

import numpy as np

from inferd.engine.sequence import Sequence

RUN_BLOCKS = 16
"""Blocks a sequence takes beyond its present need, at most (while its ``max_tokens`` may still fill them)."""


def block_hash(parent: bytes | None, token_ids: list[int]) -> bytes:
    """Chained hash of one full block: BLAKE2b-128 over the parent's hash and the block's token ids."""
    h = hashlib.blake2b(digest_size=16)
    if parent is not None:
        h.update(parent)
    h.update(np.asarray(token_ids, dtype=np.int64).tobytes())
    return h.digest()


class BlockManager:
    """Owns the block ids of the KV cache; the scheduler's only view of KV memory.

    Args:
        num_blocks: blocks in the cache.
        block_size: tokens per block.
        enable_prefix_caching: share full blocks between sequences with equal prefixes.
        run_blocks: blocks a sequence takes beyond its present need, at most, as a reserve (0: only what it needs;
            benchmarks/kv_block_order.py compares runs with the allocator before stop 38).
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 run_blocks: int = RUN_BLOCKS) -> None:
        if num_blocks < 1:
            raise ValueError("the KV cache must hold at least one block")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.run_blocks = run_blocks
        self.ref_count = [0] * num_blocks
        self.hash_of: list[bytes | None] = [None] * num_blocks
        self.cached: dict[bytes, int] = {}
        self.free_queue: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.reserves: dict[int, list[int]] = {}  # id(sequence) -> its reserve, ascending block ids
        self.reserve_of: dict[int, list[int]] = {}  # block id -> the reserve holding it

    @property
    def num_reserved(self) -> int:
        """Free blocks held in sequences' reserves."""
        return len(self.reserve_of)

    @property
    def num_free_blocks(self) -> int:
        """Blocks no sequence references: in the free queue or in a sequence's reserve."""
        return len(self.free_queue) + self.num_reserved

    @property
    def num_used_blocks(self) -> int:
        """Blocks referenced by at least one sequence."""
        return self.num_blocks - self.num_free_blocks

    def _hashes(self, seq: Sequence, num_full: int) -> list[bytes]:
        bs = self.block_size
        while len(seq.block_hashes) < num_full:
            i = len(seq.block_hashes)
            parent = seq.block_hashes[-1] if i else None
            seq.block_hashes.append(block_hash(parent, seq.tokens(i * bs, (i + 1) * bs)))
        return seq.block_hashes[:num_full]

    def get_computed_blocks(self, seq: Sequence) -> list[int]:
        """Cached blocks holding a prefix of ``seq``'s tokens, longest first match.

        The last token is never taken from the cache: its logits must be computed.
        """
        if not self.enable_prefix_caching:
            return []
        num_full = (seq.num_tokens - 1) // self.block_size
        hits = []
        for h in self._hashes(seq, num_full):
            b = self.cached.get(h)
            if b is None:
                break
            hits.append(b)
        return hits

    def allocate_slots(self, seq: Sequence, num_new_tokens: int, computed_blocks: list[int] = ()) -> bool:
        """Give ``seq`` blocks for ``num_new_tokens`` more tokens after its computed ones.

        Args:
            computed_blocks: prefix-cache hits from :meth:`get_computed_blocks` (only when the sequence
                holds no blocks yet); they count as computed tokens.

        Returns:
            False, changing nothing, when there are not enough free blocks.
        """
        bs = self.block_size
        num_computed = seq.num_computed_tokens + len(computed_blocks) * bs
        need = -(-(num_computed + num_new_tokens) // bs) - len(seq.block_table) - len(computed_blocks)
        revived = sum(1 for b in computed_blocks if self.ref_count[b] == 0)
        if need > self.num_free_blocks - revived:
            return False
        for b in computed_blocks:
            if self.ref_count[b] == 0:
                self._unfree(b)
            self.ref_count[b] += 1
        seq.block_table.extend(computed_blocks)
        seq.num_computed_tokens = num_computed
        if computed_blocks:
            seq.num_cached_tokens = len(computed_blocks) * bs
        if need <= 0:
            return True
        reserve = self.reserves.get(id(seq))
        for i in range(need):
            if not reserve:
                reserve = self._take_run(seq, need - i)
            b = reserve.pop(0)
            del self.reserve_of[b]
            h = self.hash_of[b]
            if h is not None:
                if self.cached.get(h) == b:
                    del self.cached[h]
                self.hash_of[b] = None
            self.ref_count[b] = 1
            seq.block_table.append(b)
        return True

    def _take_run(self, seq: Sequence, need: int) -> list[int]:
        """A new reserve for ``seq``: ``need`` blocks and up to ``run_blocks`` more (as many as its ``max_tokens`` can
        still fill) from the free queue's head, sorted; from the largest other reserve when the queue is empty."""
        bs = self.block_size
        room = -(-(seq.num_prompt_tokens + seq.max_tokens) // bs) - len(seq.block_table) - need
        n = min(need + min(max(room, 0), self.run_blocks), len(self.free_queue))
        run = []
        while len(run) < n:  # the oldest free block and the free ones after it, then the next oldest's
            b = next(iter(self.free_queue))
            while len(run) < n and b in self.free_queue:
                del self.free_queue[b]
                run.append(b)
                b += 1
        run.sort()
        if not run:  # every free block is in a reserve: take the back of the largest
            other = max(self.reserves.values(), key=len)
            run = other[-need:]
            del other[-need:]
        self.reserves[id(seq)] = run
        for b in run:
            self.reserve_of[b] = run
        return run

    def _unfree(self, b: int) -> None:
        """Take free block ``b`` (revived by a prefix hit) out of the free queue or a reserve."""
        reserve = self.reserve_of.pop(b, None)
        if reserve is None:
            del self.free_queue[b]
        else:
            reserve.remove(b)

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register the blocks that ``seq`` has completely computed, so later requests can share them."""
        if not self.enable_prefix_caching:
            return
        num_full = seq.num_computed_tokens // self.block_size
        for i, h in enumerate(self._hashes(seq, num_full)):
            b = seq.block_table[i]
            if self.hash_of[b] is None and h not in self.cached:
                self.cached[h] = b
                self.hash_of[b] = h

    def free(self, seq: Sequence) -> None:
        """Drop ``seq``'s references; blocks nobody references return to the free queue, and its reserve to the
        queue's head (it was taken from there)."""
        for b in reversed(seq.block_table):
            self.ref_count[b] -= 1
            if self.ref_count[b] == 0:
                self.free_queue[b] = None
                if self.hash_of[b] is None:
                    self.free_queue.move_to_end(b, last=False)
        seq.block_table = []
        reserve = self.reserves.pop(id(seq), [])
        for b in reversed(reserve):
            del self.reserve_of[b]
            self.free_queue[b] = None
            self.free_queue.move_to_end(b, last=False)
