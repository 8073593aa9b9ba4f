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


def grow(bm: BlockManager, seq: Sequence, n: int) -> None:
    """What ``n`` decode steps do to ``seq``: one more token each, whose block comes from the manager."""
    for _ in range(n):
        seq.output_token_ids.append(1)
        assert bm.allocate_slots(seq, 1)
        compute(bm, seq, 1)


def decoding_seq(rid: str, prompt_len: int, max_tokens: int) -> Sequence:
    return Sequence(request_id=rid, prompt_token_ids=[hash((rid, i)) % 1000 for i in range(prompt_len)],
                    params=SamplingParams(max_tokens=max_tokens), max_tokens=max_tokens, detokenizer=None,
                    generator=torch.Generator())


def test_sequences_growing_together_keep_their_blocks_in_runs():
    """Four sequences decoding in lockstep each get ascending, consecutive block ids (decode attention reads a
    sequence's blocks in table order), up to the run that max_tokens allows; then the next run."""
    bm = BlockManager(num_blocks=64, block_size=4)
    seqs = [decoding_seq(r, 6, 30) for r in "abcd"]
    for s in seqs:
        assert bm.allocate_slots(s, 6)
        compute(bm, s, 6)
    for _ in range(30):
        for s in seqs:
            grow(bm, s, 1)
    for s in seqs:
        t = s.block_table
        assert len(t) == 9  # 36 tokens
        assert t == list(range(t[0], t[0] + 9)), t
    assert bm.num_used_blocks == 36 and bm.num_free_blocks == 28 and bm.num_reserved == 0


def test_a_reserve_is_free_and_goes_to_whoever_needs_it():
    """A sequence's unused run still counts as free: another sequence takes from it when the queue is empty,
    rather than failing or preempting, and what is left returns to the queue when its owner is freed."""
    bm = BlockManager(num_blocks=10, block_size=4)
    a = decoding_seq("a", 4, 100)
    assert bm.allocate_slots(a, 4)  # 1 block, and a run of up to RUN_BLOCKS more: the other 9
    assert len(a.block_table) == 1 and bm.num_reserved == 9 and bm.num_free_blocks == 9
    b = decoding_seq("b", 20, 4)
    assert bm.allocate_slots(b, 20)  # 5 blocks, all from a's run
    assert bm.num_used_blocks == 6 and bm.num_free_blocks == 4
    c = decoding_seq("c", 20, 4)
    assert not bm.allocate_slots(c, 20)  # 5 > 4 free: refused, nothing changed
    assert c.block_table == [] and bm.num_free_blocks == 4
    grow(bm, a, 3)
    assert len(a.block_table) == 1  # still within its first block
    bm.free(a)
    assert bm.num_free_blocks == 5 and bm.num_reserved == 0 and len(bm.free_queue) == 5
    assert bm.allocate_slots(c, 20)
    bm.free(b)
    bm.free(c)
    assert bm.num_used_blocks == 0 and len(bm.free_queue) == 10


def test_a_cached_block_in_a_reserve_is_revived_by_a_prefix_hit():
    bm = BlockManager(num_blocks=8, block_size=4)
    filler = decoding_seq("f", 23, 1)  # six blocks, no room for a run beyond them
    assert bm.allocate_slots(filler, 23) and filler.block_table == [0, 1, 2, 3, 4, 5]
    a = decoding_seq("a", 8, 4)
    assert bm.allocate_slots(a, 8) and a.block_table == [6, 7] and bm.num_reserved == 0  # the queue is empty
    compute(bm, a, 8)
    bm.free(a)  # two cached blocks back in the queue, at its tail
    bm.free(filler)  # six blocks without a hash, at its head
    b = decoding_seq("b", 4, 100)
    assert bm.allocate_slots(b, 4)  # one block and a run of the other seven, the cached two included
    assert b.block_table == [0] and bm.reserves[id(b)] == [1, 2, 3, 4, 5, 6, 7]
    c = decoding_seq("c", 0, 1)
    c.prompt_token_ids = a.prompt_token_ids + [5]
    hits = bm.get_computed_blocks(c)
    assert hits == [6, 7]
    assert bm.allocate_slots(c, 1, hits)
    assert c.block_table == [6, 7, 5] and c.num_cached_tokens == 8  # its third block from the back of b's run
    assert bm.reserves[id(b)] == [1, 2, 3, 4] and bm.num_reserved == 4
    assert bm.num_used_blocks == 4


def test_random_traffic_keeps_every_block_accounted_for():
    """Random admissions, decode steps, prefix hits, refusals and frees: every block is, at every point, in
    exactly one of the free queue, a reserve, or a sequence's table with a matching reference count."""
    import random

    rng = random.Random(0)
    bm = BlockManager(num_blocks=40, block_size=4)
    prefixes = [[rng.randrange(50) for _ in range(12)] for _ in range(3)]
    live: list[Sequence] = []

    def check() -> None:
        refs = [0] * bm.num_blocks
        for s in live:
            for b in s.block_table:
                refs[b] += 1
        reserved = [b for r in bm.reserves.values() for b in r]
        assert len(reserved) == len(set(reserved)) == bm.num_reserved == len(bm.reserve_of)
        assert set(reserved).isdisjoint(bm.free_queue)
        for b in range(bm.num_blocks):
            assert bm.ref_count[b] == refs[b]
            assert (refs[b] > 0) + (b in bm.free_queue) + (b in bm.reserve_of) == 1, b
        assert bm.num_free_blocks + bm.num_used_blocks == bm.num_blocks
        for h, b in bm.cached.items():
            assert bm.hash_of[b] == h

    for i in range(3000):
        op = rng.random()
        if op < 0.3 and len(live) < 8:
            s = decoding_seq(f"s{i}", 0, rng.randrange(1, 40))
            s.prompt_token_ids = rng.choice(prefixes)[: rng.randrange(1, 13)] + [rng.randrange(50)
                                                                                  for _ in range(rng.randrange(9))]
            hits = bm.get_computed_blocks(s)
            if bm.allocate_slots(s, s.num_tokens - len(hits) * 4, hits):
                compute(bm, s, s.num_tokens - s.num_computed_tokens)
                live.append(s)
        elif op < 0.85 and live:
            s = rng.choice(live)
            s.output_token_ids.append(rng.randrange(50))
            if bm.allocate_slots(s, 1):
                compute(bm, s, 1)
            else:
                s.output_token_ids.pop()
        elif live:
            bm.free(live.pop(rng.randrange(len(live))))
        check()
    for s in live:
        bm.free(s)
    live.clear()
    check()
    assert bm.num_free_blocks == bm.num_blocks and bm.reserves == {}
