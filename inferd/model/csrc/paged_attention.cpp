// Causal attention over a paged KV cache for every query row of a step, decode and prefill, reading the key and
// value rows where they are in the cache (PagedAttention, Kwon et al. 2023, arXiv:2309.06180) instead of gathering
// each sequence's blocks first. A query row is the token at position p of a sequence: it attends over that
// sequence's keys 0..p (its context length p + 1), which makes a prefill chunk's causal mask implicit.
//
// Decode rows: one work item per (row, KV head); the G query heads that share the KV head score every key in FP32,
// take a softmax, then sum the value rows (attend()).
//
// Prefill rows: consecutive rows of one sequence go in tiles of up to kMaxTile rows, one work item per (tile, KV
// head). The tile's keys are converted to FP32 once per chunk of kKeyChunk keys (transposed for the scores) and
// used by every row of the tile; the scores are a register-blocked outer product (Goto & van de Geijn 2008) in
// which each score is one FMA chain over the head dimension in order, the softmax is taken per row over its own
// keys, and each output element is one FMA chain over the row's keys in order. So a row's bits depend only on its
// query and its keys: not on the tile it lands in, the other rows, the chunking of its prompt or the batch
// (tests/test_kernels.py). Softmax: two passes over the scores, FP32, as in attend().
//
// Every item runs the same code whatever else is in the batch (compiled once per machine with -ffast-math: the
// order of each sum is fixed in the binary, vectorised, with glibc's vector expf); items are taken from a shared
// counter, largest first, so the threads finish together.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

inline void to_float_row(const float* src, float* dst, int64_t d) { std::memcpy(dst, src, d * sizeof(float)); }

inline void to_float_row(const at::BFloat16* src, float* dst, int64_t d) {
  const uint16_t* s = reinterpret_cast<const uint16_t*>(src);
  for (int64_t k = 0; k < d; ++k) {
    const uint32_t u = uint32_t(s[k]) << 16;  // a BF16 is the top half of an FP32
    std::memcpy(dst + k, &u, sizeof(u));
  }
}

struct Shape {
  int64_t block_size;
  float scale;
};

constexpr int64_t kMaxD = 256, kMaxG = 16;

// 8 FP32 lanes (an AVX2 register; two NEON registers). Arithmetic on it is element-wise, and with -ffast-math
// `a += b * c` is one FMA per lane.
typedef float v8 __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));

inline v8 load8(const float* p) {
  v8 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
inline void store8(float* p, v8 v) { std::memcpy(p, &v, sizeof(v)); }
inline v8 splat(float x) { return v8{x, x, x, x, x, x, x, x}; }

// e^x per lane, for x <= 0 (softmax arguments): x = n ln 2 + r with |r| <= ln 2 / 2 (Cody & Waite's two-part
// ln 2), e^r by its Taylor polynomial to degree 7 (truncation error below 2^-24 on that interval), times 2^n built
// in the exponent bits; 0 below -86 (e^-86 = 4e-38, near the end of the normal range) and for -inf. e^0 is exactly
// 1. The same operations on every lane, so a value's result does not depend on its lane or its neighbours.
inline v8 exp8(v8 x) {
  const v8 t = x * splat(1.44269504f);
  const v8i n = __builtin_convertvector(t + (t < splat(0.f) ? splat(-0.5f) : splat(0.5f)), v8i);
  const v8 nf = __builtin_convertvector(n, v8);
  const v8 r = (x - nf * splat(0.693359375f)) + nf * splat(2.12194440e-4f);
  v8 p = splat(1.f / 5040.f);
  p = p * r + splat(1.f / 720.f);
  p = p * r + splat(1.f / 120.f);
  p = p * r + splat(1.f / 24.f);
  p = p * r + splat(1.f / 6.f);
  p = p * r + splat(0.5f);
  p = p * r + splat(1.f);
  p = p * r + splat(1.f);
  v8i bits;
  std::memcpy(&bits, &p, sizeof(bits));
  bits += n << 23;
  v8 y;
  std::memcpy(&y, &bits, sizeof(y));
  return x < splat(-86.f) ? splat(0.f) : y;
}

// Calls fn(t, row) for each token t < n of a sequence, row being its [d] key or value row in FP32, walking
// the sequence's blocks in order (no division per token).
template <typename T, typename Fn>
inline void for_each_row(const T* head, const int64_t* table, int64_t n, int64_t bs, int64_t d, float* row, Fn&& fn) {
  for (int64_t t0 = 0, b = 0; t0 < n; t0 += bs, ++b) {
    const T* block = head + table[b] * bs * d;
    const int64_t m = std::min(bs, n - t0);
    for (int64_t j = 0; j < m; ++j) {
      to_float_row(block + j * d, row, d);
      fn(t0 + j, row);
    }
  }
}

// q: [G, D] of one sequence; k_head, v_head: this KV head's [num_blocks, block_size, D]; table: the sequence's
// block ids; n: its context length in tokens; out: [G, D]. D and G are compile-time for the common shapes
// (fully unrolled, the accumulators in registers), 0 = given at run time in d_rt and g_rt.
template <typename T, int64_t kD, int64_t kG>
void attend(const T* q, const T* k_head, const T* v_head, const int64_t* table, int64_t n, const Shape& s,
            int64_t d_rt, int64_t g_rt, T* out, std::vector<float>& scores_buf) {
  const int64_t d = kD ? kD : d_rt, group = kG ? kG : g_rt, bs = s.block_size;
  alignas(64) float qf[kD ? kG * kD : kMaxG * kMaxD];
  alignas(64) float acc[kD ? kG * kD : kMaxG * kMaxD];
  alignas(64) float row[kD ? kD : kMaxD];
  const int64_t n8 = (n + 7) / 8 * 8;
  scores_buf.resize(group * n8);
  float* __restrict__ scores = scores_buf.data();  // [G, n8]
  for (int64_t g = 0; g < group; ++g) {
    to_float_row(q + g * d, qf + g * d, d);
    for (int64_t k = 0; k < d; ++k) qf[g * d + k] *= s.scale;
  }
  for_each_row(k_head, table, n, bs, d, row, [&](int64_t t, const float* r) {
    for (int64_t g = 0; g < group; ++g) {
      float dot = 0.f;
      for (int64_t k = 0; k < d; ++k) dot += qf[g * d + k] * r[k];
      scores[g * n8 + t] = dot;
    }
  });
  float inv[kG ? kG : kMaxG];
  for (int64_t g = 0; g < group; ++g) {
    float* sc = scores + g * n8;
    float mx = -std::numeric_limits<float>::infinity();
    for (int64_t t = 0; t < n; ++t) mx = std::max(mx, sc[t]);
    std::fill(sc + n, sc + n8, -std::numeric_limits<float>::infinity());  // e^-inf = 0
    v8 sum = splat(0.f);
    for (int64_t t = 0; t < n8; t += 8) {
      const v8 e = exp8(load8(sc + t) - splat(mx));
      store8(sc + t, e);
      sum += e;
    }
    inv[g] = 1.f / (((sum[0] + sum[1]) + (sum[2] + sum[3])) + ((sum[4] + sum[5]) + (sum[6] + sum[7])));
  }
  std::fill(acc, acc + group * d, 0.f);
  for_each_row(v_head, table, n, bs, d, row, [&](int64_t t, const float* r) {
    for (int64_t g = 0; g < group; ++g) {
      const float p = scores[g * n8 + t];
      for (int64_t k = 0; k < d; ++k) acc[g * d + k] += p * r[k];
    }
  });
  for (int64_t g = 0; g < group; ++g)
    for (int64_t k = 0; k < d; ++k) out[g * d + k] = T(acc[g * d + k] * inv[g]);
}


constexpr int64_t kKeyChunk = 256;  // keys per online-softmax step, converted to FP32 at a time
constexpr int64_t kMaxTile = 32;    // prefill rows per work item
constexpr int64_t kMaxQ = kMaxTile * kMaxG;

// Layout of a prefill tile's work: the tile's R rows x G heads are its "queries", qi = r * G + g, padded to a
// multiple of 8 (QP) and held transposed ([d, QP]) so that 8 queries fill a vector. Scores and probabilities are
// [kKeyChunk, QP], the output accumulator [d, QP].

// scores[t, q0 + 8 j + l] for the 4 keys t0 .. t0 + 3 and j < kQ: each one FMA chain over d of
// qT[k, q] * kb[t, k] (kb: the chunk's keys, [kKeyChunk, d] FP32).
template <int kQ>
inline void score_tile(const float* qT, int64_t qp, const float* kb, int64_t d, int64_t t0, int64_t q0,
                       float* scores) {
  v8 acc[4][kQ];
  for (int i = 0; i < 4; ++i)
    for (int j = 0; j < kQ; ++j) acc[i][j] = splat(0.f);
  const float* k0 = kb + t0 * d;
  for (int64_t k = 0; k < d; ++k) {
    v8 qv[kQ];
    for (int j = 0; j < kQ; ++j) qv[j] = load8(qT + k * qp + q0 + 8 * j);
    for (int i = 0; i < 4; ++i) {
      const v8 kv = splat(k0[i * d + k]);
      for (int j = 0; j < kQ; ++j) acc[i][j] += qv[j] * kv;
    }
  }
  for (int i = 0; i < 4; ++i)
    for (int j = 0; j < kQ; ++j) store8(scores + (t0 + i) * qp + q0 + 8 * j, acc[i][j]);
}

// accT[c, q0 + 8 j + l] for the 4 dims c0 .. c0 + 3 and j < kQ (FP32) += sum over t < m, in order, of
// vb[t, c] * probs[t, q] (vb: the chunk's values, [kKeyChunk, d] FP32). Each output element is one FMA chain.
template <int kQ>
inline void pv_tile(const float* probs, int64_t qp, const float* vb, int64_t d, int64_t m, int64_t c0, int64_t q0,
                    float* accT) {
  v8 acc[4][kQ];
  for (int i = 0; i < 4; ++i)
    for (int j = 0; j < kQ; ++j) acc[i][j] = load8(accT + (c0 + i) * qp + q0 + 8 * j);
  for (int64_t t = 0; t < m; ++t) {
    v8 pv[kQ];
    for (int j = 0; j < kQ; ++j) pv[j] = load8(probs + t * qp + q0 + 8 * j);
    for (int i = 0; i < 4; ++i) {
      const v8 vv = splat(vb[t * d + c0 + i]);
      for (int j = 0; j < kQ; ++j) acc[i][j] += pv[j] * vv;
    }
  }
  for (int i = 0; i < 4; ++i)
    for (int j = 0; j < kQ; ++j) store8(accT + (c0 + i) * qp + q0 + 8 * j, acc[i][j]);
}

// Rows c0 .. c0 + m - 1 of one KV head's keys or values into FP32 [m_pad, d], rows m .. m_pad - 1 zero.
template <typename T>
void load_chunk(const T* head, const int64_t* table, int64_t bs, int64_t d, int64_t c0, int64_t m, int64_t m_pad,
                float* dst) {
  for (int64_t t = 0; t < m; ++t) {
    const int64_t pos = c0 + t;
    to_float_row(head + (table[pos / bs] * bs + pos % bs) * d, dst + t * d, d);
  }
  std::fill(dst + m * d, dst + m_pad * d, 0.f);
}

struct TileBuffers {
  std::vector<float> qT, probs, accT, kb, vb;
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
    const int64_t m = std::min(kKeyChunk, n_max - c0), m4 = (m + 3) / 4 * 4;
    load_chunk(k_head, table, s.block_size, d, c0, m, m4, buf.kb.data());
    for (int64_t t0 = 0; t0 < m4; t0 += 4) {
      int64_t q0 = 0;
      for (; q0 + 24 <= qp; q0 += 24) score_tile<3>(qT, qp, buf.kb.data(), d, t0, q0, probs);
      if (qp - q0 == 16) score_tile<2>(qT, qp, buf.kb.data(), d, t0, q0, probs);
      else if (qp - q0 == 8) score_tile<1>(qT, qp, buf.kb.data(), d, t0, q0, probs);
    }
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
    for (int64_t c = 0; c < d; c += 4) {  // d is a multiple of 8
      int64_t q0 = 0;
      for (; q0 + 24 <= qp; q0 += 24) pv_tile<3>(probs, qp, buf.vb.data(), d, m, c, q0, accT);
      if (qp - q0 == 16) pv_tile<2>(probs, qp, buf.vb.data(), d, m, c, q0, accT);
      else if (qp - q0 == 8) pv_tile<1>(probs, qp, buf.vb.data(), d, m, c, q0, accT);
    }
  }
  for (int64_t i = 0; i < nq; ++i) {
    const int64_t r = i / group, g = i % group;
    const float inv = 1.f / run_sum[i];
    T* o = out + ((r0 + r) * num_heads + h * group + g) * d;
    for (int64_t k = 0; k < d; ++k) o[k] = T(accT[k * qp + i] * inv);
  }
}

struct Item {
  int64_t row, rows, head, cost;  // rows == 0: a decode row
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
  auto* fn = (d == 64 && group == 3) ? &attend<T, 64, 3> : (d == 64 && group == 1) ? &attend<T, 64, 1>
           : (d == 128 && group == 4) ? &attend<T, 128, 4> : &attend<T, 0, 0>;
  const int64_t num_threads = at::get_num_threads();
  std::vector<Item> items;
  for (int64_t i = 0; i < num_decode; ++i)
    for (int64_t h = 0; h < num_kv; ++h) items.push_back({i, 0, h, lens[i]});
  // Prefill runs: consecutive rows of one sequence at consecutive positions, split into tiles of at most kMaxTile
  // rows, and into at least enough tiles that every thread gets work.
  for (int64_t i = num_decode; i < num_rows;) {
    int64_t j = i + 1;
    while (j < num_rows && seqs[j] == seqs[i] && lens[j] == lens[j - 1] + 1) ++j;
    const int64_t run_len = j - i;
    const int64_t min_tiles = std::min(run_len, (2 * num_threads + num_kv - 1) / num_kv);
    const int64_t n_tiles = std::max((run_len + kMaxTile - 1) / kMaxTile, min_tiles);
    const int64_t tile = (run_len + n_tiles - 1) / n_tiles;
    for (int64_t r = i; r < j; r += tile) {
      const int64_t n = std::min(tile, j - r);
      for (int64_t h = 0; h < num_kv; ++h) items.push_back({r, n, h, n * lens[r + n - 1]});
    }
    i = j;
  }
  std::stable_sort(items.begin(), items.end(), [](const Item& a, const Item& b) { return a.cost > b.cost; });
  std::atomic<int64_t> next{0};
  const int64_t total = static_cast<int64_t>(items.size());
  at::parallel_for(0, std::min(num_threads, total), 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    TileBuffers buf;
    for (int64_t tid = begin; tid < end; ++tid) {
      for (int64_t w = next++; w < total; w = next++) {
        const Item& it = items[w];
        const int64_t table_off = seqs[it.row] * max_blocks;
        if (it.rows == 0) {
          const int64_t off = (it.row * num_heads + it.head * group) * d;
          fn(qp + off, kp + it.head * head_stride, vp + it.head * head_stride, tables + table_off, lens[it.row], shape,
             d, group, op + off, scores);
        } else {
          attend_tile(qp, kp + it.head * head_stride, vp + it.head * head_stride, tables + table_off, lens, it.row,
                      it.rows, num_heads, it.head, group, d, shape, op, buf);
        }
      }
    }
  });
}

}  // namespace

// q: [T, Hq, D] contiguous, one row per query token, the first num_decode of them decode rows (attend()), the others
// prefill rows (attend_tile()); k_cache, v_cache: [Hkv, num_blocks, block_size, D] contiguous,
// q's dtype (float32 or bfloat16); block_tables: [S, max_blocks] int64 block ids of the step's sequences; seq_idx: [T]
// int64, each row's sequence (a row of block_tables); context_lens: [T] int64, the keys each row attends over (its
// position + 1; 1 <= len <= max_blocks * block_size). Returns [T, Hq, D]. Shapes, sequence indices, lengths and
// block ids are checked, so no input reads outside the cache.
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
  auto tables = block_tables.contiguous();
  auto seqs = seq_idx.contiguous();
  auto lens = context_lens.contiguous();
  const int64_t cap = tables.size(1) * k_cache.size(2);
  // Checked over the raw int64 arrays (no tensor ops: this runs in every layer).
  const int64_t* lp = lens.data_ptr<int64_t>();
  const int64_t* sp = seqs.data_ptr<int64_t>();
  for (int64_t i = 0; i < lens.numel(); ++i) {
    TORCH_CHECK(sp[i] >= 0 && sp[i] < tables.size(0), "sequence indices must be in [0, block_tables.size(0))");
    TORCH_CHECK(lp[i] >= 1 && lp[i] <= cap, "context lengths must be in [1, max_blocks * block_size]");
  }
  const int64_t* tp = tables.data_ptr<int64_t>();
  for (int64_t i = 0; i < tables.numel(); ++i)
    TORCH_CHECK(tp[i] >= 0 && tp[i] < k_cache.size(1), "block ids must be in [0, num_blocks)");
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
