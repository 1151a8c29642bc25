// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
// What the layer-backward tests share (test_layer_backward.cpp, test_layer_backward_contracts.cpp,
// and on the GPU tests/cuda/test_layer_backward.cu): the training policies, the gradient
// arrays, one checked step against reference::backward, and the layer's shape.
#pragma once

#include <algorithm>
#include <catch2/catch.hpp>
#include <cmath>
#include <cstring>
#include <limits>
#include <mutex>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

#include "harness.hpp"
#include <epmoe/expert/mlp.hpp>
#include <epmoe/placement/table.hpp>
#include <epmoe/reference/backward.hpp>
#include <epmoe/router/expert_choice.hpp>
#include <epmoe/router/hash.hpp>
#include <epmoe/router/jitter.hpp>
#include <epmoe/router/noisy_topk.hpp>
#include <epmoe/router/sigmoid_bias.hpp>
#include <epmoe/router/sinkhorn.hpp>
#include <epmoe/schedule/pipelined.hpp>

namespace layer_backward_tests {
using namespace epmoe;

inline constexpr float nan_f = std::numeric_limits<float>::quiet_NaN();

// Bit-identical, the same length; an empty vector's data() may be null, which memcmp forbids.
inline bool same_bits(const float* a, const float* b, std::size_t n) {
  return n == 0 || std::memcmp(a, b, n * sizeof(float)) == 0;
}
inline bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && same_bits(a.data(), b.data(), a.size());
}

template <class X>
concept gated = requires(typename X::grads g) {
  g.w3;
};  // glu: w1, w3, w2

// The space these tests run on: the host here; tests/cuda/test_layer_backward.cu includes
// this file with space::cuda<float>.
using test_space = std::tuple_element_t<0, test::spaces>;
using io = test::space_io<test_space>;

template <class Router, class Capacity = capacity::dropless, class Expert = expert::swiglu,
          class Schedule = schedule::sequential, class Placement = placement::block>
struct train_policies : default_policies {
  using space = test_space;
  using comm = epmoe::comm::threads;
  using router = Router;
  using capacity = Capacity;
  using expert = Expert;
  using schedule = Schedule;
  using placement = Placement;
};

/// One rank's gradient arrays, NaN until the layer writes them: in the space's memory
/// (views()) and their host copies (after download()).
template <class X>
struct grad_arrays {
  std::vector<float> gate, w1, w3, w2, b1, b2, s1, s3, s2, sb1, sb2, sgate, obias, noise;
  std::vector<typename io::array> dev;
  std::vector<std::vector<float>*> all() {
    return {&gate, &w1, &w3, &w2, &b1, &b2, &s1, &s3, &s2, &sb1, &sb2, &sgate, &obias, &noise};
  }
  void download(const test_space& s) {
    auto a = all();
    for (std::size_t i = 0; i < a.size(); ++i) *a[i] = io::download(dev[i], s);
  }
  float* d(std::vector<float>& v) {
    auto a = all();
    return io::data(dev[static_cast<std::size_t>(std::find(a.begin(), a.end(), &v) - a.begin())]);
  }
  grad_arrays(const layer_config& c, index_t L) {
    const auto n = [](index_t v) { return std::vector<float>(static_cast<std::size_t>(v), nan_f); };
    const index_t E = c.experts, H = c.hidden, F = c.ffn, N = c.shared_experts,
                  Fs = c.shared_width();
    gate = n(E * H), w1 = n(L * F * H), w3 = n(L * F * H), w2 = n(L * H * F), b1 = n(L * F),
    b2 = n(L * H), s1 = n(N * Fs * H), s3 = n(N * Fs * H), s2 = n(N * H * Fs), sb1 = n(N * Fs),
    sb2 = n(N * H), sgate = n(N * H), obias = n(H), noise = n(E * H);
    for (auto* v : all()) dev.push_back(io::upload(*v));
  }
  static typename X::grads of(float* w1, float* w3, float* w2, float* b1, float* b2, index_t n,
                              index_t F, index_t H) {
    if constexpr (gated<X>)
      return {{w1, n, F, H}, {w3, n, F, H}, {w2, n, H, F}};
    else
      return {{w1, n, F, H}, {w2, n, H, F}, {b1, n, 1, F}, {b2, n, 1, H}};
  }
  template <class P>
  typename moe_layer<P>::gradients views(const layer_config& c, index_t L) {
    const index_t E = c.experts, H = c.hidden, N = c.shared_experts;
    return {{d(gate), E, H},
            of(d(w1), d(w3), d(w2), d(b1), d(b2), L, c.ffn, H),
            of(d(s1), d(s3), d(s2), d(sb1), d(sb2), N, c.shared_width(), H),
            {d(sgate), N, H},
            {d(obias), 1, H},
            {d(noise), E, H}};
  }
};

struct train_result {
  std::vector<float> y, dx;
  std::vector<float> dgate, dw1, dw3, dw2, db1, db2;  // summed over ranks / per logical expert
  std::vector<float> ds1, ds3, ds2, dsb1, dsb2, dsgate, dobias, dnoise;
  std::vector<pass_stats> forward_stats, backward_stats;  // [rank]
  bool reduced_agree = true;  // reduce: every rank's summed tensors and copies bit-identical
};

template <class P>
struct train_options {
  typename P::router router{};
  typename P::capacity capacity{};
  std::optional<typename P::placement> placement{};
  loss_scales losses{};
  std::vector<std::int64_t> token_ids{};
  bool reduce = false;        // call reduce_gradients: every rank then holds the sums
  bool scramble_ids = false;  // overwrite the token ids between forward and backward (host)
};

// Sums rank r's slot tensor (count L, `per` elements per slot) into its logical expert's.
inline void add_slots(std::vector<float>& into, const std::vector<float>& slots, index_t per,
                      const std::vector<int>& expert_of) {
  for (std::size_t j = 0; j < expert_of.size(); ++j)
    for (index_t i = 0; i < per; ++i) {
      float& o = into[static_cast<std::size_t>(expert_of[j] * per + i)];
      o = (std::isnan(o) ? 0.f : o) + slots[j * static_cast<std::size_t>(per) + i];
    }
}
inline void add_all(std::vector<float>& into, const std::vector<float>& v) {
  if (into.empty()) into.assign(v.size(), 0.f);
  for (std::size_t i = 0; i < v.size(); ++i) into[i] += v[i];
}

/// Forward then backward on cfg.ranks in-process ranks with dy; each rank's gradients summed
/// as a training loop would (the gate and shared tensors over the ranks, each slot into its
/// logical expert).
template <class P>
train_result train_step(layer_config cfg, const reference::full_weights& w,
                        const test::global_tokens& g, const std::vector<float>& dy,
                        const train_options<P>& opt = {}) {
  cfg.training = true;
  const index_t H = cfg.hidden, E = cfg.experts, F = cfg.ffn;
  train_result out;
  out.y.assign(g.x.size(), nan_f);
  out.dx.assign(g.x.size(), nan_f);
  for (auto* v : {&out.dw1, &out.dw3, &out.dw2})
    v->assign(static_cast<std::size_t>(E * F * H), nan_f);
  out.db1.assign(static_cast<std::size_t>(E * F), nan_f);
  out.db2.assign(static_cast<std::size_t>(E * H), nan_f);
  out.forward_stats.resize(static_cast<std::size_t>(cfg.ranks));
  out.backward_stats.resize(static_cast<std::size_t>(cfg.ranks));
  std::vector<grad_arrays<typename P::expert>*> per_rank(static_cast<std::size_t>(cfg.ranks));
  std::vector<std::vector<int>> experts_of(static_cast<std::size_t>(cfg.ranks));
  std::mutex m;
  comm::threads_world world(cfg.ranks);
  world.run([&](typename P::comm c) {
    const int r = c.rank();
    const typename P::placement where = opt.placement ? *opt.placement : typename P::placement(cfg);
    const index_t L = where.slots_per_rank();
    test::rank_arrays<P> arrays(w, reference::slice(w, where, r));
    const test_space space{};
    moe_layer<P> layer(cfg, c, arrays.views(cfg, L), opt.router, opt.capacity, where, space);
    const index_t T = g.per_rank[r], at = g.offset(r) * H;
    const auto slice = [&](const std::vector<float>& v) {
      return io::upload(std::span(v).subspan(static_cast<std::size_t>(at), T * H));
    };
    auto x = slice(g.x), dyr = slice(dy), y = slice(dy), dx = slice(dy);
    io::poison(y, space);
    io::poison(dx, space);
    auto id_array = io::upload_as(
        std::span(opt.token_ids)
            .subspan(opt.token_ids.empty() ? 0 : g.offset(r), opt.token_ids.empty() ? 0 : T));
    const std::span<const std::int64_t> ids(io::data(id_array), opt.token_ids.empty() ? 0 : T);
    layer.forward({io::data(x), T, H}, {io::data(y), T, H}, ids);
    out.forward_stats[r] = layer.stats();
    if constexpr (std::is_same_v<decltype(id_array), std::vector<std::int64_t>>)
      if (opt.scramble_ids) std::fill(id_array.begin(), id_array.end(), std::int64_t{-7});
    auto* grads = new grad_arrays<typename P::expert>(cfg, L);
    layer.backward({io::data(dyr), T, H}, {io::data(dx), T, H}, grads->template views<P>(cfg, L),
                   {.losses = opt.losses});
    out.backward_stats[r] = layer.stats();
    if (opt.reduce) layer.reduce_gradients(grads->template views<P>(cfg, L));
    grads->download(space);
    const std::vector<float> yh = io::download(y, space), dxh = io::download(dx, space);
    std::copy(yh.begin(), yh.end(), out.y.begin() + at);
    std::copy(dxh.begin(), dxh.end(), out.dx.begin() + at);
    std::lock_guard lock(m);
    per_rank[r] = grads;
    for (index_t j = 0; j < L; ++j)
      experts_of[r].push_back(where.expert_at(r, static_cast<int>(j)));
  });
  if (opt.reduce) {  // each summed tensor once (rank 0's), each copy agreeing with the first
    const auto same = [&](const std::vector<float>& a, const std::vector<float>& b) {
      out.reduced_agree = out.reduced_agree && same_bits(a, b);
    };
    const auto first_copy = [&](std::vector<float> grad_arrays<typename P::expert>::*m, index_t per,
                                std::vector<float>& into) {
      std::vector<char> seen(static_cast<std::size_t>(E), 0);
      for (int r = 0; r < cfg.ranks; ++r)
        for (std::size_t j = 0; j < experts_of[r].size(); ++j) {
          const int e = experts_of[r][j];
          const auto* src = ((*per_rank[r]).*m).data() + j * per;
          float* dst = into.data() + e * per;
          if (seen[e])
            out.reduced_agree = out.reduced_agree && same_bits(dst, src, per);
          else
            std::copy(src, src + per, dst);
          seen[e] = 1;
        }
    };
    auto& a0 = *per_rank[0];
    for (int r = 1; r < cfg.ranks; ++r) {
      same(a0.gate, per_rank[r]->gate), same(a0.s1, per_rank[r]->s1);
      same(a0.s2, per_rank[r]->s2), same(a0.s3, per_rank[r]->s3);
      same(a0.sgate, per_rank[r]->sgate), same(a0.obias, per_rank[r]->obias);
    }
    first_copy(&grad_arrays<typename P::expert>::w1, F * H, out.dw1);
    first_copy(&grad_arrays<typename P::expert>::w3, F * H, out.dw3);
    first_copy(&grad_arrays<typename P::expert>::w2, H * F, out.dw2);
    out.dgate = a0.gate, out.ds1 = a0.s1, out.ds2 = a0.s2, out.ds3 = a0.s3;
    out.dsgate = a0.sgate, out.dobias = a0.obias, out.dnoise = a0.noise;
    for (auto* a : per_rank) delete a;
    return out;
  }
  for (int r = 0; r < cfg.ranks; ++r) {
    grad_arrays<typename P::expert>& a = *per_rank[r];
    add_all(out.dgate, a.gate);
    add_slots(out.dw1, a.w1, F * H, experts_of[r]);
    add_slots(out.dw3, a.w3, F * H, experts_of[r]);
    add_slots(out.dw2, a.w2, H * F, experts_of[r]);
    add_slots(out.db1, a.b1, F, experts_of[r]);
    add_slots(out.db2, a.b2, H, experts_of[r]);
    add_all(out.ds1, a.s1), add_all(out.ds3, a.s3), add_all(out.ds2, a.s2);
    add_all(out.dsb1, a.sb1), add_all(out.dsb2, a.sb2);
    add_all(out.dsgate, a.sgate), add_all(out.dobias, a.obias), add_all(out.dnoise, a.noise);
    delete per_rank[r];
  }
  return out;
}

inline std::vector<float> to_float(const std::vector<double>& v) {
  return std::vector<float>(v.begin(), v.end());
}

/// The error of each gradient the configuration uses (NaN anywhere: +inf), checked <= tol.
template <class Expert>
void check_against(const train_result& got, const reference::gradients& want,
                   const layer_config& cfg, bool gate, bool noise = false, double tol = 2e-5) {
  int checked = 0;
  const auto check = [&](const char* name, const std::vector<float>& a,
                         const std::vector<double>& b) {
    const double e = test::relative_error(a, to_float(b));
    INFO(name << " error " << e);
    CHECK(e <= tol);
    ++checked;
  };
  check("dx", got.dx, want.dx);
  if (gate) check("dgate", got.dgate, want.dgate);
  check("dw1", got.dw1, want.dw1);
  check("dw2", got.dw2, want.dw2);
  if constexpr (gated<Expert>) {
    check("dw3", got.dw3, want.dw3);
  } else if constexpr (requires { Expert::biases; }) {
    if (Expert::biases) {
      check("db1", got.db1, want.db1);
      check("db2", got.db2, want.db2);
    }
  }
  if (cfg.shared_experts > 0) {
    check("dshared_w1", got.ds1, want.dshared_w1);
    check("dshared_w2", got.ds2, want.dshared_w2);
    if constexpr (gated<Expert>) check("dshared_w3", got.ds3, want.dshared_w3);
  }
  if (cfg.shared_gate) check("dshared_gate", got.dsgate, want.dshared_gate);
  if (cfg.output_bias) check("doutput_bias", got.dobias, want.doutput_bias);
  if (noise) check("dnoise_gate", got.dnoise, want.dnoise_gate);
  CHECK(checked >= 4);
}

inline std::vector<float> random_dy(index_t n, std::uint64_t seed) {
  return reference::random_tokens(n, 1, seed);
}

/// The reference of the same step: y, and the gradients of Σ dy ⊙ y (+ the losses').
template <class P>
reference::gradients reference_step(const layer_config& cfg, const reference::full_weights& w,
                                    const test::global_tokens& g, const std::vector<float>& dy,
                                    const train_options<P>& opt) {
  reference::full_weights rw = w;
  rw.cfg = cfg;
  const typename P::placement where = opt.placement ? *opt.placement : typename P::placement(cfg);
  const index_t n = g.total(), H = cfg.hidden;
  const reference::pass_options po{opt.token_ids, 0};
  reference::gradients want = reference::backward<typename P::expert>(
      rw, opt.router, opt.capacity, where, {g.x.data(), n, H}, g.per_rank, {dy.data(), n, H}, po);
  const loss_scales& s = opt.losses;
  if constexpr (P::router::uses_gate)
    if (s.aux != 0 || s.seq_aux != 0 || s.z != 0) {
      const reference::gradients l =
          reference::loss_backward(rw, opt.router, {g.x.data(), n, H}, g.per_rank, s, po);
      for (std::size_t i = 0; i < want.dgate.size(); ++i) want.dgate[i] += l.dgate[i];
      for (std::size_t i = 0; i < want.dx.size(); ++i) want.dx[i] += l.dx[i];
    }
  return want;
}

template <class P>
train_result check_step(const layer_config& cfg, const train_options<P>& opt = {},
                        std::vector<index_t> per_rank = {}, std::uint64_t seed = 7) {
  const auto w = reference::full_weights::random(cfg, seed);
  if (per_rank.empty()) per_rank.assign(static_cast<std::size_t>(cfg.ranks), 24);
  const auto g = test::make_tokens(per_rank, cfg.hidden, seed + 1);
  const std::vector<float> dy = random_dy(g.total() * cfg.hidden, seed + 2);
  const train_result got = train_step<P>(cfg, w, g, dy, opt);
  // The forward first: the step trains the layer the forward tests checked.
  test::run_options<P> ro{.router = opt.router,
                          .capacity = opt.capacity,
                          .token_ids = opt.token_ids,
                          .placement = opt.placement};
  if constexpr (router_with_bias<typename P::router>)
    if (opt.router.bias) ro.bias.assign(opt.router.bias, opt.router.bias + cfg.experts);
  CHECK(test::relative_error(got.y, test::run_reference<P>(cfg, w, g, ro)) <= 1e-5);
  bool noise = false;
  if constexpr (router_with_noise_gate<typename P::router>) noise = opt.router.training;
  check_against<typename P::expert>(got, reference_step<P>(cfg, w, g, dy, opt), cfg,
                                    P::router::uses_gate, noise);
  CHECK(got.reduced_agree);
  return got;
}

inline layer_config train_layer(int ranks, int top_k = 2, int experts = 8) {
  return {.hidden = 12,
          .ffn = 10,
          .experts = experts,
          .top_k = top_k,
          .ranks = ranks,
          .max_tokens = 32,
          .capacity_factor = 1.0};
}

}  // namespace layer_backward_tests
