// Element-wise parts of a decoder layer fused into one pass each, so a decode step with one request does not
// pay torch's per-operator cost (a few microseconds each, about 40 operators per layer) for tensors of a few
// hundred values. Each row is computed by itself in a fixed order, so results do not depend on the batch.
// The rounding points follow the torch path in inferd/model/layers.py (RMSNorm and SiLU round to the serving
// dtype where it does); sums are FP32 in a fixed order of this code, not torch's.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include "ops.h"
#include "vec.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

namespace {

template <typename T>
inline float ld(const T* p, int64_t i) { return float(p[i]); }

// Rounds through the serving dtype T (a no-op for float).
template <typename T>
inline float rnd(float v) { return float(T(v)); }

#if defined(__AVX512BF16__)
// Each lane rounded to BF16's precision as round_bf16_lanes() and c10::BFloat16(float) round (to nearest, ties to
// even, denormals kept; NaN to 0x7fc0), as FP32 (integer arithmetic: the same bits in any caller).
inline __m512 round_bf16x16(__m512 v) {
  const __m512i b = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_and_si512(_mm512_add_epi32(_mm512_add_epi32(b, _mm512_set1_epi32(0x7fff)), lsb),
                                     _mm512_set1_epi32(int32_t(0xffff0000u)));
  return _mm512_castsi512_ps(
      _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7fc00000)));
}

// 16 BF16 values from p as FP32 (lanes off in k: 0).
inline __m512 load_bf16x16(const at::BFloat16* p, __mmask16 k = 0xffff) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(k, p)), 16));
}
#endif

template <typename T, typename D>
void add_rms_norm_rows(float* h, const D* delta, const T* w, double eps, T* out, int64_t rows, int64_t hidden) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      inferd::add_rms_norm_row(h + r * hidden, delta ? delta + r * hidden : nullptr, w, eps, out + r * hidden, hidden);
  });
}

}  // namespace

namespace inferd {

template <typename T, typename D>
INFERD_SHARED void add_rms_norm_row(float* hr, const D* dr, const T* w, double eps, T* o, int64_t hidden) {
  if (dr)
    for (int64_t i = 0; i < hidden; ++i) hr[i] += float(dr[i]);
  float ss = 0.f;
  for (int64_t i = 0; i < hidden; ++i) ss += hr[i] * hr[i];
  const float inv = 1.f / std::sqrt(ss / float(hidden) + float(eps));
  for (int64_t i = 0; i < hidden; ++i) o[i] = T(ld(w, i) * rnd<T>(hr[i] * inv));
}

void check_slots(const int64_t* slots, int64_t T, int64_t cap) {
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(slots[t] >= 0 && slots[t] < cap, "slots must be in [0, num_blocks * block_size)");
}

template void add_rms_norm_row<at::BFloat16, at::BFloat16>(float*, const at::BFloat16*, const at::BFloat16*, double,
                                                           at::BFloat16*, int64_t);
template void add_rms_norm_row<at::BFloat16, float>(float*, const float*, const at::BFloat16*, double, at::BFloat16*,
                                                    int64_t);
template void add_rms_norm_row<float, float>(float*, const float*, const float*, double, float*, int64_t);

namespace {

// SiLU(g) * up for 8 values: g / (1 + e^-g) rounded to T, times up, rounded to T (by store8).
template <typename T>
inline void silu_mul8(const T* g, const T* u, T* out) {
  const v8 gx = load8(g);
  v8 s = gx / (splat(1.f) + exp8(-gx));
  if constexpr (!std::is_same<T, float>::value) s = round_bf16(s);
  store8(out, s * load8(u));
}

#if defined(__AVX512F__)
using inferd::v16;
using inferd::v16i;
using inferd::v16u;
using inferd::v16u16;

inline v16 load16(const float* p) { return inferd::load_lanes<v16>(p); }
inline v16 load16(const at::BFloat16* p) { return inferd::load_bf16_lanes<v16, v16u, v16u16>(p); }
inline void store16(float* p, v16 v) { inferd::store_lanes(p, v); }
inline void store16(at::BFloat16* p, v16 v) { inferd::store_bf16_lanes<v16, v16u, v16u16>(p, v); }

// silu_mul8's operations on 16 values at once (every lane the same operations: the same bits).
template <typename T>
inline void silu_mul16(const T* g, const T* u, T* out) {
  const v16 gx = load16(g);
  v16 s = gx / (v16{} + 1.f + inferd::exp_lanes<v16, v16i>(-gx));
  if constexpr (!std::is_same<T, float>::value) s = inferd::round_bf16_lanes<v16, v16u>(s);
  store16(out, s * load16(u));
}
#endif

#if defined(__AVX512BF16__)

// SiLU(g) * up in 16 lanes of BF16 values (g and u FP32 lanes that hold BF16 values) -> 16 BF16: g sigmoid(g) rounded
// to BF16, times u, rounded to BF16 (vcvtneps2bf16: to nearest even, denormals flushed to 0). With t = -g log2(e)
// held in [-200, 200] (g = +inf gives sigmoid 1; NaN stays NaN through g), n = t to nearest (vrndscaleps) and
// p = 2^(t - n) by its Taylor polynomial to degree 6 (relative error below 1.2e-7 on [-1/2, 1/2]):
// sigmoid(g) = 1 / (1 + p 2^n) = 2^-m / (2^-m + p 2^(n - m)) with m = max(n, 0), a divisor in [0.7, 2.5] whose
// reciprocal is vrcp14ps and one Newton step, times 2^-m by vscalefps (so g below -88.7 gives -0 as torch does, and
// the tiny values just above are those of g / (1 + e^-g)). No division (vdivps: 16 cycles a vector here) and no
// select: about a third of the cycles of exp_lanes() with a division (docs/performance.md, stop 30). The arithmetic
// is in builtins the compiler does not contract, so every caller gets the same bits.
__attribute__((always_inline)) inline __m256i silu_mul_bf16x16(__m512 g, __m512 u) {
  constexpr int kR = _MM_FROUND_CUR_DIRECTION;
  const __m512 one = _mm512_set1_ps(1.f), zero = _mm512_setzero_ps();
  __m512 t = _mm512_mul_round_ps(g, _mm512_set1_ps(-1.44269504088896341f), kR);
  t = _mm512_min_ps(_mm512_max_ps(t, _mm512_set1_ps(-200.f)), _mm512_set1_ps(200.f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_round_ps(t, n, kR);
  __m512 p = _mm512_set1_ps(1.5403530393381609e-4f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3333558146428443e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291076284772e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504108664821580e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022650695910071e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718055994531e-1f));
  p = _mm512_fmadd_ps(p, f, one);
  const __m512 m = _mm512_max_ps(n, zero), neg_m = _mm512_sub_round_ps(zero, m, kR);
  const __m512 d = _mm512_add_round_ps(_mm512_scalef_ps(one, neg_m), _mm512_scalef_ps(p, _mm512_sub_round_ps(n, m, kR)),
                                       kR);
  const __m512 r0 = _mm512_rcp14_ps(d);
  const __m512 r = _mm512_fmadd_ps(r0, _mm512_fnmadd_ps(d, r0, one), r0);
  const __m512 sg = _mm512_castsi512_ps(_mm512_slli_epi32(
      _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(_mm512_mul_round_ps(g, _mm512_scalef_ps(r, neg_m), kR))), 16));
  return (__m256i)_mm512_cvtneps_pbh(_mm512_mul_round_ps(sg, u, kR));
}
#endif

}  // namespace

#if defined(__AVX512BF16__)
INFERD_SHARED void silu_mul_block(const float* c, int64_t ldc, int64_t rows, at::BFloat16* out, int64_t ldo) {
  for (int64_t r = 0; r < rows; ++r)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + r * ldo),
                        silu_mul_bf16x16(round_bf16x16(_mm512_loadu_ps(c + r * ldc)),
                                         round_bf16x16(_mm512_loadu_ps(c + r * ldc + 16))));
}
#endif

template <typename T>
INFERD_SHARED void silu_mul_row(const T* g, T* out, int64_t inter, int64_t c0, int64_t c1) {
  const T* u = g + inter;
  if (c1 < 0) c1 = inter;
#if defined(__AVX512BF16__)
  if constexpr (std::is_same<T, at::BFloat16>::value) {  // 16 lanes, the last few masked: the same bits for any split
    for (int64_t i = c0; i < c1; i += 16) {
      const __mmask16 k = c1 - i >= 16 ? __mmask16(0xffff) : __mmask16((1u << (c1 - i)) - 1);
      _mm256_mask_storeu_epi16(out + i, k, silu_mul_bf16x16(load_bf16x16(g + i, k), load_bf16x16(u + i, k)));
    }
    return;
  }
#endif
  if constexpr (std::is_same<T, float>::value || std::is_same<T, at::BFloat16>::value) {
    // 16 values at a time where the build has AVX-512 (1.7x 8 at a time in BF16, stop 26), then 8, the last few
    // through the same vector code (so any split of the columns gives the same bits). About 6x a scalar loop of
    // expf calls at 8 (docs/performance.md, stop 20).
    int64_t i = c0;
#if defined(__AVX512F__)
    for (; i + 16 <= c1; i += 16) silu_mul16(g + i, u + i, out + i);
#endif
    for (; i + 8 <= c1; i += 8) silu_mul8(g + i, u + i, out + i);
    if (i < c1) {
      T gt[8] = {}, ut[8] = {}, ot[8];
      std::copy(g + i, g + c1, gt);
      std::copy(u + i, u + c1, ut);
      silu_mul8(gt, ut, ot);
      std::copy(ot, ot + (c1 - i), out + i);
    }
    return;
  }
  for (int64_t i = c0; i < c1; ++i) {
    const float gv = float(g[i]);
    const float s = rnd<T>(gv / (1.f + std::exp(-gv)));
    out[i] = T(s * float(u[i]));
  }
}

template void silu_mul_row<float>(const float*, float*, int64_t, int64_t, int64_t);
template void silu_mul_row<at::BFloat16>(const at::BFloat16*, at::BFloat16*, int64_t, int64_t, int64_t);

template <typename T>
INFERD_SHARED void rope_cache_row(const T* row, const T* ct, const T* st, T* qp, T* kc, T* vc, int64_t cap,
                                  int64_t slot, int64_t num_heads, int64_t num_kv, int64_t d, int64_t h0,
                                  int64_t h1) {
  const int64_t half = d / 2, heads = num_heads + num_kv;
  if (h1 < 0) h1 = heads + num_kv;
  for (int64_t h = h0; h < h1; ++h) {
    const T* in = row + h * d;
    if (h >= heads) {  // V: copied to the cache
      T* o = vc + ((h - heads) * cap + slot) * d;
      for (int64_t i = 0; i < d; ++i) o[i] = in[i];
      continue;
    }
    T* o = h < num_heads ? qp + h * d : kc + ((h - num_heads) * cap + slot) * d;
    // As x * cos + rotate_half(x) * sin in the dtype: each product rounded, then the sum.
    int64_t i = 0;
#if defined(__AVX512BF16__)
    // 16 at a time where a half is whole vectors: the same roundings, so the same bits (1.7x on a 2,000-row prefill's
    // QKV, stop 30)
    if constexpr (std::is_same<T, at::BFloat16>::value) {
      if (half % 16 == 0) {
        const __m512 neg = _mm512_set1_ps(-0.f);
        for (; i < d; i += 16) {
          const __m512 rot = i < half ? _mm512_xor_ps(load_bf16x16(in + i + half), neg) : load_bf16x16(in + i - half);
          const __m512 a = round_bf16x16(_mm512_mul_ps(load_bf16x16(in + i), load_bf16x16(ct + i)));
          const __m512 b = round_bf16x16(_mm512_mul_ps(rot, load_bf16x16(st + i)));
          inferd::store_bf16_16(o + i, _mm512_add_ps(a, b));
        }
      }
    }
#endif
    for (; i < d; ++i) {
      const float rot = i < half ? -float(in[i + half]) : float(in[i - half]);
      o[i] = T(rnd<T>(float(in[i]) * float(ct[i])) + rnd<T>(rot * float(st[i])));
    }
  }
}

template void rope_cache_row<float>(const float*, const float*, const float*, float*, float*, float*, int64_t, int64_t,
                                    int64_t, int64_t, int64_t, int64_t, int64_t);
template void rope_cache_row<at::BFloat16>(const at::BFloat16*, const at::BFloat16*, const at::BFloat16*,
                                           at::BFloat16*, at::BFloat16*, at::BFloat16*, int64_t, int64_t, int64_t,
                                           int64_t, int64_t, int64_t, int64_t);

}  // namespace inferd

// h: [T, hidden] float32, updated in place to h + delta when delta is given (delta: [T, hidden], float32 or
// the weight's dtype); weight: [hidden] float32 or bfloat16. Returns RMSNorm(h) * weight, [T, hidden] in the
// weight's dtype (Zhang & Sennrich 2019, arXiv:1910.07467; computed in FP32 as Hugging Face Llama does).
at::Tensor add_rms_norm(at::Tensor& h, const c10::optional<at::Tensor>& delta, const at::Tensor& weight, double eps) {
  TORCH_CHECK(h.dim() == 2 && h.scalar_type() == at::kFloat && h.is_contiguous(), "add_rms_norm: h [T, hidden] FP32");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == h.size(1) && weight.is_contiguous(), "weight: [hidden]");
  const int64_t rows = h.size(0), hidden = h.size(1);
  at::Tensor d;
  if (delta.has_value() && delta->defined()) {
    d = delta->contiguous();
    TORCH_CHECK(d.sizes() == h.sizes() && (d.scalar_type() == at::kFloat || d.scalar_type() == weight.scalar_type()),
                "delta: h's shape, FP32 or the weight's dtype");
  }
  auto out = at::empty({rows, hidden}, h.options().dtype(weight.scalar_type()));
  float* hp = h.data_ptr<float>();
  if (weight.scalar_type() == at::kBFloat16) {
    using T = at::BFloat16;
    if (d.defined() && d.scalar_type() == at::kBFloat16) {
      add_rms_norm_rows<T, T>(hp, d.data_ptr<T>(), weight.data_ptr<T>(), eps, out.data_ptr<T>(), rows, hidden);
    } else {
      add_rms_norm_rows<T, float>(hp, d.defined() ? d.data_ptr<float>() : nullptr, weight.data_ptr<T>(), eps,
                                  out.data_ptr<T>(), rows, hidden);
    }
  } else {
    TORCH_CHECK(weight.scalar_type() == at::kFloat, "weight: float32 or bfloat16");
    add_rms_norm_rows<float, float>(hp, d.defined() ? d.data_ptr<float>() : nullptr, weight.data_ptr<float>(), eps,
                                    out.data_ptr<float>(), rows, hidden);
  }
  return out;
}

// gate_up: [T, 2 I] (gate then up, float32 or bfloat16) -> SiLU(gate) * up, [T, I] in the same dtype (SiLU
// rounded to the dtype first, as F.silu(gate) * up rounds).
at::Tensor silu_mul(const at::Tensor& gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.size(1) % 2 == 0, "silu_mul: gate_up [T, 2 I]");
  const at::Tensor x = gate_up.contiguous();
  const int64_t rows = x.size(0), inter = x.size(1) / 2;
  auto out = at::empty({rows, inter}, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "silu_mul", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) inferd::silu_mul_row(xp + r * 2 * inter, op + r * inter, inter);
    });
  });
  return out;
}

// Rotary embedding of the query and key heads (Su et al. 2021, arXiv:2104.09864, "rotate half" layout as
// Hugging Face Llama) and the step's K and V written to the paged cache. qkv: [>= T, (Hq + 2 Hkv) D] (the fused
// QKV output); cos, sin: [T, D] in qkv's dtype; k_cache, v_cache: [Hkv, num_blocks, block_size, D]; slots: [T]
// int64 flat slots (block * block_size + offset). Returns the rotated queries, [T, Hq, D].
at::Tensor rope_and_cache(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, at::Tensor& k_cache,
                          at::Tensor& v_cache, const at::Tensor& slots, int64_t num_heads, int64_t num_kv) {
  TORCH_CHECK(qkv.dim() == 2 && qkv.is_contiguous() && cos.dim() == 2 && cos.is_contiguous() && sin.is_contiguous(),
              "rope_and_cache: contiguous qkv [T, (Hq + 2 Hkv) D] and cos, sin [T, D]");
  const int64_t T = slots.size(0), d = cos.size(1);
  TORCH_CHECK(qkv.size(0) >= T && qkv.size(1) == (num_heads + 2 * num_kv) * d && cos.size(0) == T &&
              sin.sizes() == cos.sizes() && d % 2 == 0, "rope_and_cache: shapes");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.size(0) == num_kv && k_cache.size(3) == d && k_cache.is_contiguous() &&
              v_cache.sizes() == k_cache.sizes() && v_cache.is_contiguous(), "rope_and_cache: caches");
  TORCH_CHECK(k_cache.scalar_type() == qkv.scalar_type() && v_cache.scalar_type() == qkv.scalar_type() &&
              cos.scalar_type() == qkv.scalar_type() && sin.scalar_type() == qkv.scalar_type(), "one dtype");
  TORCH_CHECK(slots.scalar_type() == at::kLong, "slots: int64");
  const at::Tensor sl = slots.contiguous();
  const int64_t* sp = sl.data_ptr<int64_t>();
  const int64_t cap = k_cache.size(1) * k_cache.size(2);
  inferd::check_slots(sp, T, cap);
  auto q = at::empty({T, num_heads, d}, qkv.options());
  const int64_t width = qkv.size(1);
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, qkv.scalar_type(), "rope_and_cache", [&] {
    const scalar_t* x = qkv.data_ptr<scalar_t>();
    const scalar_t* c = cos.data_ptr<scalar_t>();
    const scalar_t* s = sin.data_ptr<scalar_t>();
    scalar_t* qp = q.data_ptr<scalar_t>();
    scalar_t* kc = k_cache.data_ptr<scalar_t>();
    scalar_t* vc = v_cache.data_ptr<scalar_t>();
    at::parallel_for(0, T, 16, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t)
        inferd::rope_cache_row(x + t * width, c + t * d, s + t * d, qp + t * num_heads * d, kc, vc, cap, sp[t],
                               num_heads, num_kv, d);
    });
  });
  return q;
}

namespace {

// The index of the largest of x[0 .. n): the first of equal largest values, and the first NaN where there is one
// (what torch.argmax answers on a CPU). Eight lanes each keep their largest value and its first index (a strictly
// greater value replaces it, so a lane keeps its first of equal values); the lanes are then reduced to the
// largest value at the smallest index. A comparison with NaN is false, so NaNs are found by their own check.
int64_t argmax_row(const float* x, int64_t n) {
  using inferd::v8;
  using inferd::v8i;
  int64_t i = 0, best_i = 0;
  float best = x[0];
  bool nan = false;
  if (n >= 8) {
    v8 vbest = inferd::load8(x);
    v8i vidx = {0, 1, 2, 3, 4, 5, 6, 7}, cur = vidx;
    v8i vnan = vbest != vbest;
    for (i = 8; i + 8 <= n; i += 8) {
      const v8 v = inferd::load8(x + i);
      cur += 8;
      const v8i gt = v > vbest;
      vbest = gt ? v : vbest;
      vidx = gt ? cur : vidx;
      vnan |= v != v;
    }
    for (int l = 0; l < 8; ++l) {
      nan |= vnan[l] != 0;
      if (vbest[l] > best || (vbest[l] == best && vidx[l] < best_i)) {
        best = vbest[l];
        best_i = vidx[l];
      }
    }
  }
  for (; i < n; ++i) {
    nan |= std::isnan(x[i]);
    if (x[i] > best) {
      best = x[i];
      best_i = i;
    }
  }
  if (nan)  // (x[0] was checked in the first vector, or in the loop above)
    for (int64_t j = 0; j < n; ++j)
      if (std::isnan(x[j])) return j;
  return best_i;
}

}  // namespace

// logits: [S, V] float32 -> [S] int64, each row's argmax as torch.argmax(logits, dim=-1) gives it on a CPU (the
// first of equal maxima, the first NaN where a row has one), one vectorised pass per row: torch's CPU argmax reads
// 49,152 logits in ~0.1 ms, a tenth of a single-stream decode step's time outside the model on the machine of
// docs/performance.md (stop 22).
at::Tensor argmax_rows(const at::Tensor& logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.size(1) > 0 &&
                  logits.size(1) < (int64_t(1) << 31),
              "argmax_rows: logits [S, V] float32, 0 < V < 2^31 (the lanes keep 32-bit indices)");
  const at::Tensor x = logits.contiguous();
  const int64_t rows = x.size(0), vocab = x.size(1);
  auto out = at::empty({rows}, x.options().dtype(at::kLong));
  const float* xp = x.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, 4, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) op[r] = argmax_row(xp + r * vocab, vocab);
  });
  return out;
}

namespace {

// The top-p floor of one row (see nucleus_floor): p [n] probabilities, buf [n] scratch. A radix select on the mass
// instead of the rank: non-negative floats order as their bit patterns, so the tokens are put in buckets by the 12
// bits under the sign (the exponent and 4 mantissa bits), the bucket is found, from the largest down, where the
// probability of the tokens ranked above first reaches top_p, and only that bucket's tokens go on to the next 12
// bits, then the last 7 (all equal after that); the few left are sorted. Three to five passes over the row, without
// a sort of it. mass: kNucleusBuckets doubles of scratch.
constexpr int kNucleusBuckets = 4096;
float nucleus_floor_row(const float* p, int64_t n, double top_p, float* buf, double* mass) {
  if (top_p >= 1.0) return 0.f;  // no nucleus cut: nothing dropped
  double sums[4] = {0.0, 0.0, 0.0, 0.0};  // (four chains: one would wait on each add's latency)
  float least = std::numeric_limits<float>::infinity();
  bool nan = false;
  for (int64_t i = 0; i < n; ++i) {
    nan |= std::isnan(p[i]);
    sums[i & 3] += p[i];
    least = std::min(least, p[i]);
  }
  if (nan) return 0.f;  // no order to find: nothing dropped
  const double total = (sums[0] + sums[1]) + (sums[2] + sums[3]);
  if (total < top_p) return least;  // the row holds less than top_p: every token is kept (a sort's answer)
  // A token under (total - top_p) / n is never in the nucleus: the tokens under that hold less than total - top_p, so
  // more than top_p lies above any of them. Only the others are candidates (few in a peaked row).
  const float bound = std::nextafter(float((total - top_p) / double(n)), 0.f);
  int64_t m = 0;
  for (int64_t i = 0; i < n; ++i)
    if (p[i] >= bound) buf[m++] = p[i];
  double above = 0.0;  // the mass of the tokens ranked above those in buf[0, m): under top_p, so those are all kept
  static constexpr struct { int shift, buckets; } kLevels[] = {{19, kNucleusBuckets}, {7, kNucleusBuckets}, {0, 128}};
  for (const auto& level : kLevels) {
    if (m <= 64) break;
    const auto bucket = [&](float x) {
      uint32_t bits;
      std::memcpy(&bits, &x, sizeof bits);
      return (bits >> level.shift) & uint32_t(level.buckets - 1);  // (-0.0 goes with +0.0 into bucket 0)
    };
    std::fill(mass, mass + level.buckets, 0.0);
    for (int64_t i = 0; i < m; ++i) mass[bucket(buf[i])] += buf[i];
    int b = level.buckets - 1;
    for (; b >= 0 && above + mass[b] < top_p; --b) above += mass[b];
    if (b < 0) return least;  // (rounding: the sums in another order) every token kept
    int64_t kept = 0;
    for (int64_t i = 0; i < m; ++i)
      if (bucket(buf[i]) == uint32_t(b)) buf[kept++] = buf[i];
    m = kept;
  }
  std::sort(buf, buf + m, [](float x, float y) { return x > y; });
  for (int64_t i = 0; i < m; ++i) {
    above += buf[i];  // buf[i] is kept: the tokens above it hold under top_p
    if (above >= top_p) return buf[i];
  }
  return least;  // (rounding, as above)
}

}  // namespace

// probs: [S, V] float32 probabilities, top_p: [S] float32 in (0, 1] -> [S, 1] float32, each row's top-p floor: the
// probability of the least likely token of its nucleus (Holtzman et al. 2019, arXiv:1904.09751: the most likely
// tokens, in order, while the probability of those ranked above is under top_p), so that `probs >= floor` keeps the
// nucleus (and any token tied with its last one); 0 where top_p is 1. torch's sort of a 49,152-token row, which finding it took before,
// cost 2.2 ms on the machine of docs/performance.md (stop 47).
at::Tensor nucleus_floor(const at::Tensor& probs, const at::Tensor& top_p) {
  TORCH_CHECK(probs.dim() == 2 && probs.scalar_type() == at::kFloat && top_p.dim() == 1 &&
                  top_p.scalar_type() == at::kFloat && top_p.size(0) == probs.size(0),
              "nucleus_floor: probs [S, V] float32 and top_p [S] float32");
  const at::Tensor p = probs.contiguous(), tp = top_p.contiguous();
  const int64_t rows = p.size(0), vocab = p.size(1);
  auto out = at::empty({rows, 1}, p.options());
  // (allocated here: nothing inside the parallel region allocates, so nothing there can throw)
  // one scratch row per thread: with a grain of 1, at::parallel_for runs at most min(rows, threads) threads, whose
  // at::get_thread_num() is below that (0 where it runs inline)
  const int64_t threads = std::min<int64_t>(rows, at::get_num_threads());
  at::Tensor scratch = at::empty({threads, vocab}, p.options());
  at::Tensor sums = at::empty({threads, kNucleusBuckets}, p.options().dtype(at::kDouble));
  const float* pp = p.data_ptr<float>();
  const float* tpp = tp.data_ptr<float>();
  float *op = out.data_ptr<float>(), *sp = scratch.data_ptr<float>();
  double* mp = sums.data_ptr<double>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    const int64_t t = at::get_thread_num();
    for (int64_t r = begin; r < end; ++r)
      op[r] = nucleus_floor_row(pp + r * vocab, vocab, tpp[r], sp + t * vocab, mp + t * kNucleusBuckets);
  });
  return out;
}

// One token per row drawn from probs [S, V] float32 (a softmax's rows) by inverse transform sampling, after top-p
// (top_p [S] float32; 1 = none) and min-p (min_p [S] float32; 0 = none): of the tokens at or above both floors
// (nucleus_floor's, and min_p times the row's largest probability) and above 0, the first whose running sum (FP64, in
// vocabulary order) passes u times their total (u [S] float64 in [0, 1)) -> [S] int64. One pass for the floors'
// maximum and two for the sums, where the torch operators it replaces (masks, an FP64 copy, cumsum, searchsorted)
// took 5 ms of a 32-row step on the machine of docs/performance.md (stop 47).
at::Tensor sample_probs(const at::Tensor& probs, const at::Tensor& top_p, const at::Tensor& min_p, const at::Tensor& u) {
  TORCH_CHECK(probs.dim() == 2 && probs.scalar_type() == at::kFloat && probs.size(1) > 0,
              "sample_probs: probs [S, V] float32, V > 0");
  const int64_t rows = probs.size(0), vocab = probs.size(1);
  TORCH_CHECK(top_p.scalar_type() == at::kFloat && min_p.scalar_type() == at::kFloat &&
                  u.scalar_type() == at::kDouble && top_p.numel() == rows && min_p.numel() == rows &&
                  u.numel() == rows,
              "sample_probs: top_p [S] float32, min_p [S] float32 and u [S] float64");
  const at::Tensor p = probs.contiguous(), tp = top_p.contiguous(), mp = min_p.contiguous(), uc = u.contiguous();
  auto out = at::empty({rows}, p.options().dtype(at::kLong));
  // (allocated here: nothing inside the parallel region allocates, so nothing there can throw)
  const float *pp = p.data_ptr<float>(), *tpp = tp.data_ptr<float>(), *mpp = mp.data_ptr<float>();
  const bool any_top_p = std::any_of(tpp, tpp + rows, [](float x) { return x < 1.f; });
  // One scratch row per thread, as nucleus_floor's: 2 x 196 KB for SmolLM2's vocabulary on 2 threads, not an
  // [S, V] copy (6.3 MB at 32 rows) each step.
  const int64_t threads = any_top_p ? std::min<int64_t>(rows, at::get_num_threads()) : 0;
  at::Tensor scratch = at::empty({threads, vocab}, p.options());
  at::Tensor sums = at::empty({threads, kNucleusBuckets}, p.options().dtype(at::kDouble));
  const double* up = uc.data_ptr<double>();
  int64_t* op = out.data_ptr<int64_t>();
  float* sp = scratch.data_ptr<float>();
  double* bp = sums.data_ptr<double>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    const int64_t t = at::get_thread_num();
    for (int64_t r = begin; r < end; ++r) {
      const float* row = pp + r * vocab;
      float floor = 0.f;
      if (tpp[r] < 1.f)  // (the scratch is there for these rows only)
        floor = nucleus_floor_row(row, vocab, tpp[r], sp + t * vocab, bp + t * kNucleusBuckets);
      if (mpp[r] > 0.f) floor = std::max(floor, mpp[r] * *std::max_element(row, row + vocab));
      const auto kept = [&](float x) { return x >= floor && x > 0.f; };  // (false for a NaN)
      double total = 0.0;
      for (int64_t i = 0; i < vocab; ++i)
        if (kept(row[i])) total += row[i];
      const double target = up[r] * total;
      double sum = 0.0;
      int64_t token = -1;
      for (int64_t i = 0; i < vocab; ++i) {
        if (!kept(row[i])) continue;
        sum += row[i];
        token = i;
        if (sum > target) break;  // (the same sums as the total's, so the last kept token ends it at the latest)
      }
      op[r] = token < 0 ? int64_t(std::max_element(row, row + vocab) - row) : token;  // (no token kept: a NaN row)
    }
  });
  return out;
}
