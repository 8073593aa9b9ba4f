"""Steps with prompt rows in the compiled decoder stack against the per-operator path (issue 6; docs/performance.md,
stop 40), in one process, alternating: the model's ``stack_max_rows`` is set to 0 (steps with prompt rows per
operator, decode-only steps still in the stack) or left at ``STACK_MAX_ROWS``.

    python benchmarks/ab_stack_steps.py --streams 1,4 --limit 12 --rounds 3 --prefill-rows 8,16,32,64,96

Two measurements: ``chunked_prefill.measure`` (a ``--prompt-len``-token prompt arriving beside D streams: the
streams' ITL during its prefill over their ITL alone, and its TTFT), and a prompt of n tokens alone on an idle engine
(one prefill step of n rows, median over the rounds). Times in ms unless marked.
"""

from __future__ import annotations

import argparse
import statistics
import time

import chunked_prefill

from inferd.config import EngineConfig
from inferd.engine.llm_engine import LLMEngine
from inferd.engine.sampling_params import SamplingParams
from inferd.model import llama

PATHS = {"per operator": 0, "stack": llama.STACK_MAX_ROWS}


def set_path(engine: LLMEngine, path: str) -> None:
    engine.runner.model.stack_max_rows = PATHS[path]


def chunked(streams: int, limit: int, prompt_len: int, rounds: int) -> None:
    for _ in range(rounds):
        for path, rows in PATHS.items():
            r = chunked_prefill.measure(2048, limit, prompt_len, streams, 20, stack_max_rows=rows)
            print(f"| {streams} | {limit} | {path} | {r['itl_alone'] * 1e3:.1f} | {r['itl_during'] * 1e3:.1f} | "
                  f"{r['itl_during'] / r['itl_alone']:.2f}x | {r['ttft']:.2f} s |", flush=True)


def prefill_steps(rows: list[int], rounds: int) -> None:
    engine = LLMEngine(EngineConfig(enable_prefix_caching=False, kv_cache_memory_bytes=256 * 1024**2,
                                    max_model_len=4096))
    engine.collapse_weights()
    words = engine.encode(" ".join(f"record {i}: value {i * 37 % 101}." for i in range(200)))
    k = 0
    for n in rows:
        if n > len(words):
            raise ValueError(f"prompt text too short for {n} tokens")
        times: dict[str, list[float]] = {p: [] for p in PATHS}
        for _ in range(rounds):
            for path in PATHS:
                set_path(engine, path)
                k += 1
                engine.add_request(f"p{k}", [k % 1000 + 10] + words[:n - 1], SamplingParams(max_tokens=1))
                t0 = time.perf_counter()
                while engine.has_unfinished():
                    engine.step()
                times[path].append(time.perf_counter() - t0)
        a, b = (statistics.median(times[p]) for p in PATHS)
        print(f"| {n} | {a * 1e3:.1f} | {b * 1e3:.1f} | {a / b:.2f}x |", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--streams", default="1,4", help="decoding requests beside the long prompt, comma-separated")
    ap.add_argument("--limit", type=int, default=12, help="max_prefill_tokens_with_decodes")
    ap.add_argument("--prompt-len", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prefill-rows", default="8,16,32,64,96", help="prompt lengths for the prefill-alone A/B")
    args = ap.parse_args()
    print("| streams | L | path | ITL alone | ITL during the prefill | ratio | long prompt's TTFT |")
    print("|---:|---:|---|---:|---:|---:|---:|")
    for s in args.streams.split(","):
        chunked(int(s), args.limit, args.prompt_len, args.rounds)
    print("\n| prompt rows | per operator | stack | speedup |")
    print("|---:|---:|---:|---:|")
    prefill_steps([int(n) for n in args.prefill_rows.split(",")], max(args.rounds, 9))


if __name__ == "__main__":
    main()
