// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include <array>
#include <string>

#include "epmoe/core/config.hpp"
#include "epmoe/core/macros.hpp"
#include "epmoe/core/numeric.hpp"
#include "epmoe/core/view.hpp"
#include "epmoe/expert/activation.hpp"
#include "epmoe/expert/mlp.hpp"

namespace epmoe::expert {

/// GPT-OSS's gate (`GptOssExperts._apply_gate`, swiglu_alpha 1.702, swiglu_limit 7): the
/// +1 on the clamped up projection, biases on the gate, up and down projections.
struct gpt_oss_clamp {
  static constexpr float alpha = 1.702f, limit = 7.f, up_shift = 1.f;
  static constexpr bool biases = true;
};
/// DeepSeek-V4's clamped SwiGLU (swiglu_limit 10): silu (alpha 1), no +1, no biases.
struct deepseek_v4_clamp {
  static constexpr float alpha = 1.f, limit = 10.f, up_shift = 0.f;
  static constexpr bool biases = false;
};

/// The clamped gated activation of one element, from a = gate, b = up (biases included):
/// g = min(a, limit), u = clamp(b, -limit, limit), h = g σ(alpha g) (u + up_shift).
template <class Form>
struct clamped_gate {
  EPMOE_HD static float sigmoid(float v) { return 1.f / (1.f + expf(-v)); }
  EPMOE_HD static float gate(float a) { return a < Form::limit ? a : Form::limit; }
  EPMOE_HD static float up(float b) {
    return b < -Form::limit ? -Form::limit : (b > Form::limit ? Form::limit : b);
  }
  EPMOE_HD static float apply(float a, float b) {
    const float g = gate(a);
    return g * sigmoid(Form::alpha * g) * (up(b) + Form::up_shift);
  }
  /// da and db from dh (h's gradient). A clamp passes the gradient where its input is inside
  /// the bounds, bounds included (torch.clamp), else 0.
  EPMOE_HD static void grad(float a, float b, float dh, float& da, float& db) {
    const float g = gate(a), s = sigmoid(Form::alpha * g);
    da = a <= Form::limit ? dh * (up(b) + Form::up_shift) * s * (1.f + Form::alpha * g * (1.f - s))
                          : 0.f;
    db = b >= -Form::limit && b <= Form::limit ? dh * g * s : 0.f;
  }
};

/// Gated expert FFN with a clamped activation and biases (GPT-OSS; DeepSeek-V4 without the
/// biases): a = W1 x + b1, b = W3 x + b3, y = W2 clamped_gate(a, b) + b2. Form gives alpha,
/// limit, up_shift and biases (gpt_oss_clamp, deepseek_v4_clamp, or a user's own).
template <class Form>
struct clamped_glu {
  static constexpr bool biases = Form::biases;
  using form = Form;

  /// This rank's L local experts, stacked; PyTorch [out, in] layout, element type T. GPT-OSS
  /// interleaves gate and up in one [E, H, 2F]: de-interleave and transpose it to W1, W3.
  template <class T>
  struct weights_of {
    stacked_view<const T> w1;    // [L, F, H] gate projection
    stacked_view<const T> w3;    // [L, F, H] up projection
    stacked_view<const T> w2;    // [L, H, F] down projection
    stacked_view<const T> b1{};  // [L, 1, F] gate bias (biases)
    stacked_view<const T> b3{};  // [L, 1, F] up bias (biases)
    stacked_view<const T> b2{};  // [L, 1, H] down bias (biases)
  };
  using weights = weights_of<float>;

  template <class T>
  static void validate(const weights_of<T>& w, index_t count, index_t hidden, index_t ffn,
                       const std::string& name) {
    detail::require_shape(w.w1, count, ffn, hidden, (name + ".w1").c_str());
    detail::require_shape(w.w3, count, ffn, hidden, (name + ".w3").c_str());
    detail::require_shape(w.w2, count, hidden, ffn, (name + ".w2").c_str());
    if constexpr (biases) {
      detail::require_shape(w.b1, count, 1, ffn, (name + ".b1").c_str());
      detail::require_shape(w.b3, count, 1, ffn, (name + ".b3").c_str());
      detail::require_shape(w.b2, count, 1, hidden, (name + ".b2").c_str());
    }
  }

  /// Three GEMMs of [rows, H] x [H, F] (or back), as glu: the biases and clamps are O(F).
  static double flops_per_row(index_t hidden, index_t ffn) {
    return 6.0 * static_cast<double>(hidden) * static_cast<double>(ffn);
  }
  static index_t scratch_per_row(index_t ffn) { return 2 * ffn; }

  template <class T>
  static auto tensors(weights_of<T>& w) {
    if constexpr (biases)
      return std::array<stacked_view<const T>*, 6>{&w.w1, &w.w3, &w.w2, &w.b1, &w.b3, &w.b2};
    else
      return std::array<stacked_view<const T>*, 3>{&w.w1, &w.w3, &w.w2};
  }
  template <class T>
  static weights_of<T> slice(const weights_of<T>& w, index_t first, index_t n) {
    weights_of<T> s{w.w1.slice(first, n), w.w3.slice(first, n), w.w2.slice(first, n)};
    if constexpr (biases)
      s.b1 = w.b1.slice(first, n), s.b3 = w.b3.slice(first, n), s.b2 = w.b2.slice(first, n);
    return s;
  }

  // The biases' row functors are expert::mlp's (their activation is never applied here).
  template <class T>
  using add_bias = typename mlp<act::relu, true>::template bias_rows<T, false>;
  template <class T, class G>
  using column_sum = typename mlp<act::relu, true>::template group_column_sum<T, G>;

  /// h1[i] = clamped_gate(h1[i], h3[i]) over the [rows, F] hidden layers.
  template <class T>
  struct gate_rows {
    T* h1;
    const T* h3;
    EPMOE_HD void operator()(index_t i) const {
      h1[i] = from_float<T>(clamped_gate<Form>::apply(to_float(h1[i]), to_float(h3[i])));
    }
  };

  // a = x W1ᵀ + b1 and b = x W3ᵀ + b3 into h1, h3.
  template <class Space, class T>
  static void project_up(const Space& space, const weights_of<T>& w, grouped_rows<const T> x,
                         grouped_rows<T> h1, grouped_rows<T> h3, index_t n) {
    space.grouped_gemm_nt(x, w.w1, h1);
    space.grouped_gemm_nt(x, w.w3, h3);
    if constexpr (biases) {
      const index_t F = w.w1.rows;
      space.for_each(n, add_bias<T>{h1.data, w.b1.data, w.b1.batch_stride, F, h1.stride, h1.groups,
                                    h1.device_offsets});
      space.for_each(n, add_bias<T>{h3.data, w.b3.data, w.b3.batch_stride, F, h3.stride, h3.groups,
                                    h3.device_offsets});
    }
  }

  /// Runs every local expert g on its rows of x (group g); the output overwrites x. scratch
  /// holds x.rows() * scratch_per_row elements; `keep` receives a and b (biases included).
  template <class Space, class T>
  static void forward(const Space& space, const weights_of<T>& w, grouped_rows<T> x, T* scratch,
                      T* keep = nullptr) {
    const index_t F = w.w1.rows, n = x.elements(F);
    if (n == 0) return;
    const grouped_rows<T> h1 = x.over(scratch, F), h3 = x.over(scratch + n, F);
    project_up(space, w, grouped_rows<const T>(x), h1, h3, n);
    if (keep) space.for_each(2 * n, copy_elements<T>{scratch, keep});
    space.for_each(n, gate_rows<T>{h1.data, h3.data});
    space.grouped_gemm_nt(h1, w.w2, x);
    if constexpr (biases)
      space.for_each(x.elements(x.cols), add_bias<T>{x.data, w.b2.data, w.b2.batch_stride, x.cols,
                                                     x.stride, x.groups, x.device_offsets});
  }

  // --- backward (docs/training.md) -------------------------------------------------------

  template <class G>
  struct grads_of {
    stacked_view<G> w1;    // [L, F, H]
    stacked_view<G> w3;    // [L, F, H]
    stacked_view<G> w2;    // [L, H, F]
    stacked_view<G> b1{};  // [L, 1, F] (biases)
    stacked_view<G> b3{};  // [L, 1, F] (biases)
    stacked_view<G> b2{};  // [L, 1, H] (biases)
  };
  using grads = grads_of<float>;
  template <class G>
  static grads_of<G> slice(const grads_of<G>& g, index_t first, index_t n) {
    grads_of<G> s{g.w1.slice(first, n), g.w3.slice(first, n), g.w2.slice(first, n)};
    if constexpr (biases)
      s.b1 = g.b1.slice(first, n), s.b3 = g.b3.slice(first, n), s.b2 = g.b2.slice(first, n);
    return s;
  }
  template <class G>
  static auto tensors(grads_of<G>& g) {
    if constexpr (biases)
      return std::array<stacked_view<G>*, 6>{&g.w1, &g.w3, &g.w2, &g.b1, &g.b3, &g.b2};
    else
      return std::array<stacked_view<G>*, 3>{&g.w1, &g.w3, &g.w2};
  }
  template <class G>
  static void validate(const grads_of<G>& g, index_t count, index_t hidden, index_t ffn,
                       const std::string& name) {
    validate(weights_of<G>{g.w1, g.w3, g.w2, g.b1, g.b3, g.b2}, count, hidden, ffn, name);
  }

  static index_t backward_scratch_per_row(index_t ffn) { return 3 * ffn; }
  static double backward_flops_per_row(index_t hidden, index_t ffn, bool recompute) {
    return (recompute ? 16.0 : 12.0) * static_cast<double>(hidden) * static_cast<double>(ffn);
  }
  static index_t keep_per_row(index_t ffn) { return 2 * ffn; }

  /// Element i of the hidden layers: from a, b (biases included) and dh = dy W2, writes da
  /// over a, db over b and h = clamped_gate(a, b) over dh.
  template <class T>
  struct gate_grad_rows {
    T *a, *b, *dh;
    EPMOE_HD void operator()(index_t i) const {
      const float av = to_float(a[i]), bv = to_float(b[i]);
      float da, db;
      clamped_gate<Form>::grad(av, bv, to_float(dh[i]), da, db);
      a[i] = from_float<T>(da);
      b[i] = from_float<T>(db);
      dh[i] = from_float<T>(clamped_gate<Form>::apply(av, bv));
    }
  };

  /// The backward of forward() (as glu::backward): dx, and dW1, dW3, dW2 (+ db1, db3, db2:
  /// column sums of da, db, dy per expert) into `grads`, overwritten or added to.
  template <class Space, class T, class G>
  static void backward(const Space& space, const weights_of<T>& w, grouped_rows<const T> x,
                       grouped_rows<const T> dy, grouped_rows<T> dx, const grads_of<G>& grads,
                       T* scratch, bool accumulate = false, const T* kept = nullptr) {
    const index_t F = w.w1.rows, n = x.elements(F);
    const grouped_rows<T> a = x.over(scratch, F), b = x.over(scratch + n, F),
                          dh = x.over(scratch + 2 * n, F);
    if (n > 0) {
      if (kept)
        space.for_each(2 * n, copy_elements<T>{kept, scratch});
      else
        project_up(space, w, x, a, b, n);
      space.grouped_gemm_nn(dy, w.w2, dh);
      space.for_each(n, gate_grad_rows<T>{a.data, b.data, dh.data});
    }
    if (grads.w1.data) {  // none for frozen experts
      space.grouped_gemm_tn_accumulate(dy, grouped_rows<const T>(dh), grads.w2, accumulate);
      space.grouped_gemm_tn_accumulate(grouped_rows<const T>(a), x, grads.w1, accumulate);
      space.grouped_gemm_tn_accumulate(grouped_rows<const T>(b), x, grads.w3, accumulate);
      if constexpr (biases) {
        const index_t H = w.w2.rows;
        if (x.groups > 0) {
          space.for_each(x.groups * H,
                         column_sum<T, G>{dy.data, H, dy.stride, dy.device_offsets, grads.b2.data,
                                          grads.b2.batch_stride, accumulate});
          space.for_each(x.groups * F,
                         column_sum<T, G>{a.data, F, a.stride, a.device_offsets, grads.b1.data,
                                          grads.b1.batch_stride, accumulate});
          space.for_each(x.groups * F,
                         column_sum<T, G>{b.data, F, b.stride, b.device_offsets, grads.b3.data,
                                          grads.b3.batch_stride, accumulate});
        }
      }
    }
    if (n == 0) return;
    space.grouped_gemm_nn(a, w.w1, dx);  // dx = da W1 + db W3
    space.grouped_gemm_nn(b, w.w3, dx, true);
  }

  /// Local expert j alone on rows x [n, H] (tests, calibration).
  template <class Space, class T>
  static void forward(const Space& space, const weights_of<T>& w, index_t j, matrix_view<T> x,
                      T* scratch) {
    const index_t offsets[2] = {0, x.rows};
    forward(space, slice(w, j, 1), grouped_rows<T>{x.data, x.cols, x.stride, 1, offsets, offsets},
            scratch);
  }
};

/// GPT-OSS (`GptOssExperts`) and DeepSeek-V4 (`DeepseekV4Experts`).
using gpt_oss = clamped_glu<gpt_oss_clamp>;
using deepseek_v4 = clamped_glu<deepseek_v4_clamp>;

}  // namespace epmoe::expert
