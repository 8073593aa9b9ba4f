// Decode attention over a paged KV cache, reading the key and value rows where they are in the cache
// (PagedAttention, Kwon et al. 2023, arXiv:2309.06180) instead of gathering each sequence's blocks first.
//
// One work item per (sequence, KV head): the G query heads that share the KV head score every key of the
// sequence's context in FP32, take a softmax, then sum the value rows. Each item runs the same code whatever
// else is in the batch, so a sequence's result does not depend on the batch (compiled once per machine with
// -ffast-math: the order of each sum is fixed in the binary, vectorised, with glibc's vector expf).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
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
  scores_buf.resize(group * n);
  float* __restrict__ scores = scores_buf.data();  // [G, n]
  for (int64_t g = 0; g < group; ++g) {
    to_float_row(q + g * d, qf + g * d, d);
    for (int64_t k = 0; k < d; ++k) qf[g * d + k] *= s.scale;
  }
  for_each_row(k_head, table, n, bs, d, row, [&](int64_t t, const float* r) {
    for (int64_t g = 0; g < group; ++g) {
      float dot = 0.f;
      for (int64_t k = 0; k < d; ++k) dot += qf[g * d + k] * r[k];
      scores[g * n + t] = dot;
    }
  });
  float inv[kG ? kG : kMaxG];
  for (int64_t g = 0; g < group; ++g) {
    float* sc = scores + g * n;
    float mx = -std::numeric_limits<float>::infinity();
    for (int64_t t = 0; t < n; ++t) mx = std::max(mx, sc[t]);
    float sum = 0.f;
    for (int64_t t = 0; t < n; ++t) {
      sc[t] = std::exp(sc[t] - mx);
      sum += sc[t];
    }
    inv[g] = 1.f / sum;
  }
  std::fill(acc, acc + group * d, 0.f);
  for_each_row(v_head, table, n, bs, d, row, [&](int64_t t, const float* r) {
    for (int64_t g = 0; g < group; ++g) {
      const float p = scores[g * n + t];
      for (int64_t k = 0; k < d; ++k) acc[g * d + k] += p * r[k];
    }
  });
  for (int64_t g = 0; g < group; ++g)
    for (int64_t k = 0; k < d; ++k) out[g * d + k] = T(acc[g * d + k] * inv[g]);
}

template <typename T>
void run(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
         const at::Tensor& block_tables, const at::Tensor& context_lens, double scale, at::Tensor& out) {
  const int64_t num_seqs = q.size(0), num_heads = q.size(1), d = q.size(2);
  const int64_t num_kv = k_cache.size(0), head_stride = k_cache.size(1) * k_cache.size(2) * d;
  const int64_t group = num_heads / num_kv, max_blocks = block_tables.size(1);
  const T* qp = q.data_ptr<T>();
  const T* kp = k_cache.data_ptr<T>();
  const T* vp = v_cache.data_ptr<T>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  T* op = out.data_ptr<T>();
  const Shape shape{k_cache.size(2), float(scale)};
  at::parallel_for(0, num_seqs * num_kv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> buf;
    for (int64_t w = begin; w < end; ++w) {
      const int64_t i = w / num_kv, h = w % num_kv;
      const int64_t off = (i * num_heads + h * group) * d;
      auto* fn = (d == 64 && group == 3) ? &attend<T, 64, 3> : (d == 64 && group == 1) ? &attend<T, 64, 1>
               : (d == 128 && group == 4) ? &attend<T, 128, 4> : &attend<T, 0, 0>;
      fn(qp + off, kp + h * head_stride, vp + h * head_stride, tables + i * max_blocks, lens[i], shape, d, group,
         op + off, buf);
    }
  });
}

}  // namespace

// q: [b, Hq, D] contiguous; k_cache, v_cache: [Hkv, num_blocks, block_size, D] contiguous, q's dtype (float32 or
// bfloat16); block_tables: [b, max_blocks] int64 block ids; context_lens: [b] int64 (1 <= len <= max_blocks *
// block_size). Returns [b, Hq, D]. Shapes, lengths and block ids are checked, so no input reads outside the cache.
at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                     const at::Tensor& block_tables, const at::Tensor& context_lens, double scale) {
  TORCH_CHECK(q.device().is_cpu() && q.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(),
              "paged_decode_attention: CPU q [b, Hq, D] and caches [Hkv, blocks, block_size, D]");
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous(), "contiguous tensors");
  TORCH_CHECK(k_cache.scalar_type() == q.scalar_type() && v_cache.scalar_type() == q.scalar_type(), "one dtype");
  TORCH_CHECK(q.size(2) == k_cache.size(3) && q.size(1) % k_cache.size(0) == 0 && q.size(2) <= kMaxD &&
              q.size(1) / k_cache.size(0) <= kMaxG, "head shapes");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && context_lens.scalar_type() == at::kLong, "int64 tables");
  TORCH_CHECK(block_tables.size(0) == q.size(0) && context_lens.size(0) == q.size(0), "one table per sequence");
  auto tables = block_tables.contiguous();
  auto lens = context_lens.contiguous();
  const int64_t cap = tables.size(1) * k_cache.size(2);
  // Checked over the raw int64 arrays (b + b * max_blocks values, no tensor ops: this runs in every layer).
  const int64_t* lp = lens.data_ptr<int64_t>();
  for (int64_t i = 0; i < lens.numel(); ++i)
    TORCH_CHECK(lp[i] >= 1 && lp[i] <= cap, "context lengths must be in [1, max_blocks * block_size]");
  const int64_t* tp = tables.data_ptr<int64_t>();
  for (int64_t i = 0; i < tables.numel(); ++i)
    TORCH_CHECK(tp[i] >= 0 && tp[i] < k_cache.size(1), "block ids must be in [0, num_blocks)");
  auto out = at::empty_like(q);
  if (q.scalar_type() == at::kBFloat16) {
    run<at::BFloat16>(q, k_cache, v_cache, tables, lens, scale, out);
  } else {
    TORCH_CHECK(q.scalar_type() == at::kFloat, "float32 or bfloat16");
    run<float>(q, k_cache, v_cache, tables, lens, scale, out);
  }
  return out;
}
