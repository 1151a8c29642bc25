// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
#pragma once

// The storage a layer owns when it packs its experts: one packed_nt (host_packed.hpp) per
// matrix of each stacked expert tensor, found again by the tensor it copies.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>
#include <utility>
#include <vector>

#include "epmoe/space/host_packed.hpp"

namespace epmoe::space {

/// Packed copies of stacked weights (an expert tensor [L, N, K]), found again by the tensor
/// they copy: the storage a layer owns when it packs its experts (moe_layer::pack_weights).
/// The copies are of the values at pack() time: weights changed in place need pack() again.
class packed_weights {
 public:
  /// Packs every matrix of w; a tensor held already (same memory and shape) is refilled in
  /// place, without allocating.
  void pack(stacked_view<const float> w, weights_format as = weights_format::fp32) {
    pack(w, as, [](index_t, packed_nt&) { return false; });
  }
  /// The same, matrix j filled by fill(j, m) where it returns true (a loader of weights
  /// quantised already: m.repack_fp8(...) in format `as`, w[j]'s shape), else from w[j].
  template <class Fill>
  void pack(stacked_view<const float> w, weights_format as, Fill&& fill) {
    entry* e = nullptr;
    for (entry& x : entries_)
      if (same(x.source, w)) e = &x;
    if (!e) e = &entries_.emplace_back(entry{w, std::vector<packed_nt>(std::size_t(w.count))});
    for (index_t j = 0; j < w.count; ++j) {
      packed_nt& m = e->mats[std::size_t(j)];
      if (!fill(j, m))
        m.repack(w[j], as);
      else
        epmoe::detail::require(m.precision() == as && m.rows() == w.rows && m.cols() == w.cols,
                               "pack_weights(loaded)", m.precision().name(),
                               "a loaded matrix must have the tensor's shape and the format");
    }
  }
  /// The packed matrices of w (w may be a slice of a packed tensor: experts [j, j + n)), or
  /// nullptr when w is not packed here.
  const packed_nt* find(stacked_view<const float> w) const {
    for (const entry& x : entries_) {
      const stacked_view<const float>& s = x.source;
      if (w.rows != s.rows || w.cols != s.cols || w.stride != s.stride || w.count < 1 ||
          (w.count > 1 && w.batch_stride != s.batch_stride))
        continue;
      const auto at = reinterpret_cast<std::uintptr_t>(w.data);
      const auto base = reinterpret_cast<std::uintptr_t>(s.data);
      if (at < base || (at - base) % sizeof(float)) continue;
      const auto offset = static_cast<index_t>((at - base) / sizeof(float));
      const index_t j = s.batch_stride > 0 ? offset / s.batch_stride : 0;
      if (j * s.batch_stride == offset && j + w.count <= s.count) return &x.mats[std::size_t(j)];
    }
    return nullptr;
  }
  packed_nt* find(stacked_view<const float> w) {
    return const_cast<packed_nt*>(std::as_const(*this).find(w));
  }
  /// Holds exactly the tensors of `all`, packed: those held already are refilled in place,
  /// the others dropped (a layer that rebound its weights).
  void pack_only(std::span<const stacked_view<const float>> all,
                 weights_format as = weights_format::fp32) {
    pack_only(all, as, [](std::size_t, index_t, packed_nt&) { return false; });
  }
  /// The same, matrix j of all[t] filled by fill(t, j, m) where it returns true (as pack's).
  template <class Fill>
  void pack_only(std::span<const stacked_view<const float>> all, weights_format as, Fill&& fill) {
    std::erase_if(entries_, [&](const entry& x) {
      return std::none_of(all.begin(), all.end(), [&](const auto& w) { return same(x.source, w); });
    });
    for (std::size_t t = 0; t < all.size(); ++t)
      pack(all[t], as, [&](index_t j, packed_nt& m) { return fill(t, j, m); });
  }
  void clear() {
    entries_.clear();
    words_ = {};
    scales_ = {};
    unpacked_ = {};
    gathered_ = {};
  }
  bool empty() const { return entries_.empty(); }

  /// Room for `rows` rows of the widest input of the packed tensors converted (bf16 pairs on
  /// AVX512-BF16, u8 quads and their scales for int8 on VNNI: packed_input_words): sized
  /// when the layer packs, so that its passes do not allocate.
  /// Act-order copies (packed_nt::input_order) add room for the rows gathered in order.
  void reserve_inputs(index_t rows, cpu_path path) {
    index_t words = 0, ordered = 0;
    for (const entry& x : entries_) {
      if (!x.mats.empty())
        words = std::max(words, packed_input_words(x.mats[0].precision(), x.source.cols, path));
      for (const packed_nt& m : x.mats)
        if (!m.input_order().empty()) ordered = std::max(ordered, m.cols());
    }
    if (ordered > 0) gathered_inputs(rows * ordered);
    if (words == 0) return;
    input_words(rows, words);
    input_scales(rows);
  }
  /// Room for n floats of inputs gathered in an act-order copy's order (grown when short).
  float* gathered_inputs(index_t n) const {
    if (gathered_.size() < static_cast<std::size_t>(n)) gathered_.resize(std::size_t(n));
    return gathered_.data();
  }
  /// That room for rows x `words` words (grown when it is short: a caller that did not
  /// reserve), and for one scale per row.
  std::uint32_t* input_words(index_t rows, index_t words) const {
    const auto n = static_cast<std::size_t>(rows * words);
    if (words_.size() < n) words_.resize(n);
    return words_.data();
  }
  float* input_scales(index_t rows) const {
    if (scales_.size() < static_cast<std::size_t>(rows)) scales_.resize(std::size_t(rows));
    return scales_.data();
  }
  /// Room for one matrix of the widest packed tensor, unpacked (bf16 copies: the backward's
  /// dX = dY W multiplies by the rounded values the forward used): sized when the layer packs.
  void reserve_unpacked() {
    index_t n = 0;
    for (const entry& x : entries_) n = std::max(n, x.source.rows * x.source.cols);
    if (unpacked_.size() < static_cast<std::size_t>(n))
      unpacked_.resize(static_cast<std::size_t>(n));
  }
  /// m's values as a row-major [N, K] matrix in that room (valid until the next call).
  matrix_view<const float> unpacked(const packed_nt& m) const {
    const auto n = static_cast<std::size_t>(m.rows() * m.cols());
    if (unpacked_.size() < n) unpacked_.resize(n);
    m.unpack(unpacked_.data());
    return {unpacked_.data(), m.rows(), m.cols()};
  }
  /// Bytes of the packed copies (what packing adds to the weights' memory).
  index_t bytes() const {
    index_t n = 0;
    for (const entry& x : entries_)
      for (const packed_nt& m : x.mats) n += m.packed_bytes();
    return n;
  }

 private:
  struct entry {
    stacked_view<const float> source;
    std::vector<packed_nt> mats;
  };
  static bool same(const stacked_view<const float>& a, const stacked_view<const float>& b) {
    return a.data == b.data && a.count == b.count && a.rows == b.rows && a.cols == b.cols &&
           a.stride == b.stride && a.batch_stride == b.batch_stride;
  }
  std::vector<entry> entries_;
  mutable std::vector<std::uint32_t> words_;  // scratch of the pass that reads these copies
  mutable std::vector<float> scales_;         // (u8 quads: a scale per row)
  mutable std::vector<float> unpacked_;       // the same: one bf16 matrix, unpacked
  mutable std::vector<float> gathered_;       // the same: inputs in act order
};

}  // namespace epmoe::space
