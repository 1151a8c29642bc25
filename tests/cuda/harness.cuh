// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
#pragma once

// Runs the CUDA layer on R in-process ranks sharing one GPU (comm::threads: each rank its own
// stream and workspace) or on one rank (comm::local), and compares with the host reference.
// Weights and tokens are rounded to the element type first, so the reference sees the very
// values the GPU computes with; what is left is the rounding of intermediates.
#include <cuda_runtime.h>

#include <cstdint>
#include <limits>
#include <vector>

#include "../layer/harness.hpp"
#include <epmoe/comm/threads.hpp>
#include <epmoe/cuda/moe_layer.cuh>

namespace epmoe::test {

template <class T, class Router, class Capacity = capacity::dropless, class Comm = comm::threads,
          class Placement = placement::block>
struct cuda_policies : default_policies {
  using space = epmoe::space::cuda<T>;
  using router = Router;
  using capacity = Capacity;
  using comm = Comm;
  using placement = Placement;
};

/// Largest relative error a dtype may show against the double reference (max-norm):
/// fp32 accumulation order only; bf16/fp16 round the GEMM outputs and the gate (8 / 11
/// mantissa bits) between the three GEMMs.
template <class T>
constexpr double tolerance() {
  if constexpr (std::is_same_v<T, float>) return 1e-4;
  if constexpr (std::is_same_v<T, __half>) return 4e-3;
  return 3e-2;
}

template <class T>
inline std::vector<float> rounded(std::vector<float> v) {
  for (float& x : v) x = to_float(from_float<T>(x));
  return v;
}

/// Every array of the weights rounded to T (the gate is dyadic, so it stays exact).
template <class T>
reference::full_weights rounded(reference::full_weights w) {
  for (auto* v : {&w.gate, &w.w1, &w.w3, &w.w2, &w.shared_w1, &w.shared_w3, &w.shared_w2})
    *v = rounded<T>(std::move(*v));
  return w;
}

/// A device copy of a host fp32 array, as T.
template <class T>
device_buffer<T> upload(const std::vector<float>& v) {
  std::vector<T> h(v.size());
  for (std::size_t i = 0; i < v.size(); ++i) h[i] = from_float<T>(v[i]);
  device_buffer<T> d(static_cast<index_t>(v.size()));
  if (!v.empty())
    EPMOE_CUDA_CHECK(cudaMemcpy(d.data(), h.data(), sizeof(T) * h.size(), cudaMemcpyHostToDevice));
  // From pageable memory cudaMemcpy may return before the data lands; the layer's stream
  // does not wait for the legacy stream.
  EPMOE_CUDA_CHECK(cudaDeviceSynchronize());
  return d;
}

template <class T>
std::vector<float> download(const T* d, index_t n) {
  std::vector<T> h(static_cast<std::size_t>(n));
  if (n > 0) EPMOE_CUDA_CHECK(cudaMemcpy(h.data(), d, sizeof(T) * n, cudaMemcpyDeviceToHost));
  std::vector<float> out(h.size());
  for (std::size_t i = 0; i < h.size(); ++i) out[i] = to_float(h[i]);
  return out;
}

/// One rank's weights and tokens on the device, and the layer over them.
template <class P>
struct cuda_rank {
  using T = typename P::space::value_type;
  device_buffer<T> gate, w1, w3, w2, s1, s3, s2, noise;

  cuda_rank(const layer_config& cfg, const reference::full_weights& w,
            const typename P::placement& where, int rank) {
    const auto mine = reference::slice(w, where, rank);
    gate = upload<T>(w.gate);
    w1 = upload<T>(mine.w1);
    w3 = upload<T>(mine.w3);
    w2 = upload<T>(mine.w2);
    s1 = upload<T>(w.shared_w1);
    s3 = upload<T>(w.shared_w3);
    s2 = upload<T>(w.shared_w2);
    noise = upload<T>(w.noise_gate);
    (void)cfg;
  }

  typename moe_layer<P>::weights views(const layer_config& cfg, index_t L) const {
    const index_t H = cfg.hidden, F = cfg.ffn, N = cfg.shared_experts, Fs = cfg.shared_width();
    return {{gate.data(), cfg.experts, H},
            {{w1.data(), L, F, H}, {w3.data(), L, F, H}, {w2.data(), L, H, F}},
            {{s1.data(), N, Fs, H}, {s3.data(), N, Fs, H}, {s2.data(), N, H, Fs}},
            {noise.data(), cfg.experts, H}};
  }
};

/// What run_cuda returns: outputs in global token order and each rank's last stats.
struct cuda_result {
  std::vector<float> y;
  std::vector<pass_stats> stats;
};

/// `passes` forward passes of the CUDA layer on cfg.ranks ranks over the same tokens. Each
/// pass writes into a y poisoned with 0xff bytes (NaN in fp32, bf16 and fp16), so a row the
/// layer leaves unwritten fails every comparison.
template <class P>
cuda_result run_cuda(const layer_config& cfg, const reference::full_weights& w,
                     const global_tokens& g, const run_options<P>& opt = {}) {
  using T = typename P::space::value_type;
  cuda_result out{std::vector<float>(g.x.size(), std::numeric_limits<float>::quiet_NaN()),
                  std::vector<pass_stats>(cfg.ranks)};
  auto body = [&](typename P::comm c) {
    const int r = c.rank();
    EPMOE_CUDA_CHECK(cudaSetDevice(0));
    const typename P::placement where = opt.placement ? *opt.placement : typename P::placement(cfg);
    cuda_rank<P> dev(cfg, w, where, r);
    moe_layer<P> layer(cfg, c, dev.views(cfg, where.slots_per_rank()), opt.router, opt.capacity,
                       where);
    if constexpr (router_with_bias<typename P::router>)
      if (!opt.bias.empty()) layer.set_router_bias(opt.bias);
    const index_t Tn = g.per_rank[r], H = cfg.hidden;
    const std::vector<float> x_host(g.x.begin() + g.offset(r) * H,
                                    g.x.begin() + (g.offset(r) + Tn) * H);
    const device_buffer<T> x = upload<T>(x_host);
    device_buffer<T> y(Tn * H);
    device_buffer<std::int64_t> ids(opt.token_ids.empty() ? 0 : Tn);
    std::span<const std::int64_t> id_span;
    if (!opt.token_ids.empty()) {
      EPMOE_CUDA_CHECK(cudaMemcpy(ids.data(), opt.token_ids.data() + g.offset(r),
                                  sizeof(std::int64_t) * Tn, cudaMemcpyHostToDevice));
      EPMOE_CUDA_CHECK(cudaDeviceSynchronize());
      id_span = {ids.data(), static_cast<std::size_t>(Tn)};
    }
    for (int p = 0; p < opt.passes; ++p) {
      if (Tn > 0)  // on the layer's stream: ordered before this pass, after the last
        EPMOE_CUDA_CHECK(cudaMemsetAsync(y.data(), 0xff, sizeof(T) * Tn * H, layer.stream()));
      layer.forward({x.data(), Tn, H}, {y.data(), Tn, H}, id_span);
    }
    out.stats[r] = layer.stats();  // waits for the pass
    const std::vector<float> yh = download(y.data(), Tn * H);
    std::copy(yh.begin(), yh.end(), out.y.begin() + g.offset(r) * H);
  };
  if constexpr (std::is_same_v<typename P::comm, comm::local>) {
    body(comm::local{});
  } else {
    comm::threads_world world(cfg.ranks);
    world.run(body);
  }
  return out;
}

/// The CUDA layer's error against the reference (reference::max_relative_error: infinite on
/// NaN/Inf), with weights and tokens rounded to the layer's element type first, so that what
/// is left is the rounding of intermediates that tolerance<T>() bounds.
template <class P>
double error_vs_reference(const layer_config& cfg, std::vector<index_t> per_rank,
                          std::uint64_t seed, const run_options<P>& opt = {}) {
  using T = typename P::space::value_type;
  const auto w = rounded<T>(reference::full_weights::random(cfg, seed));
  global_tokens g = make_tokens(std::move(per_rank), cfg.hidden, seed + 1);
  g.x = rounded<T>(g.x);
  return relative_error(run_cuda<P>(cfg, w, g, opt).y, run_reference<P>(cfg, w, g, opt));
}

}  // namespace epmoe::test
