// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include <algorithm>
#include <array>
#include <cstddef>
#include <span>
#include <tuple>
#include <utility>
#include <vector>

#include "epmoe/core/error.hpp"
#include "epmoe/core/options.hpp"
#include "epmoe/core/view.hpp"
#include "epmoe/space/host_packed_weights.hpp"

namespace epmoe {

/// The weights one rank holds (non-owning views in the space's memory; they must outlive the
/// layer): moe_layer<P>::weights.
template <class T, class ExpertWeights>
struct layer_weights {
  matrix_view<const T> gate;           // [E, H] router gate, the same on every rank
  ExpertWeights experts;               // this rank's slots, local-slot order
  ExpertWeights shared{};              // [N] shared experts (config shared_experts)
  matrix_view<const T> noise_gate{};   // [E, H] noisy top-k's noise projection
  matrix_view<const T> shared_gate{};  // [N, H] (config shared_gate)
  matrix_view<const T> output_bias{};  // [1, H] (config output_bias)
  matrix_view<const T> gate_bias{};    // [1, E] the gate's logit bias (router::logit_bias)
};

namespace detail {
/// The packed copies a layer keeps for its space (space::host's packed_weights), or nothing.
template <class S>
struct packed_store_of {
  struct type {
    bool empty() const { return true; }
  };
};
template <class S>
requires requires { typename S::packed_store; }
struct packed_store_of<S> {
  using type = typename S::packed_store;
};
}  // namespace detail

}  // namespace epmoe

namespace epmoe::parts {

/// Everything a layer reads its expert weights from, in one object: the caller's views, the
/// packed copies in the space's own layout (pack), and the copies the layer owns after a live
/// re-placement (relocate). The space receives the packed copies per call (with_space), so no
/// space holds a pointer into this store, and a layer built from another (exclude_ranks)
/// copies what the other owns (own_experts) instead of pointing into it.
template <class Space, class Expert>
class weights_store {
 public:
  using value_type = typename Space::value_type;
  using expert_weights = typename Expert::template weights_of<value_type>;
  using weights = layer_weights<value_type, expert_weights>;
  static constexpr bool packs = requires { typename Space::packed_store; };

  explicit weights_store(const weights& w, packed_precision as = packed_precision::fp32)
      : w_(w), pack_as_(as) {}

  /// The views a pass reads (the layer's own copies of its experts once it owns them).
  const weights& views() const { return w_; }
  /// Other views of the same shapes (checked by the caller); packed again when packed. A
  /// store of codes only keeps them when the experts' views are the same ones (another gate,
  /// say), else the new views must hold values: it packs them.
  void rebind(const Space& s, const weights& w, index_t input_rows, bool shared) {
    const bool same = same_experts(w.experts, w_.experts) && same_experts(w.shared, w_.shared);
    w_ = w;
    if (codes_ != codes::none && same) return;
    codes_ = codes::none;
    if (packed()) pack(s, pack_as_, input_rows, shared);
  }

  /// Runs f(space) with the space reading the packed copies (a copy of `s` bound to them
  /// for this call: space::host's use_packed), or f(s) when nothing is packed.
  template <class F>
  void with_space(const Space& s, F&& f) const {
    if constexpr (packs) {
      if (!packed_.empty()) {
        Space bound = s;
        bound.use_packed(&packed_);
        f(static_cast<const Space&>(bound));
        return;
      }
    }
    f(s);
  }

  /// Packs the routed (and `shared`) experts in precision `as`, with room for `input_rows`
  /// rows of converted inputs (the AVX512-BF16 path). Repacking the same tensors allocates
  /// nothing.
  void pack(const Space& s, packed_precision as, index_t input_rows, bool shared) {
    require_values("pack_weights");
    pack(s, as, input_rows, shared, [](std::size_t, index_t, auto&) { return false; });
  }
  /// The same, matrix j of tensor t (Expert::tensors order, routed then shared) filled by
  /// load(t, j, m) where it returns true (weights quantised already: moe_layer::pack_weights);
  /// a store of codes only needs every matrix loaded.
  template <class Load>
  void pack(const Space& s, packed_precision as, index_t input_rows, bool shared, Load&& load) {
    if constexpr (packs) {
      std::array<stacked_view<const value_type>, 8> all{};
      std::size_t n = 0;
      for (auto* v : Expert::tensors(w_.experts)) all.at(n++) = *v;
      if (shared)
        for (auto* v : Expert::tensors(w_.shared)) all.at(n++) = *v;
      packed_.pack_only(std::span(all.data(), n), as, [&](std::size_t t, index_t j, auto& m) {
        if (load(t, j, m)) return true;
        detail::require(codes_ == codes::none, "pack_codes",
                        "tensor " + std::to_string(t) + ", slot " + std::to_string(j),
                        "was not loaded: the views of a layer of codes only hold no values, so "
                        "every matrix must be");
        return false;
      });
      packed_.reserve_inputs(input_rows, s.kernel_path());
      if (as == packed_precision::bf16) packed_.reserve_unpacked();
      pack_as_ = as;
    }
  }
  /// Packs every matrix by load(t, j, m) (which must fill each one), after which the views
  /// are never read (they may have no memory behind them: space::unbacked_tensors), and the
  /// store refuses what would read them until rebind binds views that hold values. A load that
  /// throws leaves copies no pass may read, until a load succeeds.
  template <class Load>
  void pack_codes(const Space& s, packed_precision as, index_t input_rows, bool shared,
                  Load&& load) {
    codes_ = codes::loading;
    pack(s, as, input_rows, shared, load);
    codes_ = codes::loaded;
  }
  /// Whether the views hold values (false: codes only, moe_layer::pack_codes).
  bool holds_values() const { return codes_ == codes::none; }
  /// config_error unless the packed copies may be read: a store of codes only whose last
  /// load failed holds some matrices of neither the old nor the new codes.
  void require_readable() const {
    detail::require(codes_ != codes::loading, "pack_codes", "failed",
                    "the last load of codes only threw: load every matrix again before a pass");
  }
  /// config_error naming `what` (which would read the views) when the views hold no values.
  void require_values(const char* what) const {
    detail::require(codes_ == codes::none, what, "codes only",
                    "the layer holds its experts as packed codes only (pack_codes): load codes "
                    "again with pack_codes, or set_weights to views that hold values first");
  }
  packed_precision precision() const { return pack_as_; }
  /// Sizes what the passes read beside the packed copies for `input_rows` rows (after a
  /// copy was refilled: an act-order copy gathers its inputs).
  void reserve_inputs(const Space& s, index_t input_rows) {
    if constexpr (packs) packed_.reserve_inputs(input_rows, s.kernel_path());
  }
  /// The packed copy of matrix j of tensor t (Expert::tensors order, the shared experts'
  /// after the routed ones), or nullptr when there is none.
  auto* packed_matrix(std::size_t t, index_t j) requires packs {
    std::array<stacked_view<const value_type>, 16> all{};
    std::size_t n = 0;
    for (auto* v : Expert::tensors(w_.experts)) all.at(n++) = *v;
    for (auto* v : Expert::tensors(w_.shared)) all.at(n++) = *v;
    auto* m = t < n && j >= 0 && j < all[t].count ? packed_.find(all[t]) : nullptr;
    return m ? m + j : nullptr;
  }
  void unpack() {
    require_values("unpack_weights");
    if constexpr (packs) packed_.clear();
  }
  bool packed() const { return !packed_.empty(); }

  bool owns_experts() const { return !owned_.empty(); }
  /// The store's own contiguous copy of its slots' weights, made from the views now (the
  /// caller's, or another layer's: copied in the space's memory), which it then reads.
  void own_experts(const Space& s) {
    require_values("a copy of the experts (apply_placement, exclude_ranks)");
    auto views = Expert::tensors(w_.experts);
    std::vector<mirror<value_type>> owned;
    std::vector<mirror<index_t>> desc;
    for (stacked_view<const value_type>* v : views) {
      detail::require(v->batch_stride % v->stride == 0, "weights.experts", v->batch_stride,
                      "a live re-placement needs each tensor's batch stride to be a multiple of "
                      "its row stride");
      auto& m =
          owned.emplace_back(s.template allocate_mirror<value_type>(v->count * v->rows * v->cols));
      auto& d = desc.emplace_back(s.template allocate_mirror<index_t>(3 * v->count));
      for (index_t j = 0; j < v->count; ++j) {  // slot j's rows: from, to, how many
        d.host()[j] = j * (v->batch_stride / v->stride);
        d.host()[v->count + j] = j * v->rows;
        d.host()[2 * v->count + j] = v->rows;
      }
      s.to_device(d, 0, d.size());
      const index_t rows_in = (v->count - 1) * (v->batch_stride / v->stride) + v->rows;
      s.copy_blocks({v->data, rows_in, v->cols, v->stride},
                    {m.device(), v->count * v->rows, v->cols}, v->count, d.device(),
                    d.device() + v->count, d.device() + 2 * v->count);
    }
    s.synchronize();
    for (std::size_t k = 0; k < views.size(); ++k) {
      stacked_view<const value_type>& v = *views[k];
      v = {owned[k].device(), v.count, v.rows, v.cols};
    }
    owned_ = std::move(owned);  // (the copies read the old ones: freed only now)
    desc_ = std::move(desc);
  }

  /// A live re-placement: the store's own copy of its slots (made on the first call), staged
  /// through host memory, moved by `move(staged)` (placement::relocate over the comm) and
  /// back; the packed copies follow. Returns what `move` returns.
  template <class Move>
  index_t relocate(const Space& s, Move&& move, index_t input_rows, bool shared) {
    if (owned_.empty()) own_experts(s);
    auto views = Expert::tensors(w_.experts);
    constexpr std::size_t N = std::tuple_size_v<decltype(views)>;
    std::array<stacked_view<value_type>, N> staged;
    for (std::size_t k = 0; k < N; ++k) {
      const stacked_view<const value_type>& v = *views[k];
      s.to_host(owned_[k], 0, owned_[k].size());
      staged[k] = {owned_[k].host(), v.count, v.rows, v.cols};
    }
    s.synchronize();
    const index_t received = move(staged);
    for (auto& m : owned_) s.to_device(m, 0, m.size());
    s.synchronize();
    if (packed()) pack(s, pack_as_, input_rows, shared);  // the slots hold other experts now
    return received;
  }

 private:
  template <class T>
  using mirror = typename Space::template mirror<T>;

  static bool same_experts(expert_weights a, expert_weights b) {
    auto x = Expert::tensors(a), y = Expert::tensors(b);
    for (std::size_t k = 0; k < x.size(); ++k)
      if (x[k]->data != y[k]->data || x[k]->count != y[k]->count || x[k]->rows != y[k]->rows ||
          x[k]->cols != y[k]->cols || x[k]->stride != y[k]->stride ||
          x[k]->batch_stride != y[k]->batch_stride)
        return false;
    return true;
  }

  weights w_;
  [[no_unique_address]] typename epmoe::detail::packed_store_of<Space>::type packed_;
  packed_precision pack_as_ = packed_precision::fp32;
  std::vector<mirror<value_type>> owned_;  // expert weights after a live re-placement
  std::vector<mirror<index_t>> desc_;      // their first copy's block offsets
  enum class codes { none, loading, loaded } codes_ = codes::none;  // none: views hold values
};

}  // namespace epmoe::parts
