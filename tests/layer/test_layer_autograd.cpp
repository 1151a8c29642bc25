// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
// What a framework's autograd asks of one pass (docs/training.md, "From a framework"): a
// forward under no_grad keeps nothing and has no backward; frozen experts cost no dW; a
// given routing's weights get their gradient. On 1 and 2 thread ranks, per-assignment and
// per-rank dedup. Outputs start as NaN.
#include <catch2/catch.hpp>
#include <cmath>
#include <cstring>
#include <limits>
#include <mutex>
#include <string>
#include <vector>

#include "harness.hpp"

using namespace epmoe;

namespace {

constexpr float nan_f = std::numeric_limits<float>::quiet_NaN();

template <bool Dedup>
struct autograd_policies : default_policies {
  using space = epmoe::space::host;
  using comm = epmoe::comm::threads;
  using router = epmoe::router::topk_softmax<2>;
  using expert = epmoe::expert::swiglu;
  static constexpr layer_options options{.dedup = Dedup};
};

layer_config train_cfg(int ranks) {
  return {.hidden = 12,
          .ffn = 10,
          .experts = 8,
          .top_k = 2,
          .ranks = ranks,
          .max_tokens = 32,
          .training = true};
}

/// One rank's gradient arrays (NaN until written) and their views; `frozen`: empty expert views.
struct grads {
  std::vector<float> gate, w1, w3, w2;
  grads(const layer_config& c, index_t L)
      : gate(c.experts * c.hidden, nan_f),
        w1(L * c.ffn * c.hidden, nan_f),
        w3(w1.size(), nan_f),
        w2(w1.size(), nan_f) {}
  template <class P>
  typename moe_layer<P>::gradients views(const layer_config& c, index_t L, bool frozen) {
    typename moe_layer<P>::gradients g{};
    g.gate = {gate.data(), c.experts, c.hidden};
    if (!frozen)
      g.experts = {{w1.data(), L, c.ffn, c.hidden},
                   {w3.data(), L, c.ffn, c.hidden},
                   {w2.data(), L, c.hidden, c.ffn}};
    return g;
  }
};

/// Runs body(layer, x, T, L, r, cfg, lock) on R thread ranks, each with a training layer of
/// seeded weights (placement::block) and `tokens` seeded tokens; body takes the lock for its
/// checks, after its collective calls. Returns the ranks that ran to the end.
template <class P, class Body>
int on_ranks(int R, unsigned seed, index_t tokens, Body&& body) {
  const layer_config cfg = train_cfg(R);
  const auto w = reference::full_weights::random(cfg, seed);
  const auto g = test::make_tokens(std::vector<index_t>(R, tokens), cfg.hidden, seed + 1);
  int done = 0;
  std::mutex m;
  comm::threads_world(R).run([&](comm::threads c) {
    const int r = c.rank();
    const placement::block where(cfg);
    const index_t L = where.slots_per_rank();
    test::rank_arrays<P> arrays(w, reference::slice(w, where, r));
    moe_layer<P> layer(cfg, c, arrays.views(cfg, L));
    body(layer, g.x.data() + g.offset(r) * cfg.hidden, g.per_rank[r], L, r, cfg, m);
    std::lock_guard lock(m);
    ++done;
  });
  return done;
}

// Catches what `f` throws, as text ("" when nothing).
template <class F>
std::string thrown(F&& f) {
  try {
    f();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

}  // namespace

TEMPLATE_TEST_CASE("autograd: a forward that keeps nothing has the same outputs and no backward",
                   "[layer][autograd]", autograd_policies<false>, autograd_policies<true>) {
  using P = TestType;
  for (int R : {1, 2}) {
    const int ran = on_ranks<P>(
        R, 41, 9,
        [&](moe_layer<P>& layer, const float* x, index_t T, index_t L, int, const layer_config& cfg,
            std::mutex& m) {
          const index_t H = cfg.hidden;
          std::vector<float> kept(T * H, nan_f), bare(T * H, nan_f), dy(T * H, 1.f),
              dx(T * H, nan_f);
          grads gr(cfg, L);
          const auto kept_pass = layer.forward({x, T, H}, {kept.data(), T, H});
          const index_t saved = layer.stats().saved_bytes;
          const auto bare_pass =
              layer.forward({x, T, H}, {bare.data(), T, H}, {}, {.keep_for_backward = false});
          const index_t bare_saved = layer.stats().saved_bytes;
          // Every rank refuses the backward of the pass that kept nothing, and of the one before.
          const std::string none = thrown([&] {
            layer.backward(bare_pass, {dy.data(), T, H}, {dx.data(), T, H},
                           gr.views<P>(cfg, L, false));
          });
          const std::string stale = thrown([&] {
            layer.backward(kept_pass, {dy.data(), T, H}, {dx.data(), T, H},
                           gr.views<P>(cfg, L, false));
          });
          std::lock_guard lock(m);
          CHECK(kept_pass.training);
          CHECK_FALSE(bare_pass.training);
          CHECK(saved > 0);
          CHECK(bare_saved == 0);
          CHECK(std::memcmp(kept.data(), bare.data(), kept.size() * sizeof(float)) == 0);
          for (float v : bare) CHECK(std::isfinite(v));
          INFO(none);
          CHECK(none.find("keep_for_backward") != std::string::npos);
          CHECK(stale.find("last forward only") != std::string::npos);
          for (float v : dx) CHECK(std::isnan(v));  // nothing written
          for (float v : gr.gate) CHECK(std::isnan(v));
        });
    CHECK(ran == R);
  }
}

TEMPLATE_TEST_CASE("autograd: frozen experts: dx and the gate's gradient as before, no dW",
                   "[layer][autograd]", autograd_policies<false>, autograd_policies<true>) {
  using P = TestType;
  for (int R : {1, 2}) {
    const int ran = on_ranks<P>(
        R, 43, 11,
        [&](moe_layer<P>& layer, const float* x, index_t T, index_t L, int r,
            const layer_config& cfg, std::mutex& m) {
          const index_t H = cfg.hidden;
          std::vector<float> y(T * H, nan_f), dy(T * H), dx_full(T * H, nan_f), dx(T * H, nan_f);
          for (index_t i = 0; i < T * H; ++i) dy[i] = std::sin(0.3f * static_cast<float>(i + r));
          grads full(cfg, L), frozen(cfg, L);
          layer.forward({x, T, H}, {y.data(), T, H});
          layer.backward({dy.data(), T, H}, {dx_full.data(), T, H}, full.views<P>(cfg, L, false));
          layer.forward({x, T, H}, {y.data(), T, H});
          layer.backward({dy.data(), T, H}, {dx.data(), T, H}, frozen.views<P>(cfg, L, true));
          // All or none: one expert tensor without the others is named.
          layer.forward({x, T, H}, {y.data(), T, H});
          auto partial = frozen.views<P>(cfg, L, false);
          partial.experts.w3 = {};
          const std::string named = thrown([&] {
            layer.backward({dy.data(), T, H}, {dx.data(), T, H}, partial);
          });
          std::lock_guard lock(m);
          CHECK(std::memcmp(dx.data(), dx_full.data(), dx.size() * sizeof(float)) == 0);
          CHECK(std::memcmp(frozen.gate.data(), full.gate.data(), full.gate.size() * 4) == 0);
          for (float v : dx) CHECK(std::isfinite(v));
          for (const auto* v : {&frozen.w1, &frozen.w3, &frozen.w2})
            for (float f : *v) CHECK(std::isnan(f));  // never touched
          for (const auto* v : {&full.w1, &full.w3, &full.w2})
            for (float f : *v) CHECK(std::isfinite(f));
          INFO(named);
          CHECK(named.find("grads.experts.w3") != std::string::npos);
        });
    CHECK(ran == R);
  }
}

TEMPLATE_TEST_CASE("autograd: a given routing's weights get dL/dw = dy . E_k(x), 0 where empty",
                   "[layer][autograd]", autograd_policies<false>, autograd_policies<true>) {
  using P = TestType;
  for (int R : {1, 2}) {
    const int ran = on_ranks<P>(
        R, 45, 7,
        [&](moe_layer<P>& layer, const float* x, index_t T, index_t L, int r,
            const layer_config& cfg, std::mutex& m) {
          const index_t H = cfg.hidden, K = 2, E = cfg.experts;
          std::vector<std::int32_t> ids(T * K);
          std::vector<float> rw(T * K), dy(T * H), y(T * H, nan_f), dx(T * H, nan_f),
              dw(T * K, nan_f);
          for (index_t t = 0; t < T; ++t) {
            ids[t * K] = static_cast<std::int32_t>((t + 3 * r) % E);
            ids[t * K + 1] = t == 2 ? no_expert : static_cast<std::int32_t>((t + 5) % E);
            if (ids[t * K + 1] == ids[t * K]) ids[t * K + 1] = (ids[t * K] + 1) % E;
            rw[t * K] = 0.25f + 0.05f * static_cast<float>(t), rw[t * K + 1] = 0.5f;
          }
          for (index_t i = 0; i < T * H; ++i) dy[i] = std::cos(0.7f * static_cast<float>(i) + r);
          const auto loss = [&](const std::vector<float>& weights) {  // L = sum dy . y
            std::vector<float> out(T * H, nan_f);
            layer.forward({x, T, H}, {{ids.data(), T, K}, {weights.data(), T, K}},
                          {out.data(), T, H}, {.keep_for_backward = false});
            double s = 0;
            for (index_t i = 0; i < T * H; ++i) s += static_cast<double>(dy[i]) * out[i];
            return s;
          };
          // y is linear in the weights: central differences are exact up to rounding. Every
          // rank runs every pass (collective), one weight at a time.
          std::vector<double> fd(T * K);
          const index_t most = 7 * K;  // every rank's count, so all take part in each pass
          for (index_t i = 0; i < most; ++i) {
            std::vector<float> up = rw, down = rw;
            if (i < T * K) up[i] += 0.125f, down[i] -= 0.125f;
            const double lu = loss(up), ld = loss(down);
            if (i < T * K) fd[i] = (lu - ld) / 0.25;
          }
          grads gr(cfg, L);
          layer.forward({x, T, H}, {{ids.data(), T, K}, {rw.data(), T, K}}, {y.data(), T, H});
          layer.backward({dy.data(), T, H}, {dx.data(), T, H}, gr.views<P>(cfg, L, false),
                         {.routing_grad = {dw.data(), T, K}});
          // A computed routing has no routing gradient to give: named.
          layer.forward({x, T, H}, {y.data(), T, H});
          std::vector<float> dw2(T * K, nan_f);
          const std::string named = thrown([&] {
            layer.backward({dy.data(), T, H}, {dx.data(), T, H}, gr.views<P>(cfg, L, false),
                           {.routing_grad = {dw2.data(), T, K}});
          });
          std::lock_guard lock(m);
          for (index_t i = 0; i < T * K; ++i) {
            INFO("rank " << r << " assignment " << i);
            REQUIRE(std::isfinite(dw[i]));
            CHECK(std::abs(dw[i] - fd[i]) <= 1e-4 * (1 + std::abs(fd[i])));
            if (ids[i] == no_expert) CHECK(dw[i] == 0.f);
          }
          for (float v : dw2) CHECK(std::isnan(v));
          INFO(named);
          CHECK(named.find("routing_grad") != std::string::npos);
        });
    CHECK(ran == R);
  }
}
