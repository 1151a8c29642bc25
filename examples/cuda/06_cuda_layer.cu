// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
//
// A Mixtral-like MoE layer (8 experts, softmax top-2, SwiGLU) on one GPU in bf16: the layer's
// stats (rows per expert, drops, bytes, time per stage) and its error against the plain host
// reference. Without a usable GPU it says why and exits 77 (CTest: skipped).
//
//   epmoe_cuda_layer [tokens]     (default 512; H=1024, F=3584, E=8, K=2)
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <thread>
#include <vector>

#include "../args.hpp"
#include <epmoe/capacity/dropless.hpp>
#include <epmoe/moe_layer.hpp>
#include <epmoe/reference/compare.hpp>
#include <epmoe/reference/forward.hpp>
#include <epmoe/reference/weights.hpp>
#include <epmoe/router/topk_softmax.hpp>
#include <epmoe/space/cuda.cuh>

namespace {

using bf16 = __nv_bfloat16;

struct policies : epmoe::default_policies {
  using space = epmoe::space::cuda<bf16>;
  using router = epmoe::router::topk_softmax<2>;
  using capacity = epmoe::capacity::dropless;
  using comm = epmoe::comm::local;
};

// bf16 keeps 8 mantissa bits and the layer rounds between its three GEMMs: the relative
// max-norm error against the double reference stays near 1e-2 (the CUDA tests' bound).
constexpr double tolerance = 3e-2;

// Round to bf16 first, so the reference sees the very values the GPU computes with.
std::vector<float> rounded(std::vector<float> v) {
  for (float& x : v) x = __bfloat162float(__float2bfloat16(x));
  return v;
}

epmoe::device_buffer<bf16> upload(const std::vector<float>& v) {
  std::vector<bf16> h(v.size());
  for (std::size_t i = 0; i < v.size(); ++i) h[i] = __float2bfloat16(v[i]);
  epmoe::device_buffer<bf16> d(static_cast<epmoe::index_t>(v.size()));
  EPMOE_CUDA_CHECK(cudaMemcpy(d.data(), h.data(), sizeof(bf16) * h.size(), cudaMemcpyHostToDevice));
  // A pageable copy may return before it lands; the layer's own stream does not wait for it.
  EPMOE_CUDA_CHECK(cudaDeviceSynchronize());
  return d;
}

// The reference in double is slow (3 H F multiply-adds per assignment): one thread per
// slice of tokens. Top-k softmax routing and dropless capacity are per token, so slices
// give the same output as one call.
std::vector<float> reference_forward(const epmoe::reference::full_weights& w,
                                     const std::vector<float>& x, epmoe::index_t T) {
  const epmoe::index_t H = w.cfg.hidden;
  std::vector<float> y(x.size());
  const epmoe::index_t n = std::max(1u, std::thread::hardware_concurrency());
  const epmoe::index_t per = (T + n - 1) / n;
  std::vector<std::thread> pool;
  for (epmoe::index_t t0 = 0; t0 < T; t0 += per)
    pool.emplace_back([&, t0] {
      const epmoe::index_t rows = std::min(per, T - t0);
      const epmoe::index_t counts[] = {rows};
      epmoe::reference::forward(w, policies::router{}, policies::capacity{},
                                {x.data() + t0 * H, rows, H}, counts, {y.data() + t0 * H, rows, H});
    });
  for (auto& t : pool) t.join();
  return y;
}

}  // namespace

int main(int argc, char** argv) try {
  cli::command_line cl(argc, argv,
                       "usage: epmoe_cuda_layer [TOKENS]\n"
                       "  A Mixtral-like layer (H=1024, F=3584, E=8, top-2) on one GPU in bf16,\n"
                       "  TOKENS tokens (default 512): stats and the error against the host\n"
                       "  reference. Exits 77 without a usable GPU.\n");
  epmoe::index_t T = 512;
  for (int given = 0; cl.next(); ++given)
    if (cl.positional() && given == 0)
      T = cl.integer_here();
    else
      cl.unknown();
  if (T < 1) cl.fail("TOKENS must be >= 1");
  int devices = 0;
  const cudaError_t e = cudaGetDeviceCount(&devices);
  if (e != cudaSuccess || devices == 0) {
    std::printf("epmoe_cuda_layer: no usable GPU (%s): skipped\n",
                e != cudaSuccess ? cudaGetErrorString(e) : "0 devices");
    return 77;
  }
  EPMOE_CUDA_CHECK(cudaSetDevice(0));
  cudaDeviceProp prop{};
  EPMOE_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));

  epmoe::layer_config cfg{.hidden = 1024,
                          .ffn = 3584,
                          .experts = 8,
                          .top_k = 2,
                          .ranks = 1,
                          .max_tokens = static_cast<int>(T)};
  const epmoe::index_t H = cfg.hidden, F = cfg.ffn, E = cfg.experts;
  std::printf(
      "Mixtral-like layer on %s: H=%lld F=%lld E=%lld top-2, T=%lld tokens, bf16, "
      "dropless, comm::local\n",
      prop.name, (long long)H, (long long)F, (long long)E, (long long)T);

  // Weights and tokens: host fp32 rounded to bf16, then on the device.
  auto w = epmoe::reference::full_weights::random(cfg, 2026);
  for (auto* v : {&w.gate, &w.w1, &w.w3, &w.w2}) *v = rounded(std::move(*v));
  const std::vector<float> x_host = rounded(epmoe::reference::random_tokens(T, H, 7));
  const auto gate = upload(w.gate), w1 = upload(w.w1), w3 = upload(w.w3), w2 = upload(w.w2);
  const auto x = upload(x_host);
  epmoe::device_buffer<bf16> y(T * H);

  // One rank holds every expert (slot j = expert j). The layer is ordered on our stream:
  // each pass waits for the work queued on it, and later work there waits for the pass.
  cudaStream_t stream;
  EPMOE_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  epmoe::moe_layer<policies> layer(
      cfg, epmoe::comm::local{},
      {{gate.data(), E, H}, {{w1.data(), E, F, H}, {w3.data(), E, F, H}, {w2.data(), E, H, F}}}, {},
      {}, epmoe::placement::block(cfg), epmoe::space::cuda<bf16>(stream));

  // Warm up (cuBLAS heuristics, module load), then time passes with events; median.
  for (int i = 0; i < 3; ++i) layer.forward({x.data(), T, H}, {y.data(), T, H});
  layer.synchronize();
  cudaEvent_t start, stop;
  EPMOE_CUDA_CHECK(cudaEventCreate(&start));
  EPMOE_CUDA_CHECK(cudaEventCreate(&stop));
  std::vector<float> ms;
  for (int i = 0; i < 20; ++i) {
    EPMOE_CUDA_CHECK(cudaEventRecord(start, stream));
    layer.forward({x.data(), T, H}, {y.data(), T, H});
    EPMOE_CUDA_CHECK(cudaEventRecord(stop, stream));
    EPMOE_CUDA_CHECK(cudaEventSynchronize(stop));
    ms.emplace_back();
    EPMOE_CUDA_CHECK(cudaEventElapsedTime(&ms.back(), start, stop));
  }
  std::sort(ms.begin(), ms.end());
  const double median_ms = ms[ms.size() / 2];
  const epmoe::pass_stats& s = layer.stats();  // the last pass; waits for it

  std::printf("\nrows per expert (routed):");
  for (epmoe::index_t v : s.routed_per_expert) std::printf(" %lld", (long long)v);
  std::printf("\nload max/mean %.2f, assignments %lld, dropped %lld\n",
              s.expert_imbalance.max_over_mean, (long long)s.assignments, (long long)s.dropped);
  const double row_bytes = double(H) * sizeof(bf16);
  std::printf(
      "bytes: permute %.1f MB (rows gathered), dispatch/combine %.1f MB each way on this "
      "GPU, to other ranks %lld (one rank)\n",
      s.rows_sent[0] * row_bytes / 1e6, s.rows_received[0] * row_bytes / 1e6,
      (long long)s.dispatch_bytes_sent);
  const auto us = [](double sec) { return sec * 1e6; };
  std::printf(
      "time per stage (us, last pass, CUDA events): route %.1f  plan %.1f  permute %.1f  "
      "dispatch %.1f  experts %.1f  combine %.1f  reduce %.1f  total %.1f\n",
      us(s.time.route), us(s.time.plan), us(s.time.permute), us(s.time.dispatch),
      us(s.time.experts), us(s.time.combine), us(s.time.reduce), us(s.time.total));
  std::printf("forward: median %.3f ms of %zu passes; experts %.1f TFLOP/s\n", median_ms, ms.size(),
              s.expert_flops / (s.time.experts > 0 ? s.time.experts : 1) / 1e12);

  // Poison y, run once more, and compare with the reference: every element must be written.
  EPMOE_CUDA_CHECK(cudaMemsetAsync(y.data(), 0xff, sizeof(bf16) * T * H, stream));
  layer.forward({x.data(), T, H}, {y.data(), T, H});
  layer.synchronize();
  std::vector<bf16> y_dev(static_cast<std::size_t>(T * H));
  EPMOE_CUDA_CHECK(
      cudaMemcpy(y_dev.data(), y.data(), sizeof(bf16) * y_dev.size(), cudaMemcpyDeviceToHost));
  std::vector<float> got(y_dev.size());
  for (std::size_t i = 0; i < got.size(); ++i) got[i] = __bfloat162float(y_dev[i]);
  // Infinite on any NaN/Inf: a row left as the 0xff poison (NaN in bf16) fails.
  const double err = epmoe::reference::max_relative_error(got, reference_forward(w, x_host, T));
  const bool ok = err <= tolerance;
  std::printf("\nmax relative error vs reference::forward: %.3e (bf16 tolerance %.0e): %s\n", err,
              tolerance, ok ? "ok" : "FAILED");
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  return ok ? 0 : 1;
} catch (const std::exception& ex) {
  std::fprintf(stderr, "epmoe_cuda_layer: %s\n", ex.what());
  return 1;
}
