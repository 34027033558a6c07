// The skinny kernel's dot products, for skinny_linear.cpp (which splits a call's weight rows
// over the threads and picks a tile by row count): a few weight rows dotted with a few x rows,
// every (weight row, x row) pair summed in one fixed order per dtype and ISA whatever the
// grouping, so a row's result does not depend on how many rows share the call. The portable
// SIMD dot tiles (simd.h's 16-lane vectors), the AVX2 tile with k in blocks, the AVX-512 tiles
// (fp32, and bf16 by VDPBF16PS), and scalar loops for a build with neither.
#pragma once
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "simd.h"

namespace {  // one translation unit includes it: no exported, interposable copies

constexpr int kMaxRows = 64;  // rows of x a call takes (decode batch)

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
#elif SPLITPHASE_AVX512
// bf16 on AVX-512 without VDPBF16PS (an Intel Xeon VM that hides AVX512-BF16): each vector
// widened to fp32 as it loads (exact) and multiplied as fp32, 16 lanes a step: dot_rows4's
// order. Without a tile, several bf16 rows took rows_each, one weight stream at a time.
struct Bf16Step {
  using T = c10::BFloat16;
  using V = vf;
  static constexpr int64_t kLanes = 16;
  static constexpr int kPrefetch = 1024;
  static V load(const c10::BFloat16* p) { return load16(p); }
  static V tail(const c10::BFloat16* p, int64_t n) { return load_tail(p, n); }
  static vf madd(vf acc, V w, V x) { return fmadd(w, x, acc); }
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

}  // namespace
