"""What the served path adds to a token: one stream's inter-token time through ``inferd serve`` (streamed
completions, httpx) against the offline engine's time per token (``inferd.LLM``), the two processes taking turns
(the other one stopped with SIGSTOP, as compare.py does), the same prompt of 128 random token ids and 128 tokens
out, greedy, EOS ignored, prefix caching off on both sides (every round computes its prompts; with
``--enable-prefix-caching`` on on both, so that the rounds after the warm-up find their prompts cached: decode only).

    python benchmarks/served_vs_offline.py --rounds 5

Served: the client's median time between streamed chunks of one request. Offline: a generation of 128 tokens less a
generation of 2 (the prefill and the first token), over the 126 tokens between. Prints each round's figures and the
ratio of the medians (docs/performance.md, stop 42).

    python benchmarks/served_vs_offline.py --rounds 5 --concurrency 32

With ``--concurrency N`` above 1, N requests with distinct prompts start together: served, N concurrent streams
from ``inferd bench serve``'s load generator (compare.py's client, aiohttp: its CPU per token is a third of
httpx's; its wall time starts after its probe request); offline, one ``generate`` of the N prompts. Each side's figure is then the wall time from the first
request to the last token over the N x 128 tokens out (prefills included on both sides), in ms a token
(docs/performance.md, stop 44). The CPU time of the served rounds is split too: the server's main thread (the
event loop: HTTP, SSE chunks, JSON, socket writes), its other threads (the engine thread and its kernels' threads,
which also spin while they wait), and this client; on a 2-core machine what the event loop and the client take,
the engine's threads lose.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import signal
import statistics
import subprocess
import sys
import time

import httpx
from prefix_cache import stop_process, wait_healthy

from inferd.bench.datasets import BenchRequest
from inferd.bench.serve import run_serve_benchmark

OFFLINE = """
import sys, time
from inferd.engine.sampling_params import SamplingParams
from inferd.entrypoints.llm import LLM
llm = LLM(model=sys.argv[1] or None, dtype="bfloat16", enable_prefix_caching=sys.argv[3] == "1")
prompts = [[int(t) for t in p.split(",")] for p in sys.argv[2].split(";")]
def run(n):
    t0 = time.perf_counter()
    llm.generate(prompts, SamplingParams(max_tokens=n, ignore_eos=True, temperature=0))
    return time.perf_counter() - t0
run(2)
print("ready", flush=True)
for _ in sys.stdin:
    if len(prompts) == 1:
        short, full = run(2), run(128)
        print((full - short) / 126 * 1e3, flush=True)
    else:
        print(run(128) / (128 * len(prompts)) * 1e3, flush=True)
"""


def thread_cpu_s(pid: int) -> tuple[float, float]:
    """CPU seconds (user + system) of process ``pid``'s main thread and of all its other threads, those that have
    ended included, from /proc."""
    tick = os.sysconf("SC_CLK_TCK")

    def stat(path: str) -> float:
        with open(path) as f:
            fields = f.read().rpartition(")")[2].split()
        return (int(fields[11]) + int(fields[12])) / tick

    main_s = stat(f"/proc/{pid}/task/{pid}/stat")
    return main_s, stat(f"/proc/{pid}/stat") - main_s


def wait_idle(pid: int, timeout: float = 120) -> None:
    """Wait until process ``pid`` takes under 5% of a core over a second (at most ``timeout`` seconds)."""
    deadline = time.monotonic() + timeout
    last = sum(thread_cpu_s(pid))
    while time.monotonic() < deadline:
        time.sleep(1)
        now = sum(thread_cpu_s(pid))
        if now - last < 0.05:
            return
        last = now
    print(f"warning: the server still took CPU after {timeout:.0f} s; measuring anyway", file=sys.stderr)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="", help="GGUF file or Hugging Face folder (default: inferd's default model)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--port", type=int, default=46999)
    ap.add_argument("--enable-prefix-caching", action="store_true", help="on in both processes (default: off)")
    ap.add_argument("--concurrency", type=int, default=1, help="requests at once (1: one stream's inter-token time)")
    args = ap.parse_args()
    rng = random.Random(0)
    prompts = [[rng.randrange(1000, 40000) for _ in range(128)] for _ in range(args.concurrency)]
    model = ["--model", args.model] if args.model else []
    server = subprocess.Popen([sys.executable, "-m", "inferd", "serve", *model, "--port", str(args.port),
                               "--served-model-name", "m", "--dtype", "bfloat16", "--log-level", "warning",
                               *([] if args.enable_prefix_caching else ["--no-enable-prefix-caching"])])
    offline = None
    url = f"http://127.0.0.1:{args.port}"
    try:
        offline = subprocess.Popen([sys.executable, "-c", OFFLINE, args.model,
                                    ";".join(",".join(map(str, p)) for p in prompts),
                                    "1" if args.enable_prefix_caching else "0"],
                                   stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert offline.stdout.readline().strip() == "ready", "the offline engine did not start"
        offline.send_signal(signal.SIGSTOP)
        wait_healthy(url, server)

        def served() -> float:
            return served_one() if args.concurrency == 1 else asyncio.run(served_many())

        async def served_many() -> float:
            requests = [BenchRequest(prompt=p, messages=None, prompt_len=len(p), output_len=128) for p in prompts]
            summary = await run_serve_benchmark(url, requests, model="m", max_concurrency=len(prompts),
                                                progress=False)
            if summary["failed"] or summary["short"]:
                raise RuntimeError(f"served round: {summary['failed']} failed, {summary['short']} short")
            return summary["duration_s"] / summary["total_output_tokens"] * 1e3

        def served_one() -> float:
            gaps, last = [], None
            body = {"model": "m", "prompt": prompts[0], "max_tokens": 128, "ignore_eos": True, "stream": True,
                    "temperature": 0}
            with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as r:
                r.raise_for_status()
                for line in r.iter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        now = time.perf_counter()
                        if last is not None:
                            gaps.append(now - last)
                        last = now
            return statistics.median(gaps) * 1e3

        served()  # the server's first request (warm-up)
        # Its start-up work after a first answer (inferd.backends.llm.after_first_answer: an import and the weights'
        # move to huge pages, ~1.4 s of CPU in the 1.5 s after it) would otherwise fall in the first round: 1.3-1.7
        # against 1.1 ms a token at 32 streams.
        wait_idle(server.pid)
        figures: dict[str, list[float]] = {"served": [], "offline": []}
        cpu = {"event loop": 0.0, "other threads": 0.0, "client": 0.0}
        for _ in range(args.rounds):
            (loop0, engine0), client0 = thread_cpu_s(server.pid), time.process_time()
            figures["served"].append(served())
            (loop1, engine1), client1 = thread_cpu_s(server.pid), time.process_time()
            cpu["event loop"] += loop1 - loop0
            cpu["other threads"] += engine1 - engine0
            cpu["client"] += client1 - client0
            server.send_signal(signal.SIGSTOP)
            offline.send_signal(signal.SIGCONT)
            offline.stdin.write("go\n")
            offline.stdin.flush()
            figures["offline"].append(float(offline.stdout.readline()))
            offline.send_signal(signal.SIGSTOP)
            server.send_signal(signal.SIGCONT)
        for name, values in figures.items():
            print(f"{name}: " + ", ".join(f"{v:.2f}" for v in values) + " ms a token")
        tokens = 128 * args.concurrency * args.rounds
        print("CPU of the served rounds, ms a token: " +
              ", ".join(f"{name} {v / tokens * 1e3:.3f}" for name, v in cpu.items()))
        ratio = statistics.median(figures["served"]) / statistics.median(figures["offline"])
        print(f"served / offline (medians of {args.rounds}): {ratio:.3f}x")
    finally:
        for proc in (server, offline):
            if proc is not None:
                proc.send_signal(signal.SIGCONT)
                stop_process(proc, timeout=30)


if __name__ == "__main__":
    main()
