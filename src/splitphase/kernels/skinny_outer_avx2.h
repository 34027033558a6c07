// The skinny kernel's tile for 12 to 64 rows of x on AVX2 (no AVX-512): outer products. Its
// 4 x 1 dot tile (skinny_linear.cpp) loads five vectors for four multiply-adds, so at 16-64 rows
// it is bound by loads, not by the two FMA pipes: 78-116 GFLOP/s on the Zen 3 host where MKL's
// square GEMMs reach 180. Here x is transposed once a call into xt (k x mp, mp = rows rounded
// up to 16, zero-padded), and a tile is 16 x rows by 6 weight rows: per k, two x vectors and
// six broadcast weight scalars feed twelve multiply-adds (bench/outer_tile_ab.py; the figures
// are at skinny.OUTER_MIN_ROWS).
// Every output sums its k products in one lane, in k order, in chains of kChain added to a
// running total, whatever the row count: results do not depend on how many rows share the
// call, within this tile's rows (the dot tile below them sums in another order).
#pragma once
#include <c10/util/BFloat16.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "simd.h"

namespace splitphase_outer {
namespace {  // one translation unit includes it: no exported, interposable copies

constexpr int kRowsBlock = 16;  // x rows a tile: two ymm
constexpr int kCols = 6;        // weight rows a tile: 12 accumulators + 2 x + 1 broadcast
constexpr int64_t kOuterBlockK = 768;  // k a pass: a 6-row bf16 block widens to 18 KiB
constexpr int64_t kChain = 128;  // products a lane sums before adding them to its total

// xt's row length for nb rows of x.
inline int64_t padded_rows(int nb) { return (nb + kRowsBlock - 1) / kRowsBlock * kRowsBlock; }

// x (nb rows of k, row-major) as xt: k rows of mp floats, rows past nb zero.
template <typename T>
void transpose_x(const T* x, int nb, int64_t k, std::vector<float>& xt) {
  const int64_t mp = padded_rows(nb);
  xt.assign(static_cast<size_t>(k * mp), 0.f);
  for (int b = 0; b < nb; ++b)
    for (int64_t i = 0; i < k; ++i) xt[i * mp + b] = static_cast<float>(x[b * k + i]);
}

// out[i] = w[i] as fp32 for i < n (exact).
inline void widen(const c10::BFloat16* w, int64_t n, float* out) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) splitphase_simd::store16(out + i, splitphase_simd::load16(w + i));
  for (; i < n; ++i) out[i] = static_cast<float>(w[i]);
}

// t[j][r] (+)= sum over i < kb of w[j * stride + i] * xt[i * mp + r], r < 16, j < NB, in
// chains of kChain products added to t in turn: one chain over all of k (up to 3072 products)
// lost more precision than the dot tile's sixteen lanes (a row of 1800 was 1.5e-4 off torch's
// linear), and adding a chain costs twelve loads, adds and stores per 12 x kChain FMAs.
template <int NB>
inline void tile(const float* xt, int64_t mp, const float* w, int64_t stride, int64_t kb,
                 float* t, bool carry) {
  for (int64_t c = 0; c < kb; c += kChain) {
    const int64_t end = std::min(kb, c + kChain);
    // Unrolled by hand (the pragmas): a loop over j left the accumulators in memory, stored
    // every step, at half the rate.
    __m256 a0[NB], a1[NB];
#pragma GCC unroll 6
    for (int j = 0; j < NB; ++j) a0[j] = a1[j] = _mm256_setzero_ps();
    for (int64_t i = c; i < end; ++i) {
      const __m256 x0 = _mm256_loadu_ps(xt + i * mp), x1 = _mm256_loadu_ps(xt + i * mp + 8);
#pragma GCC unroll 6
      for (int j = 0; j < NB; ++j) {
        const __m256 b = _mm256_broadcast_ss(w + j * stride + i);
        a0[j] = _mm256_fmadd_ps(b, x0, a0[j]);
        a1[j] = _mm256_fmadd_ps(b, x1, a1[j]);
      }
    }
    const bool add = carry || c > 0;
#pragma GCC unroll 6
    for (int j = 0; j < NB; ++j) {
      float* tj = t + 16 * j;
      _mm256_storeu_ps(tj, add ? _mm256_add_ps(_mm256_loadu_ps(tj), a0[j]) : a0[j]);
      _mm256_storeu_ps(tj + 8, add ? _mm256_add_ps(_mm256_loadu_ps(tj + 8), a1[j]) : a1[j]);
    }
  }
}

// For every x block of 16 rows: acc[m block][j][r] (+)= the block's products, NB weight rows.
template <int NB>
inline void tile_rows(const float* xt, int64_t mp, const float* w, int64_t stride, int64_t kb,
                      float* acc, bool carry) {
  for (int64_t m0 = 0; m0 < mp; m0 += kRowsBlock)
    tile<NB>(xt + m0, mp, w, stride, kb, acc + m0 * kCols, carry);
}

// One block of k for weight rows [n0, n0 + nc), nc <= kCols, into acc (mp x kCols floats).
template <typename T>
void columns(const T* w, const float* xt, int64_t mp, int64_t k, int64_t k0, int64_t kb,
             int64_t n0, int nc, float* acc) {
  alignas(64) float wbuf[kCols * kOuterBlockK];
  const float* wp;
  int64_t stride = k;
  if constexpr (std::is_same_v<T, float>) {
    wp = w + n0 * k + k0;
  } else {  // bf16 rows widened once a block (exact), then read as fp32 by every x block
    for (int j = 0; j < nc; ++j) widen(w + (n0 + j) * k + k0, kb, wbuf + j * kOuterBlockK);
    wp = wbuf, stride = kOuterBlockK;
  }
  const float* xb = xt + k0 * mp;
  switch (nc) {
    case 6: tile_rows<6>(xb, mp, wp, stride, kb, acc, k0 > 0); break;
    case 5: tile_rows<5>(xb, mp, wp, stride, kb, acc, k0 > 0); break;
    case 4: tile_rows<4>(xb, mp, wp, stride, kb, acc, k0 > 0); break;
    case 3: tile_rows<3>(xb, mp, wp, stride, kb, acc, k0 > 0); break;
    case 2: tile_rows<2>(xb, mp, wp, stride, kb, acc, k0 > 0); break;
    default: tile_rows<1>(xb, mp, wp, stride, kb, acc, k0 > 0); break;
  }
}

// y[b * width + n] for n in [lo, hi) and every x row b < nb, from xt (transpose_x). k goes in
// blocks outside the weight rows, so one block of xt (768 x 64 rows: 192 KiB) stays in L2
// while the rows stream past; with k inside, a 3072-wide weight at 64 rows re-read all of xt
// (768 KiB, past L2) for every six rows and ran at 0.94x the dot tile's rate. The sums wait
// between blocks in acc, kept by the thread.
template <typename T>
void rows(const T* w, const float* xt, int nb, int64_t k, int64_t lo, int64_t hi, int64_t width,
          T* y) {
  const int64_t mp = padded_rows(nb);
  const int64_t blocks = (hi - lo + kCols - 1) / kCols;
  thread_local std::vector<float> acc;
  acc.resize(static_cast<size_t>(blocks * mp * kCols));
  for (int64_t k0 = 0; k0 < k; k0 += kOuterBlockK) {
    const int64_t kb = std::min(kOuterBlockK, k - k0);
    for (int64_t c = 0; c < blocks; ++c) {
      const int64_t n0 = lo + c * kCols;
      const int nc = static_cast<int>(std::min<int64_t>(kCols, hi - n0));
      columns(w, xt, mp, k, k0, kb, n0, nc, acc.data() + c * mp * kCols);
    }
  }
  for (int64_t c = 0; c < blocks; ++c) {
    const float* a = acc.data() + c * mp * kCols;
    const int64_t n0 = lo + c * kCols;
    const int nc = static_cast<int>(std::min<int64_t>(kCols, hi - n0));
    for (int b = 0; b < nb; ++b)
      for (int j = 0; j < nc; ++j)
        y[b * width + n0 + j] = static_cast<T>(a[(b / kRowsBlock) * kRowsBlock * kCols + 16 * j +
                                                 b % kRowsBlock]);
  }
}

}  // namespace
}  // namespace splitphase_outer
