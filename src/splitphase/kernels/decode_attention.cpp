// Decode attention over a paged (or contiguous) KV pool: one new query token per sequence,
// each attending to its own context through a slot list. For every (sequence, KV head) the
// K rows and then the V rows of the context are read once, for all the query heads of that
// group (GQA), without gathering a padded copy of the context first. Scores, softmax and the
// weighted sum run in fp32 whatever the storage dtype (fp32 or bf16).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "ops.h"
#include "pool.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define SPLITPHASE_AVX512 1
#include "simd.h"
#endif

namespace {

#if SPLITPHASE_AVX512
using splitphase_simd::load16;
using splitphase_simd::load_tail;

template <typename T>
inline float dot(const float* q, const T* k, int64_t d) {
  __m512 a = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= d; i += 16) a = _mm512_fmadd_ps(_mm512_loadu_ps(q + i), load16(k + i), a);
  if (i < d) a = _mm512_fmadd_ps(load_tail(q + i, d - i), load_tail(k + i, d - i), a);
  return _mm512_reduce_add_ps(a);
}

// out[j] = dot(q, k[j]) for four keys: one transpose-and-add reduction for all four (a
// horizontal sum per key cost as much as the multiply-adds at head_dim 64).
template <typename T>
inline void dot4(const float* q, const T* const* k, int64_t d, float* out) {
  __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  int64_t i = 0;
  for (; i + 16 <= d; i += 16) {
    __m512 qv = _mm512_loadu_ps(q + i);
    a0 = _mm512_fmadd_ps(qv, load16(k[0] + i), a0);
    a1 = _mm512_fmadd_ps(qv, load16(k[1] + i), a1);
    a2 = _mm512_fmadd_ps(qv, load16(k[2] + i), a2);
    a3 = _mm512_fmadd_ps(qv, load16(k[3] + i), a3);
  }
  if (i < d) {
    __m512 qv = load_tail(q + i, d - i);
    a0 = _mm512_fmadd_ps(qv, load_tail(k[0] + i, d - i), a0);
    a1 = _mm512_fmadd_ps(qv, load_tail(k[1] + i, d - i), a1);
    a2 = _mm512_fmadd_ps(qv, load_tail(k[2] + i, d - i), a2);
    a3 = _mm512_fmadd_ps(qv, load_tail(k[3] + i, d - i), a3);
  }
  splitphase_simd::reduce4(a0, a1, a2, a3, out);
}

// p[t] = exp(p[t] - m) for t < n; returns their sum. 16 lanes at a time (the scalar expf was
// a tenth of a batch-8 step at context 512).
inline float exp_shifted(float* p, int64_t n, float m) {
  __m512 mv = _mm512_set1_ps(m), sum = _mm512_setzero_ps();
  for (int64_t t = 0; t < n; t += 16) {
    __mmask16 mask = n - t >= 16 ? static_cast<__mmask16>(0xffff)
                                 : splitphase_simd::tail_mask(n - t);
    __m512 e = splitphase_simd::exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(mask, p + t), mv));
    e = _mm512_maskz_mov_ps(mask, e);
    _mm512_mask_storeu_ps(p + t, mask, e);
    sum = _mm512_add_ps(sum, e);
  }
  return _mm512_reduce_add_ps(sum);
}

// o[:d] += w * v[:d]
template <typename T>
inline void axpy(float w, const T* v, float* o, int64_t d) {
  __m512 wv = _mm512_set1_ps(w);
  int64_t i = 0;
  for (; i + 16 <= d; i += 16) {
    _mm512_storeu_ps(o + i, _mm512_fmadd_ps(wv, load16(v + i), _mm512_loadu_ps(o + i)));
  }
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
#endif

// Rows (keys, then values) requested ahead of use; 8 to 64, and into L2 instead of L1, were
// no better within the noise.
constexpr int64_t kAheadRows = 16;

// Asks for the cache lines of one head_dim row now: a group's K (then V) rows are n_kv rows
// apart in the pool, a strided walk the hardware prefetchers follow poorly, so a layer whose
// K/V had left L2 (every layer of a decode step: the weights stream through in between) ran
// about three times slower than a warm one (prefetching took a cold layer at context 512 from
// 133-174 to 106-128 us, bf16 and fp32; a warm one stays at 40-47).
template <typename T>
inline void prefetch_row(const T* row, int64_t d) {
  const char* p = reinterpret_cast<const char*>(row);
  for (int64_t off = 0; off < d * static_cast<int64_t>(sizeof(T)); off += 64)
    __builtin_prefetch(p + off, 0, 3);
}

template <typename T>
void attend_group(const float* q, const T* kp, const T* vp, const int64_t* slots, int64_t len,
                  int64_t heads, int64_t g, int64_t n_kv, int64_t d, float scale, float* out) {
  // q: (heads, d) for this group; kp/vp: (slots, n_kv, d); out: (heads, d).
  std::vector<float> p(static_cast<size_t>(heads * len));
  auto key = [&](int64_t t) { return kp + (slots[t] * n_kv + g) * d; };
  const int64_t ahead = kAheadRows;
  for (int64_t t = 0; t < std::min(ahead, len); ++t) prefetch_row(key(t), d);
  int64_t t = 0;
  for (; t + 4 <= len; t += 4) {  // a row's blocking depends only on its own length
    for (int64_t u = t + ahead; u < std::min(t + ahead + 4, len); ++u) prefetch_row(key(u), d);
    const T* k4[4] = {key(t), key(t + 1), key(t + 2), key(t + 3)};
    for (int64_t h = 0; h < heads; ++h) {
      float s4[4];
      dot4(q + h * d, k4, d, s4);
      for (int j = 0; j < 4; ++j) p[h * len + t + j] = s4[j] * scale;
    }
  }
  for (; t < len; ++t) {
    for (int64_t h = 0; h < heads; ++h) p[h * len + t] = dot(q + h * d, key(t), d) * scale;
  }
  std::vector<float> inv(static_cast<size_t>(heads));
  for (int64_t h = 0; h < heads; ++h) {
    float* ph = p.data() + h * len;
    float m = -std::numeric_limits<float>::infinity();
    for (int64_t i = 0; i < len; ++i) m = std::max(m, ph[i]);
    inv[h] = 1.f / exp_shifted(ph, len, m);
  }
  std::fill(out, out + heads * d, 0.f);
  auto value = [&](int64_t u) { return vp + (slots[u] * n_kv + g) * d; };
  for (t = 0; t < std::min(ahead, len); ++t) prefetch_row(value(t), d);
  for (t = 0; t < len; ++t) {
    if (t + ahead < len) prefetch_row(value(t + ahead), d);
    const T* v = value(t);
    for (int64_t h = 0; h < heads; ++h) axpy(p[h * len + t], v, out + h * d, d);
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
  splitphase_pool::parallel_chunks(b * n_kv, 1, b, [&](int64_t begin, int64_t end) {
    for (int64_t job = begin; job < end; ++job) {
      int64_t row = job / n_kv, g = job % n_kv;
      int64_t off = (row * h + g * group) * d;
      attend_group(q + off, kp, vp, sl + row * s_max, ln[row], group, g, n_kv, d, scale,
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
  TORCH_CHECK(k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type(), "dtype");
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
  } else {
    TORCH_CHECK(false, "decode_attention supports float32 and bfloat16");
  }
  return outf.to(q.scalar_type());
}

}  // namespace splitphase_ops

TORCH_LIBRARY_FRAGMENT(splitphase, m) {
  m.def("decode_attention(Tensor q, Tensor k, Tensor v, Tensor slots, Tensor lengths) -> Tensor");
}

TORCH_LIBRARY_IMPL(splitphase, CPU, m) { m.impl("decode_attention", &splitphase_ops::decode_attention); }
