// Skinny matrix products for the decode phase: y = x W^T for a few rows of x (batch-1 to
// batch-64 decode), with W in nn.Linear's (out, in) layout. Each weight row is streamed from
// memory once per call and dotted with every row of x while it sits in L1. Output rows are
// shared out in small chunks over all intra-op threads (pool.h), so every core pulls weight
// bytes.
// Several weights can share one call (fused QKV, SwiGLU's gate and up). Accumulation is fp32
// for fp32 and bf16 weights alike, as in torch's CPU linear.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <functional>
#include <type_traits>

#include "amx_tiles.h"
#include "ops.h"
#include "pool.h"
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <vector>

#include "simd.h"
#if SPLITPHASE_AVX2
#include "skinny_outer_avx2.h"
#endif

namespace {

constexpr int kMaxRows = 64;  // rows of x a call takes (decode batch)
constexpr int64_t kGrainRows = 16;
// Four chunks a thread, not the pool's 32: a chunk restarts four weight streams and costs a
// claim, which dominated the small projections (an O projection of 768x768 bf16 is 1.2 MB,
// about 20 us). A b1 decode step of base-125m (context 512), old and new interleaved, took
// 0.80-0.92x the time in bf16 and 0.91-1.0x in fp32 on the Zen 5 host (2 and 8 a thread: no
// better), 0.87-0.94x and 0.97-1.0x on the Intel host; batch 8 0.95-1.02x. The price: a
// helper that loses its core holds up an eighth of a call, not 1/64.
constexpr int64_t kChunksPerThread = 4;

#if SPLITPHASE_SIMD
using splitphase_simd::fmadd;
using splitphase_simd::load16;
using splitphase_simd::load_tail;
using splitphase_simd::reduce4;
using splitphase_simd::vf;
using splitphase_simd::zero;

// out[r] = dot(w + r * stride, x) for four weight rows and one x row: four memory streams at
// once (more misses in flight than one row at a time), x loaded once for all four. For one
// block of a longer k (the AVX2 tile): the sums start from `from` (zero where null) and end
// in `to` (reduced into out where null). kAhead: prefetch the weight rows ahead.
template <typename W, typename X, bool kAhead = false>
inline void dot_4rows1(const W* w, int64_t stride, const X* x, int64_t k, float* out,
                       const vf* from = nullptr, vf* to = nullptr) {
  vf a0 = from ? from[0] : zero(), a1 = from ? from[1] : zero();
  vf a2 = from ? from[2] : zero(), a3 = from ? from[3] : zero();
  int64_t i = 0;
  for (; i + 16 <= k; i += 16) {
    if (kAhead) {
      for (int r = 0; r < 4; ++r)
        _mm_prefetch(reinterpret_cast<const char*>(w + r * stride + i) + 1024, _MM_HINT_T0);
    }
    vf xv = load16(x + i);
    a0 = fmadd(load16(w + i), xv, a0);
    a1 = fmadd(load16(w + stride + i), xv, a1);
    a2 = fmadd(load16(w + 2 * stride + i), xv, a2);
    a3 = fmadd(load16(w + 3 * stride + i), xv, a3);
  }
  if (i < k) {
    vf xv = load_tail(x + i, k - i);
    a0 = fmadd(load_tail(w + i, k - i), xv, a0);
    a1 = fmadd(load_tail(w + stride + i, k - i), xv, a1);
    a2 = fmadd(load_tail(w + 2 * stride + i, k - i), xv, a2);
    a3 = fmadd(load_tail(w + 3 * stride + i, k - i), xv, a3);
  }
  if (to != nullptr) {
    to[0] = a0, to[1] = a1, to[2] = a2, to[3] = a3;
  } else {
    reduce4(a0, a1, a2, a3, out);
  }
}

// acc[b] = dot(w, x[b]) for b < nb (nb <= 4), x rows fp32 with stride k. Every path sums a
// (row, x-row) dot in the same order (one 16-lane accumulator, then the tail), so a row's
// result does not depend on how many rows share the call: batch-invariant decode.
template <typename W, typename X>
inline void dot_rows4(const W* w, const X* x, int64_t k, int nb, float* out) {
  vf a0 = zero(), a1 = a0, a2 = a0, a3 = a0;
  int64_t i = 0;
  for (; i + 16 <= k; i += 16) {
    vf wv = load16(w + i);
    a0 = fmadd(wv, load16(x + i), a0);
    if (nb > 1) a1 = fmadd(wv, load16(x + k + i), a1);
    if (nb > 2) a2 = fmadd(wv, load16(x + 2 * k + i), a2);
    if (nb > 3) a3 = fmadd(wv, load16(x + 3 * k + i), a3);
  }
  if (i < k) {
    vf wv = load_tail(w + i, k - i);
    a0 = fmadd(wv, load_tail(x + i, k - i), a0);
    if (nb > 1) a1 = fmadd(wv, load_tail(x + k + i, k - i), a1);
    if (nb > 2) a2 = fmadd(wv, load_tail(x + 2 * k + i, k - i), a2);
    if (nb > 3) a3 = fmadd(wv, load_tail(x + 3 * k + i, k - i), a3);
  }
  float s[4];
  reduce4(a0, a1, a2, a3, s);
  for (int b = 0; b < nb; ++b) out[b] = s[b];
}
#if SPLITPHASE_AVX2
// Calls of at least this many rows take the outer-product tile (skinny_outer_avx2.h; 0: none;
// skinny.OUTER_MIN_ROWS). It pads x to a multiple of 8 rows, so 9-15 rows to 16, which below
// 12 costs more than the tiles gain: base-125m's layer linears at 9-10 rows took 1.08-1.20x
// the dot tile's time, at 11-12 the same. At exactly 8 the narrow tile alone took 0.87-0.90x:
// not enough to split the row counts that share a result (skinny_outer_avx2.h) in two ranges.
std::atomic<int64_t>& outer_min_rows() {
  static std::atomic<int64_t> rows{12};
  return rows;
}

// The AVX2 tile: 4 weight rows x 1 x row, with k in blocks. Of 16 ymm registers a 4 x 1 tile
// of 16 lanes (eight accumulators, weights as memory operands) is the largest that does not
// spill, so a weight row is reused by one x row at a time, and must still be in L1 for the
// next: four rows of a 3072-wide fp32 weight (48 KiB) are not, and that weight ran at 72
// GFLOP/s at 32-64 rows against 125-134 for 768-wide ones. Blocks of kBlockK keep them there.
// Each (row, x row) accumulator is carried across blocks, so it sums the same 16-lane steps in
// the same order as dot_rows4 and dot_4rows1 (batch-invariant). x is fp32 here (bf16 widened
// once a call).
constexpr int64_t kBlockK = 768;  // a multiple of 16: only the last block has a tail

// The four bf16 rows of a block as fp32 in buf (rows kBlockK apart), prefetched ahead: the
// widening, two instructions a vector, then costs once a block instead of once an x row.
inline void widen_block(const c10::BFloat16* w, int64_t stride, int64_t kb, float* buf) {
  for (int r = 0; r < 4; ++r) {
    int64_t i = 0;
    for (; i + 16 <= kb; i += 16) {
      _mm_prefetch(reinterpret_cast<const char*>(w + r * stride + i) + 1024, _MM_HINT_T0);
      splitphase_simd::store16(buf + r * kBlockK + i, load16(w + r * stride + i));
    }
    for (; i < kb; ++i) buf[r * kBlockK + i] = static_cast<float>(w[r * stride + i]);
  }
}

// out[b][r] for all nb x rows: per block, the first x row pulls the four weight rows in
// (prefetched ahead), the others find them in L1; bf16 rows are widened into a block buffer
// first (exactly, so the sums are the same). Sums between blocks wait in acc (a 768-wide
// weight, one block, never touches it: it would share L1 with the weight rows).
template <typename W>
inline void dot_4rows_all(const W* w, int64_t stride, const float* x, int64_t k, int nb,
                          float (*out)[4]) {
  vf acc[kMaxRows][4];
  alignas(64) float wbuf[4 * kBlockK];
  for (int64_t k0 = 0; k0 < k; k0 += kBlockK) {
    const int64_t kb = std::min(kBlockK, k - k0);
    const bool first = k0 == 0, last = k0 + kb == k;
    for (int b = 0; b < nb; ++b) {
      const vf* from = first ? nullptr : acc[b];
      vf* to = last ? nullptr : acc[b];
      const float* xb = x + b * k + k0;
      if constexpr (std::is_same_v<W, c10::BFloat16>) {
        if (b == 0) widen_block(w + k0, stride, kb, wbuf);
        dot_4rows1(wbuf, kBlockK, xb, kb, out[b], from, to);
      } else if (b == 0) {
        dot_4rows1<W, float, true>(w + k0, stride, xb, kb, out[b], from, to);
      } else {
        dot_4rows1(w + k0, stride, xb, kb, out[b], from, to);
      }
    }
  }
}
#else
// out[b][r] = dot(w + r * stride, x + b * k) for four weight rows and NB <= 4 x rows: a 4 x NB
// tile of independent accumulators (4 * NB multiply-add chains keep both FMA ports busy, where
// one weight row at a time had at most 4 dependent chains) and four weight streams in flight.
// Each (row, x-row) pair sums in its dtype's dot_rows4 order (one 16-lane accumulator over
// Step's vectors in k order, the tail, reduce4), so a result does not depend on how rows are
// grouped (batch-invariant). Step: the element type's vector load and multiply-add.
template <typename Step, int NB, bool kAhead>
inline void dot_4rows_tile(const typename Step::T* w, int64_t stride, const typename Step::T* x,
                           int64_t k, float (*out)[4]) {
  constexpr int64_t kLanes = Step::kLanes;
  vf a[NB][4];
  for (int b = 0; b < NB; ++b)
    for (int r = 0; r < 4; ++r) a[b][r] = zero();
  int64_t i = 0;
  for (; i + kLanes <= k; i += kLanes) {
    typename Step::V wv[4];
    for (int r = 0; r < 4; ++r) {
      if (kAhead) {  // the first x group: the weight rows come from memory
        _mm_prefetch(reinterpret_cast<const char*>(w + r * stride + i) + Step::kPrefetch,
                     _MM_HINT_T0);
      }
      wv[r] = Step::load(w + r * stride + i);
    }
    for (int b = 0; b < NB; ++b) {
      typename Step::V xv = Step::load(x + b * k + i);
      for (int r = 0; r < 4; ++r) a[b][r] = Step::madd(a[b][r], wv[r], xv);
    }
  }
  if (i < k) {
    typename Step::V wv[4];
    for (int r = 0; r < 4; ++r) wv[r] = Step::tail(w + r * stride + i, k - i);
    for (int b = 0; b < NB; ++b) {
      typename Step::V xv = Step::tail(x + b * k + i, k - i);
      for (int r = 0; r < 4; ++r) a[b][r] = Step::madd(a[b][r], wv[r], xv);
    }
  }
  for (int b = 0; b < NB; ++b) reduce4(a[b][0], a[b][1], a[b][2], a[b][3], out[b]);
}

// out[b][r] for all nb x rows, four at a time: the first group pulls the four weight rows in
// (prefetched ahead), the others find them in L1.
template <typename Step>
inline void dot_4rows_all(const typename Step::T* w, int64_t stride, const typename Step::T* x,
                          int64_t k, int nb, float (*out)[4]) {
  switch (std::min(nb, 4)) {
    case 4: dot_4rows_tile<Step, 4, true>(w, stride, x, k, out); break;
    case 3: dot_4rows_tile<Step, 3, true>(w, stride, x, k, out); break;
    case 2: dot_4rows_tile<Step, 2, true>(w, stride, x, k, out); break;
    default: dot_4rows_tile<Step, 1, true>(w, stride, x, k, out); break;
  }
  int b = 4;
  for (; b + 4 <= nb; b += 4) dot_4rows_tile<Step, 4, false>(w, stride, x + b * k, k, out + b);
  switch (nb > b ? nb - b : 0) {
    case 3: dot_4rows_tile<Step, 3, false>(w, stride, x + b * k, k, out + b); break;
    case 2: dot_4rows_tile<Step, 2, false>(w, stride, x + b * k, k, out + b); break;
    case 1: dot_4rows_tile<Step, 1, false>(w, stride, x + b * k, k, out + b); break;
    default: break;
  }
}
#endif

// fp32: 16 lanes a step, FMA.
struct F32Step {
  using T = float;
  using V = vf;
  static constexpr int64_t kLanes = 16;
  static constexpr int kPrefetch = 1024;  // bytes ahead in each weight stream
  static V load(const float* p) { return load16(p); }
  static V tail(const float* p, int64_t n) { return load_tail(p, n); }
  static vf madd(vf acc, V w, V x) { return fmadd(w, x, acc); }
};

#if SPLITPHASE_AVX512 && defined(__AVX512BF16__)
// bf16 weights and bf16 x: VDPBF16PS multiplies 32 bf16 pairs a step (products exact, fp32
// sums), so a weight byte costs a fraction of an instruction and the stream stays
// memory-bound. x is read as the bf16 it is (no widening to fp32 and narrowing back per
// weight row): a step is one x load and one VDPBF16PS per weight row.
inline __mmask32 pair_mask(int64_t n) { return static_cast<__mmask32>((1ull << n) - 1); }
inline __m512bh pairs(const c10::BFloat16* p) { return (__m512bh)_mm512_loadu_si512(p); }
inline __m512bh pairs_tail(const c10::BFloat16* p, int64_t n) {  // n < 32, zeros after
  return (__m512bh)_mm512_maskz_loadu_epi16(pair_mask(n), p);
}

// Software prefetch this far ahead in each of the four weight streams: measured 4-7% faster
// than the hardware prefetcher alone on bf16 rows of 768 on the Intel host (256 to 1024 bytes
// tried; eight rows a group instead of four was no faster). On the Zen 5 host, with the
// coarser chunks, 768-1024 was best at batch 1 (1536 slower) and 1024 at batches 2-4 (512:
// 4-10% slower); on the Intel host with those chunks 512 took 2-6% longer at b1.
constexpr int kPrefetchBytes = 1024;

// out[r] = dot(w + r * stride, x) for four weight rows: four streams in flight, x loaded
// once for all. Each row sums 32-lane steps in k order, then the tail, then reduce4: the
// order of dot_rows4, so a row's result does not depend on the grouping (batch-invariant).
inline void dot_4rows1(const c10::BFloat16* w, int64_t stride, const c10::BFloat16* x, int64_t k,
                       float* out) {
  __m512 a[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(),
                 _mm512_setzero_ps()};
  int64_t i = 0;
  for (; i + 32 <= k; i += 32) {
    __m512bh xv = pairs(x + i);
    for (int r = 0; r < 4; ++r) {
      _mm_prefetch(reinterpret_cast<const char*>(w + r * stride + i) + kPrefetchBytes, _MM_HINT_T0);
      a[r] = _mm512_dpbf16_ps(a[r], pairs(w + r * stride + i), xv);
    }
  }
  if (i < k) {
    __m512bh xv = pairs_tail(x + i, k - i);
    for (int r = 0; r < 4; ++r)
      a[r] = _mm512_dpbf16_ps(a[r], pairs_tail(w + r * stride + i, k - i), xv);
  }
  reduce4(a[0], a[1], a[2], a[3], out);
}

inline void dot_rows4(const c10::BFloat16* w, const c10::BFloat16* x, int64_t k, int nb,
                      float* out) {
  __m512 a[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(),
                 _mm512_setzero_ps()};
  int64_t i = 0;
  for (; i + 32 <= k; i += 32) {
    __m512bh wv = pairs(w + i);
    for (int b = 0; b < nb; ++b) a[b] = _mm512_dpbf16_ps(a[b], wv, pairs(x + b * k + i));
  }
  if (i < k) {
    __m512bh wv = pairs_tail(w + i, k - i);
    for (int b = 0; b < nb; ++b)
      a[b] = _mm512_dpbf16_ps(a[b], wv, pairs_tail(x + b * k + i, k - i));
  }
  float s[4];
  reduce4(a[0], a[1], a[2], a[3], s);
  for (int b = 0; b < nb; ++b) out[b] = s[b];
}

// bf16: 32 lanes (16 pairs) a step, VDPBF16PS; the order of dot_rows4 and dot_4rows1 above.
struct Bf16Step {
  using T = c10::BFloat16;
  using V = __m512bh;
  static constexpr int64_t kLanes = 32;
  static constexpr int kPrefetch = kPrefetchBytes;
  static V load(const c10::BFloat16* p) { return pairs(p); }
  static V tail(const c10::BFloat16* p, int64_t n) { return pairs_tail(p, n); }
  static __m512 madd(__m512 acc, V w, V x) { return _mm512_dpbf16_ps(acc, w, x); }
};
#define SPLITPHASE_BF16_TILE 1
#endif
#define SPLITPHASE_FP32_TILE 1
#else
template <typename W, typename X>
inline void dot_4rows1(const W* w, int64_t stride, const X* x, int64_t k, float* out) {
  for (int r = 0; r < 4; ++r) {
    float s = 0.f;
    for (int64_t i = 0; i < k; ++i)
      s += static_cast<float>(w[r * stride + i]) * static_cast<float>(x[i]);
    out[r] = s;
  }
}

template <typename W, typename X>
inline void dot_rows4(const W* w, const X* x, int64_t k, int nb, float* out) {
  for (int b = 0; b < nb; ++b) {
    float s = 0.f;
    for (int64_t i = 0; i < k; ++i)
      s += static_cast<float>(w[i]) * static_cast<float>(x[b * k + i]);
    out[b] = s;
  }
}
#endif

// out[b] = dot(w, x[b]) for all b < nb (any nb <= kMaxRows).
template <typename W, typename X>
inline void dot_rows(const W* w, const X* x, int64_t k, int nb, float* out) {
  for (int b = 0; b < nb; b += 4) dot_rows4(w, x + b * k, k, std::min(4, nb - b), out + b);
}

void check_inputs(const at::Tensor& x, at::TensorList ws) {
  TORCH_CHECK(x.dim() == 2 && x.size(0) <= kMaxRows, "x must be (rows <= 64, in_features)");
  TORCH_CHECK(!ws.empty(), "at least one weight");
  for (const auto& w : ws) {
    TORCH_CHECK(w.dim() == 2 && w.size(1) == x.size(1), "weight must be (out, in_features)");
    TORCH_CHECK(w.is_contiguous() && w.scalar_type() == x.scalar_type(), "contiguous, x's dtype");
    TORCH_CHECK(w.device().is_cpu(), "CPU tensors only");
  }
}

// y[lo..hi) = w[lo..hi) x for one x row. The rows are split into four equal runs read side
// by side (four streams in flight, x loaded once for all four), each run walking its rows in
// memory order: four long sequential streams, where four adjacent rows at a time made a new
// short stream every group (24 cache lines a bf16 row of 768), paying the prefetchers'
// ramp-up again each time. A row's sum does not depend on which path takes it.
template <typename T>
void rows1(const T* w, const T* x, int64_t k, int64_t lo, int64_t hi, T* y) {
  const int64_t run = (hi - lo) / 4;
  float acc[4];
  for (int64_t i = 0; i < run; ++i) {
    dot_4rows1(w + (lo + i) * k, run * k, x, k, acc);
    for (int r = 0; r < 4; ++r) y[lo + r * run + i] = static_cast<T>(acc[r]);
  }
  for (int64_t n = lo + 4 * run; n < hi; ++n) {
    dot_rows(w + n * k, x, k, 1, acc);
    y[n] = static_cast<T>(acc[0]);
  }
}

// y[b * width + n] for n in [lo, hi) and every x row b < nb: one weight row at a time, each
// dotted with all x rows while it sits in L1.
template <typename T>
void rows_each(const T* w, const T* x, int64_t k, int nb, int64_t lo, int64_t hi, int64_t width,
               T* y) {
  float acc[kMaxRows];
  for (int64_t n = lo; n < hi; ++n) {
    dot_rows(w + n * k, x, k, nb, acc);
    for (int b = 0; b < nb; ++b) y[b * width + n] = static_cast<T>(acc[b]);
  }
}

// The same for several x rows: 4 x nb tiles over four runs of rows read side by side (the
// stream layout of rows1), the rows the runs leave by rows_each; a row's sums are the same
// either way. Tile: dot_4rows_all's template argument (the weight type on AVX2, a Step on
// AVX-512); X: x's type there (fp32 on AVX2).
#if SPLITPHASE_SIMD
template <typename Tile, typename T, typename X>
int64_t rows_tiled(const T* w, const X* x, int64_t k, int nb, int64_t lo, int64_t hi,
                   int64_t width, T* y) {
  const int64_t run = (hi - lo) / 4;
  float acc[kMaxRows][4];
  for (int64_t i = 0; i < run; ++i) {
    dot_4rows_all<Tile>(w + (lo + i) * k, run * k, x, k, nb, acc);
    for (int b = 0; b < nb; ++b)
      for (int r = 0; r < 4; ++r) y[b * width + lo + r * run + i] = static_cast<T>(acc[b][r]);
  }
  return lo + 4 * run;  // the rows left for rows_each
}
#endif

// xf: x as fp32 (x itself where T is float), read by the AVX2 tile.
template <typename T>
void rows_n(const T* w, const T* x, const float* xf, int64_t k, int nb, int64_t lo, int64_t hi,
            int64_t width, T* y) {
#if SPLITPHASE_AVX2
  lo = rows_tiled<T>(w, xf, k, nb, lo, hi, width, y);
#else
  (void)xf;
#if defined(SPLITPHASE_FP32_TILE)
  if constexpr (std::is_same_v<T, float>) lo = rows_tiled<F32Step>(w, x, k, nb, lo, hi, width, y);
#endif
#if defined(SPLITPHASE_BF16_TILE)
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    lo = rows_tiled<Bf16Step>(w, x, k, nb, lo, hi, width, y);
  }
#endif
#endif
  rows_each(w, x, k, nb, lo, hi, width, y);
}

// x as fp32 for rows_n: x itself, or (AVX2, several bf16 rows) a widened copy in buf.
template <typename T>
const float* x_as_fp32(const T* x, int nb, int64_t k, std::vector<float>& buf) {
  if constexpr (std::is_same_v<T, float>) {
    return x;
  } else {
#if SPLITPHASE_AVX2
    if (nb > 1) {
      buf.resize(static_cast<size_t>(nb * k));
      for (int64_t i = 0; i < nb * k; ++i) buf[i] = static_cast<float>(x[i]);
      return buf.data();
    }
#else
    (void)nb, (void)k, (void)buf;
#endif
    return nullptr;
  }
}

// x is read in its own dtype (T), except by the AVX2 tile, which reads a widened fp32 copy
// of a bf16 x (x_as_fp32); widening is exact, so every path gives the same sums.
template <typename T>
void linear_impl(const T* x, int nb, int64_t k, at::TensorList ws, std::vector<at::Tensor>& ys,
                 int64_t team_rows) {
  std::vector<int64_t> start(ws.size() + 1, 0);
  std::vector<const T*> wp(ws.size());
  std::vector<T*> yp(ws.size());
  for (size_t j = 0; j < ws.size(); ++j) {
    start[j + 1] = start[j] + ws[j].size(0);
    wp[j] = ws[j].data_ptr<T>();
    yp[j] = ys[j].data_ptr<T>();
  }
#if SPLITPHASE_AMX
  // Four chunks a thread here too: one took the same time at 8 and 16 rows (0.96-1.04x).
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    if (splitphase_amx::linear(x, nb, k, start, wp, yp, team_rows, kChunksPerThread)) return;
  }
#endif
  // Kept between calls: a widened or transposed x is up to 64 x k floats (786 KB at k = 3072),
  // a malloc and page faults every linear of every step otherwise. Only this thread writes it;
  // the helpers read it inside parallel_chunks, which returns before the next call.
  thread_local std::vector<float> xbuf;
#if SPLITPHASE_AVX2
  const int64_t outer_from = outer_min_rows().load(std::memory_order_relaxed);
  const bool outer = outer_from > 0 && nb >= outer_from;
  if (outer) splitphase_outer::transpose_x(x, nb, k, xbuf);
  const float* xf = outer ? xbuf.data() : x_as_fp32(x, nb, k, xbuf);
#else
  constexpr bool outer = false;
  const float* xf = x_as_fp32(x, nb, k, xbuf);
#endif
  // One parallel range over the rows of all weights: each thread streams its share.
  splitphase_pool::parallel_chunks(start.back(), kGrainRows, team_rows, [&](int64_t begin, int64_t end) {
    for (size_t j = 0; j < ws.size(); ++j) {  // the part of the chunk in each weight
      const int64_t lo = std::max(begin, start[j]) - start[j];
      const int64_t hi = std::min(end, start[j + 1]) - start[j];
      if (lo >= hi) continue;
      if (outer) {
#if SPLITPHASE_AVX2
        splitphase_outer::rows(wp[j], xf, nb, k, lo, hi, ws[j].size(0), yp[j]);
#endif
      } else if (nb == 1) {
        rows1(wp[j], x, k, lo, hi, yp[j]);
      } else {
        rows_n(wp[j], x, xf, k, nb, lo, hi, ws[j].size(0), yp[j]);
      }
    }
  }, kChunksPerThread);
}

}  // namespace

namespace splitphase_ops {

// [x @ w.T for w in ws]: each output (rows, out_j) contiguous, one pass over every weight.
// pass_rows, when larger than x's rows, is the tokens of the forward pass x ends (the LM head
// on a prefill's last rows): it picks the thread team as those tokens would (pool.h).
std::vector<at::Tensor> skinny_linear(const at::Tensor& x, at::TensorList ws, int64_t pass_rows) {
  check_inputs(x, ws);
  const int64_t team_rows = std::max<int64_t>(pass_rows, x.size(0));
  std::vector<at::Tensor> ys;
  for (const auto& w : ws) ys.push_back(at::empty({x.size(0), w.size(0)}, x.options()));
  auto xc = x.contiguous();
  int nb = static_cast<int>(x.size(0));
  if (x.scalar_type() == at::kFloat) {
    linear_impl<float>(xc.data_ptr<float>(), nb, x.size(1), ws, ys, team_rows);
  } else if (x.scalar_type() == at::kBFloat16) {
    linear_impl<c10::BFloat16>(xc.data_ptr<c10::BFloat16>(), nb, x.size(1), ws, ys, team_rows);
  } else {
    TORCH_CHECK(false, "skinny_linear supports float32 and bfloat16");
  }
  return ys;
}

// Calls over at most `rows` rows run on the helper threads, larger ones on torch's OpenMP team.
static void set_helper_max_rows(int64_t rows) {
  splitphase_pool::helper_max_rows().store(rows, std::memory_order_relaxed);
}

// Calls of at least `rows` rows take the AVX2 outer-product tile (0: never); returns whether
// this build has it.
static bool set_outer_min_rows(int64_t rows) {
#if SPLITPHASE_AVX2
  outer_min_rows().store(rows, std::memory_order_relaxed);
  return true;
#else
  (void)rows;
  return false;
#endif
}

// bf16 calls of at least `rows` rows (up to 32) take AMX tiles where built and permitted
// (0: never); returns whether this build and process have them.
static bool set_amx_min_rows(int64_t rows) {
#if SPLITPHASE_AMX
  splitphase_amx::min_rows().store(rows, std::memory_order_relaxed);
  return splitphase_amx::permitted();
#else
  (void)rows;
  return false;
#endif
}

}  // namespace splitphase_ops

TORCH_LIBRARY(splitphase, m) {
  m.def("skinny_linear(Tensor x, Tensor[] ws, int pass_rows=0) -> Tensor[]");
  m.def("set_helper_max_rows(int rows) -> ()");
  m.def("set_amx_min_rows(int rows) -> bool");
  m.def("set_outer_min_rows(int rows) -> bool");
}

TORCH_LIBRARY_IMPL(splitphase, CPU, m) {
  m.impl("skinny_linear", &splitphase_ops::skinny_linear);
}

TORCH_LIBRARY_IMPL(splitphase, CatchAll, m) {
  m.impl("set_helper_max_rows", &splitphase_ops::set_helper_max_rows);
  m.impl("set_amx_min_rows", &splitphase_ops::set_amx_min_rows);
  m.impl("set_outer_min_rows", &splitphase_ops::set_outer_min_rows);
}
