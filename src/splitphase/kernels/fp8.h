// The two fp8 formats a K/V pool may hold (kv_cache_dtype "fp8_e4m3", "fp8_e5m2"), as the
// constants simd.h and simd_avx2.h widen them with. An fp8 byte, sign-extended to 32 bits and
// shifted so its 7 exponent-and-mantissa bits sit just below fp32's sign (the sign's copies
// fill the bits between; the mask keeps bit 31 and those 7), reads as an fp32 whose exponent
// is biased by 127 instead of the format's own; one multiply by 2^(127 - bias) fixes that,
// for the format's subnormals too (they land on fp32 subnormals, scaled exactly), and keeps
// the sign. Four instructions for eight values. Exact for every finite value; e4m3fn's NaN
// (0x7f) reads as 480 and e5m2's infinities and NaNs as large finite values, which a pool does
// not hold: torch's casts to e4m3fn saturate at 448. Exact only with denormals kept (MXCSR
// DAZ off, torch's default): with DAZ the subnormals, below 2^-6 (e4m3) and 2^-14 (e5m2),
// read as zero.
#pragma once
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>

#include <cstdint>

namespace splitphase_simd {

template <typename T>
struct Fp8;
template <>
struct Fp8<c10::Float8_e4m3fn> {
  static constexpr int kShift = 20;                  // 4 exponent + 3 mantissa bits to [26:20]
  static constexpr int32_t kMask = INT32_MIN | 0x07f00000;
  static constexpr float kScale = 0x1p120f;          // 2^(127 - 7)
};
template <>
struct Fp8<c10::Float8_e5m2> {
  static constexpr int kShift = 21;                  // 5 exponent + 2 mantissa bits to [27:21]
  static constexpr int32_t kMask = INT32_MIN | 0x0fe00000;
  static constexpr float kScale = 0x1p112f;          // 2^(127 - 15)
};

}  // namespace splitphase_simd
