"""Smoke tests of the benchmark tools: `inferd bench throughput`, `inferd bench serve` against the real
server, benchmarks/roofline.py and benchmarks/compare.py (inferd alone, tiny sizes). They check that the
tools run and count right; speed is measured by `make bench`, never asserted here."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from inferd.bench.datasets import WORKLOADS, make_requests

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def tokenizer():
    from inferd.config import default_model_path
    from inferd.engine.tokenizer import load_tokenizer

    return load_tokenizer(os.path.split(default_model_path())).hf


def test_workloads_are_reproducible_and_have_their_lengths(tokenizer):
    fixed = make_requests("fixed", tokenizer, 5, seed=3)
    assert fixed == make_requests("fixed", tokenizer, 5, seed=3)
    assert fixed != make_requests("fixed", tokenizer, 5, seed=4)
    for r in fixed:
        assert len(tokenizer.encode(r.prompt, add_special_tokens=False)) == 128 == r.prompt_len
        assert r.output_len == 128
    chat = make_requests("chat", tokenizer, 20, seed=0)
    lo, hi = WORKLOADS["chat"].output_len
    assert all(lo <= r.output_len <= hi and r.messages[-1]["role"] == "user" for r in chat)
    assert len({r.output_len for r in chat}) > 5
    shared = make_requests("shared_prefix", tokenizer, 3, seed=0)
    assert len({r.messages[0]["content"] for r in shared}) == 1
    assert len({r.messages[1]["content"] for r in shared}) == 3
    assert len(tokenizer.encode(shared[0].messages[0]["content"], add_special_tokens=False)) > 1024
    long = make_requests("long_prompt", tokenizer, 1, seed=0)[0]
    assert long.prompt_len == 2000 and long.output_len == 64


def test_bench_throughput_counts_every_token(tmp_path):
    out = tmp_path / "t.json"
    r = subprocess.run([sys.executable, "-m", "inferd", "bench", "throughput", "--num-prompts", "3",
                        "--input-len", "8", "--output-len", "5", "--output-json", str(out)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads(out.read_text())
    assert res["num_requests"] == 3
    assert res["total_input_tokens"] == 3 * 8
    assert res["total_output_tokens"] == 3 * 5  # EOS ignored: exactly the output length
    assert res["output_tokens_per_s"] > 0 and res["peak_rss_bytes"] > 100 * 2**20
    assert "output tok/s" in r.stdout


@pytest.mark.parametrize("flag, value, message", [
    ("--max-num-seqs", "0", "inferd: error: --max-num-seqs must be at least 1, got 0"),
    ("--max-num-batched-tokens", "-5", "inferd: error: --max-num-batched-tokens must be at least 1, got -5"),
    ("--kv-cache-memory-bytes", "0", "inferd: error: --kv-cache-memory-bytes must be positive"),
    ("--kv-cache-memory-bytes", "1e9",
     "inferd bench throughput: error: argument --kv-cache-memory-bytes: invalid int value: '1e9'"),
])
def test_bench_throughput_refuses_bad_engine_sizes(flag, value, message):
    """A size the engine cannot take is refused as a usage error naming the flag (exit status 2), by the engine's
    own checks as `serve` refuses it, before a model loads; not a traceback."""
    r = subprocess.run([sys.executable, "-m", "inferd", "bench", "throughput", flag, value],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stderr.strip().endswith(message)
    assert "Traceback" not in r.stderr


def test_bench_serve_against_the_server(server, tmp_path):
    out = tmp_path / "s.json"
    r = subprocess.run([sys.executable, "-m", "inferd", "bench", "serve", "--base-url", server.base_url,
                        "--workload", "fixed", "--num-prompts", "4", "--input-len", "8", "--output-len", "6",
                        "--max-concurrency", "2", "--request-rate", "50", "--output-json", str(out)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads(out.read_text())
    assert (res["completed"], res["failed"], res["short"]) == (4, 0, 0)
    assert res["total_input_tokens"] == 4 * 8  # the server's usage
    assert res["total_output_tokens"] == 4 * 6
    assert res["model"] == "SmolLM2-135M-Instruct" and res["max_concurrency"] == 2
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"):
        s = res[key]
        assert 0 < s["median"] <= s["p99"], key
    assert res["e2el_ms"]["median"] >= res["ttft_ms"]["median"]
    assert "| Successful requests | 4 |" in r.stdout


def test_bench_serve_reports_failures(server, tmp_path):
    """Requests the server refuses are counted as failed, and the exit status says so."""
    out = tmp_path / "f.json"
    r = subprocess.run([sys.executable, "-m", "inferd", "bench", "serve", "--base-url", server.base_url,
                        "--num-prompts", "2", "--input-len", "8", "--output-len", "4", "--no-progress",
                        "--extra-body", '{"model": "no-such-model"}', "--output-json", str(out)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 1
    assert "did not answer a first request: HTTP 404" in r.stderr


def test_bench_serve_without_keep_alive_opens_a_connection_per_request():
    """``--no-keep-alive`` (compare.py gives it for llama.cpp's llama-server, which closes a streamed response's
    connection although it announced it as kept alive, so that a request then sent on it fails to write its body):
    each request on a connection of its own, which it asks the server to close. Against a loopback server that
    keeps its connections open, 6 requests two at a time arrive on 7 connections (with the first short request
    that checks the server answers) without the option, on 2 with it."""
    import asyncio

    from inferd.bench.datasets import BenchRequest
    from inferd.bench.serve import run_serve_benchmark

    def run(keep_alive: bool) -> tuple[dict, int, list[bytes]]:
        accepted, heads = 0, []

        async def handle(reader, writer):
            nonlocal accepted
            accepted += 1
            while True:  # requests on this connection until the client closes it
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except asyncio.IncompleteReadError:
                    break
                heads.append(head.lower())
                length = int(re.search(rb"content-length: *(\d+)", head, re.I)[1])
                body = json.loads(await reader.readexactly(length))
                n = body["max_tokens"]
                events = [{"choices": [{"index": 0, "text": f" t{i}"}]} for i in range(n)]
                events.append({"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": n}})
                payload = b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events)
                payload += b"data: [DONE]\n\n"
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nContent-Length: %d\r\n\r\n"
                             % len(payload) + payload)
                await writer.drain()
            writer.close()

        async def main() -> dict:
            srv = await asyncio.start_server(handle, "127.0.0.1", 0)
            port = srv.sockets[0].getsockname()[1]
            reqs = [BenchRequest("hi", None, 3, 5) for _ in range(6)]
            async with srv:
                return await run_serve_benchmark(f"http://127.0.0.1:{port}", reqs, model="m", max_concurrency=2,
                                                 progress=False, keep_alive=keep_alive)

        return asyncio.run(main()), accepted, heads

    for keep_alive, connections in ((False, 7), (True, 2)):
        res, accepted, heads = run(keep_alive)
        assert (res["completed"], res["failed"], res["short"], res["total_output_tokens"]) == (6, 0, 0, 30)
        assert accepted == connections, keep_alive
        assert all((b"connection: close" in h) != keep_alive for h in heads)


def test_compare_writes_the_report(hf_model, tmp_path):
    """compare.py end to end with inferd alone: a served model, a table row, the roofline, the charts; requests
    sampled (``--sampling``), as the page says."""
    import torch
    from safetensors.torch import save_file

    model, tok = hf_model
    hf = tmp_path / "model" / "hf"
    hf.mkdir(parents=True)
    save_file({k: v.to(torch.bfloat16).contiguous() for k, v in model.state_dict().items()
               if k != "lm_head.weight"}, str(hf / "model.safetensors"))
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    (hf / "config.json").write_text(json.dumps(config))
    tok.save_pretrained(hf)
    report = tmp_path / "docs" / "benchmarks.md"
    report.parent.mkdir()
    r = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "compare.py"), "--engines", "inferd",
                        "--workloads", "fixed", "--concurrency", "1,2", "--min-prompts", "2",
                        "--prompts-per-slot", "1", "--input-len", "8", "--output-len", "4",
                        "--model-dir", str(tmp_path / "model"), "--quick", "--sampling", "0.8,0.95",
                        "--work-dir", str(tmp_path / "work"), "--output", str(report)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    text = report.read_text()
    assert "| 1 | inferd |" in text and "| 2 | inferd |" in text and "1.00x" in text
    assert "decode upper bound" in text
    assert "(streaming, sampled: temperature 0.8, top_p 0.95, EOS ignored" in text
    assert (report.parent / "bench_throughput.png").stat().st_size > 1000
    data = json.loads((report.parent / "benchmarks.json").read_text())
    runs = data["results"][0]["runs"]
    assert [(x["concurrency"], x["completed"], x["failed"]) for x in runs] == [(1, 2, 0), (2, 2, 0)]
    assert data["results"][0]["cold_start_s"] > 0 and data["results"][0]["peak_rss_bytes"] > 100 * 2**20


def test_compare_gives_llama_cpp_the_slots_its_kv_budget_holds():
    """llama-server fails a request that runs out of KV instead of making it wait, so compare.py gives it no more
    slots than the run's longest requests fit in the budget: 2,000 + 64 tokens of long_prompt (and a margin for the
    template) in 1 GiB of 23,040 bytes a token, 46,592 tokens, is 22 slots; fixed alone keeps one per stream."""
    import argparse

    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import compare

    def run(workloads, input_len=None, output_len=None, concurrency=(1, 32)):
        return argparse.Namespace(workloads=workloads, input_len=input_len, output_len=output_len, kv_cache_gib=1,
                                  concurrency=list(concurrency))

    assert compare._longest_request(run(["fixed"])) == 128 + 8 + 128
    assert compare._longest_request(run(["fixed", "long_prompt"])) == 2000 + 8 + 64
    assert compare._longest_request(run(["chat"])) == 512 + 64 + 256  # the template's tokens counted generously
    assert compare._longest_request(run(["shared_prefix"])) == 1024 + 32 + 64 + 64
    assert compare._longest_request(run(["fixed", "long_prompt"], input_len=0, output_len=4)) == 0 + 8 + 4
    assert compare._llama_cache(run(["fixed", "long_prompt"]), 23040) == (46592, 22)
    assert compare._llama_cache(run(["fixed"]), 23040) == (46592, 32)
    assert compare._llama_cache(run(["long_prompt"], concurrency=[1, 8]), 23040) == (46592, 8)


def test_compare_stops_the_other_servers_while_one_is_measured():
    """compare.others_paused: every other started server's process group (a parent and its child, as vLLM's API
    server and engine core) is stopped within, and running again after; the measured one and skipped engines are
    left alone."""
    import signal
    import time

    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import compare

    def state(pid: int) -> str:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]

    def wait_state(pid: int, want: set[str]) -> str:
        deadline = time.monotonic() + 10
        while (s := state(pid)) not in want and time.monotonic() < deadline:
            time.sleep(0.01)
        return s

    tree = "import subprocess, sys, time; c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']);" \
           " print(c.pid, flush=True); time.sleep(60)"
    procs = [subprocess.Popen([sys.executable, "-c", tree], stdout=subprocess.PIPE, text=True,
                              start_new_session=True) for _ in range(2)]
    try:
        children = [int(p.stdout.readline()) for p in procs]
        results = [{"engine": "a", "proc": procs[0]}, {"engine": "b", "proc": procs[1]}, {"engine": "c", "skipped": "x"}]
        with compare.others_paused(results, results[0]):
            assert wait_state(procs[1].pid, {"T"}) == "T" and wait_state(children[1], {"T"}) == "T"
            assert state(procs[0].pid) in "SR" and state(children[0]) in "SR"
        assert wait_state(procs[1].pid, {"S", "R"}) in "SR" and wait_state(children[1], {"S", "R"}) in "SR"
    finally:
        for p in procs:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def test_peak_rss_puts_the_resident_set_on_its_mappings():
    """benchmarks/peak_rss.py's smaps reader: a child's 64 MiB anonymous mapping, 48 MiB of it written, is found as an
    anonymous mapping of at least its size (the kernel may merge it with a neighbour) with at least 48 MiB resident;
    the heap under [heap]; and the mappings add up to the smaps file's Rss lines."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import peak_rss

    code = ("import mmap; m = mmap.mmap(-1, 64 * 2**20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS); "
            "m.write(b'x' * 48 * 2**20); "
            "print(open('/proc/self/smaps').read())")
    smaps = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    rss = peak_rss.mappings(smaps)
    anonymous = [re.fullmatch(r"\[anonymous, (\d+) MiB mapping]", name) for name in rss]
    sizes = {int(m.group(1)): rss[m.group(0)] for m in anonymous if m}
    assert any(size >= 64 and kib >= 48 * 1024 for size, kib in sizes.items()), rss
    assert "[heap]" in rss
    assert sum(rss.values()) == sum(int(line.split()[1]) for line in smaps.splitlines() if line.startswith("Rss:"))
