// attention_tiles.h's pieces on a CPU with AVX2 and FMA but no AVX-512: the same block shapes
// (up to 6 query rows against 64 keys) and the same arithmetic, in ymm. Sixteen registers
// hold 6 rows x 2 ymm (16 columns) = 12 accumulators, a broadcast and two operand vectors, so
// a block of 16R columns is done 16 columns at a time (8 loads per 12 FMAs). Included by
// attention_tiles.h inside its namespace.
#pragma once

// s[r][0:16NK] = q_r . kt[:, 0:16NK] for R rows of q (row stride ldq); kt is (D, 64).
template <int R, int NK>
inline void qk_block(const float* q, int64_t ldq, const float* kt, int64_t d, float* s) {
  for (int c = 0; c < NK; ++c) {
    __m256 acc[R][2];
    for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    const float* col = kt + 16 * c;
    for (int64_t i = 0; i < d; ++i) {
      const __m256 k0 = _mm256_loadu_ps(col + i * kKTile), k1 = _mm256_loadu_ps(col + i * kKTile + 8);
      for (int r = 0; r < R; ++r) {
        const __m256 qb = _mm256_broadcast_ss(q + r * ldq + i);
        acc[r][0] = _mm256_fmadd_ps(qb, k0, acc[r][0]);
        acc[r][1] = _mm256_fmadd_ps(qb, k1, acc[r][1]);
      }
    }
    for (int r = 0; r < R; ++r) {
      _mm256_storeu_ps(s + r * kKTile + 16 * c, acc[r][0]);
      _mm256_storeu_ps(s + r * kKTile + 16 * c + 8, acc[r][1]);
    }
  }
}

// o[r][col:col+16NV] = alpha[r] * o[r][...] + sum_{j<n} p[r][j] * v[j][col:...]; v is (64, D).
template <int R, int NV>
inline void pv_block(const float* p, const float* v, int64_t n, int64_t col, const float* alpha,
                     float* o, int64_t d) {
  for (int c = 0; c < NV; ++c) {
    const int64_t x = col + 16 * c;
    __m256 acc[R][2];
    for (int r = 0; r < R; ++r) {
      const __m256 a = _mm256_set1_ps(alpha[r]);
      acc[r][0] = _mm256_mul_ps(a, _mm256_loadu_ps(o + r * d + x));
      acc[r][1] = _mm256_mul_ps(a, _mm256_loadu_ps(o + r * d + x + 8));
    }
    for (int64_t j = 0; j < n; ++j) {
      const __m256 v0 = _mm256_loadu_ps(v + j * d + x), v1 = _mm256_loadu_ps(v + j * d + x + 8);
      for (int r = 0; r < R; ++r) {
        const __m256 pb = _mm256_broadcast_ss(p + r * kKTile + j);
        acc[r][0] = _mm256_fmadd_ps(pb, v0, acc[r][0]);
        acc[r][1] = _mm256_fmadd_ps(pb, v1, acc[r][1]);
      }
    }
    for (int r = 0; r < R; ++r) {
      _mm256_storeu_ps(o + r * d + x, acc[r][0]);
      _mm256_storeu_ps(o + r * d + x + 8, acc[r][1]);
    }
  }
}

// 2^x as attention_tiles.h's exp2_16 (its polynomial kExp2Poly for 2^f, f = x - floor(x)),
// times 2^floor(x) put together in the exponent bits; x is clamped to [-127, 127] first, and
// 2^-127 comes out as 0 (a zero exponent field), as VSCALEFPS gives 0 for a very negative x.
template <int Deg>
inline __m256 exp2_8(__m256 x) {
  static_assert(Deg == 3 || Deg == 5, "fitted degrees");
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-127.f)), _mm256_set1_ps(127.f));
  const __m256 n = _mm256_floor_ps(x);
  const __m256 f = _mm256_sub_ps(x, n);
  __m256 p = _mm256_set1_ps(kExp2Poly<Deg>[0]);
  for (int i = 1; i <= Deg; ++i) p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(kExp2Poly<Deg>[i]));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

constexpr float kShiftSlack = 8.f;  // as attention_tiles.h's (see there)

inline void store_p(float* p, __m256 e) { _mm256_storeu_ps(p, e); }

// attention_tiles.h's softmax_rows, eight lanes at a time: the row's shift moves only where a
// score rises more than kShiftSlack above it, p is 2^(c s - m) (0 past valid[r]), and the
// row's 16 partial sums in l are rescaled and added to.
template <int Deg, typename P>
inline void softmax_rows(const float* s, P* p, int nr, const int64_t* valid, float c, float* m,
                         float* alpha, float* l) {
  const __m256 ninf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  const __m256 cv = _mm256_set1_ps(c);
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  for (int r = 0; r < nr; ++r) {
    const float* row = s + r * kKTile;
    const auto n = static_cast<int>(std::clamp<int64_t>(valid[r], 0, kKTile));
    __m256 x[8], keep[8];
    __m256 mx = ninf;
    for (int k = 0; k < 8; ++k) {
      x[k] = _mm256_loadu_ps(row + 8 * k);
      keep[k] = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(n - 8 * k), lane));
      mx = _mm256_max_ps(mx, _mm256_blendv_ps(ninf, x[k], keep[k]));
    }
    alpha[r] = 1.f;
    const __m256 scaled = _mm256_mul_ps(mx, cv);  // the scale is > 0: max commutes with it
    const __m256 above = _mm256_cmp_ps(scaled, _mm256_set1_ps(m[r] + kShiftSlack), _CMP_GT_OQ);
    if (_mm256_movemask_ps(above)) {
      const float m_new = splitphase_simd::reduce8_max(scaled);
      alpha[r] = _mm256_cvtss_f32(exp2_8<Deg>(_mm256_set1_ps(m[r] - m_new)));
      m[r] = m_new;
    }
    const __m256 mv = _mm256_set1_ps(m[r]);
    __m256 sum_lo = _mm256_setzero_ps(), sum_hi = sum_lo;
    for (int k = 0; k < 8; ++k) {
      const __m256 e = _mm256_and_ps(keep[k], exp2_8<Deg>(_mm256_fmsub_ps(x[k], cv, mv)));
      store_p(p + r * kKTile + 8 * k, e);
      if (k % 2 == 0) sum_lo = _mm256_add_ps(sum_lo, e); else sum_hi = _mm256_add_ps(sum_hi, e);
    }
    const __m256 a = _mm256_set1_ps(alpha[r]);
    _mm256_storeu_ps(l + 16 * r, _mm256_fmadd_ps(_mm256_loadu_ps(l + 16 * r), a, sum_lo));
    _mm256_storeu_ps(l + 16 * r + 8, _mm256_fmadd_ps(_mm256_loadu_ps(l + 16 * r + 8), a, sum_hi));
  }
}
