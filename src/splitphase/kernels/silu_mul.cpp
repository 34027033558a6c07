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

#include "simd.h"

namespace {

#if SPLITPHASE_SIMD
using splitphase_simd::add;
using splitphase_simd::mul;
using splitphase_simd::round_to;
using splitphase_simd::set1;
using splitphase_simd::store16;
using splitphase_simd::store_tail;
using splitphase_simd::vf;

// Software prefetch this far ahead in g and u: with the hardware prefetcher alone the loads
// stalled (a pass over 2048 x 3072 took 2.6 ms in fp32 and 3.6 ms in bf16 on two threads of
// the Intel host; with it 1.6 and 1.9, `bench/elementwise_rates.py`).
constexpr int64_t kPrefetchBytes = 2048;

// silu(g) = g / (1 + exp(-g)) from e = exp(-g).
#if SPLITPHASE_AVX512
// 1 / d from the 14-bit reciprocal estimate and one Newton step, r + r (1 - d r): relative
// error about 2^-28, under fp32's own rounding. A 16-lane divide cost as much as the rest of
// an element's work together (exp, the bf16 roundings).
inline __m512 recip16(__m512 d) {
  const __m512 r = _mm512_rcp14_ps(d);
  return _mm512_fmadd_ps(r, _mm512_fnmadd_ps(d, r, _mm512_set1_ps(1.f)), r);
}
inline vf silu(vf g, vf e) { return mul(g, recip16(add(set1(1.f), e))); }
#else
// AVX2's estimate has 12 bits (one Newton step: about 2^-22, above fp32's rounding): divide.
inline vf silu(vf g, vf e) { return splitphase_simd::div(g, add(set1(1.f), e)); }
#endif

template <typename T>
void silu_mul_range(const T* g, const T* u, T* y, int64_t begin, int64_t end) {
  for (int64_t i = begin; i < end; i += 16) {
    _mm_prefetch(reinterpret_cast<const char*>(g + i) + kPrefetchBytes, _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(u + i) + kPrefetchBytes, _MM_HINT_T0);
    int64_t n = std::min<int64_t>(16, end - i);
    vf gv = n == 16 ? splitphase_simd::load16(g + i) : splitphase_simd::load_tail(g + i, n);
    vf uv = n == 16 ? splitphase_simd::load16(u + i) : splitphase_simd::load_tail(u + i, n);
    vf e = splitphase_simd::exp16(splitphase_simd::sub(splitphase_simd::zero(), gv));
    // g / (1 + exp(-g)) * u as torch's silu; bf16 rounds twice there (the silu, the product)
    vf s = round_to(silu(gv, e), T());
    if (n == 16) {
      store16(y + i, mul(s, uv));
    } else {
      store_tail(y + i, mul(s, uv), n);
    }
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
