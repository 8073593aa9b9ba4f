"""The paged attention kernel of this checkout against the one of a git revision, in one process: one layer's
attention for a prompt of ``--tokens`` prefill rows (causal; ``--prompts P`` such prompts in one call), or
``--decode N`` decode rows of ``--tokens`` keys each, over a KV cache whose blocks are shuffled (``--in-order``: each
sequence's blocks consecutive, as the block manager's runs leave them; SmolLM2-135M's
heads: 9 query heads, 3 KV heads, head dim 64, BF16). Prints whether the two kernels give the same bits, each one's
largest difference from torch's FP32 SDPA (one prompt), and the median time of each over interleaved rounds (which
build runs first alternates from round to round: the second finds the first one's rows in cache). ``--layers N``
times N calls over N caches of their own, as a step's layers are, so that the KV rows come from memory rather than
the last level cache.

    python benchmarks/ab_attention.py --base HEAD --tokens 2000
    python benchmarks/ab_attention.py --base HEAD --tokens 500 --decode 32
    python benchmarks/ab_attention.py --base HEAD --tokens 300 --decode 32 --layers 30
    python benchmarks/ab_attention.py --base HEAD --tokens 128 --prompts 16   # a 2,048-row step of fixed at 32
    python benchmarks/ab_attention.py --base HEAD --tokens 1800 --chunk 7 --layers 30 --in-order --rounds 9  # issue 6, goal 3

``--chunk N``: a step of chunked prefill beside a stream, N prefill rows of one prompt ending at ``--tokens`` keys
and one decode row over 200 keys of another sequence.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from ab_decode import kernels_at

from inferd.model import kernels


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", default="HEAD", help="git revision of the kernel to compare with")
    ap.add_argument("--tokens", type=int, default=2000)
    ap.add_argument("--decode", type=int, default=0, help="decode rows (0: prompts of prefill rows)")
    ap.add_argument("--prompts", type=int, default=1, help="prompts of --tokens prefill rows each, in one call")
    ap.add_argument("--chunk", type=int, default=0,
                    help="N: a decode row beside the last N prefill rows of a prompt of --tokens (0: off)")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--layers", type=int, default=1, help="calls per round, each over a cache of its own")
    ap.add_argument("--in-order", action="store_true",
                    help="each sequence's blocks consecutive (as the block manager's runs leave them), not shuffled")
    args = ap.parse_args()
    if args.chunk and not 1 <= args.chunk <= args.tokens:
        ap.error(f"--chunk must be in [1, --tokens], got {args.chunk}")
    if args.chunk and (args.decode or args.prompts != 1):
        ap.error("--chunk is a step of its own: not with --decode or --prompts")
    new, old = kernels._module().paged_attention, kernels_at(args.base).paged_attention
    g = torch.Generator().manual_seed(0)
    heads, kv_heads, d, bs, n = 9, 3, 64, 16, args.tokens
    seqs = 2 if args.chunk else args.decode or args.prompts
    per_seq = (n + bs - 1) // bs
    caches = [(torch.randn(kv_heads, seqs * per_seq + 8, bs, d, generator=g).bfloat16(),
               torch.randn(kv_heads, seqs * per_seq + 8, bs, d, generator=g).bfloat16()) for _ in range(args.layers)]
    k_cache, v_cache = caches[0]
    order = torch.arange(k_cache.size(1)) if args.in_order else torch.randperm(k_cache.size(1), generator=g)
    tables = order[: seqs * per_seq].view(seqs, per_seq)
    if args.chunk:
        q = torch.randn(1 + args.chunk, heads, d, generator=g).bfloat16()
        lens = torch.tensor([min(200, n)] + list(range(n - args.chunk + 1, n + 1)))
        call = (q, k_cache, v_cache, tables, torch.tensor([0] + [1] * args.chunk), lens, 1, d ** -0.5)
    elif args.decode:
        q = torch.randn(seqs, heads, d, generator=g).bfloat16()
        call = (q, k_cache, v_cache, tables, torch.arange(seqs), torch.full((seqs,), n), seqs, d ** -0.5)
    else:
        q = torch.randn(seqs * n, heads, d, generator=g).bfloat16()
        rows = torch.arange(seqs * n)
        call = (q, k_cache, v_cache, tables, rows // n, rows % n + 1, 0, d ** -0.5)
    a, b = old(*call), new(*call)
    print(f"same bits: {torch.equal(a, b)}; largest difference {(a.float() - b.float()).abs().max().item():.3g}")
    if not args.decode and not args.chunk and seqs == 1:
        keys = k_cache[:, tables[0]].reshape(kv_heads, -1, d)[:, :n].float()
        vals = v_cache[:, tables[0]].reshape(kv_heads, -1, d)[:, :n].float()
        ref = torch.nn.functional.scaled_dot_product_attention(q.float().transpose(0, 1), keys, vals, is_causal=True,
                                                               enable_gqa=True).transpose(0, 1)
        print(f"largest difference from FP32 SDPA: base {(a.float() - ref).abs().max().item():.3g}, "
              f"this checkout {(b.float() - ref).abs().max().item():.3g}")
    times: dict[str, list[float]] = {"base": [], "new": []}
    for i in range(args.rounds):
        for name, fn in ((("base", old), ("new", new)) if i % 2 else (("new", new), ("base", old))):
            t0 = time.perf_counter()
            for k, v in caches:
                fn(call[0], k, v, *call[3:])
            times[name].append(time.perf_counter() - t0)
    tb, tn = statistics.median(times["base"]), statistics.median(times["new"])
    print(f"{args.base}: {tb * 1e3:.2f} ms, this checkout: {tn * 1e3:.2f} ms, {tb / tn:.2f}x (medians of "
          f"{args.rounds}, {args.layers} call{'s' if args.layers > 1 else ''} each)")


if __name__ == "__main__":
    main()
