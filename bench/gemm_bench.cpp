// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
//
// One expert projection c[M, N] = a[M, K] bᵀ at every row count, side by side on one thread
// (issue 22): BLAS sgemm, the host space's streaming kernel (host_gemm.hpp), and the
// packed-weights kernel (host_packed.hpp) on each path this CPU runs. b (the weights) comes
// from memory before every call (a 64 MB read evicts the caches), as in a layer whose other
// experts ran in between. Prints GFLOP/s, the weights' read rate, and packed / sgemm.
//
//   epmoe_bench_gemm [--shape mixtral|deepseek|all] [--rows 1,4,...] [--reps N] [--smoke]
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "../examples/args.hpp"
#include <epmoe/space/host.hpp>
#include <epmoe/space/host_packed.hpp>

using epmoe::index_t;
using epmoe::matrix_view;
namespace sp = epmoe::space;

namespace {

std::string cpu_model() {
  std::ifstream in("/proc/cpuinfo");
  for (std::string line; std::getline(in, line);)
    if (line.rfind("model name", 0) == 0) return line.substr(line.find(':') + 2);
  return "unknown CPU";
}

struct timer {
  std::vector<float> flush = std::vector<float>(16u << 20, 1.f);  // 64 MB
  int reps;
  // Median seconds of f() over reps calls, the caches evicted before each.
  template <class F>
  double median(F&& f) {
    std::vector<double> t;
    for (int r = 0; r < reps + 1; ++r) {
      float s = 0;
      for (std::size_t i = 0; i < flush.size(); i += 16) s += flush[i];
      flush[0] = s > 0 ? 1.f : 0.f;  // keeps the read
      const auto t0 = std::chrono::steady_clock::now();
      f();
      if (r > 0)
        t.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    }
    std::sort(t.begin(), t.end());
    return t[t.size() / 2];
  }
};

}  // namespace

int main(int argc, char** argv) {
  std::string shape = "all";
  std::vector<index_t> rows = {1, 4, 8, 16, 32, 64, 128, 256, 512};
  int reps = 7;
  cli::command_line cl(argc, argv,
                       "usage: epmoe_bench_gemm [--shape mixtral|deepseek|all] [--rows 1,4,..] "
                       "[--reps N] [--smoke]\n"
                       "  One expert projection at every row count: BLAS sgemm, the streaming\n"
                       "  kernel and the packed kernels, GFLOP/s on one thread.\n");
  while (cl.next()) {
    if (cl.is("--shape")) {
      shape = cl.value();
    } else if (cl.is("--rows")) {
      const std::vector<long long> r = cl.integers();
      rows.assign(r.begin(), r.end());
    } else if (cl.is("--reps")) {
      reps = static_cast<int>(cl.integer());
    } else if (cl.is("--smoke")) {
      rows = {1, 17}, reps = 1, shape = "tiny";
    } else {
      cl.unknown();
    }
  }
  if (shape != "mixtral" && shape != "deepseek" && shape != "all" && shape != "tiny")
    cl.fail("unknown shape " + shape + " (mixtral, deepseek or all)");
  if (reps < 1) cl.fail("--reps must be at least 1");
  struct projection {
    const char* name;
    index_t n, k;
  };
  std::vector<projection> shapes;
  if (shape == "mixtral" || shape == "all") {
    shapes.push_back({"mixtral w1", 3584, 1024});
    shapes.push_back({"mixtral w2", 1024, 3584});
  }
  if (shape == "deepseek" || shape == "all") {
    shapes.push_back({"deepseek w1", 512, 1024});
    shapes.push_back({"deepseek w2", 1024, 512});
  }
  if (shape == "tiny") shapes.push_back({"tiny", 70, 37});
  sp::set_blas_threads(1);  // one thread on every side
  std::vector<sp::cpu_path> paths;
  for (sp::cpu_path p : {sp::cpu_path::portable, sp::cpu_path::avx2, sp::cpu_path::avx512})
    if (sp::cpu_runs(p)) paths.push_back(p);
  // bf16 panels: widened to fp32 on the best fp32 path, and AVX512-BF16 dot products.
  const sp::cpu_path widen = paths.back();
  const bool dot = sp::cpu_runs(sp::cpu_path::avx512_bf16);
  std::printf("machine: %s; packed paths:", cpu_model().c_str());
  for (sp::cpu_path p : paths) std::printf(" %s", sp::name_of(p));
  std::printf(" (best %s%s); one thread; %s\n\n", sp::name_of(widen),
              dot ? ", AVX512-BF16 for bf16" : "", sp::host_gemm_backend());
  std::printf("%-12s %5s %12s %12s", "projection", "M", "sgemm GF/s", "stream GF/s");
  for (sp::cpu_path p : paths) std::printf(" %10s GF/s", sp::name_of(p));
  std::printf(" %10s %14s %16s", "best/sgemm", "best weights GB/s", "bf16 widen GF/s");
  if (dot) std::printf(" %14s %10s", "bf16 dot GF/s", "dot/sgemm");
  std::printf("\n");
  timer time{.reps = reps};
  std::mt19937 rng(1);
  std::uniform_real_distribution<float> d(-1.f, 1.f);
  for (const projection& s : shapes) {
    std::vector<float> b(static_cast<std::size_t>(s.n * s.k));
    for (float& v : b) v = d(rng);
    const matrix_view<const float> bv(b.data(), s.n, s.k);
    const sp::packed_nt packed(bv), packed16(bv, epmoe::packed_precision::bf16);
    for (index_t M : rows) {
      std::vector<float> a(static_cast<std::size_t>(M * s.k)), c(static_cast<std::size_t>(M * s.n));
      for (float& v : a) v = d(rng);
      const matrix_view<const float> av(a.data(), M, s.k);
      const matrix_view<float> cv(c.data(), M, s.n);
      const double flops = 2.0 * M * s.n * s.k, bytes = 4.0 * s.n * s.k;
#if defined(EPMOE_HAS_CBLAS)
      const double t_blas = time.median([&] {
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, static_cast<int>(M),
                    static_cast<int>(s.n), static_cast<int>(s.k), 1.f, a.data(),
                    static_cast<int>(s.k), b.data(), static_cast<int>(s.k), 0.f, c.data(),
                    static_cast<int>(s.n));
      });
#else  // no BLAS: the host space's own GEMM stands in
      const double t_blas = time.median([&] { sp::host_gemm_nt(av, bv, cv); });
#endif
      const double t_stream = time.median([&] { sp::detail::gemm_nt_columns(av, bv, cv, 0, s.n); });
      std::printf("%-12s %5lld %12.1f %12.1f", s.name, static_cast<long long>(M),
                  flops / t_blas / 1e9, flops / t_stream / 1e9);
      double best = 0;
      for (sp::cpu_path p : paths) {
        const double t = time.median([&] { sp::gemm_nt_packed(av, packed, cv, p); });
        std::printf(" %15.1f", flops / t / 1e9);
        if (p == widen) best = t;
      }
      std::printf(" %9.2fx %14.1f", t_blas / best, bytes / best / 1e9);
      const double t_widen = time.median([&] { sp::gemm_nt_packed(av, packed16, cv, widen); });
      std::printf(" %16.1f", flops / t_widen / 1e9);
      if (dot) {
        // The rows rounded once, as the layer does, outside the timed call.
        const epmoe::index_t words = (s.k + 1) / 2;
        std::vector<std::uint32_t> pairs(static_cast<std::size_t>(M * words));
        sp::to_bf16_pairs(av, pairs.data(), words, sp::cpu_path::avx512_bf16);
        const double t_dot = time.median([&] {
          sp::gemm_nt_packed(av, {pairs.data(), words}, packed16, cv, 0, packed16.panels(),
                             sp::cpu_path::avx512_bf16);
        });
        std::printf(" %14.1f %9.2fx", flops / t_dot / 1e9, t_blas / t_dot);
      }
      std::printf("\n");
    }
  }
  return 0;
}
