// SwiGLU's activation silu(g) * u in one pass (torch: two passes and a temporary). Every
// element takes the same vector code, masked at the tail, so an element's result does not
// depend on where it sits in the tensor: rows stay bit-identical however many share a call
// (ATen finishes a vector loop with a scalar one that rounds exp differently).
#include <ATen/ATen.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>

#include "ops.h"
#include "pool.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define SPLITPHASE_AVX512 1
#include "simd.h"
#endif

namespace {

#if SPLITPHASE_AVX512
// Round-to-nearest-even to bf16, as c10::BFloat16 does: the bf16 bits in each 32-bit lane's
// low half (no NaN expected from finite activations).
inline __m512i bf16_bits(__m512 v) {
  __m512i bits = _mm512_castps_si512(v);
  __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  bits = _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
  return _mm512_srli_epi32(bits, 16);
}

inline void store16(float* p, __m512 v, __mmask16 m) { _mm512_mask_storeu_ps(p, m, v); }
inline void store16(c10::BFloat16* p, __m512 v, __mmask16 m) {
  _mm256_mask_storeu_epi16(p, m, _mm512_cvtepi32_epi16(bf16_bits(v)));
}

// bf16 rounds twice in torch (silu's result, then the product): round the silu to bf16 here.
inline __m512 round_like(__m512 v, float) { return v; }
inline __m512 round_like(__m512 v, c10::BFloat16) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(bf16_bits(v), 16));
}

template <typename T>
void silu_mul_range(const T* g, const T* u, T* y, int64_t begin, int64_t end) {
  for (int64_t i = begin; i < end; i += 16) {
    int64_t n = std::min<int64_t>(16, end - i);
    __mmask16 m = n == 16 ? static_cast<__mmask16>(0xffff) : splitphase_simd::tail_mask(n);
    __m512 gv = n == 16 ? splitphase_simd::load16(g + i) : splitphase_simd::load_tail(g + i, n);
    __m512 uv = n == 16 ? splitphase_simd::load16(u + i) : splitphase_simd::load_tail(u + i, n);
    __m512 e = splitphase_simd::exp16(_mm512_sub_ps(_mm512_setzero_ps(), gv));
    __m512 s = round_like(_mm512_div_ps(gv, _mm512_add_ps(_mm512_set1_ps(1.f), e)), T());
    store16(y + i, _mm512_mul_ps(s, uv), m);  // g / (1 + exp(-g)) * u, as torch's silu
  }
}
#else
template <typename T>
void silu_mul_range(const T* g, const T* u, T* y, int64_t begin, int64_t end) {
  for (int64_t i = begin; i < end; ++i) {
    float gv = static_cast<float>(g[i]);
    float s = static_cast<float>(static_cast<T>(gv / (1.f + std::exp(-gv))));
    y[i] = static_cast<T>(s * static_cast<float>(u[i]));
  }
}
#endif

template <typename T>
void silu_mul_impl(const T* g, const T* u, T* y, int64_t n, int64_t rows) {
  // Chunks are whole vectors (multiples of 16), so only the tensor's last vector is masked.
  splitphase_pool::parallel_chunks((n + 15) / 16, 256, rows, [&](int64_t begin, int64_t end) {
    silu_mul_range(g, u, y, begin * 16, std::min(n, end * 16));
  });
}

}  // namespace

namespace splitphase_ops {

// Writes into y, which may be g itself: each element is read before it is written.
static void silu_mul_into(const at::Tensor& g, const at::Tensor& u, at::Tensor& y) {
  TORCH_CHECK(g.sizes() == u.sizes() && g.is_contiguous() && u.is_contiguous(), "same shapes");
  TORCH_CHECK(g.scalar_type() == u.scalar_type(), "same dtype");
  const int64_t rows = g.dim() > 0 ? g.numel() / std::max<int64_t>(g.size(-1), 1) : 1;
  if (g.scalar_type() == at::kFloat) {
    silu_mul_impl(g.data_ptr<float>(), u.data_ptr<float>(), y.data_ptr<float>(), g.numel(), rows);
  } else if (g.scalar_type() == at::kBFloat16) {
    silu_mul_impl(g.data_ptr<c10::BFloat16>(), u.data_ptr<c10::BFloat16>(),
                  y.data_ptr<c10::BFloat16>(), g.numel(), rows);
  } else {
    TORCH_CHECK(false, "silu_mul supports float32 and bfloat16");
  }
  splitphase_pool::park_after(rows);
}

at::Tensor silu_mul(const at::Tensor& g, const at::Tensor& u) {
  auto y = at::empty_like(g);
  silu_mul_into(g, u, y);
  return y;
}

at::Tensor& silu_mul_(at::Tensor& g, const at::Tensor& u) {
  silu_mul_into(g, u, g);
  return g;
}

}  // namespace splitphase_ops

TORCH_LIBRARY_FRAGMENT(splitphase, m) {
  m.def("silu_mul(Tensor g, Tensor u) -> Tensor");
  m.def("silu_mul_(Tensor(a!) g, Tensor u) -> Tensor(a!)");
}

TORCH_LIBRARY_IMPL(splitphase, CPU, m) {
  m.impl("silu_mul", &splitphase_ops::silu_mul);
  m.impl("silu_mul_", &splitphase_ops::silu_mul_);
}
