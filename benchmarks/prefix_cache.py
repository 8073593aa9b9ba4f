"""Prefix caching on and off, served, on the shared-prefix workload (issue 6, goal 6): TTFT with the
cache against without it, measured in alternating rounds in one session.

    python benchmarks/prefix_cache.py --rounds 2 --num-prompts 12

Each round starts ``inferd serve`` with prefix caching, runs ``inferd bench serve --workload
shared_prefix`` (a common 1,024-token system prompt, a different 32-token question per request) one
request at a time (so TTFT is prefill time, not queueing), stops it, and does the same with
``--no-enable-prefix-caching``. Prints the median TTFT of each run and the ratio of the medians.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import httpx
from compare import _free_port  # benchmarks/compare.py (this script's folder is on sys.path)



def stop_process(proc: subprocess.Popen, timeout: float = 60) -> None:
    """SIGTERM ``proc``, then SIGKILL it if it has not exited within ``timeout`` seconds."""
    proc.terminate()
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def wait_healthy(url: str, server: subprocess.Popen, timeout: float = 300) -> None:
    """Wait until ``url``/health answers 200 (the model loaded). Raises RuntimeError where the server exits first or
    ``timeout`` seconds pass."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline or server.poll() is not None:
            raise RuntimeError("the server did not start")
        time.sleep(0.2)

def run(caching: bool, num_prompts: int, output_len: int) -> float:
    """Median TTFT (seconds) of one served run."""
    port = _free_port()
    args = [sys.executable, "-m", "inferd", "serve", "--port", str(port), "--log-level", "warning"]
    if not caching:
        args.append("--no-enable-prefix-caching")
    server = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_healthy(f"http://127.0.0.1:{port}", server)
        with tempfile.NamedTemporaryFile(suffix=".json") as out:
            subprocess.run([sys.executable, "-m", "inferd", "bench", "serve", "--base-url", f"http://127.0.0.1:{port}",
                            "--workload", "shared_prefix", "--num-prompts", str(num_prompts), "--max-concurrency",
                            "1", "--output-len", str(output_len), "--no-progress", "--output-json", out.name],
                           check=True, stdout=subprocess.DEVNULL)
            result = json.load(open(out.name))
        if result.get("failed"):
            raise RuntimeError(f"{result['failed']} requests failed")
        return result["ttft_ms"]["median"] / 1e3
    finally:
        stop_process(server)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--num-prompts", type=int, default=12)
    ap.add_argument("--output-len", type=int, default=8)
    args = ap.parse_args()
    on, off = [], []
    for _ in range(args.rounds):
        on.append(run(True, args.num_prompts, args.output_len))
        off.append(run(False, args.num_prompts, args.output_len))
        print(f"median TTFT: caching on {on[-1] * 1e3:.0f} ms, off {off[-1] * 1e3:.0f} ms", flush=True)
    print(f"TTFT with prefix caching {statistics.median(on) * 1e3:.0f} ms, without {statistics.median(off) * 1e3:.0f} "
          f"ms: {statistics.median(off) / statistics.median(on):.1f}x ({os.cpu_count()} CPUs)")


if __name__ == "__main__":
    main()
