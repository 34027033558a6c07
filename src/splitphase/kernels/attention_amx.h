// The prefill attention kernel's inner blocks on AMX tiles (Intel since Sapphire Rapids), for
// bf16 inputs: 16 query rows against one tile of 64 keys. Q K^T and P V are tile products
// (bf16 pairs, fp32 sums); the online softmax between them stays in AVX-512 on the fp32
// scores (attention_tiles.h's softmax_rows), and P is rounded to bf16 once for P V, as
// torch's flash kernel and FlashAttention do. K and V tiles are packed by the driver
// (prefill_attention.cpp) in the B-tile layouts below, once per call, like its other tiles.
//
// Tile registers: 0-3 hold four 16 x 16 fp32 results (64 keys of scores, or 64 output
// dimensions), 4 the A operand (16 rows of 32 bf16: queries, or P), 5-7 B operands.
#pragma once

#include "amx_tiles.h"
#include "attention_tiles.h"

#if defined(SPLITPHASE_AMX) && defined(SPLITPHASE_AVX512) && defined(SPLITPHASE_BF16_DOT)
#define SPLITPHASE_AMX_ATTENTION 1

#include <atomic>
#include <cstdint>

namespace splitphase_attn_amx {

using Bf16 = c10::BFloat16;
using splitphase_tiles::kKTile;
constexpr int kRows = 16;        // query rows a block: one tile's rows
constexpr int64_t kStep = 32;    // bf16 values in a tile row: the sum's step
constexpr int64_t kTile = 512;   // bf16 values in one B tile (16 rows of 32)

// The tiles take bf16 whose head_dim is a multiple of 32, where Linux permits them;
// `set_amx_attention` turns them off for A/B runs (the VDPBF16PS blocks then serve bf16).
inline std::atomic<bool>& enabled() {
  static std::atomic<bool> on{true};
  return on;
}

inline bool applies(int64_t d) {
  return enabled().load(std::memory_order_relaxed) && d % kStep == 0 &&
         splitphase_amx::permitted();
}

// A tile's 64 keys (d values each at keys[c], or zeros where null) into its Q K^T operand:
// D/32 steps of four B tiles (16 keys each), a tile's row r holding key n's dimensions 2r and
// 2r+1 as one 32-bit pair at column n.
inline void pack_keys(const Bf16* const* keys, int64_t d, Bf16* kp) {
  auto* dst = reinterpret_cast<uint32_t*>(kp);
  for (int64_t c = 0; c < kKTile; ++c) {
    uint32_t* col = dst + (c / 16) * 256 + c % 16;  // B tile (step 0, group c/16), column c%16
    const auto* src = reinterpret_cast<const uint32_t*>(keys[c]);
    for (int64_t i = 0; i < d / 2; ++i)  // pair i: step i/16, row i%16
      col[(i / 16) * 1024 + (i % 16) * 16] = src ? src[i] : 0u;
  }
}

// The tile's 64 values into the P V operand: two steps of 32 keys, each D/16 B tiles (16
// output dimensions each), a tile's row r holding keys 2r and 2r+1 of its step interleaved.
inline void pack_values(const Bf16* const* values, int64_t d, Bf16* vp) {
  const __m512i pairs = _mm512_set_epi16(
      47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8,
      39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
  const int64_t groups = d / 16;
  auto load = [](const Bf16* row, int64_t x) {
    return row ? _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + x)))
               : _mm512_setzero_si512();
  };
  for (int64_t c = 0; c < kKTile; c += 2) {
    Bf16* row = vp + ((c / kStep) * groups * 16 + (c % kStep) / 2) * 32;
    for (int64_t g = 0; g < groups; ++g) {
      const __m512i both = _mm512_permutex2var_epi16(load(values[c], 16 * g), pairs,
                                                     load(values[c + 1], 16 * g));
      _mm512_storeu_si512(row + g * kTile, both);
    }
  }
}

// Every tile 16 rows of 64 bytes; set per thread for each work item (oneDNN, between two
// calls, may have configured its own).
class Tiles {
 public:
  Tiles() {
    splitphase_amx::TileConfig cfg;
    for (int t = 0; t < 8; ++t) {
      cfg.rows[t] = kRows;
      cfg.colsb[t] = 64;
    }
    _tile_loadconfig(&cfg);
  }
  ~Tiles() { _tile_release(); }
  Tiles(const Tiles&) = delete;
  Tiles& operator=(const Tiles&) = delete;
};

// s (16 x 64 fp32) = q (16 rows of d bf16, contiguous) . K^T for the tile's 64 keys.
inline void scores(const Bf16* q, int64_t d, const Bf16* kp, float* s) {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t step = 0; step < d / kStep; ++step) {
    const Bf16* b = kp + step * 4 * kTile;
    _tile_loadd(4, q + step * kStep, d * 2);
    _tile_loadd(5, b, 64);
    _tile_loadd(6, b + kTile, 64);
    _tile_dpbf16ps(0, 4, 5);
    _tile_loadd(7, b + 2 * kTile, 64);
    _tile_dpbf16ps(1, 4, 6);
    _tile_loadd(5, b + 3 * kTile, 64);
    _tile_dpbf16ps(2, 4, 7);
    _tile_dpbf16ps(3, 4, 5);
  }
  _tile_stored(0, s, kKTile * 4);
  _tile_stored(1, s + 16, kKTile * 4);
  _tile_stored(2, s + 32, kKTile * 4);
  _tile_stored(3, s + 48, kKTile * 4);
}

// o[:, 16 g0 .. 16 (g0 + G)) (16 rows, row stride d) += p . V for G groups of 16 dimensions,
// the running output loaded into the result tiles and stored back.
template <int G>
inline void add_values_groups(const Bf16* p, const Bf16* vp, int64_t groups, int64_t g0,
                              float* o, int64_t d) {
  static_assert(G == 2 || G == 4, "D is a multiple of 32: groups come in pairs");
  _tile_loadd(0, o + 16 * g0, d * 4);
  _tile_loadd(1, o + 16 * (g0 + 1), d * 4);
  if constexpr (G == 4) {
    _tile_loadd(2, o + 16 * (g0 + 2), d * 4);
    _tile_loadd(3, o + 16 * (g0 + 3), d * 4);
  }
  for (int64_t step = 0; step < kKTile / kStep; ++step) {
    const Bf16* b = vp + (step * groups + g0) * kTile;
    _tile_loadd(4, p + step * kStep, kKTile * 2);
    _tile_loadd(5, b, 64);
    _tile_loadd(6, b + kTile, 64);
    _tile_dpbf16ps(0, 4, 5);
    _tile_dpbf16ps(1, 4, 6);
    if constexpr (G == 4) {
      _tile_loadd(7, b + 2 * kTile, 64);
      _tile_loadd(5, b + 3 * kTile, 64);
      _tile_dpbf16ps(2, 4, 7);
      _tile_dpbf16ps(3, 4, 5);
    }
  }
  _tile_stored(0, o + 16 * g0, d * 4);
  _tile_stored(1, o + 16 * (g0 + 1), d * 4);
  if constexpr (G == 4) {
    _tile_stored(2, o + 16 * (g0 + 2), d * 4);
    _tile_stored(3, o + 16 * (g0 + 3), d * 4);
  }
}

// o (16 x d fp32) = alpha * o + p (16 x 64 bf16) . the tile's V: rows whose shift moved are
// rescaled first (most tiles move none: softmax_rows' conditional rescaling), then the tiles
// add P V onto the running output.
inline void add_values(const Bf16* p, const Bf16* vp, const float* alpha, float* o, int64_t d) {
  for (int r = 0; r < kRows; ++r) {
    if (alpha[r] == 1.f) continue;
    const __m512 a = _mm512_set1_ps(alpha[r]);
    for (int64_t x = 0; x < d; x += 16)
      _mm512_storeu_ps(o + r * d + x, _mm512_mul_ps(_mm512_loadu_ps(o + r * d + x), a));
  }
  const int64_t groups = d / 16;
  int64_t g = 0;
  for (; g + 4 <= groups; g += 4) add_values_groups<4>(p, vp, groups, g, o, d);
  if (g < groups) add_values_groups<2>(p, vp, groups, g, o, d);
}

}  // namespace splitphase_attn_amx

#endif
