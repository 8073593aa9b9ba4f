"""What inferd's peak resident set is made of: the server started as compare.py starts it (the exported BF16 model,
a 1 GiB KV budget), compare.py's cells run against it (``fixed`` at concurrency 1, then 32), and ``/proc/PID/smaps``
copied at each new high of its resident size (sampled every 50 ms). Prints the peak (VmHWM), the mappings that hold
the most of it at the last copy, and the same mappings just after the first answer (idle), so that a change's effect
on the peak can be put on a mapping: the packed weights (one anonymous mapping of their size), glibc's main heap
(``[heap]``), the libraries. Anonymous mappings are named by their size, which is not stable: the kernel merges
neighbouring ones (the KV cache's touched blocks, glibc's thread arenas), and an arena's writable part grows within
the 64 MiB it reserves, so such a mapping can have another name idle than at the peak (shown as 0 idle).

    python benchmarks/peak_rss.py                        # 2 runs, greedy
    python benchmarks/peak_rss.py --runs 3 --sampling 0.8,0.95 --serve-args="--max-num-batched-tokens 1024"

Run it on an idle machine; runs are one after another (docs/performance.md, stop 48: 861-937 MiB over nine runs of
one build, so compare builds in alternating runs).
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import compare  # noqa: E402 - the server command, its start and the cells are compare.py's


def mappings(smaps: str) -> collections.Counter:
    """Resident KiB by mapping from the text of /proc/PID/smaps: a file's path, ``[heap]``, ``[stack]``..., or an
    anonymous mapping named by its size in MiB (mappings of one name are summed)."""
    rss, name = collections.Counter(), None
    for line in smaps.splitlines():
        parts = line.split(maxsplit=5)  # the path (field 6) may hold spaces
        if len(parts) >= 5 and "-" in parts[0] and ":" in parts[3]:
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            name = parts[5] if len(parts) > 5 else f"[anonymous, {(hi - lo) / 2**20:.0f} MiB mapping]"
        elif parts and parts[0] == "Rss:" and name is not None:
            rss[name] += int(parts[1])
    return rss


class SmapsAtPeak:
    """Copies /proc/PID/smaps whenever the process's VmRSS passes its last high by 2 MiB or more."""

    def __init__(self, pid: int, every: float = 0.05) -> None:
        self.pid, self.every, self.high_kib, self.smaps = pid, every, 0, ""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            try:
                with open(f"/proc/{self.pid}/status") as f:
                    rss = next(int(line.split()[1]) for line in f if line.startswith("VmRSS"))
                if rss >= self.high_kib + 2048:
                    with open(f"/proc/{self.pid}/smaps") as f:
                        self.smaps, self.high_kib = f.read(), rss
            except (OSError, StopIteration):
                return

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def one_run(args, model: dict, log_dir: str) -> dict:
    """One server: its idle mappings after the first answer, the cells, VmHWM and the mappings at the peak."""
    result = compare.start_engine("inferd", args, model, log_dir)
    if "skipped" in result:
        raise RuntimeError(result["skipped"])
    pid = result["proc"].pid
    try:
        time.sleep(args.settle)  # the server's start-up work after its first answer (huge pages, an import)
        with open(f"/proc/{pid}/smaps") as f:
            idle = mappings(f.read())
        sampler = SmapsAtPeak(pid)
        for c in args.concurrency:
            compare.run_cell(result, "fixed", c, args, model, log_dir)
        sampler.stop()
        with open(f"/proc/{pid}/status") as f:
            hwm = next(int(line.split()[1]) for line in f if line.startswith("VmHWM"))
    finally:
        compare.stop_engine(result)
    return {"hwm_kib": hwm, "idle": idle, "peak": mappings(sampler.smaps),
            "tok_s": [r.get("output_throughput") for r in result["runs"]]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--concurrency", default="1,32")
    ap.add_argument("--sampling", default=None, metavar="TEMPERATURE,TOP_P")
    ap.add_argument("--serve-args", default="", help="more `inferd serve` arguments, one string")
    ap.add_argument("--kv-cache-gib", type=int, default=1)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--settle", type=float, default=5.0, help="seconds between the first answer and the cells")
    ap.add_argument("--top", type=int, default=8, help="mappings listed")
    ap.add_argument("--work-dir", default=os.path.expanduser("~/.cache/inferd-bench"))
    args = ap.parse_args()
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    args.sampling = compare._parse_sampling(args.sampling)
    args.start_timeout, args.seed, args.prompts_per_slot, args.min_prompts = 300, 0, 2, 8
    args.input_len = args.output_len = None
    model_dir = os.path.join(args.work_dir, "model")
    if subprocess.run([sys.executable, os.path.join(compare.ROOT, "benchmarks", "export_model.py"),
                       model_dir]).returncode:
        return 1
    model = {"hf": os.path.join(model_dir, "hf")}
    extra = args.serve_args.split()
    command = compare.server_command

    def with_extra(engine, a, m, port):  # compare.py's command, then --serve-args
        argv, env, body, version = command(engine, a, m, port)
        return argv + extra, env, body, version

    compare.server_command = with_extra
    runs = []
    with tempfile.TemporaryDirectory() as log_dir:
        for i in range(args.runs):
            runs.append(one_run(args, model, log_dir))
            tok_s = ", ".join(f"{t:.1f}" for t in runs[-1]["tok_s"] if t is not None)
            print(f"run {i + 1}: peak RSS (VmHWM) {runs[-1]['hwm_kib'] / 1024:.0f} MiB; output tok/s {tok_s}",
                  flush=True)
    print(f"\npeak RSS over {len(runs)} runs: median {statistics.median(r['hwm_kib'] for r in runs) / 1024:.0f} "
          f"MiB, {min(r['hwm_kib'] for r in runs) / 1024:.0f}-{max(r['hwm_kib'] for r in runs) / 1024:.0f}\n")
    last = runs[-1]
    print(f"| mapping (run {len(runs)}) | idle, after the first answer (MiB) | at the peak (MiB) |\n|---|---:|---:|")
    for name, kib in last["peak"].most_common(args.top):
        print(f"| {name} | {last['idle'].get(name, 0) / 1024:.1f} | {kib / 1024:.1f} |")
    shown = {name for name, _ in last["peak"].most_common(args.top)}
    rest = [sum(v for k, v in m.items() if k not in shown) / 1024 for m in (last["idle"], last["peak"])]
    print(f"| the rest | {rest[0]:.1f} | {rest[1]:.1f} |")
    print(f"| total | {sum(last['idle'].values()) / 1024:.1f} | {sum(last['peak'].values()) / 1024:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
