// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include <cstdint>
#include <cstring>

#include "epmoe/core/macros.hpp"
#include "epmoe/core/numeric.hpp"
#include "epmoe/core/view.hpp"

// 8-bit rows on the wire (layer_config::dispatch_rows = row_format::int8; docs/wire.md):
// a dispatch row is one fp32 scale (bytes [0, 4)) and the token's H values as int8 (bytes
// [4, 4 + H)), rows 16 bytes apart at least. A token is quantised once at the sender (its
// copies to every destination are bytes), and dequantised into the experts' input rows on
// receipt. Written once as EPMOE_HD functors, so every space runs the same arithmetic.
namespace epmoe {

/// The bytes of one 8-bit row of H values.
struct wire_row {
  static constexpr index_t scale_bytes = 4;
  /// What crosses the link per row (the scale and the values).
  static constexpr index_t bytes(index_t hidden) { return scale_bytes + hidden; }
  /// Between two rows of a wire buffer: rounded up to 16 bytes (aligned scales and vectors).
  static constexpr index_t stride(index_t hidden) { return (bytes(hidden) + 15) / 16 * 16; }
};

namespace wire_ops {

/// Nearest integer, ties to even, for |v| < 2^22: adding 1.5 · 2^23 leaves no fraction bits,
/// so the sum is rounded as the FPU rounds (to nearest even); exact, branch-free, vectorises
/// (std::nearbyint is a libm call per value without SSE4.1). Needs IEEE sums: no -ffast-math.
EPMOE_HD float round_half_even(float v) {
  constexpr float magic = 12582912.f;  // 1.5 * 2^23
  return (v + magic) - magic;
}

EPMOE_HD float scale_of(const std::uint8_t* row) {
  float s;
  std::memcpy(&s, row, sizeof s);
  return s;
}
EPMOE_HD const std::int8_t* values_of(const std::uint8_t* row) {
  return reinterpret_cast<const std::int8_t*>(row + wire_row::scale_bytes);
}

/// One row of H values to its wire row: scale = max |x| / 127, q = round-half-even(x · (127 /
/// max |x|)) (fp32 product: the W8A8 kernel's own token quantisation, space/host_int8.hpp)
/// in [-127, 127]. A zero row, or one whose max is below 127 / FLT_MAX (no fp32 inverse),
/// gets scale 0 and q 0; a row holding NaN or ±Inf gets scale NaN and q 0: it arrives NaN.
template <class T>
EPMOE_HD void quantise_row(const T* x, index_t H, std::uint8_t* out) {
  // max |x| on the bits: |x| orders as its bits do, NaN and ±Inf above every finite value;
  // an integer max vectorises (a float one does not without -ffast-math) and never branches.
  std::uint32_t top = 0;
  for (index_t h = 0; h < H; ++h) {
    const float v = to_float(x[h]);
    std::uint32_t b;
    std::memcpy(&b, &v, sizeof b);
    b &= 0x7fffffffu;
    top = b > top ? b : top;
  }
  const bool bad = top >= 0x7f800000u;  // NaN or ±Inf
  float amax;
  std::memcpy(&amax, &top, sizeof amax);
  const float inv = amax > 0.f ? 127.f / amax : 0.f;
  const bool usable = !bad && inv <= 3.40282347e38f;
  auto* q = reinterpret_cast<std::int8_t*>(out + wire_row::scale_bytes);
  for (index_t h = 0; h < H; ++h) {
    float r = usable ? round_half_even(to_float(x[h]) * inv) : 0.f;
    r = r > 127.f ? 127.f : r < -127.f ? -127.f : r;
    q[h] = static_cast<std::int8_t>(static_cast<int>(r));
  }
  std::uint32_t bits = 0x7fc00000u;  // a quiet NaN: every value of the row becomes NaN
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  if (!bad) scale = usable ? amax / 127.f : 0.f;
  std::memcpy(out, &scale, sizeof scale);
}

/// Values [h0, h1) of a wire row, dequantised: scale · q (one fp32 product each).
template <class T>
EPMOE_HD void dequantise_row(const std::uint8_t* row, T* out, index_t h0, index_t h1) {
  const float s = scale_of(row);
  const std::int8_t* q = values_of(row);
  for (index_t h = h0; h < h1; ++h) out[h] = from_float<T>(s * static_cast<float>(q[h]));
}

/// Token t's wire row from x row t (once per token, before any copy).
template <class T>
struct quantise_rows {
  matrix_view<const T> x;         // [T, H]
  matrix_view<std::uint8_t> out;  // [T, wire stride]
  EPMOE_HD void operator()(index_t t) const { quantise_row(x.row(t), x.cols, out.row(t)); }
};

/// Weighted inputs (weighting::input): send row slot[t, k] = token t's wire row with its scale
/// times weight[t, k] (symmetric rounding scales with the row: the same q encode w · x).
struct scatter_scaled {
  matrix_view<const std::uint8_t> q;  // [T, wire stride]: the tokens' wire rows
  const std::int32_t* slot;           // [T*K]
  matrix_view<const float> weights;   // [T, K]
  matrix_view<std::uint8_t> out;      // [send rows, wire stride]
  index_t bytes;                      // of a row: wire_row::bytes(H)
  EPMOE_HD void operator()(index_t t) const {
    for (index_t k = 0; k < weights.cols; ++k) {
      const std::int32_t s = slot[t * weights.cols + k];
      if (s < 0) continue;
      std::uint8_t* o = out.row(s);
      std::memcpy(o, q.row(t), static_cast<std::size_t>(bytes));
      const float scaled = scale_of(o) * weights(t, k);
      std::memcpy(o, &scaled, sizeof scaled);
    }
  }
};

/// Blocks [b0, b0 + n) of wire rows -> value rows, dequantised: block b's count[b] rows from
/// src row src_at[b] to dst row dst_at[b]. Row i of the run is src row first + i; the blocks'
/// rows follow one another in src (src_at[b] + count[b] == src_at[b + 1] where rows follow),
/// so its block is the first whose rows end past it.
template <class T>
struct dequantise_blocks {
  matrix_view<const std::uint8_t> src;
  const index_t* src_at;
  const index_t* count;
  const index_t* dst_at;
  index_t b0, n, first;
  matrix_view<T> dst;
  EPMOE_HD void operator()(index_t i, index_t h0, index_t h1) const {
    const index_t row = first + i;
    index_t lo = b0, hi = b0 + n - 1;
    while (lo < hi) {
      const index_t mid = lo + (hi - lo) / 2;
      if (src_at[mid] + count[mid] <= row)
        lo = mid + 1;
      else
        hi = mid;
    }
    dequantise_row(src.row(row), dst.row(dst_at[lo] + (row - src_at[lo])), h0, h1);
  }
};

/// Dedup: each received assignment's expert-major row <- its unique wire row, dequantised.
template <class T>
struct expand_dequantise {
  const std::int32_t* key;
  const index_t* expert_row;
  matrix_view<const std::uint8_t> unique;  // the chunk's unique wire rows
  matrix_view<T> expert;
  EPMOE_HD void operator()(index_t i, index_t h0, index_t h1) const {
    dequantise_row(unique.row(key[i]), expert.row(expert_row[i]), h0, h1);
  }
};

}  // namespace wire_ops
}  // namespace epmoe
