// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include <concepts>
#include <cstdint>
#include <string>

#include "epmoe/core/concepts.hpp"

// The layer's checks of its policy slots, one static_assert per member the layer calls, so a
// policy that lacks one fails to compile with a message naming that member and where to look
// (the concepts in core/concepts.hpp state the same contracts as a whole). Each returns true,
// for use as static_assert(checks::router<R>()).
namespace epmoe::checks {

namespace detail {
// The slot's type where it exists, else a stand-in, so a missing one fails its own check
// (with its message) and not a lookup before it.
template <class S>
struct value_of {
  using type = float;
};
template <class S>
requires requires { typename S::value_type; }
struct value_of<S> {
  using type = typename S::value_type;
};
struct no_weights {};
template <class X, class T>
struct weights_of {
  using type = no_weights;
};
template <class X, class T>
requires requires { typename X::template weights_of<T>; }
struct weights_of<X, T> {
  using type = typename X::template weights_of<T>;
};
using epmoe::detail::element_functor;
using epmoe::detail::row_functor;
}  // namespace detail

template <class S>
constexpr bool space() {
  using T = typename detail::value_of<S>::type;
  static_assert(
      requires { typename S::value_type; },
      "epmoe: the space policy needs `using value_type` (the element type of rows and "
      "weights; see space/host.hpp)");
  static_assert(std::copyable<S>, "epmoe: the space policy must be copyable (a small handle)");
  static_assert(
      requires(const S& s, index_t n) {
        { s.template allocate<float>(n).data() } -> std::same_as<float*>;
      },
      "epmoe: the space policy needs allocate<T>(n) returning a buffer with data()");
  static_assert(
      requires(const S& s, index_t n) {
        { s.template allocate_mirror<index_t>(n).host() } -> std::same_as<index_t*>;
        { s.template allocate_mirror<index_t>(n).device() } -> std::same_as<index_t*>;
        s.to_host(s.template allocate_mirror<index_t>(n), n, n);
        s.to_device(s.template allocate_mirror<index_t>(n), n, n);
      },
      "epmoe: the space policy needs allocate_mirror<T>(n) (host() and device() arrays) and "
      "to_host(mirror, first, n) / to_device(mirror, first, n)");
  static_assert(
      requires(const S& s, index_t n, const index_t* c) {
        s.for_each(n, detail::element_functor{});
        s.for_each_row(n, n, detail::row_functor{});
        s.for_each_row_n(c, n, n, detail::row_functor{});
      },
      "epmoe: the space policy needs for_each(n, f), for_each_row(n, width, f) and "
      "for_each_row_n(count, max_n, width, f): the loops that run the layer's functors");
  static_assert(
      requires(const S& s, index_t n, std::int32_t* p) { s.fill(p, n, std::int32_t{}); },
      "epmoe: the space policy needs fill(pointer, n, value)");
  static_assert(
      requires(const S& s, index_t n, index_t* pn, const index_t* cn, const std::int32_t* ci,
               std::int32_t* pi, void* scratch) {
        s.count(ci, n, n, pn);
        s.exclusive_scan(cn, pn, n);
        s.sort_by_key(ci, n, n, pi, pi, scratch);
        { S::sort_scratch_bytes(n, n) } -> std::convertible_to<index_t>;
      },
      "epmoe: the space policy needs the plan's primitives count(keys, n, bins, out), "
      "exclusive_scan(in, out, n), sort_by_key(keys, n, bins, sorted, order, scratch) and "
      "static sort_scratch_bytes(n, bins)");
  static_assert(
      requires(const S& s, index_t n, const index_t* c) {
        s.copy_blocks(matrix_view<const T>{}, matrix_view<T>{}, n, c, c, c);
      },
      "epmoe: the space policy needs copy_blocks(src, dst, n, src_offsets, dst_offsets, counts)");
  static_assert(
      requires(const S& s) {
        s.gemm_nt(matrix_view<const T>{}, matrix_view<const T>{}, matrix_view<float>{});
      },
      "epmoe: the space policy needs gemm_nt(a, b, c): c [M, N] (float) = a [M, K] b [N, K]^T");
  static_assert(
      requires(const S& s) {
        s.grouped_gemm_nt(grouped_rows<const T>{}, stacked_view<const T>{}, grouped_rows<T>{});
      },
      "epmoe: the space policy needs grouped_gemm_nt(a, b, c): per group g, c's rows of g = a's "
      "rows of g x b[g]^T");
  static_assert(
      requires(const S& s, index_t n, typename S::clock& c) {
        { s.make_clock(n) } -> std::same_as<typename S::clock>;
        c.begin_pass();
        { c.seconds(c.now()) } -> std::convertible_to<double>;
      },
      "epmoe: the space policy needs a `clock` type (begin_pass(), now() -> mark, seconds(mark)) "
      "and make_clock(marks)");
  static_assert(
      requires(const S& s, index_t n) {
        s.reserve(int{}, int{}, n);
        s.enter();
        s.leave();
        s.synchronize();
      },
      "epmoe: the space policy needs reserve(calls, groups, n), enter(), leave() and "
      "synchronize()");
  return true;
}

template <class R>
constexpr bool router() {
  static_assert(
      requires {
        { R::top_k } -> std::convertible_to<int>;
      },
      "epmoe: the router policy needs `static constexpr int top_k` (experts per token; "
      "0 for a variable count; see router/topk_softmax.hpp)");
  static_assert(
      requires {
        { R::uses_gate } -> std::convertible_to<bool>;
      },
      "epmoe: the router policy needs `static constexpr bool uses_gate` (whether it "
      "routes from logits = x gate^T)");
  static_assert(token_router<R> || batch_router<R>,
                "epmoe: the router policy needs route_token(const token_input&, int* ids, float* "
                "weights) const (per token, EPMOE_HD; see router/topk_softmax.hpp) or "
                "route_batch(cfg, logits, out, floats, ints) with static scratch_floats(cfg) and "
                "scratch_ints(cfg) (see router/expert_choice.hpp)");
  static_assert(std::semiregular<R>,
                "epmoe: the router policy must be default-constructible and copyable");
  return true;
}

template <class P>
constexpr bool placement() {
  static_assert(std::constructible_from<P, const layer_config&>,
                "epmoe: the placement policy needs a constructor from const layer_config& (see "
                "placement/block.hpp)");
  static_assert(
      requires(const P& p) {
        { p.slots_per_rank() } -> std::convertible_to<int>;
      },
      "epmoe: the placement policy needs slots_per_rank() (physical slots per rank)");
  static_assert(
      requires(const P& p, int r, int j) {
        { p.expert_at(r, j) } -> std::convertible_to<int>;
      },
      "epmoe: the placement policy needs expert_at(rank, slot) (the expert it serves)");
  static_assert(
      requires(const P& p, int e, int r, std::uint64_t t) {
        { p.slot_for(e, r, t) } -> std::convertible_to<int>;
      },
      "epmoe: the placement policy needs slot_for(expert, home rank, token id) (EPMOE_HD: the "
      "copy a token's row goes to)");
  return true;
}

template <class C>
constexpr bool capacity() {
  static_assert(
      requires {
        { C::pads } -> std::convertible_to<bool>;
      },
      "epmoe: the capacity policy needs `static constexpr bool pads` (blocks padded to "
      "the limit: static shapes; see capacity/factor.hpp)");
  static_assert(
      requires(const C& c, const layer_config& cfg, index_t n) {
        { c.limit(cfg, n) } -> std::convertible_to<index_t>;
      },
      "epmoe: the capacity policy needs limit(const layer_config&, index_t tokens) const (rows "
      "per expert copy per source rank)");
  static_assert(std::semiregular<C>,
                "epmoe: the capacity policy must be default-constructible and copyable");
  return true;
}

template <class C>
constexpr bool comm() {
  static_assert(std::movable<C>, "epmoe: the comm policy must be movable");
  static_assert(
      requires(const C& c) {
        { c.rank() } -> std::convertible_to<int>;
        { c.size() } -> std::convertible_to<int>;
      },
      "epmoe: the comm policy needs rank() and size() (see comm/local.hpp)");
  static_assert(
      requires(C & c, const index_t* s, index_t* r, const std::int64_t* sl, std::int64_t* rl,
               index_t n) {
        c.alltoall(s, r, n);
        c.alltoall(sl, rl, n);
      },
      "epmoe: the comm policy needs alltoall(send, recv, n) for index_t and int64 host arrays "
      "(counts, the start-up agreement)");
  return true;
}

template <class X, class S>
constexpr bool expert() {
  using T = typename detail::value_of<S>::type;
  static_assert(
      requires { typename X::template weights_of<T>; },
      "epmoe: the expert policy needs `template <class T> struct weights_of` (its "
      "weight views for element type T; see expert/swiglu.hpp)");
  using W = typename detail::weights_of<X, T>::type;
  static_assert(
      requires(const W& w) { X::validate(w, index_t{}, index_t{}, index_t{}, std::string{}); },
      "epmoe: the expert policy needs static validate(weights, count, hidden, ffn, "
      "name) (throws config_error naming the tensor)");
  static_assert(
      requires(W & w) { X::tensors(w); },
      "epmoe: the expert policy needs static tensors(weights&) (pointers to its stacked "
      "views: live re-placement moves each)");
  static_assert(
      requires(const W& w) { X::slice(w, index_t{}, index_t{}); },
      "epmoe: the expert policy needs static slice(weights, first, n) (experts "
      "[first, first + n): one shared expert)");
  static_assert(
      requires {
        { X::flops_per_row(index_t{}, index_t{}) } -> std::convertible_to<double>;
        { X::scratch_per_row(index_t{}) } -> std::convertible_to<index_t>;
      },
      "epmoe: the expert policy needs static flops_per_row(hidden, ffn) and "
      "scratch_per_row(ffn)");
  static_assert(
      requires(const S& s, const W& w, grouped_rows<T> x, T* scratch) {
        X::forward(s, w, x, scratch);
      },
      "epmoe: the expert policy needs static forward(space, weights, grouped_rows x, scratch) "
      "(every local expert on its group of rows, output over x)");
  return true;
}

template <class Sch>
constexpr bool schedule() {
  static_assert(schedule_policy<Sch>,
                "epmoe: the schedule policy needs static run(stages&) calling route, plan, "
                "permute, shared, counts, then per unit dispatch_start/wait, experts, "
                "combine_start/wait, then reduce (see schedule/sequential.hpp)");
  return true;
}

/// What a layer's backward calls of its space, expert and router.
template <class S, class X, class R>
constexpr bool trains() {
  static_assert(training_space<S> && std::same_as<typename S::value_type, float>,
                "epmoe: moe_layer::backward needs a float space with the backward GEMMs "
                "(space::host, space::cuda<float>)");
  static_assert(
      requires { X::backward_scratch_per_row(index_t{}); },
      "epmoe: this expert policy has no backward: moe_layer::backward needs Expert::backward "
      "and Expert::backward_scratch_per_row (expert/swiglu.hpp)");
  static_assert(!R::uses_gate || router_with_backward<R>,
                "epmoe: this router has no backward yet: moe_layer::backward needs "
                "router.backward_token(in, ids, g, dlogits) (docs/training.md lists the routers "
                "that have one)");
  return true;
}

}  // namespace epmoe::checks
