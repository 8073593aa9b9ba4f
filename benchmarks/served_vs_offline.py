"""What the served path adds to a token: one stream's inter-token time through ``inferd serve`` (streamed
completions, httpx) against the offline engine's time per token (``inferd.LLM``), the two processes taking turns
(the other one stopped with SIGSTOP, as compare.py does), the same prompt of 128 random token ids and 128 tokens
out, greedy, EOS ignored.

    python benchmarks/served_vs_offline.py --rounds 5

Served: the client's median time between streamed chunks of one request. Offline: a generation of 128 tokens less a
generation of 2 (the prefill and the first token), over the 126 tokens between. Prints each round's figures and the
ratio of the medians (docs/performance.md, stop 42).
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import statistics
import subprocess
import sys
import time

import httpx
from prefix_cache import wait_healthy

OFFLINE = """
import sys, time
from inferd.engine.sampling_params import SamplingParams
from inferd.entrypoints.llm import LLM
llm = LLM(model=sys.argv[1] or None, dtype="bfloat16")
prompt = [int(t) for t in sys.argv[2].split(",")]
def run(n):
    t0 = time.perf_counter()
    llm.generate([prompt], SamplingParams(max_tokens=n, ignore_eos=True, temperature=0))
    return time.perf_counter() - t0
run(2)
print("ready", flush=True)
for _ in sys.stdin:
    short, full = run(2), run(128)
    print((full - short) / 126 * 1e3, flush=True)
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="", help="GGUF file or Hugging Face folder (default: inferd's default model)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--port", type=int, default=46999)
    args = ap.parse_args()
    rng = random.Random(0)
    prompt = [rng.randrange(1000, 40000) for _ in range(128)]
    model = ["--model", args.model] if args.model else []
    server = subprocess.Popen([sys.executable, "-m", "inferd", "serve", *model, "--port", str(args.port),
                               "--served-model-name", "m", "--dtype", "bfloat16", "--log-level", "warning"])
    offline = subprocess.Popen([sys.executable, "-c", OFFLINE, args.model, ",".join(map(str, prompt))],
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{args.port}"
    try:
        assert offline.stdout.readline().strip() == "ready", "the offline engine did not start"
        offline.send_signal(signal.SIGSTOP)
        wait_healthy(url, server)

        def served() -> float:
            gaps, last = [], None
            body = {"model": "m", "prompt": prompt, "max_tokens": 128, "ignore_eos": True, "stream": True,
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
        figures: dict[str, list[float]] = {"served": [], "offline": []}
        for _ in range(args.rounds):
            figures["served"].append(served())
            server.send_signal(signal.SIGSTOP)
            offline.send_signal(signal.SIGCONT)
            offline.stdin.write("go\n")
            offline.stdin.flush()
            figures["offline"].append(float(offline.stdout.readline()))
            offline.send_signal(signal.SIGSTOP)
            server.send_signal(signal.SIGCONT)
        for name, values in figures.items():
            print(f"{name}: " + ", ".join(f"{v:.2f}" for v in values) + " ms a token")
        ratio = statistics.median(figures["served"]) / statistics.median(figures["offline"])
        print(f"served / offline (medians of {args.rounds}): {ratio:.3f}x")
    finally:
        for proc in (server, offline):
            proc.send_signal(signal.SIGCONT)
            proc.terminate()
        for proc in (server, offline):
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()


if __name__ == "__main__":
    main()
