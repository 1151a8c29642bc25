// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
// The layer's backward (fp32, in-process ranks) against reference::backward (float64, written
// apart from the layer): dx and every gradient, on 1, 2 and 4 ranks, with capacity drops,
// padded capacity, the pipelined schedule, receive rounds, replicas, shared experts with their
// gate, an output bias, MLP experts with biases, the routers that train, and the router losses.
// Every output starts as NaN, so a row or a gradient nobody wrote fails.
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

// A namespace per file: tests/cuda compiles several of these files in one unit.
namespace layer_backward_tests {
using namespace epmoe;

namespace {

constexpr float nan_f = std::numeric_limits<float>::quiet_NaN();

// Bit-identical, the same length; an empty vector's data() may be null, which memcmp forbids.
bool same_bits(const float* a, const float* b, std::size_t n) {
  return n == 0 || std::memcmp(a, b, n * sizeof(float)) == 0;
}
bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
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
void add_slots(std::vector<float>& into, const std::vector<float>& slots, index_t per,
               const std::vector<int>& expert_of) {
  for (std::size_t j = 0; j < expert_of.size(); ++j)
    for (index_t i = 0; i < per; ++i) {
      float& o = into[static_cast<std::size_t>(expert_of[j] * per + i)];
      o = (std::isnan(o) ? 0.f : o) + slots[j * static_cast<std::size_t>(per) + i];
    }
}
void add_all(std::vector<float>& into, const std::vector<float>& v) {
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

std::vector<float> to_float(const std::vector<double>& v) {
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

std::vector<float> random_dy(index_t n, std::uint64_t seed) {
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

layer_config train_layer(int ranks, int top_k = 2, int experts = 8) {
  return {.hidden = 12,
          .ffn = 10,
          .experts = experts,
          .top_k = top_k,
          .ranks = ranks,
          .max_tokens = 32,
          .capacity_factor = 1.0};
}

}  // namespace

TEST_CASE("layer backward: dx and every gradient equal the reference on 1, 2 and 4 ranks",
          "[layer][backward]") {
  for (int ranks : {1, 2, 4}) {
    INFO("ranks " << ranks);
    check_step<train_policies<router::topk_softmax<2>>>(train_layer(ranks), {}, {}, 11 + ranks);
  }
  // Uneven tokens, one rank with none.
  check_step<train_policies<router::topk_softmax<2>>>(train_layer(2), {}, {0, 17}, 5);
  // config recompute: the hidden layers recomputed instead of kept, the same gradients.
  layer_config recompute = train_layer(2);
  recompute.recompute = true;
  check_step<train_policies<router::topk_softmax<2>>>(recompute);
  check_step<
      train_policies<router::topk_softmax<2>, capacity::dropless, expert::mlp<act::gelu, true>>>(
      recompute);
}

#ifndef EPMOE_TEST_SPACES_ONLY_GENERIC
namespace {
struct packed_train : train_policies<router::topk_softmax<2>> {
  static constexpr layer_options options{.pack_weights = true};
};
}  // namespace

TEST_CASE("layer backward: over packed expert weights, kept or recomputed hidden layers",
          "[layer][backward]") {
  check_step<packed_train>(train_layer(2), {}, {}, 21);
  layer_config recompute = train_layer(2);
  recompute.recompute = true;  // backward recomputes a and b from the packed copies
  check_step<packed_train>(recompute, {}, {}, 22);
}
#endif

TEST_CASE("layer backward: capacity drops get no gradient, padded capacity the same",
          "[layer][backward]") {
  layer_config cfg = train_layer(2);
  cfg.capacity_factor = 0.5;
  using drop = train_policies<router::topk_softmax<2>, capacity::factor<false>>;
  const auto w = reference::full_weights::random(cfg, 3);
  const auto g = test::make_tokens({24, 24}, cfg.hidden, 4);
  const auto dy = random_dy(g.total() * cfg.hidden, 5);
  const train_result got = train_step<drop>(cfg, w, g, dy);
  index_t dropped = 0;
  for (const pass_stats& s : got.forward_stats) dropped += s.dropped;
  CHECK(dropped > 0);
  check_against<expert::swiglu>(got, reference_step<drop>(cfg, w, g, dy, {}), cfg, true);
  check_step<train_policies<router::topk_softmax<2>, capacity::factor<true>>>(cfg);
  // With biases an expert's output on a padding row is not zero: its dy must be.
  check_step<train_policies<router::topk_softmax<2>, capacity::factor<true>,
                            expert::mlp<act::gelu, true>>>(cfg);
}

TEST_CASE("layer backward: pipelined chunks and receive rounds", "[layer][backward]") {
  layer_config cfg = train_layer(2);
  cfg.chunks = 3;
  check_step<train_policies<router::topk_softmax<2>, capacity::dropless, expert::swiglu,
                            schedule::pipelined<3>>>(cfg);
  layer_config rounds = train_layer(2);
  rounds.max_recv_rows = 12;
  check_step<train_policies<router::topk_softmax<2>>>(rounds);
  rounds.chunks = 2;
  check_step<train_policies<router::topk_softmax<2>, capacity::dropless, expert::swiglu,
                            schedule::pipelined<2>>>(rounds);
}

template <class Capacity = capacity::dropless, class Schedule = schedule::sequential>
struct dedup_policies
    : train_policies<router::topk_softmax<4>, Capacity, expert::swiglu, Schedule> {
  static constexpr layer_options options{.dedup = true};
};

TEST_CASE("layer backward: per-rank dedup, one dy row per (token, rank) and weights home",
          "[layer][backward]") {
  for (int ranks : {1, 2, 4}) {
    INFO("ranks " << ranks);
    check_step<dedup_policies<>>(train_layer(ranks, 4));
  }
  layer_config drops = train_layer(2, 4);
  drops.capacity_factor = 0.6;
  check_step<dedup_policies<capacity::factor<false>>>(drops);
  layer_config chunks = train_layer(2, 4);
  chunks.chunks = 2;
  check_step<dedup_policies<capacity::dropless, schedule::pipelined<2>>>(chunks);
  // A receive bound: windows of 3 tokens (pipelined: 3 units in flight), weights home per
  // window.
  chunks.max_recv_rows = 2 * 3 * 3;
  const auto bounded =
      check_step<dedup_policies<capacity::dropless, schedule::pipelined<2>>>(chunks);
  CHECK(bounded.backward_stats[0].rounds == 6);  // 16-token chunks
  CHECK(bounded.backward_stats[0].recv_buffer_rows <= 18);
}

template <class Capacity = capacity::dropless, class Schedule = schedule::sequential>
struct hierarchical_policies
    : train_policies<router::topk_softmax<4>, Capacity, expert::swiglu, Schedule> {
  static constexpr layer_options options{.hierarchical = true};
};

TEST_CASE("layer backward: hierarchical, dy crosses once per (token, node), dx sums in the node",
          "[layer][backward][hierarchical]") {
  int steps = 0;
  for (const auto& [ranks, per_node] : {std::pair{4, 2}, std::pair{4, 1}, std::pair{2, 2}}) {
    INFO("ranks " << ranks << " per node " << per_node);
    layer_config cfg = train_layer(ranks, 4);
    cfg.ranks_per_node = per_node;
    check_step<hierarchical_policies<>>(cfg);
    ++steps;
  }
  layer_config drops = train_layer(4, 4);
  drops.ranks_per_node = 2;
  drops.capacity_factor = 0.6;
  check_step<hierarchical_policies<capacity::factor<false>>>(drops);
  drops.capacity_factor = 1.0;
  drops.chunks = 2;
  check_step<hierarchical_policies<capacity::dropless, schedule::pipelined<2>>>(drops);
  // A receive bound: windows of 2 tokens per rank, each level's rows in their slots.
  drops.max_recv_rows = 4 * 3 * 2;
  const auto windows =
      check_step<hierarchical_policies<capacity::dropless, schedule::pipelined<2>>>(drops);
  CHECK(windows.forward_stats[1].rounds == 8);  // 16-token chunks in windows of 2
  CHECK(windows.backward_stats[1].rounds == 8);
  drops.capacity_factor = 0.6;
  drops.chunks = 1;
  drops.max_recv_rows = 4 * 5;
  const auto sequential = check_step<hierarchical_policies<capacity::factor<false>>>(drops);
  CHECK(sequential.forward_stats[3].rounds == 7);  // 32 tokens in windows of 5
  CHECK(sequential.forward_stats[3].peak_recv_rows <= 20);
  CHECK(steps == 3);
}

TEST_CASE("layer backward: a replicated expert's gradient is the sum over its copies",
          "[layer][backward]") {
  const layer_config cfg = train_layer(2, 2, 6);
  // 8 slots for 6 experts: expert 0 and expert 3 have a copy on each rank.
  using P = train_policies<router::topk_softmax<2>, capacity::dropless, expert::swiglu,
                           schedule::sequential, placement::table>;
  const placement::table t(6, 2, {0, 1, 2, 3, 0, 3, 4, 5});
  check_step<P>(cfg, {.placement = t});
  // reduce_gradients: every copy then holds its expert's whole gradient, every rank the
  // gate's and the shared experts' sums, bit-identical.
  layer_config shared = cfg;
  shared.shared_experts = 1;
  shared.shared_gate = true;
  shared.output_bias = true;
  check_step<P>(shared, {.placement = t, .reduce = true});
  using Q = train_policies<router::topk_softmax<2>, capacity::dropless, expert::swiglu,
                           schedule::sequential, placement::table>;
  const placement::table four(6, 4, {0, 1, 0, 2, 3, 0, 4, 5});
  check_step<Q>(train_layer(4, 2, 6), {.placement = four, .reduce = true});
}

TEST_CASE("layer backward: shared experts, their gate, the output bias, MLP experts",
          "[layer][backward]") {
  layer_config cfg = train_layer(2);
  cfg.shared_experts = 2;
  cfg.shared_ffn = 6;
  cfg.shared_gate = true;
  cfg.output_bias = true;
  check_step<train_policies<router::topk_softmax<2>>>(cfg);
  layer_config plain = train_layer(2);
  plain.shared_experts = 1;
  check_step<train_policies<router::topk_softmax<2>>>(plain);
  layer_config mlp = train_layer(2);
  mlp.shared_experts = 1;
  check_step<
      train_policies<router::topk_softmax<2>, capacity::dropless, expert::mlp<act::gelu, true>>>(
      mlp);
  check_step<
      train_policies<router::topk_softmax<2>, capacity::dropless, expert::mlp<act::relu, false>>>(
      train_layer(2));
}

TEST_CASE("layer backward: the routers that train", "[layer][backward]") {
  SECTION("softmax top-k without renormalisation, with scaling and groups") {
    router::topk_softmax<2, false> r;
    r.scaling = 2.5f;
    r.groups = 4;
    r.top_groups = 2;
    check_step<train_policies<router::topk_softmax<2, false>>>(train_layer(2), {.router = r});
  }
  SECTION("softmax top-k renormalised by a p-norm") {
    router::topk_softmax<4> r;
    r.norm_p = 2.f;
    check_step<train_policies<router::topk_softmax<4>>>(train_layer(2, 4), {.router = r});
  }
  SECTION("top-1") {
    check_step<train_policies<router::topk_softmax<1, false>>>(train_layer(4, 1));
  }
  SECTION("sigmoid with bias, groups and scaling; unnormalised") {
    std::vector<float> bias = {0.1f, -0.2f, 0.f, 0.3f, -0.1f, 0.05f, 0.f, 0.2f};
    router::sigmoid_bias<2> r;
    r.bias = bias.data();
    r.groups = 4;
    r.top_groups = 2;
    r.scaling = 2.5f;
    check_step<train_policies<router::sigmoid_bias<2>>>(train_layer(2), {.router = r});
    r.normalize = false;
    check_step<train_policies<router::sigmoid_bias<2>>>(train_layer(2), {.router = r});
  }
  SECTION("expert choice") { check_step<train_policies<router::expert_choice>>(train_layer(2)); }
  SECTION("sinkhorn, top-2 and top-1") {
    check_step<train_policies<router::sinkhorn<2>>>(train_layer(2));
    check_step<train_policies<router::sinkhorn<1>>>(train_layer(2, 1));
  }
  SECTION("noisy top-k: while training through both gates, else through the gate alone") {
    router::noisy_topk<2> r;
    r.training = true;
    r.seed = 5;
    check_step<train_policies<router::noisy_topk<2>>>(train_layer(2), {.router = r});
    r.training = false;
    check_step<train_policies<router::noisy_topk<2>>>(train_layer(2), {.router = r});
  }
  SECTION("input jitter: the gate saw x times the forward's noise") {
    router::jitter<router::topk_softmax<2>> r;
    r.training = true;
    r.eps = 0.2f;
    r.seed = 9;
    check_step<train_policies<router::jitter<router::topk_softmax<2>>>>(train_layer(2),
                                                                        {.router = r});
  }
  SECTION("hash: no gate, the experts still train") {
    std::vector<std::int64_t> ids(48);
    for (std::size_t i = 0; i < ids.size(); ++i) ids[i] = static_cast<std::int64_t>(i * 7 % 13);
    check_step<train_policies<router::hash<2>>>(train_layer(2), {.token_ids = ids});
  }
}

TEST_CASE("layer backward: the router losses' gradient flows into the gate and x",
          "[layer][backward]") {
  layer_config cfg = train_layer(2);
  cfg.seq_len = 8;
  cfg.aux_loss_coef = 0.1;
  check_step<train_policies<router::topk_softmax<2>>>(cfg, {.losses = {1.0, 0.5, 0.25}});
  check_step<train_policies<router::sigmoid_bias<2>>>(cfg, {.losses = {0.0, 2.0, 0.5}});
}

// Rank 1 passes a bad dy: every rank throws and nothing is written, on any space: not dx, not
// a routed or shared expert's gradient, not the shared gate's or the output bias's (the home
// terms' backward may run before the verdict: sequential runs shared() first), and with
// padded capacity (static shapes: a device never defers a backward's verdict).
template <class P>
void rejected_backward(bool home_terms) {
  layer_config cfg = train_layer(2);
  cfg.training = true;
  if (home_terms) cfg.shared_experts = 1, cfg.shared_gate = true, cfg.output_bias = true;
  const auto w = reference::full_weights::random(cfg, 21);
  const auto g = test::make_tokens({10, 10}, cfg.hidden, 22);
  const index_t H = cfg.hidden, T = 10;
  std::vector<std::string> caught(2);
  std::vector<int> untouched(2, 0), recovered(2, 0), looked(2, 0);
  comm::threads_world world(2);
  world.run([&](typename P::comm c) {
    const int r = c.rank();
    const placement::block where(cfg);
    const index_t L = where.slots_per_rank();
    test::rank_arrays<P> arrays(w, reference::slice(w, where, r));
    const test_space space{};
    moe_layer<P> layer(cfg, c, arrays.views(cfg, L), {}, {}, where, space);
    const auto x = io::upload(std::span(g.x).subspan(static_cast<std::size_t>(r * T * H), T * H));
    auto y = io::upload(std::vector<float>(T * H)), dy = io::upload(std::vector<float>(T * H, .5f)),
         dx = io::upload(std::vector<float>(T * H));
    io::poison(dx, space);
    grad_arrays<expert::swiglu> grads(cfg, L);
    const auto views = grads.template views<P>(cfg, L);
    const auto all_nan = [&] {
      grads.download(space);
      int n = 0;
      for (const auto* v : {&grads.gate, &grads.w1, &grads.w3, &grads.w2, &grads.s1, &grads.s3,
                            &grads.s2, &grads.sgate, &grads.obias})
        for (float f : *v) {
          if (!std::isnan(f)) return false;
          ++n;
        }
      for (float f : io::download(dx, space))
        if (!std::isnan(f)) return false;
      looked[r] = n;
      return true;
    };
    const auto attempt = [&](auto&& f) -> std::string {
      try {
        f();
      } catch (const input_error& e) {
        return std::string("input_error ") + e.field();
      } catch (const config_error& e) {
        return std::string("config_error ") + e.field();
      }
      return "none";
    };
    const matrix_view<const float> xv(io::data(x), T, H);
    const matrix_view<float> yv(io::data(y), T, H), dxv(io::data(dx), T, H);
    // Before any forward: every rank rejects (none has saved state).
    const std::string first = attempt([&] { layer.backward({io::data(dy), T, H}, dxv, views); });
    layer.forward(xv, yv);
    // Rank 1 passes dy one column short: it names dy, rank 0 hears of it.
    const std::string bad = attempt([&] {
      layer.backward({io::data(dy), T, r == 1 ? H - 1 : H}, dxv, views);
      layer.synchronize();
    });
    untouched[r] = all_nan();
    // The state was consumed: a second backward is refused; a new forward makes it work.
    const std::string again = attempt([&] { layer.backward({io::data(dy), T, H}, dxv, views); });
    layer.forward(xv, yv);
    layer.backward({io::data(dy), T, H}, dxv, views);
    recovered[r] = !all_nan() && layer.stats().backward && layer.stats().saved_bytes > 0;
    caught[r] = first + " | " + bad + " | " + again;
  });
  INFO("home terms " << home_terms << ", pads " << P::capacity::pads);
  CHECK(caught[0] ==
        "config_error backward | input_error backward inputs of rank 1 | "
        "config_error backward");
  CHECK(caught[1] == "config_error backward | config_error dy | config_error backward");
  CHECK(untouched == std::vector<int>{1, 1});
  CHECK(recovered == std::vector<int>{1, 1});
  const index_t F = cfg.ffn, E = cfg.experts;
  // gate, the routed experts' w1, w3, w2, the output bias's (always sized), and the shared
  // expert's and its gate's.
  const index_t expect = E * H + 3 * (E / 2) * F * H + H + (home_terms ? 3 * F * H + H : 0);
  CHECK(looked == std::vector<int>(2, static_cast<int>(expect)));
}

TEST_CASE("layer backward: bad arguments throw on every rank, nothing is written",
          "[layer][backward]") {
  rejected_backward<train_policies<router::topk_softmax<2>>>(false);
  // Shared experts, their gate and the output bias: their gradients are the home rank's.
  rejected_backward<train_policies<router::topk_softmax<2>>>(true);
  rejected_backward<train_policies<router::topk_softmax<2>, capacity::dropless, expert::swiglu,
                                   schedule::pipelined<2>>>(true);
  rejected_backward<train_policies<router::topk_softmax<2>, capacity::factor<true>>>(true);
}

// Host-only: these build layers over host arrays directly.
#ifndef EPMOE_TEST_SPACES_ONLY_GENERIC
TEST_CASE("layer backward: config training off is named, the saved bytes are reported",
          "[layer][backward]") {
  struct P : train_policies<router::topk_softmax<2>> {
    using comm = epmoe::comm::local;
  };
  const layer_config cfg = train_layer(1);
  const auto w = reference::full_weights::random(cfg, 31);
  const index_t H = cfg.hidden, T = 16, E = cfg.experts, K = 2;
  const auto g = test::make_tokens({T}, H, 32);
  std::vector<float> y(T * H), dy(T * H, 1.f), dx(T * H, nan_f);
  test::rank_arrays<P> arrays(w, reference::slice(w, placement::block(cfg), 0));
  grad_arrays<expert::swiglu> grads(cfg, E);
  {
    moe_layer<P> layer(cfg, comm::local{}, arrays.views(cfg, E));
    layer.forward({g.x.data(), T, H}, {y.data(), T, H});
    try {
      layer.backward({dy.data(), T, H}, {dx.data(), T, H}, grads.views<P>(cfg, E));
      FAIL("backward without config training ran");
    } catch (const config_error& e) {
      CHECK(std::string(e.field()) == "config.training");
    }
    CHECK(layer.stats().saved_bytes == 0);
  }
  layer_config training = cfg;
  training.training = true;
  training.recompute = true;
  index_t recomputed = 0;
  {
    moe_layer<P> layer(training, comm::local{}, arrays.views(cfg, E));
    layer.forward({g.x.data(), T, H}, {y.data(), T, H});
    const pass_stats& s = layer.stats();
    CHECK_FALSE(s.backward);
    // Every expert row's input (T*K rows, dropless), the routing and the logits.
    CHECK(s.saved_bytes == T * K * H * 4 + T * K * 8 + T * E * 4);
    recomputed = s.saved_bytes;
  }
  // Without recompute the experts' two hidden layers too (F = 10 padded to 12 floats).
  training.recompute = false;
  moe_layer<P> layer(training, comm::local{}, arrays.views(cfg, E));
  layer.forward({g.x.data(), T, H}, {y.data(), T, H});
  CHECK(layer.stats().saved_bytes == recomputed + T * K * 2 * 12 * 4);
  CHECK(layer.stats().expert_flops == double(T * K) * 6 * H * cfg.ffn);
  // Backward's expert FLOPs: 6 GEMMs of the forward's 3 (the kept layers are not recomputed).
  layer.backward({dy.data(), T, H}, {dx.data(), T, H}, grads.views<P>(cfg, E));
  CHECK(layer.stats().backward);
  CHECK(layer.stats().expert_flops == double(T * K) * 12 * H * cfg.ffn);
}

TEST_CASE("layer backward: loss scales on a router whose losses have no gradient are named",
          "[layer][backward]") {
  struct P : train_policies<router::noisy_topk<2>> {
    using comm = epmoe::comm::local;
  };
  layer_config cfg = train_layer(1);
  cfg.training = true;
  const auto w = reference::full_weights::random(cfg, 33);
  const index_t H = cfg.hidden, T = 8, E = cfg.experts;
  const auto g = test::make_tokens({T}, H, 34);
  std::vector<float> y(T * H), dy(T * H, 1.f), dx(T * H, nan_f);
  test::rank_arrays<P> arrays(w, reference::slice(w, placement::block(cfg), 0));
  grad_arrays<expert::swiglu> grads(cfg, E);
  moe_layer<P> layer(cfg, comm::local{}, arrays.views(cfg, E));
  layer.forward({g.x.data(), T, H}, {y.data(), T, H});
  std::string field;
  try {
    layer.backward({dy.data(), T, H}, {dx.data(), T, H}, grads.views<P>(cfg, E),
                   {.losses = {.z = 1.0}});
  } catch (const config_error& e) {
    field = e.field();
  }
  CHECK(field == "backward_options.losses");
  CHECK(std::isnan(dx[0]));
}

TEST_CASE("layer backward: the token ids are the forward's, whatever the caller's memory holds",
          "[layer][backward]") {
  // Noisy top-k seeds each token's noise with its id; backward draws the same noise again.
  router::noisy_topk<2> r;
  r.training = true;
  r.seed = 11;
  std::vector<std::int64_t> ids(48);
  for (std::size_t i = 0; i < ids.size(); ++i) ids[i] = static_cast<std::int64_t>(i * 31 % 17);
  check_step<train_policies<router::noisy_topk<2>>>(
      train_layer(2), {.router = r, .token_ids = ids, .scramble_ids = true});
}

TEST_CASE("layer backward: a given routing writes zeros into the gate's and noise gate's gradients",
          "[layer][backward]") {
  struct P : train_policies<router::noisy_topk<2>> {
    using comm = epmoe::comm::local;
  };
  layer_config cfg = train_layer(1);
  cfg.training = true;
  const auto w = reference::full_weights::random(cfg, 35);
  const index_t H = cfg.hidden, T = 6, E = cfg.experts;
  const auto g = test::make_tokens({T}, H, 36);
  std::vector<float> y(T * H, nan_f), dy(T * H, 1.f), dx(T * H, nan_f);
  std::vector<std::int32_t> rid(T * 2);
  std::vector<float> rw(T * 2, 0.5f);
  for (index_t t = 0; t < T; ++t) rid[t * 2] = t % E, rid[t * 2 + 1] = (t + 3) % E;
  test::rank_arrays<P> arrays(w, reference::slice(w, placement::block(cfg), 0));
  grad_arrays<expert::swiglu> grads(cfg, E);
  router::noisy_topk<2> r;
  r.training = true;
  moe_layer<P> layer(cfg, comm::local{}, arrays.views(cfg, E), r);
  layer.forward({g.x.data(), T, H}, {{rid.data(), T, 2}, {rw.data(), T, 2}}, {y.data(), T, H});
  layer.backward({dy.data(), T, H}, {dx.data(), T, H}, grads.views<P>(cfg, E));
  grads.download(test_space{});
  int zeros = 0;
  for (const auto* v : {&grads.gate, &grads.noise})
    for (float f : *v) zeros += f == 0.f;
  CHECK(zeros == 2 * E * H);
  for (float f : dx) CHECK(std::isfinite(f));
}

TEST_CASE("layer backward: a pass is a value, backward consumes its handle once",
          "[layer][backward]") {
  struct P : train_policies<router::topk_softmax<2>> {
    using comm = epmoe::comm::local;
  };
  layer_config cfg = train_layer(1);
  const auto w = reference::full_weights::random(cfg, 37);
  const index_t H = cfg.hidden, T = 8, E = cfg.experts;
  const auto g = test::make_tokens({T}, H, 38);
  std::vector<float> y(T * H, nan_f), dy(T * H, 1.f), dx(T * H, nan_f);
  test::rank_arrays<P> arrays(w, reference::slice(w, placement::block(cfg), 0));
  grad_arrays<expert::swiglu> grads(cfg, E);
  const auto views = grads.views<P>(cfg, E);
  {  // Inference: the handle says there is nothing to go back through.
    moe_layer<P> layer(cfg, comm::local{}, arrays.views(cfg, E));
    const auto h = layer.forward({g.x.data(), T, H}, {y.data(), T, H});
    CHECK_FALSE(h.training);
    CHECK(h.id == 0);
  }
  cfg.training = true;
  moe_layer<P> layer(cfg, comm::local{}, arrays.views(cfg, E));
  const auto first = layer.forward({g.x.data(), T, H}, {y.data(), T, H});
  const auto second = layer.forward({g.x.data(), T, H}, {y.data(), T, H});
  CHECK(first.training);
  CHECK(second.id == first.id + 1);
  const auto refused = [&](auto h) -> std::string {
    try {
      layer.backward(h, {dy.data(), T, H}, {dx.data(), T, H}, views);
    } catch (const config_error& e) {
      return e.what();
    }
    return "";
  };
  // The layer keeps the last pass only: the first one's handle is stale.
  const std::string stale = refused(first);
  INFO(stale);
  CHECK(stale.find("pass 0") != std::string::npos);
  CHECK(stale.find("pass 1") != std::string::npos);
  CHECK(std::isnan(dx[0]));
  CHECK(refused(second).empty());
  CHECK(std::isfinite(dx[0]));
  // Consumed: once.
  CHECK(refused(second).find("consumed") != std::string::npos);
}
#endif

template <class Schedule>
struct deterministic_policies
    : train_policies<router::topk_softmax<2>, capacity::dropless, expert::swiglu, Schedule> {
  static constexpr layer_options options{.deterministic = true};
};

TEST_CASE("layer backward: deterministic, bit-identical across runs, allocations and timing",
          "[layer][backward]") {
  // Each run allocates its weights and buffers afresh (other alignments; without the option
  // the host's streaming GEMM then sums in another order) on 4 ranks whose threads interleave
  // differently every time.
  layer_config cfg = train_layer(4);
  cfg.chunks = 2;
  using P = deterministic_policies<schedule::pipelined<2>>;
  const auto w = reference::full_weights::random(cfg, 41);
  const auto g = test::make_tokens({20, 20, 20, 20}, cfg.hidden, 42);
  const auto dy = random_dy(g.total() * cfg.hidden, 43);
  const train_result a = train_step<P>(cfg, w, g, dy);
  for (int run = 0; run < 4; ++run) {
    const train_result b = train_step<P>(cfg, w, g, dy);
    int compared = 0;
    for (auto m : {&train_result::y, &train_result::dx, &train_result::dgate, &train_result::dw1,
                   &train_result::dw3, &train_result::dw2}) {
      REQUIRE((a.*m).size() == (b.*m).size());
      CHECK(same_bits(a.*m, b.*m));
      double worst = 0;
      for (std::size_t i = 0; i < (a.*m).size(); ++i)
        worst = std::max(worst, double(std::abs((a.*m)[i] - (b.*m)[i])));
      INFO("worst " << worst);
      CHECK(worst == 0);
      ++compared;
    }
    CHECK(compared == 6);
  }
  // Across rank counts: the same gradients within fp32 rounding.
  layer_config one = cfg;
  one.ranks = 1;
  one.max_tokens = 80;
  using S = deterministic_policies<schedule::sequential>;
  const auto g1 = test::make_tokens({80}, cfg.hidden, 42);
  REQUIRE(g1.x == g.x);
  const train_result c = train_step<S>(one, w, g1, dy);
  CHECK(test::relative_error(c.dx, a.dx) <= 1e-5);
  CHECK(test::relative_error(c.dgate, a.dgate) <= 1e-5);
  CHECK(test::relative_error(c.dw1, a.dw1) <= 1e-5);
}

}  // namespace layer_backward_tests
