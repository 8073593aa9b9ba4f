"""inferd's GEMM kernels of this checkout against those of a git revision, in one process: the model's prefill
shapes (SmolLM2-135M: QKV 960 x 576 with BF16 output, o 576 x 576 and down 576 x 1,536 adding their FP32 sums into
an FP32 residual, gate_up 3,072 x 576 with SiLU * up fused) at ``--rows`` rows, BF16 weights in panels. Prints
whether the two builds give the same bits and the median time of each over ``--rounds`` rounds; each round runs both,
in an order that alternates from round to round (the second call of a round finds the first one's inputs in cache).

    python benchmarks/ab_gemm.py --base HEAD --rows 2048
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from ab_decode import kernels_at

from inferd.model import kernels
from inferd.model.layers import pack_panels


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", default="HEAD", help="git revision of the kernels to compare with")
    ap.add_argument("--rows", type=int, default=2048)
    ap.add_argument("--rounds", type=int, default=41)
    args = ap.parse_args()
    new, old = kernels._module(), kernels_at(args.base)
    g = torch.Generator().manual_seed(0)
    m = args.rows

    def weight(n: int, k: int) -> torch.Tensor:
        return pack_panels((torch.randn(n, k, generator=g) * 0.05).bfloat16()).data

    def x_of(k: int) -> torch.Tensor:
        return torch.randn(m, k, generator=g).bfloat16()

    w_qkv, w_o, w_down, w_gu = weight(960, 576), weight(576, 576), weight(576, 1536), weight(3072, 576)
    x576, x1536 = x_of(576), x_of(1536)
    h = torch.randn(m, 576, generator=g)
    cases = [  # name, call(module, residual) -> output to compare
        ("QKV 960 x 576, BF16 out", lambda mod, r: mod.panel_linear(x576, w_qkv, 960, None, False)),
        ("o 576 x 576, += FP32", lambda mod, r: mod.panel_linear(x576, w_o, 576, None, True, r)),
        ("down 576 x 1536, += FP32", lambda mod, r: mod.panel_linear(x1536, w_down, 576, None, True, r)),
        ("gate_up + SiLU 3072 x 576", lambda mod, r: mod.panel_linear_silu(x576, w_gu, 1536)),
    ]
    print(f"{args.rows} rows, {torch.get_num_threads()} threads; base {args.base}")
    print("| GEMM | same bits | base ms | this checkout ms | speed-up |")
    print("|---|---|---:|---:|---:|")
    for name, call in cases:
        a, b = call(old, h.clone()), call(new, h.clone())
        same = torch.equal(a.view(torch.int16) if a.dtype == torch.bfloat16 else a.view(torch.int32),
                           b.view(torch.int16) if b.dtype == torch.bfloat16 else b.view(torch.int32))
        times: dict[str, list[float]] = {"base": [], "new": []}
        residual = {"base": h.clone(), "new": h.clone()}  # each build adds into its own
        for i in range(args.rounds):
            order = (("base", old), ("new", new)) if i % 2 else (("new", new), ("base", old))
            for key, mod in order:
                t0 = time.perf_counter()
                call(mod, residual[key])
                times[key].append(time.perf_counter() - t0)
        tb, tn = statistics.median(times["base"]), statistics.median(times["new"])
        print(f"| {name} | {same} | {tb * 1e3:.2f} | {tn * 1e3:.2f} | {tb / tn:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
