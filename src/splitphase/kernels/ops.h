// The native ops as C++ functions, so a fused caller (decode_stack.cpp) runs exactly the same
// arithmetic as the per-op path without going back through the dispatcher or Python.
#pragma once
#include <ATen/ATen.h>

#include <tuple>
#include <vector>

namespace splitphase_ops {

// [x @ w.T for w in ws] for x (rows <= 64, K); each weight (N_j, K) in x's dtype; pass_rows:
// the tokens of the pass x ends, when more than its rows (they pick the thread team).
std::vector<at::Tensor> skinny_linear(const at::Tensor& x, at::TensorList ws,
                                      int64_t pass_rows = 0);

// q (B, H, D) over k/v pools (N, G, D) at slots (B, S), first lengths[b] real -> (B, H, D).
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const at::Tensor& slots, const at::Tensor& lengths);

// Causal q (B, T, H, D) over k/v (B, S, G, D), queries the last T positions -> (B, T, H*D).
at::Tensor prefill_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v);

// Varlen chunks: rows q_rows[q_starts[i]:q_starts[i+1]] of q (N, H, D), causal over pools
// (P, G, D) at slots[k_starts[i]:k_starts[i+1]], into the same rows of out (N, H*D).
void prefill_attention_paged(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                             const at::Tensor& q_rows, const at::Tensor& q_starts,
                             const at::Tensor& slots, const at::Tensor& k_starts,
                             at::Tensor& out);

// w * (x * rsqrt(mean(x^2) + eps)) over the last dim.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps);

// (x + r, rms_norm(x + r)) in one pass.
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& r,
                                                const at::Tensor& w, double eps);

// The same with x + r written over r.
std::tuple<at::Tensor, at::Tensor> add_rms_norm_(const at::Tensor& x, at::Tensor& r,
                                                 const at::Tensor& w, double eps);

// x (B, T, H, D) rotated by cos/sin (B or 1, T, D).
at::Tensor rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);

// silu(g) * u elementwise, each element independent of its position.
at::Tensor silu_mul(const at::Tensor& g, const at::Tensor& u);

// The same written over g.
at::Tensor& silu_mul_(at::Tensor& g, const at::Tensor& u);

}  // namespace splitphase_ops
