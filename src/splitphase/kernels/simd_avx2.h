// simd.h's 16-lane vector on a CPU with AVX2 and FMA but no AVX-512 (AMD Zen 2/3, Intel before
// Skylake-SP): two ymm halves, every operation done on both. The same names and lane semantics
// as the AVX-512 forms, so a kernel written in them sums in the same order on either; tails
// go through a zeroed 16-lane buffer (AVX2 has no masked 16-bit loads or stores).
#pragma once
#include <c10/util/BFloat16.h>
#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "fp8.h"

namespace splitphase_simd {

struct vf {
  __m256 lo, hi;  // lanes 0-7, 8-15
};

inline vf zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline vf set1(float v) { return {_mm256_set1_ps(v), _mm256_set1_ps(v)}; }
inline vf fmadd(vf a, vf b, vf c) {  // a * b + c, one rounding
  return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)};
}
inline vf fnmadd(vf a, vf b, vf c) {  // c - a * b, one rounding
  return {_mm256_fnmadd_ps(a.lo, b.lo, c.lo), _mm256_fnmadd_ps(a.hi, b.hi, c.hi)};
}
inline vf add(vf a, vf b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
inline vf sub(vf a, vf b) { return {_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)}; }
inline vf mul(vf a, vf b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
inline vf div(vf a, vf b) { return {_mm256_div_ps(a.lo, b.lo), _mm256_div_ps(a.hi, b.hi)}; }
inline vf max(vf a, vf b) { return {_mm256_max_ps(a.lo, b.lo), _mm256_max_ps(a.hi, b.hi)}; }
inline vf min(vf a, vf b) { return {_mm256_min_ps(a.lo, b.lo), _mm256_min_ps(a.hi, b.hi)}; }

inline __m256 widen8(const c10::BFloat16* p) {  // 8 bf16 -> fp32, exact
  __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}
template <typename T>
inline __m256 widen8_fp8(const T* p) {  // 8 fp8 -> fp32, exact (fp8.h)
  __m256i x = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  x = _mm256_and_si256(_mm256_slli_epi32(x, Fp8<T>::kShift), _mm256_set1_epi32(Fp8<T>::kMask));
  return _mm256_mul_ps(_mm256_castsi256_ps(x), _mm256_set1_ps(Fp8<T>::kScale));
}
inline __m256 widen8(const c10::Float8_e4m3fn* p) { return widen8_fp8(p); }
inline __m256 widen8(const c10::Float8_e5m2* p) { return widen8_fp8(p); }
inline vf load16(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline vf load16(const c10::BFloat16* p) { return {widen8(p), widen8(p + 8)}; }
inline vf load16(const c10::Float8_e4m3fn* p) { return {widen8(p), widen8(p + 8)}; }
inline vf load16(const c10::Float8_e5m2* p) { return {widen8(p), widen8(p + 8)}; }

// The first n < 16 lanes, zeros after.
template <typename T>
inline vf load_tail(const T* p, int64_t n) {
  T buf[16];
  std::memset(static_cast<void*>(buf), 0, sizeof(buf));
  std::memcpy(static_cast<void*>(buf), p, static_cast<size_t>(n) * sizeof(T));
  return load16(buf);
}

// Round-to-nearest-even to bf16 as c10::BFloat16 does: the bits in each lane's low half; a NaN
// gives c10's quiet NaN.
inline __m256i bf16_bits8(__m256 v) {
  __m256i bits = _mm256_castps_si256(v);
  __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  bits = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
  __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  return _mm256_blendv_epi8(bits, _mm256_set1_epi32(0x7fc0), nan);
}
inline __m256 round8(__m256 v) { return _mm256_castsi256_ps(_mm256_slli_epi32(bf16_bits8(v), 16)); }

// v rounded to T's precision and widened back (nothing for float).
inline vf round_to(vf v, float) { return v; }
inline vf round_to(vf v, c10::BFloat16) { return {round8(v.lo), round8(v.hi)}; }

inline void store16(float* p, vf v) {
  _mm256_storeu_ps(p, v.lo);
  _mm256_storeu_ps(p + 8, v.hi);
}
inline void store16(c10::BFloat16* p, vf v) {
  // packus works within 128-bit lanes: [lo0-3 hi0-3 lo4-7 hi4-7] back into order.
  __m256i packed = _mm256_packus_epi32(bf16_bits8(v.lo), bf16_bits8(v.hi));
  packed = _mm256_permute4x64_epi64(packed, 0xd8);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), packed);
}
template <typename T>
inline void store_tail(T* p, vf v, int64_t n) {  // the first n < 16 lanes
  T buf[16];
  store16(buf, v);
  std::memcpy(static_cast<void*>(p), buf, static_cast<size_t>(n) * sizeof(T));
}

// out[0..4) = horizontal sums of a0..a3: each folded to 8 lanes (lo + hi), then a fixed
// pairwise tree over all four.
inline void reduce4(vf a0, vf a1, vf a2, vf a3, float* out) {
  __m256 t0 = _mm256_hadd_ps(_mm256_add_ps(a0.lo, a0.hi), _mm256_add_ps(a1.lo, a1.hi));
  __m256 t1 = _mm256_hadd_ps(_mm256_add_ps(a2.lo, a2.hi), _mm256_add_ps(a3.lo, a3.hi));
  __m256 t = _mm256_hadd_ps(t0, t1);  // [s0 s1 s2 s3] of lanes 0-3 and of lanes 4-7
  _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1)));
}

inline float reduce8_add(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
inline float reduce_add(vf a) { return reduce8_add(_mm256_add_ps(a.lo, a.hi)); }
inline float reduce8_max(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}
inline float reduce_max(vf a) { return reduce8_max(_mm256_max_ps(a.lo, a.hi)); }

// 2^n for integral n in [-64, 64] (exact, normal).
inline __m256 pow2_8(__m256 n) {
  return _mm256_castsi256_ps(
      _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
}

// exp(x) as simd.h's AVX-512 exp16 (Cephes' expf); its final scaling by 2^n in two exact halves
// (n reaches -127, whose 2^n alone is no normal float), so the result rounds once, as scalef's.
inline __m256 exp8(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-88.3762626647949f)),
                    _mm256_set1_ps(88.3762626647949f));
  __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                             _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
  __m256 half = _mm256_round_ps(_mm256_mul_ps(n, _mm256_set1_ps(0.5f)),
                                _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
  return _mm256_mul_ps(_mm256_mul_ps(p, pow2_8(half)), pow2_8(_mm256_sub_ps(n, half)));
}
inline vf exp16(vf x) { return {exp8(x.lo), exp8(x.hi)}; }

}  // namespace splitphase_simd
