// y = x @ W.T (+ b) with FP32 accumulation, for x86 CPUs with AVX2 + FMA and without AMX (AMD Zen, Intel before
// Sapphire Rapids). On AVX2-only CPUs torch's BF16 GEMM falls back to a slow generic kernel, FP32 weights read twice
// the bytes per decode step, and MKL's FP32 GEMM on the few rows of a decode step (AMD Zen 3) reaches 20-60 GFLOP/s
// where this kernel is bound by the weights' bytes (docs/performance.md, stop 22); on AMD Zen 5 this kernel, with its
// AVX512-BF16 micro-kernel below, beats oneDNN's BF16 GEMM at every size a step has (stop 24).
//
// The weight is packed once into panels of 16 output columns, [N / 16, K, 16], the 16 values of one k together:
// - BF16 weights interleaved, so that a single 32-byte load gives columns 0-7 (the low halves of its eight 32-bit
//   words, moved up by a shift: a BF16 is the top half of an FP32) and columns 8-15 (the high halves, kept by a
//   mask): [p, k, j, h] = W[16 p + 8 h + j, k];
// - FP32 weights in column order, two 32-byte loads: [p, k, h, j] = W[16 p + 8 h + j, k].
// The micro-kernel is the usual register-blocked outer product (Goto & van de Geijn 2008, "Anatomy of
// High-Performance Matrix Multiplication"): up to 6 rows x 16 columns of FP32 accumulators, one broadcast x
// value and two weight vectors per k.
//
// On CPUs with AVX512-BF16 (AMD Zen 4/5, Intel Cooper Lake and later; the build's -march=native says), BF16
// weights of an even K are packed in pairs of k instead, [p, kk, j, t] = W[16 p + j, 2 kk + t], so that one 64-byte
// load gives a k-pair of all 16 columns, and x is packed as BF16 pairs: vdpbf16ps then adds both products of a pair
// to each FP32 accumulator, 16 columns and 2 k per instruction, 4x the multiply-adds of an AVX2 FMA. A pair's two
// products are exact in FP32 (8-bit significands) and added to the accumulator one after the other, k = 2 kk + 1
// first, then 2 kk (Intel SDM, VDPBF16PS; AMD Zen 5 gives those bits), each rounded once; its inputs and outputs
// flush denormals to zero. x is BF16 there (the model's activations are; an FP32 x is rounded to nearest even
// first, as oneDNN's BF16 matmul takes BF16 inputs).
//
// On CPUs with AMX (Intel Sapphire Rapids and later), pair panels are multiplied on AMX tiles instead (amx_pairs()):
// a pair panel is already the layout of TDPBF16PS's B operand (16 rows of k-pairs, 64 bytes each: 16 columns x 2),
// so a 16 x 64-byte tile loads straight from the panel; x is packed row-major in BF16 pairs (16-row A tiles) and each
// 16 x 16 FP32 C tile sums 16 k-pairs per instruction (Intel SDM, TDPBF16PS; Intel's Optimization Reference Manual,
// AMX chapter). Up to 2 row blocks x 2 panels of C tiles, 2 A and 2 B tiles: the 8 tile registers. A row's C values
// depend only on its own A row and the weights, through the same instruction sequence over k whatever the number of
// rows, so batch invariance holds there too; the bits are TDPBF16PS's (it rounds differently from a chain of
// vdpbf16ps), which is why every pair GEMM of a process runs on AMX once it does. Measured against oneDNN and the
// vdpbf16ps kernel in docs/performance.md (stop 28).
//
// Every output element is one chain of FMAs over k = 0 .. K-1 in order (with pair panels: over the k-pairs in
// order, each pair's two products in the instruction's order), started from zero, whatever the number of rows M,
// the row's place in the batch, the micro-tile height or the thread that runs it; the bias is added after the
// chain. So a row's result is the same bits alone and in any batch (batch invariance without padded tiles).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include "ops.h"
#include "vec.h"

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <type_traits>

#include <omp.h>
#include <sys/syscall.h>
#include <unistd.h>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kNr = inferd::kPanel;     // output columns per panel
constexpr int64_t kMr = inferd::kTileRows;  // rows per micro-tile
constexpr int64_t kMChunk = 96;  // rows whose FP32 copy stays in cache while every panel passes over them
using inferd::kAmxPairs;
using inferd::kAmxRows;

#if defined(__AVX2__) && defined(__FMA__)
inline void store8(float* o, __m256 v) { _mm256_storeu_ps(o, v); }

// 8 floats rounded to BF16, to nearest even (NaN -> 0x7FC0), as c10::BFloat16(float) and torch's .to() round.
inline void store8(at::BFloat16* o, __m256 v) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08);  // 16-bit halves, in order
  _mm_storeu_si128(reinterpret_cast<__m128i*>(o), _mm256_castsi256_si128(packed));
}
#endif

#if defined(__AVX2__) && defined(__FMA__)
// The 16 weights of one k of a panel as FP32: columns 0-7 in lo, 8-15 in hi.
inline void load16(const uint16_t* w, __m256& lo, __m256& hi) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w));
  lo = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
  hi = _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32(int32_t(0xFFFF0000u))));
}
inline void load16(const float* w, __m256& lo, __m256& hi) {
  lo = _mm256_loadu_ps(w);
  hi = _mm256_loadu_ps(w + 8);
}
#endif

// out[r * ldo + 16 q + j] = sum_k x[k * 6 + r] * panel_q[k, j] (+ bias[16 q + j]) for r < MR, q < NP, j < 16
// and 16 q + j < cols, where panel_q starts at w + q * panel_stride. MR x NP x 2 accumulators of 8 floats (12
// at most, in registers): few rows go over several panels at once so that enough independent FMA chains hide
// the FMA latency. W: uint16_t (BF16 panels) or float.
template <int MR, int NP, typename Out, typename W>
void micro_tile(const float* x, const W* w, int64_t panel_stride, int64_t K, const float* bias,
                Out* out, int64_t ldo, int64_t cols) {
#if defined(__AVX2__) && defined(__FMA__)
  __m256 acc[MR][NP][2];
#pragma GCC unroll 16
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 16
    for (int q = 0; q < NP; ++q) acc[r][q][0] = acc[r][q][1] = _mm256_setzero_ps();
#pragma GCC unroll 2
  for (int64_t k = 0; k < K; ++k) {
    __m256 w0[NP], w1[NP];
#pragma GCC unroll 16
    for (int q = 0; q < NP; ++q) load16(w + q * panel_stride + k * kNr, w0[q], w1[q]);
#pragma GCC unroll 16
    for (int r = 0; r < MR; ++r) {
      const __m256 xb = _mm256_broadcast_ss(x + k * kMr + r);
#pragma GCC unroll 16
      for (int q = 0; q < NP; ++q) {
        acc[r][q][0] = _mm256_fmadd_ps(xb, w0[q], acc[r][q][0]);
        acc[r][q][1] = _mm256_fmadd_ps(xb, w1[q], acc[r][q][1]);
      }
    }
  }
  if (bias) {  // after the chain, as F.linear adds it
#pragma GCC unroll 16
    for (int q = 0; q < NP; ++q) {
      const __m256 b0 = _mm256_loadu_ps(bias + q * kNr), b1 = _mm256_loadu_ps(bias + q * kNr + 8);
#pragma GCC unroll 16
      for (int r = 0; r < MR; ++r) {
        acc[r][q][0] = _mm256_add_ps(acc[r][q][0], b0);
        acc[r][q][1] = _mm256_add_ps(acc[r][q][1], b1);
      }
    }
  }
  if (cols == NP * kNr) {
#pragma GCC unroll 16
    for (int r = 0; r < MR; ++r)
#pragma GCC unroll 16
      for (int q = 0; q < NP; ++q) {
        store8(out + r * ldo + q * kNr, acc[r][q][0]);
        store8(out + r * ldo + q * kNr + 8, acc[r][q][1]);
      }
  } else {  // the last panel of an output width that is not a multiple of 16
    alignas(64) Out tmp[NP * kNr];
#pragma GCC unroll 16
    for (int r = 0; r < MR; ++r) {
#pragma GCC unroll 16
      for (int q = 0; q < NP; ++q) {
        store8(tmp + q * kNr, acc[r][q][0]);
        store8(tmp + q * kNr + 8, acc[r][q][1]);
      }
      std::memcpy(out + r * ldo, tmp, cols * sizeof(Out));
    }
  }
#else
  TORCH_CHECK(false, "panel_linear needs AVX2 and FMA (inferd/model/kernels.py offers it only there)");
#endif
}

template <typename Out, typename W>
using TileFn = void (*)(const float*, const W*, int64_t, int64_t, const float*, Out*, int64_t, int64_t);
// By rows in the micro-tile (1-6): panels per tile, and the tile over that many panels and over one.
constexpr int kPanelsFor[kMr + 1] = {0, 4, 3, 2, 1, 1, 1};
template <typename Out, typename W>
constexpr TileFn<Out, W> kWide[kMr + 1] = {nullptr,
                                           micro_tile<1, 4, Out, W>, micro_tile<2, 3, Out, W>, micro_tile<3, 2, Out, W>,
                                           micro_tile<4, 1, Out, W>, micro_tile<5, 1, Out, W>, micro_tile<6, 1, Out, W>};
template <typename Out, typename W>
constexpr TileFn<Out, W> kOne[kMr + 1] = {nullptr,
                                          micro_tile<1, 1, Out, W>, micro_tile<2, 1, Out, W>, micro_tile<3, 1, Out, W>,
                                          micro_tile<4, 1, Out, W>, micro_tile<5, 1, Out, W>, micro_tile<6, 1, Out, W>};

#if defined(INFERD_BF16_PAIRS)
inline void store16(float* o, __m512 v) { _mm512_storeu_ps(o, v); }
inline void store16(at::BFloat16* o, __m512 v) { inferd::store_bf16_16(o, v); }
#endif

// The micro-tile over BF16 pair panels (uint32_t words: [kk, 16] per panel) and x in BF16 pairs ([kk, 6] words per
// tile): MR x NP accumulators of 16 floats (24 at most, of 32 registers), one vdpbf16ps per (row, panel, k-pair).
// Meanwhile the k-pair rows of npf panels from pf (a 64-byte line per k-pair and panel) are prefetched: the next
// group's weights, while this group's come from L2 (gemm_panels).
// Up to kAheadRows rows (one pass, each weight line used by as few rows) the micro-tile prefetches its own panels'
// lines kAhead k-pairs (1 KiB) ahead into L2 (npf < 0): four 64-byte streams per thread, panel by panel, which the
// hardware prefetcher alone kept at ~46 GB/s of the ~60 a plain read got on AMD Zen 4. Decode steps in one process,
// alternating (docs/performance.md, stop 41): 1 row 1.07-1.08x, 2 rows 1.04-1.05x, 3 rows 1.02-1.06x; at 4 rows it
// gave 0.995x, so more rows do not; 8 or 32 k-pairs ahead gave 1.05x and 1.01x at 1 row. (AMX's GEMM, on Sapphire
// Rapids, does not come here.)
constexpr int64_t kAhead = 16, kAheadRows = 3;
template <int MR, int NP, typename Out>
void micro_tile_pairs(const uint32_t* x, const uint32_t* w, int64_t panel_stride, int64_t KP, const float* bias,
                      Out* out, int64_t ldo, int64_t cols, const uint32_t* pf, int64_t npf) {
#if defined(INFERD_BF16_PAIRS)
  __m512 acc[MR][NP];
#pragma GCC unroll 16
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 16
    for (int q = 0; q < NP; ++q) acc[r][q] = _mm512_setzero_ps();
  const auto chain = [&](auto prefetch, auto ahead) {  // three copies of the loop
    for (int64_t kk = 0; kk < KP; ++kk) {
      if constexpr (decltype(prefetch)::value)
        for (int64_t j = 0; j < npf; ++j)
          _mm_prefetch(reinterpret_cast<const char*>(pf + j * panel_stride + kk * kNr), _MM_HINT_T0);
      if constexpr (decltype(ahead)::value)
        if (kk + kAhead < KP)  // within each panel (past its end would be past the weight's, for the last)
#pragma GCC unroll 16
          for (int q = 0; q < NP; ++q)
            _mm_prefetch(reinterpret_cast<const char*>(w + q * panel_stride + (kk + kAhead) * kNr), _MM_HINT_T1);
      __m512bh wv[NP];
#pragma GCC unroll 16
      for (int q = 0; q < NP; ++q) wv[q] = (__m512bh)_mm512_loadu_si512(w + q * panel_stride + kk * kNr);
#pragma GCC unroll 16
      for (int r = 0; r < MR; ++r) {
        const __m512bh xb = (__m512bh)_mm512_set1_epi32(int32_t(x[kk * kMr + r]));
#pragma GCC unroll 16
        for (int q = 0; q < NP; ++q) acc[r][q] = _mm512_dpbf16_ps(acc[r][q], xb, wv[q]);
      }
    }
  };
  if (npf > 0)
    chain(std::true_type{}, std::false_type{});
  else if (npf < 0)
    chain(std::false_type{}, std::true_type{});
  else
    chain(std::false_type{}, std::false_type{});
  if (bias) {  // after the chain, as F.linear adds it
#pragma GCC unroll 16
    for (int q = 0; q < NP; ++q) {
      const __m512 b = _mm512_loadu_ps(bias + q * kNr);
#pragma GCC unroll 16
      for (int r = 0; r < MR; ++r) acc[r][q] = _mm512_add_ps(acc[r][q], b);
    }
  }
  if (cols == NP * kNr) {
#pragma GCC unroll 16
    for (int r = 0; r < MR; ++r)
#pragma GCC unroll 16
      for (int q = 0; q < NP; ++q) store16(out + r * ldo + q * kNr, acc[r][q]);
  } else {  // the last panel of an output width that is not a multiple of 16
    alignas(64) Out tmp[NP * kNr];
#pragma GCC unroll 16
    for (int r = 0; r < MR; ++r) {
#pragma GCC unroll 16
      for (int q = 0; q < NP; ++q) store16(tmp + q * kNr, acc[r][q]);
      std::memcpy(out + r * ldo, tmp, cols * sizeof(Out));
    }
  }
#else
  TORCH_CHECK(false, "BF16 pair panels need AVX512-BF16 (pack_panels makes them only there)");
#endif
}

template <typename Out>
using PairTileFn = void (*)(const uint32_t*, const uint32_t*, int64_t, int64_t, const float*, Out*, int64_t, int64_t,
                            const uint32_t*, int64_t);
template <typename Out, int NP>
constexpr PairTileFn<Out> kPairsRow[kMr + 1] = {
    nullptr, micro_tile_pairs<1, NP, Out>, micro_tile_pairs<2, NP, Out>, micro_tile_pairs<3, NP, Out>,
    micro_tile_pairs<4, NP, Out>, micro_tile_pairs<5, NP, Out>, micro_tile_pairs<6, NP, Out>};
// By panels (1-4), then rows (1-6): a group's last 1-3 panels too go over every row of a tile at once.
template <typename Out>
constexpr const PairTileFn<Out>* kPairs[5] = {nullptr, kPairsRow<Out, 1>, kPairsRow<Out, 2>, kPairsRow<Out, 3>,
                                              kPairsRow<Out, 4>};

#if defined(INFERD_AMX)
// The next panel pair's weights, brought into L2 a few lines after each k-step of the later passes over one pair's
// row blocks (gemm_amx), so that the first pass over that pair reads them from L2 instead of waiting on memory with
// the tile unit idle. Only prefetches: the bits are the same.
struct WeightsAhead {
  const char* at = nullptr;
  const char* end = nullptr;
  int64_t lines_per_step = 0;
  void step() {
    for (int64_t i = 0; i < lines_per_step && at < end; ++i, at += 64) _mm_prefetch(at, _MM_HINT_T1);
  }
};

// C [RB * 16, NP * 16] FP32 (row stride NP * 16) = RB row blocks of x (a0, a1; row stride ldx words, BF16 pairs)
// times NP pair panels (w0, w1) over KP k-pairs, 16 per TDPBF16PS in order. The last step's k-pairs past KP are zero
// in the packed x and in a zeroed copy of the panels' rows (so nothing is read past a panel). Tiles 0-3: C of (row
// block r, panel q) as 2 r + q; 4, 5: A of the row blocks; 6, 7: B of the panels. Each A tile is used by the block's
// products only, so it is loaded with TILELOADDT1 (x streams from L2 without displacing the panels' B tiles in L1),
// and the loads are interleaved with the products that use them (1.1-1.2x on 2,000-row GEMMs, stop 30).
// epilogue(r0, r1) is the vector work on rows [r0, r1) of the previous block's C (bias, rounding, stores; SiLU), run
// while the tile unit works through this block's products. With kSliced its kEpilogueRows rows go in slices, one
// after each k-step's products: SiLU's ~45 instructions per 16 values, all issued after the products, filled the
// reorder buffer behind products that had not completed, so most of it waited for them (gate_up + SiLU 1.16-1.20x
// sliced). A plain GEMM's bias, rounding and stores run after the last step (sliced: 0.97x; docs/performance.md,
// stop 33).
// With `ahead`, each k-step's products are followed by prefetches of the next weights (WeightsAhead).
constexpr int64_t kEpilogueRows = 2 * kAmxRows;
template <int RB, int NP, bool kSliced = true, typename F>
void amx_block_then(const uint32_t* a0, const uint32_t* a1, int64_t ldx, const uint32_t* w0, const uint32_t* w1,
                    int64_t KP, float* c, F&& epilogue, WeightsAhead* ahead = nullptr) {
  _tile_zero(0);
  if constexpr (NP > 1) _tile_zero(1);
  if constexpr (RB > 1) _tile_zero(2);
  if constexpr (RB > 1 && NP > 1) _tile_zero(3);
  const int64_t lda = ldx * 4;
  const auto step = [&](int64_t kk, const uint32_t* b0, const uint32_t* b1) {
    _tile_stream_loadd(4, a0 + kk, lda);
    _tile_loadd(6, b0, 64);
    _tile_dpbf16ps(0, 4, 6);
    if constexpr (NP > 1) _tile_loadd(7, b1, 64);
    if constexpr (NP > 1) _tile_dpbf16ps(1, 4, 7);
    if constexpr (RB > 1) _tile_stream_loadd(5, a1 + kk, lda);
    if constexpr (RB > 1) _tile_dpbf16ps(2, 5, 6);
    if constexpr (RB > 1 && NP > 1) _tile_dpbf16ps(3, 5, 7);
  };
  const int64_t full = KP / kAmxPairs * kAmxPairs, steps = (KP + kAmxPairs - 1) / kAmxPairs;
  int64_t s = 0;
  const auto slice = [&] {  // the epilogue's rows of step s: [s R / steps, (s + 1) R / steps), all R over the steps
    if constexpr (kSliced) epilogue(s * kEpilogueRows / steps, (s + 1) * kEpilogueRows / steps);
    ++s;
    if (ahead) ahead->step();
  };
  for (int64_t kk = 0; kk < full; kk += kAmxPairs) {
    step(kk, w0 + kk * kNr, w1 + kk * kNr);
    slice();
  }
  if (full < KP) {
    alignas(64) uint32_t tail[2][kAmxPairs * kNr] = {};
    for (int q = 0; q < NP; ++q)
      std::memcpy(tail[q], (q == 0 ? w0 : w1) + full * kNr, (KP - full) * kNr * sizeof(uint32_t));
    // GCC's tile intrinsics are asm statements that do not say they read memory: without this compiler barrier the
    // stores to `tail` above are dropped as dead.
    asm volatile("" ::: "memory");
    step(full, tail[0], tail[1]);
    slice();
  }
  if constexpr (!kSliced) epilogue(0, kEpilogueRows);  // after the loop: inside it, o and down ran 0.83-0.91x
  const int64_t ldc = NP * kNr * sizeof(float);
  _tile_stored(0, c, ldc);
  if constexpr (NP > 1) _tile_stored(1, c + kNr, ldc);
  if constexpr (RB > 1) _tile_stored(2, c + kAmxRows * NP * kNr, ldc);
  if constexpr (RB > 1 && NP > 1) _tile_stored(3, c + kAmxRows * NP * kNr + kNr, ldc);
  asm volatile("" ::: "memory");  // the stores above are asm too: c is written before anything reads it
}

// Row blocks of x per pass of a GEMM's panels on AMX (192 rows, 221 KB of x at K = 576, in L2): each panel pair's
// B tiles serve 6 calls of amx_block_then from L1 (within noise of 96 rows, 1.05x for gate_up; stop 30).
constexpr int64_t kAmxChunk = 12;

// Rows of x from which gemm_amx prefetches its next weights while it multiplies (WeightsAhead).
constexpr int64_t kLookAheadRows = 8;

// Each row's running argmax over the columns of the panels one thread covers, for the logits' argmax without
// writing the logits (panel_linear_argmax): lane l of row r keeps the largest value of the columns 16 p + l it has
// seen, the first such column, and the first NaN's column (kNoColumn: none yet), [M, 16] each. A lane takes a value
// that is strictly greater, or equal at a smaller column, so the order in which panels come does not matter.
constexpr int32_t kNoColumn = INT32_MAX;
struct LaneArgmax {
  float* best = nullptr;
  int32_t* col = nullptr;
  int32_t* nan_col = nullptr;
};

#if defined(INFERD_AMX)
// Row `row`'s 16 values v of columns col0 .. col0 + 15 (lanes off in `valid` past the output's width) into its lanes.
inline void lane_argmax(const LaneArgmax& am, int64_t row, __m512 v, __mmask16 valid, int32_t col0) {
  float* bp = am.best + row * kNr;
  int32_t *cp = am.col + row * kNr, *np = am.nan_col + row * kNr;
  const __m512i none = _mm512_set1_epi32(kNoColumn);
  const __m512i cols = _mm512_add_epi32(_mm512_set1_epi32(col0),
                                        _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
  const __m512 best = _mm512_loadu_ps(bp);
  const __m512i col = _mm512_loadu_si512(cp);
  const __mmask16 nan = _mm512_mask_cmp_ps_mask(valid, v, v, _CMP_UNORD_Q);
  const __mmask16 take =
      valid & ~nan &
      (_mm512_cmp_ps_mask(v, best, _CMP_GT_OQ) | _mm512_cmpeq_epi32_mask(col, none) |
       (_mm512_cmp_ps_mask(v, best, _CMP_EQ_OQ) & _mm512_cmplt_epi32_mask(cols, col)));
  _mm512_storeu_ps(bp, _mm512_mask_mov_ps(best, take, v));
  _mm512_storeu_si512(cp, _mm512_mask_mov_epi32(col, take, cols));
  if (nan) {
    const __m512i n = _mm512_loadu_si512(np);
    _mm512_storeu_si512(np, _mm512_mask_min_epi32(n, nan, n, cols));
  }
}
#endif

// Output panels [begin, end) of all M rows on AMX tiles: x in chunks of kAmxChunk row blocks (in L2), each passed
// over by every pair of panels of the range, 2 row blocks at a time; then the bias and the rounding, row by row.
// With `tail`, x holds only the M / 16 whole row blocks and tail the last one (rows past M zero): a BF16 x whose
// rows are whole tiles of k-pairs is read where it is, not copied (panel_linear).
// With `accumulate` (FP32 out): out += the sums (+ bias), each element one FP32 add, as add_rms_norm_row adds a
// delta to the residual row: the residual stream takes a projection without an [M, N] FP32 delta written and read
// back (2,000 rows: 4.6 MB of stores and their read-for-ownership per o or down projection, stop 31).
template <typename Out>
void gemm_amx(const uint32_t* x, const uint32_t* tail, int64_t M, int64_t K, const uint32_t* w, int64_t N,
              const float* bias, Out* out, int64_t begin, int64_t end, bool accumulate = false,
              const LaneArgmax* argmax = nullptr) {
  inferd::amx_configure();  // per call: other code on this thread (oneDNN) may have configured the tiles otherwise
  const int64_t KP = K / 2, ldx = inferd::amx_x_stride(K), panel_stride = KP * kNr;
  const int64_t blocks = (M + kAmxRows - 1) / kAmxRows, whole = tail ? M / kAmxRows : blocks;
  const auto a = [&](int64_t b) { return b < whole ? x + b * kAmxRows * ldx : tail; };
  // C of two blocks: each block's bias and rounding run while the next block's products are in the tile unit.
  alignas(64) float c[2][2 * kAmxRows * 2 * kNr];
  int cur = 0;
  struct Pending {
    int64_t rows = 0, m0 = 0, n0 = 0, np = 0, cols = 0;
  } prev;
  const auto store_previous = [&](int64_t r0, int64_t r1) {  // rows [r0, r1) of the previous block
    const float* cp = c[cur ^ 1];
    const int64_t np = prev.np, n0 = prev.n0;
    for (int64_t r = r0; r < std::min(r1, prev.rows); ++r) {
      if constexpr (std::is_same_v<Out, float>) {
        if (argmax) {  // the sums (+ bias) into the row's lanes instead of the output
          for (int64_t q = 0; q < np; ++q) {
            __m512 v = _mm512_loadu_ps(cp + r * np * kNr + q * kNr);
            if (bias) v = _mm512_add_ps(v, _mm512_loadu_ps(bias + n0 + q * kNr));
            const int64_t c = std::min<int64_t>(kNr, prev.cols - q * kNr);
            lane_argmax(*argmax, prev.m0 + r, v, __mmask16((1u << c) - 1), int32_t(n0 + q * kNr));
          }
          continue;
        }
      }
      Out* o = out + (prev.m0 + r) * N + n0;
      alignas(64) Out tmp[2 * kNr];
      for (int64_t q = 0; q < np; ++q) {
        __m512 v = _mm512_loadu_ps(cp + r * np * kNr + q * kNr);
        if (bias) v = _mm512_add_ps(v, _mm512_loadu_ps(bias + n0 + q * kNr));  // after the sum, as F.linear
        if constexpr (std::is_same_v<Out, float>) {
          if (accumulate) {
            const int64_t c = std::min<int64_t>(kNr, prev.cols - q * kNr);  // columns of this panel in the output
            v = _mm512_add_ps(_mm512_maskz_loadu_ps(__mmask16((1u << c) - 1), o + q * kNr), v);
          }
        }
        store16(prev.cols == np * kNr ? o + q * kNr : tmp + q * kNr, v);
      }
      if (prev.cols < np * kNr) std::memcpy(o, tmp, prev.cols * sizeof(Out));
    }
  };
  // Decode-sized x (8-192 rows: one chunk of row blocks): the next pair's weights are prefetched evenly over the
  // passes over this pair (WeightsAhead): over every pass up to 64 rows (one or two passes of two row blocks), over
  // the passes after the first from 65 rows (3-6 passes). After this range's last pair, those of the next unit in the
  // weight's order, which a thread's guided chunk usually holds too (the decode stack's fused gate_up computes a gate
  // unit's up unit first: that prefetch waits in L2 a unit longer; aiming it at `next` instead gave 0.99x at 128
  // rows). Decode steps (ab_decode.py, one process): 128 rows 1.03-1.06x, 80 and 96 rows 1.02-1.05x, 64 rows 1.05x
  // (over its second pass only: 0.97x), 32 rows 1.06-1.08x, 8 and 16 rows 1.08x and 1.03x; 1-4 rows, whose step is
  // the weights' read alone, 0.95-0.98x, and a 2,048-row prefill's chunks 0.97x, so neither takes it
  // (docs/performance.md, stop 53).
  const int64_t P = (N + kNr - 1) / kNr, ksteps = (KP + kAmxPairs - 1) / kAmxPairs;
  const int64_t passes = (blocks + 1) / 2;  // over each panel pair, where look_ahead (x in one chunk)
  const bool look_ahead = blocks <= kAmxChunk && M >= kLookAheadRows, from_first = passes <= 2;
  for (int64_t b0 = 0; b0 < blocks; b0 += kAmxChunk) {
    const int64_t b1 = std::min(blocks, b0 + kAmxChunk);
    for (int64_t p = begin; p < end; p += 2) {
      const int64_t np = std::min<int64_t>(2, end - p), n0 = p * kNr, cols = std::min(np * kNr, N - n0);
      const uint32_t *w0 = w + p * panel_stride, *w1 = w + (p + 1) * panel_stride;
      WeightsAhead ahead;
      if (look_ahead && p + 2 < P) {
        ahead.at = reinterpret_cast<const char*>(w + (p + 2) * panel_stride);
        ahead.end = reinterpret_cast<const char*>(w + std::min(P, p + 4) * panel_stride);
        const int64_t lines = (ahead.end - ahead.at) / 64, steps = (from_first ? passes : passes - 1) * ksteps;
        ahead.lines_per_step = (lines + steps - 1) / steps;
      }
      for (int64_t b = b0; b < b1; b += 2) {
        const int64_t rb = std::min<int64_t>(2, b1 - b), m0 = b * kAmxRows;
        WeightsAhead* pf = (from_first || b > b0) && ahead.at ? &ahead : nullptr;
        if (rb == 2 && np == 2)
          amx_block_then<2, 2, false>(a(b), a(b + 1), ldx, w0, w1, KP, c[cur], store_previous, pf);
        else if (rb == 2)
          amx_block_then<2, 1, false>(a(b), a(b + 1), ldx, w0, w1, KP, c[cur], store_previous, pf);
        else if (np == 2)
          amx_block_then<1, 2, false>(a(b), a(b + 1), ldx, w0, w1, KP, c[cur], store_previous, pf);
        else
          amx_block_then<1, 1, false>(a(b), a(b + 1), ldx, w0, w1, KP, c[cur], store_previous, pf);
        prev = Pending{std::min(rb * kAmxRows, M - m0), m0, n0, np, cols};
        cur ^= 1;
      }
    }
  }
  store_previous(0, kEpilogueRows);
}

// SiLU(gate) * up [M, I] BF16 (out, row stride I) for the gate panels [begin, end) of a fused gate_up weight [2 I, K]
// (I a multiple of 16: up panel p + I / 16 holds the up columns of gate panel p), x as gemm_amx reads it (whole row
// blocks in place, the last in `tail`). Each (gate, up) panel pair is one 2-panel AMX block whose FP32 sums go
// through silu_mul_block() in registers: the bits of panel_linear's BF16 gate_up followed by silu_mul, without
// writing gate_up [M, 2 I] anywhere (docs/performance.md, stops 29 and 30).
void gemm_amx_silu(const uint32_t* x, const uint32_t* tail, int64_t M, int64_t K, const uint32_t* w, int64_t I,
                   at::BFloat16* out, int64_t begin, int64_t end) {
  inferd::amx_configure();
  const int64_t KP = K / 2, ldx = inferd::amx_x_stride(K), panel_stride = KP * kNr, up = I / kNr;
  const int64_t blocks = (M + kAmxRows - 1) / kAmxRows, whole = tail ? M / kAmxRows : blocks;
  const auto a = [&](int64_t b) { return b < whole ? x + b * kAmxRows * ldx : tail; };
  // C of two blocks: each block's SiLU runs while the next block's products are in the tile unit.
  alignas(64) float c[2][2 * kAmxRows * 2 * kNr];
  int cur = 0;
  int64_t pending_rows = 0;
  at::BFloat16* pending_out = nullptr;
  const auto silu_previous = [&](int64_t r0, int64_t r1) {  // rows [r0, r1) of the previous block
    r1 = std::min(r1, pending_rows);
    if (r0 < r1) inferd::silu_mul_block(c[cur ^ 1] + r0 * 2 * kNr, 2 * kNr, r1 - r0, pending_out + r0 * I, I);
  };
  for (int64_t b0 = 0; b0 < blocks; b0 += kAmxChunk) {
    const int64_t b1 = std::min(blocks, b0 + kAmxChunk);
    for (int64_t p = begin; p < end; ++p) {
      for (int64_t b = b0; b < b1; b += 2) {
        const int64_t rb = std::min<int64_t>(2, b1 - b), m0 = b * kAmxRows;
        const uint32_t *wg = w + p * panel_stride, *wu = w + (p + up) * panel_stride;
        if (rb == 2)
          amx_block_then<2, 2>(a(b), a(b + 1), ldx, wg, wu, KP, c[cur], silu_previous);
        else
          amx_block_then<1, 2>(a(b), a(b + 1), ldx, wg, wu, KP, c[cur], silu_previous);
        pending_rows = std::min(rb * kAmxRows, M - m0);
        pending_out = out + m0 * I + p * kNr;
        cur ^= 1;
      }
    }
  }
  silu_previous(0, kEpilogueRows);
}
#endif

// One tile of `rows` rows over `np` panels (interleaved and FP32: np > 1 is the tile's widest, else 1), by the
// weight type; pair panels also prefetch npf panels from pf.
template <typename Out, typename W>
inline void tile(int64_t rows, int64_t np, const typename inferd::PackedX<W>::type* x, const W* w,
                 int64_t panel_stride, int64_t KE, const float* bias, Out* out, int64_t ldo, int64_t cols,
                 const W* pf, int64_t npf) {
  if constexpr (std::is_same_v<W, uint32_t>) {
    kPairs<Out>[np][rows](x, w, panel_stride, KE, bias, out, ldo, cols, pf, npf);
  } else {
    (np > 1 ? kWide<Out, W> : kOne<Out, W>)[rows](x, w, panel_stride, KE, bias, out, ldo, cols);
  }
}

// Panels the next tile covers, of the `left` (> 0) in its group of 4.
template <typename W>
constexpr int64_t panels_for(int64_t rows, int64_t left) {
  if (std::is_same_v<W, uint32_t>) return left;
  return kPanelsFor[rows] <= left ? kPanelsFor[rows] : 1;
}

// Panels per parallel_for chunk of a GEMM with prefill rows: ranges of 4 to 32 panels, at least two per thread.
inline int64_t prefill_grain(int64_t panels) {
  return std::max<int64_t>(4, std::min<int64_t>(32, panels / (2 * at::get_num_threads())));
}

// x @ W.T for x packed (PackedX), or with `direct` (AMX only) a BF16 x read in place and its last partial row block
// in `tail` (gemm_amx).
template <typename Out, typename W>
void run(const typename inferd::PackedX<W>::type* x, int64_t M, int64_t K, const W* w, int64_t N, const float* bias,
         Out* out, bool direct = false, const uint32_t* tail = nullptr, bool accumulate = false,
         const LaneArgmax* argmax = nullptr) {
  const int64_t panels = (N + kNr - 1) / kNr;
  const auto part = [&](int64_t begin, int64_t end) {
#if defined(INFERD_AMX)
    if constexpr (std::is_same_v<W, uint32_t>) {
      if (direct)  // with `argmax`, each thread's lanes (one LaneArgmax per OpenMP thread)
        return gemm_amx(x, tail, M, K, w, N, bias, out, begin, end, accumulate,
                        argmax ? argmax + omp_get_thread_num() : nullptr);
    }
#endif
    inferd::gemm_panels(x, M, K, w, N, bias, out, begin, end);
  };
  if (M > kMChunk) {  // prefill rows: ranges of up to 32 panels, each passing over the rows 96 at a time
    at::parallel_for(0, panels, prefill_grain(panels), part);
    return;
  }
  // Decode rows: units of 4 panels (64 columns) handed to the threads in guided chunks (the first half, then half
  // of the rest, ...), so a thread whose core the OS lends elsewhere for a while leaves its panels to the other
  // instead of holding the join. Either way each output element is computed by one thread, in one fixed order.
  const int64_t units = (panels + 3) / 4;
  const int threads = at::in_parallel_region() ? 1 : int(std::min<int64_t>(at::get_num_threads(), units));
#pragma omp parallel for schedule(guided) num_threads(threads) if (threads > 1)
  for (int64_t u = 0; u < units; ++u) part(4 * u, std::min(panels, 4 * u + 4));
}

}  // namespace

namespace inferd {

template <typename T>
INFERD_SHARED void pack_row(const T* x, int64_t m, int64_t K, float* xp) {
  float* dst = xp + (m / kMr) * K * kMr + m % kMr;
  const T* src = x + m * K;
  for (int64_t k = 0; k < K; ++k) dst[k * kMr] = float(src[k]);
}

template void pack_row<float>(const float*, int64_t, int64_t, float*);
template void pack_row<at::BFloat16>(const at::BFloat16*, int64_t, int64_t, float*);

inline uint32_t bf16_bits(float v) { return c10::BFloat16(v).x; }  // to nearest even, as torch's .to() rounds
inline uint32_t bf16_bits(at::BFloat16 v) { return v.x; }

bool amx_pairs() {
#if defined(INFERD_AMX)
  static const bool on = [] {
    const char* env = std::getenv("INFERD_AMX");
    if (env != nullptr && std::strcmp(env, "0") == 0) return false;
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;  // asm/prctl.h, the kernel's x86 AMX doc
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return on;
#else
  return false;
#endif
}

template <typename T>
INFERD_SHARED void pack_row(const T* x, int64_t m, int64_t K, uint32_t* xp) {
  const T* src = x + m * K;
  if (amx_pairs()) {  // row-major, rows of ceil(K / 32) * 16 words
    uint32_t* dst = xp + m * amx_x_stride(K);
    if constexpr (std::is_same_v<T, at::BFloat16>) {  // BF16 pairs are the row's bytes as they are
      std::memcpy(dst, src, K * sizeof(T));
    } else {
      for (int64_t kk = 0; kk < K / 2; ++kk) dst[kk] = bf16_bits(src[2 * kk]) | bf16_bits(src[2 * kk + 1]) << 16;
    }
    return;
  }
  uint32_t* dst = xp + (m / kMr) * (K / 2) * kMr + m % kMr;
  for (int64_t kk = 0; kk < K / 2; ++kk) dst[kk * kMr] = bf16_bits(src[2 * kk]) | bf16_bits(src[2 * kk + 1]) << 16;
}

template void pack_row<float>(const float*, int64_t, int64_t, uint32_t*);
template void pack_row<at::BFloat16>(const at::BFloat16*, int64_t, int64_t, uint32_t*);

template <typename Out, typename W>
INFERD_SHARED void gemm_panels(const typename PackedX<W>::type* x, int64_t M, int64_t K, const W* w, int64_t N,
                               const float* bias, Out* out, int64_t begin, int64_t end, int64_t next) {
#if defined(INFERD_AMX)
  if constexpr (std::is_same_v<W, uint32_t>) {
    if (amx_pairs()) return gemm_amx(x, nullptr, M, K, w, N, bias, out, begin, end);
  }
#endif
  // The chain's length: K values, or K / 2 pairs of k (pair panels hold 16 words per k-pair)
  const int64_t KE = std::is_same_v<W, uint32_t> ? K / 2 : K, panel_stride = KE * kNr;
  const int64_t P = (N + kNr - 1) / kNr;
  for (int64_t m0 = 0; m0 < M; m0 += kMChunk) {
    // Passes of full tiles over the rows after the first: the first reads the group's weights from memory, the
    // others from L2, and with 2 or more of those they prefetch the next 4 panels (from `next` where given, else the
    // next unit in the weight's order, which a thread's guided chunk usually holds too), an equal share each: 1.2-1.4x GEMMs of 32 rows.
    // With fewer (up to 17 rows) a pass would issue 2-4 prefetches per k-pair, slower than none (0.92x a step of
    // 8 rows), and the weights are read as they are used (docs/performance.md, stop 26).
    const int64_t m1 = std::min(M, m0 + kMChunk), after = (m1 - m0) / kMr - 1;
    for (int64_t g = begin; g < end; g += 4) {  // 4 panels (64 columns) stay in L2 while the rows pass
      const int64_t g1 = std::min(end, g + 4), from = next >= 0 && g1 == end ? next : g1,
                    ahead = std::min<int64_t>(4, P - from);
      const int64_t share = after >= 2 ? (ahead + after - 1) / after : 0;
      for (int64_t m = m0, pass = 0; m < m1; m += kMr, ++pass) {
        const int64_t rows = std::min(kMr, m1 - m);
        const int64_t first = std::max<int64_t>(0, (pass - 1) * share);
        const int64_t npf = M <= kAheadRows ? -1
                            : pass == 0 || rows < kMr ? 0 : std::max<int64_t>(0, std::min(share, ahead - first));
        for (int64_t p = g; p < g1;) {
          const int64_t np = panels_for<W>(rows, g1 - p);
          const int64_t n0 = p * kNr, cols = std::min(np * kNr, N - n0);
          tile<Out, W>(rows, np, x + m * KE, w + p * panel_stride, panel_stride, KE, bias ? bias + n0 : nullptr,
                       out + m * N + n0, N, cols, w + (from + first) * panel_stride, p == g || npf < 0 ? npf : 0);
          p += np;
        }
      }
    }
  }
}

template void gemm_panels<float, uint16_t>(const float*, int64_t, int64_t, const uint16_t*, int64_t, const float*,
                                           float*, int64_t, int64_t, int64_t);
template void gemm_panels<at::BFloat16, uint16_t>(const float*, int64_t, int64_t, const uint16_t*, int64_t,
                                                  const float*, at::BFloat16*, int64_t, int64_t, int64_t);
template void gemm_panels<float, float>(const float*, int64_t, int64_t, const float*, int64_t, const float*, float*,
                                        int64_t, int64_t, int64_t);
template void gemm_panels<float, uint32_t>(const uint32_t*, int64_t, int64_t, const uint32_t*, int64_t, const float*,
                                           float*, int64_t, int64_t, int64_t);
template void gemm_panels<at::BFloat16, uint32_t>(const uint32_t*, int64_t, int64_t, const uint32_t*, int64_t,
                                                  const float*, at::BFloat16*, int64_t, int64_t, int64_t);

}  // namespace inferd

namespace {

// The packed shape of a [N, K] weight of this dtype: BF16 [P, K / 2, 16, 2] (pairs) or [P, K, 8, 2] (interleaved),
// FP32 [P, K, 2, 8].
std::vector<int64_t> panel_shape(at::ScalarType dtype, int64_t N, int64_t K, bool pairs) {
  const int64_t P = (N + kNr - 1) / kNr;
  if (dtype != at::kBFloat16) return {P, K, 2, 8};
  return pairs ? std::vector<int64_t>{P, K / 2, 16, 2} : std::vector<int64_t>{P, K, 8, 2};
}


}  // namespace

// The bias [n] as FP32 over the weight's whole panels, zero past n (the epilogues read 16 at a time); undefined
// without one. Raises c10::Error for a bias that is not [n].
static at::Tensor whole_panel_bias(const c10::optional<at::Tensor>& bias, const at::Tensor& w_packed, int64_t n) {
  if (!bias.has_value() || !bias->defined()) return {};
  TORCH_CHECK(bias->dim() == 1 && bias->size(0) == n, "bias: [N]");
  at::Tensor b = at::zeros({w_packed.size(0) * kNr}, bias->options().dtype(at::kFloat));
  b.narrow(0, 0, n).copy_(*bias);
  return b;
}

// A BF16 x [M, K] (K a multiple of 32) as AMX reads it in place (gemm_amx's x and `tail`): its rows where they are,
// and the last partial block of 16 rows copied, then zeros, as BF16 pairs [16, K / 2] (none where M is a multiple of
// 16). The tensors are held here while the pointers are used.
struct AmxInPlace {
  at::Tensor xc, tail_words;
  const uint32_t *x = nullptr, *tail = nullptr;
  explicit AmxInPlace(const at::Tensor& in) : xc(in.contiguous()) {
    const int64_t M = xc.size(0), K = xc.size(1), whole = M / kAmxRows * kAmxRows;
    x = reinterpret_cast<const uint32_t*>(xc.data_ptr<at::BFloat16>());
    if (whole == M) return;
    tail_words = at::zeros({kAmxRows * K / 2}, xc.options().dtype(at::kInt));
    std::memcpy(tail_words.data_ptr<int32_t>(), xc.data_ptr<at::BFloat16>() + whole * K, (M - whole) * K * 2);
    tail = reinterpret_cast<const uint32_t*>(tail_words.data_ptr<int32_t>());
  }
};

// x: [M, K] float32 or bfloat16; w_packed: the panels of a [N, K] weight (pack_panels below): [ceil(N / 16), K / 2,
// 16, 2] or [ceil(N / 16), K, 8, 2] bfloat16 or [ceil(N / 16), K, 2, 8] float32, zero past N; bias: [N] float32 or
// None. Returns [M, N], float32 if out_fp32 else bfloat16 (rounded to nearest even once, after the FP32 sum). With
// BF16 pair panels an FP32 x is rounded to BF16 first (the instruction multiplies BF16 pairs). into: None, or a
// contiguous float32 [M, N] (out_fp32 only) to which the FP32 output is added in place and which is returned (the
// residual stream; each element one FP32 add, the bits of into + the output). Raises c10::Error (RuntimeError) for
// shapes, dtypes or an `into` that do not match.
at::Tensor panel_linear(const at::Tensor& x, const at::Tensor& w_packed, int64_t n, const c10::optional<at::Tensor>& bias,
                        bool out_fp32, const c10::optional<at::Tensor>& into) {
  TORCH_CHECK(x.device().is_cpu() && w_packed.device().is_cpu(), "panel_linear: CPU tensors");
  const auto wtype = w_packed.scalar_type();
  TORCH_CHECK((wtype == at::kBFloat16 || wtype == at::kFloat) && w_packed.is_contiguous(),
              "packed weight: contiguous BF16 or FP32");
  const bool pairs = inferd::is_pair_panels(w_packed);
  TORCH_CHECK(!pairs || inferd::kBf16Pairs, "panel_linear: BF16 pair panels need a build with AVX512-BF16");
  TORCH_CHECK(x.dim() == 2 && w_packed.dim() == 4 && x.size(1) % (pairs ? 2 : 1) == 0 && n > 0 &&
                  w_packed.sizes() == at::IntArrayRef(panel_shape(wtype, n, x.size(1), pairs)),
              "panel_linear: x [M, K] and the panels of a [", n, ", K] weight, not x ", x.sizes(), " and ",
              w_packed.sizes(), " ", wtype);
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat,
              "panel_linear: x must be float32 or bfloat16");
  const int64_t M = x.size(0), K = x.size(1);
  const at::Tensor b = whole_panel_bias(bias, w_packed, n);
  const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
  TORCH_CHECK(out_fp32 || wtype == at::kBFloat16, "panel_linear: FP32 weights give FP32 outputs (out_fp32)");
  const bool acc = into.has_value() && into->defined();
  if (acc) {
    TORCH_CHECK(out_fp32 && into->scalar_type() == at::kFloat && into->is_contiguous() && into->dim() == 2 &&
                    into->size(0) == M && into->size(1) == n,
                "panel_linear: `into` must be a contiguous FP32 [M, n] with out_fp32");
  }
  const bool amx = pairs && inferd::amx_pairs() && x.scalar_type() == at::kBFloat16 && inferd::amx_x_stride(K) == K / 2;
  if (acc && !amx) return into->add_(panel_linear(x, w_packed, n, bias, true, c10::nullopt));  // the same FP32 adds
  auto out = acc ? *into : at::empty({M, n}, x.options().dtype(out_fp32 ? at::kFloat : at::kBFloat16));
  if (M == 0) return out;
  if (amx) {
    // On AMX a BF16 row of whole tiles of k-pairs is already its packed row: x is read in place, and only a last
    // partial block of 16 rows is copied (into zeros), where packing x took 7% of a prefill.
    const AmxInPlace a(x);
    const auto* wp = reinterpret_cast<const uint32_t*>(w_packed.data_ptr<at::BFloat16>());
    if (out_fp32) run<float>(a.x, M, K, wp, n, bp, out.data_ptr<float>(), true, a.tail, acc);
    else run<at::BFloat16>(a.x, M, K, wp, n, bp, out.data_ptr<at::BFloat16>(), true, a.tail);
    return out;
  }
  // x packed by tiles of 6 rows, k-major ([K, 6] FP32, or [K / 2, 6] BF16 pairs; rows past M zero), so that the
  // micro-kernel's six broadcasts per k read one cache line (the layout of the A panel in Goto & van de Geijn), or
  // row-major in 16-row A tiles on AMX (ops.h, PackedX): M x K, small.
  // Only the rows past M need zeros: the last tile's, where the tiles' layout is k-major (on AMX, row-major, a row's
  // words past K / 2 too). The tiles are packed in parallel, whole tiles per thread (a 2,000-row prefill's packing,
  // serial and after a zero fill of all of x, was ~2.7% of it on AMD Zen 4; docs/performance.md, stop 35).
  const bool row_major = pairs && inferd::amx_pairs();
  const int64_t size = inferd::packed_x_size(M, K, pairs);
  const auto xtype = x.options().dtype(pairs ? at::kInt : at::kFloat);
  at::Tensor xf = row_major ? at::zeros({size}, xtype) : at::empty({size}, xtype);
  const at::Tensor xc = x.contiguous();
  const int64_t tiles = (M + kMr - 1) / kMr, tile_words = size / std::max<int64_t>(tiles, 1);
  if (!row_major && M % kMr != 0) xf.narrow(0, (tiles - 1) * tile_words, tile_words).zero_();
  // 16 tiles (96 rows) or fewer run on the calling thread: a decode step's rows cost less than waking the team.
  const auto pack_tiles = [&](const auto* src, auto* xp) {
    at::parallel_for(0, tiles, 16, [&](int64_t t0, int64_t t1) {
      for (int64_t m = t0 * kMr; m < std::min(M, t1 * kMr); ++m) inferd::pack_row(src, m, K, xp);
    });
  };
  const auto pack_to = [&](auto* xp) {
    if (x.scalar_type() == at::kBFloat16) pack_tiles(xc.data_ptr<at::BFloat16>(), xp);
    else pack_tiles(xc.data_ptr<float>(), xp);
  };
  if (pairs) pack_to(reinterpret_cast<uint32_t*>(xf.data_ptr<int32_t>()));
  else pack_to(xf.data_ptr<float>());
  if (wtype == at::kFloat) {
    run<float>(xf.data_ptr<float>(), M, K, w_packed.data_ptr<float>(), n, bp, out.data_ptr<float>());
    return out;
  }
  auto dispatch = [&](auto* wp, auto* xp) {
    if (out_fp32) run<float>(xp, M, K, wp, n, bp, out.data_ptr<float>());
    else run<at::BFloat16>(xp, M, K, wp, n, bp, out.data_ptr<at::BFloat16>());
  };
  if (pairs)
    dispatch(reinterpret_cast<const uint32_t*>(w_packed.data_ptr<at::BFloat16>()),
             reinterpret_cast<const uint32_t*>(xf.data_ptr<int32_t>()));
  else
    dispatch(reinterpret_cast<const uint16_t*>(w_packed.data_ptr<at::BFloat16>()), xf.data_ptr<float>());
  return out;
}

at::Tensor argmax_rows(const at::Tensor& logits);  // fused_ops.cpp

// argmax_rows(panel_linear(x, w_packed, n, bias, out_fp32 = true)): each row's index of its largest logit (the first
// of equal largest, the first NaN where a row has one), [M] int64, from the same FP32 sums. On AMX (x BF16, whose rows
// are whole tiles of k-pairs) the sums go from the C tiles into per-thread lanes (LaneArgmax) instead of an [M, n]
// FP32 output that argmax_rows would read back: at 128 rows and a 49,152-token vocabulary that output is 25 MB
// written and read each decode step (docs/performance.md, stop 52). Elsewhere the two calls.
at::Tensor panel_linear_argmax(const at::Tensor& x, const at::Tensor& w_packed, int64_t n,
                               const c10::optional<at::Tensor>& bias) {
#if defined(INFERD_AMX) && AT_PARALLEL_OPENMP  // the lanes are per OpenMP thread (omp_get_thread_num in run())
  const bool amx = inferd::is_pair_panels(w_packed) && inferd::amx_pairs() && x.dim() == 2 &&
                   x.scalar_type() == at::kBFloat16 && x.device().is_cpu() && x.size(0) > 0 &&
                   inferd::amx_x_stride(x.size(1)) == x.size(1) / 2 && !at::in_parallel_region() &&
                   w_packed.scalar_type() == at::kBFloat16 && w_packed.is_contiguous() && n > 0 && n < kNoColumn &&
                   w_packed.sizes() == at::IntArrayRef(panel_shape(at::kBFloat16, n, x.size(1), true));
  if (amx) {
    const int64_t M = x.size(0), K = x.size(1);
    const at::Tensor b = whole_panel_bias(bias, w_packed, n);
    const int64_t slots = std::max<int64_t>(at::get_num_threads(), omp_get_max_threads());
    auto best = at::full({slots, M, kNr}, -std::numeric_limits<float>::infinity(), x.options().dtype(at::kFloat));
    auto cols = at::full({2, slots, M, kNr}, kNoColumn, x.options().dtype(at::kInt));
    std::vector<LaneArgmax> lanes(slots);
    for (int64_t t = 0; t < slots; ++t)
      lanes[t] = {best[t].data_ptr<float>(), cols[0][t].data_ptr<int32_t>(), cols[1][t].data_ptr<int32_t>()};
    const AmxInPlace a(x);
    run<float>(a.x, M, K, reinterpret_cast<const uint32_t*>(w_packed.data_ptr<at::BFloat16>()), n,
               b.defined() ? b.data_ptr<float>() : nullptr, nullptr, true, a.tail, false, lanes.data());
    // The lanes of every thread: the largest value at its smallest column, unless the row has a NaN.
    auto out = at::empty({M}, x.options().dtype(at::kLong));
    int64_t* op = out.data_ptr<int64_t>();
    for (int64_t r = 0; r < M; ++r) {
      float v = 0.f;
      int32_t c = kNoColumn, first_nan = kNoColumn;
      for (int64_t t = 0; t < slots; ++t)
        for (int64_t l = 0; l < kNr; ++l) {
          const int64_t i = r * kNr + l;
          first_nan = std::min(first_nan, lanes[t].nan_col[i]);
          const int32_t lc = lanes[t].col[i];
          if (lc == kNoColumn) continue;
          const float lv = lanes[t].best[i];
          if (c == kNoColumn || lv > v || (lv == v && lc < c)) {
            v = lv;
            c = lc;
          }
        }
      op[r] = first_nan != kNoColumn ? first_nan : c;
    }
    return out;
  }
#endif
  return argmax_rows(panel_linear(x, w_packed, n, bias, true, c10::nullopt));
}

at::Tensor silu_mul(const at::Tensor& gate_up);  // fused_ops.cpp

// SiLU(gate) * up of x @ gate_up.T: x [M, K] bfloat16 or float32, w_packed the panels of a fused [2 I, K] gate_up
// weight (pack_panels), inter = I -> [M, I] bfloat16 (float32 with FP32 weights), the bits of panel_linear(x,
// w_packed, 2 I, None, out_fp32 = FP32 weights) then silu_mul. On AMX, for a BF16 x with K a multiple of 32 and I of
// 16, in one pass (gemm_amx_silu); elsewhere those two calls.
at::Tensor panel_linear_silu(const at::Tensor& x, const at::Tensor& w_packed, int64_t inter) {
  TORCH_CHECK(inter > 0 && x.dim() == 2, "panel_linear_silu: x [M, K] and inter > 0");
#if defined(INFERD_AMX)
  const int64_t M = x.size(0), K = x.size(1);
  if (inferd::amx_pairs() && inferd::is_pair_panels(w_packed) && w_packed.scalar_type() == at::kBFloat16 &&
      w_packed.is_contiguous() && x.device().is_cpu() && x.scalar_type() == at::kBFloat16 && inter % kNr == 0 &&
      inferd::amx_x_stride(K) == K / 2 &&
      w_packed.sizes() == at::IntArrayRef(panel_shape(at::kBFloat16, 2 * inter, K, true))) {
    auto out = at::empty({M, inter}, x.options());
    if (M == 0) return out;
    const AmxInPlace a(x);
    const auto* wp = reinterpret_cast<const uint32_t*>(w_packed.data_ptr<at::BFloat16>());
    const int64_t panels = inter / kNr;
    at::parallel_for(0, panels, prefill_grain(panels), [&](int64_t begin, int64_t end) {
      gemm_amx_silu(a.x, a.tail, M, K, wp, inter, out.data_ptr<at::BFloat16>(), begin, end);
    });
    return out;
  }
#endif
  // FP32 weights: FP32 sums and SiLU in FP32, as panel_linear gives them
  return silu_mul(panel_linear(x, w_packed, 2 * inter, c10::nullopt, w_packed.scalar_type() == at::kFloat, c10::nullopt));
}

namespace {

// Panels [p0, p1) of w [N, K] into dst: panel column c of k at index(c, k) of its panel, zero past N.
template <typename T, typename Index>
void pack_range(const T* src, T* dst, int64_t N, int64_t K, int64_t p0, int64_t p1, Index index) {
  for (int64_t p = p0; p < p1; ++p) {
    T* o = dst + p * K * kNr;
    for (int64_t c = 0; c < kNr; ++c) {
      const int64_t row = p * kNr + c;
      if (row < N) {
        const T* in = src + row * K;
        for (int64_t k = 0; k < K; ++k) o[index(c, k)] = in[k];
      } else {
        for (int64_t k = 0; k < K; ++k) o[index(c, k)] = T(0);
      }
    }
  }
}

}  // namespace

// w: [N, K] bfloat16 or float32 -> its panels, the layout panel_linear reads (what torch's reshape + permute +
// contiguous gives, one pass over the weight, in parallel over panels): bfloat16 in pairs of k [ceil(N / 16), K / 2,
// 16, 2] with [p, kk, j, t] = w[16 p + j, 2 kk + t] (kBf16Pairs builds, K even), else interleaved [ceil(N / 16), K,
// 8, 2] with [p, k, j, h] = w[16 p + 8 h + j, k]; float32 [ceil(N / 16), K, 2, 8] with [p, k, h, j] = w[16 p + 8 h +
// j, k]; zero past N. `pairs` chooses the BF16 layout (default: pairs where possible). Written into `out` where
// given (a contiguous tensor of that shape and dtype, e.g. a view of a buffer in huge pages), else into a new tensor.
at::Tensor pack_panels(const at::Tensor& w, const c10::optional<at::Tensor>& out_opt, c10::optional<bool> pairs_opt) {
  TORCH_CHECK(w.device().is_cpu() && w.dim() == 2 &&
                  (w.scalar_type() == at::kBFloat16 || w.scalar_type() == at::kFloat),
              "pack_panels: a [N, K] bfloat16 or float32 CPU tensor");
  const at::Tensor wc = w.contiguous();
  const int64_t N = wc.size(0), K = wc.size(1), P = (N + kNr - 1) / kNr;
  const bool can_pair = inferd::kBf16Pairs && wc.scalar_type() == at::kBFloat16 && K % 2 == 0;
  const bool pairs = pairs_opt.value_or(can_pair);
  TORCH_CHECK(!pairs || can_pair,
              "pack_panels: pairs of k need BF16 weights of an even K and a build with AVX512-BF16");
  const auto shape = panel_shape(wc.scalar_type(), N, K, pairs);
  at::Tensor out;
  if (out_opt.has_value()) {
    out = *out_opt;
    TORCH_CHECK(out.device().is_cpu() && out.scalar_type() == wc.scalar_type() && out.is_contiguous() &&
                    out.sizes() == at::IntArrayRef(shape),
                "pack_panels: out must be a contiguous ", at::IntArrayRef(shape), " ", wc.scalar_type(),
                " CPU tensor, not ", out.sizes(), " ", out.scalar_type());
  } else {
    out = at::empty(shape, wc.options());
  }
  if (wc.scalar_type() == at::kFloat) {
    at::parallel_for(0, P, 1, [&](int64_t p0, int64_t p1) {
      pack_range(wc.data_ptr<float>(), out.data_ptr<float>(), N, K, p0, p1,
                 [](int64_t c, int64_t k) { return k * kNr + c; });
    });
  } else {
    const auto* src = reinterpret_cast<const uint16_t*>(wc.data_ptr<at::BFloat16>());
    auto* dst = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
    at::parallel_for(0, P, 1, [&](int64_t p0, int64_t p1) {
      if (pairs)
        pack_range(src, dst, N, K, p0, p1, [](int64_t c, int64_t k) { return k / 2 * 2 * kNr + 2 * c + k % 2; });
      else
        pack_range(src, dst, N, K, p0, p1, [](int64_t c, int64_t k) { return k * kNr + 2 * (c % 8) + c / 8; });
    });
  }
  return out;
}
