// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
#pragma once

// The smallest policy of each slot: exactly the members the layer calls (core/checks.hpp),
// nothing else. tests/policies/test_stand_ins.cpp runs a layer made of them; each
// tests/compile_fail/missing_*.cpp removes one member (EPMOE_STAND_IN_WITHOUT_...) and must
// fail to compile with the message naming it.
#include <cstdint>
#include <string>

#include <epmoe/moe_layer.hpp>

namespace stand_in {
using epmoe::index_t;
using epmoe::layer_config;
template <class T>
using matrix_view = epmoe::matrix_view<T>;

/// A space that forwards every primitive to a host space it holds.
struct space {
  using value_type = float;
  template <class T>
  using buffer = epmoe::space::host::buffer<T>;
  template <class T>
  using mirror = epmoe::space::host::mirror<T>;
  using clock = epmoe::space::host::clock;
  epmoe::space::host h;

  template <class T>
  buffer<T> allocate(index_t n) const {
    return h.allocate<T>(n);
  }
  template <class T>
  mirror<T> allocate_mirror(index_t n) const {
    return h.allocate_mirror<T>(n);
  }
  template <class T>
  void to_host(const mirror<T>&, index_t, index_t) const {}
  template <class T>
  void to_device(const mirror<T>&, index_t, index_t) const {}
  template <class F>
  void for_each(index_t n, F&& f) const {
    h.for_each(n, f);
  }
#ifndef EPMOE_STAND_IN_WITHOUT_FOR_EACH_ROW
  template <class F>
  void for_each_row(index_t n, index_t w, F&& f) const {
    h.for_each_row(n, w, f);
  }
#endif
  template <class F>
  void for_each_row_n(const index_t* n, index_t max, index_t w, F&& f) const {
    h.for_each_row_n(n, max, w, f);
  }
  template <class T>
  void fill(T* p, index_t n, T v) const {
    h.fill(p, n, v);
  }
  void count(const std::int32_t* k, index_t n, index_t bins, index_t* out) const {
    h.count(k, n, bins, out);
  }
  void exclusive_scan(const index_t* in, index_t* out, index_t n) const {
    h.exclusive_scan(in, out, n);
  }
  void sort_by_key(const std::int32_t* k, index_t n, index_t bins, std::int32_t* sk,
                   std::int32_t* o, void* s) const {
    h.sort_by_key(k, n, bins, sk, o, s);
  }
  static index_t sort_scratch_bytes(index_t n, index_t bins) {
    return epmoe::space::host::sort_scratch_bytes(n, bins);
  }
  void copy_blocks(matrix_view<const float> s, matrix_view<float> d, index_t n, const index_t* a,
                   const index_t* b, const index_t* c) const {
    h.copy_blocks(s, d, n, a, b, c);
  }
  void gemm_nt(matrix_view<const float> a, matrix_view<const float> b, matrix_view<float> c) const {
    h.gemm_nt(a, b, c);
  }
  void grouped_gemm_nt(epmoe::grouped_rows<const float> a, epmoe::stacked_view<const float> b,
                       epmoe::grouped_rows<float> c) const {
    h.grouped_gemm_nt(a, b, c);
  }
  clock make_clock(index_t n) const { return h.make_clock(n); }
  void reserve(int, int, index_t) const {}
  void enter() const {}
  void leave() const {}
  void synchronize() const {}
};

/// Top-1 on the largest logit, weight 1.
struct router {
#ifndef EPMOE_STAND_IN_WITHOUT_TOP_K
  static constexpr int top_k = 1;
#endif
  static constexpr bool uses_gate = true;
  EPMOE_HD void route_token(const epmoe::token_input& in, int* ids, float* weights) const {
    int best = 0;
    for (int e = 1; e < in.experts; ++e)
      if (in.logits[e] > in.logits[best]) best = e;
    ids[0] = best;
    weights[0] = 1.f;
  }
};

/// Expert e on rank e / (E / R).
struct placement {
  int per_rank = 1;
  explicit placement(const layer_config& cfg) : per_rank(cfg.experts / cfg.ranks) {}
  int slots_per_rank() const { return per_rank; }
  int expert_at(int r, int j) const { return r * per_rank + j; }
#ifndef EPMOE_STAND_IN_WITHOUT_SLOT_FOR
  EPMOE_HD int slot_for(int e, int, std::uint64_t) const { return e; }
#endif
};

/// No limit.
struct capacity {
  static constexpr bool pads = false;
#ifndef EPMOE_STAND_IN_WITHOUT_LIMIT
  index_t limit(const layer_config&, index_t tokens) const { return tokens; }
#endif
};

/// One rank.
struct comm {
  int rank() const { return 0; }
#ifndef EPMOE_STAND_IN_WITHOUT_SIZE
  int size() const { return 1; }
#endif
  template <class T>
  void alltoall(const T* s, T* r, index_t n) {
    std::copy_n(s, n, r);
  }
  template <class T>
  void alltoallv(const T* s, const index_t* sn, const index_t* sd, T* r, const index_t*,
                 const index_t* rd) {
    std::copy_n(s + sd[0], sn[0], r + rd[0]);
  }
};

/// One linear map per expert: y = W x, W [H, H] (the layer's ffn must equal hidden: the
/// scratch holds a copy of the rows, ffn elements each).
struct expert {
  template <class T>
  struct weights_of {
    epmoe::stacked_view<const T> w;  // [L, H, H]
  };
  template <class T>
  static void validate(const weights_of<T>& w, index_t count, index_t hidden, index_t,
                       const std::string& name) {
    epmoe::detail::require_shape(w.w, count, hidden, hidden, (name + ".w").c_str());
  }
#ifndef EPMOE_STAND_IN_WITHOUT_TENSORS
  template <class T>
  static std::array<epmoe::stacked_view<const T>*, 1> tensors(weights_of<T>& w) {
    return {&w.w};
  }
#endif
  template <class T>
  static weights_of<T> slice(const weights_of<T>& w, index_t first, index_t n) {
    return {w.w.slice(first, n)};
  }
  static double flops_per_row(index_t hidden, index_t) { return 2.0 * hidden * hidden; }
  static index_t scratch_per_row(index_t ffn) { return ffn; }
  template <class Space, class T>
  static void forward(const Space& s, const weights_of<T>& w, epmoe::grouped_rows<T> x,
                      T* scratch) {
    const epmoe::grouped_rows<T> in = x.over(scratch, x.cols);
    s.for_each_row(x.rows(), x.cols,
                   epmoe::rows::copy<T>{matrix_view<const T>(x.data, x.rows(), x.cols, x.stride),
                                        matrix_view<T>(in.data, x.rows(), x.cols, in.stride)});
    s.grouped_gemm_nt(in, w.w, x);
  }
};

/// route .. reduce, one unit after another.
struct schedule {
  template <class Stages>
#ifndef EPMOE_STAND_IN_WITHOUT_RUN
  static void run(Stages& s){
#else
  static void go(Stages& s) {
#endif
      s.route();
  s.plan();
  s.permute();
  s.shared();
  s.counts();
  for (int u = 0; u < s.chunks(); ++u) {
    s.dispatch_start(u);
    s.dispatch_wait(u);
    s.experts(u);
    s.combine_start(u);
    s.combine_wait(u);
  }
  s.reduce();
}
};  // namespace stand_in

/// Every slot a stand-in.
struct policies {
  using space = stand_in::space;
  using router = stand_in::router;
  using placement = stand_in::placement;
  using capacity = stand_in::capacity;
  using comm = stand_in::comm;
  using expert = stand_in::expert;
  using schedule = stand_in::schedule;
};

}  // namespace stand_in
