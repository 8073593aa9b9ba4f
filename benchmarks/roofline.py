"""Roofline of this machine for a decoder model: what the hardware allows, before any engine runs.

Measures, with torch on ``--threads`` threads (medians of repeated runs):

* memory read bandwidth (bytes/s): ``torch.sum`` over a 1 GiB FP32 tensor, far larger than the caches, in
  ordinary 4 KiB pages and in transparent huge pages (where the kernel gives them; the weights are moved there,
  docs/architecture.md), alternately; the bound takes the faster;
* matmul throughput (FLOP/s) in BF16 and FP32: ``torch.mm`` of 2048 x 2048 matrices (oneDNN, AMX for
  BF16 where the CPU has it).

and derives, for the model (default: SmolLM2-135M-Instruct) in BF16, the upper bounds of decode
throughput (the roofline model, Williams, Waterman and Patterson, CACM 2009):

* each decode step reads every weight once (the embedding table through the tied LM head) and each
  sequence's KV cache: ``bytes_step = W + B * kv_bytes_per_token * ctx``;
* each generated token costs ``2 * P`` FLOPs in the matmuls (``P`` = parameters used per token, LM head
  included) plus attention's ``4 * layers * heads * head_dim * ctx``;
* tokens/s at batch ``B`` <= ``B / max(bytes_step / bandwidth, B * flops_token / matmul_flops)``.

    python benchmarks/roofline.py [--model PATH] [--threads 2] [--context 192] [--output-json FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch


def _median_time(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def measure(threads: int, quick: bool = False) -> dict:
    """Bandwidth (bytes/s) and matmul FLOP/s of this machine. ``quick`` uses small sizes (a smoke test)."""
    from inferd.model.layers import HugePageBuffer

    torch.set_num_threads(threads)
    n = (64 if quick else 1024) * 2**20 // 4
    small = torch.ones(n, dtype=torch.float32)
    huge = HugePageBuffer(n, torch.float32)
    huge.tensor.fill_(1.0)
    collapsed = huge.collapse()
    times: dict[str, list[float]] = {"4k": [], "huge": []}
    for _ in range(3 if quick else 7):  # alternately, so that the machine's drift falls on both alike
        times["4k"].append(_median_time(lambda: small.sum(), 1))
        if collapsed:
            times["huge"].append(_median_time(lambda: huge.tensor.sum(), 1))
    small = huge = None  # free the 2 GiB before the matmuls
    bw = {k: n * 4 / statistics.median(v) for k, v in times.items() if v}
    out = {"threads": threads, "read_bandwidth_bytes_per_s": max(bw.values()),
           "read_bandwidth_4k_pages_bytes_per_s": bw["4k"],
           "read_bandwidth_huge_pages_bytes_per_s": bw.get("huge")}
    size = 512 if quick else 2048
    from inferd.model.kernels import panel_linear_kernel

    gemm = panel_linear_kernel()  # on an AVX2 CPU without native BF16, the engine's BF16 GEMM is inferd's own
    for name, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
        a = torch.randn(size, size).to(dtype)
        b = torch.randn(size, size).to(dtype)
        if dtype == torch.bfloat16 and gemm is not None:
            from inferd.model.layers import pack_panels

            w = pack_panels(b)
            t = _median_time(lambda: gemm(a, w.data, size, None, False), 3 if quick else 7)
        else:
            t = _median_time(lambda: torch.mm(a, b), 3 if quick else 7)
        out[f"matmul_{name}_flops"] = 2 * size**3 / t
    return out


def bounds(hw: dict, model_path: str | None, context: int, batches=(1, 8, 32, 128)) -> dict:
    """Upper bounds of decode tokens/s for the model in BF16 at each batch size (see the module doc)."""
    from inferd.config import default_model_path
    from inferd.model.loader import load_checkpoint

    ckpt = load_checkpoint(model_path or default_model_path())
    c = ckpt.config
    sd = ckpt.state_dict
    embed = sd["model.embed_tokens.weight"].numel()
    params = sum(v.numel() for v in sd.values())
    # Parameters read (and multiplied) per token: all but the embedding table, plus the LM head.
    per_token = params - embed + (embed if c.tie_word_embeddings else 0)
    weight_bytes = 2 * per_token
    kv_per_token = 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * 2
    attn_flops = 4 * c.num_hidden_layers * c.num_attention_heads * c.head_dim * context
    flops_token = 2 * per_token + attn_flops
    rows = []
    for b in batches:
        t_mem = (weight_bytes + b * kv_per_token * context) / hw["read_bandwidth_bytes_per_s"]
        t_compute = b * flops_token / hw["matmul_bf16_flops"]
        rows.append({"batch": b, "tokens_per_s": b / max(t_mem, t_compute),
                     "bound": "memory" if t_mem >= t_compute else "compute"})
    return {"parameters": params, "weight_bytes_per_step": weight_bytes, "kv_bytes_per_token": kv_per_token,
            "context_tokens": context, "flops_per_token": flops_token, "decode_bounds": rows}


def format_markdown(hw: dict, b: dict) -> str:
    huge = hw.get("read_bandwidth_huge_pages_bytes_per_s")
    pages = (f" (the faster of {hw['read_bandwidth_4k_pages_bytes_per_s'] / 1e9:.1f} GB/s in 4 KiB pages and "
             f"{huge / 1e9:.1f} GB/s in 2 MiB pages)" if huge else " (4 KiB pages; no huge pages here)")
    lines = [
        f"Measured on {hw['threads']} threads: memory read bandwidth "
        f"**{hw['read_bandwidth_bytes_per_s'] / 1e9:.1f} GB/s**{pages}, matmul "
        f"**{hw['matmul_bf16_flops'] / 1e12:.2f} TFLOP/s BF16** and "
        f"**{hw['matmul_fp32_flops'] / 1e12:.2f} TFLOP/s FP32**.",
        "",
        f"Model: {b['parameters'] / 1e6:.1f} M parameters; a BF16 decode step reads "
        f"{b['weight_bytes_per_step'] / 1e6:.0f} MB of weights plus {b['kv_bytes_per_token']} bytes of KV cache "
        f"per token of context (context {b['context_tokens']} tokens); {b['flops_per_token'] / 1e6:.0f} MFLOP "
        "per generated token.",
        "",
        "| concurrent sequences | decode upper bound (tokens/s) | limited by |",
        "|---|---|---|",
    ]
    lines += [f"| {r['batch']} | {r['tokens_per_s']:.0f} | {r['bound']} |" for r in b["decode_bounds"]]
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--context", type=int, default=192, help="mean context of a decoding sequence (tokens)")
    ap.add_argument("--quick", action="store_true", help="small sizes: a smoke test, not a measurement")
    ap.add_argument("--output-json", default=None)
    args = ap.parse_args()
    hw = measure(args.threads, args.quick)
    b = bounds(hw, args.model, args.context)
    print(format_markdown(hw, b))
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"hardware": hw, "model": b}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
