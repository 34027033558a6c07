// Causal GQA prefill attention, computed in fp32, flash-style (Dao et al. 2022): queries in tiles of
// up to 64 positions against keys in tiles of 64 with an online softmax (running max and sum per
// row), so the (T, S) score matrix never exists. Key tiles above the diagonal are skipped, and
// in the tiles the diagonal crosses each block of rows computes only the keys it can see.
// The H/G query heads that share a K/V head are rows of one work item, so each K/V tile is
// read once per group. Work items are (sequence, KV head, query tile), dearest first.
//
// Rows are reached through pointers (a query position's H*D values, a key's G*D values), so
// one driver serves a strided batch (the contiguous KV cache) and a paged pool read through
// slots with the chunk's query rows gathered from a flattened batch. K and V are first
// packed into contiguous tiles (K transposed): strided rows 1-5 KB apart would fall into a
// few L1 sets and evict each other. bf16 inputs are widened to fp32 where they are copied
// anyway (K/V into the tiles, a work item's queries into its scratch) and the output rounded
// back once, so bf16 costs a conversion per element read, not a second kernel. A paged pool
// narrower than the queries (kv_cache_dtype: bf16 under fp32, fp8 under either) is widened
// the same way, in place: converting each chunk's context into a pool of q's dtype first cost
// a prefix-cache hit (8 prompts' last 16 tokens over 2000 cached, base-125m fp32) 1.6x the
// fp32 pool's time with an fp8 pool and 1.06x with bf16; in place, 0.91-1.01x. Where the CPU
// has AVX512-BF16, bf16 queries and keys stay bf16 and Q K^T takes VDPBF16PS, two dimensions
// a multiply (bench/prefill_budget.py --dtype bfloat16, base-125m on the AMD host: attention
// 0.78-0.87x the time at 512 tokens, 0.81-0.82x at 2048). Where it has AMX tiles and D is a
// multiple of 32, bf16 blocks of 16 rows take Q K^T and P V on the tiles (attention_amx.h;
// bench/prefill_ab.py --dtype bfloat16 on the Intel host, three runs: with torch's SDPA
// instead, the prefill takes 1.05-1.12x the time at 512 tokens, 1.09-1.13x at 2048, level at
// 128). Operands: attention_kv.h.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <type_traits>
#include <vector>

#include "attention_kv.h"
#include "ops.h"
#include "pool.h"

namespace {
using namespace splitphase_prefill;  // this file is its one user

// A work item's rows: its query positions t0..t0+tq-1, hg heads a position, position-major.
struct ItemRows {
  int64_t s_len, offset, d, hg, t0, tq, rows;
  float c;  // the softmax in log2 units: 2^(c s) = e^(s / sqrt(D))

  template <typename T, typename KV>
  ItemRows(const Seq<T, KV>& s, const Item& it, const Shape& sh)
      : s_len(static_cast<int64_t>(s.k.size())),
        offset(s_len - static_cast<int64_t>(s.q.size())),
        d(sh.dim),
        hg(sh.per_group()),
        t0(it.qt * q_tile(hg)),
        tq(std::min(q_tile(hg), static_cast<int64_t>(s.q.size()) - t0)),
        rows(hg * tq),
        c(1.4426950408889634f / std::sqrt(static_cast<float>(d))) {}
};

// The item's queries into qs (the group's heads of one position are adjacent), each row's
// position into pos (once an item, not per tile: a division).
template <typename T, typename KV, typename Q>
void load_rows(const Seq<T, KV>& s, const Item& it, const ItemRows& ir, Q* qs, int64_t* pos) {
  for (int64_t t = 0; t < ir.tq; ++t) {
    const T* src = s.q[ir.t0 + t] + it.g * ir.hg * ir.d;
    std::copy(src, src + ir.hg * ir.d, qs + t * ir.hg * ir.d);
  }
  for (int64_t r = 0; r < ir.rows; ++r) pos[r] = ir.offset + ir.t0 + r / ir.hg;
}

// How many keys of the tile at k0 each of a block's nr rows sees (those at positions <= its
// own), and the most any of them sees.
inline int64_t see(const int64_t* pos, int nr, int64_t k0, int64_t n_keys, int64_t* valid) {
  int64_t n = 0;
  for (int i = 0; i < nr; ++i) {
    valid[i] = std::clamp<int64_t>(pos[i] - k0 + 1, 0, n_keys);
    n = std::max(n, valid[i]);
  }
  return n;
}

// The item's rows of o over their softmax sums (16 lanes a row in l) into the output, as T.
template <typename T, typename KV>
void store_rows(const Seq<T, KV>& s, const Item& it, const ItemRows& ir, const float* o,
                const float* l) {
  for (int64_t t = 0; t < ir.tq; ++t) {
    T* dst = s.out[ir.t0 + t] + it.g * ir.hg * ir.d;
    for (int64_t j = 0; j < ir.hg; ++j) {
      const int64_t r = t * ir.hg + j;
      const float inv = 1.f / std::accumulate(l + 16 * r, l + 16 * r + 16, 0.f);
      for (int64_t x = 0; x < ir.d; ++x) dst[j * ir.d + x] = static_cast<T>(o[r * ir.d + x] * inv);
    }
  }
}

template <typename T, typename KV>
void attend_item(const Seq<T, KV>& s, const Item& it, const Shape& sh, PackedKV& pk) {
  const ItemRows ir(s, it, sh);
  const int64_t d = ir.d, rows = ir.rows;
  thread_local Scratch w;
  auto& qs = [&]() -> auto& {
    if constexpr (kPairs<T>) return w.q_pairs; else return w.q;
  }();
  qs.resize(static_cast<size_t>(rows * d));
  w.o.assign(static_cast<size_t>(rows * d), 0.f);
  w.s.resize(static_cast<size_t>(kRows * kKTile));
  w.stats.assign(static_cast<size_t>(18 * rows + 16), 0.f);  // max, rescale, 16-lane sums
  w.valid.resize(static_cast<size_t>(rows));
  w.pos.resize(static_cast<size_t>(rows));
  float *m = w.stats.data(), *alpha = m + rows + 16, *l = alpha + rows;
  // A finite floor, not -inf: the first rescale 2^(floor - m) is then exactly 0, not NaN.
  std::fill(m, m + rows, -1e30f);
  load_rows(s, it, ir, qs.data(), w.pos.data());
  for (int64_t kt = 0; kt < it.key_tiles; ++kt) {
    const int64_t k0 = kt * kKTile, n_keys = std::min(kKTile, ir.s_len - k0);
    const auto* ktile = [&] {
      if constexpr (kPairs<T>) return pk.k_pairs(it.seq, it.g, kt, d);
      else return pk.k_tile(it.seq, it.g, kt, d);
    }();
    const float* vtile = pk.v_tile(it.seq, it.g, kt, d);
    for (int64_t r = 0; r < rows; r += kRows) {
      const int nr = static_cast<int>(std::min<int64_t>(kRows, rows - r));
      // The last row of a block sees most: keys past it are not multiplied.
      const int64_t n = see(w.pos.data() + r, nr, k0, n_keys, w.valid.data() + r);
      if (n == 0) continue;  // the block sees none of this tile: its state stays as it is
      splitphase_tiles::qk(nr, static_cast<int>(n_tiles(n, 16)), qs.data() + r * d, d, ktile,
                           d, w.s.data());
      splitphase_tiles::softmax_rows<5>(w.s.data(), w.s.data(), nr, w.valid.data() + r, ir.c,
                                        m + r, alpha + r, l + 16 * r);
      splitphase_tiles::pv(nr, w.s.data(), vtile, n, alpha + r, w.o.data() + r * d, d);
    }
  }
  store_rows(s, it, ir, w.o.data(), l);
}

#if defined(SPLITPHASE_AMX_ATTENTION)
// attend_item on AMX tiles: the item's rows in blocks of 16 (the last padded with zero
// queries that see no key), each block's scores, softmax step and P V per key tile.
void attend_item_amx(const Seq<c10::BFloat16>& s, const Item& it, const Shape& sh, PackedKV& pk) {
  namespace amx = splitphase_attn_amx;
  const ItemRows ir(s, it, sh);
  const int64_t d = ir.d, rows = ir.rows, padded = n_tiles(rows, amx::kRows) * amx::kRows;
  constexpr int64_t kBlock = amx::kRows * kKTile;  // one block's scores
  thread_local Scratch w;
  thread_local std::vector<c10::BFloat16> p;  // a block's P, rounded for P V
  thread_local std::vector<int64_t> live;     // the blocks that see a key tile
  w.q_pairs.assign(static_cast<size_t>(padded * d), c10::BFloat16(0.f));
  w.o.assign(static_cast<size_t>(padded * d), 0.f);  // whole blocks: the tiles load and store them
  w.s.resize(static_cast<size_t>(2 * kBlock));
  w.stats.assign(static_cast<size_t>(18 * padded + 16), 0.f);
  w.valid.assign(static_cast<size_t>(padded), 0);  // padding rows see no key
  w.pos.resize(static_cast<size_t>(rows));
  p.resize(static_cast<size_t>(kBlock));
  float *m = w.stats.data(), *alpha = m + padded + 16, *l = alpha + padded;
  std::fill(m, m + padded, -1e30f);
  load_rows(s, it, ir, w.q_pairs.data(), w.pos.data());
  const auto scores = [&](int64_t r, const c10::BFloat16* kp, float* out) {
    amx::scores(w.q_pairs.data() + r * d, d, kp, out);
  };
  amx::Tiles tiles;
  for (int64_t kt = 0; kt < it.key_tiles; ++kt) {
    const int64_t k0 = kt * kKTile, n_keys = std::min(kKTile, ir.s_len - k0);
    live.clear();
    for (int64_t r = 0; r < padded; r += amx::kRows) {
      const int nr = static_cast<int>(std::min<int64_t>(amx::kRows, rows - r));
      if (see(w.pos.data() + r, nr, k0, n_keys, w.valid.data() + r) > 0) live.push_back(r);
    }
    if (live.empty()) continue;
    const c10::BFloat16 *kp = pk.k_pairs(it.seq, it.g, kt, d), *vp = pk.v_pairs(it.seq, it.g, kt, d);
    scores(live[0], kp, w.s.data());
    for (size_t i = 0; i < live.size(); ++i) {
      const int64_t r = live[i];
      // The next block's Q K^T is issued before this block's softmax, which the vector units
      // run while the tiles compute it: tile registers are not renamed, so in the other order
      // each block's tile work would wait for the last block's softmax and P V.
      if (i + 1 < live.size()) scores(live[i + 1], kp, w.s.data() + ((i + 1) % 2) * kBlock);
      // P is rounded to bf16 (2^-9): the exp2 fit to 7.5e-5 serves (attention_tiles.h).
      splitphase_tiles::softmax_rows<3>(w.s.data() + (i % 2) * kBlock, p.data(), amx::kRows,
                                        w.valid.data() + r, ir.c, m + r, alpha + r, l + 16 * r);
      amx::add_values(p.data(), vp, alpha + r, w.o.data() + r * d, d);
    }
  }
  store_rows(s, it, ir, w.o.data(), l);
}
#endif

template <typename T, typename KV>
void attend_one(const Seq<T, KV>& s, const Item& it, const Shape& sh, PackedKV& pk, bool amx) {
#if defined(SPLITPHASE_AMX_ATTENTION)
  if constexpr (std::is_same_v<T, c10::BFloat16> && std::is_same_v<KV, T>) {
    if (amx) return attend_item_amx(s, it, sh, pk);
  }
#endif
  (void)amx;
  attend_item(s, it, sh, pk);
}

template <typename T, typename KV>
void attend_all(const std::vector<Seq<T, KV>>& seqs, const Shape& sh) {
  const bool amx = use_amx<T, KV>(sh.dim);
  PackedKV pk = pack_kv(seqs, sh, amx);
  std::vector<Item> items;
  for (int64_t i = 0; i < static_cast<int64_t>(seqs.size()); ++i) {
    int64_t t_len = static_cast<int64_t>(seqs[i].q.size());
    int64_t offset = static_cast<int64_t>(seqs[i].k.size()) - t_len;
    const int64_t tile = q_tile(sh.per_group());
    for (int64_t qt = 0; qt < n_tiles(t_len, tile); ++qt) {
      int64_t last = offset + std::min(t_len, (qt + 1) * tile) - 1;  // the tile's last position
      for (int64_t g = 0; g < sh.groups; ++g) items.push_back({i, g, qt, last / kKTile + 1});
    }
  }
  // Costliest first: the threads that claim items in order then finish together (the causal
  // triangle makes the last query tile the dearest).
  std::stable_sort(items.begin(), items.end(),
                   [](const Item& a, const Item& b) { return a.key_tiles > b.key_tiles; });
  const int64_t rows = query_rows(seqs);
  splitphase_pool::parallel_chunks(static_cast<int64_t>(items.size()), 1, rows, [&](int64_t b, int64_t e) {
    for (int64_t it = b; it < e; ++it) attend_one(seqs[items[it].seq], items[it], sh, pk, amx);
  });
  splitphase_pool::park_helpers();  // an o_proj GEMM comes next
}

void check_rows(const at::Tensor& x, const char* name, at::ScalarType dtype) {
  TORCH_CHECK(x.scalar_type() == dtype && x.device().is_cpu(), name, ": ", dtype, " on CPU");
  TORCH_CHECK(x.stride(-1) == 1 && x.stride(-2) == x.size(-1), name,
              ": each row's heads must be contiguous (stride(-2) == D, stride(-1) == 1)");
}

}  // namespace

namespace {

void check_dtype(const at::Tensor& q) {
  TORCH_CHECK(q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16,
              "q: float32 or bfloat16");
}

template <typename T>
at::Tensor prefill_attention_t(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  const int64_t b = q.size(0), t = q.size(1), s = k.size(1);
  const int64_t h = q.size(2), d = q.size(3);
  auto out = at::empty({b, t, h * d}, q.options());
  const T *qp = q.data_ptr<T>(), *kp = k.data_ptr<T>(), *vp = v.data_ptr<T>();
  T* op = out.data_ptr<T>();
  std::vector<Seq<T>> seqs(static_cast<size_t>(b));
  for (int64_t i = 0; i < b; ++i) {
    Seq<T>& sq = seqs[i];
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

template <typename T, typename KV>
void prefill_attention_paged_t(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                               const int64_t* rp, const int64_t* qsp, const int64_t* sp,
                               const int64_t* ksp, int64_t n_chunks, at::Tensor& out) {
  const int64_t h = q.size(1), d = q.size(2), g = k.size(1);
  const T* qp = q.data_ptr<T>();
  const KV *kp = k.data_ptr<KV>(), *vp = v.data_ptr<KV>();
  T* op = out.data_ptr<T>();
  std::vector<Seq<T, KV>> seqs(static_cast<size_t>(n_chunks));
  for (int64_t i = 0; i < n_chunks; ++i) {
    const int64_t t = qsp[i + 1] - qsp[i], s = ksp[i + 1] - ksp[i];
    TORCH_CHECK(t >= 1 && t <= s, "chunk ", i, ": 1 <= queries <= keys, got ", t, " and ", s);
    Seq<T, KV>& sq = seqs[i];
    for (int64_t j = qsp[i]; j < qsp[i + 1]; ++j) {
      sq.q.push_back(qp + rp[j] * q.stride(0));
      sq.out.push_back(op + rp[j] * h * d);
    }
    for (int64_t j = ksp[i]; j < ksp[i + 1]; ++j) {
      sq.k.push_back(kp + sp[j] * g * d);
      sq.v.push_back(vp + sp[j] * g * d);
    }
  }
  if (n_chunks > 0) attend_all(seqs, {h, g, d});
}

// The paged kernel over q's pool type: q's own, or a narrower one (kv_cache_dtype): bf16 under
// fp32 queries, fp8 under either.
template <typename T>
void paged_over_pool(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                     const int64_t* rp, const int64_t* qsp, const int64_t* sp, const int64_t* ksp,
                     int64_t n_chunks, at::Tensor& out) {
  const auto kv = k.scalar_type();
  if (kv == q.scalar_type()) {
    return prefill_attention_paged_t<T, T>(q, k, v, rp, qsp, sp, ksp, n_chunks, out);
  }
  if (kv == at::kFloat8_e4m3fn) {
    return prefill_attention_paged_t<T, c10::Float8_e4m3fn>(q, k, v, rp, qsp, sp, ksp, n_chunks,
                                                             out);
  }
  if (kv == at::kFloat8_e5m2) {
    return prefill_attention_paged_t<T, c10::Float8_e5m2>(q, k, v, rp, qsp, sp, ksp, n_chunks,
                                                           out);
  }
  if constexpr (std::is_same_v<T, float>) {
    if (kv == at::kBFloat16) {
      return prefill_attention_paged_t<float, c10::BFloat16>(q, k, v, rp, qsp, sp, ksp, n_chunks,
                                                              out);
    }
  }
  TORCH_CHECK(false, "k/v pools: q's dtype, bf16 under fp32 queries, or fp8");
}

}  // namespace

namespace splitphase_ops {

// q (B, T, H, D), k/v (B, S, G, D), T <= S, queries at positions S-T..S-1 -> (B, T, H*D);
// float32 or bfloat16 (all three the same), the output in q's dtype.
at::Tensor prefill_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, "q (B,T,H,D), k/v (B,S,G,D)");
  TORCH_CHECK(k.sizes() == v.sizes() && q.size(0) == k.size(0), "k/v shapes");
  TORCH_CHECK(q.size(2) % k.size(2) == 0 && q.size(3) == k.size(3), "GQA shapes");
  TORCH_CHECK(q.size(3) % 16 == 0, "head_dim must be a multiple of 16");
  TORCH_CHECK(q.size(1) <= k.size(1) && q.size(1) > 0, "1 <= T <= S");
  check_dtype(q);
  const auto dt = q.scalar_type();
  check_rows(q, "q", dt), check_rows(k, "k", dt), check_rows(v, "v", dt);
  return dt == at::kFloat ? prefill_attention_t<float>(q, k, v)
                          : prefill_attention_t<at::BFloat16>(q, k, v);
}

// Prefill chunks packed into one flattened batch (varlen): chunk i's queries are rows
// q_rows[q_starts[i]:q_starts[i+1]] of q (N, H, D), the last of its positions, whose K/V sit
// in the pools (P, G, D) at slots[k_starts[i]:k_starts[i+1]] (positions 0..S_i-1); each
// attends causally and is written to the same rows of out (N, H*D). One parallel region for
// all chunks of a step.
void prefill_attention_paged(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                             const at::Tensor& q_rows, const at::Tensor& q_starts,
                             const at::Tensor& slots, const at::Tensor& k_starts,
                             at::Tensor& out) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3, "q (N,H,D), k/v pools (P,G,D)");
  TORCH_CHECK(k.is_contiguous() && v.is_contiguous() && out.is_contiguous(), "contiguous pools");
  TORCH_CHECK(q.size(1) % k.size(1) == 0 && q.size(2) == k.size(2), "GQA shapes");
  TORCH_CHECK(q.size(2) % 16 == 0, "head_dim must be a multiple of 16");
  TORCH_CHECK(out.dim() == 2 && out.size(0) == q.size(0) && out.size(1) == q.size(1) * q.size(2),
              "out (N, H*D)");
  for (const at::Tensor* t : {&q_rows, &q_starts, &slots, &k_starts})
    TORCH_CHECK(t->scalar_type() == at::kLong && t->dim() == 1, "index tensors: 1-d int64");
  TORCH_CHECK(q_starts.numel() == k_starts.numel() && q_starts.numel() >= 1, "starts (C+1,)");
  check_dtype(q);
  const auto dt = q.scalar_type();
  check_rows(q, "q", dt), check_rows(k, "k", k.scalar_type()), check_rows(v, "v", k.scalar_type());
  TORCH_CHECK(out.scalar_type() == dt, "out: q's dtype");
  auto rows = q_rows.contiguous(), qs = q_starts.contiguous();
  auto sl = slots.contiguous(), ks = k_starts.contiguous();
  const int64_t *rp = rows.data_ptr<int64_t>(), *sp = sl.data_ptr<int64_t>();
  const int64_t *qsp = qs.data_ptr<int64_t>(), *ksp = ks.data_ptr<int64_t>();
  const int64_t n_chunks = qs.numel() - 1;
  TORCH_CHECK(qsp[n_chunks] <= rows.numel() && ksp[n_chunks] <= sl.numel(), "starts in range");
  // Row and slot values are the caller's contract (the engine builds them from its block
  // tables once per step); the chunk boundaries are checked here.
  if (dt == at::kFloat)
    paged_over_pool<float>(q, k, v, rp, qsp, sp, ksp, n_chunks, out);
  else
    paged_over_pool<at::BFloat16>(q, k, v, rp, qsp, sp, ksp, n_chunks, out);
}

// bf16 prefill attention on AMX tiles (on) or VDPBF16PS (off); true when the tiles then take
// bf16 here (built for them, and Linux permits them), for head_dims that are multiples of 32.
bool set_amx_attention(bool on) {
#if defined(SPLITPHASE_AMX_ATTENTION)
  splitphase_attn_amx::enabled().store(on, std::memory_order_relaxed);
  return on && splitphase_amx::permitted();
#else
  (void)on;
  return false;
#endif
}

// Whether the tiles are vector code (AVX-512 or AVX2) in this build, not scalar loops.
bool prefill_attention_vectorized() {
#if SPLITPHASE_VECTOR_TILES
  return true;
#else
  return false;
#endif
}

}  // namespace splitphase_ops

TORCH_LIBRARY_FRAGMENT(splitphase, m) {
  m.def("set_amx_attention(bool on) -> bool");
  m.def("prefill_attention_vectorized() -> bool");
  m.def("prefill_attention(Tensor q, Tensor k, Tensor v) -> Tensor");
  m.def("prefill_attention_paged(Tensor q, Tensor k, Tensor v, Tensor q_rows, Tensor q_starts, "
        "Tensor slots, Tensor k_starts, Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(splitphase, CPU, m) {
  m.impl("prefill_attention", &splitphase_ops::prefill_attention);
  m.impl("prefill_attention_paged", &splitphase_ops::prefill_attention_paged);
}

TORCH_LIBRARY_IMPL(splitphase, CatchAll, m) {
  m.impl("set_amx_attention", &splitphase_ops::set_amx_attention);
  m.impl("prefill_attention_vectorized", &splitphase_ops::prefill_attention_vectorized);
}
