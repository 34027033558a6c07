// The register-blocked pieces of the prefill attention kernel (prefill_attention.cpp), for a
// block of up to 6 query rows against one tile of 64 keys: scores (Q K^T), the online-softmax
// step, and the weighted sum of values (P V). K tiles are packed transposed (D, 64) and V
// tiles row-major (64, D), both contiguous, so every operand of the inner loops is a
// contiguous 16-lane load or a broadcast; 6 rows x 4 vectors = 24 accumulators of 32 zmm.
// On a CPU with AVX2 and FMA but no AVX-512 the same pieces are ymm code
// (attention_tiles_avx2.h); a scalar version of each serves the rest (slower; the softmax
// shifts by the exact running max, so results agree within rounding).
#pragma once
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && \
    defined(__AVX512DQ__) && defined(__BMI2__)
#define SPLITPHASE_AVX512 1
#include "simd.h"
#elif defined(__AVX2__) && defined(__FMA__)
#define SPLITPHASE_AVX2_TILES 1
#include "simd.h"
#endif
#if SPLITPHASE_AVX512 || SPLITPHASE_AVX2_TILES
#define SPLITPHASE_VECTOR_TILES 1
#endif

namespace splitphase_tiles {

constexpr int64_t kKTile = 64;  // keys per tile: four 16-lane vectors of scores per row
constexpr int kRows = 6;        // query rows per register block

// 2^f for f in [0, 1) by a polynomial of degree Deg fitted for the least relative error, in
// Horner order (highest power first): degree 5 is within 1.7e-7 of 2^f, degree 3 within 7.5e-5.
template <int Deg>
constexpr float kExp2Poly[Deg + 1] = {};
template <>
constexpr float kExp2Poly<5>[6] = {1.877576578e-3f, 8.989340626e-3f, 5.582631752e-2f,
                                   2.401536107e-1f, 6.931530833e-1f, 9.999999404e-1f};
template <>
constexpr float kExp2Poly<3>[4] = {7.802451402e-2f, 2.260671705e-1f, 6.958335638e-1f,
                                   9.999251962e-1f};

#if SPLITPHASE_AVX512
// s[r][0:16NK] = q_r . kt[:, 0:16NK] for R rows of q (row stride ldq); kt is (D, 64).
template <int R, int NK>
inline void qk_block(const float* q, int64_t ldq, const float* kt, int64_t d, float* s) {
  __m512 acc[R][NK];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < NK; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t i = 0; i < d; ++i) {
    __m512 kv[NK];
    for (int c = 0; c < NK; ++c) kv[c] = _mm512_loadu_ps(kt + i * kKTile + 16 * c);
    for (int r = 0; r < R; ++r) {
      __m512 qb = _mm512_set1_ps(q[r * ldq + i]);
      for (int c = 0; c < NK; ++c) acc[r][c] = _mm512_fmadd_ps(qb, kv[c], acc[r][c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < NK; ++c) _mm512_storeu_ps(s + r * kKTile + 16 * c, acc[r][c]);
}

#if defined(__AVX512BF16__)
#define SPLITPHASE_BF16_DOT 1
// The same for bf16 q (row stride ldq) against the K tile packed as (D/2, 64, 2) bf16 pairs:
// one VDPBF16PS multiplies two dimensions of 16 keys. The products are exact in fp32, as in
// the widened path; the sums round in another order.
template <int R, int NK>
inline void qk_block(const c10::BFloat16* q, int64_t ldq, const c10::BFloat16* kp, int64_t d,
                     float* s) {
  __m512 acc[R][NK];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < NK; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t i = 0; i < d / 2; ++i) {
    __m512bh kv[NK];
    for (int c = 0; c < NK; ++c)
      kv[c] = (__m512bh)_mm512_loadu_si512(kp + i * 2 * kKTile + 32 * c);
    for (int r = 0; r < R; ++r) {
      uint32_t pair;
      std::memcpy(&pair, q + r * ldq + 2 * i, sizeof pair);
      const __m512bh qb = (__m512bh)_mm512_set1_epi32(static_cast<int>(pair));
      for (int c = 0; c < NK; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], kv[c], qb);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < NK; ++c) _mm512_storeu_ps(s + r * kKTile + 16 * c, acc[r][c]);
}
#endif

// o[r][col:col+16NV] = alpha[r] * o[r][...] + sum_{j<n} p[r][j] * v[j][col:...]; v is (64, D).
template <int R, int NV>
inline void pv_block(const float* p, const float* v, int64_t n, int64_t col, const float* alpha,
                     float* o, int64_t d) {
  __m512 acc[R][NV];
  for (int r = 0; r < R; ++r) {
    __m512 a = _mm512_set1_ps(alpha[r]);
    for (int c = 0; c < NV; ++c)
      acc[r][c] = _mm512_mul_ps(a, _mm512_loadu_ps(o + r * d + col + 16 * c));
  }
  for (int64_t j = 0; j < n; ++j) {
    __m512 vj[NV];
    for (int c = 0; c < NV; ++c) vj[c] = _mm512_loadu_ps(v + j * d + col + 16 * c);
    for (int r = 0; r < R; ++r) {
      __m512 pb = _mm512_set1_ps(p[r * kKTile + j]);
      for (int c = 0; c < NV; ++c) acc[r][c] = _mm512_fmadd_ps(pb, vj[c], acc[r][c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < NV; ++c) _mm512_storeu_ps(o + r * d + col + 16 * c, acc[r][c]);
}

// 2^x as 2^f * 2^n, n = floor(x) and f = x - n in [0, 1) from one VREDUCEPS; 2^f by a
// polynomial of degree Deg fitted for the least relative error on [0, 1), and VSCALEFPS
// multiplies by 2^floor(x) itself (0 for a very negative x: no clamp needed). Degree 5 is
// within 1.7e-7 of 2^f (fp32 rounding is 6e-8); degree 3 within 7.5e-5, for probabilities
// rounded to bf16 (2^-9) next, as on the AMX tiles, where the exponentials are what bounds the
// kernel: two multiply-adds fewer. Lanes outside `keep` are 0.
template <int Deg>
inline __m512 exp2_16(__mmask16 keep, __m512 x) {
  static_assert(Deg == 3 || Deg == 5, "fitted degrees");
  const __m512 f = _mm512_reduce_ps(x, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  __m512 p = _mm512_set1_ps(kExp2Poly<Deg>[0]);
  for (int i = 1; i <= Deg; ++i) p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(kExp2Poly<Deg>[i]));
  return _mm512_maskz_scalef_ps(keep, p, x);
}

// How far (log2 units) a row's scores may rise above its running shift before the shift
// moves: a tile whose scores stay below it skips the row's horizontal max, and its p values
// are at most 2^8 (no overflow in fp32 sums), as FlashAttention-4's conditional rescaling.
constexpr float kShiftSlack = 8.f;

inline void store_p(float* p, __m512 e) { _mm512_storeu_ps(p, e); }
#if defined(SPLITPHASE_BF16_DOT)
// Rounded to nearest even, as torch's flash kernel rounds P for its bf16 P V.
inline void store_p(c10::BFloat16* p, __m512 e) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), (__m256i)_mm512_cvtneps_pbh(e));
}
#endif

// Folds one tile of raw scores s (nr rows x 64; row r's first valid[r] are real) into the
// running softmax, in log2 units (c = scale * log2 e): where a score rises more than
// kShiftSlack above the row's shift m[r], m[r] moves up to the tile's max and alpha[r] gets
// 2^(m_old - m_new) (what the row's output so far is rescaled by), else alpha[r] = 1; p (s
// itself, or bf16 for the tiles' P V) gets 2^(c s - m[r]) (0 past valid[r]), and the row's
// 16-lane partial sums l[16r:16r+16] of the unrounded values are rescaled and added to (one
// horizontal sum per row at the very end).
// A row's shifts depend on its own scores alone, so its result does not depend on its batch.
template <int Deg, typename P>
inline void softmax_rows(const float* s, P* p, int nr, const int64_t* valid, float c, float* m,
                         float* alpha, float* l) {
  const __m512 ninf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  const __m512 cv = _mm512_set1_ps(c);
  for (int r = 0; r < nr; ++r) {
    // The row's scores stay in registers between the max and the exponentials, and its lane
    // masks come from one BZHI: no branch but the rare shift, so rows overlap in the core.
    const float* row = s + r * kKTile;
    const auto n = static_cast<unsigned>(std::clamp<int64_t>(valid[r], 0, kKTile));
    const uint64_t seen = _bzhi_u64(~uint64_t{0}, n);
    __m512 x[4], xm[4];
    __mmask16 keep[4];
    for (int k = 0; k < 4; ++k) {
      x[k] = _mm512_loadu_ps(row + 16 * k);
      keep[k] = static_cast<__mmask16>(seen >> (16 * k));
      xm[k] = _mm512_mask_mov_ps(ninf, keep[k], x[k]);
    }
    const __m512 mx = _mm512_max_ps(_mm512_max_ps(xm[0], xm[1]), _mm512_max_ps(xm[2], xm[3]));
    alpha[r] = 1.f;
    __m512 scaled = _mm512_mul_ps(mx, cv);  // the scale is > 0: max commutes with it
    if (_mm512_cmp_ps_mask(scaled, _mm512_set1_ps(m[r] + kShiftSlack), _CMP_GT_OQ)) {
      const float m_new = _mm512_reduce_max_ps(scaled);
      alpha[r] = _mm512_cvtss_f32(exp2_16<Deg>(1, _mm512_set1_ps(m[r] - m_new)));
      m[r] = m_new;
    }
    const __m512 mv = _mm512_set1_ps(m[r]);
    __m512 e[4];
    for (int k = 0; k < 4; ++k) {
      e[k] = exp2_16<Deg>(keep[k], _mm512_fmsub_ps(x[k], cv, mv));
      store_p(p + r * kKTile + 16 * k, e[k]);
    }
    const __m512 sum = _mm512_add_ps(_mm512_add_ps(e[0], e[1]), _mm512_add_ps(e[2], e[3]));
    __m512 lr = _mm512_loadu_ps(l + 16 * r);
    _mm512_storeu_ps(l + 16 * r, _mm512_fmadd_ps(lr, _mm512_set1_ps(alpha[r]), sum));
  }
}
#elif SPLITPHASE_AVX2_TILES
#include "attention_tiles_avx2.h"
#else
template <int R, int NK>
inline void qk_block(const float* q, int64_t ldq, const float* kt, int64_t d, float* s) {
  for (int r = 0; r < R; ++r) {
    float* sr = s + r * kKTile;
    for (int64_t c = 0; c < 16 * NK; ++c) sr[c] = 0.f;
    for (int64_t i = 0; i < d; ++i)
      for (int64_t c = 0; c < 16 * NK; ++c) sr[c] = std::fma(q[r * ldq + i], kt[i * kKTile + c], sr[c]);
  }
}

template <int R, int NV>
inline void pv_block(const float* p, const float* v, int64_t n, int64_t col, const float* alpha,
                     float* o, int64_t d) {
  for (int r = 0; r < R; ++r) {
    float* orow = o + r * d + col;
    for (int64_t c = 0; c < 16 * NV; ++c) orow[c] *= alpha[r];
    for (int64_t j = 0; j < n; ++j)
      for (int64_t c = 0; c < 16 * NV; ++c) orow[c] = std::fma(p[r * kKTile + j], v[j * d + col + c], orow[c]);
  }
}

template <int Deg, typename P>  // the vector path's exp2 degree; std::exp2 here
inline void softmax_rows(const float* s, P* p, int nr, const int64_t* valid, float c, float* m,
                         float* alpha, float* l) {
  for (int r = 0; r < nr; ++r) {
    const float* sr = s + r * kKTile;
    float m_new = m[r], sum = 0.f;
    for (int64_t j = 0; j < valid[r]; ++j) m_new = std::max(m_new, sr[j] * c);
    alpha[r] = std::exp2(m[r] - m_new);
    m[r] = m_new;
    for (int64_t j = 0; j < kKTile; ++j) {
      const float e = j < valid[r] ? std::exp2(std::fma(sr[j], c, -m_new)) : 0.f;
      p[r * kKTile + j] = static_cast<P>(e);
      sum += e;
    }
    l[16 * r] = l[16 * r] * alpha[r] + sum;  // lane 0 of the row's partial sums
  }
}
#endif

// qk_block for nr (1..6) rows and the first nk (1..4) vectors of 16 keys; Q is float (kt the
// transposed tile) or, with SPLITPHASE_BF16_DOT, bf16 (kt the tile of pairs).
template <int R, typename Q>
inline void qk_cols(int nk, const Q* q, int64_t ldq, const Q* kt, int64_t d, float* s) {
  switch (nk) {
    case 1: return qk_block<R, 1>(q, ldq, kt, d, s);
    case 2: return qk_block<R, 2>(q, ldq, kt, d, s);
    case 3: return qk_block<R, 3>(q, ldq, kt, d, s);
    default: return qk_block<R, 4>(q, ldq, kt, d, s);
  }
}

template <typename Q>
inline void qk(int nr, int nk, const Q* q, int64_t ldq, const Q* kt, int64_t d, float* s) {
  switch (nr) {
    case 1: return qk_cols<1>(nk, q, ldq, kt, d, s);
    case 2: return qk_cols<2>(nk, q, ldq, kt, d, s);
    case 3: return qk_cols<3>(nk, q, ldq, kt, d, s);
    case 4: return qk_cols<4>(nk, q, ldq, kt, d, s);
    case 5: return qk_cols<5>(nk, q, ldq, kt, d, s);
    default: return qk_cols<6>(nk, q, ldq, kt, d, s);
  }
}

template <int NV>
inline void pv_rows(int nr, const float* p, const float* v, int64_t n, int64_t col,
                    const float* alpha, float* o, int64_t d) {
  switch (nr) {
    case 1: return pv_block<1, NV>(p, v, n, col, alpha, o, d);
    case 2: return pv_block<2, NV>(p, v, n, col, alpha, o, d);
    case 3: return pv_block<3, NV>(p, v, n, col, alpha, o, d);
    case 4: return pv_block<4, NV>(p, v, n, col, alpha, o, d);
    case 5: return pv_block<5, NV>(p, v, n, col, alpha, o, d);
    default: return pv_block<6, NV>(p, v, n, col, alpha, o, d);
  }
}

// o[nr rows] = alpha * o + p @ v over n keys, all D (a multiple of 16) columns in chunks of
// up to 4 vectors.
inline void pv(int nr, const float* p, const float* v, int64_t n, const float* alpha, float* o,
               int64_t d) {
  int64_t col = 0;
  for (; col + 64 <= d; col += 64) pv_rows<4>(nr, p, v, n, col, alpha, o, d);
  switch ((d - col) / 16) {
    case 1: pv_rows<1>(nr, p, v, n, col, alpha, o, d); break;
    case 2: pv_rows<2>(nr, p, v, n, col, alpha, o, d); break;
    case 3: pv_rows<3>(nr, p, v, n, col, alpha, o, d); break;
    default: break;
  }
}

}  // namespace splitphase_tiles
