// The vector pieces shared by the kernels: 16 lanes of fp32 (`vf`) from fp32 or bf16 storage,
// tails, a four-way horizontal sum and exp, on AVX-512 (one zmm) or, on a CPU without it,
// AVX2 with FMA (two ymm: simd_avx2.h). The build is -march=native, so the building CPU picks.
// SPLITPHASE_SIMD is defined where either is; code written in the generic names (zero, set1,
// fmadd, add, ...) runs on both, lane for lane the same operations in the same order (the
// horizontal sums, reduce4 and reduce_add, each keep one fixed order per instruction set).
#pragma once
#include <c10/util/BFloat16.h>

#include <cstdint>

#include "fp8.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define SPLITPHASE_AVX512 1
#define SPLITPHASE_SIMD 1
#include <immintrin.h>
#elif defined(__AVX2__) && defined(__FMA__)
#define SPLITPHASE_AVX2 1
#define SPLITPHASE_SIMD 1
#include "simd_avx2.h"
#endif

#if SPLITPHASE_AVX512
namespace splitphase_simd {

using vf = __m512;
inline vf zero() { return _mm512_setzero_ps(); }
inline vf set1(float v) { return _mm512_set1_ps(v); }
inline vf fmadd(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }  // a * b + c
inline vf add(vf a, vf b) { return _mm512_add_ps(a, b); }
inline vf sub(vf a, vf b) { return _mm512_sub_ps(a, b); }
inline vf mul(vf a, vf b) { return _mm512_mul_ps(a, b); }
inline vf max(vf a, vf b) { return _mm512_max_ps(a, b); }
inline float reduce_add(vf a) { return _mm512_reduce_add_ps(a); }
inline float reduce_max(vf a) { return _mm512_reduce_max_ps(a); }

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {
  __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
// The first n < 16 lanes, zeros after: a tail is one more masked step of the same
// accumulation, so every path sums in the same order (no scalar tail for the compiler to
// contract differently).
inline __mmask16 tail_mask(int64_t n) { return static_cast<__mmask16>((1u << n) - 1); }
inline __m512 load_tail(const float* p, int64_t n) { return _mm512_maskz_loadu_ps(tail_mask(n), p); }
inline __m512 load_tail(const c10::BFloat16* p, int64_t n) {
  __m256i raw = _mm256_maskz_loadu_epi16(tail_mask(n), p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

// 16 fp8 (in raw's bytes) -> fp32, exact (fp8.h).
template <typename T>
inline __m512 widen16_fp8(__m128i raw) {
  __m512i x = _mm512_cvtepi8_epi32(raw);
  x = _mm512_and_si512(_mm512_slli_epi32(x, Fp8<T>::kShift), _mm512_set1_epi32(Fp8<T>::kMask));
  return _mm512_mul_ps(_mm512_castsi512_ps(x), _mm512_set1_ps(Fp8<T>::kScale));
}
inline __m512 load16(const c10::Float8_e4m3fn* p) {
  return widen16_fp8<c10::Float8_e4m3fn>(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline __m512 load16(const c10::Float8_e5m2* p) {
  return widen16_fp8<c10::Float8_e5m2>(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline __m512 load_tail(const c10::Float8_e4m3fn* p, int64_t n) {
  return widen16_fp8<c10::Float8_e4m3fn>(_mm_maskz_loadu_epi8(tail_mask(n), p));
}
inline __m512 load_tail(const c10::Float8_e5m2* p, int64_t n) {
  return widen16_fp8<c10::Float8_e5m2>(_mm_maskz_loadu_epi8(tail_mask(n), p));
}

// Round-to-nearest-even to bf16, as c10::BFloat16 does: the bf16 bits in each 32-bit lane's
// low half; a NaN lane gives c10's quiet NaN (the carry of the rounding would turn some into
// infinities or zeros).
inline __m512i bf16_bits(__m512 v) {
  __m512i bits = _mm512_castps_si512(v);
  __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  bits = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
  return _mm512_mask_mov_epi32(bits, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7fc0));
}

// 16 lanes rounded to bf16 (nearest even), packed in 256 bits. With AVX512-BF16 one
// VCVTNEPS2BF16 (about a fifth of the instructions; it also flushes denormals, below 1.2e-38,
// to zero where c10 keeps them), else bf16_bits.
inline __m256i bf16_pack(__m512 v) {
#if defined(__AVX512BF16__)
  return (__m256i)_mm512_cvtneps_pbh(v);
#else
  return _mm512_cvtepi32_epi16(bf16_bits(v));
#endif
}

// v rounded to T's precision and widened back (nothing for float): where torch's bf16 ops
// round an intermediate result.
inline __m512 round_to(__m512 v, float) { return v; }
inline __m512 round_to(__m512 v, c10::BFloat16) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bf16_pack(v)), 16));
}

// 16 lanes into T storage (bf16 rounded to nearest even); the _tail forms write the first n < 16.
inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
inline void store16(c10::BFloat16* p, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), bf16_pack(v));
}
inline void store_tail(float* p, __m512 v, int64_t n) {
  _mm512_mask_storeu_ps(p, static_cast<__mmask16>((1u << n) - 1), v);
}
inline void store_tail(c10::BFloat16* p, __m512 v, int64_t n) {
  _mm256_mask_storeu_epi16(p, static_cast<__mmask16>((1u << n) - 1), bf16_pack(v));
}

// out[0..4) = horizontal sums of a0..a3, all four at once (a transpose-and-add tree instead of
// four serial reductions). Every path reduces through here, so a row's sum has one order.
inline void reduce4(__m512 a0, __m512 a1, __m512 a2, __m512 a3, float* out) {
  __m512 t0 = _mm512_add_ps(_mm512_unpacklo_ps(a0, a1), _mm512_unpackhi_ps(a0, a1));
  __m512 t1 = _mm512_add_ps(_mm512_unpacklo_ps(a2, a3), _mm512_unpackhi_ps(a2, a3));
  __m512d d0 = _mm512_castps_pd(t0), d1 = _mm512_castps_pd(t1);
  __m512 u = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(d0, d1)),
                           _mm512_castpd_ps(_mm512_unpackhi_pd(d0, d1)));  // [s0 s1 s2 s3] x4
  __m256 v = _mm256_add_ps(_mm512_castps512_ps256(u),
                           _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(u), 1)));
  _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1)));
}

// exp(x) as Cephes' expf: x = n ln2 + r with |r| <= ln2/2, a degree-7 polynomial for e^r,
// scaled by 2^n (within 2 ulp of the true value over the clamped range).
inline __m512 exp16(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-88.3762626647949f)),
                    _mm512_set1_ps(88.3762626647949f));
  __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                  _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  return _mm512_scalef_ps(p, n);
}

}  // namespace splitphase_simd
#endif  // SPLITPHASE_AVX512
