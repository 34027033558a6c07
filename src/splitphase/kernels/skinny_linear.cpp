// Skinny matrix products for the decode phase: y = x W^T for a few rows of x (batch-1 to
// batch-64 decode), with W in nn.Linear's (out, in) layout. Each weight row is streamed from
// memory once per call and dotted with every row of x while it sits in L1. Output rows are
// shared out in small chunks over all intra-op threads (pool.h), so every core pulls weight
// bytes.
// Several weights can share one call (fused QKV, SwiGLU's gate and up). Accumulation is fp32
// for fp32 and bf16 weights alike, as in torch's CPU linear. This file walks a call's rows and
// picks the tile; the tiles are in skinny_dot.h, skinny_outer_avx2.h and amx_tiles.h.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <functional>
#include <type_traits>

#include "amx_tiles.h"
#include "ops.h"
#include "pool.h"
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <vector>

#include "simd.h"
#if SPLITPHASE_AVX2
#include "skinny_outer_avx2.h"
#endif
#include "skinny_dot.h"

namespace {

constexpr int64_t kGrainRows = 16;
// Four chunks a thread, not the pool's 32: a chunk restarts four weight streams and costs a
// claim, which dominated the small projections (an O projection of 768x768 bf16 is 1.2 MB,
// about 20 us). A b1 decode step of base-125m (context 512), old and new interleaved, took
// 0.80-0.92x the time in bf16 and 0.91-1.0x in fp32 on the Zen 5 host (2 and 8 a thread: no
// better), 0.87-0.94x and 0.97-1.0x on the Intel host; batch 8 0.95-1.02x. The price: a
// helper that loses its core holds up an eighth of a call, not 1/64.
constexpr int64_t kChunksPerThread = 4;

#if SPLITPHASE_AVX2
// Calls of at least this many rows take the outer-product tile (skinny_outer_avx2.h; 0: none;
// skinny.OUTER_MIN_ROWS). It pads x to a multiple of 8 rows, so 9-15 rows to 16, which below
// 12 costs more than the tiles gain: base-125m's layer linears at 9-10 rows took 1.08-1.20x
// the dot tile's time, at 11-12 the same. At exactly 8 the narrow tile alone took 0.87-0.90x:
// not enough to split the row counts that share a result (skinny_outer_avx2.h) in two ranges.
std::atomic<int64_t>& outer_min_rows() {
  static std::atomic<int64_t> rows{12};
  return rows;
}
#endif

void check_inputs(const at::Tensor& x, at::TensorList ws) {
  TORCH_CHECK(x.dim() == 2 && x.size(0) <= kMaxRows, "x must be (rows <= 64, in_features)");
  TORCH_CHECK(!ws.empty(), "at least one weight");
  for (const auto& w : ws) {
    TORCH_CHECK(w.dim() == 2 && w.size(1) == x.size(1), "weight must be (out, in_features)");
    TORCH_CHECK(w.is_contiguous() && w.scalar_type() == x.scalar_type(), "contiguous, x's dtype");
    TORCH_CHECK(w.device().is_cpu(), "CPU tensors only");
  }
}

// y[lo..hi) = w[lo..hi) x for one x row. The rows are split into four equal runs read side
// by side (four streams in flight, x loaded once for all four), each run walking its rows in
// memory order: four long sequential streams, where four adjacent rows at a time made a new
// short stream every group (24 cache lines a bf16 row of 768), paying the prefetchers'
// ramp-up again each time. A row's sum does not depend on which path takes it.
template <typename T>
void rows1(const T* w, const T* x, int64_t k, int64_t lo, int64_t hi, T* y) {
  const int64_t run = (hi - lo) / 4;
  float acc[4];
  for (int64_t i = 0; i < run; ++i) {
#if SPLITPHASE_AVX512 && !defined(__AVX512BF16__)
    // bf16 widened as it loads: with the weight streams prefetched ahead, a b1 decode step of
    // base-125m took 0.83-0.90x the time (Intel Xeon VM without AVX512-BF16, 2 threads).
    if constexpr (std::is_same_v<T, c10::BFloat16>) {
      dot_4rows1<T, T, true>(w + (lo + i) * k, run * k, x, k, acc);
    } else {
      dot_4rows1(w + (lo + i) * k, run * k, x, k, acc);
    }
#else
    dot_4rows1(w + (lo + i) * k, run * k, x, k, acc);
#endif
    for (int r = 0; r < 4; ++r) y[lo + r * run + i] = static_cast<T>(acc[r]);
  }
  for (int64_t n = lo + 4 * run; n < hi; ++n) {
    dot_rows(w + n * k, x, k, 1, acc);
    y[n] = static_cast<T>(acc[0]);
  }
}

// y[b * width + n] for n in [lo, hi) and every x row b < nb: one weight row at a time, each
// dotted with all x rows while it sits in L1.
template <typename T>
void rows_each(const T* w, const T* x, int64_t k, int nb, int64_t lo, int64_t hi, int64_t width,
               T* y) {
  float acc[kMaxRows];
  for (int64_t n = lo; n < hi; ++n) {
    dot_rows(w + n * k, x, k, nb, acc);
    for (int b = 0; b < nb; ++b) y[b * width + n] = static_cast<T>(acc[b]);
  }
}

// The same for several x rows: 4 x nb tiles over four runs of rows read side by side (the
// stream layout of rows1), the rows the runs leave by rows_each; a row's sums are the same
// either way. Tile: dot_4rows_all's template argument (the weight type on AVX2, a Step on
// AVX-512); X: x's type there (fp32 on AVX2).
#if SPLITPHASE_SIMD
template <typename Tile, typename T, typename X>
int64_t rows_tiled(const T* w, const X* x, int64_t k, int nb, int64_t lo, int64_t hi,
                   int64_t width, T* y) {
  const int64_t run = (hi - lo) / 4;
  float acc[kMaxRows][4];
  for (int64_t i = 0; i < run; ++i) {
    dot_4rows_all<Tile>(w + (lo + i) * k, run * k, x, k, nb, acc);
    for (int b = 0; b < nb; ++b)
      for (int r = 0; r < 4; ++r) y[b * width + lo + r * run + i] = static_cast<T>(acc[b][r]);
  }
  return lo + 4 * run;  // the rows left for rows_each
}
#endif

// xf: x as fp32 (x itself where T is float), read by the AVX2 tile.
template <typename T>
void rows_n(const T* w, const T* x, const float* xf, int64_t k, int nb, int64_t lo, int64_t hi,
            int64_t width, T* y) {
#if SPLITPHASE_AVX2
  lo = rows_tiled<T>(w, xf, k, nb, lo, hi, width, y);
#else
  (void)xf;
#if defined(SPLITPHASE_FP32_TILE)
  if constexpr (std::is_same_v<T, float>) lo = rows_tiled<F32Step>(w, x, k, nb, lo, hi, width, y);
#endif
#if defined(SPLITPHASE_BF16_TILE)
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    lo = rows_tiled<Bf16Step>(w, x, k, nb, lo, hi, width, y);
  }
#endif
#endif
  rows_each(w, x, k, nb, lo, hi, width, y);
}

// x as fp32 for rows_n: x itself, or (AVX2, several bf16 rows) a widened copy in buf.
template <typename T>
const float* x_as_fp32(const T* x, int nb, int64_t k, std::vector<float>& buf) {
  if constexpr (std::is_same_v<T, float>) {
    return x;
  } else {
#if SPLITPHASE_AVX2
    if (nb > 1) {
      buf.resize(static_cast<size_t>(nb * k));
      for (int64_t i = 0; i < nb * k; ++i) buf[i] = static_cast<float>(x[i]);
      return buf.data();
    }
#else
    (void)nb, (void)k, (void)buf;
#endif
    return nullptr;
  }
}

// x is read in its own dtype (T), except by the AVX2 tile, which reads a widened fp32 copy
// of a bf16 x (x_as_fp32); widening is exact, so every path gives the same sums.
template <typename T>
void linear_impl(const T* x, int nb, int64_t k, at::TensorList ws, std::vector<at::Tensor>& ys,
                 int64_t team_rows) {
  std::vector<int64_t> start(ws.size() + 1, 0);
  std::vector<const T*> wp(ws.size());
  std::vector<T*> yp(ws.size());
  for (size_t j = 0; j < ws.size(); ++j) {
    start[j + 1] = start[j] + ws[j].size(0);
    wp[j] = ws[j].data_ptr<T>();
    yp[j] = ys[j].data_ptr<T>();
  }
#if SPLITPHASE_AMX
  // Four chunks a thread here too: one took the same time at 8 and 16 rows (0.96-1.04x).
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    if (splitphase_amx::linear(x, nb, k, start, wp, yp, team_rows, kChunksPerThread)) return;
  }
#endif
  // Kept between calls: a widened or transposed x is up to 64 x k floats (786 KB at k = 3072),
  // a malloc and page faults every linear of every step otherwise. Only this thread writes it;
  // the helpers read it inside parallel_chunks, which returns before the next call.
  thread_local std::vector<float> xbuf;
#if SPLITPHASE_AVX2
  const int64_t outer_from = outer_min_rows().load(std::memory_order_relaxed);
  const bool outer = outer_from > 0 && nb >= outer_from;
  if (outer) splitphase_outer::transpose_x(x, nb, k, xbuf);
  const float* xf = outer ? xbuf.data() : x_as_fp32(x, nb, k, xbuf);
#else
  constexpr bool outer = false;
  const float* xf = x_as_fp32(x, nb, k, xbuf);
#endif
  // One parallel range over the rows of all weights: each thread streams its share.
  splitphase_pool::parallel_chunks(start.back(), kGrainRows, team_rows, [&](int64_t begin, int64_t end) {
    for (size_t j = 0; j < ws.size(); ++j) {  // the part of the chunk in each weight
      const int64_t lo = std::max(begin, start[j]) - start[j];
      const int64_t hi = std::min(end, start[j + 1]) - start[j];
      if (lo >= hi) continue;
      if (outer) {
#if SPLITPHASE_AVX2
        splitphase_outer::rows(wp[j], xf, nb, k, lo, hi, ws[j].size(0), yp[j]);
#endif
      } else if (nb == 1) {
        rows1(wp[j], x, k, lo, hi, yp[j]);
      } else {
        rows_n(wp[j], x, xf, k, nb, lo, hi, ws[j].size(0), yp[j]);
      }
    }
  }, kChunksPerThread);
}

}  // namespace

namespace splitphase_ops {

// [x @ w.T for w in ws]: each output (rows, out_j) contiguous, one pass over every weight.
// pass_rows, when larger than x's rows, is the tokens of the forward pass x ends (the LM head
// on a prefill's last rows): it picks the thread team as those tokens would (pool.h).
std::vector<at::Tensor> skinny_linear(const at::Tensor& x, at::TensorList ws, int64_t pass_rows) {
  check_inputs(x, ws);
  const int64_t team_rows = std::max<int64_t>(pass_rows, x.size(0));
  std::vector<at::Tensor> ys;
  for (const auto& w : ws) ys.push_back(at::empty({x.size(0), w.size(0)}, x.options()));
  auto xc = x.contiguous();
  int nb = static_cast<int>(x.size(0));
  if (x.scalar_type() == at::kFloat) {
    linear_impl<float>(xc.data_ptr<float>(), nb, x.size(1), ws, ys, team_rows);
  } else if (x.scalar_type() == at::kBFloat16) {
    linear_impl<c10::BFloat16>(xc.data_ptr<c10::BFloat16>(), nb, x.size(1), ws, ys, team_rows);
  } else {
    TORCH_CHECK(false, "skinny_linear supports float32 and bfloat16");
  }
  return ys;
}

// Calls over at most `rows` rows run on the helper threads, larger ones on torch's OpenMP team.
static void set_helper_max_rows(int64_t rows) {
  splitphase_pool::helper_max_rows().store(rows, std::memory_order_relaxed);
}

// Calls of at least `rows` rows take the AVX2 outer-product tile (0: never); returns whether
// this build has it.
static bool set_outer_min_rows(int64_t rows) {
#if SPLITPHASE_AVX2
  outer_min_rows().store(rows, std::memory_order_relaxed);
  return true;
#else
  (void)rows;
  return false;
#endif
}

// bf16 calls of at least `rows` rows (up to 32) take AMX tiles where built and permitted
// (0: never); returns whether this build and process have them.
static bool set_amx_min_rows(int64_t rows) {
#if SPLITPHASE_AMX
  splitphase_amx::min_rows().store(rows, std::memory_order_relaxed);
  return splitphase_amx::permitted();
#else
  (void)rows;
  return false;
#endif
}

}  // namespace splitphase_ops

TORCH_LIBRARY(splitphase, m) {
  m.def("skinny_linear(Tensor x, Tensor[] ws, int pass_rows=0) -> Tensor[]");
  m.def("set_helper_max_rows(int rows) -> ()");
  m.def("set_amx_min_rows(int rows) -> bool");
  m.def("set_outer_min_rows(int rows) -> bool");
}

TORCH_LIBRARY_IMPL(splitphase, CPU, m) {
  m.impl("skinny_linear", &splitphase_ops::skinny_linear);
}

TORCH_LIBRARY_IMPL(splitphase, CatchAll, m) {
  m.impl("set_helper_max_rows", &splitphase_ops::set_helper_max_rows);
  m.impl("set_amx_min_rows", &splitphase_ops::set_amx_min_rows);
  m.impl("set_outer_min_rows", &splitphase_ops::set_outer_min_rows);
}
