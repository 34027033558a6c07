// Decode-shaped bf16 linears on AMX tiles (Intel since Sapphire Rapids), for the skinny kernel.
//
// y = x @ w.T for a few rows of x computed as its transpose, w @ x.T: the A tile is 16 weight
// rows of 32 values, loaded in place from the row-major weight (no packed copy); the B tile is
// x.T in pairs of k (VNNI), packed once a call; the C tile holds 16 weight rows by up to 16 x
// rows in fp32 (up to 32 x rows: two B tiles, each A tile multiplied by both). Each output's
// sum runs over k in the tile unit's fixed order, whatever the batch size, so a row's result
// does not depend on the rows beside it (within this path). VDPBF16PS reads each weight row
// once per four x rows; a tile product covers 16.
#pragma once

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define SPLITPHASE_AMX 1

#include <c10/util/BFloat16.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <vector>

#include "pool.h"

namespace splitphase_amx {

constexpr int kTileRows = 16;   // weight rows a tile (and at most x rows: C's columns)
constexpr int64_t kTileK = 32;  // bf16 values of k a tile row holds (64 bytes)

// Batches from this many rows take the tiles (skinny.AMX_MIN_ROWS sets it; 0: never). Below
// it VDPBF16PS is faster: the tile loads read 32 weight rows side by side, which the memory
// serves slower than VDPBF16PS's four streams, and a few x rows leave the tiles mostly idle.
inline std::atomic<int64_t>& min_rows() {
  static std::atomic<int64_t> rows{7};
  return rows;
}

// Linux hands out the tile state only on request, once per process.
inline bool permitted() {
  constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  static const bool ok = syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  return ok;
}

constexpr int kMaxXRows = 2 * kTileRows;  // x rows a call takes: two B tiles side by side

inline bool applies(int nb, int64_t k) {
  int64_t from = min_rows().load(std::memory_order_relaxed);
  return from > 0 && nb >= from && nb <= kMaxXRows && k % kTileK == 0 && permitted();
}

// xp[((kb * 16) + r) * nb + m] = the pair x[m][kb*32 + 2r], x[m][kb*32 + 2r + 1].
inline void pack_x(const c10::BFloat16* x, int nb, int64_t k, c10::BFloat16* xp) {
  for (int64_t kb = 0; kb < k / kTileK; ++kb)
    for (int r = 0; r < kTileRows; ++r)
      for (int m = 0; m < nb; ++m) {
        const c10::BFloat16* src = x + m * k + kb * kTileK + 2 * r;
        c10::BFloat16* dst = xp + ((kb * kTileRows + r) * nb + m) * 2;
        dst[0] = src[0];
        dst[1] = src[1];
      }
}

// The x rows split over B tiles: the first 16 (group 0), then the rest (group 1), packed into
// xp (nb * k values) one group after the other.
struct XGroups {
  int rows[2];
  const c10::BFloat16* packed[2];
  XGroups(const c10::BFloat16* x, int nb, int64_t k, c10::BFloat16* xp)
      : rows{std::min(nb, kTileRows), std::max(nb - kTileRows, 0)},
        packed{xp, xp + rows[0] * k} {
    pack_x(x, rows[0], k, xp);
    if (rows[1]) pack_x(x + rows[0] * k, rows[1], k, xp + rows[0] * k);
  }
};

struct alignas(64) TileConfig {
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tiles 0-1: C of x group 0 for two blocks of 16 weight rows; 2-3: the same for group 1;
// 4-5: the blocks' A; 6-7: each group's B (x.T). Unused tiles stay unconfigured.
class Tiles {
 public:
  explicit Tiles(const XGroups& g) {
    TileConfig cfg;
    for (int gi = 0; gi < 2 && g.rows[gi]; ++gi)
      for (int t : {2 * gi, 2 * gi + 1, 6 + gi}) {
        cfg.rows[t] = kTileRows;
        cfg.colsb[t] = static_cast<uint16_t>(g.rows[gi] * 4);
      }
    cfg.rows[4] = cfg.rows[5] = kTileRows;
    cfg.colsb[4] = cfg.colsb[5] = 64;
    _tile_loadconfig(&cfg);  // per thread, per call: oneDNN may have configured others since
  }
  ~Tiles() { _tile_release(); }
  Tiles(const Tiles&) = delete;
  Tiles& operator=(const Tiles&) = delete;
};

// C (16 weight rows by nb x rows) into y's columns n0.. of x rows m0..
inline void store_rows(const float (&c)[kTileRows][kTileRows], int nb, int m0, int64_t n0,
                       int64_t width, c10::BFloat16* y) {
  for (int r = 0; r < kTileRows; ++r)
    for (int m = 0; m < nb; ++m)
      y[(m0 + m) * width + n0 + r] = static_cast<c10::BFloat16>(c[r][m]);
}

// Weight rows [lo, hi) of w (rows of k values; whole blocks of 32) against the packed x
// groups: two blocks of 16 weight rows share each B tile, each A tile serves both groups.
template <int G>
void blocks(const c10::BFloat16* w, const XGroups& g, int64_t k, int64_t lo, int64_t hi,
            int64_t width, c10::BFloat16* y) {
  const int64_t stride = k * 2;  // bytes between weight rows
  const int64_t bs0 = g.rows[0] * 4, bs1 = g.rows[1] * 4;
  alignas(64) float c[4][kTileRows][kTileRows];
  for (; lo + 2 * kTileRows <= hi; lo += 2 * kTileRows) {
    const char* a = reinterpret_cast<const char*>(w + lo * k);
    const char* b0 = reinterpret_cast<const char*>(g.packed[0]);
    const char* b1 = reinterpret_cast<const char*>(g.packed[1]);
    _tile_zero(0);
    _tile_zero(1);
    if constexpr (G == 2) {
      _tile_zero(2);
      _tile_zero(3);
    }
    for (int64_t kb = 0; kb < k / kTileK; ++kb, a += 64, b0 += kTileRows * bs0, b1 += kTileRows * bs1) {
      _tile_loadd(6, b0, bs0);
      if constexpr (G == 2) _tile_loadd(7, b1, bs1);
      _tile_loadd(4, a, stride);
      _tile_dpbf16ps(0, 4, 6);
      if constexpr (G == 2) _tile_dpbf16ps(2, 4, 7);
      _tile_loadd(5, a + kTileRows * stride, stride);
      _tile_dpbf16ps(1, 5, 6);
      if constexpr (G == 2) _tile_dpbf16ps(3, 5, 7);
    }
    _tile_stored(0, c[0], 64);
    _tile_stored(1, c[1], 64);
    store_rows(c[0], g.rows[0], 0, lo, width, y);
    store_rows(c[1], g.rows[0], 0, lo + kTileRows, width, y);
    if constexpr (G == 2) {
      _tile_stored(2, c[2], 64);
      _tile_stored(3, c[3], 64);
      store_rows(c[2], g.rows[1], kTileRows, lo, width, y);
      store_rows(c[3], g.rows[1], kTileRows, lo + kTileRows, width, y);
    }
  }
}

inline void rows(const c10::BFloat16* w, const XGroups& g, int64_t k, int64_t lo, int64_t hi,
                 int64_t width, c10::BFloat16* y) {
  Tiles tiles(g);
  if (g.rows[1]) {
    blocks<2>(w, g, k, lo, hi, width, y);
  } else {
    blocks<1>(w, g, k, lo, hi, width, y);
  }
}

// [x @ w.T for each w] into y, in blocks of 32 weight rows over all the weights, `per_thread`
// chunks a thread; false (nothing written) where the tiles do not apply, or a weight's rows
// are not whole blocks: then no row's path depends on where the chunks fall.
inline bool linear(const c10::BFloat16* x, int nb, int64_t k, const std::vector<int64_t>& start,
                   const std::vector<const c10::BFloat16*>& w, const std::vector<c10::BFloat16*>& y,
                   int64_t team_rows, int64_t per_thread) {
  constexpr int64_t kBlock = 2 * kTileRows;
  if (!applies(nb, k)) return false;
  for (size_t j = 0; j + 1 < start.size(); ++j)
    if ((start[j + 1] - start[j]) % kBlock) return false;
  std::vector<c10::BFloat16> xp(nb * k);
  const XGroups g(x, nb, k, xp.data());
  splitphase_pool::parallel_chunks(start.back() / kBlock, 1, team_rows, [&](int64_t begin, int64_t end) {
    for (size_t j = 0; j + 1 < start.size(); ++j) {
      int64_t lo = std::max(begin * kBlock, start[j]), hi = std::min(end * kBlock, start[j + 1]);
      if (lo < hi) rows(w[j], g, k, lo - start[j], hi - start[j], start[j + 1] - start[j], y[j]);
    }
  }, per_thread);
  return true;
}

}  // namespace splitphase_amx

#endif
