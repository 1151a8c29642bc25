// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include <array>
#include <cmath>
#include <concepts>
#include <string>

#include "epmoe/core/config.hpp"
#include "epmoe/core/macros.hpp"
#include "epmoe/core/numeric.hpp"
#include "epmoe/core/view.hpp"
#include "epmoe/expert/activation.hpp"

namespace epmoe::expert {

/// silu(a) * b, one element: the gated activation between the SwiGLU GEMMs.
EPMOE_HD float silu_mul(float a, float b) { return a / (1.f + expf(-a)) * b; }

/// Gated expert FFN: y = W2 (act(W1 x) * W3 x). SwiGLU with act::silu (Mixtral, DeepSeek,
/// Qwen, OLMoE, DBRX, Jamba, Granite, PhiMoE), GeGLU with act::gelu or act::gelu_tanh.
/// Each local expert's rows run as one GEMM block per projection.
template <class Act>
struct glu {
  /// This rank's L local experts, stacked; PyTorch [out, in] layout, element type T (fp32
  /// on the host; fp32, bf16 or fp16 in device memory on space::cuda<T>).
  template <class T>
  struct weights_of {
    stacked_view<const T> w1;  // [L, F, H] gate projection
    stacked_view<const T> w3;  // [L, F, H] up projection
    stacked_view<const T> w2;  // [L, H, F] down projection
  };
  using weights = weights_of<float>;

  /// Checks `count` stacked experts of width hidden -> ffn -> hidden; `name` prefixes the
  /// field in errors ("weights.experts", "weights.shared").
  template <class T>
  static void validate(const weights_of<T>& w, index_t count, index_t hidden, index_t ffn,
                       const std::string& name) {
    detail::require_shape(w.w1, count, ffn, hidden, (name + ".w1").c_str());
    detail::require_shape(w.w3, count, ffn, hidden, (name + ".w3").c_str());
    detail::require_shape(w.w2, count, hidden, ffn, (name + ".w2").c_str());
  }
  static void validate(const layer_config& cfg, const weights& w) {
    validate(w, cfg.experts_per_rank(), cfg.hidden, cfg.ffn, "weights.experts");
  }

  /// Three GEMMs of [rows, H] x [H, F] (or back): 2 FLOPs per multiply-add.
  static double flops_per_row(index_t hidden, index_t ffn) {
    return 6.0 * static_cast<double>(hidden) * static_cast<double>(ffn);
  }
  static double flops_per_row(const layer_config& cfg) {
    return flops_per_row(cfg.hidden, cfg.ffn);
  }

  /// Scratch elements per row: the two [rows, F] projections (the layer passes F padded to
  /// its row alignment).
  static index_t scratch_per_row(index_t ffn) { return 2 * ffn; }
  static index_t scratch_per_row(const layer_config& cfg) { return scratch_per_row(cfg.ffn); }

  /// The stacked tensors of a weight bundle, for what moves or checks every tensor alike
  /// (live re-placement moves each slot's matrices).
  template <class T>
  static std::array<stacked_view<const T>*, 3> tensors(weights_of<T>& w) {
    return {&w.w1, &w.w3, &w.w2};
  }
  /// Experts [first, first + n) of a bundle (a shared expert, one local expert).
  template <class T>
  static weights_of<T> slice(const weights_of<T>& w, index_t first, index_t n) {
    return {w.w1.slice(first, n), w.w3.slice(first, n), w.w2.slice(first, n)};
  }

  template <class T>
  struct act_mul_rows {
    T* h1;
    const T* h3;
    EPMOE_HD void operator()(index_t i) const {
      h1[i] = from_float<T>(Act::apply(to_float(h1[i])) * to_float(h3[i]));
    }
  };

  /// Runs every local expert g on its rows of x (group g; the groups' GEMMs go to the
  /// space's grouped GEMM); the output [rows, H] overwrites x (its input is no longer needed
  /// once both up-projections are done). scratch holds x.rows() * scratch_per_row elements.
  /// `keep` (training without recompute): x.rows() * keep_per_row(F) elements that receive
  /// the two up-projections for backward.
  template <class Space, class T>
  static void forward(const Space& space, const weights_of<T>& w, grouped_rows<T> x, T* scratch,
                      T* keep = nullptr) {
    const index_t F = w.w1.rows, n = x.elements(F);  // the [rows, F] hidden layers
    if (n == 0) return;
    const grouped_rows<T> h1 = x.over(scratch, F), h3 = x.over(scratch + n, F);
    space.grouped_gemm_nt(x, w.w1, h1);
    space.grouped_gemm_nt(x, w.w3, h3);
    if (keep) space.for_each(2 * n, copy_elements<T>{scratch, keep});
    // The gate over whole padded rows (padding elements are never read).
    if constexpr (std::same_as<Act, act::silu> && requires { space.silu_mul(h1.data, h3.data, n); })
      space.silu_mul(h1.data, h3.data, n);  // the space's vectorised loop (space::host)
    else
      space.for_each(n, act_mul_rows<T>{h1.data, h3.data});
    space.grouped_gemm_nt(h1, w.w2, x);
  }

  // --- backward (docs/training.md) -------------------------------------------------------

  /// The gradients of the L local experts' weights, shaped like weights_of (G: float, or the
  /// space's element type).
  template <class G>
  struct grads_of {
    stacked_view<G> w1;  // [L, F, H]
    stacked_view<G> w3;  // [L, F, H]
    stacked_view<G> w2;  // [L, H, F]
  };
  using grads = grads_of<float>;
  template <class G>
  static grads_of<G> slice(const grads_of<G>& g, index_t first, index_t n) {
    return {g.w1.slice(first, n), g.w3.slice(first, n), g.w2.slice(first, n)};
  }
  template <class G>
  static std::array<stacked_view<G>*, 3> tensors(grads_of<G>& g) {
    return {&g.w1, &g.w3, &g.w2};
  }
  /// Checks a gradient bundle as validate() checks weights ("grads.experts.w1: ...").
  template <class G>
  static void validate(const grads_of<G>& g, index_t count, index_t hidden, index_t ffn,
                       const std::string& name) {
    validate(weights_of<G>{g.w1, g.w3, g.w2}, count, hidden, ffn, name);
  }

  /// Scratch elements per row of backward: the two recomputed projections and dh.
  static index_t backward_scratch_per_row(index_t ffn) { return 3 * ffn; }
  /// FLOPs per row of backward: dh, three dW and two dX GEMMs, and with `recompute` the two
  /// up-projections again (8 GEMMs of the forward's 3, else 6).
  static double backward_flops_per_row(index_t hidden, index_t ffn, bool recompute) {
    return (recompute ? 16.0 : 12.0) * static_cast<double>(hidden) * static_cast<double>(ffn);
  }
  /// Elements per row a training forward keeps (without recompute): a = x W1ᵀ, b = x W3ᵀ.
  static index_t keep_per_row(index_t ffn) { return 2 * ffn; }

  /// Element i of the [rows, F] hidden layers: from a = x W1ᵀ, b = x W3ᵀ and dh = dy W2,
  /// writes da = dh b act'(a) over a, db = dh act(a) over b, and h = act(a) b over dh.
  template <class T>
  struct act_mul_grad_rows {
    T *a, *b, *dh;
    EPMOE_HD void operator()(index_t i) const {
      const float av = to_float(a[i]), bv = to_float(b[i]), g = to_float(dh[i]);
      const float s = Act::apply(av);
      a[i] = from_float<T>(g * bv * Act::grad(av));
      b[i] = from_float<T>(g * s);
      dh[i] = from_float<T>(s * bv);
    }
  };

  /// The backward of forward() for the rows of every local expert g (group g), recomputing
  /// the hidden layers from the saved inputs x: dx = dL/dx (may be x or dy: they are read
  /// before dx is written) and dL/dW of every tensor into `grads` (overwritten, or added to
  /// with `accumulate`: several calls over parts of the rows). dy is dL/d(the expert's
  /// output). scratch holds x.rows() * backward_scratch_per_row(F) elements (F padded as for
  /// forward).
  template <class Space, class T, class G>
  static void backward(const Space& space, const weights_of<T>& w, grouped_rows<const T> x,
                       grouped_rows<const T> dy, grouped_rows<T> dx, const grads_of<G>& grads,
                       T* scratch, bool accumulate = false, const T* kept = nullptr) {
    const index_t F = w.w1.rows, n = x.elements(F);
    const grouped_rows<T> a = x.over(scratch, F), b = x.over(scratch + n, F),
                          dh = x.over(scratch + 2 * n, F);
    if (n > 0) {
      if (kept) {  // the forward's a and b (the functor below overwrites them)
        space.for_each(2 * n, copy_elements<T>{kept, scratch});
      } else {
        space.grouped_gemm_nt(x, w.w1, a);
        space.grouped_gemm_nt(x, w.w3, b);
      }
      space.grouped_gemm_nn(dy, w.w2, dh);  // dh = dy W2: [rows, H] x [H, F]
      space.for_each(n, act_mul_grad_rows<T>{a.data, b.data, dh.data});
    }
    // dW2 = dyᵀ h, dW1 = daᵀ x, dW3 = dbᵀ x (zeros for a group without rows); none for
    // frozen experts (empty gradient views).
    if (grads.w1.data) {
      space.grouped_gemm_tn_accumulate(dy, grouped_rows<const T>(dh), grads.w2, accumulate);
      space.grouped_gemm_tn_accumulate(grouped_rows<const T>(a), x, grads.w1, accumulate);
      space.grouped_gemm_tn_accumulate(grouped_rows<const T>(b), x, grads.w3, accumulate);
    }
    if (n == 0) return;
    // dx = da W1 + db W3: [rows, F] x [F, H].
    space.grouped_gemm_nn(a, w.w1, dx);
    space.grouped_gemm_nn(b, w.w3, dx, true);
  }

  /// Local expert j alone on rows x [n, H] (tests, calibration): the grouped forward of one
  /// group.
  template <class Space, class T>
  static void forward(const Space& space, const weights_of<T>& w, index_t j, matrix_view<T> x,
                      T* scratch) {
    const index_t offsets[2] = {0, x.rows};
    forward(space, slice(w, j, 1), grouped_rows<T>{x.data, x.cols, x.stride, 1, offsets, offsets},
            scratch);
  }
};

/// SwiGLU (Shazeer 2020), the default expert.
using swiglu = glu<act::silu>;
/// GeGLU with exact GELU (Shazeer 2020); glu<act::gelu_tanh> for the tanh form.
using geglu = glu<act::gelu>;

}  // namespace epmoe::expert
