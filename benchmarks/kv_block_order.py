"""A/B of the KV block allocator's runs (inferd.engine.block_manager) on a server that has been up a while, in one
process: two engines, A handing out blocks from the free queue's head one at a time in queue order (as before
stop 38) and B in runs (this checkout), each first aged by the same stream of requests of random lengths at
``--concurrency`` (continuous batching, greedy, ignore_eos; random token ids), so that its free queue holds blocks
in the order that traffic leaves them. Then, in alternating rounds, each engine takes ``--concurrency`` new
requests of ``--prompt-len`` tokens and runs ``--steps`` decode steps; reported: the median step of each round, the
median over rounds, and how many of the running sequences' consecutive table entries are consecutive block ids.

    python benchmarks/kv_block_order.py --age 300 --rounds 4
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
import types

from inferd.config import EngineConfig
from inferd.engine.llm_engine import LLMEngine
from inferd.engine.sampling_params import SamplingParams


def one_at_a_time(self, seq, need: int) -> list[int]:
    """Engine A's ``BlockManager._take_run``: exactly ``need`` blocks from the free queue's head, in queue order
    (the allocator before stop 38; nothing is left over for a reserve)."""
    run = [self.free_queue.popitem(last=False)[0] for _ in range(need)]
    self.reserves[id(seq)] = run
    for b in run:
        self.reserve_of[b] = run
    return run


def add(e: LLMEngine, rid: str, prompt: list[int], max_tokens: int) -> None:
    e.add_request(rid, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0))


def age(e: LLMEngine, n: int, concurrency: int, seed: int) -> None:
    """Serve ``n`` requests (prompts 50-400 random tokens, 20-400 output tokens), ``concurrency`` at a time."""
    rng = random.Random(seed)
    todo = [([rng.randrange(100, 40000) for _ in range(rng.randint(50, 400))], rng.randint(20, 400))
            for _ in range(n)]
    i = 0
    while todo or e.has_unfinished():
        while todo and len(e.seqs) < concurrency:
            prompt, max_tokens = todo.pop()
            add(e, f"age{i}", prompt, max_tokens)
            i += 1
        e.step()


def in_order(e: LLMEngine) -> float:
    """Fraction of the running sequences' next table entries that are the next block id."""
    pairs = [(a, b) for s in e.seqs.values() for a, b in zip(s.block_table, s.block_table[1:])]
    return sum(b == a + 1 for a, b in pairs) / max(len(pairs), 1)


def round_time(e: LLMEngine, r: int, args, rng: random.Random) -> tuple[float, float]:
    """Median decode step (seconds) of ``args.concurrency`` new requests, and their blocks' order."""
    for i in range(args.concurrency):
        add(e, f"r{r}-{i}", [rng.randrange(100, 40000) for _ in range(args.prompt_len)], args.steps + 8)
    while any(s.num_computed_tokens < s.num_prompt_tokens for s in e.seqs.values()):
        e.step()
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        e.step()
        times.append(time.perf_counter() - t0)
    order = in_order(e)
    while e.has_unfinished():
        e.step()
    return statistics.median(times), order


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--age", type=int, default=300, help="requests each engine serves before it is measured")
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--steps", type=int, default=64, help="decode steps timed per round")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--kv-bytes", type=int, default=512 * 1024**2, help="KV cache budget (the server's default)")
    args = ap.parse_args()
    if min(args.age, args.concurrency, args.prompt_len, args.steps, args.rounds) < 1:
        ap.error("every count must be at least 1")
    engines = {}
    for name in ("A: one block at a time", "B: runs"):
        e = LLMEngine(EngineConfig(max_num_seqs=args.concurrency, kv_cache_memory_bytes=args.kv_bytes))
        e.collapse_weights()
        if name.startswith("A"):
            e.block_manager._take_run = types.MethodType(one_at_a_time, e.block_manager)
        t0 = time.perf_counter()
        age(e, args.age, args.concurrency, seed=0)
        print(f"{name}: aged by {args.age} requests in {time.perf_counter() - t0:.0f} s", flush=True)
        engines[name] = e
    steps: dict[str, list[float]] = {k: [] for k in engines}
    orders: dict[str, list[float]] = {k: [] for k in engines}
    for r in range(args.rounds):
        for name in (list(engines) if r % 2 else list(engines)[::-1]):
            t, order = round_time(engines[name], r, args, random.Random(r))
            steps[name].append(t)
            orders[name].append(order)
            print(f"round {r} {name}: decode step {t * 1e3:.2f} ms, next blocks in order {order:.2f}", flush=True)
    (a, ta), (b, tb) = ((k, statistics.median(v)) for k, v in steps.items())
    print(f"{a}: {ta * 1e3:.2f} ms; {b}: {tb * 1e3:.2f} ms; {ta / tb:.2f}x (medians of {args.rounds} rounds of "
          f"{args.steps} steps at {args.concurrency} sequences, prompts of {args.prompt_len} tokens)")


if __name__ == "__main__":
    main()
