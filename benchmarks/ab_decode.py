"""A/B of decode-step time (or of one prompt's prefill) in one process: two engines built with and without
a change, measured in alternating rounds so that both see the same machine state (this VM's run-to-run
spread is 5-15%).

    python benchmarks/ab_decode.py --change packed-weights --batch 1 --batch 8 --batch 32 --rounds 3 --steps 40
    python benchmarks/ab_decode.py --change prefill-gemm-tiles --prefill-len 2000 --rounds 5
    python benchmarks/ab_decode.py --change fp32-panels --dtype float32 --batch 1 --batch 8

Changes (B has it, A is built without it):
- ``packed-weights``: BF16 GEMM weights packed once for oneDNN (inferd.model.layers.pack_linear_weight)
  against plain weights;
- ``ragged-tiles``: GEMMs in ragged tiles of 32 rows, no padding (inferd.model.layers.rows_invariant_up_to
  says yes) against 16-row tiles with the batch padded to a multiple of 16;
- ``index-select-gather``: the KV blocks gathered with ``index_select`` (inferd.model.attention.
  gather_blocks) against advanced indexing ``cache[:, block_tables]``;
- ``aligned-key-len``: attention over the keys up to the longest context of a call rounded up to 16
  (inferd.engine.model_runner uses inferd.model.attention.key_len) against the next power of two (at
  least 64), as before;
- ``sdpa-decode``: decode attention through torch's fused ``scaled_dot_product_attention``
  (inferd.model.attention.decode_attention) against the earlier bmm, masked_fill, FP32 softmax, bmm chain;
- ``refine-logits``: BF16 logits near each row's maximum recomputed in FP32 (inferd.model.llama.
  refine_near_max) against the BF16 GEMM output alone;
- ``prefill-gemm-tiles``: prefill rows' GEMMs in fixed 128-row tiles (inferd.model.layers.
  rows_invariant_in_tiles says yes) against the 32-row ragged tiles of the decode rows;
- ``additive-masks``: attention masks built once per step as additive masks in the model dtype (inferd.model.
  attention.attention_bias) against bool masks that ``scaled_dot_product_attention`` converts in every layer;
- ``paged-decode-kernel``: decode attention by the compiled CPU kernel that reads the KV blocks in place
  (inferd.model.kernels) against gathering them for ``scaled_dot_product_attention``;
- ``avx2-bf16-gemm``: on a CPU without native BF16 matmul, BF16 served through inferd's AVX2 GEMM kernel
  (inferd.model.kernels.panel_linear_kernel) against what dtype ``auto`` served there before: FP32 weights
  through MKL, in 16-row tiles;
- ``fused-ops``: each layer's residual add + RMSNorm, RoPE + K/V cache write and SiLU * up in inferd's compiled
  ops (inferd.model.kernels.fused_ops) against torch's operators;
- ``fp32-panels`` (with ``--dtype float32``): on a CPU without native BF16 matmul, FP32 weights packed for inferd's
  AVX2 GEMM (inferd.model.layers.takes_panels) against MKL's FP32 GEMM on plain weights in 16-row tiles;
- ``bf16-pairs``: on a CPU with AVX512-BF16, BF16 weights packed in pairs of k for inferd's AVX512-BF16 micro-kernel
  (``vdpbf16ps``; inferd.model.layers.panel_shape) against the interleaved panels of the AVX2 micro-kernel;
- ``panels-not-onednn``: on a CPU with AVX512-BF16 and no AMX, BF16 through inferd's panels and decoder stack
  against oneDNN's packed GEMM, per operator (what served there before stop 24);
- ``argmax-kernel``: greedy tokens by inferd's compiled ``argmax_rows`` (inferd.engine.sampler.argmax_rows) against
  ``torch.argmax``;
- ``decode-stack``: a decode-only step's layers in one compiled call (inferd.model.llama.decode_stack) against
  the per-operator kernels, nine calls per layer;
- ``--kernels-base REV`` (instead of ``--change``): the decoder stack and element-wise ops
  (inferd.model.kernels.fused_ops) of this checkout's kernels against those compiled from the C++ sources
  (inferd/model/csrc) of git revision REV, built once into the extensions cache (the GEMM and attention kernel
  calls of steps with prefill rows stay this checkout's), for changes inside the kernels that have no switch of
  their own.

Each engine holds N requests of 128 prompt tokens
(ignore_eos, greedy); a round is ``--steps`` decode steps per engine; reported: the median step of each
round, and the median over rounds, for A (without) and B (with). With ``--prefill-len N`` a round is
instead one prefill of an N-token prompt per engine (prefix caching off; the time of the step that
computes its last chunk to the first sampled token).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import torch

import inferd.engine.model_runner as model_runner
import inferd.engine.sampler as sampler
import inferd.model.attention as attention
import inferd.model.kernels as kernels
import inferd.model.layers as layers
import inferd.model.llama as llama
from inferd.bench.datasets import make_requests
from inferd.config import EngineConfig
from inferd.engine.llm_engine import LLMEngine
from inferd.engine.sampling_params import SamplingParams


def _gather_by_indexing(cache: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor:
    return cache[:, block_tables].view(cache.shape[0], -1, cache.shape[-1])


def _decode_attention_bmm(q, keys, vals, key_mask, scale):
    b, n_head, d = q.shape
    n_kv, _, length, _ = keys.shape
    group = n_head // n_kv
    qg = q.view(b, n_kv, group, d).transpose(0, 1).reshape(n_kv * b, group, d)
    scores = torch.bmm(qg, keys.reshape(n_kv * b, length, d).transpose(1, 2)).float() * scale
    scores = scores.view(n_kv, b, group, -1) + key_mask.view(1, b, 1, -1).float()  # additive mask
    probs = torch.softmax(scores, dim=-1).to(q.dtype).view(n_kv * b, group, -1)
    o = torch.bmm(probs, vals.reshape(n_kv * b, length, d)).view(n_kv, b, group, d)
    return o.transpose(0, 1).reshape(b, n_head, d)


# change -> (module, attribute, what A uses instead), or a list of them
CHANGES = {
    "packed-weights": (llama, "pack_linear_weight", lambda w, rows: w),
    "ragged-tiles": (llama, "rows_invariant_up_to", lambda weights, rows: False),
    "index-select-gather": (attention, "gather_blocks", _gather_by_indexing),
    "sdpa-decode": (attention, "decode_attention", _decode_attention_bmm),
    "aligned-key-len": (model_runner, "key_len", lambda n, align: max(64, 1 << (n - 1).bit_length())),
    "refine-logits": (llama, "refine_near_max", lambda logits, hidden, weight: None),
    "prefill-gemm-tiles": (llama, "rows_invariant_in_tiles", lambda weights, rows: False),
    "additive-masks": (model_runner, "attention_bias", lambda visible, dtype: visible),
    "paged-attention-kernel": (model_runner, "paged_attention_kernel", lambda: None),
    "fused-ops": (llama, "fused_ops", lambda: None),
    "decode-stack": (llama, "decode_stack", lambda *args: None),
    # A: what this CPU served before the kernel (dtype auto = FP32 without native BF16 matmul)
    "avx2-bf16-gemm": [(kernels, "panel_linear_kernel", lambda: None), (layers, "panel_linear_kernel", lambda: None)],
    "argmax-kernel": (sampler, "argmax_rows", lambda x: x.argmax(dim=-1)),
    "fp32-panels": (layers, "takes_panels", lambda dtype, device: dtype == torch.bfloat16 and _takes_panels(dtype, device)),
    # A: BF16 panels interleaved for the AVX2 micro-kernel where the AVX512-BF16 one serves
    "bf16-pairs": (layers, "_pairs", lambda k: False),
    # A: oneDNN's packed BF16 GEMM, per operator, where inferd's panels and decoder stack serve
    "panels-not-onednn": [(kernels, "onednn_bf16_gemm", lambda: True), (layers, "onednn_bf16_gemm", lambda: True),
                          (kernels, "panel_linear_kernel", lambda: None), (layers, "panel_linear_kernel", lambda: None)],
}
_takes_panels = layers.takes_panels


@contextlib.contextmanager
def without(change: str):
    """Within: ``change`` is undone (for building, or running, engine A)."""
    patches = CHANGES[change] if isinstance(CHANGES[change], list) else [CHANGES[change]]
    origs = [getattr(module, name) for module, name, _ in patches]
    for module, name, replacement in patches:
        setattr(module, name, replacement)
    try:
        yield
    finally:
        for (module, name, _), orig in zip(patches, origs):
            setattr(module, name, orig)


def kernels_at(rev: str):
    """inferd's kernel module compiled from the C++ sources of git revision ``rev`` (kernels._CFLAGS), cached under
    the extensions folder by the sources, flags, torch version and CPU (as kernels._module keys its build); its
    DecodeStack binding is made module-local so that it loads beside this checkout's module."""
    import hashlib
    import os
    import pathlib
    import subprocess

    from torch.utils.cpp_extension import load

    from inferd.cache import cache_dir

    def git(*argv: str) -> str:
        return subprocess.run(["git", *argv], check=True, capture_output=True, text=True, cwd=kernels._CSRC).stdout

    files = [os.path.basename(f) for f in git("ls-tree", "--name-only", rev, "./").split()]
    texts = {f: git("show", f"{rev}:./{f}") for f in files if f.endswith((".cpp", ".h"))}
    if "py::module_local()" not in texts["module.cpp"]:
        texts["module.cpp"] = texts["module.cpp"].replace('(m, "DecodeStack",', '(m, "DecodeStack", py::module_local(),')
    key = [torch.__version__, " ".join(kernels._CFLAGS), kernels._cpu_id(), *(texts[f] for f in sorted(texts))]
    name = "inferd_ab_" + hashlib.sha256("\0".join(key).encode()).hexdigest()[:12]
    folder = os.path.join(cache_dir("extensions"), name)
    os.makedirs(folder, exist_ok=True)
    for f, text in texts.items():  # written once: a rewrite's new mtime would make ninja compile them all again
        path = pathlib.Path(folder, f)
        if not path.exists() or path.read_text() != text:
            path.write_text(text)
    sources = [os.path.join(folder, f) for f in sorted(texts) if f.endswith(".cpp")]
    return load(name=name, sources=sources, extra_cflags=kernels._CFLAGS, extra_ldflags=["-fopenmp"],
                build_directory=folder, verbose=False)


def fixed_prompts(e: LLMEngine, n: int) -> list[list[int]]:
    """The token ids of the ``fixed`` workload's first ``n`` prompts (128 tokens each, ``inferd bench``'s seed 0).
    They share no KV block, so every row's attention reads KV of its own, as in the served benchmarks: until stop 53
    the profiling scripts gave every request one prompt, whose blocks prefix caching then shared, and a 32-row step
    read a 32nd of its KV (docs/performance.md)."""
    return [e.encode(r.prompt) for r in make_requests("fixed", e.tokenizer.hf, n)]


def start_streams(e: LLMEngine, n: int, max_tokens: int = 1000) -> LLMEngine:
    """Add ``n`` greedy requests of the ``fixed`` workload's 128-token prompts (:func:`fixed_prompts`; ignore_eos),
    run their prefills and 3 decode steps."""
    for i, prompt in enumerate(fixed_prompts(e, n)):
        e.add_request(f"r{i}", prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0))
    while any(s.num_computed_tokens < s.num_prompt_tokens for s in e.seqs.values()):
        e.step()
    for _ in range(3):
        e.step()
    return e


def engine(batch: int, dtype: str) -> LLMEngine:
    # 1 GiB, the served benchmarks' KV budget (46,600 tokens): 256 MiB held 11,650, so that past ~80 streams the
    # engine preempted some of them while it was timed.
    e = LLMEngine(EngineConfig(max_num_seqs=batch, kv_cache_memory_bytes=1024**3, max_model_len=4096,
                               dtype=dtype))
    e.collapse_weights()  # as the server does after its first answer
    return start_streams(e, batch)


def prefill_engine(prompt_len: int, dtype: str) -> LLMEngine:
    e = LLMEngine(EngineConfig(max_num_seqs=1, kv_cache_memory_bytes=256 * 1024**2, max_model_len=4096,
                               enable_prefix_caching=False, max_num_batched_tokens=max(2048, prompt_len),
                               dtype=dtype))
    e.collapse_weights()
    return e


def in_turn(i: int, change: str, run_a, run_b) -> tuple[float, float]:
    """Round ``i``'s figures of A (``run_a()`` with ``change`` undone, as a change at run time, the gather, must be
    while A runs) and B (``run_b()``): A first in even rounds, B first in odd ones. The second engine of a round runs
    at the same contexts but after the first, and a fixed order would give that any bias."""
    out = {}
    for which in ("a", "b") if i % 2 == 0 else ("b", "a"):
        if which == "a":
            with without(change):
                out["a"] = run_a()
        else:
            out["b"] = run_b()
    return out["a"], out["b"]


def prefill_time(e: LLMEngine, prompt_len: int, i: int) -> float:
    """Seconds from adding an N-token prompt to its first token (the whole prompt in one step)."""
    prompt = e.encode("word " * prompt_len)[:prompt_len]
    e.add_request(f"p{i}", prompt, SamplingParams(max_tokens=1, temperature=0))
    t0 = time.perf_counter()
    while e.has_unfinished():
        e.step()
    return time.perf_counter() - t0


def round_median(e: LLMEngine, steps: int) -> float:
    ts = []
    for _ in range(steps):
        t0 = time.perf_counter()
        e.step()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    which = ap.add_mutually_exclusive_group()
    which.add_argument("--change", choices=sorted(CHANGES), help="default: packed-weights")
    ap.add_argument("--batch", type=int, action="append", default=None)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--prefill-len", type=int, default=0, help="time one prefill of this many tokens instead")
    ap.add_argument("--dtype", default="auto", help="the engines' --dtype (auto, bfloat16, float32)")
    which.add_argument("--kernels-base", metavar="REV",
                       help="A: the decoder stack and element-wise ops compiled from REV's kernel sources")
    args = ap.parse_args()
    args.change = args.change or "packed-weights"
    if args.kernels_base:
        base = kernels_at(args.kernels_base)
        CHANGES[f"kernels-base {args.kernels_base}"] = (llama, "fused_ops", lambda: base)
        args.change = f"kernels-base {args.kernels_base}"
    if args.prefill_len:
        print(f"{args.change}: A = without, B = with; {torch.get_num_threads()} threads; "
              f"ms to prefill {args.prefill_len} tokens")
        with without(args.change):
            a = prefill_engine(args.prefill_len, args.dtype)
        b = prefill_engine(args.prefill_len, args.dtype)
        ra, rb = [], []
        for i in range(args.rounds + 1):  # the first round warms both up and is not counted
            ta, tb = in_turn(i, args.change, lambda: prefill_time(a, args.prefill_len, i),
                             lambda: prefill_time(b, args.prefill_len, i))
            if i:
                ra.append(ta)
                rb.append(tb)
        ma, mb = statistics.median(ra), statistics.median(rb)
        print(f"A rounds {', '.join(f'{x * 1e3:.0f}' for x in ra)}; B rounds {', '.join(f'{x * 1e3:.0f}' for x in rb)}; "
              f"A median {ma * 1e3:.0f}, B median {mb * 1e3:.0f}, B speed-up {ma / mb:.2f}x")
        return
    print(f"{args.change}: A = without, B = with; {torch.get_num_threads()} threads; ms per decode step")
    print("| running requests | A rounds | B rounds | A median | B median | B speed-up |")
    print("|---:|---|---|---:|---:|---:|")
    for batch in args.batch or [1, 32]:
        with without(args.change):
            a = engine(batch, args.dtype)
        b = engine(batch, args.dtype)
        ra, rb = [], []
        for i in range(args.rounds):
            ta, tb = in_turn(i, args.change, lambda: round_median(a, args.steps), lambda: round_median(b, args.steps))
            ra.append(ta)
            rb.append(tb)
        ma, mb = statistics.median(ra), statistics.median(rb)
        print(f"| {batch} | {', '.join(f'{x * 1e3:.1f}' for x in ra)} | {', '.join(f'{x * 1e3:.1f}' for x in rb)} "
              f"| {ma * 1e3:.1f} | {mb * 1e3:.1f} | {ma / mb:.2f}x |", flush=True)
        del a, b


if __name__ == "__main__":
    main()
