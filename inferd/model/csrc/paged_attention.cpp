// Causal attention over a paged KV cache for every query row of a step, decode and prefill, reading the key and
// value rows where they are in the cache (PagedAttention, Kwon et al. 2023, arXiv:2309.06180) instead of gathering
// each sequence's blocks first. A query row is the token at position p of a sequence: it attends over that
// sequence's keys 0..p (its context length p + 1), which makes a prefill chunk's causal mask implicit.
//
// Decode rows (attend_decode()): one work item per (row, KV head). The G query heads that share the KV head score the keys
// in groups of up to 3 heads x 2 keys (each score 8 lane sums over the head dimension, then a fixed-order lane
// sum), take a softmax over all of them (two passes, FP32), then sum the value rows 32 output dims at a time; each
// next KV block is prefetched while one is computed (a sequence's blocks are wherever the allocator put them). BF16
// rows of head dim 64 or 128 on CPUs with AVX512-BF16 go through attend_decode_pairs() (vdpbf16ps, 16 keys' lane
// sums at once, probabilities rounded to BF16 before the value sums).
//
// Prefill rows (attend_tile()): a sequence's consecutive rows go in tiles of up to kMaxTile rows, one work item per
// (tile, KV head). The keys and values are converted to FP32 once per chunk of kKeyChunk keys for all the tile's
// rows; the tile's rows x heads are vectorised 8 (16 with AVX-512) at a time, so the scores and the value sums are
// register-blocked outer products (Goto & van de Geijn 2008) in which each score is one FMA chain over the head
// dimension in order and each output element one FMA chain over the row's keys in order; the softmax is online over
// the chunks, at fixed absolute key positions (Milakov & Gimelshein 2018). So a prefill row's bits depend only on
// its query and its keys: not on the tile it lands in, the other rows, the chunking of its prompt or the batch
// (tests/test_kernels.py). BF16 tiles on CPUs with AVX512-BF16 (attend_tile_pairs()) compute both products with
// vdpbf16ps over pairs instead, the keys read in place, the probabilities rounded to BF16 before P V: the same
// invariance, about 3x faster.
//
// Every item runs the same code whatever else is in the batch (compiled once per machine with -ffast-math, so the
// order of each sum is fixed in the binary; exp8() of vec.h is the vector exponential); items are taken from a shared
// counter, largest first, so the threads finish together; while more items remain than threads, a decode item takes
// its thread's next one at once and prefetches that one's first rows (inferd::DecodeAhead).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include "ops.h"
#include "vec.h"

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

namespace {

using inferd::exp8;
using inferd::LineVector;
using inferd::load8;
using inferd::splat;
using inferd::store8;
using inferd::v8;
using inferd::v8i;

#define INFERD_INLINE __attribute__((always_inline)) inline  // micro-kernels: their accumulators stay in registers

struct Shape {
  int64_t block_size;
  float scale;
};

constexpr int64_t kMaxD = 256, kMaxG = 16;

// A row of d values (d a multiple of 8) as FP32.
template <typename T>
inline void to_float_row(const T* src, float* dst, int64_t d) {
  for (int64_t k = 0; k < d; k += 8) store8(dst + k, load8(src + k));
}

// Sum of the 8 lanes in a fixed order.
inline float hsum(v8 a) { return ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7])); }

// Scores of kH query heads (qf [kH, d] FP32, scaled) against kN keys (rows of k, each d values, stride d):
// scores[h * stride + i]. Each score: 8 lane sums, each one FMA chain over d / 8 in order, then hsum.
// kH x kN independent chains hide the FMA latency.
template <typename T, int kH, int kN, int kD>
INFERD_INLINE void dot_keys(const float* qf, const T* k, int64_t d_rt, float* scores,
                            int64_t stride) {
  const int64_t d = kD ? kD : d_rt;
  v8 acc[kN][kH];
  for (int i = 0; i < kN; ++i)
    for (int h = 0; h < kH; ++h) acc[i][h] = splat(0.f);
  for (int64_t c = 0; c < d; c += 8) {
    v8 kv[kN];
    for (int i = 0; i < kN; ++i) kv[i] = load8(k + i * d + c);
    for (int h = 0; h < kH; ++h) {
      const v8 qv = load8(qf + h * d + c);
      for (int i = 0; i < kN; ++i) acc[i][h] += qv * kv[i];
    }
  }
  for (int i = 0; i < kN; ++i)
    for (int h = 0; h < kH; ++h) scores[h * stride + i] = hsum(acc[i][h]);
}

// acc[h * d + c0 + 8 j] for h < kH, j < kV += sum over t < m, in order, of p[h * stride + t] * v[t, c0 + 8 j]
// (v: m value rows of one block, stride d). Each output element one FMA chain over the keys in order.
template <typename T, int kH, int kV, int kD>
INFERD_INLINE void sum_values(const float* p, int64_t stride, const T* v, int64_t m, int64_t d_rt, int64_t c0,
                              float* acc) {
  const int64_t d = kD ? kD : d_rt;
  v8 a[kH][kV];
  for (int h = 0; h < kH; ++h)
    for (int j = 0; j < kV; ++j) a[h][j] = load8(acc + h * d + c0 + 8 * j);
  for (int64_t t = 0; t < m; ++t) {
    // One value vector live at a time: kH x kV accumulators + kH probabilities + 1 fit AVX2's 16 registers at 3 x 4
    // (a row's kV vectors first, as before, spilled an accumulator to the stack every key: stop 46).
    v8 pv[kH];
    for (int h = 0; h < kH; ++h) pv[h] = splat(p[h * stride + t]);
    for (int j = 0; j < kV; ++j) {
      const v8 vv = load8(v + t * d + c0 + 8 * j);
      for (int h = 0; h < kH; ++h) a[h][j] += pv[h] * vv;
    }
  }
  for (int h = 0; h < kH; ++h)
    for (int j = 0; j < kV; ++j) store8(acc + h * d + c0 + 8 * j, a[h][j]);
}

// A decode row's largest score of sc[0 .. n - 1], and sc[n .. n_pad - 1] set to -inf (their e^x is 0).
inline float max_and_pad(float* sc, int64_t n, int64_t n_pad) {
  float mx = -std::numeric_limits<float>::infinity();
  int64_t t = 0;
#if defined(__AVX512F__)
  if (n >= 16) {  // max is exact in any order: the same value as the scalar loop; max_ps returns its second
                  // operand when either is NaN, so a NaN score is skipped as std::max(mx, nan) skips it
    __m512 m = _mm512_set1_ps(mx);
    for (; t + 16 <= n; t += 16) m = _mm512_max_ps(_mm512_loadu_ps(sc + t), m);
    mx = _mm512_reduce_max_ps(m);
  }
#endif
  for (; t < n; ++t) mx = std::max(mx, sc[t]);
  std::fill(sc + n, sc + n_pad, -std::numeric_limits<float>::infinity());
  return mx;
}

// The next block's rows (bytes from p) into the cache while this block is computed: the blocks of a sequence are
// wherever the allocator put them, so the hardware prefetcher, which follows addresses, cannot start on them.
// prefetch_block() asks for L2 (PREFETCHT1): on AMD Zen 4, decode attention over 32 rows x 330 keys x 30 layers
// from memory ran 1.18x faster (FP32 rows) and 1.27-1.35x (BF16 pairs) than with PREFETCHT0, and reading 1 GiB
// in random 2 KiB chunks 1.7x (docs/performance.md, stop 35): likely because a PREFETCHT0 that misses holds one of
// the core's few L1 miss buffers until its line lands. On Zen 5 the hint made no difference beyond the noise
// (0.91-1.09x, stop 26), nor on Sapphire Rapids (stop 32), where AMX's decode attention still asks for L1
// (prefetch_block<kL1>).
constexpr int kL2 = 2, kL1 = 3;  // __builtin_prefetch's locality: PREFETCHT1 and PREFETCHT0 on x86
template <int kLocality = kL2>
inline void prefetch_block(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t o = 0; o < bytes; o += 64) __builtin_prefetch(c + o, 0, kLocality);
}

template <typename T, int kH, int kD>
void scores_of_heads(const float* qf, const T* k_head, const int64_t* table, int64_t n, int64_t bs, int64_t d,
                     float* scores, int64_t stride) {
  for (int64_t t0 = 0, b = 0; t0 < n; t0 += bs, ++b) {  // block by block, 4 keys at a time
    const T* block = k_head + table[b] * bs * d;
    const int64_t m = std::min(bs, n - t0);
    if (t0 + bs < n) prefetch_block(k_head + table[b + 1] * bs * d, std::min(bs, n - t0 - bs) * d * int64_t(sizeof(T)));
    int64_t i = 0;
    for (; i + 2 <= m; i += 2) dot_keys<T, kH, 2, kD>(qf, block + i * d, d, scores + t0 + i, stride);
    for (; i < m; ++i) dot_keys<T, kH, 1, kD>(qf, block + i * d, d, scores + t0 + i, stride);
  }
}

template <typename T, int kH, int kD>
void values_of_heads(const float* p, int64_t stride, const T* v_head, const int64_t* table, int64_t n, int64_t bs,
                     int64_t d, float* acc) {
  for (int64_t c0 = 0; c0 < d; c0 += 32) {  // 32 output dims (kH x 4 accumulators) per pass over the keys
    const int64_t w = std::min<int64_t>(32, d - c0);
    for (int64_t t0 = 0, b = 0; t0 < n; t0 += bs, ++b) {
      const T* block = v_head + table[b] * bs * d;
      const int64_t m = std::min(bs, n - t0);
      if (c0 == 0 && t0 + bs < n)
        prefetch_block(v_head + table[b + 1] * bs * d, std::min(bs, n - t0 - bs) * d * int64_t(sizeof(T)));
      if (w == 32) sum_values<T, kH, 4, kD>(p + t0, stride, block, m, d, c0, acc);
      else if (w == 24) sum_values<T, kH, 3, kD>(p + t0, stride, block, m, d, c0, acc);
      else if (w == 16) sum_values<T, kH, 2, kD>(p + t0, stride, block, m, d, c0, acc);
      else sum_values<T, kH, 1, kD>(p + t0, stride, block, m, d, c0, acc);
    }
  }
}

constexpr int64_t kKeyChunk = 256;  // keys per online-softmax step, converted to FP32 at a time
constexpr int64_t kMaxTile = 32;    // prefill rows per work item
constexpr int64_t kMaxQ = kMaxTile * kMaxG;

// Layout of a prefill tile's work: the tile's R rows x G heads are its "queries", qi = r * G + g, padded to a
// multiple of 8 (QP) and held transposed ([d, QP]) so that 8 queries fill a vector. Scores and probabilities are
// [kKeyChunk, QP], the output accumulator [d, QP].

// FP32 vectors of 8 lanes (v8), or 16 where the build has AVX-512 (v16), for the prefill tiles: the lanes are a
// tile's queries, so each score and each output element is the same FMA chain whatever the width (the same bits).
#if defined(__AVX512F__)
using inferd::v16;
#endif
template <typename V>
constexpr int64_t kLanes = sizeof(V) / sizeof(float);
using inferd::load_lanes;
using inferd::store_lanes;

// v, held in a register from here on. GCC otherwise folds the load into each FMA that uses v (a memory operand), so
// the outer products below issued kK loads per vector instead of one: 12 loads per 8 FMAs, more than AMD Zen 3's two
// 256-bit loads a cycle feed (docs/performance.md, stop 46). The same instructions, so the same bits. Only where the
// vector fits one register (AVX: 32 bytes, AVX-512: 64); elsewhere (x86 without AVX, aarch64) the constraint could
// not be met and the module would not build.
template <typename V>
INFERD_INLINE V in_register(V v) {
#if defined(__AVX512F__)
  asm("" : "+v"(v));
#elif defined(__AVX__)
  if constexpr (sizeof(V) <= 32) asm("" : "+x"(v));
#endif
  return v;
}

// scores[t, q0 + L j + l] for the kK keys t0 .. t0 + kK - 1 and j < kQ (L lanes of V): each one FMA chain over d of
// qT[k, q] * kb[t, k] (kb: the chunk's keys, [kKeyChunk, d] FP32). kQ x kK accumulators: at least 8 independent
// chains, so the FMA latency is hidden whatever the number of queries.
template <typename V, int kQ, int kK>
INFERD_INLINE void score_tile(const float* qT, int64_t qp, const float* kb, int64_t d, int64_t t0, int64_t q0,
                              float* scores) {
  constexpr int64_t L = kLanes<V>;
  V acc[kK][kQ];
  for (int i = 0; i < kK; ++i)
    for (int j = 0; j < kQ; ++j) acc[i][j] = V{};
  const float* k0 = kb + t0 * d;
  for (int64_t k = 0; k < d; ++k) {
    V qv[kQ];
    for (int j = 0; j < kQ; ++j) qv[j] = in_register(load_lanes<V>(qT + k * qp + q0 + L * j));
    for (int i = 0; i < kK; ++i) {
      const V kv = V{} + k0[i * d + k];
      for (int j = 0; j < kQ; ++j) acc[i][j] += qv[j] * kv;
    }
  }
  for (int i = 0; i < kK; ++i)
    for (int j = 0; j < kQ; ++j) store_lanes(scores + (t0 + i) * qp + q0 + L * j, acc[i][j]);
}

// accT[c, q0 + L j + l] for the kC dims c0 .. c0 + kC - 1 and j < kQ (FP32) += sum over t < m, in order, of
// vb[t, c] * probs[t, q] (vb: the chunk's values, [kKeyChunk, d] FP32). Each output element is one FMA chain;
// kC x kQ of them at once.
template <typename V, int kQ, int kC>
INFERD_INLINE void pv_tile(const float* probs, int64_t qp, const float* vb, int64_t d, int64_t m, int64_t c0,
                           int64_t q0, float* accT) {
  constexpr int64_t L = kLanes<V>;
  V acc[kC][kQ];
  for (int i = 0; i < kC; ++i)
    for (int j = 0; j < kQ; ++j) acc[i][j] = load_lanes<V>(accT + (c0 + i) * qp + q0 + L * j);
  for (int64_t t = 0; t < m; ++t) {
    V pv[kQ];
    for (int j = 0; j < kQ; ++j) pv[j] = in_register(load_lanes<V>(probs + t * qp + q0 + L * j));
    for (int i = 0; i < kC; ++i) {
      const V vv = V{} + vb[t * d + c0 + i];
      for (int j = 0; j < kQ; ++j) acc[i][j] += pv[j] * vv;
    }
  }
  for (int i = 0; i < kC; ++i)
    for (int j = 0; j < kQ; ++j) store_lanes(accT + (c0 + i) * qp + q0 + L * j, acc[i][j]);
}

// Rows c0 .. c0 + m - 1 of one KV head's keys or values into FP32 [m_pad, d], rows m .. m_pad - 1 zero (bs: the
// block size, a power of two).
template <typename T>
void load_chunk(const T* head, const int64_t* table, int64_t bs, int64_t d, int64_t c0, int64_t m, int64_t m_pad,
                float* dst) {
  for (int64_t t = 0; t < m;) {  // block by block (c0 is a multiple of the block size: no division per token)
    const int64_t pos = c0 + t, off = pos & (bs - 1), n = std::min(bs - off, m - t);
    const T* block = head + (table[pos / bs] * bs + off) * d;
    for (int64_t j = 0; j < n; ++j) to_float_row(block + j * d, dst + (t + j) * d, d);
    t += n;
  }
  std::fill(dst + m * d, dst + m_pad * d, 0.f);
}

struct TileBuffers {
  LineVector<float> qT, probs, accT, kb, vb;
};

// One prefill tile: rows r0 .. r0 + n_rows - 1 of q [T, Hq, D], all of one sequence, with the G heads of KV head
// h; each row attends over its keys 0 .. lens[row] - 1. Online softmax (Milakov & Gimelshein 2018, as in
// FlashAttention) in steps of kKeyChunk keys at absolute positions 0, kKeyChunk, ...; a query's keys past its own
// context get probability exactly 0 (and a step past it rescales by exactly 1), so they change none of its bits.
template <typename T>
void attend_tile(const T* q, const T* k_head, const T* v_head, const int64_t* table, const int64_t* lens, int64_t r0,
                 int64_t n_rows, int64_t num_heads, int64_t h, int64_t group, int64_t d, const Shape& s, T* out,
                 TileBuffers& buf) {
  const int64_t nq = n_rows * group, qp = (nq + 7) / 8 * 8;
  int64_t n_max = 0;
  for (int64_t r = 0; r < n_rows; ++r) n_max = std::max(n_max, lens[r0 + r]);
  buf.qT.assign(d * qp, 0.f);
  buf.probs.resize(kKeyChunk * qp);
  buf.accT.assign(d * qp, 0.f);
  buf.kb.resize(kKeyChunk * d);
  buf.vb.resize(kKeyChunk * d);
  float *qT = buf.qT.data(), *probs = buf.probs.data(), *accT = buf.accT.data();
  alignas(64) float row[kMaxD];
  alignas(32) float ctx[kMaxQ], run_max[kMaxQ], run_sum[kMaxQ];
  for (int64_t i = 0; i < nq; ++i) {
    const int64_t r = i / group, g = i % group;
    to_float_row(q + ((r0 + r) * num_heads + h * group + g) * d, row, d);
    for (int64_t k = 0; k < d; ++k) qT[k * qp + i] = row[k] * s.scale;
  }
  for (int64_t i = 0; i < qp; ++i) {  // padding queries (zero) see every key
    ctx[i] = float(i < nq ? lens[r0 + i / group] : n_max);
    run_max[i] = -std::numeric_limits<float>::infinity();
    run_sum[i] = 0.f;
  }
  const v8 neg_inf = splat(-std::numeric_limits<float>::infinity()), zero = splat(0.f);
  for (int64_t c0 = 0; c0 < n_max; c0 += kKeyChunk) {
    const int64_t m = std::min(kKeyChunk, n_max - c0), m8 = (m + 7) / 8 * 8;
    load_chunk(k_head, table, s.block_size, d, c0, m, m8, buf.kb.data());
    const float* kb = buf.kb.data();
    int64_t q0 = 0;
#if defined(__AVX512F__)
    for (; q0 + 48 <= qp; q0 += 48)
      for (int64_t t0 = 0; t0 < m8; t0 += 4) score_tile<v16, 3, 4>(qT, qp, kb, d, t0, q0, probs);
#endif
    for (; q0 + 24 <= qp; q0 += 24)
      for (int64_t t0 = 0; t0 < m8; t0 += 4) score_tile<v8, 3, 4>(qT, qp, kb, d, t0, q0, probs);
    if (qp - q0 == 16)
      for (int64_t t0 = 0; t0 < m8; t0 += 4) score_tile<v8, 2, 4>(qT, qp, kb, d, t0, q0, probs);
    else if (qp - q0 == 8)
      for (int64_t t0 = 0; t0 < m8; t0 += 8) score_tile<v8, 1, 8>(qT, qp, kb, d, t0, q0, probs);
    // Per 8 queries: the step's maximum over each query's visible keys, the rescale of what came before, the
    // probabilities (0 for keys past a query's context) and their running sum, a chain over t in order.
    alignas(32) float corr[kMaxQ];
    for (int64_t q0 = 0; q0 < qp; q0 += 8) {
      const v8 n_ctx = load8(ctx + q0);
      v8 mx = load8(run_max + q0);
      for (int64_t t = 0; t < m; ++t) {
        const v8 sc = load8(probs + t * qp + q0);
        mx = ((splat(float(c0 + t)) < n_ctx) & (sc > mx)) ? sc : mx;
      }
      const v8 old_max = load8(run_max + q0);
      const v8 c = exp8(old_max - mx);  // 0 on the first step (old max -inf), exactly 1 where mx did not move
      v8 sum = load8(run_sum + q0) * c;
      for (int64_t t = 0; t < m; ++t) {
        const v8 p = splat(float(c0 + t)) < n_ctx ? exp8(load8(probs + t * qp + q0) - mx) : zero;
        store8(probs + t * qp + q0, p);
        sum += p;
      }
      store8(run_max + q0, mx);
      store8(run_sum + q0, sum);
      store8(corr + q0, c);
    }
    for (int64_t k = 0; k < d; ++k)
      for (int64_t q0 = 0; q0 < qp; q0 += 8) store8(accT + k * qp + q0, load8(accT + k * qp + q0) * load8(corr + q0));
    load_chunk(v_head, table, s.block_size, d, c0, m, m, buf.vb.data());
    const float* vb = buf.vb.data();
    q0 = 0;
#if defined(__AVX512F__)
    for (; q0 + 48 <= qp; q0 += 48)
      for (int64_t c = 0; c < d; c += 4) pv_tile<v16, 3, 4>(probs, qp, vb, d, m, c, q0, accT);
#endif
    for (; q0 + 24 <= qp; q0 += 24)
      for (int64_t c = 0; c < d; c += 4) pv_tile<v8, 3, 4>(probs, qp, vb, d, m, c, q0, accT);
    if (qp - q0 == 16)
      for (int64_t c = 0; c < d; c += 4) pv_tile<v8, 2, 4>(probs, qp, vb, d, m, c, q0, accT);
    else if (qp - q0 == 8)
      for (int64_t c = 0; c < d; c += 8) pv_tile<v8, 1, 8>(probs, qp, vb, d, m, c, q0, accT);  // d: a multiple of 8
  }
  for (int64_t i = 0; i < nq; ++i) {
    const int64_t r = i / group, g = i % group;
    const float inv = 1.f / run_sum[i];
    T* o = out + ((r0 + r) * num_heads + h * group + g) * d;
    for (int64_t k = 0; k < d; ++k) o[k] = T(accT[k * qp + i] * inv);
  }
}

#if defined(INFERD_BF16_PAIRS)
// Prefill tiles of BF16 rows on CPUs with AVX512-BF16: both products of the tile, Q K^T and P V, as vdpbf16ps over
// pairs (the kernel of panel_gemm.cpp: each instruction adds two exact BF16 products to 16 FP32 accumulators, the
// odd element of a pair first). The lanes are still a tile's queries; pairs run over the head dimension for the
// scores (a key pair is a 32-bit word of the cache row itself, broadcast; no conversion of the keys) and over
// consecutive keys for the value sums, so the probabilities are rounded to BF16 before P V (as FlashAttention does,
// Dao 2023, arXiv:2307.08691) and the values are re-laid in pairs of keys once per chunk. Key pairs sit at fixed
// absolute positions (kKeyChunk is even) and every score and output element is one chain in order, so a row's bits
// still depend only on its query and its keys.
using inferd::v16i;
using inferd::v16u;


// acc[i][j] (lanes q0 + 16 j + l) += sum over x < n, in order, of the pair products of lanes[x, q] (32-bit pairs, row
// stride ld) and word(x, i), broadcast: one vdpbf16ps per (x, i, j), kB x kQ accumulators (24 of the 32 registers).
template <int kQ, int kB, typename Word>
INFERD_INLINE void dp_tile(const uint32_t* lanes, int64_t ld, int64_t n, int64_t q0, Word word, __m512 (&acc)[kB][kQ]) {
  for (int64_t x = 0; x < n; ++x) {
    __m512bh lv[kQ];
#pragma GCC unroll 4
    for (int j = 0; j < kQ; ++j) lv[j] = (__m512bh)_mm512_loadu_si512(lanes + x * ld + q0 + 16 * j);
#pragma GCC unroll 16
    for (int i = 0; i < kB; ++i) {
      const __m512bh b = (__m512bh)_mm512_set1_epi32(int32_t(word(x, i)));
#pragma GCC unroll 4
      for (int j = 0; j < kQ; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], lv[j], b);
    }
  }
}

// scores[t, q0 + 16 j + l] = scale * sum over kk < dp, in order, of the pair products of qP[kk, q] and key t's pair
// kk (krow[t]: the key rows in the cache, as 32-bit pairs), for the kK keys t0 .. t0 + kK - 1 and j < kQ.
template <int kQ, int kK>
INFERD_INLINE void score_tile_pairs(const uint32_t* qP, int64_t qp, const uint32_t* const* krow, int64_t dp,
                                    int64_t t0, int64_t q0, float scale, float* scores) {
  __m512 acc[kK][kQ];
#pragma GCC unroll 16
  for (int i = 0; i < kK; ++i)
#pragma GCC unroll 4
    for (int j = 0; j < kQ; ++j) acc[i][j] = _mm512_setzero_ps();
  dp_tile<kQ, kK>(qP, qp, dp, q0, [&](int64_t kk, int i) { return krow[t0 + i][kk]; }, acc);
  const __m512 sc = _mm512_set1_ps(scale);
#pragma GCC unroll 16
  for (int i = 0; i < kK; ++i)
#pragma GCC unroll 4
    for (int j = 0; j < kQ; ++j) _mm512_storeu_ps(scores + (t0 + i) * qp + q0 + 16 * j, _mm512_mul_ps(acc[i][j], sc));
}

// accT[c, q0 + 16 j + l] for the kC dims c0 .. c0 + kC - 1 and j < kQ += sum over key pairs tt < m2, in order, of
// the pair products of pP[tt, q] (two probabilities) and vP[tt, c] (the two keys' values).
template <int kQ, int kC>
INFERD_INLINE void pv_tile_pairs(const uint32_t* pP, int64_t qp, const uint32_t* vP, int64_t d, int64_t m2,
                                 int64_t c0, int64_t q0, float* accT) {
  __m512 acc[kC][kQ];
#pragma GCC unroll 16
  for (int i = 0; i < kC; ++i)
#pragma GCC unroll 4
    for (int j = 0; j < kQ; ++j) acc[i][j] = _mm512_loadu_ps(accT + (c0 + i) * qp + q0 + 16 * j);
  dp_tile<kQ, kC>(pP, qp, m2, q0, [&](int64_t tt, int i) { return vP[tt * d + c0 + i]; }, acc);
#pragma GCC unroll 16
  for (int i = 0; i < kC; ++i)
#pragma GCC unroll 4
    for (int j = 0; j < kQ; ++j) _mm512_storeu_ps(accT + (c0 + i) * qp + q0 + 16 * j, acc[i][j]);
}

// e^x in 16 lanes with AVX-512's own range reduction and scaling: n = x log2(e) rounded to nearest (vrndscaleps),
// r = x - n ln 2 (two constants, as exp_lanes), the same degree-7 polynomial, then p * 2^n by vscalefps (which gives
// infinity past the float range); exactly 0 below -86, as exp_lanes. About 14 operations where exp_lanes takes 25
// (its rounding, clamps and exponent arithmetic by hand); within an ulp of it. The prefill softmax's exponentials
// are half of a long prompt's attention (docs/performance.md, stop 28).
INFERD_INLINE v16 exp16_scalef(v16 xv) {
  __m512 x;
  std::memcpy(&x, &xv, sizeof(x));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 low = _mm512_set1_ps(-86.f);
  const __m512 xc = _mm512_max_ps(x, low);  // -inf (a first chunk's old maximum) would make r NaN
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), xc);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.f / 5040.f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 720.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  const __m512 y = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, low, _CMP_GE_OQ) | _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q),
                                       _mm512_scalef_ps(p, n));
  v16 out;
  std::memcpy(&out, &y, sizeof(out));
  return out;
}

// Lanes rounded to BF16 (round_bf16's rule: to nearest, ties to even), as the FP32 they stand for.
INFERD_INLINE v16u round_bits(v16 v) {
  v16u u;
  std::memcpy(&u, &v, sizeof(u));
  return (u + (((u >> 16) & 1u) + 0x7fffu)) & 0xffff0000u;  // no NaN here: probabilities are in [0, 1]
}

// A BF16 tile's start: its nq query rows' pairs, k-major (qP [d / 2, qp], zero past nq: each query's own bits), each
// query's context length in ctx (the padding queries past nq see every key: n_max), and the online softmax's state
// (running maximum -inf, sum 0).
// a[j] lane i <- a[i] lane j: a 16 x 16 transpose of 32-bit words (unpacks in 32 and 64 bits, then 128-bit lanes).
INFERD_INLINE void transpose16(__m512i (&a)[16]) {
  __m512i t[16];
#pragma GCC unroll 8
  for (int k = 0; k < 8; ++k) {
    t[2 * k] = _mm512_unpacklo_epi32(a[2 * k], a[2 * k + 1]);
    t[2 * k + 1] = _mm512_unpackhi_epi32(a[2 * k], a[2 * k + 1]);
  }
#pragma GCC unroll 4
  for (int k = 0; k < 4; ++k) {  // u[4 k + c], 128-bit lane L: rows 4 k .. 4 k + 3 of column 4 L + c
    a[4 * k] = _mm512_unpacklo_epi64(t[4 * k], t[4 * k + 2]);
    a[4 * k + 1] = _mm512_unpackhi_epi64(t[4 * k], t[4 * k + 2]);
    a[4 * k + 2] = _mm512_unpacklo_epi64(t[4 * k + 1], t[4 * k + 3]);
    a[4 * k + 3] = _mm512_unpackhi_epi64(t[4 * k + 1], t[4 * k + 3]);
  }
#pragma GCC unroll 4
  for (int c = 0; c < 4; ++c) {
    const __m512i v0 = _mm512_shuffle_i32x4(a[c], a[4 + c], 0x44), v1 = _mm512_shuffle_i32x4(a[c], a[4 + c], 0xEE);
    const __m512i w0 = _mm512_shuffle_i32x4(a[8 + c], a[12 + c], 0x44);
    const __m512i w1 = _mm512_shuffle_i32x4(a[8 + c], a[12 + c], 0xEE);
    t[c] = _mm512_shuffle_i32x4(v0, w0, 0x88);
    t[4 + c] = _mm512_shuffle_i32x4(v0, w0, 0xDD);
    t[8 + c] = _mm512_shuffle_i32x4(v1, w1, 0x88);
    t[12 + c] = _mm512_shuffle_i32x4(v1, w1, 0xDD);
  }
#pragma GCC unroll 16
  for (int k = 0; k < 16; ++k) a[k] = t[k];
}

void start_pair_tile(const at::BFloat16* q, const int64_t* lens, int64_t r0, int64_t nq, int64_t qp, int64_t num_heads,
                     int64_t h, int64_t group, int64_t d, int64_t n_max, uint32_t* qP, float* ctx, float* run_max,
                     float* run_sum) {
  // Query i = r group + g is head h group + g of row r0 + r (counted, not divided: a 64-bit division per query was
  // most of this function's time on short prompts, stop 33).
  const auto query = [&](int64_t r, int64_t g) {
    return reinterpret_cast<const uint32_t*>(q + ((r0 + r) * num_heads + h * group + g) * d);
  };
  if (d / 2 % 16 == 0) {  // 16 queries x 16 pairs at a time, transposed in registers (a scalar loop was ~10% of a
                          // 128-token prompt's attention, stop 33); zero past nq, as qP's rows already are
    for (int64_t i0 = 0, r = 0, g = 0; i0 < nq; i0 += 16) {
      const uint32_t* rows[16];
      for (int j = 0; j < 16; ++j) {
        rows[j] = i0 + j < nq ? query(r, g) : nullptr;
        if (++g == group) g = 0, ++r;
      }
      for (int64_t k0 = 0; k0 < d / 2; k0 += 16) {
        __m512i w[16];
#pragma GCC unroll 16
        for (int j = 0; j < 16; ++j) w[j] = rows[j] ? _mm512_loadu_si512(rows[j] + k0) : _mm512_setzero_si512();
        transpose16(w);
#pragma GCC unroll 16
        for (int k = 0; k < 16; ++k) _mm512_storeu_si512(qP + (k0 + k) * qp + i0, w[k]);
      }
    }
  } else {
    for (int64_t r = 0, i = 0; i < nq; ++r)
      for (int64_t g = 0; g < group; ++g, ++i)
        for (int64_t kk = 0; kk < d / 2; ++kk) qP[kk * qp + i] = query(r, g)[kk];
  }
  for (int64_t r = 0, i = 0; i < nq; ++r)
    for (int64_t g = 0; g < group; ++g) ctx[i++] = float(lens[r0 + r]);
  for (int64_t i = 0; i < qp; ++i) {
    if (i >= nq) ctx[i] = float(n_max);
    run_max[i] = -std::numeric_limits<float>::infinity();
    run_sum[i] = 0.f;
  }
}

// The values of a chunk's m keys in pairs of keys, rows tt < rows: vP[tt, c] = (v[2 tt, c], v[2 tt + 1, c]), BF16
// bits, a zero value past m (rows past the chunk's pairs all zero); row_at(t) is key t's value row.
template <typename RowAt>
void pair_values(RowAt row_at, int64_t m, int64_t rows, int64_t d, uint32_t* vP) {
  for (int64_t tt = 0; tt < rows; ++tt) {
    uint32_t* dst = vP + tt * d;
    if (2 * tt >= m) {
      std::memset(dst, 0, d * sizeof(uint32_t));
      continue;
    }
    const auto* a = reinterpret_cast<const uint16_t*>(row_at(2 * tt));
    const uint16_t* b = 2 * tt + 1 < m ? reinterpret_cast<const uint16_t*>(row_at(2 * tt + 1)) : nullptr;
    int64_t c = 0;
    for (; c + 16 <= d; c += 16) {
      const __m512i lo = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + c)));
      const __m512i hi = b ? _mm512_slli_epi32(
                                 _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + c))), 16)
                           : _mm512_setzero_si512();
      _mm512_storeu_si512(dst + c, _mm512_or_si512(lo, hi));
    }
    for (; c < d; ++c) dst[c] = uint32_t(a[c]) | (b ? uint32_t(b[c]) << 16 : 0u);
  }
}

struct PairBuffers {
  LineVector<uint32_t> qP, pP, vP;  // AMX: pP holds P [query, key pair] (the A tiles of P V)
  LineVector<float> scores, accT;   // AMX: accT is the output [query, dim] (the C tiles of P V)
  std::vector<const uint32_t*> krow;
  LineVector<uint16_t> kg;  // AMX: 16 key rows gathered where they are not one block's
};

#if defined(INFERD_AMX)
// scores[t, q] = S (unscaled) for the 16 KB keys from t0 (krow) and the 16 NQ queries from q0, on AMX tiles blocked
// as panel_gemm.cpp's amx_block: C tiles 0-3 = (key block i, query group j) at 2 i + j, per 16-pair step of the head
// dim A tiles 4, 5 = the key blocks' rows (read in place where they are one block's 16 consecutive rows, else
// gathered into kg) and B tiles 6, 7 = the query groups' pairs. Each score sums the head dim's pairs 16 per
// instruction, in order.
template <int KB, int NQ>
void scores_amx(const uint32_t* qP, int64_t qp, const uint32_t* const* krow, int64_t dp, int64_t t0, int64_t q0,
                int64_t m, int64_t bs, uint16_t* kg, float* scores, int64_t ldc) {
  const int64_t d = 2 * dp;
  const uint32_t* a[2];
  for (int i = 0; i < KB; ++i) {
    const int64_t t = t0 + 16 * i;
    a[i] = krow[t];
    if (!(bs >= 16 && t + 16 <= m)) {  // not one block's 16 consecutive rows: gathered
      for (int r = 0; r < 16; ++r) std::memcpy(kg + (16 * i + r) * d, krow[t + r], d * sizeof(uint16_t));
      a[i] = reinterpret_cast<const uint32_t*>(kg + 16 * i * d);
    }
  }
  asm volatile("" ::: "memory");  // the tile loads below are asm that does not say it reads kg
  _tile_zero(0);
  if constexpr (NQ > 1) _tile_zero(1);
  if constexpr (KB > 1) _tile_zero(2);
  if constexpr (KB > 1 && NQ > 1) _tile_zero(3);
  for (int64_t kk = 0; kk < dp; kk += 16) {
    _tile_loadd(4, a[0] + kk, d * 2);
    if constexpr (KB > 1) _tile_loadd(5, a[1] + kk, d * 2);
    _tile_loadd(6, qP + kk * qp + q0, qp * 4);
    if constexpr (NQ > 1) _tile_loadd(7, qP + kk * qp + q0 + 16, qp * 4);
    _tile_dpbf16ps(0, 4, 6);
    if constexpr (NQ > 1) _tile_dpbf16ps(1, 4, 7);
    if constexpr (KB > 1) _tile_dpbf16ps(2, 5, 6);
    if constexpr (KB > 1 && NQ > 1) _tile_dpbf16ps(3, 5, 7);
  }
  float* c = scores + t0 * ldc;
  _tile_stored(0, c, ldc * 4);
  if constexpr (NQ > 1) _tile_stored(1, c + 16, ldc * 4);
  if constexpr (KB > 1) _tile_stored(2, c + 16 * ldc, ldc * 4);
  if constexpr (KB > 1 && NQ > 1) _tile_stored(3, c + 16 * ldc + 16, ldc * 4);
  asm volatile("" ::: "memory");  // the C stores are asm too: scores are written before they are read
}

// 2^t in 16 lanes, 0 where `keep` is off or t < -126: n = t rounded to nearest (vrndscaleps), f = t - n in
// [-0.5, 0.5], 2^f by the degree-5 Taylor polynomial of e^(f ln 2) (relative error below 2.5e-6, far under the BF16
// rounding of the probabilities that use it), times 2^n by vscalefps. A NaN t gives NaN. 10 operations with the
// FMA that forms t (exp16_scalef: 15).
INFERD_INLINE __m512 exp2_16(__m512 t, __mmask16 keep) {
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 p = _mm512_set1_ps(1.3333558146428443e-3f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291076284772e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504108664821580e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022650695910071e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718055994531e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  return _mm512_maskz_scalef_ps(keep & _mm512_cmp_ps_mask(t, _mm512_set1_ps(-126.f), _CMP_NLT_UQ), p, n);
}

// Prefill tiles on AMX (head dims that are whole tiles of 32), FlashAttention's loop (Dao 2023, arXiv:2307.08691)
// with both products on tiles, in chunks of kKeyChunk keys at fixed absolute positions:
// - S = K Q^T: C [16 keys, 16 queries] = A (16 key rows read in place from a block, else gathered) times B (the
//   queries' pairs [dim pair, query]), 2 x 2 tiles (scores_amx); stored unscaled, so the softmax reads each score
//   once for the maximum and once for the exponential, 2^(s scale log2(e) - max) by one FMA and exp2_16().
// - The softmax runs with the queries in the lanes (a key's scores are a row of C): the running maximum and sum are
//   16 queries' lanes, the probabilities are rounded to BF16 in pairs of keys and 16 key pairs x 16 queries are
//   transposed in registers into P [query, key pair], the A layout of P V.
// - O += P V: C = the output [query, dim] (FP32, rescaled by e^(old max - max) first), A = P, B = the chunk's values
//   in pairs of keys [key pair, dim] (two rows interleaved, the vdpbf16ps path's layout).
// Every score and output element is one fixed sequence of tile products over its own query and keys, in order, so a
// row's bits depend only on its query and its keys, not on the tile or chunking of its prompt (tests/test_kernels.py).
void attend_tile_amx(const at::BFloat16* q, const at::BFloat16* k_head, const at::BFloat16* v_head,
                     const int64_t* table, const int64_t* lens, int64_t r0, int64_t n_rows, int64_t num_heads,
                     int64_t h, int64_t group, int64_t d, const Shape& s, at::BFloat16* out, PairBuffers& buf,
                     const uint32_t* shared_pairs, int64_t shared_keys) {
  const int64_t nq = n_rows * group, qp = (nq + 15) / 16 * 16, dp = d / 2, bs = s.block_size;
  constexpr int64_t kPairs = kKeyChunk / 2;  // a multiple of 16
  int64_t n_max = 0;
  for (int64_t r = 0; r < n_rows; ++r) n_max = std::max(n_max, lens[r0 + r]);
  buf.qP.assign(dp * qp, 0u);
  buf.pP.resize(qp * kPairs);
  buf.vP.resize(kPairs * d);
  buf.scores.resize(kKeyChunk * 32);
  buf.accT.assign(qp * d, 0.f);
  buf.krow.resize(kKeyChunk);
  buf.kg.resize(32 * d);
  uint32_t *qP = buf.qP.data(), *pT = buf.pP.data(), *vP = buf.vP.data();
  float *scores = buf.scores.data(), *acc = buf.accT.data();
  const uint32_t** krow = buf.krow.data();
  alignas(64) float ctx[kMaxQ], run_max[kMaxQ], run_sum[kMaxQ];
  start_pair_tile(q, lens, r0, nq, qp, num_heads, h, group, d, n_max, qP, ctx, run_max, run_sum);
  inferd::amx_configure();
  // GCC's tile loads are asm that does not say it reads memory: the query pairs above are stored before they run.
  asm volatile("" ::: "memory");
  const int shift = __builtin_ctzll(uint64_t(bs));  // bs is a power of two: no division per key
  const auto row_of = [&](const at::BFloat16* head, int64_t pos) {
    return head + (table[pos >> shift] * bs + (pos & (bs - 1))) * d;
  };
  alignas(64) uint16_t order[32];  // element 2 j <- j, 2 j + 1 <- 16 + j
  for (int j = 0; j < 16; ++j) {
    order[2 * j] = uint16_t(j);
    order[2 * j + 1] = uint16_t(16 + j);
  }
  const __m512i pair_words = _mm512_load_si512(order);
  for (int64_t c0 = 0; c0 < n_max; c0 += kKeyChunk) {
    const int64_t m = std::min(kKeyChunk, n_max - c0), m16 = (m + 15) / 16 * 16, m2 = (m + 1) / 2;
    const int64_t m2p = (m2 + 15) / 16 * 16;
    for (int64_t t = 0; t < m16; ++t)  // keys past m: any real row (no query sees them)
      krow[t] = reinterpret_cast<const uint32_t*>(row_of(k_head, c0 + (t < m ? t : 0)));
    // The chunk's values in pairs of keys, zero past m (and up to m2p, the tiles' 16 pairs): for a whole chunk, the
    // pairs the sequence's tiles share (the same words, built once per call by run()), else here.
    const uint32_t* vc = vP;
    if (m == kKeyChunk && c0 + kKeyChunk <= shared_keys)
      vc = shared_pairs + c0 / 2 * d;
    else
      pair_values([&](int64_t t) { return row_of(v_head, c0 + t); }, m, m2p, d, vP);
    asm volatile("" ::: "memory");
    // The chunk runs 32 queries at a time, scores to P V, so that those queries' scores (32 KiB), probabilities and
    // output rows stay in L1 between the phases (all of a tile's 96 queries at once: 170 KiB, from L2; stop 34).
    for (int64_t g0 = 0; g0 < qp; g0 += 32) {
      const bool two = g0 + 16 < qp;
      for (int64_t t0 = 0; t0 < m16; t0 += 32) {
        if (t0 + 32 <= m16) {
          if (two)
            scores_amx<2, 2>(qP, qp, krow, dp, t0, g0, m, bs, buf.kg.data(), scores, 32);
          else
            scores_amx<2, 1>(qP, qp, krow, dp, t0, g0, m, bs, buf.kg.data(), scores, 32);
        } else if (two) {
          scores_amx<1, 2>(qP, qp, krow, dp, t0, g0, m, bs, buf.kg.data(), scores, 32);
        } else {
          scores_amx<1, 1>(qP, qp, krow, dp, t0, g0, m, bs, buf.kg.data(), scores, 32);
        }
      }
      // Per 16 queries (the lanes): the chunk's maximum over each query's visible keys, of the unscaled scores (the
      // scale is positive and rounding is monotonic, so the scaled maximum is the maximum of the scaled scores); the
      // rescale of what came before; the probabilities 2^(s scale log2(e) - max), 0 for keys past a query's context
      // and past the chunk, rounded to BF16 (vcvtne2ps2bf16: to nearest even) and interleaved into pairs of keys;
      // their running sum (of the rounded values, the weights P V uses), a chain over the pairs of keys in order, one
      // vdpbf16ps by BF16 ones a pair (the odd key then the even one, denormals flushed as the tile products flush
      // them; 4 operations a pair before, stop 30). The running maxima are kept in units of log2(e) scale.
      const __m512 l2s = _mm512_set1_ps(s.scale * 1.44269504088896341f);
      for (int64_t q0 = g0; q0 < g0 + (two ? 32 : 16); q0 += 16) {
        const float* sq = scores + (q0 - g0);  // key t's scores of these 16 queries: sq[32 t ..]
        const __m512 n_ctx = _mm512_load_ps(ctx + q0);
        // Keys [0, seen) of the chunk are inside every one of these 16 queries' contexts: no mask there, and their
        // maximum in four running maxima (exact in any order; vmaxps(sc, mx) returns mx where sc is NaN, as the
        // masked chain's `sc > mx ? sc : mx` does).
        int64_t seen = m;
        for (int i = 0; i < 16; ++i) seen = std::min<int64_t>(seen, std::max<int64_t>(0, int64_t(ctx[q0 + i]) - c0));
        const __m512 ninf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
        __m512 m4[4] = {ninf, ninf, ninf, ninf};
        int64_t t = 0;
        for (; t + 4 <= seen; t += 4)
#pragma GCC unroll 4
          for (int j = 0; j < 4; ++j) m4[j] = _mm512_max_ps(_mm512_loadu_ps(sq + (t + j) * 32), m4[j]);
        __m512 raw = _mm512_max_ps(_mm512_max_ps(m4[0], m4[1]), _mm512_max_ps(m4[2], m4[3]));
        for (; t < m; ++t) {
          const __m512 sc = _mm512_loadu_ps(sq + t * 32);
          const __mmask16 take = _mm512_cmp_ps_mask(_mm512_set1_ps(float(c0 + t)), n_ctx, _CMP_LT_OQ) &
                                 _mm512_cmp_ps_mask(sc, raw, _CMP_GT_OQ);
          raw = _mm512_mask_mov_ps(raw, take, sc);
        }
        const __m512 old_max = _mm512_load_ps(run_max + q0);
        const __m512 scaled = _mm512_mul_ps(raw, l2s);
        const __m512 mx = _mm512_mask_mov_ps(old_max, _mm512_cmp_ps_mask(scaled, old_max, _CMP_GT_OQ), scaled);
        const __m512 c = exp2_16(_mm512_sub_ps(old_max, mx), 0xffff);
        __m512 sum = _mm512_mul_ps(_mm512_load_ps(run_sum + q0), c);
        const __m512 neg_mx = _mm512_sub_ps(_mm512_setzero_ps(), mx);
        const auto p_of = [&](int64_t t, __mmask16 keep) {
          return exp2_16(_mm512_fmadd_ps(_mm512_loadu_ps(sq + t * 32), l2s, neg_mx), keep);
        };
        const __m512bh ones = (__m512bh)_mm512_set1_epi16(0x3f80);  // BF16 1.0
        for (int64_t tt0 = 0; tt0 < m2p; tt0 += 16) {
          __m512i w[16];
#pragma GCC unroll 16
          for (int i = 0; i < 16; ++i) {
            const int64_t t = 2 * (tt0 + i);
            __m512 p0 = _mm512_setzero_ps(), p1 = _mm512_setzero_ps();
            if (t + 1 < seen) {
              p0 = p_of(t, 0xffff);
              p1 = p_of(t + 1, 0xffff);
            } else {
              if (t < m) p0 = p_of(t, _mm512_cmp_ps_mask(_mm512_set1_ps(float(c0 + t)), n_ctx, _CMP_LT_OQ));
              if (t + 1 < m)
                p1 = p_of(t + 1, _mm512_cmp_ps_mask(_mm512_set1_ps(float(c0 + t + 1)), n_ctx, _CMP_LT_OQ));
            }
            // 16-bit elements p0[0..15], p1[0..15] -> 32-bit words (p0[q], p1[q])
            w[i] = _mm512_permutexvar_epi16(pair_words, (__m512i)_mm512_cvtne2ps_pbh(p1, p0));
            sum = _mm512_dpbf16_ps(sum, (__m512bh)w[i], ones);
          }
          transpose16(w);
#pragma GCC unroll 16
          for (int j = 0; j < 16; ++j) _mm512_storeu_si512(pT + (q0 + j) * m2p + tt0, w[j]);
        }
        _mm512_store_ps(run_max + q0, mx);
        _mm512_store_ps(run_sum + q0, sum);
        // What came before, rescaled by e^(old max - max).
        for (int i = 0; i < 16; ++i) {
          const __m512 ci = _mm512_set1_ps(c[i]);
          for (int64_t k = 0; k < d; k += 16)
            _mm512_storeu_ps(acc + (q0 + i) * d + k, _mm512_mul_ps(_mm512_loadu_ps(acc + (q0 + i) * d + k), ci));
        }
      }
      asm volatile("" ::: "memory");
      // O += P V: C tiles 0-3 = (16 queries, 16 dims) x 2 x 2, A 4, 5 = P of the two query groups, B 6, 7 = V of the
      // two dim groups.
      for (int64_t c = 0; c < d; c += 32) {
        float* o = acc + g0 * d + c;
        _tile_loadd(0, o, d * 4);
        _tile_loadd(1, o + 16, d * 4);
        if (two) {
          _tile_loadd(2, o + 16 * d, d * 4);
          _tile_loadd(3, o + 16 * d + 16, d * 4);
        }
        for (int64_t tt0 = 0; tt0 < m2p; tt0 += 16) {
          // The next step's value rows into L1 while this step's products run (a tile load waits on its misses).
          if (tt0 + 16 < m2p)
            for (int64_t r = tt0 + 16; r < tt0 + 32; ++r) {
              _mm_prefetch(reinterpret_cast<const char*>(vc + r * d + c), _MM_HINT_T0);
              _mm_prefetch(reinterpret_cast<const char*>(vc + r * d + c + 16), _MM_HINT_T0);
            }
          _tile_loadd(4, pT + g0 * m2p + tt0, m2p * 4);
          _tile_loadd(6, vc + tt0 * d + c, d * 4);
          _tile_loadd(7, vc + tt0 * d + c + 16, d * 4);
          _tile_dpbf16ps(0, 4, 6);
          _tile_dpbf16ps(1, 4, 7);
          if (two) {
            _tile_loadd(5, pT + (g0 + 16) * m2p + tt0, m2p * 4);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
          }
        }
        _tile_stored(0, o, d * 4);
        _tile_stored(1, o + 16, d * 4);
        if (two) {
          _tile_stored(2, o + 16 * d, d * 4);
          _tile_stored(3, o + 16 * d + 16, d * 4);
        }
      }
      asm volatile("" ::: "memory");  // the C stores are asm too: acc is written before it is read
    }
  }
  for (int64_t r = 0, i = 0; i < nq; ++r)
    for (int64_t g = 0; g < group; ++g, ++i) {
      const __m512 inv = _mm512_set1_ps(1.f / run_sum[i]);
      at::BFloat16* o = out + ((r0 + r) * num_heads + h * group + g) * d;
      for (int64_t k = 0; k < d; k += 16)  // as at::BFloat16(float) rounds, denormals included
        inferd::store_bf16_16(o + k, _mm512_mul_ps(_mm512_loadu_ps(acc + i * d + k), inv));
    }
}
#endif

// attend_tile() for BF16 with the pair products above; the same online softmax, in 16 lanes.
void attend_tile_pairs(const at::BFloat16* q, const at::BFloat16* k_head, const at::BFloat16* v_head,
                       const int64_t* table, const int64_t* lens, int64_t r0, int64_t n_rows, int64_t num_heads,
                       int64_t h, int64_t group, int64_t d, const Shape& s, at::BFloat16* out, PairBuffers& buf,
                       const uint32_t* shared_pairs = nullptr, int64_t shared_keys = 0) {
#if defined(INFERD_AMX)
  // AMX (head dims that are whole tiles of 32): both products on tiles (bits of their own, batch- and
  // chunk-invariant the same way; docs/performance.md, stops 28 and 29).
  if (inferd::amx_pairs() && d % 32 == 0)
    return attend_tile_amx(q, k_head, v_head, table, lens, r0, n_rows, num_heads, h, group, d, s, out, buf,
                           shared_pairs, shared_keys);
#endif
  const int64_t nq = n_rows * group, qp = (nq + 15) / 16 * 16, dp = d / 2, bs = s.block_size;
  int64_t n_max = 0;
  for (int64_t r = 0; r < n_rows; ++r) n_max = std::max(n_max, lens[r0 + r]);
  buf.qP.assign(dp * qp, 0u);
  buf.pP.resize(kKeyChunk / 2 * qp);
  buf.vP.resize(kKeyChunk / 2 * d);
  buf.scores.resize(kKeyChunk * qp);
  buf.accT.assign(d * qp, 0.f);
  buf.krow.resize(kKeyChunk);
  uint32_t *qP = buf.qP.data(), *pP = buf.pP.data(), *vP = buf.vP.data();
  float *scores = buf.scores.data(), *accT = buf.accT.data();
  const uint32_t** krow = buf.krow.data();
  alignas(64) float ctx[kMaxQ], run_max[kMaxQ], run_sum[kMaxQ], corr[kMaxQ];
  start_pair_tile(q, lens, r0, nq, qp, num_heads, h, group, d, n_max, qP, ctx, run_max, run_sum);
  const int shift = __builtin_ctzll(uint64_t(bs));  // bs is a power of two: no division per key
  const auto row_of = [&](const at::BFloat16* head, int64_t pos) {
    return head + (table[pos >> shift] * bs + (pos & (bs - 1))) * d;
  };
  for (int64_t c0 = 0; c0 < n_max; c0 += kKeyChunk) {
    const int64_t m = std::min(kKeyChunk, n_max - c0), m16 = (m + 15) / 16 * 16, m2 = (m + 1) / 2;
    for (int64_t t = 0; t < m16; ++t)  // keys past m: any real row (no query sees them)
      krow[t] = reinterpret_cast<const uint32_t*>(row_of(k_head, c0 + (t < m ? t : 0)));
    int64_t q0 = 0;
    for (; q0 + 48 <= qp; q0 += 48)
      for (int64_t t0 = 0; t0 < m16; t0 += 8) score_tile_pairs<3, 8>(qP, qp, krow, dp, t0, q0, s.scale, scores);
    if (qp - q0 == 32)
      for (int64_t t0 = 0; t0 < m16; t0 += 8) score_tile_pairs<2, 8>(qP, qp, krow, dp, t0, q0, s.scale, scores);
    else if (qp - q0 == 16)
      for (int64_t t0 = 0; t0 < m16; t0 += 16) score_tile_pairs<1, 16>(qP, qp, krow, dp, t0, q0, s.scale, scores);
    // Per 16 queries: the step's maximum over each query's visible keys, the rescale of what came before, the
    // probabilities (0 for keys past a query's context) rounded to BF16 in pairs of keys, and their running sum
    // (of the rounded values, the weights P V uses), a chain over t in order.
    for (int64_t q0 = 0; q0 < qp; q0 += 16) {
      const v16 n_ctx = load_lanes<v16>(ctx + q0);
      v16 mx = load_lanes<v16>(run_max + q0);
      // Keys [0, seen) of the chunk are inside every one of these 16 queries' contexts: no mask there, and their
      // maximum in four running maxima (exact in any order; `sc > mx ? sc : mx` and vmaxps(sc, mx) both skip a NaN
      // score), which the chain's compare-and-blend latency per key had bounded. The same values as the masked loop.
      int64_t seen = m;
      for (int i = 0; i < 16; ++i) seen = std::min<int64_t>(seen, std::max<int64_t>(0, int64_t(ctx[q0 + i]) - c0));
      int64_t t = 0;
      if (seen >= 4) {
        __m512 m4[4];
        std::memcpy(&m4[0], &mx, sizeof(mx));
        m4[1] = m4[2] = m4[3] = m4[0];
        for (; t + 4 <= seen; t += 4)
#pragma GCC unroll 4
          for (int j = 0; j < 4; ++j) m4[j] = _mm512_max_ps(_mm512_loadu_ps(scores + (t + j) * qp + q0), m4[j]);
        const __m512 all = _mm512_max_ps(_mm512_max_ps(m4[0], m4[1]), _mm512_max_ps(m4[2], m4[3]));
        std::memcpy(&mx, &all, sizeof(mx));
      }
      for (; t < m; ++t) {
        const v16 sc = load_lanes<v16>(scores + t * qp + q0);
        mx = ((float(c0 + t) < n_ctx) & (sc > mx)) ? sc : mx;
      }
      const v16 old_max = load_lanes<v16>(run_max + q0);
      const v16 c = exp16_scalef(old_max - mx);
      v16 sum = load_lanes<v16>(run_sum + q0) * c;
      for (int64_t tt = 0; tt < m2; ++tt) {
        const int64_t t = 2 * tt;
        v16 p0{}, p1{};
        if (t + 1 < seen) {
          p0 = exp16_scalef(load_lanes<v16>(scores + t * qp + q0) - mx);
          p1 = exp16_scalef(load_lanes<v16>(scores + (t + 1) * qp + q0) - mx);
        } else {
          p0 = float(c0 + t) < n_ctx ? exp16_scalef(load_lanes<v16>(scores + t * qp + q0) - mx) : v16{};
          if (t + 1 < m)
            p1 = float(c0 + t + 1) < n_ctx ? exp16_scalef(load_lanes<v16>(scores + (t + 1) * qp + q0) - mx) : v16{};
        }
        const v16u u0 = round_bits(p0), u1 = round_bits(p1);
        const v16u packed = (u0 >> 16) | u1;
        std::memcpy(pP + tt * qp + q0, &packed, sizeof(packed));
        v16 r0f, r1f;
        std::memcpy(&r0f, &u0, sizeof(r0f));
        std::memcpy(&r1f, &u1, sizeof(r1f));
        sum += r0f;
        sum += r1f;
      }
      store_lanes(run_max + q0, mx);
      store_lanes(run_sum + q0, sum);
      store_lanes(corr + q0, c);
    }
    for (int64_t k = 0; k < d; ++k)
      for (int64_t q0 = 0; q0 < qp; q0 += 16)
        store_lanes(accT + k * qp + q0, load_lanes<v16>(accT + k * qp + q0) * load_lanes<v16>(corr + q0));
    // The chunk's values in pairs of keys, a zero value past m.
    pair_values([&](int64_t t) { return row_of(v_head, c0 + t); }, m, m2, d, vP);
    q0 = 0;
    for (; q0 + 48 <= qp; q0 += 48)
      for (int64_t c = 0; c + 8 <= d; c += 8) pv_tile_pairs<3, 8>(pP, qp, vP, d, m2, c, q0, accT);
    if (qp - q0 == 32)
      for (int64_t c = 0; c + 8 <= d; c += 8) pv_tile_pairs<2, 8>(pP, qp, vP, d, m2, c, q0, accT);
    else if (qp - q0 == 16)
      for (int64_t c = 0; c + 8 <= d; c += 8) pv_tile_pairs<1, 8>(pP, qp, vP, d, m2, c, q0, accT);  // d % 8 == 0
  }
  for (int64_t i = 0; i < nq; ++i) {
    const int64_t r = i / group, g = i % group;
    const float inv = 1.f / run_sum[i];
    at::BFloat16* o = out + ((r0 + r) * num_heads + h * group + g) * d;
    for (int64_t k = 0; k < d; ++k) o[k] = at::BFloat16(accT[k * qp + i] * inv);
  }
}
#endif

#if defined(INFERD_BF16_PAIRS)
// Decode rows of BF16 on CPUs with AVX512-BF16 (head dims 64 and 128): the same products with vdpbf16ps. Scores: a
// key row's pairs times the query's (16 lanes of partial sums per key, 2 instructions a key at head dim 64), the
// lane sums of 16 keys at once by one fixed tree of unpacks and shuffles; values: two keys' rows interleaved into
// pairs of keys, times the two probabilities (rounded to BF16, their sum taken over the rounded values). Every score
// and output element is one fixed sequence of operations on its own inputs, so a row's bits do not depend on the
// batch.

// r[t] = the sum of the 16 lanes of a[t], for t < 16, in natural order: unpacks in 32 then 64 bits, then 128-bit
// lane shuffles (the same tree for every t).
INFERD_INLINE __m512 lane_sums16(const __m512 (&a)[16]) {
  __m512 r1[8], r2[4], r3[2];
#pragma GCC unroll 8
  for (int i = 0; i < 8; ++i)
    r1[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
#pragma GCC unroll 4
  for (int i = 0; i < 4; ++i) {
    const __m512d x = _mm512_castps_pd(r1[2 * i]), y = _mm512_castps_pd(r1[2 * i + 1]);
    r2[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
#pragma GCC unroll 2
  for (int i = 0; i < 2; ++i)
    r3[i] = _mm512_add_ps(_mm512_shuffle_f32x4(r2[2 * i], r2[2 * i + 1], 0x88),
                          _mm512_shuffle_f32x4(r2[2 * i], r2[2 * i + 1], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(r3[0], r3[1], 0x88), _mm512_shuffle_f32x4(r3[0], r3[1], 0xDD));
}

// out[h, c] += sum over key pairs tt < np, in order, of v[2 tt, c] p[h, 2 tt] + v[2 tt + 1, c] p[h, 2 tt + 1] for
// kH heads (probability pairs pw[h][tt]) and head dim 32 kJ; rows(tt): keys 2 tt and 2 tt + 1's value rows (BF16
// bits). acc[h][2 j + hi], lane i holds output dim 32 j + 8 (i / 4) + 4 hi + i % 4 (vpunpck{l,h}wd's order).
template <int kH, int kJ, typename Rows>
INFERD_INLINE void decode_values(const uint32_t* const (&pw)[kH], int64_t np, Rows rows, __m512 (&acc)[kH][2 * kJ]) {
#pragma GCC unroll 8
  for (int h = 0; h < kH; ++h)
#pragma GCC unroll 8
    for (int v = 0; v < 2 * kJ; ++v) acc[h][v] = _mm512_setzero_ps();
  for (int64_t tt = 0; tt < np; ++tt) {
    const auto [a, b] = rows(tt);
    __m512bh vv[2 * kJ];
#pragma GCC unroll 4
    for (int j = 0; j < kJ; ++j) {
      const __m512i x = _mm512_loadu_si512(a + 32 * j), y = _mm512_loadu_si512(b + 32 * j);
      vv[2 * j] = (__m512bh)_mm512_unpacklo_epi16(x, y);
      vv[2 * j + 1] = (__m512bh)_mm512_unpackhi_epi16(x, y);
    }
#pragma GCC unroll 8
    for (int h = 0; h < kH; ++h) {
      const __m512bh pb = (__m512bh)_mm512_set1_epi32(int32_t(pw[h][tt]));
#pragma GCC unroll 8
      for (int v = 0; v < 2 * kJ; ++v) acc[h][v] = _mm512_dpbf16_ps(acc[h][v], vv[v], pb);
    }
  }
}

// Each head's softmax over its scores [G, n32] (n32: n rounded up to 32; the scores past n set to -inf): the
// probabilities rounded to BF16, in pairs of keys into pw [G, n32 / 2] (zero past n), and 1 / their sum in inv[g] (a
// fixed 16-lane sum of the rounded values, the weights P V uses).
INFERD_INLINE void softmax_pairs(float* scores, uint32_t* pw, int64_t n, int64_t group, float* inv) {
  const int64_t n32 = (n + 31) / 32 * 32;
  for (int64_t g = 0; g < group; ++g) {
    float* sc = scores + g * n32;
    const float mx = max_and_pad(sc, n, n32);
    v16 sum{};
    for (int64_t t = 0; t < n32; t += 32) {
      const v16u a = round_bits(inferd::exp_lanes<v16, v16i>(load_lanes<v16>(sc + t) - mx));
      const v16u b = round_bits(inferd::exp_lanes<v16, v16i>(load_lanes<v16>(sc + t + 16) - mx));
      v16 fa, fb;
      std::memcpy(&fa, &a, sizeof(fa));
      std::memcpy(&fb, &b, sizeof(fb));
      sum += fa;
      sum += fb;
      // Exact (the values are BF16 already): words t / 2 .. t / 2 + 15 = (p[t], p[t + 1]), ...
      _mm512_storeu_si512(pw + g * (n32 / 2) + t / 2, (__m512i)_mm512_cvtne2ps_pbh((__m512)fb, (__m512)fa));
    }
    alignas(64) float lanes[16];
    store_lanes(lanes, sum);
    float total = 0.f;
    for (int i = 0; i < 16; ++i) total += lanes[i];
    inv[g] = 1.f / total;
  }
}

// The next decode item's (inferd::DecodeAhead) first kAheadKeys keys' blocks, K and V, prefetched into L2 at an even
// pace over the current item's steps: feed(s) brings the blocks fetched to s / steps of them, where an item of n keys
// has steps = 2 ceil(n / 16) (its 16-key steps of scores, then of values). At the next item's start its rows are then
// in L2, and the memory reads overlap this item's arithmetic instead of stalling that item's scores pass. Finishing
// the feed by half or three quarters of the item gained less (1.04-1.15x against 1.13-1.16x); at 1,000 keys a cap of
// 256 keys gained 1.00-1.01x against 512's 1.04-1.05x (docs/performance.md, stop 42). Only prefetches.
class AheadFeed {
 public:
  static constexpr int64_t kAheadKeys = 512;
  AheadFeed(const inferd::DecodeAhead* ahead, int64_t n, int64_t bs, int64_t d)
      : ahead_(ahead), bs_(bs), d_(d), steps_(2 * ((n + 15) / 16)),
        blocks_(ahead ? (std::min(ahead->n, kAheadKeys) + bs - 1) / bs : 0) {}
  explicit operator bool() const { return blocks_ > 0; }
  int64_t steps() const { return steps_; }
  void operator()(int64_t s) {
    const int64_t upto = std::min(blocks_, (blocks_ * s + steps_ - 1) / steps_);
    for (; fed_ < upto; ++fed_) {
      const int64_t rows = std::min(bs_, ahead_->n - fed_ * bs_), at = ahead_->table[fed_] * bs_ * d_;
      prefetch_block(static_cast<const at::BFloat16*>(ahead_->k_head) + at, rows * d_ * 2);
      prefetch_block(static_cast<const at::BFloat16*>(ahead_->v_head) + at, rows * d_ * 2);
    }
  }

 private:
  const inferd::DecodeAhead* ahead_;
  int64_t bs_, d_, steps_, blocks_, fed_ = 0;
};

#if defined(INFERD_AMX)
// attend_decode_pairs() on AMX tiles (head dims 64 and 128): the same softmax, both products on tiles, so the
// instruction count per key does not grow with the group's heads.
// - Scores, 16 keys at a time: C [16 keys, 16 heads] = A (the 16 key rows, 32 dims a tile: read in place where they
//   are one block's consecutive rows, else gathered) times B (the group's query pairs [dim pair, head], built once,
//   zero past G); each score sums the head dim's pairs 16 per instruction, in order; a head's 16 scores are its
//   column of C, times the scale.
// - Values, 32 keys at a time: C [16 heads, 16 dims] (4 tiles: 64 dims a pass) += A (probability pairs, pw's rows:
//   16 pairs of keys) times B (the 32 keys' value rows interleaved into pairs of keys, [key pair, dim]); then each
//   head's row times 1 / its sum.
// Tiles: C 0-3; A 4; B 5-7 (and 2, 3 for the scores' B at head dim 128).
template <int kJ>
void attend_decode_amx(const at::BFloat16* q, const at::BFloat16* k_head, const at::BFloat16* v_head,
                       const int64_t* table, int64_t n, int64_t bs, float scale, int64_t group, at::BFloat16* out,
                       LineVector<float>& buf, const inferd::DecodeAhead* ahead) {
  constexpr int64_t d = 32 * kJ;
  const int64_t n32 = (n + 31) / 32 * 32;
  // The next item's first keys into L2 over this item's scores, then its first pass over the values (AheadFeed). On
  // a 2-core Sapphire Rapids class Xeon, 32 rows x 30 layers from memory, each sequence's blocks in order: 150 / 250
  // / 500 keys 1.08x / 1.11x / 1.06x, shuffled blocks 1.00x; steps of 4-32 rows 1.02-1.04x; the same bits
  // (docs/performance.md, stop 49).
  AheadFeed feed(ahead, n, bs, d);
  buf.resize(inferd::attend_decode_scratch(n, group, d));
  float* scores = buf.data();                                    // [G, n32]
  auto* pw = reinterpret_cast<uint32_t*>(scores + group * n32);  // [16, n32 / 2]: rows past G read, not used
  const auto* kh = reinterpret_cast<const uint16_t*>(k_head);
  const auto* vh = reinterpret_cast<const uint16_t*>(v_head);
  const auto* qw = reinterpret_cast<const uint32_t*>(q);
  const int shift = __builtin_ctzll(uint64_t(bs));
  const auto row_at = [&](const uint16_t* head, int64_t t) {  // key t's row; past n, key 0's (probability 0)
    t = t < n ? t : 0;
    return head + (table[t >> shift] * bs + (t & (bs - 1))) * d;
  };
  inferd::amx_configure();
  alignas(64) uint32_t qb[kJ][16 * 16] = {};  // [pair, head] per 16 dim pairs
  for (int64_t g = 0; g < group; ++g)
    for (int64_t kk = 0; kk < d / 2; ++kk) qb[kk / 16][kk % 16 * 16 + g] = qw[g * (d / 2) + kk];
  alignas(64) uint16_t kg[16 * d];
  alignas(64) float cs[16 * 16];
  asm volatile("" ::: "memory");  // tile loads are asm that does not say it reads memory
  _tile_loadd(6, qb[0], 64);
  _tile_loadd(7, qb[1], 64);
  if constexpr (kJ == 4) {
    _tile_loadd(2, qb[2], 64);
    _tile_loadd(3, qb[3], 64);
  }
  for (int64_t t = 16; t < 48 && t < n; t += 16)
    if ((t & (bs - 1)) < 16) prefetch_block<kL1>(row_at(kh, t), std::min<int64_t>(16, n - t) * d * 2);
  const __m512i column = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                            _mm512_set1_epi32(16));
  const __m512 sc = _mm512_set1_ps(scale);
  for (int64_t t0 = 0; t0 < n; t0 += 16) {
    if (feed) feed(t0 / 16 + 1);
    if (t0 + 48 < n && ((t0 + 48) & (bs - 1)) < 16)
      prefetch_block<kL1>(row_at(kh, t0 + 48), std::min<int64_t>(16, n - t0 - 48) * d * 2);
    const uint16_t* a;
    if (bs >= 16 && t0 + 16 <= n) {
      a = row_at(kh, t0);
    } else {
      for (int i = 0; i < 16; ++i) std::memcpy(kg + i * d, row_at(kh, t0 + i), d * sizeof(uint16_t));
      asm volatile("" ::: "memory");
      a = kg;
    }
    _tile_zero(0);
    _tile_loadd(4, a, d * 2);
    _tile_dpbf16ps(0, 4, 6);
    _tile_loadd(4, a + 32, d * 2);
    _tile_dpbf16ps(0, 4, 7);
    if constexpr (kJ == 4) {
      _tile_loadd(4, a + 64, d * 2);
      _tile_dpbf16ps(0, 4, 2);
      _tile_loadd(4, a + 96, d * 2);
      _tile_dpbf16ps(0, 4, 3);
    }
    _tile_stored(0, cs, 64);
    asm volatile("" ::: "memory");
    for (int64_t g = 0; g < group; ++g) {
      const __m512 s16 = _mm512_i32gather_ps(_mm512_add_epi32(column, _mm512_set1_epi32(int32_t(g))), cs, 4);
      _mm512_storeu_ps(scores + g * n32 + t0, _mm512_mul_ps(s16, sc));
    }
  }
  float inv[kMaxG];
  softmax_pairs(scores, pw, n, group, inv);
  // Words of a pair of value rows a, b for 16 dims: (a[c], b[c]) in dim order, from 32 dims of each.
  alignas(64) uint16_t order[32];
  for (int i = 0; i < 16; ++i) {
    order[2 * i] = uint16_t(i);
    order[2 * i + 1] = uint16_t(32 + i);
  }
  const __m512i lo = _mm512_load_si512(order), hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
  for (int64_t t = bs; t < 3 * bs && t < n; t += bs) prefetch_block<kL1>(row_at(vh, t), std::min(bs, n - t) * d * 2);
  alignas(64) uint32_t vb[4][16 * 16];  // [dims 16 j .. 16 j + 15 of the pass][key pair, dim]
  alignas(64) float ob[16 * 64];
  for (int64_t c0 = 0; c0 < d; c0 += 64) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t tt0 = 0; tt0 < n32 / 2; tt0 += 16) {
      for (int64_t kk = 0; kk < 16; ++kk) {
        const int64_t t = 2 * (tt0 + kk);
        if (feed && c0 == 0 && (t & 15) == 0) feed(feed.steps() / 2 + t / 16 + 1);
        if ((t & (bs - 1)) == 0 && t + 3 * bs < n && c0 == 0)
          prefetch_block<kL1>(row_at(vh, t + 3 * bs), std::min(bs, n - t - 3 * bs) * d * 2);
        const uint16_t* a = row_at(vh, t) + c0;
        const uint16_t* b = row_at(vh, t + 1) + c0;
        for (int h = 0; h < 2; ++h) {
          const __m512i x = _mm512_loadu_si512(a + 32 * h), y = _mm512_loadu_si512(b + 32 * h);
          _mm512_store_si512(vb[2 * h] + kk * 16, _mm512_permutex2var_epi16(x, lo, y));
          _mm512_store_si512(vb[2 * h + 1] + kk * 16, _mm512_permutex2var_epi16(x, hi, y));
        }
      }
      asm volatile("" ::: "memory");
      _tile_loadd(4, pw + tt0, n32 / 2 * 4);
      _tile_loadd(5, vb[0], 64);
      _tile_dpbf16ps(0, 4, 5);
      _tile_loadd(6, vb[1], 64);
      _tile_dpbf16ps(1, 4, 6);
      _tile_loadd(7, vb[2], 64);
      _tile_dpbf16ps(2, 4, 7);
      _tile_loadd(5, vb[3], 64);
      _tile_dpbf16ps(3, 4, 5);
      asm volatile("" ::: "memory");  // vb is written again only after these loads
    }
    _tile_stored(0, ob, 256);
    _tile_stored(1, ob + 16, 256);
    _tile_stored(2, ob + 32, 256);
    _tile_stored(3, ob + 48, 256);
    asm volatile("" ::: "memory");
    for (int64_t g = 0; g < group; ++g)
      for (int64_t c = 0; c < 64; ++c) out[g * d + c0 + c] = at::BFloat16(ob[g * 64 + c] * inv[g]);
  }
}
#endif

template <int kJ>
void attend_decode_pairs(const at::BFloat16* q, const at::BFloat16* k_head, const at::BFloat16* v_head,
                         const int64_t* table, int64_t n, int64_t bs, float scale, int64_t group, at::BFloat16* out,
                         LineVector<float>& buf, const inferd::DecodeAhead* ahead) {
  constexpr int64_t d = 32 * kJ;
  const int64_t n32 = (n + 31) / 32 * 32, np = (n + 1) / 2;
  // The next item's first keys into L2 over this item's scores, then its values (AheadFeed). Decode attention over
  // 32 rows x 230 keys x 26 layers from memory, one process: in order 1.13-1.16x, shuffled blocks 1.24-1.31x; 500
  // keys 1.10x / 1.19x; the same bits (docs/performance.md, stop 42).
  AheadFeed feed(ahead, n, bs, d);
  buf.resize(inferd::attend_decode_scratch(n, group, d));
  float* scores = buf.data();                                          // [G, n32]
  auto* pw = reinterpret_cast<uint32_t*>(scores + group * n32);        // [G, n32 / 2] probability pairs
  const auto* kh = reinterpret_cast<const uint16_t*>(k_head);
  const auto* vh = reinterpret_cast<const uint16_t*>(v_head);
  const auto* qh = reinterpret_cast<const uint16_t*>(q);
  // Key t's row (t < n; past n, key 0's: any real row, whose probability is 0). bs is a power of two: a shift, not
  // a 64-bit division per row.
  const int shift = __builtin_ctzll(uint64_t(bs));
  const auto row_at = [&](const uint16_t* head, int64_t t) {
    t = t < n ? t : 0;
    return head + (table[t >> shift] * bs + (t & (bs - 1))) * d;
  };
  // The 16 keys 48 ahead of the 16 being scored are prefetched (at block size 16, three blocks in flight; two ahead
  // was up to 1.08x slower, docs/performance.md, stop 26); keys 16-47 before the loop, the first 16 are read at once.
  // (Under block size 16 a prefetch of 16 rows from a block's start runs past the block: wasted, not wrong.) The
  // value rows of the same keys go along (keys 0-47 before the loop), into L2, so that the values pass after the
  // softmax finds them there (1.05-1.2x on AMD Zen 4, stop 35). That pass still prefetches whole blocks ahead of it:
  // here only a block's first 16 rows are (block sizes over 16), and without it the pass was 0.90x.
  for (int64_t t = 0; t < 48 && t < n; t += 16)
    if ((t & (bs - 1)) < 16) {
      if (t) prefetch_block(row_at(kh, t), std::min<int64_t>(16, n - t) * d * 2);
      prefetch_block(row_at(vh, t), std::min<int64_t>(16, n - t) * d * 2);
    }
  // The scores of keys t0 .. t0 + 15 for every head of the group; row(i): key t0 + i's row.
  const auto score16 = [&](int64_t t0, auto row) {
    for (int64_t g = 0; g < group; ++g) {
      __m512 acc[16];
#pragma GCC unroll 16
      for (int i = 0; i < 16; ++i) acc[i] = _mm512_setzero_ps();
#pragma GCC unroll 4
      for (int j = 0; j < kJ; ++j) {
        const __m512bh qv = (__m512bh)_mm512_loadu_si512(qh + g * d + 32 * j);
#pragma GCC unroll 16
        for (int i = 0; i < 16; ++i) acc[i] = _mm512_dpbf16_ps(acc[i], (__m512bh)_mm512_loadu_si512(row(i) + 32 * j), qv);
      }
      _mm512_storeu_ps(scores + g * n32 + t0, _mm512_mul_ps(lane_sums16(acc), _mm512_set1_ps(scale)));
    }
  };
  for (int64_t t0 = 0; t0 < n; t0 += 16) {
    if (feed) feed(t0 / 16 + 1);
    if (t0 + 48 < n && ((t0 + 48) & (bs - 1)) < 16) {  // a block's first rows, 48 keys ahead, from wherever it is
      prefetch_block(row_at(kh, t0 + 48), std::min<int64_t>(16, n - t0 - 48) * d * 2);
      prefetch_block(row_at(vh, t0 + 48), std::min<int64_t>(16, n - t0 - 48) * d * 2);
    }
    if (bs >= 16 && t0 + 16 <= n) {  // 16 rows of one block: one address and fixed offsets (the same loads)
      const uint16_t* base = row_at(kh, t0);
      score16(t0, [base](int i) { return base + i * d; });
    } else {
      const uint16_t* rows[16];
#pragma GCC unroll 16
      for (int i = 0; i < 16; ++i) rows[i] = row_at(kh, t0 + i);
      score16(t0, [&rows](int i) { return rows[i]; });
    }
  }
  float inv[kMaxG];
  softmax_pairs(scores, pw, n, group, inv);
  const uint16_t* const v0 = row_at(vh, 0);  // key 0's row, the stand-in past n
  const auto vrows = [&](int64_t tt) {
    const int64_t t = 2 * tt;
    if (feed && (t & 15) == 0) feed(feed.steps() / 2 + t / 16 + 1);
    // Entering a block: fetch the third one after it meanwhile (t is even: at block size 1, every other block).
    if ((t & (bs - 1)) == 0 && t + 3 * bs < n)
      prefetch_block(row_at(vh, t + 3 * bs), std::min(bs, n - t - 3 * bs) * d * 2);
    const uint16_t* a = row_at(vh, t);
    const uint16_t* b = v0;
    if (t + 1 < n) b = bs >= 2 ? a + d : row_at(vh, t + 1);  // bs >= 2: the next row of t's block (t is even)
    return std::pair<const uint16_t*, const uint16_t*>(a, b);
  };
  for (int64_t t = bs; t < 3 * bs && t < n; t += bs)  // blocks 1 and 2: the loop starts 3 ahead
    prefetch_block(row_at(vh, t), std::min(bs, n - t) * d * 2);
  // Heads per pass over the values: up to kH x 2 kJ accumulators (20 or 16); a group that fits in one pass takes
  // exactly its heads (SmolLM2's 3 of 5: 40% fewer vdpbf16ps than repeating the last head, docs/performance.md,
  // stop 28). Each head's sums are their own chains, so the bits do not depend on the pass.
  constexpr int kH = kJ == 2 ? 5 : 2;
  const auto pass = [&](auto heads, int64_t g0) {
    constexpr int kP = decltype(heads)::value;
    __m512 acc[kP][2 * kJ];
    const uint32_t* rows[kP];  // heads past the group repeat its last one (their sums are not used)
    for (int h = 0; h < kP; ++h) rows[h] = pw + std::min<int64_t>(g0 + h, group - 1) * (n32 / 2);
    decode_values<kP, kJ>(rows, np, vrows, acc);
    for (int h = 0; h < kP && g0 + h < group; ++h) {
      at::BFloat16* o = out + (g0 + h) * d;
      alignas(64) float lanes[16];
      for (int v = 0; v < 2 * kJ; ++v) {
        _mm512_store_ps(lanes, acc[h][v]);
        const int64_t j = v / 2, hi = v % 2;
        for (int i = 0; i < 16; ++i) o[32 * j + 8 * (i / 4) + 4 * hi + i % 4] = at::BFloat16(lanes[i] * inv[g0 + h]);
      }
    }
  };
  switch (group < kH ? group : 0) {
    case 1: return pass(std::integral_constant<int, 1>{}, 0);
    case 2: return pass(std::integral_constant<int, 2>{}, 0);
    case 3: return pass(std::integral_constant<int, 3>{}, 0);
    case 4: return pass(std::integral_constant<int, 4>{}, 0);
    default:
      for (int64_t g0 = 0; g0 < group; g0 += kH) pass(std::integral_constant<int, kH>{}, g0);
  }
}
#endif

struct Item {
  int64_t row, rows, head, cost;  // rows == 0: a decode row
  int64_t run = -1;               // a prefill tile: its run of rows (shared value pairs)
};

template <typename T>
void run(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& block_tables,
         const at::Tensor& seq_idx, const at::Tensor& context_lens, int64_t num_decode, double scale, at::Tensor& out) {
  const int64_t num_rows = q.size(0), num_heads = q.size(1), d = q.size(2);
  const int64_t num_kv = k_cache.size(0), head_stride = k_cache.size(1) * k_cache.size(2) * d;
  const int64_t group = num_heads / num_kv, max_blocks = block_tables.size(1);
  const T* qp = q.data_ptr<T>();
  const T* kp = k_cache.data_ptr<T>();
  const T* vp = v_cache.data_ptr<T>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* seqs = seq_idx.data_ptr<int64_t>();
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  T* op = out.data_ptr<T>();
  const Shape shape{k_cache.size(2), float(scale)};
  const int64_t num_threads = at::get_num_threads();
  std::vector<Item> items;
  for (int64_t i = 0; i < num_decode; ++i)
    for (int64_t h = 0; h < num_kv; ++h) items.push_back({i, 0, h, lens[i]});
  struct Run {
    int64_t seq, keys;  // per prefill run: its sequence, and the keys in whole chunks that its longest row sees
  };
  std::vector<Run> runs;
  const std::vector<inferd::PrefillTile> tiles =
      inferd::prefill_tiles(seqs, lens, num_decode, num_rows, num_kv, num_threads);
  for (size_t i = 0; i < tiles.size(); ++i) {
    const inferd::PrefillTile& t = tiles[i];
    for (int64_t h = 0; h < num_kv; ++h)
      items.push_back({t.row, t.rows, h, t.rows * lens[t.row + t.rows - 1], t.run});
    if (i + 1 == tiles.size() || tiles[i + 1].run != t.run) {  // the run's last tile: its keys shared if it has several
      const bool several = i > 0 && tiles[i - 1].run == t.run;
      runs.push_back({seqs[t.row], several ? lens[t.row + t.rows - 1] / kKeyChunk * kKeyChunk : 0});
    }
  }
  // Runs of several tiles on AMX: each KV head's values in pairs of keys, whole chunks, built once here where every
  // tile of the run re-laid them per chunk before (the same words; stop 31).
  std::vector<LineVector<uint32_t>> shared(runs.size() * num_kv);
#if defined(INFERD_AMX)
  if constexpr (std::is_same_v<T, at::BFloat16>) {
    if (inferd::amx_pairs() && d % 32 == 0) {
      std::vector<std::array<int64_t, 3>> tasks;  // (run, head, chunk)
      for (int64_t r = 0; r < int64_t(runs.size()); ++r)
        for (int64_t h = 0; h < num_kv; ++h) {
          shared[r * num_kv + h].resize(runs[r].keys / 2 * d);
          for (int64_t c0 = 0; c0 < runs[r].keys; c0 += kKeyChunk) tasks.push_back({r, h, c0});
        }
      at::parallel_for(0, int64_t(tasks.size()), 1, [&](int64_t begin, int64_t end) {
        for (int64_t i = begin; i < end; ++i) {
          const auto [r, h, c0] = tasks[i];
          const T* v_head = vp + h * head_stride;
          const int64_t* table = tables + runs[r].seq * max_blocks;
          const int64_t bs = shape.block_size;
          pair_values([&](int64_t t) {
            const int64_t pos = c0 + t;
            return v_head + (table[pos / bs] * bs + pos % bs) * d;
          }, kKeyChunk, kKeyChunk / 2, d, shared[r * num_kv + h].data() + c0 / 2 * d);
        }
      });
    }
  }
#endif
  std::stable_sort(items.begin(), items.end(), [](const Item& a, const Item& b) { return a.cost > b.cost; });
  std::atomic<int64_t> next{0};
  const int64_t total = static_cast<int64_t>(items.size());
  at::parallel_for(0, std::min(num_threads, total), 1, [&](int64_t begin, int64_t end) {
    LineVector<float> scores;
    TileBuffers buf;
#if defined(INFERD_BF16_PAIRS)
    PairBuffers pbuf;
#endif
    for (int64_t tid = begin; tid < end; ++tid) {
      // A decode item takes the item its thread computes next from the counter at once, while more items remain
      // than threads, so that it can prefetch that one's rows while it computes (inferd::DecodeAhead); otherwise
      // (prefill tiles, the last items) the next is taken when this one is done, so the threads finish together.
      int64_t w_next = total;
      for (int64_t w = next++; w < total; w = w_next < total ? w_next : next++) {
        w_next = items[w].rows == 0 && total - next.load() > num_threads ? next++ : total;
        const Item& it = items[w];
        const int64_t table_off = seqs[it.row] * max_blocks;
        if (it.rows == 0) {
          const int64_t off = (it.row * num_heads + it.head * group) * d;
          inferd::DecodeAhead ahead{};
          const bool has_ahead = w_next < total && items[w_next].rows == 0;
          if (has_ahead) {
            const Item& nx = items[w_next];
            ahead = {kp + nx.head * head_stride, vp + nx.head * head_stride, tables + seqs[nx.row] * max_blocks,
                     lens[nx.row]};
          }
          inferd::attend_decode(qp + off, kp + it.head * head_stride, vp + it.head * head_stride, tables + table_off,
                                lens[it.row], shape.block_size, shape.scale, d, group, op + off, scores,
                                has_ahead ? &ahead : nullptr);
        } else {
#if defined(INFERD_BF16_PAIRS)
          if constexpr (std::is_same_v<T, at::BFloat16>) {
            const LineVector<uint32_t>& sp = shared[it.run * num_kv + it.head];
            attend_tile_pairs(qp, kp + it.head * head_stride, vp + it.head * head_stride, tables + table_off, lens,
                              it.row, it.rows, num_heads, it.head, group, d, shape, op, pbuf, sp.data(),
                              int64_t(sp.size() / d * 2));
            continue;
          }
#endif
          attend_tile(qp, kp + it.head * head_stride, vp + it.head * head_stride, tables + table_off, lens, it.row,
                      it.rows, num_heads, it.head, group, d, shape, op, buf);
        }
      }
    }
  });
}

}  // namespace

namespace inferd {

// A decode row: q [G, D] of one sequence; k_head, v_head: this KV head's [num_blocks, block_size, D]; table: the
// sequence's block ids; n: its context length in tokens; out: [G, D]. The query heads go in groups of up to 3,
// each group scoring 4 keys at a time (12 FMA chains), then summing 32 value dims at a time.
template <typename T>
INFERD_SHARED void attend_decode(const T* q, const T* k_head, const T* v_head, const int64_t* table, int64_t n,
                                 int64_t bs, float scale, int64_t d, int64_t group, T* out, LineVector<float>& buf,
                                 const DecodeAhead* ahead) {
#if defined(INFERD_BF16_PAIRS)
  if constexpr (std::is_same_v<T, at::BFloat16>) {
#if defined(INFERD_AMX)
    if (amx_pairs()) {
      if (d == 64) return attend_decode_amx<2>(q, k_head, v_head, table, n, bs, scale, group, out, buf, ahead);
      if (d == 128) return attend_decode_amx<4>(q, k_head, v_head, table, n, bs, scale, group, out, buf, ahead);
    }
#endif
    if (d == 64) return attend_decode_pairs<2>(q, k_head, v_head, table, n, bs, scale, group, out, buf, ahead);
    if (d == 128) return attend_decode_pairs<4>(q, k_head, v_head, table, n, bs, scale, group, out, buf, ahead);
  }
#endif
  const int64_t n8 = (n + 7) / 8 * 8;
  buf.resize(attend_decode_scratch(n, group, d));
  float* scores = buf.data();  // [G, n8]
  float* qf = scores + group * n8;  // [G, d]
  float* acc = qf + group * d;  // [G, d]
  for (int64_t g = 0; g < group; ++g) {
    to_float_row(q + g * d, qf + g * d, d);
    for (int64_t k = 0; k < d; ++k) qf[g * d + k] *= scale;
  }
  for (int64_t g0 = 0; g0 < group; g0 += 3) {
    const int64_t nh = std::min<int64_t>(3, group - g0);
    float* sg = scores + g0 * n8;
    auto* fn = d == 64 ? (nh == 3 ? &scores_of_heads<T, 3, 64> : nh == 2 ? &scores_of_heads<T, 2, 64>
                                                                  : &scores_of_heads<T, 1, 64>)
                       : (nh == 3 ? &scores_of_heads<T, 3, 0> : nh == 2 ? &scores_of_heads<T, 2, 0>
                                                                 : &scores_of_heads<T, 1, 0>);
    fn(qf + g0 * d, k_head, table, n, bs, d, sg, n8);
  }
  float inv[kMaxG];
  for (int64_t g = 0; g < group; ++g) {
    float* sc = scores + g * n8;
    const float mx = max_and_pad(sc, n, n8);
    v8 sum = splat(0.f);
    for (int64_t t = 0; t < n8; t += 8) {
      const v8 e = exp8(load8(sc + t) - splat(mx));
      store8(sc + t, e);
      sum += e;
    }
    inv[g] = 1.f / hsum(sum);
  }
  std::fill(acc, acc + group * d, 0.f);
  for (int64_t g0 = 0; g0 < group; g0 += 3) {
    const int64_t nh = std::min<int64_t>(3, group - g0);
    auto* fn = d == 64 ? (nh == 3 ? &values_of_heads<T, 3, 64> : nh == 2 ? &values_of_heads<T, 2, 64>
                                                                  : &values_of_heads<T, 1, 64>)
                       : (nh == 3 ? &values_of_heads<T, 3, 0> : nh == 2 ? &values_of_heads<T, 2, 0>
                                                                 : &values_of_heads<T, 1, 0>);
    fn(scores + g0 * n8, n8, v_head, table, n, bs, d, acc + g0 * d);
  }
  for (int64_t g = 0; g < group; ++g)
    for (int64_t k = 0; k < d; ++k) out[g * d + k] = T(acc[g * d + k] * inv[g]);
}

std::vector<PrefillTile> prefill_tiles(const int64_t* seqs, const int64_t* lens, int64_t first, int64_t num_rows,
                                       int64_t num_kv, int64_t num_threads) {
  std::vector<PrefillTile> tiles;
  for (int64_t i = first, run = 0; i < num_rows; ++run) {
    int64_t j = i + 1;
    while (j < num_rows && seqs[j] == seqs[i] && lens[j] == lens[j - 1] + 1) ++j;
    const int64_t run_len = j - i;
    const int64_t min_tiles = std::min(run_len, (2 * num_threads + num_kv - 1) / num_kv);
    const int64_t n_tiles = std::max((run_len + kMaxTile - 1) / kMaxTile, min_tiles);
    const int64_t tile = (run_len + n_tiles - 1) / n_tiles;
    for (int64_t r = i; r < j; r += tile) tiles.push_back({r, std::min(tile, j - r), run});
    i = j;
  }
  return tiles;
}

struct PrefillScratch::Buffers {
#if defined(INFERD_BF16_PAIRS)
  PairBuffers pairs;
#else
  TileBuffers tile;
#endif
};
PrefillScratch::PrefillScratch() : buffers(new Buffers) {}
PrefillScratch::PrefillScratch(PrefillScratch&&) noexcept = default;
PrefillScratch::~PrefillScratch() = default;

void attend_prefill_tile(const at::BFloat16* q, const at::BFloat16* k_head, const at::BFloat16* v_head,
                         const int64_t* table, const int64_t* lens, int64_t r0, int64_t n_rows, int64_t num_heads,
                         int64_t h, int64_t group, int64_t d, int64_t block_size, float scale, at::BFloat16* out,
                         PrefillScratch& scratch) {
  const Shape shape{block_size, scale};
#if defined(INFERD_BF16_PAIRS)  // as run() picks the kernel for BF16
  attend_tile_pairs(q, k_head, v_head, table, lens, r0, n_rows, num_heads, h, group, d, shape, out,
                    scratch.buffers->pairs);
#else
  attend_tile(q, k_head, v_head, table, lens, r0, n_rows, num_heads, h, group, d, shape, out, scratch.buffers->tile);
#endif
}

void check_attention_indices(const int64_t* seq_idx, const int64_t* context_lens, int64_t rows,
                             const int64_t* block_tables, int64_t num_seqs, int64_t max_blocks, int64_t num_blocks,
                             int64_t block_size) {
  for (int64_t i = 0; i < rows; ++i) {
    TORCH_CHECK(seq_idx[i] >= 0 && seq_idx[i] < num_seqs, "sequence indices must be in [0, block_tables.size(0))");
    TORCH_CHECK(context_lens[i] >= 1 && context_lens[i] <= max_blocks * block_size,
                "context lengths must be in [1, max_blocks * block_size]");
  }
  for (int64_t i = 0; i < num_seqs * max_blocks; ++i)
    TORCH_CHECK(block_tables[i] >= 0 && block_tables[i] < num_blocks, "block ids must be in [0, num_blocks)");
}

template void attend_decode<float>(const float*, const float*, const float*, const int64_t*, int64_t, int64_t, float,
                                   int64_t, int64_t, float*, LineVector<float>&, const DecodeAhead*);
template void attend_decode<at::BFloat16>(const at::BFloat16*, const at::BFloat16*, const at::BFloat16*,
                                          const int64_t*, int64_t, int64_t, float, int64_t, int64_t, at::BFloat16*,
                                          LineVector<float>&, const DecodeAhead*);

}  // namespace inferd

// q: [T, Hq, D] contiguous (D a multiple of 8), one row per query token, the first num_decode of them decode rows
// (attend_decode()), the others prefill rows (attend_tile()); k_cache, v_cache: [Hkv, num_blocks, block_size, D] contiguous
// (block_size a power of two), q's dtype (float32 or bfloat16); block_tables: [S, max_blocks] int64 block ids of the
// step's sequences; seq_idx: [T] int64, each row's sequence (a row of block_tables); context_lens: [T] int64, the
// keys each row attends over (its position + 1; 1 <= len <= max_blocks * block_size). Returns [T, Hq, D]. Shapes,
// sequence indices, lengths and block ids are checked, so no input reads outside the cache.
at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                           const at::Tensor& block_tables, const at::Tensor& seq_idx, const at::Tensor& context_lens,
                           int64_t num_decode, double scale) {
  TORCH_CHECK(q.device().is_cpu() && q.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(),
              "paged_attention: CPU q [T, Hq, D] and caches [Hkv, blocks, block_size, D]");
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous(), "contiguous tensors");
  TORCH_CHECK(k_cache.scalar_type() == q.scalar_type() && v_cache.scalar_type() == q.scalar_type(), "one dtype");
  TORCH_CHECK(q.size(2) == k_cache.size(3) && q.size(1) % k_cache.size(0) == 0 && q.size(2) <= kMaxD &&
              q.size(1) / k_cache.size(0) <= kMaxG, "head shapes");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && seq_idx.scalar_type() == at::kLong &&
              context_lens.scalar_type() == at::kLong && block_tables.dim() == 2, "int64 tables");
  TORCH_CHECK(seq_idx.numel() == q.size(0) && context_lens.numel() == q.size(0), "one sequence and length per row");
  TORCH_CHECK(num_decode >= 0 && num_decode <= q.size(0) && q.size(2) % 8 == 0, "num_decode in [0, T], D % 8 == 0");
  TORCH_CHECK(k_cache.size(2) > 0 && (k_cache.size(2) & (k_cache.size(2) - 1)) == 0, "block size: a power of two");
  auto tables = block_tables.contiguous();
  auto seqs = seq_idx.contiguous();
  auto lens = context_lens.contiguous();
  // Checked over the raw int64 arrays (no tensor ops: this runs in every layer).
  inferd::check_attention_indices(seqs.data_ptr<int64_t>(), lens.data_ptr<int64_t>(), lens.numel(),
                                  tables.data_ptr<int64_t>(), tables.size(0), tables.size(1), k_cache.size(1),
                                  k_cache.size(2));
  auto out = at::empty_like(q);
  if (q.size(0) == 0) return out;
  if (q.scalar_type() == at::kBFloat16) {
    run<at::BFloat16>(q, k_cache, v_cache, tables, seqs, lens, num_decode, scale, out);
  } else {
    TORCH_CHECK(q.scalar_type() == at::kFloat, "float32 or bfloat16");
    run<float>(q, k_cache, v_cache, tables, seqs, lens, num_decode, scale, out);
  }
  return out;
}
