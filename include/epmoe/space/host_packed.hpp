// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
#pragma once

// A GEMM for any number of rows over weights packed once (issue 22): c = a bᵀ with b (an
// expert's [out, in] weight) stored as panels of 32 output columns, K-major, so that every
// panel is read from memory once and used for all of a's rows while it sits in cache. sgemm
// packs b on every call, which dominates when a has 16-256 rows (an expert's share of a
// decode batch); the streaming kernel (host_gemm.hpp) re-reads a for every 4 columns.
// The micro-kernels, one per instruction set and chosen at run time from what the CPU has,
// are in host_packed_kernels.hpp; each weights_format beyond the floats has a header of its
// own with its panel layout, quantisation and kernels (host_int8.hpp, host_int4.hpp).

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <new>
#include <span>
#include <utility>
#include <vector>

#include "epmoe/core/options.hpp"
#include "epmoe/core/view.hpp"
#include "epmoe/space/host_fp8.hpp"
#include "epmoe/space/host_int4.hpp"
#include "epmoe/space/host_int8.hpp"
#include "epmoe/space/host_mxfp4.hpp"
#include "epmoe/space/host_mxfp4_vnni.hpp"
#include "epmoe/space/host_packed_kernels.hpp"

namespace epmoe::space {

/// b [N, K] packed for c = a bᵀ in a weights_format: panel p holds columns [32p, 32p + 32)
/// (columns past N zero), 64-byte aligned. fp32: K rows of 32 elements. bf16 (half the bytes
/// to read, values rounded to nearest even): ceil(K / 2) rows of 32 pairs, column j's
/// elements k and k + 1 side by side (k even; past K zero), the layout of AVX512-BF16's pair
/// dot products, which the other paths widen with a shift and a mask. int8_channel: int8 quads
/// and each column's scale and compensation (host_int8.hpp); int4, int4_asym, int8_group: a
/// block per group of inputs (host_int4.hpp); fp8_block and mxfp4: their codes and block
/// scales (host_fp8.hpp, host_mxfp4.hpp). Built once; repack() refills it
/// in place (new values of the same shape and format: a training step) without allocating.
class packed_nt {
 public:
  static constexpr index_t panel_cols = 32;

  packed_nt() = default;
  explicit packed_nt(matrix_view<const float> b, weights_format as = weights_format::fp32) {
    repack(b, as);
  }

  /// Packs b, allocating only when its shape or format differs from the last one.
  /// int8_channel: each output channel quantised (quantise_int8_channel); config_error for NaN
  /// or Inf, or K past int8_max_cols.
  void repack(matrix_view<const float> b, weights_format as = weights_format::fp32) {
    shape(b.rows, b.cols, as);
    if (as_.grouped()) {
      for (index_t p = 0; p < panels(); ++p) {
        const index_t j0 = p * panel_cols;
        detail::pack_group_panel(data_.get() + p * panel_bytes(), as_, k_,
                                 std::min(panel_cols, n_ - j0), j0, b, {}, nullptr, nullptr);
      }
      return;
    }
    if (as_ == weights_format::fp8_block) {
      std::vector<float> scales;
      fp8_block_scales(b, scales);
      return fill_fp8(
          [&](index_t n, index_t k) {
            const float s = scales[std::size_t(n / 128 * ((k_ + 127) / 128) + k / 128)];
            return s > 0 ? e4m3_bits(b(n, k) / s) : e4m3_bits(b(n, k));  // (a zero block)
          },
          scales.data());
    }
    if (as_ == weights_format::mxfp4)
      for (index_t p = 0; p < panels(); ++p)
        detail::quantise_mxfp4_panel(data_.get() + p * panel_bytes(), b, p * panel_cols,
                                     std::min(panel_cols, n_ - p * panel_cols));
    else if (as_ == weights_format::int8_channel)
      for (index_t p = 0; p < panels(); ++p) {
        const index_t j0 = p * panel_cols;
        detail::pack_int8_panel(data_.get() + p * panel_bytes(), k_, std::min(panel_cols, n_ - j0),
                                j0, b, {}, nullptr);
      }
    else if (as_ == weights_format::bf16)
      fill<std::uint16_t>(b, bf16_bits);
    else
      fill<float>(b, [](float v) { return v; });
  }
  /// Packs weights quantised already as int8_channel: q [N, K] (any int8, -128 too) and
  /// scales [N] (finite, >= 0), as a checkpoint stores them.
  void repack_int8(matrix_view<const std::int8_t> q, const float* scales) {
    for (index_t j = 0; j < q.rows; ++j)
      epmoe::detail::require(std::isfinite(scales[j]) && scales[j] >= 0,
                             "pack_weights(int8_channel)", scales[j],
                             "a channel's scale must be finite and >= 0");
    shape(q.rows, q.cols, weights_format::int8_channel);
    for (index_t p = 0; p < panels(); ++p) {
      const index_t j0 = p * panel_cols;
      detail::pack_int8_panel(data_.get() + p * panel_bytes(), k_, std::min(panel_cols, n_ - j0),
                              j0, {}, q, scales);
    }
  }

  /// Packs weights quantised already in group-wise format `as` (int4, int4_asym, int8_group),
  /// as a checkpoint stores them (loaders: GPTQ, AWQ, GGUF Q4_K / Q8_0): q [N, K] holding the
  /// format's integers (int4 [-8, 7], int4_asym [0, 15], int8_group any int8), scales [N, G]
  /// and, for int4_asym, offsets [N, G] (G = ceil(K / group); row-major; finite); w = scale q
  /// + offset. config_error naming the field and the rule otherwise.
  void repack_grouped(weights_format as, matrix_view<const std::int8_t> q, const float* scales,
                      const float* offsets = nullptr) {
    const std::string who = std::string("repack_grouped(") + as.name() + ")";
    epmoe::detail::require(as.grouped(), who.c_str(), as.name(),
                           "must be a group-wise format (int4, int4_asym, int8_group)");
    check_group(as);
    const bool asym = as.id == weights_format::kind::int4_asym;
    epmoe::detail::require(!asym || offsets, (who + ".offsets").c_str(), "none",
                           "int4_asym needs an offset per group");
    const bool four = as.id == weights_format::kind::int4;
    const int lo = four ? -8 : asym ? 0 : -128, hi = four ? 7 : asym ? 15 : 127;
    for (index_t n = 0; n < q.rows; ++n)
      for (index_t k = 0; k < q.cols; ++k)
        epmoe::detail::require(q(n, k) >= lo && q(n, k) <= hi, (who + ".q").c_str(), int{q(n, k)},
                               asym ? "must be in [0, 15]" : "must be in [-8, 7]");
    const index_t values = q.rows * group_count(as, q.cols);
    for (index_t i = 0; i < values; ++i) {
      epmoe::detail::require(std::isfinite(scales[i]), (who + ".scales").c_str(), scales[i],
                             "must be finite");
      if (asym)
        epmoe::detail::require(std::isfinite(offsets[i]), (who + ".offsets").c_str(), offsets[i],
                               "must be finite");
    }
    shape(q.rows, q.cols, as);
    for (index_t p = 0; p < panels(); ++p) {
      const index_t j0 = p * panel_cols;
      detail::pack_group_panel(data_.get() + p * panel_bytes(), as_, k_,
                               std::min(panel_cols, n_ - j0), j0, {}, q, scales,
                               asym ? offsets : nullptr);
    }
  }
  /// Packs FP8 weights as a checkpoint stores them (fp8_block; no re-quantisation): q [N, K]
  /// e4m3fn bytes (no NaN) and scale_inv [ceil(N / 128), ceil(K / 128)] row-major (finite,
  /// >= 0): w = e4m3(q) * scale_inv of its 128 x 128 block (DeepSeek-V3's weight_scale_inv).
  void repack_fp8(matrix_view<const std::uint8_t> q, const float* scale_inv) {
    fp8_check(q, scale_inv);
    shape(q.rows, q.cols, weights_format::fp8_block);
    fill_fp8([&](index_t n, index_t k) { return q(n, k); }, scale_inv);
  }
  /// Packs MXFP4 weights as a checkpoint stores them (GPT-OSS's *_blocks, *_scales): blocks
  /// [N, ceil(K / 32) * 16] bytes, two E2M1 codes each (input 2i in the low nibble, 2i + 1 in
  /// the high one; codes past K ignored), scales [N, ceil(K / 32)] E8M0 (at most 252): w =
  /// e2m1 * 2^(scale - 127) per block of 32 inputs.
  void repack_mxfp4(index_t K, matrix_view<const std::uint8_t> blocks,
                    matrix_view<const std::uint8_t> scales) {
    epmoe::detail::require(blocks.rows == scales.rows && blocks.cols == (K + 31) / 32 * 16 &&
                               scales.cols == (K + 31) / 32,
                           "pack_weights(mxfp4).blocks", blocks.cols,
                           "must be [N, ceil(K / 32) * 16] bytes beside scales [N, ceil(K / 32)]");
    mxfp4_check(scales);
    shape(blocks.rows, K, weights_format::mxfp4);
    for (index_t p = 0; p < panels(); ++p)
      detail::pack_mxfp4_panel(data_.get() + p * panel_bytes(), k_,
                               std::min(panel_cols, n_ - p * panel_cols), p * panel_cols,
                               [&](index_t n, index_t b, std::uint8_t* codes) {
                                 for (index_t i = 0; i < 32; ++i)
                                   codes[i] = blocks(n, 16 * b + i / 2) >> (4 * (i % 2)) & 15;
                                 return scales(n, b);
                               });
  }

  /// Act order (a GPTQ checkpoint's desc_act): this copy holds the weight's inputs in
  /// `order` (its column j is input order[j]), so that each group is a run of that order; a
  /// product gathers its inputs the same way (gather_inputs). A group-wise copy only; a
  /// permutation of [0, K), else config_error; empty: the inputs' own order. Every repack
  /// clears it (a copy packed from values holds them in their own order).
  void set_input_order(std::span<const index_t> order) {
    if (order.empty()) return order_.clear();
    epmoe::detail::require(as_.grouped(), "repack_grouped.order", as_.name(),
                           "act order applies to group-wise formats");
    epmoe::detail::require(index_t(order.size()) == k_, "repack_grouped.order",
                           index_t(order.size()), "must hold one index per input (K)");
    std::vector<char> seen(static_cast<std::size_t>(k_), 0);
    for (const index_t v : order)
      epmoe::detail::require(v >= 0 && v < k_ && !seen[std::size_t(v)]++, "repack_grouped.order", v,
                             "must be a permutation of [0, K)");
    order_.assign(order.begin(), order.end());
  }
  std::span<const index_t> input_order() const { return order_; }

  index_t rows() const { return n_; }  // N: output columns of c
  index_t cols() const { return k_; }  // K
  weights_format precision() const { return as_; }
  index_t panels() const { return (n_ + panel_cols - 1) / panel_cols; }
  /// Panel p's elements (E: float for fp32, std::uint16_t for bf16, std::byte for int8).
  template <class E>
  const E* panel(index_t p) const {
    return reinterpret_cast<const E*>(data_.get() + p * panel_bytes());
  }
  /// The values this copy holds, as b [N, K] row-major floats (bf16: b rounded; int8: each q
  /// times its channel's scale): what a backward multiplies by so that it differentiates the
  /// forward it follows, and the format's definition the tests compare the kernels with.
  void unpack(float* out) const {
    if (as_ == weights_format::fp8_block || as_ == weights_format::mxfp4) {
      for (index_t p = 0; p < panels(); ++p) {
        const index_t j0 = p * panel_cols, cols = std::min(panel_cols, n_ - j0);
        (as_ == weights_format::fp8_block ? detail::unpack_fp8_panel : detail::unpack_mxfp4_panel)(
            panel<std::byte>(p), k_, cols, out + j0 * k_, k_);
      }
      return;
    }
    const bool pairs = as_ == weights_format::bf16;
    for (index_t p = 0; p < panels(); ++p) {
      const index_t j0 = p * panel_cols, cols = std::min(panel_cols, n_ - j0);
      const detail::int8_panel_view q = detail::int8_panel(panel<std::byte>(p), k_);
      for (index_t k = 0; k < k_; ++k)
        for (index_t j = 0; j < cols; ++j)
          out[(j0 + j) * k_ + k] =
              as_.grouped() ? detail::group_weight(panel<std::byte>(p), as_, k, j)
              : as_ == weights_format::int8_channel ? q.scale[j] * q.q[k / 4 * 128 + 4 * j + k % 4]
              : pairs ? bf16_value(panel<std::uint16_t>(p)[k / 2 * 2 * panel_cols + 2 * j + k % 2])
                      : panel<float>(p)[k * panel_cols + j];
    }
    if (order_.empty()) return;
    std::vector<float> row(static_cast<std::size_t>(k_));  // back to the inputs' own order
    for (index_t n = 0; n < n_; ++n) {
      float* r = out + n * k_;
      for (index_t j = 0; j < k_; ++j) row[std::size_t(order_[std::size_t(j)])] = r[j];
      std::copy(row.begin(), row.end(), r);
    }
  }
  /// Bytes of the panels (weights, scales and zero padding): what one pass reads.
  index_t packed_bytes() const { return panels() * panel_bytes(); }

 private:
  index_t panel_bytes() const {
    if (as_.grouped()) return group_panel_bytes(as_, k_);
    return as_ == weights_format::fp8_block      ? fp8_panel_bytes(k_)
           : as_ == weights_format::mxfp4        ? mxfp4_panel_bytes(k_)
           : as_ == weights_format::int8_channel ? int8_panel_bytes(k_)
           : as_ == weights_format::bf16         ? (k_ + 1) / 2 * 2 * panel_cols * 2
                                                 : k_ * panel_cols * 4;
  }
  void shape(index_t n, index_t k, weights_format as) {
    order_.clear();
    epmoe::detail::require(as != weights_format::int8_channel || k <= int8_max_cols,
                           "pack_weights(int8_channel)", k,
                           "K (a weight's inputs) must be at most 66311: vpdpbusd sums in int32");
    if (as.grouped()) check_group(as);
    if (n != n_ || k != k_ || as != as_ || !data_) {
      n_ = n, k_ = k, as_ = as;
      data_.reset(static_cast<std::byte*>(
          ::operator new[](std::max<std::size_t>(static_cast<std::size_t>(packed_bytes()), 1),
                           std::align_val_t{64})));
    }
  }
  // fp8_block panels from code(n, k) and block scales [ceil(N / 128), ceil(K / 128)].
  template <class Code>
  void fill_fp8(Code&& code, const float* scales) {
    for (index_t p = 0; p < panels(); ++p)
      detail::pack_fp8_panel(data_.get() + p * panel_bytes(), k_,
                             std::min(panel_cols, n_ - p * panel_cols), p * panel_cols, code,
                             scales + p * panel_cols / 128 * ((k_ + 127) / 128));
  }
  template <class E, class Convert>
  void fill(matrix_view<const float> b, Convert convert) {
    // Element (k, j) of a panel: fp32 at k * 32 + j; bf16 at (k / 2) * 64 + 2 j + k % 2.
    const bool pairs = as_ == weights_format::bf16;
    for (index_t p = 0; p < panels(); ++p) {
      E* out = reinterpret_cast<E*>(data_.get() + p * panel_bytes());
      std::fill_n(out, panel_bytes() / index_t{sizeof(E)}, E{});
      const index_t j0 = p * panel_cols, cols = std::min(panel_cols, n_ - j0);
      for (index_t k = 0; k < k_; ++k) {
        E* row = pairs ? out + k / 2 * 2 * panel_cols + k % 2 : out + k * panel_cols;
        const index_t step = pairs ? 2 : 1;
        for (index_t j = 0; j < cols; ++j) row[j * step] = convert(b(j0 + j, k));
      }
    }
  }
  struct aligned_delete {
    void operator()(std::byte* p) const { ::operator delete[](p, std::align_val_t{64}); }
  };
  std::unique_ptr<std::byte, aligned_delete> data_;
  index_t n_ = 0, k_ = 0;
  weights_format as_ = weights_format::fp32;
  std::vector<index_t> order_;  // set_input_order
};

/// out [M, K] row-major = a's rows with their inputs in b's order (out(i, j) = a(i, order[j]);
/// a's own order when b has none): what an act-order copy multiplies.
inline matrix_view<const float> gather_inputs(matrix_view<const float> a, const packed_nt& b,
                                              float* out) {
  const std::span<const index_t> order = b.input_order();
  for (index_t i = 0; i < a.rows; ++i)
    for (index_t j = 0; j < a.cols; ++j)
      out[i * a.cols + j] = order.empty() ? a(i, j) : a(i, order[std::size_t(j)]);
  return {out, a.rows, a.cols};
}

static_assert(packed_nt::panel_cols == detail::panel_width,
              "the micro-kernels (host_packed_kernels.hpp) compute panels of panel_cols columns");

namespace detail {
// The panels [p0, p1) of b, elements E, on `path` (a16: a as bf16 pairs, for avx512_bf16).
template <class E>
inline void gemm_nt_panels(matrix_view<const float> a, converted_rows a16, const packed_nt& b,
                           matrix_view<float> c, index_t p0, index_t p1, cpu_path path) {
  const index_t K = b.cols(), N = b.rows(), chunk = packed_row_chunk(K);
  for (index_t i0 = 0; i0 < a.rows; i0 += chunk) {
    const matrix_view<const float> ai = a.rows_slice(i0, std::min(chunk, a.rows - i0));
    for (index_t p = p0; p < p1; ++p) {
      const index_t j0 = p * packed_nt::panel_cols;
      const index_t cols = std::min(packed_nt::panel_cols, N - j0);
      float* cp = c.row(i0) + j0;
      const E* panel = b.panel<E>(p);
#if defined(EPMOE_HOST_PACKED_X86)
      if constexpr (sizeof(E) == 2) {
        if (path == cpu_path::avx512_bf16) {
          packed_panel_bf16dot({a16.data + i0 * a16.stride, a16.stride}, ai.rows, panel, K, cp,
                               c.stride, cols);
          continue;
        }
      }
      if (path == cpu_path::avx512 || path == cpu_path::avx512_bf16) {
        packed_panel_avx512(ai, panel, K, cp, c.stride, cols);
        continue;
      }
      if (path == cpu_path::avx2) {
        packed_panel_avx2(ai, panel, K, cp, c.stride, cols);
        continue;
      }
#endif
      packed_panel_portable(ai, panel, K, cp, c.stride, cols);
    }
  }
}

// The same for int8_channel panels with `kernel` (a8: a quantised per token, for VNNI).
inline void gemm_nt_int8_panels(matrix_view<const float> a, converted_rows a8, const packed_nt& b,
                                matrix_view<float> c, index_t p0, index_t p1, int8_kernel kernel) {
  const index_t K = b.cols(), N = b.rows(), chunk = packed_row_chunk(K);
  for (index_t i0 = 0; i0 < a.rows; i0 += chunk) {
    const matrix_view<const float> ai = a.rows_slice(i0, std::min(chunk, a.rows - i0));
    for (index_t p = p0; p < p1; ++p) {
      const index_t j0 = p * packed_nt::panel_cols;
      const index_t cols = std::min(packed_nt::panel_cols, N - j0);
      float* cp = c.row(i0) + j0;
      const std::byte* panel = b.panel<std::byte>(p);
#if defined(EPMOE_HOST_PACKED_X86)
      if (kernel == int8_kernel::avx512_vnni) {
        int8_panel_vnni({a8.data + i0 * a8.stride, a8.stride, a8.scales + i0}, ai.rows, panel, K,
                        cp, c.stride, cols);
        continue;
      }
      if (kernel == int8_kernel::avx512) {
        int8_panel_avx512(ai, panel, K, cp, c.stride, cols);
        continue;
      }
      if (kernel == int8_kernel::avx2) {
        int8_panel_avx2(ai, panel, K, cp, c.stride, cols);
        continue;
      }
#endif
      int8_panel_portable(ai, panel, K, cp, c.stride, cols);
    }
  }
}

// The same for group-wise panels (host_int4.hpp: group_panel).
inline void gemm_nt_group_panels(matrix_view<const float> a, converted_rows a8, const packed_nt& b,
                                 matrix_view<float> c, index_t p0, index_t p1, int8_kernel kernel) {
  const index_t K = b.cols(), N = b.rows(), chunk = packed_row_chunk(K);
  for (index_t i0 = 0; i0 < a.rows; i0 += chunk) {
    const matrix_view<const float> ai = a.rows_slice(i0, std::min(chunk, a.rows - i0));
    const converted_rows a8i{a8.data ? a8.data + i0 * a8.stride : nullptr, a8.stride,
                             a8.scales ? a8.scales + i0 : nullptr};
    for (index_t p = p0; p < p1; ++p) {
      const index_t j0 = p * packed_nt::panel_cols;
      group_panel(kernel, ai, a8i, b.panel<std::byte>(p), b.precision(), K, c.row(i0) + j0,
                  c.stride, std::min(packed_nt::panel_cols, N - j0));
    }
  }
}

// The same for fp8_block and mxfp4 panels with `kernel` (a16: a as bf16 pairs, avx512_bf16),
// or mxfp4 as W4A8 (w4a8: a16 the rows quantised per token, quantise_group_rows).
inline void gemm_nt_minifloat_panels(matrix_view<const float> a, converted_rows a16,
                                     const packed_nt& b, matrix_view<float> c, index_t p0,
                                     index_t p1, minifloat_kernel kernel, bool w4a8) {
  const index_t K = b.cols(), N = b.rows(), chunk = packed_row_chunk(K);
  const auto panel = b.precision() == weights_format::fp8_block ? fp8_panel : mxfp4_panel;
  for (index_t i0 = 0; i0 < a.rows; i0 += chunk) {
    const index_t n = std::min(chunk, a.rows - i0);
    const matrix_view<const float> ai = a.rows_slice(i0, n);
    const converted_rows ai16{a16.data ? a16.data + i0 * a16.stride : nullptr, a16.stride,
                              a16.scales ? a16.scales + i0 : nullptr};
    for (index_t p = p0; p < p1; ++p) {
      const index_t j0 = p * packed_nt::panel_cols, cols = std::min(packed_nt::panel_cols, N - j0);
      if (w4a8)
        mxfp4_panel_vnni(ai16, n, b.panel<std::byte>(p), K, c.row(i0) + j0, c.stride, cols);
      else
        panel(ai, ai16, b.panel<std::byte>(p), K, c.row(i0) + j0, c.stride, cols, kernel);
    }
  }
}
}  // namespace detail

inline bool is_minifloat(weights_format f) {
  return f == weights_format::fp8_block || f == weights_format::mxfp4;
}

/// Whether gemm_nt_packed over b on `path` reads a as bf16 pairs (to_bf16_pairs): bf16
/// panels on AVX512-BF16, whose dot products take bf16 on both sides.
inline bool packed_reads_bf16_pairs(const packed_nt& b, cpu_path path) {
  return path == cpu_path::avx512_bf16 && b.precision() == weights_format::bf16;
}

/// Words per row of a that gemm_nt_packed over panels of format `as` and K inputs reads
/// converted on `path` (converted_rows: bf16 pairs, u8 quads); 0 when it reads a itself.
inline index_t packed_input_words(weights_format as, index_t K, cpu_path path) {
  if (as == weights_format::bf16 && path == cpu_path::avx512_bf16) return (K + 1) / 2;
  if (as == weights_format::mxfp4 && mxfp4_w4a8(path)) return group_input_words(as, K);
  if (is_minifloat(as) && minifloat_kernel_for(path) == minifloat_kernel::avx512_bf16)
    return (K + 1) / 2;
  if (as == weights_format::int8_channel && int8_kernel_for(path) == int8_kernel::avx512_vnni)
    return (K + 3) / 4;
  if (as.grouped() && int8_kernel_for(path) == int8_kernel::avx512_vnni)
    return group_input_words(as, K);
  return 0;
}

/// a's rows converted for gemm_nt_packed over b on `path` (packed_input_words(...) > 0):
/// into out (row stride `stride` words) and, for u8 quads, one scale per row into scales.
inline void convert_inputs(matrix_view<const float> a, const packed_nt& b, cpu_path path,
                           std::uint32_t* out, index_t stride, float* scales) {
  if (b.precision().grouped() || (b.precision() == weights_format::mxfp4 && mxfp4_w4a8(path)))
    quantise_group_rows(a, b.precision(), out, stride, scales, int8_kernel_for(path));
  else if (b.precision() == weights_format::int8_channel)
    quantise_u8_rows(a, out, stride, scales, int8_kernel_for(path));
  else
    to_bf16_pairs(a, out, stride, path);
}

/// c[M, N] = a[M, K] bᵀ for b packed, over panels [p0, p1) (c's columns [32 p0, 32 p1) ∩
/// [0, N)), on `path` (which the CPU must run: cpu_runs). Each panel is read once per chunk
/// of rows (packed_row_chunk) and used for all of them while in cache; a split of the panels
/// over threads shares nothing. Sums run over k in order: bits depend on the shapes alone.
/// bf16 panels are widened to fp32 as they load (products and sums in fp32), or on
/// AVX512-BF16 multiplied with a16, a rounded to bf16 (packed_reads_bf16_pairs: products of
/// two bf16 exact in fp32, sums in fp32). int8 panels: int8_kernel_for(path), reading `a16`
/// as a quantised per token on VNNI (convert_inputs).
inline void gemm_nt_packed(matrix_view<const float> a, converted_rows a16, const packed_nt& b,
                           matrix_view<float> c, index_t p0, index_t p1,
                           cpu_path path = best_cpu_path()) {
  if (b.precision().grouped())
    detail::gemm_nt_group_panels(a, a16, b, c, p0, p1, int8_kernel_for(path));
  else if (b.precision() == weights_format::int8_channel)
    detail::gemm_nt_int8_panels(a, a16, b, c, p0, p1, int8_kernel_for(path));
  else if (is_minifloat(b.precision()))
    detail::gemm_nt_minifloat_panels(a, a16, b, c, p0, p1, minifloat_kernel_for(path),
                                     b.precision() == weights_format::mxfp4 && mxfp4_w4a8(path));
  else if (b.precision() == weights_format::bf16)
    detail::gemm_nt_panels<std::uint16_t>(a, a16, b, c, p0, p1, path);
  else
    detail::gemm_nt_panels<float>(a, a16, b, c, p0, p1, path);
}

/// The same, converting a itself where the path reads it converted (into memory it
/// allocates: the space converts once into storage packed_weights holds).
inline void gemm_nt_packed(matrix_view<const float> a, const packed_nt& b, matrix_view<float> c,
                           index_t p0, index_t p1, cpu_path path = best_cpu_path()) {
  std::vector<float> gathered(b.input_order().empty() ? 0 : std::size_t(a.rows * a.cols));
  if (!gathered.empty()) a = gather_inputs(a, b, gathered.data());
  std::vector<std::uint32_t> words;
  std::vector<float> scales;
  converted_rows a16;
  if (const index_t w = packed_input_words(b.precision(), b.cols(), path)) {
    words.resize(static_cast<std::size_t>(a.rows * w));
    scales.resize(static_cast<std::size_t>(a.rows));
    convert_inputs(a, b, path, words.data(), w, scales.data());
    a16 = {words.data(), w, scales.data()};
  }
  gemm_nt_packed(a, a16, b, c, p0, p1, path);
}

/// Every panel.
inline void gemm_nt_packed(matrix_view<const float> a, const packed_nt& b, matrix_view<float> c,
                           cpu_path path = best_cpu_path()) {
  gemm_nt_packed(a, b, c, 0, b.panels(), path);
}

/// int8_channel panels on a given kernel (tests and benchmarks: the paths a CPU runs, VNNI
/// or not), converting a where it reads it quantised.
inline void gemm_nt_int8(matrix_view<const float> a, const packed_nt& b, matrix_view<float> c,
                         int8_kernel kernel) {
  std::vector<std::uint32_t> words;
  std::vector<float> scales;
  converted_rows a8;
  if (kernel == int8_kernel::avx512_vnni) {
    const index_t w = (b.cols() + 3) / 4;
    words.resize(static_cast<std::size_t>(a.rows * w));
    scales.resize(static_cast<std::size_t>(a.rows));
    quantise_u8_rows(a, words.data(), w, scales.data(), kernel);
    a8 = {words.data(), w, scales.data()};
  }
  detail::gemm_nt_int8_panels(a, a8, b, c, 0, b.panels(), kernel);
}

/// Group-wise panels (int4, int4_asym, int8_group) on a given kernel (tests and benchmarks),
/// converting a where it reads it quantised (VNNI).
inline void gemm_nt_grouped(matrix_view<const float> a, const packed_nt& b, matrix_view<float> c,
                            int8_kernel kernel) {
  std::vector<float> gathered(b.input_order().empty() ? 0 : std::size_t(a.rows * a.cols));
  if (!gathered.empty()) a = gather_inputs(a, b, gathered.data());
  std::vector<std::uint32_t> words;
  std::vector<float> scales;
  converted_rows a8;
  if (kernel == int8_kernel::avx512_vnni) {
    const index_t w = group_input_words(b.precision(), b.cols());
    words.resize(static_cast<std::size_t>(a.rows * w));
    scales.resize(static_cast<std::size_t>(a.rows));
    quantise_group_rows(a, b.precision(), words.data(), w, scales.data(), kernel);
    a8 = {words.data(), w, scales.data()};
  }
  detail::gemm_nt_group_panels(a, a8, b, c, 0, b.panels(), kernel);
}

/// fp8_block or mxfp4 panels on a given kernel (tests and benchmarks), converting a to bf16
/// pairs for avx512_bf16.
inline void gemm_nt_minifloat(matrix_view<const float> a, const packed_nt& b, matrix_view<float> c,
                              minifloat_kernel kernel) {
  std::vector<std::uint32_t> words;
  const index_t w = (b.cols() + 1) / 2;
  if (kernel == minifloat_kernel::avx512_bf16) {
    words.resize(static_cast<std::size_t>(a.rows * w));
    to_bf16_pairs(a, words.data(), w, cpu_path::avx512_bf16);
  }
  detail::gemm_nt_minifloat_panels(a, {words.data(), w}, b, c, 0, b.panels(), kernel, false);
}

/// mxfp4 panels as W4A8 (mxfp4_w4a8 must hold), a quantised per token (tests, benchmarks).
inline void gemm_nt_mxfp4_w4a8(matrix_view<const float> a, const packed_nt& b,
                               matrix_view<float> c) {
  const index_t w = group_input_words(weights_format::mxfp4, b.cols());
  std::vector<std::uint32_t> words(static_cast<std::size_t>(a.rows * w));
  std::vector<float> scales(static_cast<std::size_t>(a.rows));
  quantise_group_rows(a, weights_format::mxfp4, words.data(), w, scales.data(),
                      int8_kernel::avx512_vnni);
  detail::gemm_nt_minifloat_panels(a, {words.data(), w, scales.data()}, b, c, 0, b.panels(),
                                   minifloat_kernel::portable, true);
}

}  // namespace epmoe::space
