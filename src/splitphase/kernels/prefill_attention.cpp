// Causal GQA prefill attention in fp32, flash-style (Dao et al. 2022): queries in tiles of
// 32 positions against keys in tiles of 64 with an online softmax (running max and sum per
// row), so the (T, S) score matrix never exists. Key tiles above the diagonal are skipped and
// only the tiles the diagonal crosses are masked. The H/G query heads that share a K/V head
// form one block of rows against each K/V tile, so a K/V tile is read once per group.
// Work items are (sequence, KV head, query tile), the costliest (last) tiles first.
//
// Every row is reached through a pointer (a query row's H*D values, a key's G*D values), so
// one core serves a strided batch (the contiguous KV cache) and a paged pool read in place
// through slots with the chunk's query rows gathered from a flattened batch.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <limits>
#include <numeric>
#include <vector>

#include "pool.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define SPLITPHASE_AVX512 1
#include "simd.h"
#endif

namespace {

constexpr int64_t kQTile = 32;  // query positions per work item
constexpr int64_t kKTile = 64;  // keys per tile: four 16-lane vectors of scores per row
constexpr int kRows = 6;        // rows per register block: 6 x 4 accumulators of 32 zmm

// One sequence's rows: T queries (the last T of its S positions) over S keys.
struct Seq {
  std::vector<const float*> q;  // (T,) each -> (H, D)
  std::vector<const float*> k;  // (S,) each -> (G, D)
  std::vector<const float*> v;  // (S,) each -> (G, D)
  std::vector<float*> out;      // (T,) each -> (H * D)
};

struct Shape {
  int64_t heads, groups, dim;
  int64_t per_group() const { return heads / groups; }
};

#if SPLITPHASE_AVX512
// s[r][0:64] = q_r . kt[:, 0:64] for R query rows; kt is one packed key tile (D, 64).
template <int R>
inline void qk_block(const float* const* q, const float* kt, int64_t d, float* s) {
  __m512 acc[R][4];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 4; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t i = 0; i < d; ++i) {
    const float* kr = kt + i * kKTile;
    __m512 k0 = _mm512_loadu_ps(kr), k1 = _mm512_loadu_ps(kr + 16);
    __m512 k2 = _mm512_loadu_ps(kr + 32), k3 = _mm512_loadu_ps(kr + 48);
    for (int r = 0; r < R; ++r) {
      __m512 qb = _mm512_set1_ps(q[r][i]);
      acc[r][0] = _mm512_fmadd_ps(qb, k0, acc[r][0]);
      acc[r][1] = _mm512_fmadd_ps(qb, k1, acc[r][1]);
      acc[r][2] = _mm512_fmadd_ps(qb, k2, acc[r][2]);
      acc[r][3] = _mm512_fmadd_ps(qb, k3, acc[r][3]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 4; ++c) _mm512_storeu_ps(s + r * kKTile + 16 * c, acc[r][c]);
}

// o[r][col:col+16NV] = alpha[r] * o[r][...] + sum_j p[r][j] * v_j[col:...] over n keys.
template <int R, int NV>
inline void pv_block(const float* p, const float* const* v, int64_t n, int64_t col,
                     const float* alpha, float* o, int64_t ld) {
  __m512 acc[R][NV];
  for (int r = 0; r < R; ++r) {
    __m512 a = _mm512_set1_ps(alpha[r]);
    for (int c = 0; c < NV; ++c) acc[r][c] = _mm512_mul_ps(a, _mm512_loadu_ps(o + r * ld + col + 16 * c));
  }
  for (int64_t j = 0; j < n; ++j) {
    __m512 vj[NV];
    for (int c = 0; c < NV; ++c) vj[c] = _mm512_loadu_ps(v[j] + col + 16 * c);
    for (int r = 0; r < R; ++r) {
      __m512 pb = _mm512_set1_ps(p[r * kKTile + j]);
      for (int c = 0; c < NV; ++c) acc[r][c] = _mm512_fmadd_ps(pb, vj[c], acc[r][c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < NV; ++c) _mm512_storeu_ps(o + r * ld + col + 16 * c, acc[r][c]);
}

// 2^x, Cephes' exp2f: x = n + r with |r| <= 1/2, a degree-6 polynomial for 2^r, scaled by
// 2^n (scalef gives 0 for a very negative n; no clamp needed). Lanes outside `keep` are 0.
inline __m512 exp2_16(__mmask16 keep, __m512 x) {
  __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_sub_ps(x, n);
  __m512 p = _mm512_set1_ps(1.535336188319500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.339887440266574e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(9.618437357674640e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.550332471162809e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(2.402264791363012e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(6.931472028550421e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  return _mm512_maskz_scalef_ps(keep, p, n);
}

inline __mmask16 key_mask(int64_t valid, int c) {
  int64_t left = valid - 16 * c;
  if (left >= 16) return static_cast<__mmask16>(0xffff);
  return left > 0 ? splitphase_simd::tail_mask(left) : static_cast<__mmask16>(0);
}

// Folds one tile of raw scores s (rows x 64; row r's first valid[r] are real) into the
// running softmax, in log2 units (c = scale * log2 e): m (the running max) moves up, alpha
// gets 2^(m_old - m_new) (what the output so far is rescaled by), s becomes 2^(c s - m_new)
// (0 past valid[r]) and each row's 16-lane partial sums l are rescaled and added to. The
// arrays hold rows rounded up to 16; the rows past `rows` stay finite and unused.
inline void softmax_tile(float* s, int64_t rows, int64_t rows16, const int64_t* valid, float c,
                         float* m, float* alpha, float* l) {
  const __m512 ninf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t r = 0; r < rows16; ++r) {
    alpha[r] = m[r];
    if (r >= rows) continue;
    __m512 mx = ninf;
    for (int k = 0; k < 4; ++k)
      mx = _mm512_mask_max_ps(mx, key_mask(valid[r], k), mx, _mm512_loadu_ps(s + r * kKTile + 16 * k));
    m[r] = std::max(m[r], _mm512_reduce_max_ps(mx) * c);  // the scale is > 0: max commutes
  }
  for (int64_t r = 0; r < rows16; r += 16) {
    __m512 d = _mm512_sub_ps(_mm512_loadu_ps(alpha + r), _mm512_loadu_ps(m + r));
    _mm512_storeu_ps(alpha + r, exp2_16(0xffff, d));
  }
  const __m512 cv = _mm512_set1_ps(c);
  for (int64_t r = 0; r < rows; ++r) {
    __m512 mv = _mm512_set1_ps(m[r]), sum = _mm512_setzero_ps();
    for (int k = 0; k < 4; ++k) {
      float* p = s + r * kKTile + 16 * k;
      __m512 e = exp2_16(key_mask(valid[r], k), _mm512_fmsub_ps(_mm512_loadu_ps(p), cv, mv));
      _mm512_storeu_ps(p, e);
      sum = _mm512_add_ps(sum, e);
    }
    __m512 lr = _mm512_loadu_ps(l + 16 * r);
    _mm512_storeu_ps(l + 16 * r, _mm512_fmadd_ps(lr, _mm512_set1_ps(alpha[r]), sum));
  }
}
#else
template <int R>
inline void qk_block(const float* const* q, const float* kt, int64_t d, float* s) {
  for (int r = 0; r < R; ++r) {
    for (int64_t c = 0; c < kKTile; ++c) s[r * kKTile + c] = 0.f;
    for (int64_t i = 0; i < d; ++i)
      for (int64_t c = 0; c < kKTile; ++c) s[r * kKTile + c] += q[r][i] * kt[i * kKTile + c];
  }
}

template <int R, int NV>
inline void pv_block(const float* p, const float* const* v, int64_t n, int64_t col,
                     const float* alpha, float* o, int64_t ld) {
  for (int r = 0; r < R; ++r) {
    float* orow = o + r * ld + col;
    for (int64_t c = 0; c < 16 * NV; ++c) orow[c] *= alpha[r];
    for (int64_t j = 0; j < n; ++j)
      for (int64_t c = 0; c < 16 * NV; ++c) orow[c] += p[r * kKTile + j] * v[j][col + c];
  }
}

inline void softmax_tile(float* s, int64_t rows, int64_t rows16, const int64_t* valid, float c,
                         float* m, float* alpha, float* l) {
  for (int64_t r = 0; r < rows16; ++r) {
    alpha[r] = m[r];
    if (r >= rows) continue;
    for (int64_t j = 0; j < valid[r]; ++j) m[r] = std::max(m[r], s[r * kKTile + j] * c);
  }
  for (int64_t r = 0; r < rows16; ++r) alpha[r] = std::exp2(alpha[r] - m[r]);
  for (int64_t r = 0; r < rows; ++r) {
    float sum = 0.f, *p = s + r * kKTile;
    for (int64_t j = 0; j < kKTile; ++j) {
      p[j] = j < valid[r] ? std::exp2(p[j] * c - m[r]) : 0.f;
      sum += p[j];
    }
    l[16 * r] = l[16 * r] * alpha[r] + sum;  // lane 0 of the row's partial sums
  }
}
#endif

using QkFn = void (*)(const float* const*, const float*, int64_t, float*);
constexpr QkFn kQk[kRows + 1] = {nullptr, qk_block<1>, qk_block<2>, qk_block<3>,
                                 qk_block<4>, qk_block<5>, qk_block<6>};

template <int NV>
void pv_rows(int rows, const float* p, const float* const* v, int64_t n, int64_t col,
             const float* alpha, float* o, int64_t ld) {
  switch (rows) {
    case 1: return pv_block<1, NV>(p, v, n, col, alpha, o, ld);
    case 2: return pv_block<2, NV>(p, v, n, col, alpha, o, ld);
    case 3: return pv_block<3, NV>(p, v, n, col, alpha, o, ld);
    case 4: return pv_block<4, NV>(p, v, n, col, alpha, o, ld);
    case 5: return pv_block<5, NV>(p, v, n, col, alpha, o, ld);
    default: return pv_block<6, NV>(p, v, n, col, alpha, o, ld);
  }
}

// o[rows] = alpha * o + p @ V over n keys, all D columns in chunks of up to 4 vectors.
void pv_all(int rows, const float* p, const float* const* v, int64_t n, const float* alpha,
            float* o, int64_t d) {
  int64_t col = 0;
  for (; col + 64 <= d; col += 64) pv_rows<4>(rows, p, v, n, col, alpha, o, d);
  switch ((d - col) / 16) {
    case 1: pv_rows<1>(rows, p, v, n, col, alpha, o, d); break;
    case 2: pv_rows<2>(rows, p, v, n, col, alpha, o, d); break;
    case 3: pv_rows<3>(rows, p, v, n, col, alpha, o, d); break;
    default: break;
  }
}

// Keys of every (sequence, KV head) as tiles of (D, 64), transposed so a query row's scores
// for 64 keys are 64 lanes of one multiply-add per dimension; zeros past the last key.
struct PackedKeys {
  std::vector<float> data;
  std::vector<int64_t> seq_base;  // offset of sequence i's (G, tiles, D, 64) block

  float* tile(int64_t seq, int64_t g, int64_t kt, int64_t tiles, int64_t d) {
    return data.data() + seq_base[seq] + ((g * tiles) + kt) * d * kKTile;
  }
};

int64_t n_tiles(int64_t n, int64_t tile) { return (n + tile - 1) / tile; }

PackedKeys pack_keys(const std::vector<Seq>& seqs, const Shape& sh) {
  PackedKeys pk;
  int64_t total = 0;
  std::vector<int64_t> jobs;  // (seq, g, kt) flattened
  for (const Seq& s : seqs) {
    pk.seq_base.push_back(total);
    total += sh.groups * n_tiles(static_cast<int64_t>(s.k.size()), kKTile) * sh.dim * kKTile;
  }
  pk.data.resize(static_cast<size_t>(total));
  std::vector<std::array<int64_t, 3>> items;
  for (int64_t i = 0; i < static_cast<int64_t>(seqs.size()); ++i) {
    int64_t tiles = n_tiles(static_cast<int64_t>(seqs[i].k.size()), kKTile);
    for (int64_t g = 0; g < sh.groups; ++g)
      for (int64_t kt = 0; kt < tiles; ++kt) items.push_back({i, g, kt});
  }
  splitphase_pool::parallel_chunks(static_cast<int64_t>(items.size()), 4, [&](int64_t b, int64_t e) {
    for (int64_t it = b; it < e; ++it) {
      auto [i, g, kt] = items[it];
      const Seq& s = seqs[i];
      int64_t len = static_cast<int64_t>(s.k.size()), tiles = n_tiles(len, kKTile);
      float* dst = pk.tile(i, g, kt, tiles, sh.dim);
      for (int64_t c = 0; c < kKTile; ++c) {
        int64_t key = kt * kKTile + c;
        const float* src = key < len ? s.k[key] + g * sh.dim : nullptr;
        for (int64_t x = 0; x < sh.dim; ++x) dst[x * kKTile + c] = src ? src[x] : 0.f;
      }
    }
  });
  return pk;
}

// One work item: query tile qt of sequence `seq`, the query heads of KV head g.
struct Item {
  int64_t seq, g, qt, key_tiles;
};

void attend_item(const Seq& s, const Item& it, const Shape& sh, PackedKeys& pk) {
  const int64_t t_len = static_cast<int64_t>(s.q.size()), s_len = static_cast<int64_t>(s.k.size());
  const int64_t offset = s_len - t_len, d = sh.dim, hg = sh.per_group();
  const int64_t t0 = it.qt * kQTile, tq = std::min(kQTile, t_len - t0), rows = hg * tq;
  // Softmax in log2 units: 2^(c s) = e^(s / sqrt(D)).
  const float c = 1.4426950408889634f / std::sqrt(static_cast<float>(d));
  const int64_t rows16 = n_tiles(rows, 16) * 16;
  thread_local std::vector<float> sbuf, obuf, stats;
  thread_local std::vector<const float*> qrow, vrow;
  thread_local std::vector<int64_t> valid;
  sbuf.resize(static_cast<size_t>(rows * kKTile));
  obuf.assign(static_cast<size_t>(rows * d), 0.f);
  stats.assign(static_cast<size_t>(18 * rows16), 0.f);  // running max, rescale, 16-lane sums
  float *m = stats.data(), *alpha = m + rows16, *l = alpha + rows16;
  // A finite floor, not -inf: the first rescale 2^(floor - m) is then exactly 0, not NaN.
  std::fill(m, m + rows, -1e30f);
  qrow.resize(static_cast<size_t>(rows));
  valid.resize(static_cast<size_t>(rows));
  for (int64_t j = 0; j < hg; ++j)  // row j * tq + t: head g * hg + j at position t0 + t
    for (int64_t t = 0; t < tq; ++t) qrow[j * tq + t] = s.q[t0 + t] + (it.g * hg + j) * d;
  vrow.resize(static_cast<size_t>(kKTile));
  const int64_t tiles = n_tiles(s_len, kKTile);
  for (int64_t kt = 0; kt < it.key_tiles; ++kt) {
    const int64_t k0 = kt * kKTile, n_keys = std::min(kKTile, s_len - k0);
    const float* ktile = pk.tile(it.seq, it.g, kt, tiles, d);
    for (int64_t r = 0; r < rows; r += kRows) {
      int64_t nr = std::min<int64_t>(kRows, rows - r);
      kQk[nr](qrow.data() + r, ktile, d, sbuf.data() + r * kKTile);
    }
    for (int64_t r = 0; r < rows; ++r) {  // keys at positions <= the query's own
      valid[r] = std::clamp<int64_t>(offset + t0 + r % tq - k0 + 1, 0, n_keys);
    }
    softmax_tile(sbuf.data(), rows, rows16, valid.data(), c, m, alpha, l);
    for (int64_t j = 0; j < n_keys; ++j) vrow[j] = s.v[k0 + j] + it.g * d;
    for (int64_t r = 0; r < rows; r += kRows) {
      int nr = static_cast<int>(std::min<int64_t>(kRows, rows - r));
      int64_t n = *std::max_element(valid.begin() + r, valid.begin() + r + nr);
      pv_all(nr, sbuf.data() + r * kKTile, vrow.data(), n, alpha + r, obuf.data() + r * d, d);
    }
  }
  for (int64_t j = 0; j < hg; ++j) {
    for (int64_t t = 0; t < tq; ++t) {
      const float* o = obuf.data() + (j * tq + t) * d;
      const float* lr = l + 16 * (j * tq + t);
      float inv = 1.f / std::accumulate(lr, lr + 16, 0.f);
      float* dst = s.out[t0 + t] + (it.g * hg + j) * d;
      for (int64_t x = 0; x < d; ++x) dst[x] = o[x] * inv;
    }
  }
}

void attend_all(const std::vector<Seq>& seqs, const Shape& sh) {
  PackedKeys pk = pack_keys(seqs, sh);
  std::vector<Item> items;
  for (int64_t i = 0; i < static_cast<int64_t>(seqs.size()); ++i) {
    int64_t t_len = static_cast<int64_t>(seqs[i].q.size());
    int64_t offset = static_cast<int64_t>(seqs[i].k.size()) - t_len;
    for (int64_t qt = 0; qt < n_tiles(t_len, kQTile); ++qt) {
      int64_t last = offset + std::min(t_len, (qt + 1) * kQTile) - 1;  // the tile's last position
      for (int64_t g = 0; g < sh.groups; ++g) items.push_back({i, g, qt, last / kKTile + 1});
    }
  }
  // Costliest first: the threads that claim items in order then finish together (the causal
  // triangle makes the last query tile the dearest).
  std::stable_sort(items.begin(), items.end(),
                   [](const Item& a, const Item& b) { return a.key_tiles > b.key_tiles; });
  splitphase_pool::parallel_chunks(static_cast<int64_t>(items.size()), 1, [&](int64_t b, int64_t e) {
    for (int64_t it = b; it < e; ++it) attend_item(seqs[items[it].seq], items[it], sh, pk);
  });
  splitphase_pool::park_after(kQTile + 1);  // an o_proj GEMM comes next
}

void check_rows(const at::Tensor& x, const char* name) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.device().is_cpu(), name, ": float32 on CPU");
  TORCH_CHECK(x.stride(-1) == 1 && x.stride(-2) == x.size(-1), name,
              ": each row's heads must be contiguous (stride(-2) == D, stride(-1) == 1)");
}

}  // namespace

namespace splitphase_ops {

// q (B, T, H, D), k/v (B, S, G, D), T <= S, queries at positions S-T..S-1 -> (B, T, H*D).
at::Tensor prefill_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, "q (B,T,H,D), k/v (B,S,G,D)");
  TORCH_CHECK(k.sizes() == v.sizes() && q.size(0) == k.size(0), "k/v shapes");
  TORCH_CHECK(q.size(2) % k.size(2) == 0 && q.size(3) == k.size(3), "GQA shapes");
  TORCH_CHECK(q.size(3) % 16 == 0, "head_dim must be a multiple of 16");
  TORCH_CHECK(q.size(1) <= k.size(1) && q.size(1) > 0, "1 <= T <= S");
  check_rows(q, "q"), check_rows(k, "k"), check_rows(v, "v");
  const int64_t b = q.size(0), t = q.size(1), s = k.size(1);
  const int64_t h = q.size(2), d = q.size(3);
  auto out = at::empty({b, t, h * d}, q.options());
  const float *qp = q.data_ptr<float>(), *kp = k.data_ptr<float>(), *vp = v.data_ptr<float>();
  float* op = out.data_ptr<float>();
  std::vector<Seq> seqs(static_cast<size_t>(b));
  for (int64_t i = 0; i < b; ++i) {
    Seq& sq = seqs[i];
    for (int64_t j = 0; j < t; ++j) {
      sq.q.push_back(qp + i * q.stride(0) + j * q.stride(1));
      sq.out.push_back(op + (i * t + j) * h * d);
    }
    for (int64_t j = 0; j < s; ++j) {
      sq.k.push_back(kp + i * k.stride(0) + j * k.stride(1));
      sq.v.push_back(vp + i * v.stride(0) + j * v.stride(1));
    }
  }
  attend_all(seqs, {h, k.size(2), d});
  return out;
}

// Rows q_rows of q (N, H, D) attend causally over the pool (P, G, D) at slots (S,) (their
// sequence's positions 0..S-1; the queries are the last T) and are written to those rows of
// out (N, H*D).
void prefill_attention_paged(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                             const at::Tensor& q_rows, const at::Tensor& slots, at::Tensor& out) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3, "q (N,H,D), k/v pools (P,G,D)");
  TORCH_CHECK(k.is_contiguous() && v.is_contiguous() && out.is_contiguous(), "contiguous pools");
  TORCH_CHECK(q.size(1) % k.size(1) == 0 && q.size(2) == k.size(2), "GQA shapes");
  TORCH_CHECK(q.size(2) % 16 == 0, "head_dim must be a multiple of 16");
  TORCH_CHECK(out.dim() == 2 && out.size(0) == q.size(0) && out.size(1) == q.size(1) * q.size(2),
              "out (N, H*D)");
  TORCH_CHECK(q_rows.scalar_type() == at::kLong && slots.scalar_type() == at::kLong, "int64");
  TORCH_CHECK(q_rows.numel() <= slots.numel() && q_rows.numel() > 0, "1 <= T <= S");
  check_rows(q, "q"), check_rows(k, "k"), check_rows(v, "v");
  TORCH_CHECK(out.scalar_type() == at::kFloat, "out: float32");
  auto rows = q_rows.contiguous();
  auto sl = slots.contiguous();
  const int64_t h = q.size(1), d = q.size(2), g = k.size(1);
  const int64_t *rp = rows.data_ptr<int64_t>(), *sp = sl.data_ptr<int64_t>();
  const float *qp = q.data_ptr<float>(), *kp = k.data_ptr<float>(), *vp = v.data_ptr<float>();
  float* op = out.data_ptr<float>();
  // Row and slot values are the caller's contract (the engine builds them from its block
  // tables once per step).
  std::vector<Seq> seqs(1);
  Seq& sq = seqs[0];
  for (int64_t j = 0; j < rows.numel(); ++j) {
    sq.q.push_back(qp + rp[j] * q.stride(0));
    sq.out.push_back(op + rp[j] * h * d);
  }
  for (int64_t j = 0; j < sl.numel(); ++j) {
    sq.k.push_back(kp + sp[j] * g * d);
    sq.v.push_back(vp + sp[j] * g * d);
  }
  attend_all(seqs, {h, g, d});
}

}  // namespace splitphase_ops

TORCH_LIBRARY_FRAGMENT(splitphase, m) {
  m.def("prefill_attention(Tensor q, Tensor k, Tensor v) -> Tensor");
  m.def("prefill_attention_paged(Tensor q, Tensor k, Tensor v, Tensor q_rows, Tensor slots, "
        "Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(splitphase, CPU, m) {
  m.impl("prefill_attention", &splitphase_ops::prefill_attention);
  m.impl("prefill_attention_paged", &splitphase_ops::prefill_attention_paged);
}
