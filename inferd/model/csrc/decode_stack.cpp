// A step of a Llama-family decoder in one call, on the CPU path where inferd's BF16 GEMM serves (panel_gemm.cpp:
// AVX2, or AVX512-BF16 over pair panels): every layer's residual add and RMSNorm, QKV projection, rotary embedding
// and KV-cache write, paged attention, output projection and MLP run inside one OpenMP parallel region, the threads
// meeting at a barrier between dependent phases. The per-operator path costs, per layer, nine calls from Python, nine
// wake-ups of the thread team and a dozen tensor allocations; at one decode row that is most of a step that is not
// weight reads (docs/performance.md, stop 19), and in a step of a few prompt rows beside decode rows, libgomp took
// 19% of it (stop 39).
//
// Phases of a layer (T rows: decode rows, one per sequence, then any prefill rows), five barriers (up to 8 rows, I a
// multiple of 16): residual add + RMSNorm (every thread all rows up to 8 rows, else split by rows, one more barrier)
// and GEMM panels (QKV) | attention items from a shared counter, the most keys first: (decode row, KV head), which
// first rotates the row's query heads and K head and writes K and V to the cache, and (prefill tile, KV head) as
// paged_attention() tiles a prompt chunk; with prefill rows every row is rotated and written first, one more barrier |
// panels (o) | norm as before, panels (gate_up), each unit of gate columns with the up unit of the same columns and
// SiLU * up of them (where I is a multiple of 16; else a SiLU phase of its own) | panels (down). A GEMM's panels go
// to the threads in guided chunks. Four fewer barriers than a phase per operation: a 1-row step 1.05x (stop 27).
//
// The o and down projections' FP32 sums go into the FP32 residual stream unrounded, as in the per-operator path.
//
// Every row, panel and attention item is computed by the out-of-line functions of ops.h that the per-operator
// kernels call too, so a row gets the same bits here as through the per-operator path, alone or in any batch
// (tests/test_kernels.py); the engine runs decode-only steps here, and steps with prefill rows of up to
// STACK_MAX_ROWS (inferd/model/llama.py) rows, larger ones per operator.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <omp.h>

#include "ops.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <memory>
#include <utility>
#include <vector>

namespace inferd {

namespace {

using BF16 = at::BFloat16;

inline int64_t panels(int64_t n) { return (n + kPanel - 1) / kPanel; }

constexpr int64_t kSiluColumns = 256;  // columns per SiLU * up item
constexpr int64_t kOwnNormRows = 8;    // up to this many rows, every thread normalises every row (norm_rows)

void check_panels(const at::Tensor& w, int64_t n, int64_t k, const char* name) {  // either BF16 layout of pack_panels
  const bool pairs = kBf16Pairs && k % 2 == 0 && is_pair_panels(w);
  const int64_t rows = pairs ? k / 2 : k, cols = pairs ? 16 : 8;
  TORCH_CHECK(w.dim() == 4 && w.scalar_type() == at::kBFloat16 && w.is_contiguous() && w.size(0) == panels(n) &&
                  w.size(1) == rows && w.size(2) == cols && w.size(3) == 2,
              "DecodeStack: ", name, " must be packed panels [", panels(n), ", ", rows, ", ", cols, ", 2] BF16");
}

template <typename W>
const W* panel_ptr(const at::Tensor& w) { return reinterpret_cast<const W*>(w.data_ptr<BF16>()); }

}  // namespace

DecodeStack::DecodeStack(const std::vector<at::Tensor>& weights, const std::vector<at::Tensor>& qkv_bias,
                         const at::Tensor& final_norm, int64_t num_heads, int64_t num_kv, int64_t head_dim,
                         double eps, double scale)
    : weights_(weights), final_norm_(final_norm), heads_(num_heads), kv_(num_kv), d_(head_dim), eps_(eps),
      scale_(float(scale)) {
  TORCH_CHECK(!weights.empty() && weights.size() % 6 == 0, "DecodeStack: 6 weights per layer");
  TORCH_CHECK(num_kv > 0 && num_heads % num_kv == 0 && num_heads / num_kv <= 16 && head_dim > 0 &&
                  head_dim % 8 == 0 && head_dim <= 256,
              "DecodeStack: head shapes");
  layers_ = int64_t(weights.size()) / 6;
  hidden_ = final_norm.size(0);
  inter_ = is_pair_panels(weights[5]) ? 2 * weights[5].size(1) : weights[5].size(1);
  qkv_n_ = (num_heads + 2 * num_kv) * head_dim;
  TORCH_CHECK(final_norm.dim() == 1 && final_norm.scalar_type() == at::kBFloat16 && final_norm.is_contiguous(),
              "DecodeStack: final norm [H] BF16");
  for (int64_t l = 0; l < layers_; ++l) {
    const at::Tensor* w = &weights[6 * l];
    for (int i = 0; i < 2; ++i)
      TORCH_CHECK(w[i].dim() == 1 && w[i].size(0) == hidden_ && w[i].scalar_type() == at::kBFloat16 &&
                      w[i].is_contiguous(),
                  "DecodeStack: norm weights [H] BF16");
    check_panels(w[2], qkv_n_, hidden_, "qkv");
    check_panels(w[3], hidden_, num_heads * head_dim, "o");
    check_panels(w[4], 2 * inter_, hidden_, "gate_up");
    check_panels(w[5], hidden_, inter_, "down");
  }
  TORCH_CHECK(qkv_bias.empty() || int64_t(qkv_bias.size()) == layers_, "DecodeStack: no qkv bias or one per layer");
  for (const at::Tensor& b : qkv_bias) {
    TORCH_CHECK(b.dim() == 1 && b.size(0) == qkv_n_, "DecodeStack: qkv bias [(Hq + 2 Hkv) D]");
    // FP32 over whole panels, as panel_linear converts a bias (the kernel reads 16 at a time).
    at::Tensor padded = at::zeros({panels(qkv_n_) * kPanel}, b.options().dtype(at::kFloat));
    padded.narrow(0, 0, qkv_n_).copy_(b);
    bias_.push_back(padded);
  }
}

at::Tensor DecodeStack::run(at::Tensor& h, const at::Tensor& cos, const at::Tensor& sin,
                            const std::vector<at::Tensor>& k_caches, const std::vector<at::Tensor>& v_caches,
                            const at::Tensor& slots, const at::Tensor& block_tables, const at::Tensor& seq_idx,
                            const at::Tensor& context_lens, int64_t num_decode) const {
  const int64_t T = h.size(0), H = hidden_, I = inter_, D = d_, A = heads_ * d_, group = heads_ / kv_;
  TORCH_CHECK(h.device().is_cpu() && h.dim() == 2 && h.size(1) == H && h.scalar_type() == at::kFloat &&
                  h.is_contiguous() && T > 0,
              "DecodeStack.run: h [T, H] FP32, T > 0");
  for (const at::Tensor* t : {&cos, &sin})
    TORCH_CHECK(t->dim() == 2 && t->size(0) == T && t->size(1) == D && t->scalar_type() == at::kBFloat16 &&
                    t->is_contiguous(),
                "DecodeStack.run: cos, sin [T, D] BF16");
  TORCH_CHECK(int64_t(k_caches.size()) == layers_ && int64_t(v_caches.size()) == layers_,
              "DecodeStack.run: one K and one V cache per layer");
  const at::Tensor& k0 = k_caches[0];
  TORCH_CHECK(k0.dim() == 4 && k0.size(0) == kv_ && k0.size(3) == D && k0.size(2) > 0 &&
                  (k0.size(2) & (k0.size(2) - 1)) == 0,
              "DecodeStack.run: caches [Hkv, num_blocks, block_size (a power of two), D]");
  for (int64_t l = 0; l < layers_; ++l)
    for (const at::Tensor* c : {&k_caches[l], &v_caches[l]})
      TORCH_CHECK(c->sizes() == k0.sizes() && c->scalar_type() == at::kBFloat16 && c->is_contiguous(),
                  "DecodeStack.run: caches of one shape, BF16, contiguous");
  const int64_t num_blocks = k0.size(1), bs = k0.size(2), cap = num_blocks * bs;
  TORCH_CHECK(slots.numel() == T && seq_idx.numel() == T && context_lens.numel() == T &&
                  slots.scalar_type() == at::kLong && seq_idx.scalar_type() == at::kLong &&
                  context_lens.scalar_type() == at::kLong && block_tables.scalar_type() == at::kLong &&
                  block_tables.dim() == 2,
              "DecodeStack.run: int64 slots, seq_idx, context_lens [T] and block_tables [S, max_blocks]");
  const at::Tensor sl = slots.contiguous(), sq = seq_idx.contiguous(), ln = context_lens.contiguous(),
                   tb = block_tables.contiguous();
  const int64_t *sp = sl.data_ptr<int64_t>(), *qi = sq.data_ptr<int64_t>(), *lp = ln.data_ptr<int64_t>(),
                *tp = tb.data_ptr<int64_t>();
  const int64_t max_blocks = tb.size(1);
  check_slots(sp, T, cap);
  check_attention_indices(qi, lp, T, tp, tb.size(0), max_blocks, num_blocks, bs);
  TORCH_CHECK(num_decode >= 0 && num_decode <= T, "DecodeStack.run: num_decode must be in [0, T]");
  const bool mixed = num_decode < T;  // prefill rows too

  // A GEMM's input in the kernel's packed FP32 layout ([ceil(T / 6), K, 6], rows past T zero), one copy per thread
  // and per K (H, A, I): each thread packs the BF16 rows (T x K values) itself, which costs less than reading tiles
  // another thread wrote from that thread's cache, and lets the work on one row (its norm, its attention items, its
  // SiLU * up) go to any thread (one decode row: 0.56-0.77 ms of a ~10 ms forward, docs/performance.md, stop 20).
  const int nthreads = std::max(1, at::get_num_threads());
  // (Either layout's size: pair panels and FP32 tiles use the same 4-byte words.)
  const auto size_of = [T](int64_t K) { return std::max(packed_x_size(T, K, false), packed_x_size(T, K, true)); };
  const int64_t xh_n = size_of(H), xa_n = size_of(A), per_thread = xh_n + xa_n + size_of(I);
  at::Tensor packed = at::zeros({nthreads * per_thread}, h.options());
  // BF16 activations, shared by the threads.
  const int64_t norm_copies = T <= kOwnNormRows ? nthreads : 1;  // each thread's normalised rows, or one shared
  at::Tensor act = at::empty({T * (norm_copies * H + qkv_n_ + 2 * A + 2 * I + I)}, h.options().dtype(at::kBFloat16));
  // The o and down projections' FP32 sums, added to the FP32 residual stream unrounded (as the per-operator path).
  at::Tensor deltas = at::empty({2 * T * H}, h.options());
  at::Tensor out = at::empty({T, H}, h.options().dtype(at::kBFloat16));
  BF16* normed_all = act.data_ptr<BF16>();  // [norm_copies, T, H]: the RMSNorm of the rows
  BF16* qkv = normed_all + norm_copies * T * H;  // [T, (Hq + 2 Hkv) D]
  BF16* q = qkv + T * qkv_n_;           // [T, Hq, D]
  BF16* attn = q + T * A;               // [T, Hq, D]
  BF16* gu = attn + T * A;              // [T, 2 I]
  BF16* mlp = gu + T * 2 * I;           // [T, I]
  float* o = deltas.data_ptr<float>();  // [T, H]
  float* delta = o + T * H;             // [T, H]
  // The residual stream in two buffers, h and hq: a layer's first norm reads h and writes the sums to hq, the
  // second reads hq and writes h. Each thread's copy of the sums it normalises: sums.
  const bool own_norm = T <= kOwnNormRows;
  at::Tensor h2 = at::empty({T, H}, h.options()), sums = at::empty({own_norm ? nthreads * T * H : 0}, h.options());
  float *hp = h.data_ptr<float>(), *hq = h2.data_ptr<float>();
  const BF16 *cp = cos.data_ptr<BF16>(), *snp = sin.data_ptr<BF16>();
  std::vector<BF16*> kc(layers_), vc(layers_);
  for (int64_t l = 0; l < layers_; ++l) {
    kc[l] = k_caches[l].data_ptr<BF16>();
    vc[l] = v_caches[l].data_ptr<BF16>();
  }
  // Attention items: (decode row, KV head) and (prefill tile, KV head) as paged_attention() makes them (rows == 0: a
  // decode row), the most keys first, taken from a counter per layer.
  struct Item {
    int64_t row, rows, head, cost;
  };
  std::vector<Item> items;
  for (int64_t t = 0; t < num_decode; ++t)
    for (int64_t g = 0; g < kv_; ++g) items.push_back({t, 0, g, lp[t]});
  for (const PrefillTile& tile : prefill_tiles(qi, lp, num_decode, T, kv_, nthreads))
    for (int64_t g = 0; g < kv_; ++g)
      items.push_back({tile.row, tile.rows, g, tile.rows * lp[tile.row + tile.rows - 1]});
  std::stable_sort(items.begin(), items.end(), [](const Item& a, const Item& b) { return a.cost > b.cost; });
  const int64_t n_items = int64_t(items.size());
  std::unique_ptr<std::atomic<int64_t>[]> next(new std::atomic<int64_t>[layers_]);
  for (int64_t l = 0; l < layers_; ++l) next[l].store(0);
  const BF16* final_norm = final_norm_.data_ptr<BF16>();
  // SiLU * up in the gate_up GEMM's loop, 64 columns at a time, where up's columns start at a panel boundary; else
  // in a phase of its own, split within a row too (by 256 columns), so that a step of one or a few rows keeps every
  // thread busy (at one row, SiLU * up was 21 us of each layer's ~300 on one thread before it was vectorised).
  const int64_t silu_chunks = (I + kSiluColumns - 1) / kSiluColumns;
  const bool fuse_silu = I % kPanel == 0;
  const int64_t silu_units = (panels(I) + 3) / 4;

  // Each thread's attention scratch (attend_decode_scratch), sized here for the longest context: nothing inside the
  // parallel region allocates, so nothing there can throw (an exception leaving an OpenMP region terminates the
  // process).
  const int64_t longest = *std::max_element(lp, lp + T);
  std::vector<LineVector<float>> scratch(nthreads, LineVector<float>(attend_decode_scratch(longest, group, D)));
  // Prefill tiles' buffers grow inside the region: an allocation that fails there is caught and reported after it.
  std::vector<PrefillScratch> tile_scratch(mixed ? nthreads : 0);
  std::atomic<bool> failed{false};

#pragma omp parallel num_threads(nthreads)
  {
    // team <= nthreads: OpenMP may give fewer (a nested region, a thread limit).
    const int tid = omp_get_thread_num(), team = omp_get_num_threads();
    LineVector<float>& buf = scratch[tid];
    // A GEMM's output panels in units of 4 (64 columns), handed out in shrinking chunks (guided: the first half,
    // then half of the rest, ...), then a barrier. Where the OS lends a thread's core to the server's event loop or
    // the client for a while, the other thread takes the panels left instead of waiting at the barrier (served
    // single-stream TPOT 15.1 -> 14.2 ms against an even static split, docs/performance.md).
    float* xh = packed.data_ptr<float>() + tid * per_thread;
    float *xa = xh + xh_n, *xi = xa + xa_n;
    float* sum = own_norm ? sums.data_ptr<float>() + tid * T * H : nullptr;
    // (x: this thread's FP32 tiles, or its BF16 pair tiles in the same memory where the weights are in pairs.)
    auto pack = [&](const BF16* src, float* x, int64_t K, const at::Tensor& w) {
      if (is_pair_panels(w))
        for (int64_t t = 0; t < T; ++t) pack_row(src, t, K, reinterpret_cast<uint32_t*>(x));
      else
        for (int64_t t = 0; t < T; ++t) pack_row(src, t, K, x);
    };
    auto panels_of = [&](const float* x, int64_t K, const at::Tensor& w, int64_t N, const float* bias, auto* y,
                         int64_t p0, int64_t p1, int64_t next) {
      if (is_pair_panels(w))
        gemm_panels(reinterpret_cast<const uint32_t*>(x), T, K, panel_ptr<uint32_t>(w), N, bias, y, p0, p1, next);
      else
        gemm_panels(x, T, K, panel_ptr<uint16_t>(w), N, bias, y, p0, p1, next);
    };
    auto gemm = [&](const float* x, int64_t K, const at::Tensor& w, int64_t N, const float* bias, auto* y) {
      const int64_t p = panels(N), units = (p + 3) / 4;
#pragma omp for schedule(guided)
      for (int64_t u = 0; u < units; ++u) panels_of(x, K, w, N, bias, y, 4 * u, std::min(p, 4 * u + 4), -1);
    };
    // h += delta, then RMSNorm, of each row: the sums go to the other residual buffer (read after the next barrier),
    // the normalised rows to the buffer returned. Up to kOwnNormRows rows every thread normalises every row into its
    // own copy, each row's sum written out by one thread, instead of one thread working while the other waits at a
    // barrier; more rows are split between the threads.
    auto norm_rows = [&](const float* from, float* to, const float* d, const BF16* w) -> const BF16* {
      if (own_norm) {
        BF16* mine = normed_all + tid * T * H;
        std::memcpy(sum, from, T * H * sizeof(float));
        for (int64_t t = 0; t < T; ++t) {
          add_rms_norm_row<BF16, float>(sum + t * H, d ? d + t * H : nullptr, w, eps_, mine + t * H, H);
          if (t % team == tid) std::memcpy(to + t * H, sum + t * H, H * sizeof(float));
        }
        return mine;
      }
#pragma omp for schedule(static)
      for (int64_t t = 0; t < T; ++t) {
        std::memcpy(to + t * H, from + t * H, H * sizeof(float));
        add_rms_norm_row<BF16, float>(to + t * H, d ? d + t * H : nullptr, w, eps_, normed_all + t * H, H);
      }
      return normed_all;
    };
    for (int64_t l = 0; l < layers_; ++l) {
      const at::Tensor* w = &weights_[6 * l];
      pack(norm_rows(hp, hq, l == 0 ? nullptr : delta, w[0].data_ptr<BF16>()), xh, H, w[2]);
      gemm(xh, H, w[2], qkv_n_, bias_.empty() ? nullptr : bias_[l].data_ptr<float>(), qkv);
      // Decode-only: each attention item rotates its row's query heads and K head and writes K and V to the cache
      // first (the slot is this sequence's own: no other row of a decode step reads it). With prefill rows every
      // row is rotated and written first (one more barrier): a prompt row attends over its earlier rows' keys.
      if (mixed) {
#pragma omp for schedule(static)
        for (int64_t t = 0; t < T; ++t)
          rope_cache_row(qkv + t * qkv_n_, cp + t * D, snp + t * D, q + t * A, kc[l], vc[l], cap, sp[t], heads_, kv_,
                         D);
      }
      // A decode item takes the item its thread computes next from the counter at once, while more items remain
      // than threads, so that it can prefetch that one's rows while it computes (DecodeAhead); otherwise (prefill
      // tiles, the last items) the next is taken when this one is done, so the threads finish together.
      int64_t i_next = n_items;
      for (int64_t i = next[l]++; i < n_items; i = i_next < n_items ? i_next : next[l]++) {
        i_next = items[i].rows == 0 && n_items - next[l].load() > team ? next[l]++ : n_items;
        const int64_t t = items[i].row, g = items[i].head, off = t * A + g * group * D;
        const BF16 *k_head = kc[l] + g * cap * D, *v_head = vc[l] + g * cap * D;
        if (items[i].rows > 0) {
          try {
            attend_prefill_tile(q, k_head, v_head, tp + qi[t] * max_blocks, lp, t, items[i].rows, heads_, g, group, D,
                                bs, scale_, attn, tile_scratch[tid]);
          } catch (...) {
            failed = true;
          }
          continue;
        }
        if (!mixed)
          for (const int64_t h0 : {g * group, heads_ + g, heads_ + kv_ + g})
            rope_cache_row(qkv + t * qkv_n_, cp + t * D, snp + t * D, q + t * A, kc[l], vc[l], cap, sp[t], heads_,
                           kv_, D, h0, h0 == g * group ? h0 + group : h0 + 1);
        DecodeAhead ahead{};
        const bool has_ahead = i_next < n_items && items[i_next].rows == 0;
        if (has_ahead) {
          const Item& nx = items[i_next];
          ahead = {kc[l] + nx.head * cap * D, vc[l] + nx.head * cap * D, tp + qi[nx.row] * max_blocks, lp[nx.row]};
        }
        attend_decode(q + off, k_head, v_head, tp + qi[t] * max_blocks, lp[t], bs, scale_, D, group, attn + off, buf,
                      has_ahead ? &ahead : nullptr);
      }
#pragma omp barrier
      pack(attn, xa, A, w[3]);
      gemm(xa, A, w[3], H, nullptr, o);
      pack(norm_rows(hq, hp, o, w[1].data_ptr<BF16>()), xh, H, w[4]);
      if (fuse_silu) {  // a gate unit, the up unit of the same columns, then SiLU * up of those columns
        const int64_t up0 = panels(I);
#pragma omp for schedule(guided)
        for (int64_t u = 0; u < silu_units; ++u) {
          const int64_t p0 = 4 * u, p1 = std::min(up0, p0 + 4);
          panels_of(xh, H, w[4], 2 * I, nullptr, gu, p0, p1, up0 + p0);
          panels_of(xh, H, w[4], 2 * I, nullptr, gu, up0 + p0, up0 + p1, p1 < up0 ? p1 : -1);
          for (int64_t t = 0; t < T; ++t) silu_mul_row(gu + t * 2 * I, mlp + t * I, I, p0 * kPanel, p1 * kPanel);
        }
      } else {
        gemm(xh, H, w[4], 2 * I, nullptr, gu);
#pragma omp for schedule(static)
        for (int64_t i = 0; i < T * silu_chunks; ++i) {
          const int64_t t = i / silu_chunks, c0 = i % silu_chunks * kSiluColumns, c1 = std::min(c0 + kSiluColumns, I);
          silu_mul_row(gu + t * 2 * I, mlp + t * I, I, c0, c1);
        }
      }
      pack(mlp, xi, I, w[5]);
      gemm(xi, I, w[5], H, nullptr, delta);
    }
#pragma omp for schedule(static)
    for (int64_t t = 0; t < T; ++t)
      add_rms_norm_row<BF16, float>(hp + t * H, delta + t * H, final_norm, eps_, out.data_ptr<BF16>() + t * H, H);
  }
  TORCH_CHECK(!failed, "DecodeStack.run: out of memory for the prefill tiles' buffers");
  return out;
}

}  // namespace inferd
