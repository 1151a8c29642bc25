// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <mutex>
#include <numeric>
#include <vector>

#include "epmoe/comm/threads.hpp"
#include "epmoe/sim/topology.hpp"
#include "epmoe/space/host_gemm.hpp"

// Calibration: measures this machine's rates as R in-process ranks see them (comm::threads
// exchange, host expert GEMMs, memory reads) and turns them into a topology. Every rank runs
// its share at the same time, as the layer's ranks do, so shared cores and caches count.
namespace epmoe::sim {

struct calibration_options {
  int ranks = 2;
  int hidden = 512, ffn = 1024;   // expert shape of the GEMM probe
  index_t gemm_rows = 128;        // rows per expert (about R * T * K / E)
  int gemm_calls = 4;             // experts per probe (local slots)
  index_t small_bytes = 4 << 10;  // per peer, the latency point of the exchange fit
  index_t large_bytes = 1 << 20;  // per peer, the bandwidth point
  int exchanges = 40;             // per size (median)
  int reps = 7;                   // GEMM and memory probes (median)
  std::size_t memory_bytes = std::size_t{128} << 20;  // streamed per rank
};

/// What calibrate() measured, per rank.
struct calibration {
  double exchange_small = 0, exchange_large = 0;  // s: median alltoallv of each size
  double latency = 0, bandwidth = 0;              // fit: small + bytes in / bandwidth
  double gemm_flops = 0;                          // FLOP/s of 3 expert GEMMs (SwiGLU shape)
  double memory_bandwidth = 0;                    // bytes/s streaming reads
  topology topo;                                  // nodes 1, ranks_per_node R, fp32 rows
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

}  // namespace detail

/// Measures the link, GEMM and memory rates of R ranks on comm::threads. The exchange fit:
/// every rank sends n bytes to every rank (itself included, as the layer's buffers do); the
/// time of the slowest rank at two sizes gives latency + (R - 1) n / bandwidth, the form
/// class_seconds() prices.
inline calibration calibrate(const calibration_options& o = {}) {
  const int R = o.ranks;
  epmoe::detail::require(R >= 1, "calibration ranks", R, "must be >= 1");
  calibration out;
  std::mutex mu;
  std::vector<double> t_small, t_large, gemm, mem;
  comm::threads_world world(R);
  world.run([&](comm::threads c) {
    using clock = std::chrono::steady_clock;
    // (a) exchange: a barrier-aligned alltoallv per sample; rank 0's clock (every rank leaves
    // the exchange's closing barrier together).
    const index_t big = o.large_bytes / 4, small = o.small_bytes / 4;
    std::vector<float> send(static_cast<std::size_t>(big * R), 1.f), recv(send.size());
    std::vector<index_t> counts(static_cast<std::size_t>(R)), displs(counts.size());
    std::vector<double> mine_small, mine_large;
    for (index_t n : {small, big}) {
      for (int r = 0; r < R; ++r) counts[r] = n, displs[r] = r * n;
      for (int i = 0; i < o.exchanges + 3; ++i) {
        c.alltoallv(send.data(), counts.data(), displs.data(), recv.data(), counts.data(),
                    displs.data());  // aligns the ranks before the timed one
        const auto t0 = clock::now();
        c.alltoallv(send.data(), counts.data(), displs.data(), recv.data(), counts.data(),
                    displs.data());
        if (i >= 3) (n == small ? mine_small : mine_large).push_back(detail::seconds_since(t0));
      }
    }
    // (b) GEMM: the three SwiGLU GEMMs of `gemm_calls` experts, all ranks at once.
    const index_t M = o.gemm_rows, H = o.hidden, F = o.ffn;
    std::vector<float> a(static_cast<std::size_t>(M * H), 0.01f),
        h(static_cast<std::size_t>(M * F));
    std::vector<float> w(static_cast<std::size_t>(o.gemm_calls) * 3 * F * H, 0.001f);
    std::vector<float> y(static_cast<std::size_t>(M * H));
    std::vector<double> mine_gemm, mine_mem;
    for (int i = 0; i < o.reps + 1; ++i) {
      c.alltoallv(send.data(), counts.data(), displs.data(), recv.data(), counts.data(),
                  displs.data());  // start together
      const auto t0 = clock::now();
      for (int e = 0; e < o.gemm_calls; ++e) {
        const float* we = w.data() + static_cast<std::size_t>(e) * 3 * F * H;
        space::host_gemm_nt({a.data(), M, H}, {we, F, H}, {h.data(), M, F});
        space::host_gemm_nt({a.data(), M, H}, {we + F * H, F, H}, {h.data(), M, F});
        space::host_gemm_nt({h.data(), M, F}, {we + 2 * F * H, H, F}, {y.data(), M, H});
      }
      const double s = detail::seconds_since(t0);
      if (i > 0) mine_gemm.push_back(6.0 * double(M) * H * F * o.gemm_calls / s);
    }
    // (c) memory: stream a large array (reads), all ranks at once.
    std::vector<float> big_array(o.memory_bytes / sizeof(float), 1.f);
    volatile float sink = 0;
    for (int i = 0; i < o.reps + 1; ++i) {
      c.alltoallv(send.data(), counts.data(), displs.data(), recv.data(), counts.data(),
                  displs.data());
      const auto t0 = clock::now();
      float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      const std::size_t n = big_array.size() / 8 * 8;
      for (std::size_t j = 0; j < n; j += 8)
        for (int k = 0; k < 8; ++k) acc[k] += big_array[j + k];
      sink = sink + acc[0] + acc[1] + acc[2] + acc[3] + acc[4] + acc[5] + acc[6] + acc[7];
      const double s = detail::seconds_since(t0);
      if (i > 0) mine_mem.push_back(double(n * sizeof(float)) / s);
    }
    std::lock_guard lock(mu);
    if (c.rank() == 0) t_small = mine_small, t_large = mine_large;
    gemm.push_back(detail::median(mine_gemm));
    mem.push_back(detail::median(mine_mem));
  });
  out.exchange_small = detail::median(t_small);
  out.exchange_large = detail::median(t_large);
  const double dbytes = double(o.large_bytes - o.small_bytes) * std::max(R - 1, 1);
  out.bandwidth = dbytes / std::max(out.exchange_large - out.exchange_small, 1e-9);
  out.latency = std::max(
      0.0, out.exchange_small - double(o.small_bytes) * std::max(R - 1, 1) / out.bandwidth);
  out.gemm_flops = *std::min_element(gemm.begin(), gemm.end());  // the slowest rank's rate
  out.memory_bandwidth = *std::min_element(mem.begin(), mem.end());
  topology& t = out.topo;
  t.name = "calibrated_threads";
  t.nodes = 1;
  t.ranks_per_node = R;
  t.intra_bandwidth = t.inter_bandwidth = out.bandwidth;  // one machine: both classes alike
  t.intra_latency = t.inter_latency = out.latency;
  t.gemm_flops = out.gemm_flops;
  t.memory_bandwidth = out.memory_bandwidth;
  t.activation_bytes = t.weight_bytes = 4;  // the host layer moves and multiplies fp32
  return out;
}

}  // namespace epmoe::sim
