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

namespace epmoe::expert {

/// Non-gated expert FFN: y = W2 act(W1 x + b1) + b2 (Switch Transformer and NLLB-MoE: ReLU;
/// GShard, Switch's GELU variant: GELU). Biases = false: no b1, b2 (their views stay empty).
template <class Act, bool Biases = false>
struct mlp {
  static constexpr bool biases = Biases;

  /// This rank's L local experts, stacked; PyTorch [out, in] layout, element type T.
  template <class T>
  struct weights_of {
    stacked_view<const T> w1;    // [L, F, H] up projection
    stacked_view<const T> w2;    // [L, H, F] down projection
    stacked_view<const T> b1{};  // [L, 1, F] (Biases)
    stacked_view<const T> b2{};  // [L, 1, H] (Biases)
  };
  using weights = weights_of<float>;

  template <class T>
  static void validate(const weights_of<T>& w, index_t count, index_t hidden, index_t ffn,
                       const std::string& name) {
    detail::require_shape(w.w1, count, ffn, hidden, (name + ".w1").c_str());
    detail::require_shape(w.w2, count, hidden, ffn, (name + ".w2").c_str());
    if constexpr (Biases) {
      detail::require_shape(w.b1, count, 1, ffn, (name + ".b1").c_str());
      detail::require_shape(w.b2, count, 1, hidden, (name + ".b2").c_str());
    }
  }

  /// Two GEMMs of [rows, H] x [H, F] (and back): 2 FLOPs per multiply-add.
  static double flops_per_row(index_t hidden, index_t ffn) {
    return 4.0 * static_cast<double>(hidden) * static_cast<double>(ffn);
  }
  static index_t scratch_per_row(index_t ffn) { return ffn; }

  template <class T>
  static auto tensors(weights_of<T>& w) {
    if constexpr (Biases)
      return std::array<stacked_view<const T>*, 4>{&w.w1, &w.w2, &w.b1, &w.b2};
    else
      return std::array<stacked_view<const T>*, 2>{&w.w1, &w.w2};
  }
  template <class T>
  static weights_of<T> slice(const weights_of<T>& w, index_t first, index_t n) {
    if constexpr (Biases)
      return {w.w1.slice(first, n), w.w2.slice(first, n), w.b1.slice(first, n),
              w.b2.slice(first, n)};
    else
      return {w.w1.slice(first, n), w.w2.slice(first, n)};
  }

  /// Element i of a grouped [rows, cols] matrix (row stride `stride`): v = act(v + b[g]) or
  /// v + b[g], g the row's group (a binary search of the offsets; groups are few).
  template <class T, bool Activate>
  struct bias_rows {
    T* data;
    const T* bias;  // [groups, cols], group g at g * bias_stride (or null: no bias)
    index_t bias_stride, cols, stride;
    int groups;
    const index_t* offsets;  // [groups + 1] in the space's memory
    EPMOE_HD void operator()(index_t i) const {
      const index_t r = i / stride, c = i - r * stride;
      if (c >= cols) return;  // row padding: never read
      float v = to_float(data[i]);
      if (bias) {
        const index_t row = offsets[0] + r;
        int lo = 0, hi = groups;  // the group g with offsets[g] <= row < offsets[g + 1]
        while (hi - lo > 1) {
          const int mid = (lo + hi) / 2;
          (offsets[mid] <= row ? lo : hi) = mid;
        }
        v += to_float(bias[lo * bias_stride + c]);
      }
      if constexpr (Activate) v = Act::apply(v);
      data[i] = from_float<T>(v);
    }
  };

  /// Runs every local expert g on its rows of x (group g); the output overwrites x. scratch
  /// holds x.rows() * scratch_per_row elements.
  template <class Space, class T>
  static void forward(const Space& space, const weights_of<T>& w, grouped_rows<T> x, T* scratch) {
    const index_t F = w.w1.rows, n = x.elements(F);
    if (n == 0) return;
    const grouped_rows<T> h = x.over(scratch, F);
    space.grouped_gemm_nt(x, w.w1, h);
    space.for_each(n, bias_rows<T, true>{h.data, Biases ? w.b1.data : nullptr, w.b1.batch_stride, F,
                                         h.stride, h.groups, h.device_offsets});
    space.grouped_gemm_nt(h, w.w2, x);
    if constexpr (Biases)
      space.for_each(x.elements(x.cols),
                     bias_rows<T, false>{x.data, w.b2.data, w.b2.batch_stride, x.cols, x.stride,
                                         x.groups, x.device_offsets});
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

}  // namespace epmoe::expert
