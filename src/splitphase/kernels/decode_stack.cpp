// A whole decode pass through the decoder layers in one call: per layer fused QKV -> RoPE ->
// K/V write into the pool -> paged decode attention -> O proj, residual + RMSNorm -> gate/up
// -> SiLU * up -> down, residual + the next layer's (or the final) RMSNorm. Each step is the
// function the per-op path calls (ops.h; above the skinny kernel's row limit oneDNN's packed
// GEMM on the per-op path's own packed copies, or torch's linear) in the same order on the
// same shapes, so the result is bit-identical to the per-op path;
// what goes away is the Python and dispatcher work between the ~15 ops of each layer.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <optional>
#include <tuple>
#include <vector>

#include "ops.h"
#include "pool.h"

namespace {

constexpr int64_t kWeightsPerLayer = 9;  // in_norm, q, k, v, o, post_norm, gate, up, down
constexpr int64_t kPackedPerLayer = 5;   // oneDNN-packed: q|k|v stacked, o, gate, up, down

// x @ w.T on oneDNN's packed copy of w, the op packed_linear.py calls.
at::Tensor onednn_linear(const at::Tensor& x, const at::Tensor& packed) {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("mkldnn::_linear_pointwise", "")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                            c10::string_view, c10::List<std::optional<at::Scalar>>,
                            std::optional<c10::string_view>)>();
  return op.call(x, packed, std::nullopt, "none", c10::List<std::optional<at::Scalar>>(), "");
}

// x @ w.T for each w: the skinny kernel up to `max_rows` rows (as skinny.linears decides in
// Python), past them oneDNN's packed copies where given (as the per-op path then runs), else
// torch's linear.
std::vector<at::Tensor> linears(const at::Tensor& x, at::TensorList ws, int64_t max_rows,
                                at::TensorList packed = {}) {
  if (x.size(0) <= max_rows) return splitphase_ops::skinny_linear(x, ws);
  splitphase_pool::park_helpers();  // oneDNN/MKL's OpenMP team needs both cores
  std::vector<at::Tensor> ys;
  for (size_t i = 0; i < ws.size(); ++i) {
    ys.push_back(packed.empty() ? at::linear(x, ws[i]) : onednn_linear(x, packed[i]));
  }
  return ys;
}

// Q, K, V (B, H*D), (B, G*D) x2: one packed GEMM on the stacked copy, sliced as the per-op
// path slices it, or one skinny call (or torch's linear) over the three weights.
std::vector<at::Tensor> qkv_linear(const at::Tensor& h, at::TensorList w, int64_t max_rows,
                                   at::TensorList packed) {
  if (packed.empty() || h.size(0) <= max_rows) return linears(h, {w[1], w[2], w[3]}, max_rows);
  splitphase_pool::park_helpers();
  at::Tensor y = onednn_linear(h, packed[0]);
  const int64_t nq = w[1].size(0), nk = w[2].size(0);
  return {y.narrow(1, 0, nq), y.narrow(1, nq, nk), y.narrow(1, nq + nk, w[3].size(0))};
}

struct Step {
  const at::Tensor& write_slots;  // (B,) pool slot of each row's new K/V
  const at::Tensor& slots;        // (B, S) context slots, the new one included
  const at::Tensor& lengths;      // (B,)
  at::Tensor cos;                 // (B or 1, 1, D)
  at::Tensor sin;
  double eps;
  int64_t max_rows, heads, kv_heads, head_dim;
};

// rows into the pool at slots, in the pool's dtype, which may be narrower than the model's (to()
// is a no-op if equal). CPU index_copy_ has no fp8 kernel: one-byte pools take the rows as bytes.
void write_rows(at::Tensor& pool, const at::Tensor& slots, const at::Tensor& rows) {
  auto narrow = rows.to(pool.dtype());
  if (pool.element_size() == 1) {
    pool.view(at::kByte).index_copy_(0, slots, narrow.view(at::kByte));
  } else {
    pool.index_copy_(0, slots, narrow);
  }
}

// One decoder layer on x (B, d_model) with h = its input norm of x; writes this layer's K/V
// into k_pool/v_pool (N, G, D). Returns (the layer's output, next_norm of it): the residual
// adds ride in the norm that follows them (add_rms_norm), as the per-op path does.
std::tuple<at::Tensor, at::Tensor> layer(const at::Tensor& x, const at::Tensor& h,
                                         at::TensorList w, at::TensorList p,
                                         const at::Tensor& next_norm, at::Tensor k_pool,
                                         at::Tensor v_pool, const Step& s) {
  const int64_t b = x.size(0);
  auto qkv = qkv_linear(h, w, s.max_rows, p);  // (B, H*D), (B, G*D) x2
  auto q = splitphase_ops::rope(qkv[0].view({b, 1, s.heads, s.head_dim}), s.cos, s.sin);
  auto k = splitphase_ops::rope(qkv[1].view({b, 1, s.kv_heads, s.head_dim}), s.cos, s.sin);
  write_rows(k_pool, s.write_slots, k.view({b, s.kv_heads, s.head_dim}));
  write_rows(v_pool, s.write_slots, qkv[2].view({b, s.kv_heads, s.head_dim}));
  auto a = splitphase_ops::decode_attention(q.view({b, s.heads, s.head_dim}), k_pool, v_pool,
                                            s.slots, s.lengths);  // (B, H, D)
  auto slice = [&p](int64_t i, int64_t n) { return p.empty() ? p : p.slice(i, n); };
  auto o = linears(a.view({b, s.heads * s.head_dim}), {w[4]}, s.max_rows, slice(1, 1))[0];
  auto [x2, h2] = splitphase_ops::add_rms_norm_(x, o, w[5], s.eps);  // x + o written over o
  auto gu = linears(h2, {w[6], w[7]}, s.max_rows, slice(2, 2));  // (B, d_ff) x2
  auto m = splitphase_ops::silu_mul_(gu[0], gu[1]);  // (B, d_ff), over the gate's output
  auto d = linears(m, {w[8]}, s.max_rows, slice(4, 1))[0];
  return splitphase_ops::add_rms_norm_(x2, d, next_norm, s.eps);
}

// x (B, d_model) through every layer; weights 9 per layer; k/v caches (L, N, G, D);
// cos/sin (B or 1, D). Returns the final norm of the last layer's output (B, d_model).
at::Tensor decode_layers(const at::Tensor& x, at::TensorList weights,
                         const at::Tensor& final_norm, const at::Tensor& k_cache,
                         const at::Tensor& v_cache, const at::Tensor& write_slots,
                         const at::Tensor& slots, const at::Tensor& lengths,
                         const at::Tensor& cos, const at::Tensor& sin, double eps,
                         int64_t max_rows, int64_t heads, at::TensorList packed) {
  const int64_t n_layers = k_cache.size(0);
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x (B, d_model) contiguous");
  TORCH_CHECK(n_layers > 0 && static_cast<int64_t>(weights.size()) == kWeightsPerLayer * n_layers,
              "9 weights per layer");
  TORCH_CHECK(packed.empty() || static_cast<int64_t>(packed.size()) == kPackedPerLayer * n_layers,
              "none or 5 packed weights per layer");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  v_cache.sizes() == k_cache.sizes(),
              "k/v caches (L, N, G, D) contiguous");
  TORCH_CHECK(write_slots.dim() == 1 && write_slots.size(0) == x.size(0), "write_slots (B,)");
  TORCH_CHECK(cos.dim() == 2 && cos.sizes() == sin.sizes() && cos.size(1) == k_cache.size(3) &&
                  (cos.size(0) == 1 || cos.size(0) == x.size(0)),
              "cos/sin (B or 1, head_dim)");
  Step s{write_slots, slots, lengths, cos.unsqueeze(1).contiguous(),
         sin.unsqueeze(1).contiguous(), eps, max_rows, heads, k_cache.size(2), k_cache.size(3)};
  at::Tensor out = x;
  at::Tensor h = splitphase_ops::rms_norm(x, weights[0], eps);
  for (int64_t l = 0; l < n_layers; ++l) {
    const at::Tensor& next =
        l + 1 < n_layers ? weights[(l + 1) * kWeightsPerLayer] : final_norm;
    at::TensorList p = packed.empty() ? packed : packed.slice(l * kPackedPerLayer, kPackedPerLayer);
    std::tie(out, h) = layer(out, h, weights.slice(l * kWeightsPerLayer, kWeightsPerLayer), p,
                             next, k_cache.select(0, l), v_cache.select(0, l), s);
  }
  return h;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(splitphase, m) {
  m.def(
      "decode_layers(Tensor x, Tensor[] weights, Tensor final_norm, Tensor(a!) k_cache, "
      "Tensor(b!) v_cache, "
      "Tensor write_slots, Tensor slots, Tensor lengths, Tensor cos, Tensor sin, float eps, "
      "int max_rows, int heads, Tensor[] packed) -> Tensor");
}

TORCH_LIBRARY_IMPL(splitphase, CPU, m) { m.impl("decode_layers", &decode_layers); }

// oneDNN's packed copies are MkldnnCPU tensors, which decide the dispatch when they are passed.
TORCH_LIBRARY_IMPL(splitphase, MkldnnCPU, m) { m.impl("decode_layers", &decode_layers); }
