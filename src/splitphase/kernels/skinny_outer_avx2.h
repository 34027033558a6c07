// The skinny kernel's tiles for 12 to 64 rows of x on AVX2 (no AVX-512): outer products. Its
// 4 x 1 dot tile (skinny_linear.cpp) loads five vectors for four multiply-adds, so at 16-64 rows
// it is bound by loads, not by the two FMA pipes: 78-116 GFLOP/s on the Zen 3 host where MKL's
// square GEMMs reach 180. Here x is transposed once a call into xt (k x mp, mp = rows rounded
// up to 8, zero-padded). The wide tile is 16 x rows by 6 weight rows: per k, two x vectors and
// six broadcast weight scalars feed twelve multiply-adds. Where 8 rows are left over (24, 40,
// 56 rows, which used to pad to 32, 48, 64) the narrow tile takes them: 8 x rows by 12 weight
// rows, one x vector and twelve broadcasts a k. Figures: bench/outer_tile_ab.py.
// Every output sums its k products in one lane, in k order, in chains of kChain added to a
// running total, in either tile and whatever the row count: results do not depend on how many
// rows share the call, within these tiles' rows (the dot tile below them sums in another order).
#pragma once
#include <c10/util/BFloat16.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <type_traits>
#include <vector>

#include "simd.h"

namespace splitphase_outer {
namespace {  // one translation unit includes it: no exported, interposable copies

constexpr int kRowsBlock = 16;  // x rows of the wide tile (two ymm); the narrow tile takes 8
constexpr int kWideCols = 6;    // weight rows of the wide tile: 12 accumulators + 2 x + 1 broadcast
constexpr int kCols = 12;       // weight rows of the narrow tile (12 + 1 + 1), two wide tiles'
constexpr int64_t kOuterBlockK = 768;  // k a pass
constexpr int64_t kChain = 128;  // products a lane sums before adding them to its total
constexpr int64_t kAskAheadRows = 32;  // wide-tile x rows up to which a group asks for the next

// xt's row length for nb rows of x: 16-row blocks and, where 8 rows are left, one of 8.
inline int64_t padded_rows(int nb) { return (nb + 7) / 8 * 8; }

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

// t[j * mp + r] (+)= sum over i < kb of w[j * stride + i] * xt[i * mp + r], for 8 * NX x rows r
// and NB weight rows j, in chains of kChain products added to t in turn: one chain over all of
// k (up to 3072 products) lost more precision than the dot tile's sixteen lanes (a row of 1800
// was 1.5e-4 off torch's linear), and adding a chain costs a load, add and store per
// accumulator per kChain FMAs. Both tiles do the same lane operations in the same order, so a
// row's result does not depend on which of them took it. ahead (or null): the next group's
// weight rows (same stride), asked for (prefetcht1) a line of each row every 16 k.
template <int NX, int NB>
inline void tile(const float* xt, int64_t mp, const float* w, int64_t stride, int64_t kb,
                 float* t, bool carry, const float* ahead) {
  for (int64_t c = 0; c < kb; c += kChain) {
    const int64_t end = std::min(kb, c + kChain);
    // Unrolled by hand (the pragmas): a loop over j left the accumulators in memory, stored
    // every step, at half the rate.
    __m256 a[NX][NB];
#pragma GCC unroll 12
    for (int j = 0; j < NB; ++j)
#pragma GCC unroll 2
      for (int v = 0; v < NX; ++v) a[v][j] = _mm256_setzero_ps();
    for (int64_t i = c; i < end; ++i) {
      if (ahead != nullptr && i % 16 == 0) {
#pragma GCC unroll 12
        for (int j = 0; j < NB; ++j)
          _mm_prefetch(reinterpret_cast<const char*>(ahead + j * stride + i), _MM_HINT_T1);
      }
      __m256 xv[NX];
#pragma GCC unroll 2
      for (int v = 0; v < NX; ++v) xv[v] = _mm256_loadu_ps(xt + i * mp + 8 * v);
#pragma GCC unroll 12
      for (int j = 0; j < NB; ++j) {
        const __m256 b = _mm256_broadcast_ss(w + j * stride + i);
#pragma GCC unroll 2
        for (int v = 0; v < NX; ++v) a[v][j] = _mm256_fmadd_ps(b, xv[v], a[v][j]);
      }
    }
    const bool add = carry || c > 0;
#pragma GCC unroll 12
    for (int j = 0; j < NB; ++j)
#pragma GCC unroll 2
      for (int v = 0; v < NX; ++v) {
        float* tj = t + j * mp + 8 * v;
        _mm256_storeu_ps(tj, add ? _mm256_add_ps(_mm256_loadu_ps(tj), a[v][j]) : a[v][j]);
      }
  }
}

// tile<NX, nc> for a run-time nc in [1, NB].
template <int NX, int NB>
inline void tile_cols(int nc, const float* xt, int64_t mp, const float* w, int64_t stride,
                      int64_t kb, float* t, bool carry, const float* ahead = nullptr) {
  if constexpr (NB > 1) {
    if (nc < NB) return tile_cols<NX, NB - 1>(nc, xt, mp, w, stride, kb, t, carry, ahead);
  }
  tile<NX, NB>(xt, mp, w, stride, kb, t, carry, ahead);
}

// The narrow tile's weight rows at a time for rows k floats apart. Addresses 4 KiB apart
// share a set of the 32 KiB 8-way L1, and twelve fp32 rows of a 3072-wide weight (12 KiB
// apart) all fall in one: read in place twelve at a time they evicted each other, and the down
// projection ran at 0.85x the rate of the wide tile padded to 16 rows; copied first, 0.83-0.87x
// (the copy's short runs from memory). Six rows and xt's line fit a set's eight ways: 1.3x (a
// one-thread harness over the tiles, 8 rows).
inline int narrow_cols(int64_t k) {
  const int64_t step = k * static_cast<int64_t>(sizeof(float)) % 4096;
  const int64_t sets = step == 0 ? 1 : 4096 / std::gcd(step, int64_t{4096});
  return (kCols + sets - 1) / sets > 4 ? kWideCols : kCols;
}

// acc (kCols x mp floats) (+)= kb of k for nc <= kCols weight rows (w, row stride `stride`):
// the wide tile over every 16 x rows, six weight rows at a time, then the narrow tile over the
// last 8 x rows if mp leaves them, `cols` weight rows at a time. Only the first 16 x rows of
// a group wait on its rows from memory, the others find them in L1; the last 16 ask for the
// next group's rows meanwhile, so memory works while they compute (where the next group lies
// within the ask_rows rows from w that this thread multiplies; 0: never). That paid up to 32
// x rows: base-125m's layer linears and LM head together (fp32, 12 layers, old and new code
// in turn) took 0.80-0.92x the time at 12-24 rows and 0.86-1.00x at 32; at 48 and 64 rows,
// where a group's rows serve three or four 16-row tiles, 0.95-1.06x. Rows 4 KiB apart (k a multiple of 1024: the down projection) do not ask
// (columns): in a one-thread harness the next rows, in the same L1 sets as the current ones,
// made the tile 5% slower.
inline void multiply(const float* xb, int64_t mp, const float* w, int64_t stride, int64_t kb,
                     int nc, float* acc, bool carry, int cols, int64_t ask_rows) {
  const int64_t wide_rows = mp / kRowsBlock * kRowsBlock;
  for (int j0 = 0; j0 < nc; j0 += kWideCols)
    for (int64_t m0 = 0; m0 < wide_rows; m0 += kRowsBlock) {
      const bool ahead = wide_rows <= kAskAheadRows && m0 + kRowsBlock == wide_rows &&
                         j0 + 2 * kWideCols <= ask_rows;
      tile_cols<2, kWideCols>(std::min(kWideCols, nc - j0), xb + m0, mp, w + j0 * stride, stride,
                              kb, acc + j0 * mp + m0, carry,
                              ahead ? w + (j0 + kWideCols) * stride : nullptr);
    }
  if (wide_rows == mp) return;
  for (int j0 = 0; j0 < nc; j0 += cols)
    tile_cols<1, kCols>(std::min(cols, nc - j0), xb + wide_rows, mp, w + j0 * stride, stride, kb,
                        acc + j0 * mp + wide_rows, carry);
}

// One block of k for weight rows [n0, n0 + nc) of the rows up to end into acc. fp32 rows are
// read in place; bf16 rows are widened (exact) once a block, then read as fp32 by every x
// block (256 of k at a time, to keep twelve widened rows in L1, was no faster at 16 and 32).
template <typename T>
void columns(const T* w, const float* xt, int64_t mp, int64_t k, int64_t k0, int64_t kb,
             int64_t n0, int nc, int64_t end, float* acc) {
  if constexpr (std::is_same_v<T, float>) {
    const bool aliased = k * static_cast<int64_t>(sizeof(float)) % 4096 == 0;
    multiply(xt + k0 * mp, mp, w + n0 * k + k0, k, kb, nc, acc, k0 > 0, narrow_cols(k),
             aliased ? 0 : end - n0);
  } else {
    alignas(64) float wbuf[kCols * kOuterBlockK];
    for (int j = 0; j < nc; ++j) widen(w + (n0 + j) * k + k0, kb, wbuf + j * kOuterBlockK);
    (void)end;
    multiply(xt + k0 * mp, mp, wbuf, kOuterBlockK, kb, nc, acc, k0 > 0, kCols, 0);
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
  acc.resize(static_cast<size_t>(blocks * kCols * mp));
  for (int64_t k0 = 0; k0 < k; k0 += kOuterBlockK) {
    const int64_t kb = std::min(kOuterBlockK, k - k0);
    for (int64_t c = 0; c < blocks; ++c) {
      const int64_t n0 = lo + c * kCols;
      const int nc = static_cast<int>(std::min<int64_t>(kCols, hi - n0));
      columns(w, xt, mp, k, k0, kb, n0, nc, hi, acc.data() + c * kCols * mp);
    }
  }
  // Weight row n's sums start at acc[(n - lo) * mp]: block c's row j is row c * kCols + j.
  for (int b = 0; b < nb; ++b)
    for (int64_t n = lo; n < hi; ++n) y[b * width + n] = static_cast<T>(acc[(n - lo) * mp + b]);
}

}  // namespace
}  // namespace splitphase_outer
