"""Offline throughput benchmark (``inferd bench throughput``): every request is given to the engine at
once and it runs until all are done, as ``vllm bench throughput`` does.

Reports requests/s and input, output and total tokens/s over the wall time from the first
``add_request`` to the last finished request, and the process's peak resident set size (bytes, from
``getrusage``; it includes the model weights and the KV cache).
"""

from __future__ import annotations

import resource
import time

from inferd.bench.datasets import BenchRequest


def run_throughput(requests: list[BenchRequest], model: str | None = None, **engine_kwargs) -> dict:
    """Run ``requests`` through an :class:`~inferd.entrypoints.llm.LLM` greedily, EOS ignored.

    Args:
        requests: prompts (or chat messages, formatted with the model's chat template) and output lengths.
        model: GGUF file or Hugging Face folder; None = the default model.
        **engine_kwargs: :class:`~inferd.config.EngineConfig` fields (``dtype``, ``max_num_seqs``...).

    Returns:
        A dict of figures: ``requests_per_s``, ``input_tokens_per_s``, ``output_tokens_per_s``,
        ``total_tokens_per_s``, ``elapsed_s``, token totals and ``peak_rss_bytes``.
    """
    from inferd.engine.sampling_params import SamplingParams
    from inferd.entrypoints.llm import LLM

    t_load = time.perf_counter()
    llm = LLM(model, **engine_kwargs)
    load_s = time.perf_counter() - t_load
    engine = llm.engine
    prompts, params = [], []
    for r in requests:
        text = r.prompt if r.messages is None else engine.apply_chat_template(r.messages)
        prompts.append(engine.encode(text, add_special_tokens=r.messages is None))
        params.append(SamplingParams(max_tokens=r.output_len, temperature=0.0, ignore_eos=True))
    t0 = time.perf_counter()
    outputs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - t0
    n_in = sum(len(p) for p in prompts)
    n_out = sum(len(o.outputs[0].token_ids) for o in outputs)
    return {
        "num_requests": len(requests),
        "elapsed_s": elapsed,
        "load_s": load_s,
        "total_input_tokens": n_in,
        "total_output_tokens": n_out,
        "requests_per_s": len(requests) / elapsed,
        "input_tokens_per_s": n_in / elapsed,
        "output_tokens_per_s": n_out / elapsed,
        "total_tokens_per_s": (n_in + n_out) / elapsed,
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    }


def format_markdown(r: dict) -> str:
    return ("| requests | elapsed (s) | req/s | input tok/s | output tok/s | total tok/s | peak RSS (MiB) |\n"
            "|---|---|---|---|---|---|---|\n"
            f"| {r['num_requests']} | {r['elapsed_s']:.2f} | {r['requests_per_s']:.2f} | "
            f"{r['input_tokens_per_s']:.1f} | {r['output_tokens_per_s']:.1f} | {r['total_tokens_per_s']:.1f} | "
            f"{r['peak_rss_bytes'] / 2**20:.0f} |\n")
