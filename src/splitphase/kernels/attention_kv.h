// The prefill attention kernel's operands (prefill_attention.cpp): a call's sequences as row
// pointers, its K/V tiles packed once per call (transposed fp32, VDPBF16PS pairs, or AMX
// B tiles), its work items and their per-thread scratch.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <memory>
#include <type_traits>
#include <vector>

#include "attention_amx.h"
#include "attention_tiles.h"
#include "pool.h"

namespace splitphase_prefill {
using splitphase_tiles::kKTile;
using splitphase_tiles::kRows;

// Query positions per work item, for hg query heads per K/V head: about 96 rows (positions x
// heads) share each K/V tile, and a multiple of the 6-row register block where one exists
// (a 2-row remainder block runs its multiply-adds at a third of the rate).
inline int64_t q_tile(int64_t hg) {
  const int64_t most = std::max<int64_t>(1, std::min<int64_t>(64, 96 / hg));
  for (int64_t t = most; t >= 1; --t)
    if ((hg * t) % kRows == 0) return t;
  return most;
}

// One sequence's rows: T queries (the last T of its S positions) over S keys; T is float or
// at::BFloat16, KV the pool's type: T's own, or narrower (bf16 under fp32, fp8 under either:
// kv_cache_dtype), widened as the tiles are packed.
template <typename T, typename KV = T>
struct Seq {
  std::vector<const T*> q;    // (T,) each -> (H, D)
  std::vector<const KV*> k;   // (S,) each -> (G, D)
  std::vector<const KV*> v;   // (S,) each -> (G, D)
  std::vector<T*> out;        // (T,) each -> (H * D)
};

struct Shape {
  int64_t heads, groups, dim;
  int64_t per_group() const { return heads / groups; }
};

inline int64_t n_tiles(int64_t n, int64_t tile) { return (n + tile - 1) / tile; }

// Query rows (tokens) of the call, all sequences: what picks the thread team (pool.h).
template <typename T, typename KV>
int64_t query_rows(const std::vector<Seq<T, KV>>& seqs) {
  int64_t rows = 0;
  for (const auto& s : seqs) rows += static_cast<int64_t>(s.q.size());
  return rows;
}

// Every (sequence, KV head, key tile) as a K tile (D, 64), transposed so one query row's
// scores for 64 keys are four vectors of multiply-adds per dimension, then its V tile
// (64, D); zeros past the sequence's last key.
struct PackedKV {
  std::unique_ptr<float[]> data;  // not value-initialised: pack_tile writes every element
  std::vector<int64_t> seq_base;  // where sequence i's (G, tiles, 2, 64 * D) block starts
  std::vector<int64_t> seq_tiles;

  float* k_tile(int64_t seq, int64_t g, int64_t kt, int64_t d) {
    return data.get() + seq_base[seq] + (g * seq_tiles[seq] + kt) * 2 * kKTile * d;
  }
  float* v_tile(int64_t seq, int64_t g, int64_t kt, int64_t d) {
    return k_tile(seq, g, kt, d) + kKTile * d;
  }
  // bf16 keys for VDPBF16PS: the K tile's first half holds (D/2, 64, 2) bf16 pairs; for AMX
  // tiles, K's and V's halves hold them in B-tile layouts (attention_amx.h).
  c10::BFloat16* k_pairs(int64_t seq, int64_t g, int64_t kt, int64_t d) {
    return reinterpret_cast<c10::BFloat16*>(k_tile(seq, g, kt, d));
  }
  c10::BFloat16* v_pairs(int64_t seq, int64_t g, int64_t kt, int64_t d) {
    return reinterpret_cast<c10::BFloat16*>(v_tile(seq, g, kt, d));
  }
};

// bf16 on AMX tiles where the library has them and they apply to this head_dim (bf16 queries
// over a bf16 pool).
template <typename T, typename KV>
bool use_amx(int64_t d) {
#if defined(SPLITPHASE_AMX_ATTENTION)
  if constexpr (std::is_same_v<T, c10::BFloat16> && std::is_same_v<KV, T>) {
    return splitphase_attn_amx::applies(d);
  }
#endif
  (void)d;
  return false;
}

// bf16 queries and keys meet in VDPBF16PS where the CPU has it; everything else is widened.
template <typename T>
constexpr bool kPairs =
#if defined(SPLITPHASE_BF16_DOT)
    std::is_same_v<T, c10::BFloat16>;
#else
    false;
#endif

// dst[:d] = src[:d] as fp32 (exact; d a multiple of 16, checked by the callers).
template <typename KV>
void widen(const KV* src, float* dst, int64_t d) {
#if SPLITPHASE_SIMD
  for (int64_t x = 0; x < d; x += 16) splitphase_simd::store16(dst + x, splitphase_simd::load16(src + x));
#else
  for (int64_t x = 0; x < d; ++x) dst[x] = static_cast<float>(src[x]);
#endif
}

// Key c's D values (ks, or zeros where null) into its K tile: transposed fp32, or for
// VDPBF16PS (D/2, 64, 2) bf16 pairs (a pool narrower than bf16 widened to it, exactly).
template <typename T, typename KV>
void put_key(float* kdst, int64_t c, const KV* ks, int64_t d) {
  if constexpr (kPairs<T>) {
    auto* kp = reinterpret_cast<c10::BFloat16*>(kdst);
    for (int64_t x = 0; x < d; ++x) {
      kp[(x / 2) * 2 * kKTile + 2 * c + x % 2] = ks ? T(static_cast<float>(ks[x])) : T(0.f);
    }
  } else if constexpr (std::is_same_v<KV, float> || std::is_same_v<KV, c10::BFloat16>) {
    for (int64_t x = 0; x < d; ++x) kdst[x * kKTile + c] = ks ? static_cast<float>(ks[x]) : 0.f;
  } else {  // fp8: c10's scalar conversion is a chain of bit operations; the vector one is four
    thread_local std::vector<float> row;
    row.resize(static_cast<size_t>(d));
    if (ks) widen(ks, row.data(), d);
    for (int64_t x = 0; x < d; ++x) kdst[x * kKTile + c] = ks ? row[x] : 0.f;
  }
}

#if defined(SPLITPHASE_AMX_ATTENTION)
// One K/V tile in the AMX B-tile layouts (zeros past the sequence's last key).
inline void pack_tile_amx(const Seq<c10::BFloat16>& s, int64_t g, int64_t kt, int64_t d,
                          c10::BFloat16* kdst, c10::BFloat16* vdst) {
  const int64_t len = static_cast<int64_t>(s.k.size());
  std::array<const c10::BFloat16*, kKTile> keys{}, values{};
  for (int64_t c = 0; c < kKTile && kt * kKTile + c < len; ++c) {
    keys[c] = s.k[kt * kKTile + c] + g * d;
    values[c] = s.v[kt * kKTile + c] + g * d;
  }
  splitphase_attn_amx::pack_keys(keys.data(), d, kdst);
  splitphase_attn_amx::pack_values(values.data(), d, vdst);
}
#endif

template <typename T, typename KV>
void pack_tile(const Seq<T, KV>& s, int64_t g, int64_t kt, int64_t d, float* kdst, float* vdst) {
  const int64_t len = static_cast<int64_t>(s.k.size());
  for (int64_t c = 0; c < kKTile; ++c) {
    int64_t key = kt * kKTile + c;
    if (key >= len) {
      put_key<T, KV>(kdst, c, nullptr, d);
      std::fill(vdst + c * d, vdst + (c + 1) * d, 0.f);
      continue;
    }
    put_key<T, KV>(kdst, c, s.k[key] + g * d, d);
    widen(s.v[key] + g * d, vdst + c * d, d);
  }
}

template <typename T, typename KV>
PackedKV pack_kv(const std::vector<Seq<T, KV>>& seqs, const Shape& sh, bool amx) {
  PackedKV pk;
  int64_t total = 0;
  std::vector<std::array<int64_t, 3>> jobs;  // (seq, g, key tile)
  for (int64_t i = 0; i < static_cast<int64_t>(seqs.size()); ++i) {
    int64_t tiles = n_tiles(static_cast<int64_t>(seqs[i].k.size()), kKTile);
    pk.seq_base.push_back(total);
    pk.seq_tiles.push_back(tiles);
    total += sh.groups * tiles * 2 * kKTile * sh.dim;
    for (int64_t g = 0; g < sh.groups; ++g)
      for (int64_t kt = 0; kt < tiles; ++kt) jobs.push_back({i, g, kt});
  }
  pk.data.reset(new float[static_cast<size_t>(total)]);
  auto pack = [&](int64_t b, int64_t e) {
    for (int64_t j = b; j < e; ++j) {
      auto [i, g, kt] = jobs[j];
#if defined(SPLITPHASE_AMX_ATTENTION)
      if constexpr (std::is_same_v<T, c10::BFloat16> && std::is_same_v<KV, T>) {
        if (amx) {
          pack_tile_amx(seqs[i], g, kt, sh.dim, pk.k_pairs(i, g, kt, sh.dim),
                        pk.v_pairs(i, g, kt, sh.dim));
          continue;
        }
      }
#endif
      pack_tile(seqs[i], g, kt, sh.dim, pk.k_tile(i, g, kt, sh.dim), pk.v_tile(i, g, kt, sh.dim));
    }
  };
  splitphase_pool::parallel_chunks(static_cast<int64_t>(jobs.size()), 4, query_rows(seqs), pack);
  return pk;
}

// One work item: query tile qt of sequence `seq`, the query heads of KV head g.
struct Item {
  int64_t seq, g, qt, key_tiles;
};

// Per-thread buffers of one work item, rows ordered position-major (row t * H/G + j is head
// g * H/G + j at the tile's position t), so a query position's rows are adjacent in q and out.
struct Scratch {
  std::vector<float> q, o, s, stats;
  std::vector<c10::BFloat16> q_pairs;  // bf16 queries as they are (VDPBF16PS, AMX tiles)
  std::vector<int64_t> valid, pos;
};

}  // namespace splitphase_prefill
