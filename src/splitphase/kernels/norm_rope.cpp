// RMSNorm and rotate-half RoPE as one pass each, rows shared over all intra-op threads.
// Both round as the torch reference does: fp32 math (no contraction into FMAs), and for bf16
// a rounding to bf16 wherever the reference's bf16 tensor ops round. RoPE takes the same
// operation order (bit-exact); RMSNorm's sum of squares runs in 16-lane partial sums, within
// fp32 rounding of torch's. Each row's result depends only on that row (batch-invariant).
#include <ATen/ATen.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <tuple>

#include "ops.h"
#include "pool.h"

#include "simd.h"

namespace {

#if SPLITPHASE_SIMD
using splitphase_simd::add;
using splitphase_simd::mul;
using splitphase_simd::set1;
using splitphase_simd::vf;
using splitphase_simd::zero;
#endif

template <typename T>
inline float rnd(float v) { return static_cast<float>(static_cast<T>(v)); }

// sum(x^2) over one row. A serial sum was one dependent add chain of D links (a 768-wide row
// took ~1 us, most of a prefill's norm); four 16-lane accumulators and one fixed reduction
// keep the order a function of D alone, so a row's norm still does not depend on its batch.
template <typename T>
inline float sum_squares(const T* xr, int64_t d) {
#if SPLITPHASE_SIMD
  using splitphase_simd::load16;
  using splitphase_simd::load_tail;
  using splitphase_simd::reduce4;
  vf acc[4] = {zero(), zero(), zero(),
                   zero()};
  int64_t i = 0;
  for (; i + 16 <= d; i += 16) {
    vf v = load16(xr + i);
    acc[(i / 16) % 4] = add(acc[(i / 16) % 4], mul(v, v));
  }
  if (i < d) {
    vf v = load_tail(xr + i, d - i);
    acc[(i / 16) % 4] = add(acc[(i / 16) % 4], mul(v, v));
  }
  float part[4];
  reduce4(acc[0], acc[1], acc[2], acc[3], part);
  return (part[0] + part[1]) + (part[2] + part[3]);
#else
  float ss = 0.f;
  for (int64_t i = 0; i < d; ++i) {
    float v = static_cast<float>(xr[i]);
    ss += v * v;
  }
  return ss;
#endif
}

#if SPLITPHASE_SIMD
// fn(i, n) over [0, d) in steps of 16 lanes, n = 16 but for a last partial step: the element
// loops below in vector form, each lane the scalar loop's operations in its order (bf16
// rounded where that loop rounds), so results stay bit-identical to it. Scalar loops over
// c10::BFloat16 had compiled to a conversion call per element: the bf16 passes ran at about
// half the fp32 passes' bytes per second (`bench/elementwise_rates.py`).
template <typename F>
inline void lanes(int64_t d, F&& fn) {
  for (int64_t i = 0; i < d; i += 16) fn(i, std::min<int64_t>(16, d - i));
}

template <typename T>
inline vf load(const T* p, int64_t n) {
  return n == 16 ? splitphase_simd::load16(p) : splitphase_simd::load_tail(p, n);
}

template <typename T>
inline void store(T* p, vf v, int64_t n) {
  if (n == 16) {
    splitphase_simd::store16(p, v);
  } else {
    splitphase_simd::store_tail(p, v, n);
  }
}
#endif

// One row: y = w * (x * rsqrt(mean(x^2) + eps)).
template <typename T>
inline void rms_row(const T* xr, const T* w, T* yr, int64_t d, float eps) {
  float ss = sum_squares(xr, d);
  float inv = 1.f / std::sqrt(ss / static_cast<float>(d) + eps);
#if SPLITPHASE_SIMD
  const vf iv = set1(inv);
  lanes(d, [&](int64_t i, int64_t n) {
    vf nv = splitphase_simd::round_to(mul(load(xr + i, n), iv), T());
    store(yr + i, mul(load(w + i, n), nv), n);
  });
#else
  for (int64_t i = 0; i < d; ++i) {
    float n = rnd<T>(static_cast<float>(xr[i]) * inv);  // x32 * rsqrt(..) -> x.dtype
    yr[i] = static_cast<T>(static_cast<float>(w[i]) * n);
  }
#endif
}

template <typename T>
void rms_rows(const T* x, const T* w, T* y, int64_t rows, int64_t d, float eps) {
  splitphase_pool::parallel_chunks(rows, 8, rows, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) rms_row(x + r * d, w, y + r * d, d, eps);
  });
}

// s = x + r (rounded to T, as torch's add), then y = rms_norm(s): one pass over the rows.
template <typename T>
void add_rms_rows(const T* x, const T* r, const T* w, T* s, T* y, int64_t rows, int64_t d,
                  float eps) {
  splitphase_pool::parallel_chunks(rows, 8, rows, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const int64_t off = row * d;
#if SPLITPHASE_SIMD
      lanes(d, [&](int64_t i, int64_t n) {
        store(s + off + i, add(load(x + off + i, n), load(r + off + i, n)), n);
      });
#else
      for (int64_t i = 0; i < d; ++i) {
        s[off + i] = static_cast<T>(static_cast<float>(x[off + i]) + static_cast<float>(r[off + i]));
      }
#endif
      rms_row(s + off, w, y + off, d, eps);  // s's row is still in L1
    }
  });
}

}  // namespace

namespace splitphase_ops {

// y = w * (x * rsqrt(mean(x^2) + eps)) over the last dim of x (..., D).
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  TORCH_CHECK(x.is_contiguous() && w.is_contiguous() && x.size(-1) == w.numel(), "shapes");
  TORCH_CHECK(x.scalar_type() == w.scalar_type(), "x and weight share a dtype");
  auto y = at::empty_like(x);
  int64_t d = x.size(-1), rows = x.numel() / std::max<int64_t>(d, 1);
  if (x.scalar_type() == at::kFloat) {
    rms_rows<float>(x.data_ptr<float>(), w.data_ptr<float>(), y.data_ptr<float>(), rows, d,
                    static_cast<float>(eps));
  } else if (x.scalar_type() == at::kBFloat16) {
    rms_rows<c10::BFloat16>(x.data_ptr<c10::BFloat16>(), w.data_ptr<c10::BFloat16>(),
                            y.data_ptr<c10::BFloat16>(), rows, d, static_cast<float>(eps));
  } else {
    TORCH_CHECK(false, "rms_norm supports float32 and bfloat16");
  }
  splitphase_pool::park_after(rows);
  return y;
}

// s = x + r and y = rms_norm(s); s may be r itself (each element is read before it is written).
static void add_rms_norm_into(const at::Tensor& x, const at::Tensor& r, const at::Tensor& w,
                              double eps, at::Tensor& s, at::Tensor& y) {
  TORCH_CHECK(x.is_contiguous() && r.is_contiguous() && w.is_contiguous(), "contiguous");
  TORCH_CHECK(x.sizes() == r.sizes() && x.size(-1) == w.numel(), "shapes");
  TORCH_CHECK(x.scalar_type() == r.scalar_type() && x.scalar_type() == w.scalar_type(), "dtype");
  int64_t d = x.size(-1), rows = x.numel() / std::max<int64_t>(d, 1);
  if (x.scalar_type() == at::kFloat) {
    add_rms_rows<float>(x.data_ptr<float>(), r.data_ptr<float>(), w.data_ptr<float>(),
                        s.data_ptr<float>(), y.data_ptr<float>(), rows, d, static_cast<float>(eps));
  } else if (x.scalar_type() == at::kBFloat16) {
    using B = c10::BFloat16;
    add_rms_rows<B>(x.data_ptr<B>(), r.data_ptr<B>(), w.data_ptr<B>(), s.data_ptr<B>(),
                    y.data_ptr<B>(), rows, d, static_cast<float>(eps));
  } else {
    TORCH_CHECK(false, "add_rms_norm supports float32 and bfloat16");
  }
  splitphase_pool::park_after(rows);
}

// (x + r, rms_norm(x + r)): a residual add and the next norm in one pass.
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& r,
                                                const at::Tensor& w, double eps) {
  auto s = at::empty_like(x);
  auto y = at::empty_like(x);
  add_rms_norm_into(x, r, w, eps, s, y);
  return {s, y};
}

// The same with x + r written over r.
std::tuple<at::Tensor, at::Tensor> add_rms_norm_(const at::Tensor& x, at::Tensor& r,
                                                 const at::Tensor& w, double eps) {
  auto y = at::empty_like(x);
  add_rms_norm_into(x, r, w, eps, r, y);
  return {r, y};
}

}  // namespace splitphase_ops

namespace {

// One head of D = 2 * half values: y = x * cos + rotate_half(x) * sin, each product rounded
// to T as torch's bf16 ops round it.
template <typename T>
inline void rope_head(const T* xr, const T* cs, const T* sn, T* yr, int64_t half) {
#if SPLITPHASE_SIMD
  using splitphase_simd::round_to;
  const vf minus = set1(-1.f);  // an exact sign flip, as the scalar negation
  lanes(half, [&](int64_t i, int64_t n) {
    const vf lo = load(xr + i, n), hi = load(xr + half + i, n);
    const vf a_lo = round_to(mul(lo, load(cs + i, n)), T());
    const vf c_lo = round_to(mul(mul(hi, minus), load(sn + i, n)), T());
    store(yr + i, add(a_lo, c_lo), n);
    const vf a_hi = round_to(mul(hi, load(cs + half + i, n)), T());
    const vf c_hi = round_to(mul(lo, load(sn + half + i, n)), T());
    store(yr + half + i, add(a_hi, c_hi), n);
  });
#else
  for (int64_t i = 0; i < 2 * half; ++i) {
    float rot = i < half ? -static_cast<float>(xr[i + half]) : static_cast<float>(xr[i - half]);
    float a = rnd<T>(static_cast<float>(xr[i]) * static_cast<float>(cs[i]));
    float c = rnd<T>(rot * static_cast<float>(sn[i]));
    yr[i] = static_cast<T>(a + c);
  }
#endif
}

template <typename T>
void rope_rows(const T* x, int64_t x_row_stride, const T* cs, const T* sn, T* y, int64_t b,
               int64_t t, int64_t h, int64_t d, bool per_batch) {
  const int64_t half = d / 2;
  splitphase_pool::parallel_chunks(b * t, 4, b * t, [&](int64_t begin, int64_t end) {
    for (int64_t bt = begin; bt < end; ++bt) {
      int64_t table = (per_batch ? bt : bt % t) * d;  // cos/sin row of this position
      for (int64_t head = 0; head < h; ++head) {
        const T* xr = x + bt * x_row_stride + head * d;
        T* yr = y + (bt * h + head) * d;
        rope_head(xr, cs + table, sn + table, yr, half);
      }
    }
  });
}

}  // namespace

namespace splitphase_ops {

// The distance between x's (b, t) rows when each holds its H*D values contiguously, rows a fixed
// stride apart (a slice of a fused Q/K/V projection's output), else 0. With one position per
// row (decode) the rows are the batch's, whatever stride torch gives the size-1 dim.
static int64_t head_row_stride(const at::Tensor& x) {
  if (x.dim() != 4 || x.stride(3) != 1 || x.stride(2) != x.size(3)) return 0;
  const int64_t row = x.size(1) == 1 ? x.stride(0) : x.stride(1);
  const bool fixed = x.size(1) == 1 || x.stride(0) == x.size(1) * x.stride(1);
  return fixed && row >= x.size(2) * x.size(3) ? row : 0;
}

// x (B, T, H, D) rotated by cos/sin (B or 1, T, D): x * cos + rotate_half(x) * sin.
at::Tensor rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  // a contiguous x may have any stride on a size-1 dim: its rows are H*D apart
  const int64_t row_stride = x.is_contiguous() ? x.size(2) * x.size(3) : head_row_stride(x);
  TORCH_CHECK(row_stride > 0, "x (B, T, H, D), rows of contiguous heads");
  TORCH_CHECK(cos.dim() == 3 && cos.is_contiguous() && sin.is_contiguous(), "cos/sin (B|1,T,D)");
  TORCH_CHECK(cos.sizes() == sin.sizes() && cos.size(1) == x.size(1) && cos.size(2) == x.size(3),
              "cos/sin match x");
  TORCH_CHECK(cos.size(0) == 1 || cos.size(0) == x.size(0), "cos batch is 1 or B");
  TORCH_CHECK(x.size(3) % 2 == 0, "even head dim");
  TORCH_CHECK(cos.scalar_type() == x.scalar_type() && sin.scalar_type() == x.scalar_type(), "dtype");
  auto y = at::empty(x.sizes(), x.options());  // contiguous whatever x's row stride
  bool per_batch = cos.size(0) == x.size(0) && x.size(0) > 1;
  if (x.scalar_type() == at::kFloat) {
    rope_rows<float>(x.data_ptr<float>(), row_stride, cos.data_ptr<float>(), sin.data_ptr<float>(),
                     y.data_ptr<float>(), x.size(0), x.size(1), x.size(2), x.size(3), per_batch);
  } else if (x.scalar_type() == at::kBFloat16) {
    rope_rows<c10::BFloat16>(x.data_ptr<c10::BFloat16>(), row_stride, cos.data_ptr<c10::BFloat16>(),
                             sin.data_ptr<c10::BFloat16>(), y.data_ptr<c10::BFloat16>(),
                             x.size(0), x.size(1), x.size(2), x.size(3), per_batch);
  } else {
    TORCH_CHECK(false, "rope supports float32 and bfloat16");
  }
  splitphase_pool::park_after(x.size(0) * x.size(1));
  return y;
}

}  // namespace splitphase_ops

TORCH_LIBRARY_FRAGMENT(splitphase, m) {
  m.def("rms_norm(Tensor x, Tensor w, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor r, Tensor w, float eps) -> (Tensor, Tensor)");
  m.def("add_rms_norm_(Tensor x, Tensor(a!) r, Tensor w, float eps) -> (Tensor(a!), Tensor)");
  m.def("rope(Tensor x, Tensor cos, Tensor sin) -> Tensor");
}

TORCH_LIBRARY_IMPL(splitphase, CPU, m) {
  m.impl("rms_norm", &splitphase_ops::rms_norm);
  m.impl("add_rms_norm", &splitphase_ops::add_rms_norm);
  m.impl("add_rms_norm_", &splitphase_ops::add_rms_norm_);
  m.impl("rope", &splitphase_ops::rope);
}
