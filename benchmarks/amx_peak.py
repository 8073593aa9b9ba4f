"""How far the prefill GEMMs are from the AMX unit's own rate, on one core (a CPU with AMX-BF16 only).

Measures, in nanoseconds per TDPBF16PS (one 16 x 16 x 32 BF16 tile product, 16,384 FLOP):

* the tile unit's rate: a loop of 4 independent tile products on tiles already loaded (no memory), and the same
  with its A and B tiles loaded from L1 each time (4 KiB of 1 KiB tiles, row stride 64 bytes), as Intel's
  Optimization Reference Manual (AMX chapter) gives them: 16 cycles a product; and once more with those tiles 16
  bytes past a cache line, so that each 64-byte row straddles two lines (malloc's large blocks start 16 bytes past
  a page: the attention kernels' scratch did until stop 34);
* ``panel_linear`` (inferd's AMX GEMM, inferd/model/csrc/panel_gemm.cpp) at the model's prefill shapes, 2,000 rows
  by default, on one thread: its time divided by its tile products (ceil(M / 16) x ceil(N / 16) x ceil(K / 32)).

The ratio of the two is what is left in the GEMMs on this machine: the GEMM's tiles come from L2 (x) and from L2 or
memory (the weights), not from registers. Medians of ``--rounds`` runs.

    python benchmarks/amx_peak.py [--rows 2000] [--rounds 9]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch.utils.cpp_extension import load_inline

_SOURCE = r"""
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <chrono>
#include <cstdint>
#include <stdexcept>

namespace {
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};
}  // namespace

// Nanoseconds per tile product: mode 0 from tiles in registers, mode 1 with A and B loaded from L1 before each, mode 2
// as 1 with the rows 16 bytes past a cache line.
double tdp_ns(int64_t mode, int64_t iters) {
  if (syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) != 0)
    throw std::runtime_error("the kernel refused AMX tile data to this process");
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = 16;
    cfg.colsb[t] = 64;
  }
  _tile_loadconfig(&cfg);
  alignas(64) static uint8_t buf[8 * 4096 + 64] = {};  // zeros: BF16 0.0, no denormals or NaN
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  _tile_loadd(4, buf, 64);
  _tile_loadd(5, buf + 1024, 64);
  _tile_loadd(6, buf + 2048, 64);
  _tile_loadd(7, buf + 3072, 64);
  const auto t0 = std::chrono::steady_clock::now();
  for (int64_t i = 0; i < iters; ++i) {
    if (mode >= 1) {
      const uint8_t* b = buf + (i & 7) * 4096 + (mode == 2 ? 16 : 0);
      _tile_loadd(4, b, 64);
      _tile_loadd(6, b + 1024, 64);
      _tile_loadd(7, b + 2048, 64);
      _tile_loadd(5, b + 3072, 64);
    }
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
  }
  _tile_stored(0, buf, 64);
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  _tile_release();
  return s / (4.0 * iters) * 1e9;
}
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=2000, help="GEMM rows (prefill tokens)")
    ap.add_argument("--rounds", type=int, default=9)
    args = ap.parse_args()
    from inferd.model import kernels
    from inferd.model.layers import pack_panels

    module = kernels._module()
    if module is None or not module.amx:
        raise SystemExit("this CPU (or this build) has no AMX-BF16: nothing to measure")
    ext = load_inline("inferd_amx_peak", cpp_sources=_SOURCE, functions=["tdp_ns"],
                      extra_cflags=["-O2", "-march=native", "-mamx-tile", "-mamx-bf16"])
    torch.set_num_threads(1)
    iters = 2_000_000
    peak = {mode: statistics.median(ext.tdp_ns(mode, iters) for _ in range(args.rounds)) for mode in (0, 1, 2)}
    print(f"tile products, one core: {peak[0]:.2f} ns each from registers, {peak[1]:.2f} ns with A and B from L1 "
          f"({16384 / peak[0] / 1e3:.2f} TFLOP/s), {peak[2]:.2f} ns with A and B from L1 rows that straddle cache "
          f"lines\n")
    print("| GEMM (N x K) | ms, one thread | ns per tile product | TFLOP/s | x the registers' rate |")
    print("|---|---|---|---|---|")
    gemm = module.panel_linear
    g = torch.Generator().manual_seed(0)
    m = args.rows
    for name, n, k, fp32 in (("qkv", 960, 576, False), ("o", 576, 576, True), ("gate_up", 3072, 576, False),
                             ("down", 576, 1536, True)):
        w = pack_panels((torch.randn(n, k, generator=g) * 0.05).bfloat16())
        x = torch.randn(m, k, generator=g).bfloat16()
        gemm(x, w.data, n, None, fp32)
        times = []
        for _ in range(args.rounds):
            t0 = time.perf_counter()
            gemm(x, w.data, n, None, fp32)
            times.append(time.perf_counter() - t0)
        t = statistics.median(times)
        products = -(-m // 16) * -(-n // 16) * -(-k // 32)
        ns = t / products * 1e9
        print(f"| {name} ({n} x {k}) | {t * 1e3:.2f} | {ns:.2f} | {2 * m * n * k / t / 1e12:.2f} | "
              f"{ns / peak[0]:.1f} |")


if __name__ == "__main__":
    main()
