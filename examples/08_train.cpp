// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
//
// Training in C++: one MoE layer on 4 in-process ranks (8 experts, top-2, experts split over
// the ranks) learns a task its experts can specialise on. Tokens come from 8 clusters; a
// token of cluster c wants y = A_c x (a different linear map per cluster), so a router that
// sends each cluster to its own experts wins. Each step: forward, the loss (mean squared
// error) and dy on every rank, backward, reduce_gradients (the gate is replicated: every rank
// applies the same summed gradient), Adam. Balance comes from the auxiliary loss (default)
// or from DeepSeek-V3's bias update (--bias: sigmoid router, update_router after each step).
// Prints the loss and the per-expert load (max/mean over all ranks) per step; exits 1 if the
// loss does not fall below the stated level or the load is more uneven than stated (without
// balancing, --aux-coef 0, it is: 1.55 here).
// Usage: epmoe_train [--steps N] [--bias] [--aux-coef A] [--every N] [--loss-below L]
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <random>
#include <type_traits>
#include <vector>

#include "args.hpp"
#include <epmoe/epmoe.hpp>
#include <epmoe/router/sigmoid_bias.hpp>

using namespace epmoe;

namespace {

constexpr int R = 4, E = 8, K = 2, H = 16, F = 32, clusters = 8;
constexpr index_t T = 64;  // tokens per rank and step

struct aux_policies : default_policies {
  using router = epmoe::router::topk_softmax<K>;
  using comm = epmoe::comm::threads;
};
struct bias_policies : default_policies {
  using router = epmoe::router::sigmoid_bias<K>;
  using comm = epmoe::comm::threads;
};

/// Adam over one flat parameter array (the same update on every rank for a replicated one).
struct adam {
  std::vector<float> m, v;
  void step(std::vector<float>& p, const std::vector<float>& g, int t, float lr) {
    if (m.empty()) m.assign(p.size(), 0.f), v.assign(p.size(), 0.f);
    const float b1 = 0.9f, b2 = 0.999f;
    const float c1 = 1.f - std::pow(b1, static_cast<float>(t)),
                c2 = 1.f - std::pow(b2, static_cast<float>(t));
    for (std::size_t i = 0; i < p.size(); ++i) {
      m[i] = b1 * m[i] + (1 - b1) * g[i];
      v[i] = b2 * v[i] + (1 - b2) * g[i] * g[i];
      p[i] -= lr * (m[i] / c1) / (std::sqrt(v[i] / c2) + 1e-8f);
    }
  }
};

/// The task: cluster centres and one map per cluster, the same on every rank.
struct task {
  std::vector<float> centre, map;  // [clusters, H], [clusters, H, H]
  explicit task(std::uint64_t seed) {
    std::mt19937_64 rng(seed);
    std::normal_distribution<float> n(0.f, 1.f);
    centre.resize(clusters * H), map.resize(clusters * H * H);
    for (float& c : centre) c = 2.f * n(rng);
    for (float& a : map) a = n(rng) / std::sqrt(float(H));
  }
  /// T tokens and their targets for one rank and step.
  void batch(std::mt19937_64& rng, std::vector<float>& x, std::vector<float>& target) const {
    std::normal_distribution<float> n(0.f, 0.3f);
    std::uniform_int_distribution<int> pick(0, clusters - 1);
    for (index_t t = 0; t < T; ++t) {
      const int c = pick(rng);
      for (int h = 0; h < H; ++h) x[t * H + h] = centre[c * H + h] + n(rng);
      for (int o = 0; o < H; ++o) {
        float s = 0.f;
        for (int h = 0; h < H; ++h) s += map[(c * H + o) * H + h] * x[t * H + h];
        target[t * H + o] = s;
      }
    }
  }
};

struct goals {
  double loss_below;  // final loss (mean over the last 10 steps) below this
  double load_below;  // final per-expert load max/mean below this
};

template <class P>
int train(int steps, int every, double aux_coef, goals want) {
  const layer_config cfg{.hidden = H,
                         .ffn = F,
                         .experts = E,
                         .top_k = K,
                         .ranks = R,
                         .max_tokens = static_cast<int>(T),
                         .aux_loss_coef = aux_coef,
                         .training = true};
  const task data(7);
  std::vector<double> losses(static_cast<std::size_t>(steps)), loads(losses.size());
  comm::threads_world world(R);
  world.run([&](typename P::comm c) {
    const int r = c.rank();
    const int L = E / R;
    std::mt19937_64 init(100);  // the gate: the same on every rank
    std::normal_distribution<float> n(0.f, 1.f);
    std::vector<float> gate(E * H), w1(L * F * H), w3(L * F * H), w2(L * H * F);
    for (float& v : gate) v = 0.1f * n(init);
    std::mt19937_64 mine(200 + r);  // this rank's experts
    for (float& v : w1) v = n(mine) / std::sqrt(float(H));
    for (float& v : w3) v = n(mine) / std::sqrt(float(H));
    for (float& v : w2) v = n(mine) / std::sqrt(float(F));
    std::vector<float> dgate(gate.size()), dw1(w1.size()), dw3(w3.size()), dw2(w2.size());
    using layer_t = moe_layer<P>;
    layer_t layer(
        cfg, c,
        {{gate.data(), E, H}, {{w1.data(), L, F, H}, {w3.data(), L, F, H}, {w2.data(), L, H, F}}});
    const typename layer_t::gradients grads{
        {dgate.data(), E, H},
        {{dw1.data(), L, F, H}, {dw3.data(), L, F, H}, {dw2.data(), L, H, F}}};
    adam opt_gate, opt1, opt3, opt2;
    std::vector<float> x(T * H), y(T * H), target(T * H), dy(T * H), dx(T * H);
    std::mt19937_64 rng(300 + r);
    std::vector<double> mine_loss(R), all_loss(R);
    for (int step = 0; step < steps; ++step) {
      data.batch(rng, x, target);
      layer.forward({x.data(), T, H}, {y.data(), T, H});
      // Loss = mean over every rank's tokens of |y - target|² / H; dy its gradient.
      double sq = 0;
      for (index_t i = 0; i < T * H; ++i) {
        const float d = y[i] - target[i];
        sq += double{d} * d;
        dy[i] = 2.f * d / static_cast<float>(R * T * H);
      }
      // The aux loss of every rank, averaged (its scale is 1/R per rank).
      const loss_scales aux{.aux = std::is_same_v<P, aux_policies> ? 1.0 / R : 0.0};
      layer.backward({dy.data(), T, H}, {dx.data(), T, H}, grads, {.losses = aux});
      layer.reduce_gradients(grads);
      const float lr = 1e-2f;
      opt_gate.step(gate, dgate, step + 1, lr);
      opt1.step(w1, dw1, step + 1, lr);
      opt3.step(w3, dw3, step + 1, lr);
      opt2.step(w2, dw2, step + 1, lr);
      const auto load = layer.gather_load();  // collective: every rank's routing
      if constexpr (router_with_bias<typename P::router>) layer.update_router();
      std::fill(mine_loss.begin(), mine_loss.end(), sq / double(R * T * H));
      c.alltoall(mine_loss.data(), all_loss.data(), 1);
      if (r == 0) {
        double total = 0;
        for (double v : all_loss) total += v;
        losses[static_cast<std::size_t>(step)] = total;
        loads[static_cast<std::size_t>(step)] = load.experts.max_over_mean;
      }
    }
  });
  for (int s = 0; s < steps; ++s)
    if (s % every == 0 || s == steps - 1)
      std::printf("step %4d  loss %.4f  expert load max/mean %.2f\n", s, losses[s], loads[s]);
  const int tail = std::min(10, steps);
  double loss = 0, load = 0;
  for (int s = steps - tail; s < steps; ++s) loss += losses[s] / tail, load += loads[s] / tail;
  const bool ok = loss < want.loss_below && load < want.load_below;
  std::printf(
      "\nfirst loss %.4f, last %d steps: loss %.4f (goal < %.3f), load max/mean %.2f "
      "(goal < %.2f): %s\n",
      losses[0], tail, loss, want.loss_below, load, want.load_below, ok ? "met" : "NOT met");
  return ok ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  cli::command_line cl(argc, argv,
                       "usage: epmoe_train [--steps N] [--bias] [--aux-coef A] [--every N]\n"
                       "                   [--loss-below L]\n"
                       "  Trains one MoE layer (8 experts, top-2) on 4 in-process ranks on a\n"
                       "  task of 8 clusters, each wanting its own linear map; prints the loss\n"
                       "  and the per-expert load every N steps (default 25) of 300.\n"
                       "  A: the auxiliary loss's coefficient (default 0.1; 0: no balancing).\n"
                       "  --bias: DeepSeek-V3's bias update instead of the auxiliary loss.\n"
                       "  Exits 1 unless the loss (mean of the last 10 steps) is below L\n"
                       "  (default 0.05) and the load max/mean below 1.35.\n");
  int steps = 300, every = 25;
  double aux_coef = 0.1;
  bool bias = false;
  goals want{0.05, 1.35};
  while (cl.next()) {
    if (cl.is("--steps"))
      steps = static_cast<int>(cl.integer());
    else if (cl.is("--every"))
      every = static_cast<int>(cl.integer());
    else if (cl.is("--bias"))
      bias = true;
    else if (cl.is("--aux-coef"))
      aux_coef = cl.number();
    else if (cl.is("--loss-below"))
      want.loss_below = cl.number();
    else
      cl.unknown();
  }
  if (steps < 1 || every < 1) cl.fail("--steps and --every must be >= 1");
  std::printf("MoE layer, %d experts top-%d on %d in-process ranks, %lld tokens per rank; %s\n\n",
              E, K, R, static_cast<long long>(T),
              bias ? "balance: DeepSeek-V3 bias update" : "balance: auxiliary loss");
  return bias ? train<bias_policies>(steps, every, aux_coef, want)
              : train<aux_policies>(steps, every, aux_coef, want);
}
