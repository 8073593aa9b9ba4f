"""What this machine's memory gives the access patterns of a decode step: read rates (GB/s, 2 threads by default)
by working-set size (where the last level cache ends for this guest), and 1 GiB read in chunks of 2-32 KiB in a
shuffled order, as decode attention reads its KV blocks (one head's block of 16 keys x 64 dims in BF16 is 2 KiB),
with and without software prefetches three chunks ahead. Prints markdown tables; the figures of a run are quoted in
docs/performance.md (stop 37).

    python benchmarks/memory_patterns.py
    python benchmarks/memory_patterns.py --threads 1 --gib 0.5

The loops are C++ (AVX-512 loads summed, so nothing is optimised away), compiled once into the extensions cache by
torch.utils.cpp_extension; a CPU without AVX-512F cannot run them (RuntimeError from the build).
"""

from __future__ import annotations

import argparse
import os

from torch.utils.cpp_extension import load_inline

from inferd.cache import cache_dir

_SOURCE = r"""
#include <immintrin.h>
#include <omp.h>
#include <torch/extension.h>
#include <algorithm>
#include <chrono>
#include <cstring>
#include <random>
#include <vector>

namespace {

struct Buffer {
  char* p;
  size_t bytes;
  explicit Buffer(size_t b) : p(static_cast<char*>(std::aligned_alloc(4096, b))), bytes(b) {
    TORCH_CHECK(p != nullptr, "out of memory");
    std::memset(p, 1, b);
  }
  ~Buffer() { std::free(p); }
};

inline __m512 sum_chunk(const char* p, size_t bytes, const char* ahead, int hint, __m512 acc) {
  if (ahead != nullptr && hint >= 0)  // a burst of prefetches for the chunk three ahead, then the reads
    for (size_t o = 0; o < bytes; o += 64) {
      if (hint == 0) _mm_prefetch(ahead + o, _MM_HINT_T0);
      else _mm_prefetch(ahead + o, _MM_HINT_T1);
    }
  for (size_t o = 0; o < bytes; o += 64) acc = _mm512_add_ps(acc, _mm512_load_ps(reinterpret_cast<const float*>(p + o)));
  return acc;
}

}  // namespace

// Median seconds of `rounds` passes over `bytes` read in chunks of `chunk` bytes: in order, or shuffled; hint -1 none,
// 0 PREFETCHT0, 1 PREFETCHT1 (the chunk three ahead in this thread's order).
double read_rate(int64_t bytes, int64_t chunk, bool shuffled, int64_t hint, int64_t threads, int64_t rounds) {
  TORCH_CHECK(bytes >= chunk && chunk % 64 == 0 && bytes % 4096 == 0 && threads >= 1 && rounds >= 1,
              "read_rate: bytes a multiple of 4096 and at least one chunk, chunks of 64-byte lines, threads and "
              "rounds at least 1");
  Buffer buf{size_t(bytes)};
  const size_t n = size_t(bytes / chunk);
  std::vector<size_t> order(n);
  for (size_t i = 0; i < n; ++i) order[i] = i;
  if (shuffled) std::shuffle(order.begin(), order.end(), std::mt19937(1));
  std::vector<double> times;
  float total = 0;
  for (int64_t r = 0; r < rounds + 1; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
#pragma omp parallel num_threads(int(threads))
    {
      const size_t t = size_t(omp_get_thread_num()), nt = size_t(omp_get_num_threads());
      const size_t c0 = n * t / nt, c1 = n * (t + 1) / nt;
      __m512 acc = _mm512_setzero_ps();
      for (size_t c = c0; c < c1; ++c)
        acc = sum_chunk(buf.p + order[c] * chunk, size_t(chunk), c + 3 < c1 ? buf.p + order[c + 3] * chunk : nullptr,
                        int(hint), acc);
      const float mine = _mm512_reduce_add_ps(acc);
#pragma omp atomic
      total += mine;
    }
    if (r > 0) times.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  TORCH_CHECK(total >= 0, "unreachable: every byte read is 1");  // keeps the sums
  std::sort(times.begin(), times.end());
  return times[times.size() / 2];
}
"""


def _module():
    build = os.path.join(cache_dir("extensions"), "memory_patterns")
    os.makedirs(build, exist_ok=True)
    return load_inline("inferd_memory_patterns", cpp_sources=_SOURCE, functions=["read_rate"],
                       extra_cflags=["-O3", "-march=native", "-fopenmp"], extra_ldflags=["-fopenmp"],
                       build_directory=build, verbose=False)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--gib", type=float, default=1.0, help="bytes of the chunked reads, in GiB")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    if args.threads < 1 or args.rounds < 1 or args.gib < 1 / 1024:
        ap.error("--threads and --rounds must be at least 1, --gib at least 1/1024 (1 MiB)")
    m = _module()
    mib = 2**20
    print(f"Read rate by working set ({args.threads} threads, the median pass of max({args.rounds}, 1024 / MiB) passes "
          "over one buffer):\n")
    print("| working set (MiB) | GB/s |\n|---:|---:|")
    for size in (4, 16, 64, 128, 160, 192, 256, 512):
        reps = max(args.rounds, 1024 // size)
        t = m.read_rate(size * mib, 64 * 1024, False, -1, args.threads, reps)
        print(f"| {size} | {size * mib / t / 1e9:.1f} |")
    total = int(args.gib * 1024) * mib
    print(f"\n{args.gib:g} GiB read in chunks ({args.threads} threads, medians of {args.rounds}):\n")
    print("| chunks | order | prefetch (3 chunks ahead) | GB/s |\n|---|---|---|---:|")
    cases = [(32 * 1024, False, -1)] + [(c * 1024, True, -1) for c in (2, 4, 8, 32)] + [(2048, True, 0), (2048, True, 1)]
    for chunk, shuffled, hint in cases:
        rate = total / m.read_rate(total, chunk, shuffled, hint, args.threads, args.rounds) / 1e9
        print(f"| {chunk // 1024} KiB | {'shuffled' if shuffled else 'in order'} | "
              f"{['none', 'PREFETCHT0', 'PREFETCHT1'][hint + 1]} | {rate:.1f} |")


if __name__ == "__main__":
    main()
