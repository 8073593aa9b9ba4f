"""Online serving benchmark against any OpenAI-compatible server (``inferd bench serve``).

Requests are streamed (``stream: true``) so that the client sees each token as it is sent. Arrivals are
a Poisson process at ``request_rate`` requests/s (exponential inter-arrival times from the seed), or all
at once when the rate is infinite; ``max_concurrency`` bounds the requests in flight either way.

Per request it records, in seconds of wall-clock time at the client:

* TTFT, time to first token: from sending the request to the first chunk that carries text.
* ITL, inter-token latency: the gaps between successive text chunks.
* TPOT, time per output token: ``(e2e - ttft) / (output_tokens - 1)``.
* E2E latency: from sending the request to the end of the stream.

Output tokens are the server's ``usage.completion_tokens`` (asked for with
``stream_options.include_usage``) where the server reports it, else the generated text re-encoded with
the tokenizer (as vLLM's ``benchmark_serving`` counts them). Metric names and definitions follow vLLM's
benchmark (``vllm bench serve``), so the figures can be set side by side. The client is aiohttp, as vLLM's
benchmark's is: it shares the machine with the server under test, and at 32 streams it used 0.04 ms of CPU per
streamed token against httpx's 0.11-0.15 ms (docs/performance.md, stop 26).
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from dataclasses import dataclass, field

import aiohttp
import numpy as np

from inferd.bench.datasets import BenchRequest


@dataclass
class RequestResult:
    """What one request measured (times in seconds)."""

    success: bool = False
    error: str = ""
    prompt_len: int = 0
    output_len: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    text: str = ""


async def _lines(resp: aiohttp.ClientResponse):
    """The body's lines as they arrive (SSE events are one ``data:`` line each), of any length."""
    buf = b""
    async for data in resp.content.iter_any():
        buf += data
        *lines, buf = buf.split(b"\n")
        for line in lines:
            yield line.decode()
    if buf:
        yield buf.decode()


async def _send(client: aiohttp.ClientSession, base_url: str, model: str, req: BenchRequest, extra_body: dict,
                tokenizer) -> RequestResult:
    chat = req.messages is not None
    url = base_url.rstrip("/") + ("/v1/chat/completions" if chat else "/v1/completions")
    payload = {"model": model, "max_tokens": req.output_len, "temperature": 0.0, "stream": True,
               "stream_options": {"include_usage": True}, "ignore_eos": True}
    payload.update({"messages": req.messages} if chat else {"prompt": req.prompt})
    payload.update(extra_body)
    res = RequestResult(prompt_len=req.prompt_len, output_len=req.output_len)
    usage_tokens = None
    t0 = time.perf_counter()
    last = t0
    try:
        async with client.post(url, json=payload) as resp:
            if resp.status != 200:
                res.error = f"HTTP {resp.status}: {(await resp.read()).decode(errors='replace')[:200]}"
                return res
            parts = []
            async for line in _lines(resp):
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if chunk.get("error"):
                    res.error = str(chunk["error"])[:200]
                    return res
                if chunk.get("usage"):
                    usage_tokens = chunk["usage"].get("completion_tokens")
                    res.prompt_len = chunk["usage"].get("prompt_tokens") or res.prompt_len
                for choice in chunk.get("choices") or []:
                    text = (choice.get("delta") or {}).get("content") if chat else choice.get("text")
                    if text:
                        now = time.perf_counter()
                        if not parts:
                            res.ttft = now - t0
                        else:
                            res.itl.append(now - last)
                        last = now
                        parts.append(text)
        res.latency = time.perf_counter() - t0
        res.text = "".join(parts)
        if usage_tokens is not None:
            res.output_tokens = usage_tokens
        elif tokenizer is not None:
            res.output_tokens = len(tokenizer.encode(res.text, add_special_tokens=False))
        else:
            res.output_tokens = len(parts)
        res.success = bool(parts)
        if not parts:
            res.error = "no text streamed"
    except (aiohttp.ClientError, asyncio.TimeoutError, json.JSONDecodeError, UnicodeDecodeError, OSError) as e:
        res.error = f"{type(e).__name__}: {e}"[:200]
    return res


def _stats(values: list[float], scale: float = 1000.0) -> dict[str, float]:
    if not values:
        return {"mean": float("nan"), "median": float("nan"), "p90": float("nan"), "p99": float("nan")}
    a = np.asarray(values) * scale
    return {"mean": float(a.mean()), "median": float(np.median(a)), "p90": float(np.percentile(a, 90)),
            "p99": float(np.percentile(a, 99))}


def summarize(results: list[RequestResult], duration: float) -> dict:
    """Aggregate figures: throughputs per second of wall time, latencies in milliseconds. ``failed``:
    requests with an error or no text; ``short``: completed ones with fewer tokens than asked for."""
    ok = [r for r in results if r.success]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_len for r in ok)
    tpot = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    errors: dict[str, int] = {}
    for r in results:
        if not r.success:
            errors[r.error] = errors.get(r.error, 0) + 1
    return {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "short": sum(1 for r in ok if r.output_tokens < r.output_len),
        "errors": errors,
        "duration_s": duration,
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "request_throughput": len(ok) / duration if duration else 0.0,
        "input_throughput": in_tokens / duration if duration else 0.0,
        "output_throughput": out_tokens / duration if duration else 0.0,
        "total_token_throughput": (in_tokens + out_tokens) / duration if duration else 0.0,
        "ttft_ms": _stats([r.ttft for r in ok]),
        "tpot_ms": _stats(tpot),
        "itl_ms": _stats([x for r in ok for x in r.itl]),
        "e2el_ms": _stats([r.latency for r in ok]),
    }


async def _arrivals(n: int, rate: float, seed: int):
    rng = random.Random(seed)
    for i in range(n):
        yield i
        if math.isfinite(rate) and rate > 0 and i + 1 < n:
            await asyncio.sleep(rng.expovariate(rate))


async def run_serve_benchmark(base_url: str, requests: list[BenchRequest], *, model: str | None = None,
                              request_rate: float = math.inf, max_concurrency: int | None = None,
                              seed: int = 0, extra_body: dict | None = None, tokenizer=None,
                              api_key: str | None = None, progress: bool = True,
                              timeout: float = 1800.0, keep_alive: bool = True) -> dict:
    """Send ``requests`` to the server and return :func:`summarize`'s figures plus the settings.

    Args:
        base_url: the server's root, e.g. ``http://127.0.0.1:8000`` (``/v1/...`` is appended).
        model: the model id to send; None = the first id of ``GET /v1/models``.
        request_rate: mean arrivals per second (Poisson); ``inf`` sends all at once.
        max_concurrency: most requests in flight; None = unbounded.
        extra_body: fields merged into every request (e.g. a ``logit_bias`` for servers without
            ``ignore_eos``).
        tokenizer: counts output tokens when the server reports no usage.
        keep_alive: reuse connections between requests; False opens one per request, for servers that close
            connections they announced as kept alive (llama.cpp's llama-server closes its streamed ones, so
            that a request sent on such a connection fails to write its body).

    Raises:
        RuntimeError: the server does not answer a first short request (nothing is measured then).
    """
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    connector = aiohttp.TCPConnector(limit=max(max_concurrency or len(requests), 1) + 4, force_close=not keep_alive)
    async with aiohttp.ClientSession(headers=headers, connector=connector,
                                     timeout=aiohttp.ClientTimeout(total=timeout)) as client:
        if model is None:
            async with client.get(base_url.rstrip("/") + "/v1/models") as r:
                r.raise_for_status()
                model = (await r.json())["data"][0]["id"]
        probe = await _send(client, base_url, model, BenchRequest(requests[0].prompt, requests[0].messages,
                                                                  requests[0].prompt_len, 4),
                            extra_body or {}, tokenizer)
        if not probe.success:
            raise RuntimeError(f"the server did not answer a first request: {probe.error}")
        sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
        bar = None
        if progress:
            from tqdm import tqdm

            bar = tqdm(total=len(requests), unit="req", desc="bench serve")

        async def one(req: BenchRequest) -> RequestResult:
            if sem is None:
                res = await _send(client, base_url, model, req, extra_body or {}, tokenizer)
            else:
                async with sem:
                    res = await _send(client, base_url, model, req, extra_body or {}, tokenizer)
            if bar is not None:
                bar.update(1)
            return res

        t0 = time.perf_counter()
        tasks = []
        async for i in _arrivals(len(requests), request_rate, seed):
            tasks.append(asyncio.create_task(one(requests[i])))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - t0
        if bar is not None:
            bar.close()
    summary = summarize(list(results), duration)
    summary.update({"base_url": base_url, "model": model, "num_prompts": len(requests),
                    "request_rate": None if not math.isfinite(request_rate) else request_rate,
                    "max_concurrency": max_concurrency, "seed": seed})
    return summary


def format_markdown(summary: dict, title: str = "Serving benchmark") -> str:
    """A Markdown table of a :func:`run_serve_benchmark` summary."""
    rows = [
        ("Successful requests", f"{summary['completed']}"),
        ("Failed requests", f"{summary['failed']}"),
        ("Requests with fewer tokens than asked", f"{summary['short']}"),
        ("Max concurrency", f"{summary.get('max_concurrency') or 'unbounded'}"),
        ("Request rate (req/s)", f"{summary.get('request_rate') or 'inf'}"),
        ("Duration (s)", f"{summary['duration_s']:.2f}"),
        ("Input tokens", f"{summary['total_input_tokens']}"),
        ("Output tokens", f"{summary['total_output_tokens']}"),
        ("Request throughput (req/s)", f"{summary['request_throughput']:.2f}"),
        ("Output token throughput (tok/s)", f"{summary['output_throughput']:.1f}"),
        ("Total token throughput (tok/s)", f"{summary['total_token_throughput']:.1f}"),
    ]
    for key, label in (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL"), ("e2el_ms", "E2E latency")):
        s = summary[key]
        rows.append((f"{label} mean / median / P90 / P99 (ms)",
                     f"{s['mean']:.1f} / {s['median']:.1f} / {s['p90']:.1f} / {s['p99']:.1f}"))
    lines = [f"### {title}", "", "| metric | value |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in rows]
    return "\n".join(lines) + "\n"

