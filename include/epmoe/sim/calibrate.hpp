// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <random>
#include <vector>

#include "epmoe/comm/threads.hpp"
#include "epmoe/core/config.hpp"
#include "epmoe/core/losses.hpp"
#include "epmoe/core/rows.hpp"
#include "epmoe/expert/swiglu.hpp"
#include "epmoe/router/topk_softmax.hpp"
#include "epmoe/sim/topology.hpp"
#include "epmoe/space/host.hpp"

// Calibration: measures this machine's rates as R ranks of a communicator see them (the
// exchange of comm::threads or comm::mpi, host expert and gate GEMMs, the router's top-k, row
// copies, memory reads) and turns them into a topology. Every rank runs each probe at the
// same time, as the layer's ranks do, so shared cores and caches count.
namespace epmoe::sim {

struct calibration_options {
  int ranks = 2;                  // calibrate(): in-process ranks (measure() takes the comm's)
  int hidden = 512, ffn = 1024;   // expert shape of the GEMM probe
  index_t gemm_rows = 128;        // rows per expert (about R * T * K / E)
  int gemm_calls = 4;             // experts per probe (local slots)
  index_t tokens = 256;           // route and copy probes: T tokens per rank
  int experts = 8, top_k = 2;     // route probe: gate [E, H], top-K
  index_t small_bytes = 4 << 10;  // per peer, the latency point of the exchange fit
  index_t large_bytes = 1 << 20;  // per peer, the bandwidth point
  int exchanges = 20;             // per size (best of)
  int reps = 7;                   // GEMM, route, copy and memory probes (best of)
  std::size_t memory_bytes = std::size_t{128} << 20;  // streamed per rank
  std::size_t cold_bytes = std::size_t{48} << 20;     // streamed before a copy or exchange sample
};

/// What the probes measured (the slowest rank's figure for each).
struct calibration {
  double exchange_small = 0, exchange_large = 0;  // s: best alltoallv of each size
  double latency = 0, bandwidth = 0;              // fit: small = latency + (R-1) small / bandwidth
  double gemm_flops = 0;                          // FLOP/s of the layer's expert FFN code
  std::vector<std::pair<double, double>> gemm_curve;  // (rows, FLOP/s) at M/4, M/2 and M rows
  double route_seconds = 0;                           // s: gate GEMM + top-k of `tokens` tokens
  double topk_rate = 0;          // logits/s that makes route_seconds() match the probe
  double copy_bandwidth = 0;     // bytes/s of permute's row gather, warm source, cold destination
  double regroup_bandwidth = 0;  // bytes/s of the regroup's row copies, likewise
  double reduce_bandwidth = 0;  // bytes/s (rows in + out) of the weighted reduce, warm in, cold out
  double memory_bandwidth = 0;  // bytes/s streaming reads
  topology topo;                // nodes 1, ranks_per_node R, fp32 rows
};

namespace detail {

inline double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::nth_element(v.begin(), v.begin() + v.size() / 2, v.end());
  return v[v.size() / 2];
}

inline double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// The router's top-k over T tokens of E logits, then the router losses, as the layer's route
// stage runs them (topk_softmax<K> for the K the options name).
struct route_scratch {
  std::vector<std::int32_t> ids;
  std::vector<float> weights, probs;
  std::vector<double> acc;
  router_losses losses;
};
template <int K>
void route_probe(const layer_config& cfg, matrix_view<const float> logits, route_scratch& s) {
  const router::topk_softmax<K> r{};
  const index_t T = logits.rows;
  for (index_t t = 0; t < T; ++t)
    r.route_token({logits.row(t), nullptr, static_cast<int>(logits.cols), t, 0},
                  s.ids.data() + t * K, s.weights.data() + t * K);
  const routing_view routing{{s.ids.data(), T, K}, {s.weights.data(), T, K}};
  compute_losses(r, cfg, logits, routing, std::span<float>(s.probs), std::span<double>(s.acc),
                 s.losses);
}
inline void route_probe(const layer_config& cfg, matrix_view<const float> logits,
                        route_scratch& s) {
  switch (cfg.top_k) {
    case 1:
      return route_probe<1>(cfg, logits, s);
    case 2:
      return route_probe<2>(cfg, logits, s);
    case 4:
      return route_probe<4>(cfg, logits, s);
    case 6:
      return route_probe<6>(cfg, logits, s);
    default:
      return route_probe<8>(cfg, logits, s);  // other K: priced as top-8
  }
}
/// Streams 48 MiB of its own through the caches: what the rest of a model (attention, the other
/// layers) does between two passes of one MoE layer. The validation runs it before every
/// pass and the copy and exchange probes before every sample, so both start cold; without it,
/// back-to-back passes whose activations fit in the cache copy rows faster than a layer in a
/// model does (the cost model has no cache).
class cold_caches {
 public:
  explicit cold_caches(std::size_t bytes = std::size_t{48} << 20)
      : data_(std::max<std::size_t>(bytes / sizeof(float), 8), 1.f) {}
  void operator()() { read(data_.data(), data_.size()); }

  /// Reads n floats (8 independent sums, which vectorise) so the compiler cannot skip them;
  /// returns how many it read (n rounded down to 8).
  std::size_t read(const float* p, std::size_t n) {
    float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    n = n / 8 * 8;
    for (std::size_t j = 0; j < n; j += 8)
      for (int k = 0; k < 8; ++k) acc[k] += p[j + k];
    sink_ = sink_ + acc[0] + acc[1] + acc[2] + acc[3] + acc[4] + acc[5] + acc[6] + acc[7];
    return n;
  }

 private:
  std::vector<float> data_;
  volatile float sink_ = 0;
};

inline double best(const std::vector<double>& v, bool largest) {
  if (v.empty()) return 0;
  return largest ? *std::max_element(v.begin(), v.end()) : *std::min_element(v.begin(), v.end());
}

}  // namespace detail

inline void fit(calibration& cal, const calibration_options& o, int R);

/// Collective: every rank of `c` runs the probes at once; every rank returns the same
/// calibration (the slowest rank's rate of each probe). The exchange fit: every rank sends n
/// bytes to every other rank (rows to itself are priced as copies); the slowest rank's
/// median at two sizes gives latency + (R - 1) n / bandwidth, the form class_seconds()
/// prices. The route probe runs the gate GEMM and topk_softmax<K>'s per-token code; the copy
/// probe gathers T*K rows of H floats, tokens ascending per block, as permute does.
template <class Comm>
calibration measure(Comm& c, const calibration_options& o) {
  using clock = std::chrono::steady_clock;
  const int R = c.size();
  epmoe::detail::require(o.hidden >= 1 && o.ffn >= 1, "calibration hidden/ffn", o.hidden,
                         "must be >= 1");
  epmoe::detail::require(o.tokens >= 1 && o.experts >= o.top_k && o.top_k >= 1,
                         "calibration tokens/experts/top_k", o.tokens,
                         "need tokens >= 1 and 1 <= top_k <= experts");
  // Every copy and exchange sample starts from cold caches (as a pass in a model does), then
  // warms what the stage before it just touched (the probes below say what).
  detail::cold_caches evict(o.cold_bytes);
  const index_t M = o.gemm_rows, H = o.hidden, F = o.ffn;
  const int L = o.gemm_calls;
  // The expert probe's weights: random, as a layer's are.
  std::vector<float> w1(static_cast<std::size_t>(L) * F * H), w3(w1.size()), w2(w1.size());
  {
    std::mt19937 wr(static_cast<unsigned>(c.rank()) + 7);
    std::uniform_real_distribution<float> wu(-0.05f, 0.05f);
    for (auto* v : {&w1, &w3, &w2})
      for (float& f : *v) f = wu(wr);
  }
  // The pool the memory probe streams and the route probe's cold tokens come from.
  std::vector<float> big_array(std::max<std::size_t>(o.memory_bytes / sizeof(float), 1 << 20));
  for (std::size_t i = 0; i < big_array.size(); ++i)  // varied values: the route probe's tokens
    big_array[i] = float((i * 2654435761u >> 16) & 1023) / 512.f - 1.f;
  std::size_t next_window = 0;
  auto cold = [&](std::size_t floats) {
    floats = (floats + 15) / 16 * 16;
    if (next_window + floats > big_array.size()) next_window = 0;
    float* p = big_array.data() + next_window;
    next_window += floats;
    return p;
  };
  auto read = [&](const float* p, std::size_t n) { return evict.read(p, n); };
  // (a) exchange: a barrier-aligning alltoallv, then the timed one. The rows come from a send
  // buffer just written (as permute leaves it) and land in a cold receive buffer.
  const index_t big = o.large_bytes / 4, small = o.small_bytes / 4;
  std::vector<float> send(static_cast<std::size_t>(big * R), 1.f), recv(send.size());
  std::vector<index_t> counts(static_cast<std::size_t>(R)), displs(counts.size());
  std::vector<index_t> sync_counts(counts.size(), 1);
  std::vector<double> mine_small, mine_large;
  auto sync = [&] {
    std::vector<index_t>& d = displs;
    for (int r = 0; r < R; ++r) d[r] = r;
    c.alltoallv(send.data(), sync_counts.data(), d.data(), recv.data(), sync_counts.data(),
                d.data());
  };
  for (index_t n : {small, big}) {
    for (int i = 0; i < o.exchanges + 3; ++i) {
      if (n == big) {
        evict();
        std::fill(send.begin(), send.end(), float(i));
      }
      float* s = send.data();
      float* d = recv.data();
      sync();
      for (int r = 0; r < R; ++r) counts[r] = r == c.rank() ? 0 : n, displs[r] = r * n;
      const auto t0 = clock::now();
      c.alltoallv(s, counts.data(), displs.data(), d, counts.data(), displs.data());
      if (i >= 3) (n == small ? mine_small : mine_large).push_back(detail::seconds_since(t0));
    }
  }
  // (b) experts: the layer's own expert code (expert::swiglu on space::host: gate and up
  // GEMMs, the fused SiLU, the down GEMM in place) over `gemm_calls` experts of `gemm_rows`
  // rows each, the input just regrouped (warm).
  std::vector<float> xe(static_cast<std::size_t>(L) * M * H),
      scratch(2 * static_cast<std::size_t>(M) * F);
  const expert::swiglu::weights we{
      {w1.data(), L, F, H}, {w3.data(), L, F, H}, {w2.data(), L, H, F}};
  const space::host host{};
  std::vector<double> mine_gemm, mine_route, mine_copy, mine_cold, mine_mem;
  // At M rows (gemm_flops) and at M/4 and M/2 (the curve: rounds and cold experts get fewer).
  std::vector<double> mine_quarter, mine_half;
  for (index_t m : {M / 4, M / 2, M}) {
    if (m < 1) continue;
    auto& into = m == M ? mine_gemm : m == M / 2 ? mine_half : mine_quarter;
    for (int i = 0; i < o.reps + 1; ++i) {
      for (std::size_t j = 0; j < xe.size(); ++j) xe[j] = float(int(j % 7) - 3) * 0.1f;
      sync();
      const auto t0 = clock::now();
      for (int e = 0; e < L; ++e)
        expert::swiglu::forward(
            host, we, e, {xe.data() + static_cast<std::size_t>(e) * M * H, m, H}, scratch.data());
      const double s = detail::seconds_since(t0);
      if (i > 0) into.push_back(6.0 * double(m) * H * F * L / s);
    }
  }
  // (c) route: gate GEMM [T, H] x [E, H]^T on cold tokens, then the router's top-k per token.
  const index_t T = o.tokens, E = o.experts, K = o.top_k;
  std::mt19937 rng(static_cast<unsigned>(c.rank()) + 1);
  std::uniform_real_distribution<float> u(-1.f, 1.f);
  std::vector<float> x(static_cast<std::size_t>(T * H)), gate(static_cast<std::size_t>(E * H));
  for (float& v : x) v = u(rng);
  for (float& v : gate) v = u(rng);
  std::vector<float> logits(static_cast<std::size_t>(T * E));
  const layer_config route_cfg{.hidden = o.hidden,
                               .ffn = o.ffn,
                               .experts = o.experts,
                               .top_k = o.top_k,
                               .ranks = 1,
                               .max_tokens = static_cast<int>(T)};
  detail::route_scratch scratch_r{std::vector<std::int32_t>(static_cast<std::size_t>(T * 8)),
                                  std::vector<float>(static_cast<std::size_t>(T * 8)),
                                  std::vector<float>(static_cast<std::size_t>(T * E)),
                                  std::vector<double>(static_cast<std::size_t>(2 * E)),
                                  {}};
  for (int i = 0; i < o.reps + 1; ++i) {
    const float* xc = cold(x.size());
    sync();
    const auto t0 = clock::now();
    host.gemm_nt({xc, T, H}, {gate.data(), E, H}, {logits.data(), T, E});
    detail::route_probe(route_cfg, {logits.data(), T, E}, scratch_r);
    if (i > 0) mine_route.push_back(detail::seconds_since(t0));
  }
  // (d) copies of T*K rows of H floats from a warm source into a cold destination, in the
  // layer's orders for a uniform routing (each token to K distinct random experts) on block
  // placement. Permute's gather: one block per expert, its tokens ascending (as
  // build_send_plan orders them), so a block skips through x; x was just read by the gate.
  // The regroup: R*L contiguous blocks from source-major to expert-major order (as
  // copy_blocks runs them); the received rows were just written by the exchange.
  std::vector<std::int32_t> order, slot(static_cast<std::size_t>(T * K));
  order.reserve(slot.size());
  {
    std::vector<std::vector<std::int32_t>> block(static_cast<std::size_t>(E));  // t * K + k
    std::vector<int> pick(static_cast<std::size_t>(E));
    for (index_t t = 0; t < T; ++t) {
      std::iota(pick.begin(), pick.end(), 0);
      for (index_t k = 0; k < K; ++k) {  // a partial Fisher-Yates shuffle: K distinct experts
        std::swap(pick[k], pick[k + rng() % (E - k)]);
        block[pick[k]].push_back(static_cast<std::int32_t>(t * K + k));
      }
    }
    for (const auto& b : block)
      for (std::int32_t a : b) {
        slot[a] = static_cast<std::int32_t>(order.size());  // where the reduce finds it
        order.push_back(static_cast<std::int32_t>(a / K));
      }
  }
  const index_t n_rows = T * K;
  const int B = std::max(1, R * std::max(1, o.experts / R));  // (source, local expert) blocks
  const int Lr = B / R;
  std::vector<index_t> block_first(static_cast<std::size_t>(B) + 1),
      moved_first(block_first.size());
  for (int b = 0; b <= B; ++b) block_first[b] = n_rows * b / B;
  for (int j = 0, at = 0; j < Lr; ++j)  // expert-major: (j, s) blocks in order
    for (int sr = 0; sr < R; ++sr) {
      const int b = sr * Lr + j;
      moved_first[b] = at;
      at += static_cast<int>(block_first[b + 1] - block_first[b]);
    }
  std::vector<float> rows(static_cast<std::size_t>(n_rows * H)), moved(rows.size());
  std::vector<float> y(static_cast<std::size_t>(T * H)), weights(slot.size(), 0.5f);
  std::vector<double> mine_reduce;
  for (int pass = 0; pass < 3; ++pass)
    for (int i = 0; i < o.reps + 1; ++i) {
      evict();
      if (pass == 0)
        read(x.data(), x.size());
      else
        std::fill(rows.begin(), rows.end(), float(i));
      sync();
      const auto t0 = clock::now();
      if (pass == 0) {  // permute's own gather
        const rows::gather<float> g{{x.data(), T, H}, order.data(), {rows.data(), n_rows, H}};
        for (index_t r = 0; r < n_rows; ++r) g(r, 0, H);
      } else if (pass == 2) {  // the layer's weighted reduce: rows just back from the combine
        const rows::weighted_reduce<float> wr{{rows.data(), n_rows, H},
                                              slot.data(),
                                              {weights.data(), T, K},
                                              nullptr,
                                              {y.data(), T, H}};
        for (index_t t = 0; t < T; ++t) wr(t, 0, H);
      } else {  // the regroup's row memcpy (space::host::copy_blocks)
        for (int b = 0; b < B; ++b)
          for (index_t r = 0; r < block_first[b + 1] - block_first[b]; ++r)
            std::memcpy(moved.data() + (moved_first[b] + r) * H,
                        rows.data() + (block_first[b] + r) * H, static_cast<std::size_t>(H) * 4);
      }
      const double s = detail::seconds_since(t0);
      if (i == 0) continue;
      if (pass == 2)  // rows in and out
        mine_reduce.push_back(double(n_rows + T) * H * 4 / s);
      else
        (pass ? mine_cold : mine_copy).push_back(double(n_rows) * H * 4 / s);
    }
  // (e) memory: stream a large array (reads).
  for (int i = 0; i < o.reps + 1; ++i) {
    sync();
    const auto t0 = clock::now();
    const std::size_t n = read(big_array.data(), big_array.size());
    const double s = detail::seconds_since(t0);
    if (i > 0) mine_mem.push_back(double(n * sizeof(float)) / s);
  }
  // Every rank's medians to every rank.
  constexpr int V = 10;
  std::vector<double> out_v(static_cast<std::size_t>(V) * R), in_v(out_v.size());
  // Best of the samples (least time, most rate): on a shared machine the others are the
  // neighbours' noise. The validation takes the best pass alike.
  const double mine[V] = {detail::best(mine_small, false),  detail::best(mine_large, false),
                          detail::best(mine_gemm, true),    detail::best(mine_route, false),
                          detail::best(mine_copy, true),    detail::best(mine_mem, true),
                          detail::best(mine_cold, true),    detail::best(mine_reduce, true),
                          detail::best(mine_quarter, true), detail::best(mine_half, true)};
  for (int r = 0; r < R; ++r) std::copy_n(mine, V, out_v.begin() + r * V);
  c.alltoall(out_v.data(), in_v.data(), V);
  auto over_ranks = [&](int k, bool slowest_is_max) {
    double v = in_v[k];
    for (int r = 1; r < R; ++r)
      v = slowest_is_max ? std::max(v, in_v[r * V + k]) : std::min(v, in_v[r * V + k]);
    return v;
  };
  calibration cal;
  cal.exchange_small = over_ranks(0, true);
  cal.exchange_large = over_ranks(1, true);
  cal.gemm_flops = over_ranks(2, false);
  cal.route_seconds = over_ranks(3, true);
  cal.copy_bandwidth = over_ranks(4, false);
  cal.memory_bandwidth = over_ranks(5, false);
  cal.regroup_bandwidth = over_ranks(6, false);
  cal.reduce_bandwidth = over_ranks(7, false);
  for (const auto& [m, k] : {std::pair{M / 4, 8}, std::pair{M / 2, 9}})
    if (m >= 1 && (cal.gemm_curve.empty() || double(m) > cal.gemm_curve.back().first))
      cal.gemm_curve.emplace_back(double(m), over_ranks(k, false));
  if (cal.gemm_curve.empty() || double(M) > cal.gemm_curve.back().first)
    cal.gemm_curve.emplace_back(double(M), cal.gemm_flops);
  fit(cal, o, R);
  return cal;
}

/// Derives the exchange fit, the top-k rate and the topology from the measured figures.
inline void fit(calibration& cal, const calibration_options& o, int R) {
  const double peers = std::max(R - 1, 1);
  const double extra = cal.exchange_large - cal.exchange_small;
  if (extra > 0.1 * cal.exchange_large) {
    cal.bandwidth = double(o.large_bytes - o.small_bytes) * peers / extra;
  } else {
    // The two sizes took about as long: the fixed cost (e.g. waking a parked thread on a VM)
    // drowned the bytes. The rows then move at the copy rate, as they do in shared memory.
    cal.bandwidth = cal.copy_bandwidth > 0 ? cal.copy_bandwidth : 1e10;
  }
  cal.latency = std::max(0.0, cal.exchange_small - double(o.small_bytes) * peers / cal.bandwidth);
  // The share of the route probe the gate GEMM at the expert rate does not explain (when the
  // small gate GEMM beat the expert rate, top-k is priced as nearly free).
  const double T = double(o.tokens), E = o.experts;
  const double gate_gemm = 2.0 * T * o.hidden * E / cal.gemm_flops;
  cal.topk_rate = T * E / std::max(cal.route_seconds - gate_gemm, 1e-3 * cal.route_seconds);
  topology& t = cal.topo;
  t.name = "calibrated";
  t.nodes = 1;
  t.ranks_per_node = R;
  t.intra_bandwidth = t.inter_bandwidth = cal.bandwidth;  // one machine: both classes alike
  t.intra_latency = t.inter_latency = cal.latency;
  t.gemm_flops = cal.gemm_flops;
  t.gemm_curve = cal.gemm_curve;
  t.memory_bandwidth = cal.memory_bandwidth;
  t.copy_bandwidth = cal.copy_bandwidth;
  t.regroup_bandwidth = cal.regroup_bandwidth;
  t.reduce_bandwidth = cal.reduce_bandwidth;
  t.topk_rate = cal.topk_rate;
  t.activation_bytes = t.weight_bytes = 4;  // the host layer moves and multiplies fp32
}

/// The median of calibrations of one machine with the same options, figure by figure,
/// refitted: what a run of rounds reports as this machine's rates.
inline calibration median_of(const std::vector<calibration>& all, const calibration_options& o,
                             int R) {
  if (all.empty()) return {};
  calibration c = all[0];
  auto mid = [&](double calibration::*f) {
    std::vector<double> v;
    for (const auto& a : all) v.push_back(a.*f);
    c.*f = detail::median(v);
  };
  for (auto f :
       {&calibration::exchange_small, &calibration::exchange_large, &calibration::gemm_flops,
        &calibration::route_seconds, &calibration::copy_bandwidth, &calibration::regroup_bandwidth,
        &calibration::reduce_bandwidth, &calibration::memory_bandwidth})
    mid(f);
  for (std::size_t k = 0; k < c.gemm_curve.size(); ++k) {  // every round has the same points
    std::vector<double> v;
    for (const auto& a : all) v.push_back(a.gemm_curve[k].second);
    c.gemm_curve[k].second = detail::median(v);
  }
  fit(c, o, R);
  c.topo.name = all[0].topo.name;
  return c;
}

/// Probe sizes matched to a layer of T tokens per rank: the expert GEMM at the uniform rows
/// per expert (R T K / E) over E / R experts, the exchange's bandwidth point at about one
/// rank's per-peer dispatch (T K H 4 / R bytes, at least 64 KiB), the route and copy probes
/// at T tokens.
inline calibration_options options_for(const layer_config& cfg, index_t tokens) {
  calibration_options o;
  const index_t R = cfg.ranks, K = cfg.top_k, E = cfg.experts, H = cfg.hidden;
  o.ranks = cfg.ranks;
  o.hidden = cfg.hidden;
  o.ffn = cfg.ffn;
  o.gemm_calls = std::max(1, cfg.experts / cfg.ranks);
  o.gemm_rows = std::max<index_t>(1, R * tokens * K / E);
  o.tokens = std::max<index_t>(1, tokens);
  o.experts = cfg.experts;
  o.top_k = cfg.top_k;
  o.large_bytes = std::max<index_t>(index_t{64} << 10, tokens * K * H * 4 / R);
  return o;
}

/// measure() on R in-process ranks (comm::threads).
inline calibration calibrate(const calibration_options& o = {}) {
  epmoe::detail::require(o.ranks >= 1, "calibration ranks", o.ranks, "must be >= 1");
  calibration out;
  comm::threads_world world(o.ranks);
  world.run([&](comm::threads c) {
    auto cal = measure(c, o);
    if (c.rank() == 0) out = std::move(cal);
  });
  out.topo.name = "calibrated_threads";
  return out;
}

}  // namespace epmoe::sim
