// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
#pragma once

// The group-wise weight formats on the host (weights_format int4, int4_asym, int8_group;
// docs/quantisation.md): how a packed_nt panel holds them, their quantisation at pack time,
// the tokens' conversion for VNNI, and the portable kernel; the x86 kernels are in
// host_int4_kernels.hpp. Chosen at run time as int8_channel's are (int8_kernel_for): W4A8 /
// W8A8 on AVX512-VNNI, W4A16 / W8A16 (weights dequantised in registers, fp32 FMA) on
// AVX-512, AVX2+FMA and a portable loop.
//
// A panel of 32 output columns holds G = ceil(K / group) blocks, one per group: group / 4
// quads, then 32 fp32 scales, then (int4_asym) 32 fp32 offsets. An int4 quad is 64 bytes:
// byte 4 j + r holds input 4 g + r of column j in its low nibble and of column 16 + j in its
// high nibble (j < 16), unsigned: u = q + 8 (int4) or q (int4_asym). An int8_group quad is
// int8_channel's 128 bytes (column j's inputs at 4 j + r). Past K and past N zero.
//
// VNNI: vpdpbusd takes the weights as its unsigned operand (nibbles masked to bytes; int8
// flipped to u = q + 128) and the tokens' int8 as the signed one, so a group's int32 sum
// Σ u qx is exact and no compensation is stored with the weights: each group's sum starts at
// -z Σ qx (z = 8 for int4, 128 for int8_group; 0 for int4_asym, which adds m Σ qx in fp32),
// a value per row and group that the conversion computes beside the quantised row.

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <utility>

#include "epmoe/core/error.hpp"
#include "epmoe/core/options.hpp"
#include "epmoe/core/view.hpp"
#include "epmoe/space/host_int8.hpp"

namespace epmoe::space {

using wkind = weights_format::kind;

/// The largest group the formats pack (int8_group's group sums fit int32 far below it).
inline constexpr index_t group_max = 4096;

/// Groups of a row of K inputs, bytes of one quad (4 inputs x 32 columns), of one group's
/// block and of one panel.
constexpr index_t group_count(weights_format f, index_t K) { return (K + f.group - 1) / f.group; }
constexpr index_t group_quad_bytes(weights_format f) {
  return f.id == wkind::int8_group ? 128 : 64;
}
constexpr index_t group_block_bytes(weights_format f) {
  return f.group / 4 * group_quad_bytes(f) + (f.id == wkind::int4_asym ? 256 : 128);
}
constexpr index_t group_panel_bytes(weights_format f, index_t K) {
  return group_count(f, K) * group_block_bytes(f);
}

/// config_error unless f's group is one the formats pack.
inline void check_group(weights_format f) {
  epmoe::detail::require(f.group >= 32 && f.group % 32 == 0 && f.group <= group_max,
                         (std::string("pack_weights(") + f.name() + ").group").c_str(), f.group,
                         "must be a multiple of 32, at most 4096");
}

/// The kernels' names for a group-wise format (int8_kernel's instruction sets).
inline const char* name_of(int8_kernel k, weights_format f) {
  const bool four = f.id != wkind::int8_group;
  switch (k) {
    case int8_kernel::avx512_vnni:
      return four ? "AVX512-VNNI W4A8" : "AVX512-VNNI W8A8";
    case int8_kernel::avx512:
      return four ? "AVX-512 W4A16" : "AVX-512 W8A16";
    case int8_kernel::avx2:
      return four ? "AVX2+FMA W4A16" : "AVX2+FMA W8A16";
    default:
      return four ? "portable W4A16" : "portable W8A16";
  }
}

/// The format's quantisation of one group of a row, w[0, n) (reference::group_weights::
/// quantise states it): each q given as put(k, q); returns {scale, offset}. NaN or ±Inf
/// throws config_error naming the output channel `row` and the group.
template <class Put>
inline std::pair<float, float> quantise_group(weights_format f, const float* w, index_t n,
                                              index_t row, index_t group, Put&& put) {
  float amax = 0, lo = w[0], hi = w[0];
  for (index_t k = 0; k < n; ++k) {
    if (!std::isfinite(w[k]))
      throw config_error(
          std::string("pack_weights(") + f.name() + ")",
          "output channel " + std::to_string(row) + ", group " + std::to_string(group),
          "holds NaN or Inf, which the format cannot hold");
    amax = std::max(amax, std::abs(w[k]));
    lo = std::min(lo, w[k]), hi = std::max(hi, w[k]);
  }
  if (f.id == wkind::int4_asym) {  // in double: hi - lo may pass fp32's range
    const double step = (double{hi} - lo) / 15;
    for (index_t k = 0; k < n; ++k)
      put(k,
          static_cast<std::int8_t>(
              step > 0 ? std::clamp(std::nearbyint((double{w[k]} - lo) / step), 0.0, 15.0) : 0.0));
    return {static_cast<float>(step), lo};
  }
  const bool four = f.id == wkind::int4;
  const float scale = amax / (four ? 7.5f : 127.f), top = four ? 7.f : 127.f;
  for (index_t k = 0; k < n; ++k)
    put(k,
        static_cast<std::int8_t>(
            scale > 0 ? std::clamp(std::nearbyint(w[k] / scale), four ? -8.f : -127.f, top) : 0.f));
  return {scale, 0.f};
}

/// Words per row of the tokens converted for the VNNI kernel: the int8 quads of every group
/// (G group / 4), then one word per group (quantise_group_rows).
inline index_t group_input_words(weights_format f, index_t K) {
  return group_count(f, K) * (f.group / 4 + 1);
}

/// The rows of a quantised per token (quantise_u8_row's scale and rounding) for the VNNI
/// kernel: row i at out + i * stride: its int8 quads (zero past K), then per group the int32
/// its sum starts at, -z Σ qx (z = 8: int4, 128: int8_group, 12: mxfp4 as W4A8), or for
/// int4_asym Σ qx as fp32 bits; its scale at scales[i].
inline void quantise_group_rows(matrix_view<const float> a, weights_format f, std::uint32_t* out,
                                index_t stride, float* scales, int8_kernel kernel) {
  const index_t G = group_count(f, a.cols), per = f.group / 4, words = G * per;
  const std::int32_t z = f.id == wkind::int4         ? 8
                         : f.id == wkind::int8_group ? 128
                         : f.id == wkind::mxfp4      ? 12  // (host_mxfp4_vnni.hpp's 2 e2m1 + 12)
                                                     : 0;
  for (index_t i = 0; i < a.rows; ++i) {
    std::uint32_t* o = out + i * stride;
    quantise_u8_rows(a.rows_slice(i, 1), o, words, scales + i, kernel);
    for (index_t t = 0; t < G; ++t) {
      std::int32_t sum = 0;
      for (index_t w = t * per; w < (t + 1) * per; ++w) {
        o[w] ^= 0x80808080u;  // u8 = q + 128 back to q
        for (int b = 0; b < 4; ++b) sum += static_cast<std::int8_t>(o[w] >> (8 * b));
      }
      o[words + t] = f.id == wkind::int4_asym ? std::bit_cast<std::uint32_t>(float(sum))
                                              : static_cast<std::uint32_t>(-z * sum);
    }
  }
}

namespace detail {

// One group's block of a panel: its quads, scales and offsets (int4_asym; else nullptr).
struct group_block {
  const std::byte* quads;
  const float* scale;
  const float* offset;
};
inline group_block group_at(const std::byte* panel, weights_format f, index_t t) {
  const std::byte* b = panel + t * group_block_bytes(f);
  const auto* s = reinterpret_cast<const float*>(b + f.group / 4 * group_quad_bytes(f));
  return {b, s, f.id == wkind::int4_asym ? s + 32 : nullptr};
}

// Input k (within its group's block) of column j: q as the format stores it (unsigned u for
// int4: minus 8 here).
inline int group_q(const std::byte* quads, weights_format f, index_t k, index_t j) {
  if (f.id == wkind::int8_group)
    return static_cast<std::int8_t>(quads[k / 4 * 128 + 4 * j + k % 4]);
  const auto byte = static_cast<unsigned>(quads[k / 4 * 64 + 4 * (j % 16) + k % 4]);
  const int u = static_cast<int>(j < 16 ? byte & 15u : byte >> 4);
  return f.id == wkind::int4 ? u - 8 : u;
}

// The weight (k, j) of a panel in fp32: fma(scale, q, offset), one rounding of s q + m.
inline float group_weight(const std::byte* panel, weights_format f, index_t k, index_t j) {
  const group_block b = group_at(panel, f, k / f.group);
  return std::fma(b.scale[j], static_cast<float>(group_q(b.quads, f, k % f.group, j)),
                  b.offset ? b.offset[j] : 0.f);
}

// Packs rows [j0, j0 + cols) of b (fp32, quantised here) or of q (pre-quantised, with scales
// and offsets [N, G], offsets only for int4_asym) into one panel; zero past K and past cols.
inline void pack_group_panel(std::byte* out, weights_format f, index_t K, index_t cols, index_t j0,
                             matrix_view<const float> b, matrix_view<const std::int8_t> q,
                             const float* scales, const float* offsets) {
  const index_t G = group_count(f, K), g = f.group;
  std::fill_n(out, group_panel_bytes(f, K), std::byte{0});
  for (index_t j = 0; j < cols; ++j)
    for (index_t t = 0; t < G; ++t) {
      std::byte* quads = out + t * group_block_bytes(f);
      auto* sm = reinterpret_cast<float*>(quads + g / 4 * group_quad_bytes(f));
      const auto put = [&](index_t k, std::int8_t v) {  // k within the group
        if (f.id == wkind::int8_group) {
          quads[k / 4 * 128 + 4 * j + k % 4] = static_cast<std::byte>(v);
        } else {
          const auto u = static_cast<unsigned>(f.id == wkind::int4 ? v + 8 : v);
          std::byte& at = quads[k / 4 * 64 + 4 * (j % 16) + k % 4];
          at |= static_cast<std::byte>(j < 16 ? u : u << 4);
        }
      };
      const index_t k0 = t * g, n = std::min(g, K - k0);
      std::pair<float, float> sm_j;
      if (b.data) {
        sm_j = quantise_group(f, b.row(j0 + j) + k0, n, j0 + j, t, put);
      } else {
        for (index_t k = 0; k < n; ++k) put(k, q(j0 + j, k0 + k));
        sm_j = {scales[(j0 + j) * G + t], offsets ? offsets[(j0 + j) * G + t] : 0.f};
      }
      sm[j] = sm_j.first;
      if (f.id == wkind::int4_asym) sm[32 + j] = sm_j.second;
    }
}

// c rows [0, m) x columns [0, cols) of one panel, portable W4A16 / W8A16: each weight
// dequantised (group_weight), fp32 sums of x w in input order.
inline void group_panel_portable(matrix_view<const float> a, const std::byte* panel,
                                 weights_format f, index_t K, float* c, index_t ldc, index_t cols) {
  constexpr index_t W = panel_width;
  for (index_t i = 0; i < a.rows; ++i) {
    float acc[W] = {};
    const float* x = a.row(i);
    for (index_t k = 0; k < K; ++k)
      for (index_t j = 0; j < W; ++j) acc[j] += x[k] * group_weight(panel, f, k, j);
    for (index_t j = 0; j < cols; ++j) c[i * ldc + j] = acc[j];
  }
}

}  // namespace detail

}  // namespace epmoe::space

#include "epmoe/space/host_int4_kernels.hpp"
