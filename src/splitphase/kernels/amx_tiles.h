// Decode-shaped bf16 linears on AMX tiles (Intel since Sapphire Rapids), for the skinny kernel.
//
// y = x @ w.T for a few rows of x computed as its transpose, w @ x.T: the A tile is 16 weight
// rows of 32 values, loaded in place from the row-major weight (no packed copy); the B tile is
// x.T in pairs of k (VNNI), packed once a call; the C tile holds 16 weight rows by the batch's
// rows in fp32. Each output's sum runs over k in the tile unit's fixed order, whatever the
// batch size, so a row's result does not depend on the rows beside it (within this path).
// VDPBF16PS reads each weight row once per four x rows; a tile product covers all 16.
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

inline bool applies(int nb, int64_t k) {
  int64_t from = min_rows().load(std::memory_order_relaxed);
  return from > 0 && nb >= from && nb <= kTileRows && k % kTileK == 0 && permitted();
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

struct alignas(64) TileConfig {
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tiles 0-1: C for two blocks of 16 weight rows; 2-3: their A; 4: B (x.T).
class Tiles {
 public:
  explicit Tiles(int nb) {
    TileConfig cfg;
    for (int t = 0; t < 5; ++t) cfg.rows[t] = kTileRows;
    cfg.colsb[0] = cfg.colsb[1] = cfg.colsb[4] = static_cast<uint16_t>(nb * 4);
    cfg.colsb[2] = cfg.colsb[3] = 64;
    _tile_loadconfig(&cfg);  // per thread, per call: oneDNN may have configured others since
  }
  ~Tiles() { _tile_release(); }
  Tiles(const Tiles&) = delete;
  Tiles& operator=(const Tiles&) = delete;
};

inline void store_rows(const float (&c)[kTileRows][kTileRows], int nb, int64_t n0, int64_t width,
                       c10::BFloat16* y) {
  for (int r = 0; r < kTileRows; ++r)
    for (int m = 0; m < nb; ++m) y[m * width + n0 + r] = static_cast<c10::BFloat16>(c[r][m]);
}

// Weight rows [lo, hi) of w (rows of k values; whole blocks of 32) against packed x: two
// blocks of 16 rows share each B tile.
inline void rows(const c10::BFloat16* w, const c10::BFloat16* xp, int64_t k, int nb,
                 int64_t lo, int64_t hi, int64_t width, c10::BFloat16* y) {
  const int64_t stride = k * 2;  // bytes between weight rows
  const int64_t b_stride = nb * 4;
  alignas(64) float c[2][kTileRows][kTileRows];
  Tiles tiles(nb);
  for (; lo + 2 * kTileRows <= hi; lo += 2 * kTileRows) {
    const char* a = reinterpret_cast<const char*>(w + lo * k);
    const char* b = reinterpret_cast<const char*>(xp);
    _tile_zero(0);
    _tile_zero(1);
    for (int64_t kb = 0; kb < k / kTileK; ++kb, a += 64, b += kTileRows * b_stride) {
      _tile_loadd(4, b, b_stride);
      _tile_loadd(2, a, stride);
      _tile_dpbf16ps(0, 2, 4);
      _tile_loadd(3, a + kTileRows * stride, stride);
      _tile_dpbf16ps(1, 3, 4);
    }
    _tile_stored(0, c[0], 64);
    _tile_stored(1, c[1], 64);
    store_rows(c[0], nb, lo, width, y);
    store_rows(c[1], nb, lo + kTileRows, width, y);
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
  pack_x(x, nb, k, xp.data());
  splitphase_pool::parallel_chunks(start.back() / kBlock, 1, team_rows, [&](int64_t begin, int64_t end) {
    for (size_t j = 0; j + 1 < start.size(); ++j) {
      int64_t lo = std::max(begin * kBlock, start[j]), hi = std::min(end * kBlock, start[j + 1]);
      if (lo < hi) rows(w[j], xp.data(), k, nb, lo - start[j], hi - start[j], start[j + 1] - start[j], y[j]);
    }
  }, per_thread);
  return true;
}

}  // namespace splitphase_amx

#endif
