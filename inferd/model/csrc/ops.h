// Row-level pieces of inferd's CPU kernels, shared by the per-operator kernels (panel_gemm.cpp, fused_ops.cpp,
// paged_attention.cpp) and the decoder stack that runs a whole decode step in one call (decode_stack.cpp). Each is
// one out-of-line function (noinline, noclone), so a row computed through either path runs the same machine code
// and gets the same bits (with -ffast-math a function inlined into two callers could be vectorised two ways).
#pragma once

#include <ATen/ATen.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <new>
#include <vector>

#if defined(__AMX_TILE__)
#include <immintrin.h>
#endif

#define INFERD_SHARED __attribute__((noinline, noclone))

namespace inferd {

// panel_gemm.cpp: y = x @ W.T (+ b), W packed in panels of kPanel output columns, x packed k-major in tiles of
// kTileRows rows.
constexpr int64_t kPanel = 16;
constexpr int64_t kTileRows = 6;

// Whether this build has the AVX512-BF16 micro-kernel (vdpbf16ps, -march=native on AMD Zen 4/5 or Intel Cooper Lake
// and later): BF16 weights of an even K are then packed in pairs of k (W = uint32_t below).
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__) && defined(__AVX512BF16__)
#define INFERD_BF16_PAIRS 1
constexpr bool kBf16Pairs = true;
#else
constexpr bool kBf16Pairs = false;
#endif

// Whether this build can run pair panels on AMX tiles (TDPBF16PS: Intel Sapphire Rapids and later, -march=native).
// Whether it does is decided once per process at run time (amx_pairs()): Linux must grant the process the tile
// state (arch_prctl ARCH_REQ_XCOMP_PERM, Linux 5.16+), and INFERD_AMX=0 turns it off.
#if defined(INFERD_BF16_PAIRS) && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define INFERD_AMX 1
#endif

// Whether GEMMs over pair panels run on AMX tiles in this process (see above): then every pair GEMM does, whatever
// its rows, so a row's bits never depend on the batch (TDPBF16PS sums a tile's 16 k-pairs with its own rounding,
// not as a chain of vdpbf16ps: docs/performance.md, stop 28).
bool amx_pairs();

// Rows of x per AMX tile, and k-pairs per tile row (64 bytes).
constexpr int64_t kAmxRows = 16;
constexpr int64_t kAmxPairs = 16;

#if defined(INFERD_AMX)
// The palette-1 tile configuration (Intel SDM, LDTILECFG): 64 bytes, rows and bytes per row of each of 16 tiles.
struct alignas(64) TileConfig {
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tiles 0-7 all 16 rows of 64 bytes (what inferd's AMX code uses: the GEMM's C, A and B tiles, attention's): loaded
// at the start of each kernel call, as other code on the thread (oneDNN) may have configured the tiles otherwise.
inline void amx_configure() {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = kAmxRows;
    cfg.colsb[t] = 64;
  }
  // GCC 12's _tile_loadconfig names only 8 bytes of cfg as its operand: every field is stored before it runs.
  asm volatile("" : : "r"(&cfg) : "memory");
  _tile_loadconfig(&cfg);
}
#endif

// The packed x a GEMM with weights of type W reads: FP32 [ceil(M / 6), K, 6] (W = float, or uint16_t: BF16 weights
// interleaved for the AVX2 kernel); BF16 pairs [ceil(M / 6), K / 2, 6] of 32-bit words (W = uint32_t: BF16 weights in
// pairs of k; a word's low half is x[2 kk], its high half x[2 kk + 1]); with amx_pairs() instead row-major BF16
// pairs [ceil(M / 16) * 16, ceil(K / 32) * 16] (AMX's A tiles: 16 rows of 16 words; zero past M and K).
template <typename W>
struct PackedX {
  using type = float;
};
template <>
struct PackedX<uint32_t> {
  using type = uint32_t;
};

// Whether w holds BF16 panels in pairs of k ([P, K / 2, 16, 2]; interleaved BF16 panels are [P, K, 8, 2], FP32
// ones [P, K, 2, 8]): the layout's shape is how panel_linear and the decoder stack tell them apart.
inline bool is_pair_panels(const at::Tensor& w) {
  return w.scalar_type() == at::kBFloat16 && w.dim() == 4 && w.size(2) == 16;
}

// 32-bit words per row of the AMX layout of packed x: K / 2 pairs rounded up to whole tile rows.
inline int64_t amx_x_stride(int64_t K) { return (K / 2 + kAmxPairs - 1) / kAmxPairs * kAmxPairs; }

// Elements (floats or 32-bit words) of the packed x of M rows and K columns, for pair panels or not.
inline int64_t packed_x_size(int64_t M, int64_t K, bool pairs) {
  if (pairs && amx_pairs()) return (M + kAmxRows - 1) / kAmxRows * kAmxRows * amx_x_stride(K);
  return (M + kTileRows - 1) / kTileRows * (pairs ? K / 2 : K) * kTileRows;
}

// Row m of x [M, K] (float or at::BFloat16) into xp, the packed layout above (rows past M stay as the caller zeroed
// them): FP32 values (float* xp), or BF16 pairs (uint32_t* xp; FP32 values rounded to nearest even, K even).
template <typename T>
void pack_row(const T* x, int64_t m, int64_t K, float* xp);
template <typename T>
void pack_row(const T* x, int64_t m, int64_t K, uint32_t* xp);

// Output panels [p_begin, p_end) of x @ W.T (+ bias) for the M rows of xp: out [M, N] (row stride N), w the packed
// weight: W = float [ceil(N / 16), K, 16]; uint16_t (BF16 bits, interleaved) [ceil(N / 16), K, 16]; uint32_t (BF16
// pairs, kBf16Pairs builds) [ceil(N / 16), K / 2, 16]; bias [ceil(N / 16) * 16] FP32 or null. Out: float or
// at::BFloat16 (with BF16 weights), float (with FP32 weights). next >= 0: the panel from which passes over the rows
// from L2 prefetch the next 4 panels' weights for the last unit of the range (default: p_end, the following unit).
template <typename Out, typename W>
void gemm_panels(const typename PackedX<W>::type* xp, int64_t M, int64_t K, const W* w, int64_t N, const float* bias,
                 Out* out, int64_t p_begin, int64_t p_end, int64_t next = -1);

// fused_ops.cpp. One row of hidden values: h += delta (delta may be null), then out = RMSNorm(h) * w.
template <typename T, typename D>
void add_rms_norm_row(float* h, const D* delta, const T* w, double eps, T* out, int64_t hidden);

// Columns [c0, c1) (c1 < 0: to I) of one row of a fused [2 I] gate_up: out [I] = SiLU(gate) * up. Each value goes
// through the same vector code whatever its lane (the last few of a range too: 16 lanes, masked, with AVX512-BF16;
// else 8), so any split of a row's columns gives the same bits.
template <typename T>
void silu_mul_row(const T* gate_up, T* out, int64_t inter, int64_t c0 = 0, int64_t c1 = -1);

#if defined(INFERD_BF16_PAIRS)
// fused_ops.cpp: out [rows, 16] (row stride ldo) = SiLU(gate) * up of an FP32 block c [rows, 32] (row stride ldc: a
// row's 16 gate sums, then its 16 up sums), each sum rounded to BF16 first as panel_linear's BF16 output rounds it:
// the bits silu_mul_row gives over those rounded sums.
void silu_mul_block(const float* c, int64_t ldc, int64_t rows, at::BFloat16* out, int64_t ldo);
#endif

// Heads [h0, h1) (h1 < 0: all Hq + 2 Hkv) of one row of the fused QKV output ((Hq + 2 Hkv) D values): Q and K
// rotated by cos, sin [D], Q to q [Hq, D], K and V to the caches [Hkv, cap, D] at slot. Each head is computed by
// itself, so any split of a row's heads gives the same bits.
template <typename T>
void rope_cache_row(const T* row, const T* cos, const T* sin, T* q, T* k_cache, T* v_cache, int64_t cap,
                    int64_t slot, int64_t num_heads, int64_t num_kv, int64_t d, int64_t h0 = 0, int64_t h1 = -1);

// fused_ops.cpp: every one of the T slots in [0, cap) (cap = num_blocks * block_size), else c10::Error.
void check_slots(const int64_t* slots, int64_t T, int64_t cap);

// paged_attention.cpp: every row's sequence index in [0, num_seqs) and context length in [1, max_blocks *
// block_size], every block id of block_tables [num_seqs, max_blocks] in [0, num_blocks), else c10::Error.
void check_attention_indices(const int64_t* seq_idx, const int64_t* context_lens, int64_t rows,
                             const int64_t* block_tables, int64_t num_seqs, int64_t max_blocks, int64_t num_blocks,
                             int64_t block_size);

// A std::vector whose memory starts on a 64-byte cache line. An AMX tile load or store whose rows straddle cache
// lines runs ~5x slower than one whose rows are lines (16 rows of 64 bytes from L1: 34 against 6.9 TSC cycles on
// Sapphire Rapids), and malloc's large blocks start 16 bytes past a page (docs/performance.md, stop 34). The
// attention kernels' scratch, whose rows tiles read and write, is held in these.
template <typename T>
struct LineAllocator {
  using value_type = T;
  LineAllocator() = default;
  template <typename U>
  LineAllocator(const LineAllocator<U>&) {}
  T* allocate(std::size_t n) { return static_cast<T*>(::operator new(n * sizeof(T), std::align_val_t(64))); }
  void deallocate(T* p, std::size_t) { ::operator delete(p, std::align_val_t(64)); }
  template <typename U>
  bool operator==(const LineAllocator<U>&) const { return true; }
  template <typename U>
  bool operator!=(const LineAllocator<U>&) const { return false; }
};
template <typename T>
using LineVector = std::vector<T, LineAllocator<T>>;

// The scratch attend_decode() needs, in floats: G x (1.5 x n rounded up to 32 + 2 D), G at least 16 (the AMX value
// pass reads 16 rows of probabilities, one tile; the rows past G are not used).
inline int64_t attend_decode_scratch(int64_t n, int64_t group, int64_t d) {
  return (group > 16 ? group : 16) * ((n + 31) / 32 * 48 + 2 * d);
}

// paged_attention.cpp. One decode row and KV head: q [G, D] (the G query heads of that KV head) over the first n
// keys of k_head, v_head ([num_blocks, block_size, D]) through the block table; out [G, D]. buf: scratch, resized
// to attend_decode_scratch(n, G, D) floats (no allocation where it is already that large).
//
// ahead: the decode item this thread computes next, if known (its KV head's rows, block table and context length in
// tokens). Where given, the AVX512-BF16 and AMX paths prefetch that item's first keys' rows into L2 at an even pace
// over this item's work, so the next item starts on rows already in cache instead of waiting on memory at its start
// and in its scores pass (only prefetches: the bits do not change).
struct DecodeAhead {
  const void* k_head;
  const void* v_head;
  const int64_t* table;
  int64_t n;
};
template <typename T>
void attend_decode(const T* q, const T* k_head, const T* v_head, const int64_t* table, int64_t n, int64_t block_size,
                   float scale, int64_t d, int64_t group, T* out, LineVector<float>& buf,
                   const DecodeAhead* ahead = nullptr);

// paged_attention.cpp. The prefill rows [first, num_rows) of a step as attention work: each run of consecutive rows
// of one sequence at consecutive positions (seqs [T] each row's sequence, lens [T] its context length) in tiles of at
// most 32 rows, and in at least enough tiles that num_threads threads all get a (tile, KV head) item over num_kv
// heads. run: the tile's run, numbered from 0 in row order.
struct PrefillTile {
  int64_t row, rows, run;
};
std::vector<PrefillTile> prefill_tiles(const int64_t* seqs, const int64_t* lens, int64_t first, int64_t num_rows,
                                       int64_t num_kv, int64_t num_threads);

// A thread's buffers for attend_prefill_tile(), kept between calls (they grow to the largest tile's and stay).
struct PrefillScratch {
  struct Buffers;
  std::unique_ptr<Buffers> buffers;
  PrefillScratch();
  PrefillScratch(PrefillScratch&&) noexcept;
  ~PrefillScratch();
};

// paged_attention.cpp. One prefill tile for KV head h, as paged_attention() computes it (the same bits): rows r0 ..
// r0 + n_rows - 1 of q [T, Hq, D] BF16, all of one sequence (table: its block ids), each attending over its keys 0 ..
// lens[row] - 1 of k_head, v_head ([num_blocks, block_size, D]); writes those rows' G heads of out [T, Hq, D]. Raises
// std::bad_alloc where its buffers cannot grow.
void attend_prefill_tile(const at::BFloat16* q, const at::BFloat16* k_head, const at::BFloat16* v_head,
                         const int64_t* table, const int64_t* lens, int64_t r0, int64_t n_rows, int64_t num_heads,
                         int64_t h, int64_t group, int64_t d, int64_t block_size, float scale, at::BFloat16* out,
                         PrefillScratch& scratch);

// decode_stack.cpp: every layer of a Llama-family decoder for a step of decode rows (one query row per sequence) and
// prefill rows in one call, on the CPU path of inferd's BF16 GEMM. Built once per model from its weights (checked
// here); run() per step. See decode_stack.cpp.
class DecodeStack {
 public:
  // weights: 6 per layer, in order: input_layernorm [H], post_attention_layernorm [H] (BF16), then the packed
  // panels ([ceil(N / 16), K, 8, 2] BF16, see pack_panels) of QKV ([(Hq + 2 Hkv) D] x H), o (H x Hq D),
  // gate_up (2 I x H) and down (H x I). qkv_bias: empty, or one [(Hq + 2 Hkv) D] tensor per layer. final_norm:
  // [H] BF16. Raises c10::Error (RuntimeError in Python) on shapes or dtypes that do not fit together.
  DecodeStack(const std::vector<at::Tensor>& weights, const std::vector<at::Tensor>& qkv_bias,
              const at::Tensor& final_norm, int64_t num_heads, int64_t num_kv, int64_t head_dim, double eps,
              double scale);

  // h: [T, H] FP32 residual stream (the embeddings), updated in place; cos, sin: [T, D] BF16; k_caches, v_caches:
  // one [Hkv, num_blocks, block_size, D] BF16 tensor per layer; slots: [T] int64 KV-cache slot of each row;
  // block_tables: [S, max_blocks] int64; seq_idx: [T] int64 (each row's row of block_tables); context_lens: [T]
  // int64 (position + 1); num_decode: the first rows that are decode rows (one per sequence), the others prefill
  // rows (a sequence's consecutive positions on consecutive rows, as paged_attention() takes them).
  // Returns the final RMSNorm of the residual stream, [T, H] BF16. Raises c10::Error on shapes, slots, sequence
  // indices, lengths or block ids out of range (nothing is read or written outside).
  at::Tensor run(at::Tensor& h, const at::Tensor& cos, const at::Tensor& sin, const std::vector<at::Tensor>& k_caches,
                 const std::vector<at::Tensor>& v_caches, const at::Tensor& slots, const at::Tensor& block_tables,
                 const at::Tensor& seq_idx, const at::Tensor& context_lens, int64_t num_decode) const;

 private:
  std::vector<at::Tensor> weights_, bias_;
  at::Tensor final_norm_;
  int64_t layers_, hidden_, inter_, heads_, kv_, d_, qkv_n_;
  double eps_;
  float scale_;
};

}  // namespace inferd
