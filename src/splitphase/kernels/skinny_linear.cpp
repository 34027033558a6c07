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
#include <functional>
#include <type_traits>

#include "ops.h"
#include "pool.h"
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define SPLITPHASE_AVX512 1
#include "simd.h"
#endif

namespace {

constexpr int kMaxRows = 64;  // rows of x a call takes (decode batch)
constexpr int64_t kGrainRows = 16;

#if SPLITPHASE_AVX512
using splitphase_simd::load16;
using splitphase_simd::load_tail;
using splitphase_simd::reduce4;

// out[r] = dot(w + r * stride, x) for four weight rows and one x row: four memory streams at
// once (more misses in flight than one row at a time), x loaded once for all four.
template <typename W, typename X>
inline void dot_4rows1(const W* w, int64_t stride, const X* x, int64_t k, float* out) {
  __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  int64_t i = 0;
  for (; i + 16 <= k; i += 16) {
    __m512 xv = load16(x + i);
    a0 = _mm512_fmadd_ps(load16(w + i), xv, a0);
    a1 = _mm512_fmadd_ps(load16(w + stride + i), xv, a1);
    a2 = _mm512_fmadd_ps(load16(w + 2 * stride + i), xv, a2);
    a3 = _mm512_fmadd_ps(load16(w + 3 * stride + i), xv, a3);
  }
  if (i < k) {
    __m512 xv = load_tail(x + i, k - i);
    a0 = _mm512_fmadd_ps(load_tail(w + i, k - i), xv, a0);
    a1 = _mm512_fmadd_ps(load_tail(w + stride + i, k - i), xv, a1);
    a2 = _mm512_fmadd_ps(load_tail(w + 2 * stride + i, k - i), xv, a2);
    a3 = _mm512_fmadd_ps(load_tail(w + 3 * stride + i, k - i), xv, a3);
  }
  reduce4(a0, a1, a2, a3, out);
}

// acc[b] = dot(w, x[b]) for b < nb (nb <= 4), x rows fp32 with stride k. Every path sums a
// (row, x-row) dot in the same order (one 16-lane accumulator, then the tail), so a row's
// result does not depend on how many rows share the call: batch-invariant decode.
template <typename W, typename X>
inline void dot_rows4(const W* w, const X* x, int64_t k, int nb, float* out) {
  __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  int64_t i = 0;
  for (; i + 16 <= k; i += 16) {
    __m512 wv = load16(w + i);
    a0 = _mm512_fmadd_ps(wv, load16(x + i), a0);
    if (nb > 1) a1 = _mm512_fmadd_ps(wv, load16(x + k + i), a1);
    if (nb > 2) a2 = _mm512_fmadd_ps(wv, load16(x + 2 * k + i), a2);
    if (nb > 3) a3 = _mm512_fmadd_ps(wv, load16(x + 3 * k + i), a3);
  }
  if (i < k) {
    __m512 wv = load_tail(w + i, k - i);
    a0 = _mm512_fmadd_ps(wv, load_tail(x + i, k - i), a0);
    if (nb > 1) a1 = _mm512_fmadd_ps(wv, load_tail(x + k + i, k - i), a1);
    if (nb > 2) a2 = _mm512_fmadd_ps(wv, load_tail(x + 2 * k + i, k - i), a2);
    if (nb > 3) a3 = _mm512_fmadd_ps(wv, load_tail(x + 3 * k + i, k - i), a3);
  }
  float s[4];
  reduce4(a0, a1, a2, a3, s);
  for (int b = 0; b < nb; ++b) out[b] = s[b];
}
// out[b][r] = dot(w + r * stride, x + b * k) for four weight rows and NB <= 4 x rows: a 4 x NB
// tile of independent accumulators (4 * NB FMA chains keep both FMA ports busy, where one
// weight row at a time had at most 4 dependent chains) and four weight streams in flight. Each
// (row, x-row) pair sums in dot_rows4's order (one 16-lane accumulator in k order, the tail,
// reduce4), so a result does not depend on how rows are grouped (batch-invariant).
template <int NB, bool kPrefetch>
inline void dot_4rows_tile(const float* w, int64_t stride, const float* x, int64_t k,
                           float (*out)[4]) {
  __m512 a[NB][4];
  for (int b = 0; b < NB; ++b)
    for (int r = 0; r < 4; ++r) a[b][r] = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= k; i += 16) {
    __m512 wv[4];
    for (int r = 0; r < 4; ++r) {
      if (kPrefetch) _mm_prefetch(reinterpret_cast<const char*>(w + r * stride + i) + 1024, _MM_HINT_T0);
      wv[r] = load16(w + r * stride + i);
    }
    for (int b = 0; b < NB; ++b) {
      __m512 xv = load16(x + b * k + i);
      for (int r = 0; r < 4; ++r) a[b][r] = _mm512_fmadd_ps(wv[r], xv, a[b][r]);
    }
  }
  if (i < k) {
    __m512 wv[4];
    for (int r = 0; r < 4; ++r) wv[r] = load_tail(w + r * stride + i, k - i);
    for (int b = 0; b < NB; ++b) {
      __m512 xv = load_tail(x + b * k + i, k - i);
      for (int r = 0; r < 4; ++r) a[b][r] = _mm512_fmadd_ps(wv[r], xv, a[b][r]);
    }
  }
  for (int b = 0; b < NB; ++b) reduce4(a[b][0], a[b][1], a[b][2], a[b][3], out[b]);
}

// out[b][r] for all nb x rows, four at a time: the four weight rows come from L1 after the
// first group.
inline void dot_4rows_all(const float* w, int64_t stride, const float* x, int64_t k, int nb,
                          float (*out)[4]) {
  // The first group pulls the weight rows in (prefetched ahead); the others find them in L1.
  switch (std::min(nb, 4)) {
    case 4: dot_4rows_tile<4, true>(w, stride, x, k, out); break;
    case 3: dot_4rows_tile<3, true>(w, stride, x, k, out); break;
    case 2: dot_4rows_tile<2, true>(w, stride, x, k, out); break;
    default: dot_4rows_tile<1, true>(w, stride, x, k, out); break;
  }
  int b = 4;
  for (; b + 4 <= nb; b += 4) dot_4rows_tile<4, false>(w, stride, x + b * k, k, out + b);
  switch (nb > b ? nb - b : 0) {
    case 3: dot_4rows_tile<3, false>(w, stride, x + b * k, k, out + b); break;
    case 2: dot_4rows_tile<2, false>(w, stride, x + b * k, k, out + b); break;
    case 1: dot_4rows_tile<1, false>(w, stride, x + b * k, k, out + b); break;
    default: break;
  }
}
#define SPLITPHASE_FP32_TILE 1

#if defined(__AVX512BF16__)
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
// than the hardware prefetcher alone on bf16 rows of 768 (256 to 1024 bytes tried; eight
// rows a group instead of four was no faster).
constexpr int kPrefetchBytes = 512;

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
#endif
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

// The same for several x rows: fp32 takes 4 x nb tiles over four runs of rows read side by side
// (the stream layout of rows1); a row's sums are those of rows_each.
template <typename T>
void rows_n(const T* w, const T* x, int64_t k, int nb, int64_t lo, int64_t hi, int64_t width,
            T* y) {
#if defined(SPLITPHASE_FP32_TILE)
  if constexpr (std::is_same_v<T, float>) {
    const int64_t run = (hi - lo) / 4;
    float acc[kMaxRows][4];
    for (int64_t i = 0; i < run; ++i) {
      dot_4rows_all(w + (lo + i) * k, run * k, x, k, nb, acc);
      for (int b = 0; b < nb; ++b)
        for (int r = 0; r < 4; ++r) y[b * width + lo + r * run + i] = acc[b][r];
    }
    lo += 4 * run;
  }
#endif
  rows_each(w, x, k, nb, lo, hi, width, y);
}

// x is read in its own dtype (T): a bf16 x needs no fp32 copy, every kernel widens it exactly.
template <typename T>
void linear_impl(const T* x, int nb, int64_t k, at::TensorList ws, std::vector<at::Tensor>& ys) {
  std::vector<int64_t> start(ws.size() + 1, 0);
  std::vector<const T*> wp(ws.size());
  std::vector<T*> yp(ws.size());
  for (size_t j = 0; j < ws.size(); ++j) {
    start[j + 1] = start[j] + ws[j].size(0);
    wp[j] = ws[j].data_ptr<T>();
    yp[j] = ys[j].data_ptr<T>();
  }
  // One parallel range over the rows of all weights: each thread streams its share.
  splitphase_pool::parallel_chunks(start.back(), kGrainRows, nb, [&](int64_t begin, int64_t end) {
    if (nb == 1) {
      for (size_t j = 0; j < ws.size(); ++j) {  // the part of the chunk in each weight
        int64_t lo = std::max(begin, start[j]), hi = std::min(end, start[j + 1]);
        if (lo < hi) rows1(wp[j], x, k, lo - start[j], hi - start[j], yp[j]);
      }
      return;
    }
    for (size_t j = 0; j < ws.size(); ++j) {
      int64_t lo = std::max(begin, start[j]), hi = std::min(end, start[j + 1]);
      if (lo < hi) rows_n(wp[j], x, k, nb, lo - start[j], hi - start[j], ws[j].size(0), yp[j]);
    }
  });
}

}  // namespace

namespace splitphase_ops {

// [x @ w.T for w in ws]: each output (rows, out_j) contiguous, one pass over every weight.
std::vector<at::Tensor> skinny_linear(const at::Tensor& x, at::TensorList ws) {
  check_inputs(x, ws);
  std::vector<at::Tensor> ys;
  for (const auto& w : ws) ys.push_back(at::empty({x.size(0), w.size(0)}, x.options()));
  auto xc = x.contiguous();
  int nb = static_cast<int>(x.size(0));
  if (x.scalar_type() == at::kFloat) {
    linear_impl<float>(xc.data_ptr<float>(), nb, x.size(1), ws, ys);
  } else if (x.scalar_type() == at::kBFloat16) {
    linear_impl<c10::BFloat16>(xc.data_ptr<c10::BFloat16>(), nb, x.size(1), ws, ys);
  } else {
    TORCH_CHECK(false, "skinny_linear supports float32 and bfloat16");
  }
  return ys;
}

}  // namespace splitphase_ops

TORCH_LIBRARY(splitphase, m) {
  m.def("skinny_linear(Tensor x, Tensor[] ws) -> Tensor[]");
}

TORCH_LIBRARY_IMPL(splitphase, CPU, m) {
  m.impl("skinny_linear", &splitphase_ops::skinny_linear);
}
