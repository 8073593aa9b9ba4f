"""Chunked prefill against running streams (issue 6, goal 3): what a long prompt does to the inter-token
latency (ITL) of requests already decoding, and what its own time to first token (TTFT) is, for several
per-step token budgets (``max_num_batched_tokens``) and limits on prompt tokens in steps with decode rows
(``max_prefill_tokens_with_decodes``, 0 = none; 12 is the default on a CPU with AMX, 6 with AVX512-BF16, 3 on others). In-process engine, so HTTP is not in the
figures.

    python benchmarks/chunked_prefill.py --setting 2048:0 --setting 64:0 --setting 2048:12 --streams 1

For each setting (budget:limit): an engine with ``--streams`` requests of 128 prompt tokens decoding (ignore_eos); their
ITL is measured alone (median step time over ``--steps`` steps: every running request gets one token per
step), then a ``--prompt-len``-token prompt arrives and is prefilled beside them: its TTFT, and the
running streams' ITL until its first token (median and largest step); then their ITL alone again over as many
steps. The ratio divides by the median of the steps alone before and after, since this machine's memory bandwidth,
which a decode step follows and a step with prompt rows does not, can change in the seconds of a prefill. The same
prompt alone on an idle engine gives its TTFT without company. Prefix caching is off so that every run computes the prompt. With
``--by-context``, the median step is also printed by how many of the long prompt's tokens were computed before it
(its rows' attention grows with them; docs/performance.md, stop 44).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from ab_decode import start_streams

from inferd.config import EngineConfig
from inferd.engine.llm_engine import LLMEngine
from inferd.engine.sampling_params import SamplingParams


def long_prompt(engine: LLMEngine, n: int, salt: int) -> list[int]:
    words = " ".join(f"record {salt}-{i}: value {i * 37 % 101} unit {i % 7}." for i in range(n))
    ids = engine.encode(words)[:n]
    if len(ids) < n:
        raise ValueError(f"prompt text too short for {n} tokens")
    return ids


def prefill_alone(engine: LLMEngine, ids: list[int], rid: str) -> float:
    """TTFT in seconds of ``ids`` on an idle engine."""
    t0 = time.perf_counter()
    engine.add_request(rid, ids, SamplingParams(max_tokens=1, temperature=0))
    while engine.has_unfinished():
        engine.step()
    return time.perf_counter() - t0


def step_times(engine: LLMEngine, steps: int) -> list[float]:
    """Wall time in seconds of each of ``steps`` engine steps."""
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
    return times


def measure(budget: int, limit: int, prompt_len: int, streams: int, steps: int,
            stack_max_rows: int | None = None) -> dict:
    """One setting (times in seconds); ``stack_max_rows``: the model's, where given (benchmarks/ab_stack_steps.py)."""
    engine = LLMEngine(EngineConfig(max_num_batched_tokens=budget, max_prefill_tokens_with_decodes=limit,
                                    enable_prefix_caching=False, kv_cache_memory_bytes=512 * 1024**2,
                                    max_model_len=4096))
    if stack_max_rows is not None:
        engine.runner.model.stack_max_rows = stack_max_rows
    engine.collapse_weights()  # as the server does after its first answer
    prefill_alone(engine, long_prompt(engine, prompt_len, 0), "warmup")
    ttft_alone = statistics.median(prefill_alone(engine, long_prompt(engine, prompt_len, i), f"alone{i}")
                                   for i in (1, 2))
    start_streams(engine, streams, max_tokens=3_000)
    alone = step_times(engine, steps)
    t_arrive = time.perf_counter()
    engine.add_request("long", long_prompt(engine, prompt_len, 3), SamplingParams(max_tokens=1, temperature=0))
    seq = engine.seqs["long"]
    during, ttft, by_context = [], None, {}
    while ttft is None:
        computed = seq.num_computed_tokens
        t0 = time.perf_counter()
        outs = engine.step()
        during.append(time.perf_counter() - t0)
        by_context.setdefault(computed // 400 * 400, []).append(during[-1])
        if any(o.request_id == "long" for o in outs):
            ttft = time.perf_counter() - t_arrive
    after = step_times(engine, steps)
    return {"budget": budget, "limit": limit, "itl_alone": statistics.median(alone + after),
            "itl_before": statistics.median(alone), "itl_after": statistics.median(after),
            "itl_during": statistics.median(during),
            "itl_max": max(during), "ttft": ttft, "ttft_alone": ttft_alone, "steps": len(during),
            "by_context": {c: statistics.median(v) for c, v in sorted(by_context.items())}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--setting", action="append", default=None,
                    help="max_num_batched_tokens:max_prefill_tokens_with_decodes (0 = no limit), e.g. 2048:12")
    ap.add_argument("--prompt-len", type=int, default=2000)
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--by-context", action="store_true",
                    help="also print the median step by the long prompt's computed tokens (400 at a time)")
    args = ap.parse_args()
    print(f"{args.streams} running streams, a {args.prompt_len}-token prompt arrives; {torch.get_num_threads()} "
          "threads; times in ms")
    print("| max_num_batched_tokens | max_prefill_tokens_with_decodes | streams' ITL alone: median of the steps before "
          "and after (before / after) | ITL during the prefill (median / max) | ratio | long prompt's TTFT beside them | "
          "its TTFT alone | steps |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for setting in args.setting or ["2048:0", "256:0", "64:0", "2048:12"]:
        budget, limit = (int(x) for x in setting.split(":"))
        r = measure(budget, limit, args.prompt_len, args.streams, args.steps)
        print(f"| {budget} | {limit} | {r['itl_alone'] * 1e3:.1f} ({r['itl_before'] * 1e3:.1f} / "
              f"{r['itl_after'] * 1e3:.1f}) | {r['itl_during'] * 1e3:.1f} / {r['itl_max'] * 1e3:.0f} | "
              f"{r['itl_during'] / r['itl_alone']:.2f}x | {r['ttft'] * 1e3:.0f} | {r['ttft_alone'] * 1e3:.0f} | "
              f"{r['steps']} |", flush=True)
        if args.by_context:
            print("  steps by the long prompt's computed tokens: " + ", ".join(
                f"{c}-{c + 399}: {t * 1e3:.1f} ms" for c, t in r["by_context"].items()), flush=True)


if __name__ == "__main__":
    main()
