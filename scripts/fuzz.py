"""Property-based fuzzing of the server's OpenAPI schema with schemathesis.

Starts ``inferd serve`` on a loopback port (a 64-token context keeps every generated request short),
runs ``schemathesis run`` with the ``not_a_server_error`` check over every operation, then checks that
the server is still healthy and holds no KV block. Exit status 0 only if all of that holds.

    python scripts/fuzz.py --examples 25 --phases fuzzing     # the short run in the test suite
    python scripts/fuzz.py --examples 3000 --report docs/fuzzing.md   # `make fuzz`
"""

from __future__ import annotations

import argparse
import datetime
import glob
import os
import re
import socket
import subprocess
import sys
import tempfile
import time

import httpx


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _metric(base: str, name: str) -> float:
    for line in httpx.get(base + "/metrics", timeout=10).text.splitlines():
        if line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise RuntimeError(f"{name} missing")


def _served(base: str) -> list[tuple[str, str, int]]:
    rows = []
    for line in httpx.get(base + "/metrics", timeout=10).text.splitlines():
        m = re.match(r'inferd:http_requests_total\{route="([^"]*)",status="(\d+)"\} (\S+)', line)
        if m:
            rows.append((m.group(1), m.group(2), int(float(m.group(3)))))
    return sorted(rows)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--examples", type=int, default=20, help="test cases per operation and phase")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--phases", default="coverage,fuzzing", help="schemathesis phases")
    ap.add_argument("--max-time", type=int, default=None,
                    help="time budget in seconds (schemathesis repeats fuzzing until it is spent)")
    ap.add_argument("--report", default=None, help="write a Markdown summary here")
    args = ap.parse_args()

    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    log = open(os.path.join(tempfile.gettempdir(), f"inferd-fuzz-{port}.log"), "wb")
    server = subprocess.Popen([sys.executable, "-m", "inferd", "serve", "--port", str(port), "--max-model-len", "64",
                               "--log-level", "warning"], stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 180
        while True:
            try:
                if httpx.get(base + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline or server.poll() is not None:
                print("server did not start", file=sys.stderr)
                return 2
            time.sleep(0.2)
        report_dir = tempfile.mkdtemp(prefix="inferd-fuzz-")
        st = os.path.join(os.path.dirname(sys.executable), "schemathesis")
        t0 = time.monotonic()
        budget = ["--max-time", str(args.max_time)] if args.max_time else []
        run = subprocess.run([st, "run", base + "/openapi.json", "--checks", "not_a_server_error",
                              "-n", str(args.examples), "--phases", args.phases, "-w", str(args.workers),
                              "--request-timeout", "120", "--seed", str(args.seed), "--report", "ndjson",
                              "--report-dir", report_dir, *budget], capture_output=True, text=True)
        elapsed = time.monotonic() - t0
        print(run.stdout[-4000:])
        requests = 0
        statuses: dict[str, int] = {}
        for path in glob.glob(os.path.join(report_dir, "*.ndjson")):
            with open(path) as f:
                for line in f:
                    for m in re.finditer(r'"status_code": ?(\d+)', line):
                        requests += 1
                        statuses[m.group(1)] = statuses.get(m.group(1), 0) + 1
        server_errors = sum(n for code, n in statuses.items() if code.startswith("5"))
        time.sleep(1.0)
        healthy = httpx.get(base + "/health", timeout=10).status_code == 200
        blocks = _metric(base, "inferd:kv_cache_blocks_used")
        running = _metric(base, "inferd:num_requests_running")
        ok = run.returncode == 0 and server_errors == 0 and healthy and blocks == 0 and running == 0
        summary = (f"schemathesis exit {run.returncode}; {requests} responses recorded, by status "
                   f"{dict(sorted(statuses.items()))}; 5xx: {server_errors}; healthy afterwards: {healthy}; "
                   f"KV blocks held afterwards: {blocks:g}; running: {running:g}; {elapsed:.0f} s")
        print(summary)
        if args.report:
            with open(args.report, "w") as f:
                f.write("# Fuzzing the OpenAI API\n\n")
                f.write("`make fuzz` runs `scripts/fuzz.py`: schemathesis generates requests from the server's "
                        "OpenAPI schema (`/openapi.json`), valid and invalid, for every operation, and checks "
                        "that none gets a 5xx; the server runs with a 64-token context so that every valid "
                        "request is short. Afterwards the server must answer /health with 200 and hold no KV "
                        "block.\n\n")
                f.write(f"Last run: {datetime.date.today()}, `python scripts/fuzz.py {' '.join(sys.argv[1:])}`"
                        f"\n\n{summary}\n\nThe server's own count (`inferd:http_requests_total`):\n\n"
                        "| route | status | responses |\n|---|---|---|\n")
                for route, status, n in _served(base):
                    f.write(f"| {route} | {status} | {n} |\n")
        return 0 if ok else 1
    finally:
        server.terminate()
        try:
            server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            server.kill()
        log.close()


if __name__ == "__main__":
    sys.exit(main())
