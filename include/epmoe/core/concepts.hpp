// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include <concepts>
#include <cstdint>
#include <span>
#include <string>

#include "epmoe/core/config.hpp"
#include "epmoe/core/routing.hpp"
#include "epmoe/core/view.hpp"

// One concept per policy slot. moe_layer checks each slot with a static_assert whose message
// says what to provide, so a wrong policy fails with one readable line.
namespace epmoe {

/// A space whose memory is on a device (space::cuda): host code reaches it only through
/// mirrors and the space's copies.
template <class S>
concept device_space = requires {
  requires S::device;
};

namespace detail {
// Stand-ins for what the layer hands a space's loops.
struct element_functor {
  void operator()(index_t) const {}
};
struct row_functor {
  void operator()(index_t, index_t, index_t) const {}
};
}  // namespace detail

/// Where memory lives and kernels run: exactly what the layer and its stages call of a
/// space (see space/host.hpp): buffers and host mirrors, loops over elements and rows, the
/// plan's count / scan / stable sort, block copies, GEMMs (the gate's, and the experts'
/// grouped), a stage clock, and ordering with the caller.
template <class S>
concept space_policy = std::copyable<S> && requires {
  typename S::value_type;
  typename S::clock;
} && requires(const S& s, index_t n, index_t* pn, const index_t* cn, std::int32_t* pi,
              const std::int32_t* ci, void* scratch, typename S::clock& c) {
  { s.template allocate<float>(n).data() } -> std::same_as<float*>;
  { s.template allocate_mirror<index_t>(n).host() } -> std::same_as<index_t*>;
  { s.template allocate_mirror<index_t>(n).device() } -> std::same_as<index_t*>;
  s.to_host(s.template allocate_mirror<index_t>(n), n, n);
  s.to_device(s.template allocate_mirror<index_t>(n), n, n);
  s.for_each(n, detail::element_functor{});
  s.for_each_row(n, n, detail::row_functor{});
  s.for_each_row_n(cn, n, n, detail::row_functor{});
  s.fill(pi, n, std::int32_t{});
  s.count(ci, n, n, pn);
  s.exclusive_scan(cn, pn, n);
  s.sort_by_key(ci, n, n, pi, pi, scratch);
  { S::sort_scratch_bytes(n, n) } -> std::convertible_to<index_t>;
  s.copy_blocks(matrix_view<const typename S::value_type>{}, matrix_view<typename S::value_type>{},
                n, cn, cn, cn);
  s.gemm_nt(matrix_view<const typename S::value_type>{},
            matrix_view<const typename S::value_type>{}, matrix_view<float>{});
  s.grouped_gemm_nt(grouped_rows<const typename S::value_type>{},
                    stacked_view<const typename S::value_type>{},
                    grouped_rows<typename S::value_type>{});
  { s.make_clock(n) } -> std::same_as<typename S::clock>;
  s.reserve(int{}, int{}, n);
  c.begin_pass();
  { c.seconds(c.now()) } -> std::convertible_to<double>;
  s.enter();
  s.leave();
  s.synchronize();
};

/// A space that can run the expert backward (docs/training.md): beyond space_policy, the
/// grouped GEMMs of the backward, dX = dY W (grouped_gemm_nn) and dW = dYᵀ X summed over each
/// group's rows (grouped_gemm_tn_accumulate). Only a training pass requires it.
template <class S>
concept training_space = space_policy<S> && requires(const S& s) {
  s.grouped_gemm_nn(grouped_rows<const typename S::value_type>{},
                    stacked_view<const typename S::value_type>{},
                    grouped_rows<typename S::value_type>{}, bool{});
  s.grouped_gemm_tn_accumulate(grouped_rows<const typename S::value_type>{},
                               grouped_rows<const typename S::value_type>{}, stacked_view<float>{},
                               bool{});
};

/// A router that decides per token, from that token alone (host+device code).
template <class R>
concept token_router = requires(const R& r, const token_input& in, int* ids, float* weights) {
  r.route_token(in, ids, weights);
};

/// A router that decides over the whole local batch (expert choice, Sinkhorn), with scratch
/// the layer sizes once.
template <class R>
concept batch_router = requires(const R& r, const layer_config& cfg,
                                matrix_view<const float> logits, mutable_routing_view out,
                                std::span<float> fs, std::span<std::int32_t> is) {
  r.route_batch(cfg, logits, out, fs, is);
  { R::scratch_floats(cfg) } -> std::convertible_to<index_t>;
  { R::scratch_ints(cfg) } -> std::convertible_to<index_t>;
};

/// Picks experts and weights for each token. top_k > 0: exactly top_k per token (must equal
/// config top_k); 0: a variable number, up to E (expert choice).
template <class R>
concept router_policy = std::semiregular<R> && requires {
  { R::top_k } -> std::convertible_to<int>;
  { R::uses_gate } -> std::convertible_to<bool>;
} &&(token_router<R> || batch_router<R>);

// Optional router features, each a static flag the router may declare.
template <class R>
concept router_with_bias = requires {
  requires R::has_bias;
};
template <class R>
concept router_needs_token_ids = requires {
  requires R::needs_token_ids;
};
/// A router that reads a table the layer copies (router::table: [vocab, K] expert ids).
template <class R>
concept router_with_table = requires {
  requires R::has_table;
};
template <class R>
concept router_with_noise_gate = requires {
  requires R::uses_noise_gate;
};
/// A learned bias on the gate's logits (weights.gate_bias, grads.gate_bias: router::logit_bias).
template <class R>
concept router_with_gate_bias = requires {
  requires R::uses_gate_bias;
};
template <class R>
concept router_with_jitter = requires {
  requires R::jitters_input;
};
/// A router the layer trains through: the backward of route_token for one token, its choice
/// held fixed (docs/training.md).
template <class R>
concept router_with_backward = requires(const R& r, const token_input& in, const int* ids,
                                        const float* g, float* dl) {
  r.backward_token(in, ids, g, dl);
}
|| requires(const R& r, const token_input& in, const int* ids, const float* g, float* dl) {
  r.backward_token(in, ids, g, dl, dl);  // with a noise gate: dL/d(noise logits) too
};
template <class R>
concept router_with_validate = requires(const R& r, const layer_config& cfg) {
  r.validate(cfg);
};

/// Which rank holds which expert: every rank holds slots_per_rank() physical slots, slot j of
/// rank r serving logical expert expert_at(r, j); slot_for picks the copy (global slot
/// r * slots_per_rank() + j) that serves expert e for a token of rank `home`.
template <class P>
concept placement_policy = std::constructible_from<P, const layer_config&> &&
    requires(const P& p, int e, int r, int j, std::uint64_t token) {
  { p.slots_per_rank() } -> std::convertible_to<int>;
  { p.expert_at(r, j) } -> std::convertible_to<int>;
  { p.slot_for(e, r, token) } -> std::convertible_to<int>;
};

template <class P>
concept placement_with_validate = requires(const P& p, const layer_config& cfg) {
  p.validate(cfg);
};

/// Per-expert, per-source-rank row limit and whether buffers are padded to it.
template <class C>
concept capacity_policy = std::semiregular<C> &&
    requires(const C& c, const layer_config& cfg, index_t tokens) {
  { C::pads } -> std::convertible_to<bool>;
  { c.limit(cfg, tokens) } -> std::convertible_to<index_t>;
};

/// What the layer calls of a comm itself: rank/size and a fixed-size all-to-all of host
/// arrays (counts, the start-up agreement, the router's load). Rows move through
/// transport<Comm, Space> (core/transport.hpp), which for host memory needs host_communicator.
template <class C>
concept communicator = std::movable<C> &&
    requires(C& c, const index_t* si, index_t* ri, const std::int64_t* sl, std::int64_t* rl,
             index_t n) {
  { c.rank() } -> std::convertible_to<int>;
  { c.size() } -> std::convertible_to<int>;
  c.alltoall(si, ri, n);
  c.alltoall(sl, rl, n);
};

/// A comm that moves rows in host memory: an all-to-all-v (counts and displacements in
/// elements) of every element type the layer exchanges (float rows, int64 dedup metadata).
template <class C>
concept host_communicator = communicator<C> &&
    requires(C& c, const index_t* si, const float* sf, float* rf, const std::int64_t* sl,
             std::int64_t* rl) {
  c.alltoallv(sf, si, si, rf, si, si);
  c.alltoallv(sl, si, si, rl, si, si);
};

/// The expert FFN on a space: its weight bundle per element type, shape checks, the tensors
/// it holds (live re-placement moves them), a slice (one shared expert), cost, scratch, and a
/// grouped forward over every local expert's rows.
template <class X, class Space>
concept expert_policy = requires {
  typename X::template weights_of<typename Space::value_type>;
}
&&requires(const Space& space, typename X::template weights_of<typename Space::value_type>& w,
           grouped_rows<typename Space::value_type> rows, typename Space::value_type* scratch) {
  X::validate(w, index_t{}, index_t{}, index_t{}, std::string{});
  X::tensors(w);
  X::slice(w, index_t{}, index_t{});
  { X::flops_per_row(index_t{}, index_t{}) } -> std::convertible_to<double>;
  { X::scratch_per_row(index_t{}) } -> std::convertible_to<index_t>;
  X::forward(space, w, rows, scratch);
};

namespace detail {
/// The stages a schedule drives; moe_layer hands the schedule an object of this shape.
struct stages_archetype {
  int chunks() const { return 1; }
  void route() {}
  void plan() {}
  void permute() {}
  void shared() {}
  void counts() {}
  void dispatch_start(int) {}
  void dispatch_wait(int) {}
  void experts(int) {}
  void combine_start(int) {}
  void combine_wait(int) {}
  void reduce() {}
};
}  // namespace detail

/// Exchange units a schedule keeps in flight (the receive buffer holds this many rounds under
/// config max_recv_rows): its `static constexpr int units_in_flight`, else 3 (dispatch of
/// i+1, experts of i, combine of i-1).
template <class S>
constexpr int units_in_flight_of() {
  if constexpr (requires { S::units_in_flight; })
    return static_cast<int>(S::units_in_flight);
  else
    return 3;
}

/// Orders (and may overlap) the stages of one pass.
template <class S>
concept schedule_policy = requires(detail::stages_archetype& st) {
  S::run(st);
};

}  // namespace epmoe
