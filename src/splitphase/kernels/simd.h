// AVX-512 loads shared by the kernels: 16 lanes of fp32 from fp32 or bf16 storage, and
// masked tails. Only included where __AVX512F__/BW/VL are defined (-march=native).
#pragma once
#include <c10/util/BFloat16.h>
#include <immintrin.h>

#include <cstdint>

namespace splitphase_simd {

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

}  // namespace splitphase_simd
