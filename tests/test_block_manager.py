"""KV-cache block manager: free list, reference counts, prefix caching by chained hashes."""

from __future__ import annotations

import torch

from inferd.engine.block_manager import BlockManager
from inferd.engine.sampling_params import SamplingParams
from inferd.engine.sequence import Sequence


def make_seq(rid: str, tokens: list[int]) -> Sequence:
    return Sequence(request_id=rid, prompt_token_ids=tokens, params=SamplingParams(max_tokens=8), max_tokens=8,
                    detokenizer=None, generator=torch.Generator())


def compute(bm: BlockManager, seq: Sequence, n: int) -> None:
    """What the engine does after a step computed ``n`` tokens of ``seq``."""
    seq.num_computed_tokens += n
    bm.cache_full_blocks(seq)


def test_allocate_and_free_return_every_block():
    bm = BlockManager(num_blocks=8, block_size=4)
    seq = make_seq("a", list(range(10)))
    assert bm.allocate_slots(seq, 10)
    assert len(seq.block_table) == 3 and bm.num_free_blocks == 5
    assert all(bm.ref_count[b] == 1 for b in seq.block_table)
    bm.free(seq)
    assert bm.num_free_blocks == 8 and seq.block_table == []
    assert bm.num_used_blocks == 0


def test_allocation_fails_without_side_effects_when_full():
    bm = BlockManager(num_blocks=2, block_size=4)
    seq = make_seq("a", list(range(12)))
    assert not bm.allocate_slots(seq, 12)
    assert seq.block_table == [] and bm.num_free_blocks == 2


def test_prefix_blocks_are_shared_and_refcounted():
    bm = BlockManager(num_blocks=16, block_size=4)
    a = make_seq("a", list(range(10)))
    assert bm.allocate_slots(a, 10)
    compute(bm, a, 10)  # two full blocks are now cached
    b = make_seq("b", list(range(8)) + [99, 98, 97])
    hits = bm.get_computed_blocks(b)
    assert hits == a.block_table[:2]
    assert bm.allocate_slots(b, b.num_tokens - 8, hits)
    assert b.num_computed_tokens == 8 and b.num_cached_tokens == 8
    assert b.block_table[:2] == a.block_table[:2]
    assert [bm.ref_count[x] for x in a.block_table[:2]] == [2, 2]
    bm.free(a)
    assert [bm.ref_count[x] for x in b.block_table[:2]] == [1, 1]
    bm.free(b)
    assert bm.num_used_blocks == 0


def test_the_last_token_is_never_taken_from_the_cache():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = make_seq("a", list(range(8)))
    bm.allocate_slots(a, 8)
    compute(bm, a, 8)
    same = make_seq("b", list(range(8)))
    assert len(bm.get_computed_blocks(same)) == 1  # 8 tokens: the second block holds the last token


def test_different_prefix_does_not_hit():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = make_seq("a", list(range(9)))
    bm.allocate_slots(a, 9)
    compute(bm, a, 9)
    # Same second block, different first block: the chained hash differs.
    b = make_seq("b", [7, 7, 7, 7, 4, 5, 6, 7, 1])
    assert bm.get_computed_blocks(b) == []


def test_freed_cached_blocks_are_reused_then_evicted_lru():
    bm = BlockManager(num_blocks=4, block_size=4)
    a = make_seq("a", list(range(9)))
    bm.allocate_slots(a, 9)
    compute(bm, a, 9)
    bm.free(a)
    assert bm.num_free_blocks == 4
    # Still cached after free: a new request with the prefix revives the blocks.
    b = make_seq("b", list(range(9)))
    hits = bm.get_computed_blocks(b)
    assert len(hits) == 2
    assert bm.allocate_slots(b, 1, hits)
    bm.free(b)
    # A request that needs every block evicts the cached ones.
    c = make_seq("c", [50 + i for i in range(16)])
    assert bm.get_computed_blocks(c) == []
    assert bm.allocate_slots(c, 16)
    assert bm.cached == {}
    d = make_seq("d", list(range(9)))
    assert bm.get_computed_blocks(d) == []


def test_prefix_caching_off():
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    a = make_seq("a", list(range(9)))
    bm.allocate_slots(a, 9)
    compute(bm, a, 9)
    assert bm.get_computed_blocks(make_seq("b", list(range(9)))) == []
