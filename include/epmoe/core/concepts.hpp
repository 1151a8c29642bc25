// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include <concepts>

#include "epmoe/core/config.hpp"
#include "epmoe/core/view.hpp"

// One concept per policy slot. moe_layer checks each slot with a static_assert whose message
// says what to provide, so a wrong policy fails with one readable line.
namespace epmoe {

/// Where memory lives and kernels run: workspace allocation, GEMM, element-wise loops.
template <class S>
concept space_policy = std::semiregular<S> && requires(const S& s, index_t n) {
  { s.template allocate<float>(n).data() } -> std::same_as<float*>;
  s.gemm_nt(matrix_view<const float>{}, matrix_view<const float>{}, matrix_view<float>{});
  s.synchronize();
};

/// Picks K experts and weights per token from its gate logits (per-token, host+device).
template <class R>
concept router_policy = std::semiregular<R> &&
    requires(const R& r, const float* logits, int experts, int* ids, float* weights) {
  { R::top_k } -> std::convertible_to<int>;
  { R::uses_gate } -> std::convertible_to<bool>;
  r.route_token(logits, experts, ids, weights);
};

/// Which rank holds which expert, and in which local slot.
template <class P>
concept placement_policy = std::constructible_from<P, const layer_config&> &&
    requires(const P& p, int e, int r, int j) {
  { p.experts_per_rank() } -> std::convertible_to<int>;
  { p.rank_of(e) } -> std::convertible_to<int>;
  { p.local_index(e) } -> std::convertible_to<int>;
  { p.expert_at(r, j) } -> std::convertible_to<int>;
};

/// Per-expert, per-source-rank row limit and whether buffers are padded to it.
template <class C>
concept capacity_policy = std::semiregular<C> &&
    requires(const C& c, const layer_config& cfg, index_t tokens) {
  { C::pads } -> std::convertible_to<bool>;
  { c.limit(cfg, tokens) } -> std::convertible_to<index_t>;
};

/// Moves rows between ranks: rank/size, a fixed-size all-to-all for counts, an all-to-all-v
/// for rows (counts and displacements in elements).
template <class C>
concept communicator = std::movable<C> &&
    requires(C& c, const index_t* si, index_t* ri, const float* sf, float* rf, index_t n) {
  { c.rank() } -> std::convertible_to<int>;
  { c.size() } -> std::convertible_to<int>;
  c.alltoall(si, ri, n);
  c.alltoallv(sf, si, si, rf, si, si);
};

/// The expert FFN: its weight bundle, shape checks, cost, scratch, and a grouped forward.
template <class X>
concept expert_policy = requires {
  typename X::weights;
}
&&requires(const layer_config& cfg, const typename X::weights& w) {
  X::validate(cfg, w);
  { X::flops_per_row(cfg) } -> std::convertible_to<double>;
  { X::scratch_per_row(cfg) } -> std::convertible_to<index_t>;
};

namespace detail {
/// The stages a schedule drives; moe_layer hands the schedule an object of this shape.
struct stages_archetype {
  void route() {}
  void plan() {}
  void permute() {}
  void dispatch() {}
  void experts() {}
  void combine() {}
  void reduce() {}
};
}  // namespace detail

/// Orders (and may overlap) the stages of one pass.
template <class S>
concept schedule_policy = requires(detail::stages_archetype& st) {
  S::run(st);
};

}  // namespace epmoe
