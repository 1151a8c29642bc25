// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
//
// The CUDA layer's pieces against their ceilings, measured side by side in one run (bf16):
//   - the experts' GEMMs (8 experts, uneven rows) as one grouped call and as one GEMM per
//     expert, vs one dense cuBLAS GEMM of the same FLOPs;
//   - permute (rows::gather) and un-permute + weighted reduce (rows::weighted_reduce) vs a
//     device-to-device cudaMemcpyAsync of the same bytes;
//   - the layer (H=4096, F=14336, E=8, K=2, comm::local) at T = 16, 512, 8192: dynamic
//     (dropless) and static (padded capacity, CUDA-graph replay), time per stage and total.
// Every time is the median of --reps runs after warm-up, each timed by CUDA events.
// bench/cuda/torch_mixtral.py times a PyTorch eager block at the same shapes and prints the
// ratio to this program's JSON. Without a usable GPU: says why, exits 77.
//
//   epmoe_cuda_bench [--smoke] [--reps N] [--tokens 16,512,8192] [--json FILE]
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <limits>
#include <numeric>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "../../examples/args.hpp"
#include <epmoe/capacity/dropless.hpp>
#include <epmoe/capacity/factor.hpp>
#include <epmoe/moe_layer.hpp>
#include <epmoe/router/topk_softmax.hpp>
#include <epmoe/space/cuda.cuh>

namespace {

using epmoe::index_t;
using bf16 = __nv_bfloat16;
namespace ck = epmoe::cuda_kernels;

struct options {
  bool smoke = false;
  int reps = 20;
  int warmup = 3;
  std::vector<index_t> tokens{16, 512, 8192};
  index_t hidden = 4096, ffn = 14336;
  int experts = 8;
  double capacity_factor = 1.25;  // static mode: rows per expert = ceil(1.25 T K / E)
  std::string json;
};

constexpr int top_k = 2;
constexpr double target = 0.70;  // issue 8: >= 70% of the dense GEMM / of a copy

template <class Capacity>
struct policies : epmoe::default_policies {
  using space = epmoe::space::cuda<bf16>;
  using router = epmoe::router::topk_softmax<top_k>;
  using capacity = Capacity;
  using comm = epmoe::comm::local;
};
using dynamic_policies = policies<epmoe::capacity::dropless>;
using static_policies = policies<epmoe::capacity::factor<true>>;

// --- device data -------------------------------------------------------------------------

// Uniform(-scale, scale) from a hash of (seed, i): gigabytes of weights in milliseconds,
// never zeros (zeros run faster than real data).
__global__ void fill_uniform(bf16* p, index_t n, float scale, std::uint64_t seed) {
  for (index_t i = static_cast<index_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<index_t>(gridDim.x) * blockDim.x) {
    std::uint64_t z = seed * 0x9E3779B97F4A7C15ull + static_cast<std::uint64_t>(i);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    const float u = static_cast<float>(z >> 40) * (1.f / 16777216.f);  // [0, 1)
    p[i] = __float2bfloat16((2.f * u - 1.f) * scale);
  }
}

epmoe::device_buffer<bf16> random_device(index_t n, float scale, std::uint64_t seed) {
  epmoe::device_buffer<bf16> b(n);
  fill_uniform<<<ck::grid_for(n), ck::block_threads>>>(b.data(), n, scale, seed);
  EPMOE_CUDA_CHECK(cudaGetLastError());
  EPMOE_CUDA_CHECK(cudaDeviceSynchronize());
  return b;
}

template <class U>
epmoe::device_buffer<U> upload(const std::vector<U>& h) {
  epmoe::device_buffer<U> d(static_cast<index_t>(h.size()));
  EPMOE_CUDA_CHECK(cudaMemcpy(d.data(), h.data(), sizeof(U) * h.size(), cudaMemcpyHostToDevice));
  EPMOE_CUDA_CHECK(cudaDeviceSynchronize());  // a pageable copy may return before it lands
  return d;
}

// Every element written and finite (the output was poisoned with NaN before).
bool all_finite(const bf16* d, index_t n) {
  std::vector<bf16> h(static_cast<std::size_t>(n));
  EPMOE_CUDA_CHECK(cudaMemcpy(h.data(), d, sizeof(bf16) * h.size(), cudaMemcpyDeviceToHost));
  return std::all_of(h.begin(), h.end(), [](bf16 v) { return std::isfinite(__bfloat162float(v)); });
}

void poison(bf16* d, index_t n, cudaStream_t s) {
  EPMOE_CUDA_CHECK(cudaMemsetAsync(d, 0xff, sizeof(bf16) * n, s));  // 0xffff: NaN
  EPMOE_CUDA_CHECK(cudaStreamSynchronize(s));
}

// --- timing ------------------------------------------------------------------------------

double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const std::size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

/// CUDA events around each call of f on stream s: warm-up calls, then `reps` timed ones;
/// `after` runs after each timed call has finished (e.g. reading the layer's stats).
class event_timer {
 public:
  event_timer() {
    EPMOE_CUDA_CHECK(cudaEventCreate(&start_));
    EPMOE_CUDA_CHECK(cudaEventCreate(&stop_));
  }
  ~event_timer() {
    cudaEventDestroy(start_);
    cudaEventDestroy(stop_);
  }
  event_timer(const event_timer&) = delete;
  event_timer& operator=(const event_timer&) = delete;

  template <class F, class After>
  std::vector<double> seconds(cudaStream_t s, int warmup, int reps, F&& f, After&& after) {
    for (int i = 0; i < warmup; ++i) f();
    EPMOE_CUDA_CHECK(cudaStreamSynchronize(s));
    std::vector<double> out;
    for (int i = 0; i < reps; ++i) {
      EPMOE_CUDA_CHECK(cudaEventRecord(start_, s));
      f();
      EPMOE_CUDA_CHECK(cudaEventRecord(stop_, s));
      EPMOE_CUDA_CHECK(cudaEventSynchronize(stop_));
      float ms = 0;
      EPMOE_CUDA_CHECK(cudaEventElapsedTime(&ms, start_, stop_));
      out.push_back(ms * 1e-3);
      after();
    }
    return out;
  }
  template <class F>
  double median_seconds(cudaStream_t s, int warmup, int reps, F&& f) {
    return median(seconds(s, warmup, reps, f, [] {}));
  }

 private:
  cudaEvent_t start_ = nullptr, stop_ = nullptr;
};

// --- results -----------------------------------------------------------------------------

struct ratio_row {
  std::string name, unit;
  double value = 0, ceiling = 0;  // in `unit`
  std::string note;
  double ratio() const { return ceiling > 0 ? value / ceiling : 0; }
};

struct layer_row {
  index_t tokens = 0;
  std::string mode;  // dynamic | static_eager | static_graph
  double total = 0;  // seconds, median
  epmoe::stage_times stages;
  index_t dropped = 0, padding_rows = 0, rows = 0;
  double expert_flops = 0;
  bool finite = true;
};

std::string num(double v) {
  char b[64];
  std::snprintf(b, sizeof b, "%.6g", std::isfinite(v) ? v : 0.0);
  return b;
}

// --- micro benchmarks --------------------------------------------------------------------

// Row counts of the 8 experts: uneven (max/min 2.7, as a skewed router gives), sum `total`.
std::vector<index_t> uneven_rows(index_t total, int experts) {
  std::vector<double> share(experts);
  for (int j = 0; j < experts; ++j) share[j] = 3.0 - 2.0 * j / std::max(1, experts - 1);
  const double sum = std::accumulate(share.begin(), share.end(), 0.0);
  std::vector<index_t> rows(experts);
  index_t at = 0;
  for (int j = 0; j < experts; ++j) at += rows[j] = static_cast<index_t>(total * share[j] / sum);
  rows[0] += total - at;
  return rows;
}

index_t largest(const std::vector<index_t>& tokens) {
  return *std::max_element(tokens.begin(), tokens.end());
}

// The layer's grouped GEMMs over every expert's rows at the largest T, as the SwiGLU expert
// calls them through the space (space.grouped_gemm_nt): up (W1, then W3: each E problems
// [m, H] x [F, H]^T) and down (E problems [m, F] x [H, F]^T), each against one dense cuBLAS
// GEMM of the same FLOPs ([sum m, in] x [out, in]^T).
std::vector<ratio_row> bench_gemm(const options& o, const epmoe::space::cuda<bf16>& space,
                                  event_timer& timer) {
  const index_t total = largest(o.tokens) * top_k, H = o.hidden, F = o.ffn;
  const int E = o.experts;
  const std::vector<index_t> rows = uneven_rows(total, E);
  std::printf("grouped GEMM rows per expert:");
  for (index_t m : rows) std::printf(" %lld", (long long)m);
  std::printf(" (sum %lld)\n", (long long)total);
  std::vector<index_t> offsets(static_cast<std::size_t>(E) + 1, 0);
  for (int j = 0; j < E; ++j) offsets[j + 1] = offsets[j] + rows[j];
  const auto d_offsets = upload(offsets);
  const index_t wide = std::max(H, F);
  const auto a = random_device(total * wide, 1.f, 11);
  const auto w = random_device(3 * E * H * F, 1.f / std::sqrt(float(wide)), 12);  // W1|W3|W2
  epmoe::device_buffer<bf16> c(2 * total * wide);
  const cudaStream_t s = space.caller();

  std::vector<ratio_row> out;
  for (const bool up : {true, false}) {
    const index_t in = up ? H : F, n_out = up ? F : H;
    const int calls = up ? 2 : 1;  // up: W1 into c[0 .. total F), W3 into the next block
    const epmoe::grouped_rows<const bf16> x{a.data(), in, in, E, offsets.data(), d_offsets.data()};
    const auto weights = [&](int q) {
      return epmoe::stacked_view<const bf16>(w.data() + (up ? q : 2) * E * H * F, E, n_out, in);
    };
    const auto result = [&](int q) {
      return epmoe::grouped_rows<bf16>{
          c.data() + q * total * n_out, n_out, n_out, E, offsets.data(), d_offsets.data()};
    };
    const index_t dense_out = calls * n_out;  // up: [total, H] x [2F, H]^T
    const double flops = 2.0 * total * in * dense_out;
    // The layer picks one of the two by the experts' mean rows (set_per_group_gemm_rows).
    const auto time_experts = [&](index_t per_group_rows) {
      space.set_per_group_gemm_rows(per_group_rows);
      return timer.median_seconds(s, o.warmup, o.reps, [&] {
        space.enter();
        for (int q = 0; q < calls; ++q) space.grouped_gemm_nt(x, weights(q), result(q));
        space.leave();
      });
    };
    const index_t chosen = space.per_group_gemm_rows();
    const double grouped = time_experts(std::numeric_limits<index_t>::max() / (4 * E)),
                 per_expert = time_experts(0);
    space.set_per_group_gemm_rows(chosen);
    const double dense = timer.median_seconds(s, o.warmup, o.reps, [&] {
      space.enter();
      space.gemm_nt(epmoe::matrix_view<const bf16>(a.data(), total, in),
                    epmoe::matrix_view<const bf16>(w.data(), dense_out, in),
                    epmoe::matrix_view<bf16>(c.data(), total, dense_out));
      space.leave();
    });
    out.push_back(
        {up ? "grouped GEMM up (W1, W3: 2 grouped calls of E)" : "grouped GEMM down (W2: E)",
         "TFLOP/s", flops / grouped / 1e12, flops / dense / 1e12,
         "space::cuda::grouped_gemm_nt as one cublasGemmGroupedBatchedEx"});
    out.push_back({up ? "per-expert GEMMs up (W1, W3: 2 x E cublasGemmEx)"
                      : "per-expert GEMMs down (W2: E cublasGemmEx)",
                   "TFLOP/s", flops / per_expert / 1e12, flops / dense / 1e12,
                   "space::cuda::grouped_gemm_nt as one cublasGemmEx per expert"});
  }
  return out;
}

// Permute and un-permute + weighted reduce at the largest T, the layer's functors on the
// space, against a device-to-device copy of the same bytes (read + written).
std::vector<ratio_row> bench_rows(const options& o, const epmoe::space::cuda<bf16>& space,
                                  event_timer& timer) {
  const index_t T = largest(o.tokens), H = o.hidden, n = T * top_k;
  const cudaStream_t s = space.caller();
  // Assignment a = t*K + k goes to send row order[a]: shuffled, as sorting by expert does.
  std::vector<std::int32_t> order(static_cast<std::size_t>(n)), row_token(order.size());
  std::iota(order.begin(), order.end(), 0);
  std::shuffle(order.begin(), order.end(), std::mt19937_64(5));
  for (index_t a = 0; a < n; ++a) row_token[order[a]] = static_cast<std::int32_t>(a / top_k);
  std::vector<float> weight(order.size());
  for (index_t a = 0; a < n; ++a) weight[a] = a % top_k ? 0.25f : 0.75f;
  const auto d_slot = upload(order), d_row_token = upload(row_token);
  const auto d_weight = upload(weight);
  const auto x = random_device(T * H, 1.f, 21);
  const auto back = random_device(n * H, 1.f, 22);
  epmoe::device_buffer<bf16> send(n * H), y(T * H);
  // Copies of up to one send buffer plus the index bytes.
  const index_t copy_max = n * H * static_cast<index_t>(sizeof(bf16)) + 16 * n;
  epmoe::device_buffer<char> copy_src(copy_max), copy_dst(copy_max);
  EPMOE_CUDA_CHECK(cudaMemset(copy_src.data(), 0x3c, copy_max));

  const auto copy_gbps = [&](index_t bytes) {  // counts bytes read + written
    if (bytes > copy_max) throw std::logic_error("copy_gbps: past the copy buffers");
    const double t = timer.median_seconds(s, o.warmup, o.reps, [&] {
      EPMOE_CUDA_CHECK(
          cudaMemcpyAsync(copy_dst.data(), copy_src.data(), bytes, cudaMemcpyDeviceToDevice, s));
    });
    return 2.0 * bytes / t / 1e9;
  };

  std::vector<ratio_row> out;
  {
    const double t = timer.median_seconds(s, o.warmup, o.reps, [&] {
      space.enter();
      space.for_each_row(
          n, H,
          epmoe::rows::gather<bf16>{{x.data(), T, H}, d_row_token.data(), {send.data(), n, H}});
      space.leave();
    });
    const double bytes = 2.0 * n * H * sizeof(bf16) + n * sizeof(std::int32_t);
    out.push_back({"permute (rows::gather)", "GB/s", bytes / t / 1e9,
                   copy_gbps(static_cast<index_t>(bytes / 2))});
  }
  {
    const double t = timer.median_seconds(s, o.warmup, o.reps, [&] {
      space.enter();
      space.for_each_row(T, H,
                         epmoe::rows::weighted_reduce<bf16>{{back.data(), n, H},
                                                            d_slot.data(),
                                                            {d_weight.data(), T, top_k},
                                                            nullptr,
                                                            {y.data(), T, H}});
      space.leave();
    });
    const double bytes = double(n + T) * H * sizeof(bf16) + n * (sizeof(std::int32_t) + 4.0);
    out.push_back({"un-permute + weighted reduce (rows::weighted_reduce)", "GB/s", bytes / t / 1e9,
                   copy_gbps(static_cast<index_t>(bytes / 2))});
  }
  return out;
}

// --- the layer ---------------------------------------------------------------------------

struct layer_weights {
  epmoe::device_buffer<bf16> gate, w1, w3, w2;
  layer_weights(index_t E, index_t H, index_t F)
      // Gate logits of std ~1.3 (uneven but not collapsed routing), weights of unit gain.
      : gate(random_device(E * H, 4.f / std::sqrt(float(H)), 31)),
        w1(random_device(E * F * H, 1.f / std::sqrt(float(H)), 32)),
        w3(random_device(E * F * H, 1.f / std::sqrt(float(H)), 33)),
        w2(random_device(E * H * F, 1.f / std::sqrt(float(F)), 34)) {}
  template <class P>
  typename epmoe::moe_layer<P>::weights views(index_t E, index_t H, index_t F) const {
    return {{gate.data(), E, H},
            {{w1.data(), E, F, H}, {w3.data(), E, F, H}, {w2.data(), E, H, F}}};
  }
};

// Median of each stage over the timed passes (stats() per pass: the layer's own events).
epmoe::stage_times median_stages(const std::vector<epmoe::stage_times>& v) {
  using st = epmoe::stage_times;
  using field = double st::*;
  const auto med = [&](field f) {
    std::vector<double> x;
    for (const auto& t : v) x.push_back(t.*f);
    return median(x);
  };
  st m;
  for (field f : {&st::route, &st::plan, &st::permute, &st::dispatch, &st::experts, &st::combine,
                  &st::shared, &st::reduce, &st::total})
    m.*f = med(f);
  return m;
}

template <class Layer>
layer_row fill_row(const Layer& l, index_t T, const char* mode, double total,
                   const epmoe::stage_times& stages) {
  const epmoe::pass_stats& s = l.stats();
  index_t rows = 0;
  for (index_t r : s.padded_rows_per_local_expert) rows += r;
  return {T, mode, total, stages, s.dropped, s.padding_rows, rows, s.expert_flops, true};
}

std::vector<layer_row> bench_layer(const options& o, event_timer& timer) {
  const index_t H = o.hidden, F = o.ffn, E = o.experts;
  const index_t Tmax = largest(o.tokens);
  epmoe::layer_config cfg{.hidden = static_cast<int>(H),
                          .ffn = static_cast<int>(F),
                          .experts = static_cast<int>(E),
                          .top_k = top_k,
                          .ranks = 1,
                          .max_tokens = static_cast<int>(Tmax),
                          .capacity_factor = o.capacity_factor};
  const layer_weights w(E, H, F);
  const auto x = random_device(Tmax * H, 1.f, 41);
  epmoe::device_buffer<bf16> y(Tmax * H);
  // Each layer ordered on a stream of ours (the caller's stream: events and graph capture).
  cudaStream_t dyn_stream, fixed_stream;
  EPMOE_CUDA_CHECK(cudaStreamCreateWithFlags(&dyn_stream, cudaStreamNonBlocking));
  EPMOE_CUDA_CHECK(cudaStreamCreateWithFlags(&fixed_stream, cudaStreamNonBlocking));
  epmoe::moe_layer<dynamic_policies> dyn(
      cfg, epmoe::comm::local{}, w.views<dynamic_policies>(E, H, F), {}, {},
      epmoe::placement::block(cfg), typename dynamic_policies::space(dyn_stream));
  epmoe::moe_layer<static_policies> fixed(
      cfg, epmoe::comm::local{}, w.views<static_policies>(E, H, F), {}, {},
      epmoe::placement::block(cfg), typename static_policies::space(fixed_stream));
  if (!fixed.static_shapes()) throw std::logic_error("cuda_bench: static_policies not static");

  std::vector<layer_row> out;
  for (const index_t T : o.tokens) {
    const epmoe::matrix_view<const bf16> xv{x.data(), T, H};
    const epmoe::matrix_view<bf16> yv{y.data(), T, H};
    std::vector<epmoe::stage_times> stages;
    const auto keep_stages = [&stages](const auto& l) {
      return [&stages, p = &l] { stages.push_back(p->stats().time); };
    };

    // Dynamic (dropless): one host sync per pass for the counts.
    poison(y.data(), T * H, dyn_stream);
    const auto t_dyn = timer.seconds(
        dyn_stream, o.warmup, o.reps, [&] { dyn.forward(xv, yv); }, keep_stages(dyn));
    out.push_back(fill_row(dyn, T, "dynamic", median(t_dyn), median_stages(stages)));
    out.back().finite = all_finite(y.data(), T * H);

    // Static, eager.
    stages.clear();
    poison(y.data(), T * H, fixed_stream);
    const auto t_eager = timer.seconds(
        fixed_stream, o.warmup, o.reps, [&] { fixed.forward(xv, yv); }, keep_stages(fixed));
    out.push_back(fill_row(fixed, T, "static_eager", median(t_eager), median_stages(stages)));
    out.back().finite = all_finite(y.data(), T * H);

    // Static, captured once and replayed: no host work, no launch gaps.
    cudaGraph_t graph = nullptr;
    cudaGraphExec_t exec = nullptr;
    EPMOE_CUDA_CHECK(cudaStreamBeginCapture(fixed_stream, cudaStreamCaptureModeThreadLocal));
    fixed.forward(xv, yv);
    EPMOE_CUDA_CHECK(cudaStreamEndCapture(fixed_stream, &graph));
    EPMOE_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
    poison(y.data(), T * H, fixed_stream);
    const double t_graph = timer.median_seconds(fixed_stream, o.warmup, o.reps, [&] {
      EPMOE_CUDA_CHECK(cudaGraphLaunch(exec, fixed_stream));
    });
    // Stage times of a replay are not recorded (no events in a graph): the eager ones stand.
    out.push_back(fill_row(fixed, T, "static_graph", t_graph, out.back().stages));
    out.back().finite = all_finite(y.data(), T * H);
    EPMOE_CUDA_CHECK(cudaGraphExecDestroy(exec));
    EPMOE_CUDA_CHECK(cudaGraphDestroy(graph));
  }
  return out;
}

// --- output ------------------------------------------------------------------------------

void print_layer(const options& o, const std::vector<layer_row>& rows) {
  std::printf(
      "\nlayer H=%lld F=%lld E=%d K=%d bf16, comm::local, static capacity factor %.2f: "
      "median ms per pass (stages: the layer's events; static_graph shows the eager "
      "stages)\n",
      (long long)o.hidden, (long long)o.ffn, o.experts, top_k, o.capacity_factor);
  std::printf("%6s %-13s %9s | %7s %7s %7s %7s %8s %7s %7s | %7s %7s %8s %s\n", "T", "mode",
              "total", "route", "plan", "permute", "dispat", "experts", "combine", "reduce",
              "dropped", "padding", "exp TF/s", "");
  for (const auto& r : rows) {
    const auto ms = [](double s) { return s * 1e3; };
    const double tf = r.stages.experts > 0 ? r.expert_flops / r.stages.experts / 1e12 : 0;
    std::printf(
        "%6lld %-13s %9.3f | %7.3f %7.3f %7.3f %7.3f %8.3f %7.3f %7.3f | %7lld %7lld "
        "%8.1f %s\n",
        (long long)r.tokens, r.mode.c_str(), ms(r.total), ms(r.stages.route), ms(r.stages.plan),
        ms(r.stages.permute), ms(r.stages.dispatch), ms(r.stages.experts), ms(r.stages.combine),
        ms(r.stages.reduce), (long long)r.dropped, (long long)r.padding_rows, tf,
        r.finite ? "" : "OUTPUT NOT FINITE");
  }
}

std::string to_json(const options& o, const cudaDeviceProp& prop,
                    const std::vector<ratio_row>& ratios, const std::vector<layer_row>& layer) {
  std::ostringstream j;
  j << "{\n  \"device\": \"" << prop.name << "\",\n  \"smoke\": " << (o.smoke ? "true" : "false")
    << ",\n  \"reps\": " << o.reps << ",\n  \"shape\": {\"hidden\": " << o.hidden
    << ", \"ffn\": " << o.ffn << ", \"experts\": " << o.experts << ", \"top_k\": " << top_k
    << ", \"dtype\": \"bf16\", \"capacity_factor\": " << num(o.capacity_factor)
    << "},\n  \"ratios\": [";
  for (std::size_t i = 0; i < ratios.size(); ++i) {
    const auto& r = ratios[i];
    j << (i ? "," : "") << "\n    {\"name\": \"" << r.name << "\", \"unit\": \"" << r.unit
      << "\", \"value\": " << num(r.value) << ", \"ceiling\": " << num(r.ceiling)
      << ", \"ratio\": " << num(r.ratio()) << ", \"target\": " << num(target) << ", \"note\": \""
      << r.note << "\"}";
  }
  j << "\n  ],\n  \"layer\": [";
  for (std::size_t i = 0; i < layer.size(); ++i) {
    const auto& r = layer[i];
    const auto& t = r.stages;
    j << (i ? "," : "") << "\n    {\"tokens\": " << r.tokens << ", \"mode\": \"" << r.mode
      << "\", \"total_ms\": " << num(r.total * 1e3)
      << ", \"stages_ms\": {\"route\": " << num(t.route * 1e3)
      << ", \"plan\": " << num(t.plan * 1e3) << ", \"permute\": " << num(t.permute * 1e3)
      << ", \"dispatch\": " << num(t.dispatch * 1e3) << ", \"experts\": " << num(t.experts * 1e3)
      << ", \"combine\": " << num(t.combine * 1e3) << ", \"reduce\": " << num(t.reduce * 1e3)
      << ", \"total\": " << num(t.total * 1e3) << "}, \"dropped\": " << r.dropped
      << ", \"padding_rows\": " << r.padding_rows << ", \"expert_rows\": " << r.rows
      << ", \"expert_flops\": " << num(r.expert_flops)
      << ", \"finite\": " << (r.finite ? "true" : "false") << "}";
  }
  j << "\n  ]\n}\n";
  return j.str();
}

options parse(int argc, char** argv) {
  options o;
  cli::command_line cl(
      argc, argv,
      "usage: epmoe_cuda_bench [--smoke] [--reps N] [--tokens 16,512,8192] [--json FILE]\n"
      "  The CUDA layer's grouped GEMM and row kernels against their ceilings, and the layer\n"
      "  at Mixtral-8x7B widths (bf16). Without a usable GPU: says why, exits 77.\n");
  while (cl.next()) {
    if (cl.is("--smoke")) {
      o.smoke = true;
      o.reps = 3;
      o.warmup = 1;
      o.tokens = {16, 64};
      o.hidden = 256;
      o.ffn = 512;
    } else if (cl.is("--reps")) {
      o.reps = std::max(1, static_cast<int>(cl.integer()));
    } else if (cl.is("--tokens")) {
      const std::vector<long long> t = cl.integers();
      o.tokens.assign(t.begin(), t.end());
    } else if (cl.is("--json")) {
      o.json = cl.value();
    } else {
      cl.unknown();
    }
  }
  if (o.tokens.empty()) cl.fail("--tokens: give at least one count");
  return o;
}

}  // namespace

int main(int argc, char** argv) try {
  const options o = parse(argc, argv);
  int devices = 0;
  const cudaError_t e = cudaGetDeviceCount(&devices);
  if (e != cudaSuccess || devices == 0) {
    std::printf("epmoe_cuda_bench: no usable GPU (%s): skipped\n",
                e != cudaSuccess ? cudaGetErrorString(e) : "0 devices");
    return 77;
  }
  EPMOE_CUDA_CHECK(cudaSetDevice(0));
  cudaDeviceProp prop{};
  EPMOE_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  std::printf(
      "epmoe_cuda_bench on %s (%d SMs), H=%lld F=%lld E=%d K=%d bf16, median of %d after "
      "%d warm-up%s\n",
      prop.name, prop.multiProcessorCount, (long long)o.hidden, (long long)o.ffn, o.experts, top_k,
      o.reps, o.warmup, o.smoke ? " (smoke shapes)" : "");

  event_timer timer;
  cudaStream_t s = nullptr;
  EPMOE_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  std::vector<ratio_row> ratios;
  {
    // The layer's primitives, on a space of its own ordered on s (its cuBLAS handle and
    // workspaces, as a layer's).
    const epmoe::space::cuda<bf16> space(s);
    space.reserve(8, o.experts, 1024);
    ratios = bench_gemm(o, space, timer);
    const auto rows = bench_rows(o, space, timer);
    ratios.insert(ratios.end(), rows.begin(), rows.end());
    EPMOE_CUDA_CHECK(cudaStreamSynchronize(s));
  }
  EPMOE_CUDA_CHECK(cudaStreamDestroy(s));

  const std::vector<layer_row> layer = bench_layer(o, timer);
  print_layer(o, layer);

  std::printf("\n%-46s %10s %10s %7s %7s\n", "ratio (measured side by side)", "value", "ceiling",
              "ratio", "target");
  bool met = true, finite = true;
  for (const auto& r : ratios) {
    std::printf("%-46s %10.1f %10.1f %6.0f%% %6.0f%% %s  (%s%s%s)\n", r.name.c_str(), r.value,
                r.ceiling, 100 * r.ratio(), 100 * target, r.ratio() >= target ? "met" : "MISSED",
                r.unit.c_str(), r.note.empty() ? "" : "; ", r.note.c_str());
    met = met && r.ratio() >= target;
  }
  for (const auto& r : layer) finite = finite && r.finite;
  if (!o.json.empty()) {
    std::ofstream f(o.json);
    f << to_json(o, prop, ratios, layer);
    if (!f) throw std::runtime_error("cannot write " + o.json);
    std::printf("wrote %s\n", o.json.c_str());
  }
  if (!finite) {
    std::fprintf(stderr, "epmoe_cuda_bench: a layer output was not finite (unwritten or NaN)\n");
    return 1;
  }
  std::printf("targets %s\n", met ? "met" : "missed (see above)");
  return 0;
} catch (const std::exception& ex) {
  std::fprintf(stderr, "epmoe_cuda_bench: %s\n", ex.what());
  return 1;
}
