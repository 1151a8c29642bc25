// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
#pragma once

// A training loop on one layer object, checked step by step against the float64 reference
// (docs/training.md, "Training loops"): forward (k micro-batches) -> backward (accumulating
// across them) -> reduce_gradients -> an SGD step on the weights the layer views -> repack
// when packed -> update_router for a biased router. After each step every rank gathers the
// updated weights over the layer's comm (which also proves every copy of a replicated
// parameter agrees), so the reference of the next step runs on exactly the weights the layer
// reads. Runs on any comm (threads, MPI) on space::host; reports errors, asserts nothing, so a
// test framework (or a user checking their own policies) decides.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "epmoe/comm/threads.hpp"
#include "epmoe/moe_layer.hpp"
#include "epmoe/reference/backward.hpp"
#include "epmoe/reference/compare.hpp"
#include "epmoe/reference/forward.hpp"
#include "epmoe/reference/weights.hpp"
#include "epmoe/space/host_packed_kernels.hpp"

namespace epmoe::testing {

/// One step of the loop.
struct loop_step {
  std::vector<index_t> tokens{};  // per rank (empty: 24 on every rank)
  int micro_batches = 1;          // forward+backward passes over slices of each rank's tokens
  bool accumulate = false;        // true: gradients zeroed, every micro-batch accumulates;
                                  // false: NaN first, the first overwrites, the rest accumulate
  bool backward = true;           // false: forward passes only (no gradients, no update)
  std::optional<packed_precision> pack{};  // repack in this precision before the step
};

template <class P>
struct loop_options {
  typename P::router router{};
  typename P::capacity capacity{};
  std::optional<typename P::placement> placement{};
  loss_scales losses{};
  std::vector<loop_step> steps = std::vector<loop_step>(4);
  float lr = 0.125f;                 // SGD's step (a power of two: the update is one rounding)
  std::uint64_t seed = 1;            // weights, tokens and dy
  bool update_router = true;         // routers with a bias: update_router after each step
  bool one_batch_reference = false;  // the reference of a step's micro-batches is one backward
                                     // of their concatenation (token routers, no drops/losses)
  double tolerance = 2e-5;           // fp32 steps
  double bf16_tolerance = 1e-4;      // steps over bf16 packed copies (vs the rounded weights)
};

/// What one rank checked: (step, what, error) rows; a row passes when error <= its tol.
struct loop_report {
  struct row {
    int step = 0, rank = 0;
    std::string what;
    double error = 0, tol = 0;
  };
  std::vector<row> rows;
  void add(int step, int rank, std::string what, double e, double tol) {
    rows.push_back({step, rank, std::move(what), std::isnan(e) ? INFINITY : e, tol});
  }
  void merge(const loop_report& o) { rows.insert(rows.end(), o.rows.begin(), o.rows.end()); }
  std::vector<row> failures() const {
    std::vector<row> f;
    for (const row& r : rows)
      if (!(r.error <= r.tol)) f.push_back(r);
    return f;
  }
  /// "step 2 rank 1 dw1: 3e-3 > 2e-5; ..." (empty when every row passed).
  std::string text() const {
    std::string s;
    for (const row& r : failures())
      s += "step " + std::to_string(r.step) + " rank " + std::to_string(r.rank) + " " + r.what +
           ": " + std::to_string(r.error) + " > " + std::to_string(r.tol) + "; ";
    return s;
  }
};

namespace detail {

template <class X>
struct grad_views;
template <class Act>
struct grad_views<expert::glu<Act>> {
  static constexpr bool gated = true, biases = false;
  static typename expert::glu<Act>::grads of(reference::rank_weights& g) {
    const index_t L = g.local, H = g.hidden, F = g.ffn;
    return {{g.w1.data(), L, F, H}, {g.w3.data(), L, F, H}, {g.w2.data(), L, H, F}};
  }
  static typename expert::glu<Act>::grads shared(reference::full_weights& g) {
    const index_t N = g.cfg.shared_experts, H = g.cfg.hidden, F = g.cfg.shared_width();
    return {{g.shared_w1.data(), N, F, H},
            {g.shared_w3.data(), N, F, H},
            {g.shared_w2.data(), N, H, F}};
  }
};
template <class Act, bool Biases>
struct grad_views<expert::mlp<Act, Biases>> {
  static constexpr bool gated = false, biases = Biases;
  static typename expert::mlp<Act, Biases>::grads of(reference::rank_weights& g) {
    const index_t L = g.local, H = g.hidden, F = g.ffn;
    return {{g.w1.data(), L, F, H},
            {g.w2.data(), L, H, F},
            {g.b1.data(), L, 1, F},
            {g.b2.data(), L, 1, H}};
  }
  static typename expert::mlp<Act, Biases>::grads shared(reference::full_weights& g) {
    const index_t N = g.cfg.shared_experts, H = g.cfg.hidden, F = g.cfg.shared_width();
    return {{g.shared_w1.data(), N, F, H},
            {g.shared_w2.data(), N, H, F},
            {g.shared_b1.data(), N, 1, F},
            {g.shared_b2.data(), N, 1, H}};
  }
};

inline std::vector<float> to_float(const std::vector<double>& v) { return {v.begin(), v.end()}; }
inline double error_of(std::span<const float> got, std::span<const float> want) {
  return reference::max_relative_error(std::vector<float>(got.begin(), got.end()),
                                       std::vector<float>(want.begin(), want.end()));
}
inline bool same_bits(std::span<const float> a, std::span<const float> b) {
  return a.size() == b.size() && (a.empty() || !std::memcmp(a.data(), b.data(), a.size_bytes()));
}

/// The tensors a step trains, by name: the rank's value, its gradient and, per element of the
/// expected gradient, where it is in the reference's (slot tensors: their logical expert's).
struct trained {
  const char* name;
  std::vector<float>* value;
  std::vector<float>* grad;
  const std::vector<double>* want;  // the reference gradient, whole
  std::vector<float>* into;         // the reference's tensor, whole
  index_t per_slot = 0;             // > 0: a slot tensor, `per_slot` elements per expert
};

/// A step's tokens: every rank's, rank after rank.
struct batch {
  std::vector<index_t> per_rank;
  std::vector<float> x, dy;
  std::vector<std::int64_t> ids;  // [total] token ids, or empty
  index_t offset(int r) const {
    index_t o = 0;
    for (int q = 0; q < r; ++q) o += per_rank[static_cast<std::size_t>(q)];
    return o;
  }
  index_t total() const { return offset(static_cast<int>(per_rank.size())); }
  /// Micro-batch i of k: rows [T i / k, T (i + 1) / k) of every rank's tokens.
  batch micro(int i, int k, index_t H) const {
    batch b;
    for (int r = 0; r < static_cast<int>(per_rank.size()); ++r) {
      const index_t T = per_rank[static_cast<std::size_t>(r)], a = T * i / k, z = T * (i + 1) / k,
                    at = (offset(r) + a) * H;
      b.per_rank.push_back(z - a);
      b.x.insert(b.x.end(), x.begin() + at, x.begin() + at + (z - a) * H);
      b.dy.insert(b.dy.end(), dy.begin() + at, dy.begin() + at + (z - a) * H);
      if (!ids.empty())
        b.ids.insert(b.ids.end(), ids.begin() + offset(r) + a, ids.begin() + offset(r) + z);
    }
    return b;
  }
};

}  // namespace detail

/// One rank's loop: runs every step of `opt` on one moe_layer<P> over make_comm() (collective:
/// every rank calls it with the same cfg and options) and checks, after every step, its
/// outputs, dx and (after reduce_gradients) every gradient it holds against the reference.
/// make_comm is called twice: the layer's comm and the one that gathers the weights (an MPI
/// comm duplicates its communicator; comm::threads copies share the rank's mailbox).
template <class P, class MakeComm>
loop_report run_rank(MakeComm make_comm, layer_config cfg, const loop_options<P>& opt) {
  using X = typename P::expert;
  using router_t = typename P::router;
  using G = detail::grad_views<X>;
  static_assert(std::derived_from<typename P::space, space::host>,
                "testing::run_rank: space::host (the arrays are host vectors)");
  constexpr float nan = std::numeric_limits<float>::quiet_NaN();
  cfg.training = true;
  typename P::comm comm = make_comm();
  const int r = comm.rank(), R = cfg.ranks;
  const index_t H = cfg.hidden, E = cfg.experts, F = cfg.ffn;
  const typename P::placement where = opt.placement ? *opt.placement : typename P::placement(cfg);
  const index_t L = where.slots_per_rank();
  loop_report report;

  // The whole model as the reference sees it, and this rank's arrays the layer views.
  reference::full_weights full = reference::full_weights::random(cfg, opt.seed);
  reference::full_weights mine = full;  // the replicated tensors (gate, shared, ...)
  reference::rank_weights slots = reference::slice(full, where, r);
  reference::full_weights dmine = mine;
  reference::rank_weights dslots = slots;
  const auto weights = [&] {
    typename moe_layer<P>::weights w{
        mine.gate_view(), reference::views_of<X>::of(slots), {}, mine.noise_gate_view(), {}, {}};
    if (cfg.shared_experts > 0) w.shared = reference::views_of<X>::shared(mine);
    if (cfg.shared_gate) w.shared_gate = {mine.shared_gate.data(), cfg.shared_experts, H};
    if (cfg.output_bias) w.output_bias = {mine.output_bias.data(), 1, H};
    return w;
  };
  const auto grads = [&] {
    typename moe_layer<P>::gradients g{{dmine.gate.data(), E, H},      G::of(dslots), {}, {}, {},
                                       {dmine.noise_gate.data(), E, H}};
    if (cfg.shared_experts > 0) g.shared = G::shared(dmine);
    if (cfg.shared_gate) g.shared_gate = {dmine.shared_gate.data(), cfg.shared_experts, H};
    if (cfg.output_bias) g.output_bias = {dmine.output_bias.data(), 1, H};
    return g;
  };
  moe_layer<P> layer(cfg, make_comm(), weights(), opt.router, opt.capacity, where);
  std::vector<float> bias(static_cast<std::size_t>(E), 0.f);  // the reference's router bias
  if constexpr (router_with_bias<router_t>)
    if (opt.router.bias) std::copy_n(opt.router.bias, E, bias.begin());

  // What this configuration trains.
  bool noisy = false;
  if constexpr (router_with_noise_gate<router_t>) noisy = opt.router.training;
  reference::gradients want;  // the step's reference, filled below
  std::vector<detail::trained> tensors;
  using W = reference::full_weights;
  using D = reference::gradients;
  // A replicated tensor: mine's, dmine's, the reference's (the same member of each).
  const auto train = [&](const char* n, std::vector<float> W::*v, std::vector<double> D::*w) {
    tensors.push_back({n, &(mine.*v), &(dmine.*v), &(want.*w), &(full.*v), 0});
  };
  // A slot tensor: slots', dslots', the reference's logical experts'.
  const auto train_slots = [&](const char* n, std::vector<float> reference::rank_weights::*v,
                               std::vector<double> D::*w, std::vector<float> W::*f, index_t per) {
    tensors.push_back({n, &(slots.*v), &(dslots.*v), &(want.*w), &(full.*f), per});
  };
  if constexpr (router_t::uses_gate) train("dgate", &W::gate, &D::dgate);
  if (noisy) train("dnoise_gate", &W::noise_gate, &D::dnoise_gate);
  train_slots("dw1", &reference::rank_weights::w1, &D::dw1, &W::w1, F * H);
  if (G::gated) train_slots("dw3", &reference::rank_weights::w3, &D::dw3, &W::w3, F * H);
  train_slots("dw2", &reference::rank_weights::w2, &D::dw2, &W::w2, H * F);
  if (G::biases) {
    train_slots("db1", &reference::rank_weights::b1, &D::db1, &W::b1, F);
    train_slots("db2", &reference::rank_weights::b2, &D::db2, &W::b2, H);
  }
  if (cfg.shared_experts > 0) {
    train("dshared_w1", &W::shared_w1, &D::dshared_w1);
    if (G::gated) train("dshared_w3", &W::shared_w3, &D::dshared_w3);
    train("dshared_w2", &W::shared_w2, &D::dshared_w2);
    if (G::biases) {
      train("dshared_b1", &W::shared_b1, &D::dshared_b1);
      train("dshared_b2", &W::shared_b2, &D::dshared_b2);
    }
  }
  if (cfg.shared_gate) train("dshared_gate", &W::shared_gate, &D::dshared_gate);
  if (cfg.output_bias) train("doutput_bias", &W::output_bias, &D::doutput_bias);

  packed_precision precision = packed_precision::fp32;
  if constexpr (requires { P::options.pack_as; }) precision = P::options.pack_as;

  // The reference's weights of a step: the experts rounded as bf16 packed copies hold them.
  const auto reference_weights = [&] {
    reference::full_weights w = full;
    w.cfg = cfg;
    if (layer.weights_packed() && precision == packed_precision::bf16)
      for (auto* v : {&w.w1, &w.w3, &w.w2, &w.shared_w1, &w.shared_w3, &w.shared_w2})
        for (float& x : *v) x = space::bf16_rounded(x);
    return w;
  };
  // A reference router reading the reference's bias.
  const auto reference_router = [&] {
    router_t rr = opt.router;
    if constexpr (router_with_bias<router_t>) rr.bias = bias.data();
    return rr;
  };

  std::uint64_t ran = 0;  // forward passes so far
  for (int s = 0; s < static_cast<int>(opt.steps.size()); ++s) {
    const loop_step& step = opt.steps[static_cast<std::size_t>(s)];
    if (step.pack) {
      precision = *step.pack;
      layer.pack_weights(precision);
    }
    const double tol = layer.weights_packed() && precision == packed_precision::bf16
                           ? opt.bf16_tolerance
                           : opt.tolerance;
    detail::batch b;
    b.per_rank =
        step.tokens.empty() ? std::vector<index_t>(static_cast<std::size_t>(R), 24) : step.tokens;
    const std::uint64_t seed = opt.seed * 1000 + static_cast<std::uint64_t>(s) * 10;
    b.x = reference::random_tokens(b.total(), H, seed + 1);
    b.dy = reference::random_tokens(b.total(), H, seed + 2);
    if constexpr (router_needs_token_ids<router_t>)  // vocabulary ids (router::hash)
      for (index_t t = 0; t < b.total(); ++t) b.ids.push_back((t * 7 + s) % 13);
    const index_t T = b.per_rank[static_cast<std::size_t>(r)];
    const int k = std::max(1, step.micro_batches);
    const reference::full_weights rw = reference_weights();
    const router_t rr = reference_router();

    // The layer's passes, and the reference of each (or of the whole step).
    std::vector<float> y(static_cast<std::size_t>(T * H), nan), dx = y, want_y = y, want_dx = y;
    for (auto& t : tensors) std::fill(t.grad->begin(), t.grad->end(), step.accumulate ? 0.f : nan);
    want = reference::gradients::zeros(cfg, b.total());
    const std::uint64_t first_pass = ran;
    std::vector<index_t> load(static_cast<std::size_t>(E), 0);
    for (int i = 0; i < k; ++i) {
      const detail::batch m = b.micro(i, k, H);
      const index_t Tm = m.per_rank[static_cast<std::size_t>(r)], at = m.offset(r) * H,
                    mine_at = T * i / k * H;
      const std::uint64_t pass = ran++;  // the noise's counter: passes run so far
      const std::span<const std::int64_t> ids =
          m.ids.empty() ? std::span<const std::int64_t>{}
                        : std::span<const std::int64_t>(m.ids).subspan(m.offset(r), Tm);
      auto handle = layer.forward({m.x.data() + at, Tm, H}, {y.data() + mine_at, Tm, H}, ids);
      if (step.backward)
        layer.backward(handle, {m.dy.data() + at, Tm, H}, {dx.data() + mine_at, Tm, H}, grads(),
                       {.losses = opt.losses, .accumulate = step.accumulate || i > 0});
      const reference::pass_options po{m.ids, pass};
      const index_t n = m.total();
      std::vector<float> ym(static_cast<std::size_t>(n * H), nan);
      reference::forward<X>(rw, rr, opt.capacity, where, {m.x.data(), n, H}, m.per_rank,
                            {ym.data(), n, H}, po);
      std::copy_n(ym.begin() + at, Tm * H, want_y.begin() + mine_at);
      if (i == k - 1)  // the load update_router sums: the last pass's routed assignments
        for (const auto& route : reference::route_ranks(rw, rr, {m.x.data(), n, H}, m.per_rank, po))
          for (std::int32_t e : route.ids)
            if (e != no_expert) ++load[static_cast<std::size_t>(e)];
      if (!step.backward || opt.one_batch_reference) continue;
      reference::gradients g = reference::backward<X>(
          rw, rr, opt.capacity, where, {m.x.data(), n, H}, m.per_rank, {m.dy.data(), n, H}, po);
      if constexpr (reference::router_with_losses<router_t>)
        if (opt.losses.aux != 0 || opt.losses.seq_aux != 0 || opt.losses.z != 0) {
          const reference::gradients l =
              reference::loss_backward(rw, rr, {m.x.data(), n, H}, m.per_rank, opt.losses, po);
          for (std::size_t j = 0; j < g.dgate.size(); ++j) g.dgate[j] += l.dgate[j];
          for (std::size_t j = 0; j < g.dx.size(); ++j) g.dx[j] += l.dx[j];
        }
      std::copy_n(g.dx.begin() + at, Tm * H, want_dx.begin() + mine_at);
      g.dx.clear();
      const auto add = [](std::vector<double>& into, const std::vector<double>& v) {
        for (std::size_t j = 0; j < into.size() && j < v.size(); ++j) into[j] += v[j];
      };
      for (std::vector<double> D::*p :
           {&D::dgate, &D::dw1, &D::dw3, &D::dw2, &D::db1, &D::db2, &D::dshared_w1, &D::dshared_w3,
            &D::dshared_w2, &D::dshared_b1, &D::dshared_b2, &D::dshared_gate, &D::doutput_bias,
            &D::dnoise_gate})
        add(want.*p, g.*p);
    }
    if (step.backward && opt.one_batch_reference) {
      const index_t n = b.total();
      want = reference::backward<X>(rw, rr, opt.capacity, where, {b.x.data(), n, H}, b.per_rank,
                                    {b.dy.data(), n, H}, {b.ids, first_pass});
      for (index_t t = 0; t < T * H; ++t)
        want_dx[static_cast<std::size_t>(t)] = static_cast<float>(want.dx[b.offset(r) * H + t]);
    }
    report.add(s, r, "y", detail::error_of(y, want_y), tol);
    report.add(s, r, "passes()", layer.passes() == ran ? 0 : INFINITY, 0);
    if (!step.backward) continue;
    report.add(s, r, "dx", detail::error_of(dx, want_dx), tol);

    // Every gradient this rank holds after the reduce: the sums, a slot its expert's.
    layer.reduce_gradients(grads());
    for (const detail::trained& t : tensors) {
      std::vector<float> w = detail::to_float(*t.want);
      if (t.per_slot > 0) {
        std::vector<float> mine_w(static_cast<std::size_t>(L * t.per_slot));
        for (index_t j = 0; j < L; ++j)
          std::copy_n(w.begin() + where.expert_at(r, static_cast<int>(j)) * t.per_slot, t.per_slot,
                      mine_w.begin() + j * t.per_slot);
        w = std::move(mine_w);
      }
      report.add(s, r, t.name, detail::error_of(*t.grad, w), tol);
    }

    // The optimizer step on the arrays the layer views; packed copies are repacked.
    for (const detail::trained& t : tensors)
      for (std::size_t j = 0; j < t.value->size(); ++j) (*t.value)[j] -= opt.lr * (*t.grad)[j];
    if (layer.weights_packed()) layer.pack_weights(precision);

    // Every rank's tensors to every rank: the reference's next weights; the copies agree.
    std::vector<float> send;
    for (const detail::trained& t : tensors)
      send.insert(send.end(), t.value->begin(), t.value->end());
    const auto n = static_cast<index_t>(send.size());
    std::vector<float> all(static_cast<std::size_t>(n * R));
    {
      std::vector<float> to_all(static_cast<std::size_t>(n * R));
      for (int q = 0; q < R; ++q) std::copy(send.begin(), send.end(), to_all.begin() + q * n);
      comm.alltoall(to_all.data(), all.data(), n);
    }
    bool agree = true;
    std::vector<std::vector<char>> seen(tensors.size(), std::vector<char>(E, 0));
    for (int q = 0; q < R; ++q) {
      const float* from = all.data() + q * n;
      for (std::size_t i = 0; i < tensors.size(); ++i) {
        const detail::trained& t = tensors[i];
        const std::size_t size = t.value->size();
        if (t.per_slot == 0) {  // replicated: every rank's bit-identical
          agree = agree && detail::same_bits({from, size}, *t.value);
          std::copy_n(from, size, t.into->begin());
        }
        for (index_t j = 0; t.per_slot > 0 && j < L; ++j) {  // a slot: its expert's (copies agree)
          const int e = where.expert_at(q, static_cast<int>(j));
          const std::span<const float> v(from + j * t.per_slot,
                                         static_cast<std::size_t>(t.per_slot));
          float* dst = t.into->data() + e * t.per_slot;
          if (seen[i][static_cast<std::size_t>(e)])
            agree = agree && detail::same_bits(v, {dst, v.size()});
          std::copy(v.begin(), v.end(), dst);
          seen[i][static_cast<std::size_t>(e)] = 1;
        }
        from += size;
      }
    }
    report.add(s, r, "copies agree", agree ? 0 : INFINITY, 0);

    // A biased router: the load every rank sums, and the bias it moves the same way.
    if constexpr (router_with_bias<router_t>)
      if (opt.update_router) {
        const std::span<const index_t> got = layer.update_router();
        bool same = got.size() == load.size() && std::equal(got.begin(), got.end(), load.begin());
        report.add(s, r, "update_router load", same ? 0 : INFINITY, 0);
        rr.update_bias(bias, load);
        const std::span<const float> lb = layer.router_bias();
        report.add(s, r, "router bias", detail::same_bits(lb, bias) ? 0 : INFINITY, 0);
      }
  }
  return report;
}

/// run_rank on cfg.ranks in-process ranks (comm::threads); every rank's rows.
template <class P>
loop_report run_threads(const layer_config& cfg, const loop_options<P>& opt) {
  std::vector<loop_report> per(static_cast<std::size_t>(cfg.ranks));
  comm::threads_world world(cfg.ranks);
  world.run([&](typename P::comm c) {
    per[static_cast<std::size_t>(c.rank())] = run_rank<P>([&] { return c; }, cfg, opt);
  });
  loop_report all;
  for (const loop_report& p : per) all.merge(p);
  return all;
}

}  // namespace epmoe::testing
