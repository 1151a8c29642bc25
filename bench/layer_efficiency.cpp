// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
//
// Layer forward vs one GEMM of the same expert FLOPs, side by side in one run.
// efficiency = time of one [T*K, H] x [H, 3F]-sized GEMM doing the layer's expert FLOPs,
//              divided by the layer's time. Usage: epmoe_bench_efficiency [tokens...]
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include <epmoe/epmoe.hpp>
#include <epmoe/reference/weights.hpp>

using namespace epmoe;

namespace {

template <class F>
double median_seconds(int reps, F&& f) {
  f();  // warm-up
  std::vector<double> t(static_cast<std::size_t>(reps));
  for (double& s : t) {
    const auto start = std::chrono::steady_clock::now();
    f();
    s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  }
  std::nth_element(t.begin(), t.begin() + reps / 2, t.end());
  return t[static_cast<std::size_t>(reps / 2)];
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<index_t> sizes;
  for (int i = 1; i < argc; ++i) sizes.push_back(std::atoll(argv[i]));
  if (sizes.empty()) sizes = {1, 16, 128, 1024};
  // Mixtral's ratios (F = 3.5 H), scaled to a 2-core machine.
  const layer_config cfg{
      .hidden = 512,
      .ffn = 1792,
      .experts = 8,
      .top_k = 2,
      .ranks = 1,
      .max_tokens = static_cast<int>(*std::max_element(sizes.begin(), sizes.end()))};
  const auto full = reference::full_weights::random(cfg, 1);
  const auto mine = reference::slice(full, placement::block(cfg), 0);
  moe_layer<> layer(cfg, comm::local{}, {full.gate_view(), mine.experts()});

  std::printf("GEMM: %s; H=%d F=%d E=%d K=%d, 1 rank\n", space::host_gemm_backend(), cfg.hidden,
              cfg.ffn, cfg.experts, cfg.top_k);
  std::printf("%8s %12s %12s %12s %10s\n", "tokens", "layer ms", "1-GEMM ms", "GFLOP/s",
              "efficiency");
  for (index_t T : sizes) {
    const auto x = reference::random_tokens(T, cfg.hidden, 2);
    std::vector<float> y(x.size());
    const int reps = T >= 1024 ? 5 : 20;
    const double layer_s = median_seconds(reps, [&] {
      layer.forward({x.data(), T, cfg.hidden}, {y.data(), T, cfg.hidden});
    });
    const double flops = layer.stats().expert_flops;
    // One GEMM with the same FLOPs: [T*K, H] x [H, 3F].
    const index_t M = T * cfg.top_k, N = 3 * index_t{cfg.ffn};
    std::vector<float> a(M * cfg.hidden, 0.5f), b(N * cfg.hidden, 0.25f), c(M * N);
    const double gemm_s = median_seconds(reps, [&] {
      space::host_gemm_nt({a.data(), M, cfg.hidden}, {b.data(), N, cfg.hidden}, {c.data(), M, N});
    });
    std::printf("%8lld %12.3f %12.3f %12.2f %10.2f\n", static_cast<long long>(T), layer_s * 1e3,
                gemm_s * 1e3, flops / layer_s * 1e-9, gemm_s / layer_s);
  }
  return 0;
}
