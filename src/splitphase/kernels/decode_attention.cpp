// Decode attention over a paged (or contiguous) KV pool: one new query token per sequence,
// each attending to its own context through a slot list. A job is one sequence's K/V heads
// (split in parts when the batch is smaller than the thread count): its K rows are read once
// for all its query heads (GQA), a slot's heads side by side, then each K/V head's V rows with
// that head's query outputs held in registers, without gathering a padded copy of the context
// first. Scores, softmax and the weighted sum run in fp32 whatever the storage dtype (fp32,
// bf16 or fp8, the pool's own: it need not be the query's).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

#include "ops.h"
#include "pool.h"

#include "simd.h"

namespace {

#if SPLITPHASE_SIMD
using splitphase_simd::add;
using splitphase_simd::fmadd;
using splitphase_simd::load16;
using splitphase_simd::load_tail;
using splitphase_simd::set1;
using splitphase_simd::store16;
using splitphase_simd::vf;
using splitphase_simd::zero;

template <typename T>
inline float dot(const float* q, const T* k, int64_t d) {
  vf a = zero();
  int64_t i = 0;
  for (; i + 16 <= d; i += 16) a = fmadd(load16(q + i), load16(k + i), a);
  if (i < d) a = fmadd(load_tail(q + i, d - i), load_tail(k + i, d - i), a);
  return splitphase_simd::reduce_add(a);
}

// out[j] = dot(q, k[j]) for four keys: one transpose-and-add reduction for all four (a
// horizontal sum per key cost as much as the multiply-adds at head_dim 64).
template <typename T>
inline void dot4(const float* q, const T* const* k, int64_t d, float* out) {
  vf a0 = zero(), a1 = a0, a2 = a0, a3 = a0;
  int64_t i = 0;
  for (; i + 16 <= d; i += 16) {
    vf qv = load16(q + i);
    a0 = fmadd(qv, load16(k[0] + i), a0);
    a1 = fmadd(qv, load16(k[1] + i), a1);
    a2 = fmadd(qv, load16(k[2] + i), a2);
    a3 = fmadd(qv, load16(k[3] + i), a3);
  }
  if (i < d) {
    vf qv = load_tail(q + i, d - i);
    a0 = fmadd(qv, load_tail(k[0] + i, d - i), a0);
    a1 = fmadd(qv, load_tail(k[1] + i, d - i), a1);
    a2 = fmadd(qv, load_tail(k[2] + i, d - i), a2);
    a3 = fmadd(qv, load_tail(k[3] + i, d - i), a3);
  }
  splitphase_simd::reduce4(a0, a1, a2, a3, out);
}

// p[t] = exp(p[t] - m) for t < n; returns their sum. 16 lanes at a time (the scalar expf was
// a tenth of a batch-8 step at context 512); the tail's lanes past n, reloaded as zeros, add
// nothing.
inline float exp_shifted(float* p, int64_t n, float m) {
  vf mv = set1(m), sum = zero();
  int64_t t = 0;
  for (; t + 16 <= n; t += 16) {
    vf e = splitphase_simd::exp16(splitphase_simd::sub(load16(p + t), mv));
    store16(p + t, e);
    sum = add(sum, e);
  }
  if (t < n) {
    splitphase_simd::store_tail(
        p + t, splitphase_simd::exp16(splitphase_simd::sub(load_tail(p + t, n - t), mv)), n - t);
    sum = add(sum, load_tail(p + t, n - t));
  }
  return splitphase_simd::reduce_add(sum);
}

// max(p[0:n]), 16 lanes at a time (a scalar max is a chain of dependent instructions: a fifth
// of a batch-8 call at context 512). Exact: a maximum does not depend on the order.
inline float max_of(const float* p, int64_t n) {
  vf mx = set1(-std::numeric_limits<float>::infinity());
  int64_t t = 0;
  for (; t + 16 <= n; t += 16) mx = splitphase_simd::max(mx, load16(p + t));
  float m = splitphase_simd::reduce_max(mx);
  for (; t < n; ++t) m = std::max(m, p[t]);
  return m;
}

// dst[:d] = v[:d] widened to fp32 (exact).
template <typename T>
inline void widen_row(const T* v, float* dst, int64_t d) {
  int64_t i = 0;
  for (; i + 16 <= d; i += 16) store16(dst + i, load16(v + i));
  if (i < d) splitphase_simd::store_tail(dst + i, load_tail(v + i, d - i), d - i);
}

// o[:d] += w * v[:d]
template <typename T>
inline void axpy(float w, const T* v, float* o, int64_t d) {
  vf wv = set1(w);
  int64_t i = 0;
  for (; i + 16 <= d; i += 16) store16(o + i, fmadd(wv, load16(v + i), load16(o + i)));
  for (; i < d; ++i) o[i] += w * static_cast<float>(v[i]);
}

#else
template <typename T>
inline float dot(const float* q, const T* k, int64_t d) {
  float s = 0.f;
  for (int64_t i = 0; i < d; ++i) s += q[i] * static_cast<float>(k[i]);
  return s;
}

template <typename T>
inline void dot4(const float* q, const T* const* k, int64_t d, float* out) {
  for (int j = 0; j < 4; ++j) out[j] = dot(q, k[j], d);
}

inline float max_of(const float* p, int64_t n) {
  float m = -std::numeric_limits<float>::infinity();
  for (int64_t i = 0; i < n; ++i) m = std::max(m, p[i]);
  return m;
}

inline float exp_shifted(float* p, int64_t n, float m) {
  float sum = 0.f;
  for (int64_t t = 0; t < n; ++t) {
    p[t] = std::exp(p[t] - m);
    sum += p[t];
  }
  return sum;
}

template <typename T>
inline void axpy(float w, const T* v, float* o, int64_t d) {
  for (int64_t i = 0; i < d; ++i) o[i] += w * static_cast<float>(v[i]);
}

template <typename T>
inline void widen_row(const T* v, float* dst, int64_t d) {
  for (int64_t i = 0; i < d; ++i) dst[i] = static_cast<float>(v[i]);
}
#endif

// Rows (keys, then values) requested ahead of use; 8 to 64 were no better within the noise.
constexpr int64_t kAheadRows = 16;

// Asks for the cache lines of one head_dim row now: a group's K (then V) rows are n_kv rows
// apart in the pool, a strided walk the hardware prefetchers follow poorly, so a layer whose
// K/V had left L2 (every layer of a decode step: the weights stream through in between) ran
// about three times slower than a warm one (prefetching took a cold layer at context 512 from
// 133-174 to 106-128 us, bf16 and fp32; a warm one stays at 40-47). The lines go to L2, not L1
// (T0): on the AMD Zen 4 host (fp32, context 512, 12 layers with 64 MB read between them) a
// batch-8 layer took 358-435 us against 599-708 with T0, and whole decode steps of base-125m,
// in alternating processes, 0.84-0.92x the time at batch 8 and 32 (fp32 and bf16). A job's
// rows ahead are hundreds of lines, past what L1 can have in flight (NTA was as slow as T0).
template <typename T>
inline void prefetch_row(const T* row, int64_t d) {
  const char* p = reinterpret_cast<const char*>(row);
  for (int64_t off = 0; off < d * static_cast<int64_t>(sizeof(T)); off += 64)
    __builtin_prefetch(p + off, 0, 2);  // PREFETCHT1: into L2
}

#if SPLITPHASE_SIMD
// The value walk's unit is one register of fp32 lanes (zmm: 16, ymm: 8), not simd.h's 16-lane
// vf (two ymm on AVX2): a strip's accumulators, one broadcast weight a head and the value
// vector they share must fit the register file, 32 vectors with AVX-512 and 16 without.
#if SPLITPHASE_AVX512
using reg_t = __m512;
constexpr int kRegLanes = 16, kVecRegs = 32;
inline reg_t reg_load(const float* p) { return _mm512_loadu_ps(p); }
inline reg_t reg_load(const c10::BFloat16* p) { return splitphase_simd::load16(p); }
inline reg_t reg_load(const c10::Float8_e4m3fn* p) { return splitphase_simd::load16(p); }
inline reg_t reg_load(const c10::Float8_e5m2* p) { return splitphase_simd::load16(p); }
inline reg_t reg_broadcast(const float* p) { return _mm512_set1_ps(*p); }
inline reg_t reg_fmadd(reg_t a, reg_t b, reg_t c) { return _mm512_fmadd_ps(a, b, c); }
inline reg_t reg_zero() { return _mm512_setzero_ps(); }
inline void reg_store(float* p, reg_t v) { _mm512_storeu_ps(p, v); }
#define SPLITPHASE_IN_REGISTER(v) asm("" : "+v"(v))
#else
using reg_t = __m256;
constexpr int kRegLanes = 8, kVecRegs = 16;
inline reg_t reg_load(const float* p) { return _mm256_loadu_ps(p); }
inline reg_t reg_load(const c10::BFloat16* p) { return splitphase_simd::widen8(p); }
inline reg_t reg_load(const c10::Float8_e4m3fn* p) { return splitphase_simd::widen8(p); }
inline reg_t reg_load(const c10::Float8_e5m2* p) { return splitphase_simd::widen8(p); }
inline reg_t reg_broadcast(const float* p) { return _mm256_broadcast_ss(p); }
inline reg_t reg_fmadd(reg_t a, reg_t b, reg_t c) { return _mm256_fmadd_ps(a, b, c); }
inline reg_t reg_zero() { return _mm256_setzero_ps(); }
inline void reg_store(float* p, reg_t v) { _mm256_storeu_ps(p, v); }
#define SPLITPHASE_IN_REGISTER(v) asm("" : "+x"(v))
#endif

// out[h][:C * kRegLanes] = sum_t p[h * len + t] * v_t for the H query heads of one K/V head,
// v_t at base + slots[t] * stride, the accumulators in registers for the whole walk. Every
// output lane sums its keys in order, one rounding each, as axpy from zeroed out does, so
// the result does not depend on the register width or the strips. With `ask_ahead`, the row
// kAheadRows ahead is requested as it goes (false where another strip of the same rows
// asks). 2.0x the speed of the walk on vf it replaced with the data in L2 (that one needed 17
// ymm at 3 heads, so GCC kept its accumulators in a stack array); 0.88-1.05x the time cold,
// where memory sets the pace (docs/performance.md, session 34).
template <int H, int C, typename T>
inline void value_walk(const float* p, int64_t len, const T* base, const int64_t* slots,
                       int64_t stride, bool ask_ahead, float* out, int64_t d) {
  reg_t acc[H][C];
  // Unrolled in full, so the accumulators are registers, not an indexed array.
#pragma GCC unroll 8
  for (int h = 0; h < H; ++h)
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) acc[h][c] = reg_zero();
  for (int64_t t = 0; t < len; ++t) {
    if (ask_ahead && t + kAheadRows < len) prefetch_row(base + slots[t + kAheadRows] * stride, d);
    const T* v = base + slots[t] * stride;
    reg_t w[H];
#pragma GCC unroll 8
    for (int h = 0; h < H; ++h) w[h] = reg_broadcast(p + h * len + t);
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) {
      reg_t x = reg_load(v + c * kRegLanes);
      // One load shared by the H multiply-adds: short of registers, GCC otherwise folds the
      // load into each of them (H loads a vector; 1.13x the time at 3 heads).
      SPLITPHASE_IN_REGISTER(x);
#pragma GCC unroll 8
      for (int h = 0; h < H; ++h) acc[h][c] = reg_fmadd(w[h], x, acc[h][c]);
    }
  }
#pragma GCC unroll 8
  for (int h = 0; h < H; ++h)
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) reg_store(out + h * d + c * kRegLanes, acc[h][c]);
}

// value_walk over n <= C register widths (C - 1, C - 2, ... instantiated down to 1).
template <int H, int C, typename T>
inline void value_strip(int64_t n, const float* p, int64_t len, const T* base,
                        const int64_t* slots, int64_t stride, bool ask_ahead, float* out,
                        int64_t d) {
  if constexpr (C > 1) {
    if (n < C) return value_strip<H, C - 1>(n, p, len, base, slots, stride, ask_ahead, out, d);
  }
  value_walk<H, C>(p, len, base, slots, stride, ask_ahead, out, d);
}

// The value walk of H heads over d in strips of as many register widths as fit beside the
// H weights and the value vector (AVX2: 8 at one head, 6 at two, 4 at three, 2 at four); each
// strip walks the rows again, from cache, and only the first asks for the lines ahead.
template <int H, typename T>
inline void value_strips(const float* p, int64_t len, const T* base, const int64_t* slots,
                         int64_t stride, float* out, int64_t d) {
  constexpr int kMost = std::min(8, (kVecRegs - H - 1) / H);
  const int64_t cols = d / kRegLanes;
  for (int64_t c0 = 0; c0 < cols; c0 += kMost) {
    value_strip<H, kMost>(std::min<int64_t>(kMost, cols - c0), p, len, base + c0 * kRegLanes,
                          slots, stride, c0 == 0, out + c0 * kRegLanes, d);
  }
}

// False where the walk does not apply (more than 4 heads a K/V head, or d not a multiple of
// 16, even where 8-lane registers would cover it: both instruction sets then take one path,
// axpy's, whose scalar tail rounds differently): the caller sums with axpy.
template <typename T>
inline bool value_in_registers(int64_t heads, const float* p, int64_t len, const T* base,
                               const int64_t* slots, int64_t stride, float* out, int64_t d) {
  if (d % 16 != 0) return false;
  switch (heads) {
    case 1: value_strips<1>(p, len, base, slots, stride, out, d); return true;
    case 2: value_strips<2>(p, len, base, slots, stride, out, d); return true;
    case 3: value_strips<3>(p, len, base, slots, stride, out, d); return true;
    case 4: value_strips<4>(p, len, base, slots, stride, out, d); return true;
    default: return false;
  }
}
#else
template <typename T>
inline bool value_in_registers(int64_t, const float*, int64_t, const T*, const int64_t*, int64_t,
                               float*, int64_t) {
  return false;
}
#endif

// One sequence's query heads of the K/V heads [g0, g1), over its len context slots. The
// pool stores a slot's K/V heads side by side ((slots, n_kv, d)), so reading all of a job's
// heads from each slot row walks the pool in contiguous runs (a block's slots are adjacent)
// where one head at a time read a d-row every n_kv * d. Per query head the arithmetic is the
// same whatever [g0, g1) is (scores four keys at a time, then the softmax, then the weighted
// sum over slots in order): a row's result does not depend on how jobs split the heads.
template <typename T>
void attend_groups(const float* q, const T* kp, const T* vp, const int64_t* slots, int64_t len,
                   int64_t group, int64_t g0, int64_t g1, int64_t n_kv, int64_t d, float scale,
                   float* out) {
  // q: (g1 - g0) * group heads of d for these groups; kp/vp: (slots, n_kv, d); out like q.
  const int64_t heads = (g1 - g0) * group, span = (g1 - g0) * d;
  std::vector<float> p(static_cast<size_t>(heads * len));
  auto key = [&](int64_t t, int64_t g) { return kp + (slots[t] * n_kv + g) * d; };
  const int64_t ahead = kAheadRows;
  // A narrower pool's four keys widened once for all the group's query heads, not once a
  // head: an fp8 widening is four instructions a vector, a head's dot products one.
  std::vector<float> wide(static_cast<size_t>(4 * d));  // unused for an fp32 pool
  const float* w4[4] = {wide.data(), wide.data() + d, wide.data() + 2 * d, wide.data() + 3 * d};
  for (int64_t t = 0; t < std::min(ahead, len); ++t) prefetch_row(key(t, g0), span);
  int64_t t = 0;
  for (; t + 4 <= len; t += 4) {  // a row's blocking depends only on its own length
    for (int64_t g = g0; g < g1; ++g) {
      // Each head's part of the four rows ahead beside its own dot products, not all of the
      // rows at once (64 lines at base-125m fp32): the score pass alone ran at 1.2x the speed
      // (cold, block-shuffled slots, one thread), the whole attention at 0.88-0.98x the time
      // (best of 10, alternated in one process).
      for (int64_t u = t + ahead; u < std::min(t + ahead + 4, len); ++u) prefetch_row(key(u, g), d);
      const T* k4[4] = {key(t, g), key(t + 1, g), key(t + 2, g), key(t + 3, g)};
      if constexpr (!std::is_same_v<T, float>) {
        for (int j = 0; j < 4; ++j) widen_row(k4[j], wide.data() + j * d, d);
      }
      for (int64_t h = (g - g0) * group; h < (g - g0 + 1) * group; ++h) {
        float s4[4];
        if constexpr (std::is_same_v<T, float>) {
          dot4(q + h * d, k4, d, s4);
        } else {
          dot4(q + h * d, w4, d, s4);
        }
        for (int j = 0; j < 4; ++j) p[h * len + t + j] = s4[j] * scale;
      }
    }
  }
  for (; t < len; ++t) {
    for (int64_t h = 0; h < heads; ++h) {
      p[h * len + t] = dot(q + h * d, key(t, g0 + h / group), d) * scale;
    }
  }
  std::vector<float> inv(static_cast<size_t>(heads));
  for (int64_t h = 0; h < heads; ++h) {
    float* ph = p.data() + h * len;
    inv[h] = 1.f / exp_shifted(ph, len, max_of(ph, len));
  }
  const int64_t stride = n_kv * d;  // from a slot's row of one K/V head to the next slot's
  for (int64_t g = g0; g < g1; ++g) {  // one K/V head's rows at a time, its heads in registers
    const int64_t h0 = (g - g0) * group;
    const T* base = vp + g * d;
    for (t = 0; t < std::min(ahead, len); ++t) prefetch_row(base + slots[t] * stride, d);
    const float* pg = p.data() + h0 * len;
    if (value_in_registers(group, pg, len, base, slots, stride, out + h0 * d, d)) continue;
    std::fill(out + h0 * d, out + (h0 + group) * d, 0.f);
    for (t = 0; t < len; ++t) {
      if (t + ahead < len) prefetch_row(base + slots[t + ahead] * stride, d);
      const T* v = base + slots[t] * stride;
      for (int64_t h = h0; h < h0 + group; ++h) axpy(p[h * len + t], v, out + h * d, d);
    }
  }
  for (int64_t h = 0; h < heads; ++h) {
    for (int64_t i = 0; i < d; ++i) out[h * d + i] *= inv[h];
  }
}

template <typename T>
void decode_impl(const at::Tensor& qf, const at::Tensor& k, const at::Tensor& v,
                 const at::Tensor& slots, const at::Tensor& lengths, at::Tensor& outf) {
  const int64_t b = qf.size(0), h = qf.size(1), d = qf.size(2), n_kv = k.size(1);
  const int64_t group = h / n_kv, s_max = slots.size(1);
  const float scale = 1.f / std::sqrt(static_cast<float>(d));
  const float* q = qf.data_ptr<float>();
  const T* kp = k.data_ptr<T>();
  const T* vp = v.data_ptr<T>();
  const int64_t* sl = slots.data_ptr<int64_t>();
  const int64_t* ln = lengths.data_ptr<int64_t>();
  float* out = outf.data_ptr<float>();
  // A job is one sequence's K/V heads, split into as many parts as it takes to give every
  // thread work when the batch is smaller than the thread count (batch 1: halves on 2 threads).
  const int64_t threads = at::get_num_threads();
  const int64_t parts = std::min(n_kv, std::max<int64_t>(1, (threads + b - 1) / b));
  const int64_t per_part = (n_kv + parts - 1) / parts;
  splitphase_pool::parallel_chunks(b * parts, 1, b, [&](int64_t begin, int64_t end) {
    for (int64_t job = begin; job < end; ++job) {
      int64_t row = job / parts, g0 = (job % parts) * per_part;
      int64_t g1 = std::min(n_kv, g0 + per_part);
      if (g0 >= g1) continue;
      int64_t off = (row * h + g0 * group) * d;
      attend_groups(q + off, kp, vp, sl + row * s_max, ln[row], group, g0, g1, n_kv, d, scale,
                    out + off);
    }
  });
}

}  // namespace

namespace splitphase_ops {

// q (B, H, D); k, v (N, G, D) pools; slots (B, S) int64 (first lengths[b] used); -> (B, H, D).
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const at::Tensor& slots, const at::Tensor& lengths) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3, "q (B,H,D), k/v (N,G,D)");
  TORCH_CHECK(k.is_contiguous() && v.is_contiguous(), "k/v pools must be contiguous");
  TORCH_CHECK(q.size(1) % k.size(1) == 0 && q.size(2) == k.size(2), "GQA shapes");
  TORCH_CHECK(slots.scalar_type() == at::kLong && lengths.scalar_type() == at::kLong, "int64");
  TORCH_CHECK(slots.dim() == 2 && slots.size(0) == q.size(0) && lengths.numel() == q.size(0),
              "slots (B, S), lengths (B,)");
  // The pool may keep K/V narrower than the model computes (an fp32 model over a bf16 or fp8
  // pool, unscaled, as vLLM's fp8 cache without calibrated scales): q is read in fp32 either
  // way.
  TORCH_CHECK(v.scalar_type() == k.scalar_type(), "k and v pools share a dtype");
  auto sl = slots.contiguous();
  auto ln = lengths.contiguous();
  // Slot values and 1 <= lengths <= S are the caller's contract (checked once per step in
  // Python, not once per layer here).
  auto qf = q.to(at::kFloat).contiguous();
  auto outf = at::empty(qf.sizes(), qf.options());
  if (k.scalar_type() == at::kFloat) {
    decode_impl<float>(qf, k, v, sl, ln, outf);
  } else if (k.scalar_type() == at::kBFloat16) {
    decode_impl<c10::BFloat16>(qf, k, v, sl, ln, outf);
  } else if (k.scalar_type() == at::kFloat8_e4m3fn) {
    decode_impl<c10::Float8_e4m3fn>(qf, k, v, sl, ln, outf);
  } else if (k.scalar_type() == at::kFloat8_e5m2) {
    decode_impl<c10::Float8_e5m2>(qf, k, v, sl, ln, outf);
  } else {
    TORCH_CHECK(false, "decode_attention supports float32, bfloat16 and fp8 (e4m3fn, e5m2) pools");
  }
  return outf.to(q.scalar_type());
}

}  // namespace splitphase_ops

TORCH_LIBRARY_FRAGMENT(splitphase, m) {
  m.def("decode_attention(Tensor q, Tensor k, Tensor v, Tensor slots, Tensor lengths) -> Tensor");
}

TORCH_LIBRARY_IMPL(splitphase, CPU, m) { m.impl("decode_attention", &splitphase_ops::decode_attention); }
