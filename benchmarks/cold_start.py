"""Cold start of ``inferd serve``: process start to the first answered request, and the peak RSS until then.

Starts the server, polls ``/v1/models`` and sends one request (a completion or a chat completion) until it is
answered; repeats in rounds, alternating the checkouts given (same session, so that the machine's drift falls on
all of them alike) and prints the times and their medians. Run from a checkout's root:

    python benchmarks/cold_start.py --rounds 3 --checkout . --checkout /tmp/old -- --model PATH ...

Arguments after ``--`` go to ``inferd serve``. A checkout runs with its own ``inferd`` package on PYTHONPATH.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

import httpx

REQUESTS = {
    "completion": ("/v1/completions", {"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}),
    "chat": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "What is the capital of France?"}],
                                      "max_tokens": 8, "temperature": 0}),
}


def cold_start(checkout: str, kind: str, port: int, serve_args: list[str]) -> tuple[float, int]:
    """(seconds to the first answered request, peak RSS in bytes until then) of one server start."""
    env = {**os.environ, "PYTHONPATH": os.path.abspath(checkout), "HF_HUB_OFFLINE": "1"}
    t0 = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "inferd", "serve", "--port", str(port), "--log-level", "warning",
                             *serve_args], env=env, cwd="/", stdout=subprocess.DEVNULL)
    path, body = REQUESTS[kind]
    base = f"http://127.0.0.1:{port}"
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"the server exited with {proc.returncode}")
            try:
                model = httpx.get(base + "/v1/models", timeout=1).json()["data"][0]["id"]
                if httpx.post(base + path, json={**body, "model": model}, timeout=60).status_code == 200:
                    break
            except (httpx.HTTPError, KeyError, IndexError, ValueError):
                pass
            time.sleep(0.02)
        elapsed = time.monotonic() - t0
        with open(f"/proc/{proc.pid}/status") as f:
            hwm = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM"))
        return elapsed, hwm
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkout", action="append", default=None, help="repository root to run (repeatable)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--kind", action="append", choices=sorted(REQUESTS), default=None)
    ap.add_argument("--port", type=int, default=8123)
    ap.add_argument("serve_args", nargs="*", help="after --: arguments of inferd serve")
    args = ap.parse_args()
    checkouts, kinds = args.checkout or ["."], args.kind or ["completion", "chat"]
    times: dict[tuple[str, str], list[float]] = {}
    for r in range(args.rounds):
        for c in checkouts:
            for k in kinds:
                s, hwm = cold_start(c, k, args.port, args.serve_args)
                times.setdefault((c, k), []).append(s)
                print(f"round {r + 1} {c} {k}: {s:.2f} s, peak RSS {hwm / 2**20:,.0f} MiB", flush=True)
    for (c, k), ts in times.items():
        print(f"{c} {k}: {', '.join(f'{t:.2f}' for t in ts)} s (median {statistics.median(ts):.2f})")


if __name__ == "__main__":
    main()
