"""Scheduler: token budget, chunked prefill, prefix reuse, preemption and resume, abort."""

from __future__ import annotations

from inferd.engine.block_manager import BlockManager
from inferd.engine.scheduler import Scheduler
from inferd.engine.sequence import SequenceStatus
from test_block_manager import make_seq


def run_step(sched: Scheduler, sampled_token: int = 1):
    """One step without a model: computed tokens advance; sequences at their end get a token."""
    out = sched.schedule()
    for item in out.scheduled:
        seq = item.seq
        seq.num_computed_tokens += item.num_new_tokens
        sched.block_manager.cache_full_blocks(seq)
        if seq.num_computed_tokens == seq.num_tokens:
            seq.output_token_ids.append(sampled_token)
    return out


def test_decodes_and_prefills_share_the_budget_with_chunking():
    bm = BlockManager(64, 4)
    sched = Scheduler(bm, max_num_batched_tokens=10, max_num_seqs=8)
    a = make_seq("a", list(range(3)))
    sched.add(a)
    run_step(sched)  # a: prefill 3
    assert a.output_token_ids == [1]
    long = make_seq("long", list(range(100, 125)))  # 25 tokens
    sched.add(long)
    out = run_step(sched)
    assert [(s.seq.request_id, s.num_new_tokens) for s in out.scheduled] == [("a", 1), ("long", 9)]
    out = run_step(sched)
    assert [(s.seq.request_id, s.num_new_tokens) for s in out.scheduled] == [("a", 1), ("long", 9)]
    assert long.output_token_ids == []  # a partial prefill samples nothing
    out = run_step(sched)
    assert [(s.seq.request_id, s.num_new_tokens) for s in out.scheduled] == [("a", 1), ("long", 7)]
    assert long.output_token_ids == [1] and long.num_computed_tokens == 25
    out = run_step(sched)
    assert [(s.seq.request_id, s.num_new_tokens) for s in out.scheduled] == [("a", 1), ("long", 1)]



def test_long_prompt_tokens_beside_decodes_are_limited():
    """max_prefill_tokens_with_decodes = L: a step with D decode rows computes at most L * W + D tokens of long
    prompts (over long_prefill_token_threshold), W the long prompts running with prompt tokens left or waiting,
    a running partial prefill and newly admitted prompts together; with nothing decoding, the whole budget; short
    prompts are not held back."""
    sched = Scheduler(BlockManager(256, 4), max_num_batched_tokens=64, max_num_seqs=16,
                      max_prefill_tokens_with_decodes=4, long_prefill_token_threshold=8)
    alone = make_seq("alone", list(range(30)))
    sched.add(alone)
    assert [(s.seq.request_id, s.num_new_tokens) for s in run_step(sched).scheduled] == [("alone", 30)]
    long = make_seq("long", list(range(100, 160)))
    sched.add(long)
    out = run_step(sched)  # "alone" decodes, one long prompt: 4 * 1 + 1 = 5 of its tokens
    assert [(s.seq.request_id, s.num_new_tokens) for s in out.scheduled] == [("alone", 1), ("long", 5)]
    out = run_step(sched)  # the same while it is running
    assert [(s.seq.request_id, s.num_new_tokens) for s in out.scheduled] == [("alone", 1), ("long", 5)]
    backlog = [make_seq(f"b{i}", list(range(200 + 20 * i, 220 + 20 * i))) for i in range(3)]
    for b in backlog:
        sched.add(b)
    out = run_step(sched)  # W = 4 (the running one and 3 waiting): 4 * 4 + 1 = 17, first come first served
    assert [(s.seq.request_id, s.num_new_tokens) for s in out.scheduled] == [("alone", 1), ("long", 17)]
    out = run_step(sched)  # "long" has 60 - 27 = 33 left: it takes 17 again
    assert [(s.seq.request_id, s.num_new_tokens) for s in out.scheduled] == [("alone", 1), ("long", 17)]
    out = run_step(sched)  # its last 16 tokens, then the next in line gets the 17th
    assert [(s.seq.request_id, s.num_new_tokens) for s in out.scheduled] == [("alone", 1), ("long", 16), ("b0", 1)]
    out = run_step(sched)  # 2 decoding ("long" now too), W = 3: 4 * 3 + 2 = 14 (b0's 19 left, then b1)
    assert [(s.seq.request_id, s.num_new_tokens) for s in out.scheduled] == [
        ("alone", 1), ("long", 1), ("b0", 14)]
    out = run_step(sched)  # W = 3 again, 14 tokens: b0's last 5, then 9 of b1
    assert [(s.seq.request_id, s.num_new_tokens) for s in out.scheduled] == [
        ("alone", 1), ("long", 1), ("b0", 5), ("b1", 9)]
    for seq in (long, *backlog):
        sched.finish(seq, "abort")
    short = make_seq("short", list(range(400, 408)))  # 8 tokens, not long: not held back to 4 * 1 + 1
    sched.add(short)
    out = run_step(sched)
    assert [(s.seq.request_id, s.num_new_tokens) for s in out.scheduled] == [("alone", 1), ("short", 8)]
    for seq in (alone, short):
        sched.finish(seq, "abort")
    idle = make_seq("idle", list(range(500, 560)))
    sched.add(idle)
    out = run_step(sched)  # nothing decoding: the whole budget
    assert [(s.seq.request_id, s.num_new_tokens) for s in out.scheduled] == [("idle", 60)]


def test_long_prompts_leave_every_decode_row_its_token():
    """L * W + D is capped at the budget less D: a long prompt ahead of decoding requests in the running list
    leaves each of them its token however many long prompts wait; W counts only waiting prompts this step could
    admit (room under max_num_seqs) of no lower priority than the decoding requests."""
    sched = Scheduler(BlockManager(1024, 4), max_num_batched_tokens=40, max_num_seqs=16,
                      max_prefill_tokens_with_decodes=4, long_prefill_token_threshold=8)
    x = make_seq("x", [1, 2])
    sched.add(x)
    run_step(sched)
    long = make_seq("long", list(range(100, 200)))
    d0, d1 = make_seq("d0", [3, 4]), make_seq("d1", [5, 6])
    for seq in (long, d0, d1):
        sched.add(seq)
    out = run_step(sched)  # x decodes: the long prompt gets 4 * 1 + 1, the short ones are not held back
    assert [(s.seq.request_id, s.num_new_tokens) for s in out.scheduled] == [
        ("x", 1), ("long", 5), ("d0", 2), ("d1", 2)]
    backlog = [make_seq(f"b{i}", list(range(300 + 20 * i, 320 + 20 * i))) for i in range(20)]
    for b in backlog:
        sched.add(b)
    # D = 3; W = 11 (12 places free, at most 40 // 4 + 1): 4 * 11 + 3 = 47 > 40, capped at 40 - 3.
    out = run_step(sched)
    assert [(s.seq.request_id, s.num_new_tokens) for s in out.scheduled] == [
        ("x", 1), ("long", 37), ("d0", 1), ("d1", 1)]
    for b in backlog:
        sched.finish(b, "abort")
    background = [make_seq(f"g{i}", list(range(700 + 20 * i, 720 + 20 * i))) for i in range(5)]
    for g in background:
        g.priority = -1
        sched.add(g)
    out = run_step(sched)  # lower priority than the decoding requests: W = 1, 4 * 1 + 3
    assert [(s.seq.request_id, s.num_new_tokens) for s in out.scheduled] == [
        ("x", 1), ("long", 7), ("d0", 1), ("d1", 1)]
    for g in background:
        sched.finish(g, "abort")
    sched.max_num_seqs = 4
    for i in range(5):
        sched.add(make_seq(f"c{i}", list(range(900 + 20 * i, 920 + 20 * i))))
    out = run_step(sched)  # no room to admit them: W = 1
    assert [(s.seq.request_id, s.num_new_tokens) for s in out.scheduled] == [
        ("x", 1), ("long", 7), ("d0", 1), ("d1", 1)]


def test_first_come_first_served_and_max_num_seqs():
    sched = Scheduler(BlockManager(64, 4), max_num_batched_tokens=100, max_num_seqs=2)
    seqs = [make_seq(str(i), [i, i + 1]) for i in range(3)]
    for s in seqs:
        sched.add(s)
    out = run_step(sched)
    assert [s.seq.request_id for s in out.scheduled] == ["0", "1"]
    assert seqs[2].status == SequenceStatus.WAITING
    sched.finish(seqs[0], "stop")
    out = run_step(sched)
    assert [s.seq.request_id for s in out.scheduled] == ["1", "2"]


def test_prefix_cache_hit_skips_computed_tokens():
    bm = BlockManager(64, 4)
    sched = Scheduler(bm, 100, 8)
    a = make_seq("a", list(range(13)))
    sched.add(a)
    run_step(sched)
    b = make_seq("b", list(range(12)) + [77, 78])
    sched.add(b)
    out = run_step(sched)
    item = [s for s in out.scheduled if s.seq is b][0]
    assert b.num_cached_tokens == 12 and item.num_new_tokens == 2


def test_preemption_by_recompute_and_resume():
    bm = BlockManager(num_blocks=6, block_size=4)
    sched = Scheduler(bm, 100, 8)
    a = make_seq("a", list(range(8)))  # 2 blocks
    b = make_seq("b", list(range(50, 58)))  # 2 blocks
    sched.add(a)
    sched.add(b)
    run_step(sched)
    assert bm.num_free_blocks == 2
    # Each decode of 4 more tokens needs a block; a runs first, b is preempted when blocks run out.
    preempted = []
    for _ in range(8):
        out = run_step(sched)
        preempted += [s.request_id for s in out.preempted]
    assert preempted and preempted[0] == "b"
    assert b.num_preemptions >= 1
    # b is recomputed from the start (prompt and its output so far) once a finishes.
    sched.finish(a, "stop")
    assert b.status == SequenceStatus.WAITING and b.num_computed_tokens == 0 and b.block_table == []
    tokens_before = b.num_tokens
    out = run_step(sched)
    item = [s for s in out.scheduled if s.seq is b][0]
    # Its freed blocks kept their hashes, so its two full prompt blocks come back from the prefix cache
    # (the block it was decoding into was not full when it was preempted).
    assert b.num_cached_tokens == 8
    assert item.num_new_tokens == tokens_before - b.num_cached_tokens
    assert b.status == SequenceStatus.RUNNING and b.num_computed_tokens == tokens_before
    assert b.num_tokens == tokens_before + 1  # resumed: it sampled its next token


def test_finish_frees_blocks_of_running_and_waiting():
    bm = BlockManager(16, 4)
    sched = Scheduler(bm, 6, 8)
    a = make_seq("a", list(range(12)))
    sched.add(a)
    run_step(sched)  # a partially prefilled: holds 2 blocks
    assert bm.num_used_blocks == 2
    sched.finish(a, "abort")
    assert bm.num_used_blocks == 0 and a.status == SequenceStatus.FINISHED
    w = make_seq("w", [1, 2, 3])
    sched.add(w)
    sched.finish(w, "abort")
    assert not sched.has_work()
