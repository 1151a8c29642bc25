// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
// What only a device has: passes captured in CUDA graphs and replayed, the caller's stream,
// grid-stride loops past a grid's cap, and inputs rejected without a host wait. Each test
// fails on a GPU without the fix it names (issue 17).
#include <cuda_runtime.h>

#include <catch2/catch.hpp>
#include <cstdint>
#include <limits>
#include <stdexcept>
#include <vector>

#include "space_io.cuh"
#include <epmoe/router/noisy_topk.hpp>

// A namespace per file: tests/cuda compiles several of these files in one unit.
namespace device_tests {
using namespace epmoe;

namespace {

template <class Router = router::topk_softmax<2>, class Capacity = capacity::factor<true>,
          class Comm = comm::local>
struct device_policies : default_policies {
  using space = epmoe::space::cuda<float>;
  using router = Router;
  using capacity = Capacity;
  using comm = Comm;
};
using io = test::space_io<epmoe::space::cuda<float>>;

// One rank's layer with its weights on the device (comm::local).
template <class P>
struct one_rank {
  test::rank_arrays<P> arrays;
  typename P::space space;
  moe_layer<P> layer;
  one_rank(const layer_config& cfg, const reference::full_weights& w, cudaStream_t caller,
           typename P::router router = {})
      : arrays(w, reference::slice(w, placement::block(cfg), 0)),
        space(caller),
        layer(cfg, comm::local{}, arrays.views(cfg, cfg.experts), router, {}, placement::block(cfg),
              space) {}
};

// The reference of one rank's T tokens.
template <class P>
std::vector<float> reference_of(const layer_config& cfg, const reference::full_weights& w,
                                const test::global_tokens& g, typename P::router router = {},
                                std::uint64_t pass = 0) {
  return test::run_reference<P>(cfg, w, g, {.router = router}, pass);
}

}  // namespace

TEST_CASE("device: static passes captured at two token counts replay alternately (fix 1, 3)",
          "[cuda][graph]") {
  using P = device_policies<>;
  const layer_config cfg{.hidden = 24,
                         .ffn = 40,
                         .experts = 8,
                         .top_k = 2,
                         .ranks = 1,
                         .max_tokens = 64,
                         .capacity_factor = 1.5};
  const auto w = reference::full_weights::random(cfg, 1);
  cudaStream_t s;
  EPMOE_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  one_rank<P> r(cfg, w, s);
  REQUIRE(r.layer.static_shapes());
  int checked = 0;
  std::vector<cudaGraphExec_t> graphs;
  std::vector<test::global_tokens> gs;
  std::vector<device_buffer<float>> xs, ys;
  for (index_t T : {64, 23}) {  // no eager pass first: the layout does not depend on T
    gs.push_back(test::make_tokens({T}, cfg.hidden, 10 + T));
    xs.push_back(io::upload(gs.back().x));
    ys.push_back(io::upload(std::vector<float>(T * cfg.hidden)));
    cudaGraph_t g;
    EPMOE_CUDA_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
    r.layer.forward({xs.back().data(), T, cfg.hidden}, {ys.back().data(), T, cfg.hidden});
    EPMOE_CUDA_CHECK(cudaStreamEndCapture(s, &g));
    cudaGraphExec_t e;
    EPMOE_CUDA_CHECK(cudaGraphInstantiate(&e, g, 0));
    graphs.push_back(e);
  }
  for (int round = 0; round < 3; ++round)
    for (std::size_t i = 0; i < graphs.size(); ++i) {
      io::poison(ys[i], r.space);
      EPMOE_CUDA_CHECK(cudaStreamSynchronize(nullptr));
      EPMOE_CUDA_CHECK(cudaGraphLaunch(graphs[i], s));
      EPMOE_CUDA_CHECK(cudaStreamSynchronize(s));
      CAPTURE(round, i);
      CHECK(test::relative_error(io::download(ys[i], r.space), reference_of<P>(cfg, w, gs[i])) <=
            1e-4);
      ++checked;
    }
  CHECK(checked == 6);
}

TEST_CASE("device: training noise in a replayed graph draws each replay's pass (fix 2)",
          "[cuda][graph]") {
  using P = device_policies<router::noisy_topk<2>>;
  const layer_config cfg{.hidden = 16,
                         .ffn = 24,
                         .experts = 8,
                         .top_k = 2,
                         .ranks = 1,
                         .max_tokens = 32,
                         .capacity_factor = 2.0};
  const auto w = reference::full_weights::random(cfg, 2);
  const router::noisy_topk<2> noisy{.training = true, .seed = 5};
  cudaStream_t s;
  EPMOE_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  one_rank<P> r(cfg, w, s, noisy);
  const auto g = test::make_tokens({32}, cfg.hidden, 3);
  auto x = io::upload(g.x);
  auto y = io::upload(std::vector<float>(g.x.size()));
  cudaGraph_t graph;
  EPMOE_CUDA_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
  r.layer.forward({x.data(), 32, cfg.hidden}, {y.data(), 32, cfg.hidden});
  EPMOE_CUDA_CHECK(cudaStreamEndCapture(s, &graph));
  cudaGraphExec_t exec;
  EPMOE_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  std::vector<std::vector<float>> outs;
  for (std::uint64_t pass = 0; pass < 3; ++pass) {
    EPMOE_CUDA_CHECK(cudaGraphLaunch(exec, s));
    EPMOE_CUDA_CHECK(cudaStreamSynchronize(s));
    outs.push_back(io::download(y, r.space));
    CAPTURE(pass);
    // The captured pass counter was 0; the device counter advances with every replay.
    CHECK(test::relative_error(outs.back(), reference_of<P>(cfg, w, g, noisy, pass)) <= 1e-4);
  }
  CHECK(test::relative_error(outs[1], outs[0]) > 1e-3);
}

TEST_CASE("device: static shapes with ranks of different token counts (fix 3)", "[cuda][static]") {
  using P = device_policies<router::topk_softmax<2>, capacity::factor<true>, comm::threads>;
  const layer_config cfg{.hidden = 16,
                         .ffn = 24,
                         .experts = 8,
                         .top_k = 2,
                         .ranks = 2,
                         .max_tokens = 40,
                         .capacity_factor = 1.25};
  const auto w = reference::full_weights::random(cfg, 4);
  const auto g = test::make_tokens({40, 9}, cfg.hidden, 5);
  const auto got = test::run_layer<P>(cfg, w, g);
  CHECK(test::relative_error(got.y, test::run_reference<P>(cfg, w, g)) <= 1e-4);
}

TEST_CASE("device: a pass waits for the caller's stream, no device sync (fix 5)",
          "[cuda][stream]") {
  using P = device_policies<router::topk_softmax<2>, capacity::dropless>;
  const layer_config cfg{
      .hidden = 32, .ffn = 48, .experts = 8, .top_k = 2, .ranks = 1, .max_tokens = 256};
  const auto w = reference::full_weights::random(cfg, 6);
  cudaStream_t caller;
  EPMOE_CUDA_CHECK(cudaStreamCreateWithFlags(&caller, cudaStreamNonBlocking));
  one_rank<P> r(cfg, w, caller);
  const auto g = test::make_tokens({256}, cfg.hidden, 7);
  std::vector<float> host(g.x);
  float* pinned;
  EPMOE_CUDA_CHECK(cudaMallocHost(&pinned, sizeof(float) * host.size()));
  std::copy(host.begin(), host.end(), pinned);
  device_buffer<float> x(static_cast<index_t>(host.size())), y(static_cast<index_t>(host.size()));
  // The tokens arrive on the caller's stream, late: many small copies queued ahead.
  EPMOE_CUDA_CHECK(cudaMemsetAsync(x.data(), 0, sizeof(float) * host.size(), caller));
  for (int rep = 0; rep < 50; ++rep)
    EPMOE_CUDA_CHECK(cudaMemcpyAsync(x.data(), pinned, sizeof(float) * host.size(),
                                     cudaMemcpyHostToDevice, caller));
  EPMOE_CUDA_CHECK(cudaMemsetAsync(y.data(), 0xff, sizeof(float) * host.size(), caller));
  r.layer.forward({x.data(), 256, cfg.hidden}, {y.data(), 256, cfg.hidden});
  // And the caller reads y on its own stream, after the pass without waiting for it.
  std::vector<float> out(host.size());
  EPMOE_CUDA_CHECK(cudaMemcpyAsync(out.data(), y.data(), sizeof(float) * out.size(),
                                   cudaMemcpyDeviceToHost, caller));
  EPMOE_CUDA_CHECK(cudaStreamSynchronize(caller));
  CHECK(test::relative_error(out, reference_of<P>(cfg, w, g)) <= 1e-4);
  EPMOE_CUDA_CHECK(cudaFreeHost(pinned));
}

namespace {
struct mark_one {
  std::uint8_t* p;
  __device__ void operator()(index_t i) const { p[i] = 1; }
};
}  // namespace

TEST_CASE("device: for_each reaches every element past the grid's cap (fix 4)", "[cuda][loops]") {
  const epmoe::space::cuda<float> s;
  const index_t n = (index_t{1} << 28) + 12345;  // more than 65535 * 8 blocks of 256 threads
  device_buffer<std::uint8_t> d(n);
  EPMOE_CUDA_CHECK(cudaMemset(d.data(), 0, static_cast<std::size_t>(n)));
  s.for_each(n, mark_one{d.data()});
  s.synchronize();
  std::vector<std::uint8_t> h(static_cast<std::size_t>(n));
  EPMOE_CUDA_CHECK(cudaMemcpy(h.data(), d.data(), h.size(), cudaMemcpyDeviceToHost));
  index_t zeros = 0;
  for (std::uint8_t v : h) zeros += v == 0;
  CHECK(zeros == 0);
}

TEST_CASE("device: a bad input on one rank of two makes both throw, y untouched",
          "[cuda][errors]") {
  const layer_config cfg{.hidden = 16,
                         .ffn = 24,
                         .experts = 8,
                         .top_k = 2,
                         .ranks = 2,
                         .max_tokens = 20,
                         .capacity_factor = 1.0};
  const auto w = reference::full_weights::random(cfg, 8);
  const auto run = [&]<class P>(P) {
    std::vector<int> config_errors(2), input_errors(2), untouched(2);
    comm::threads_world world(2);
    world.run([&](comm::threads c) {
      const int r = c.rank();
      test::rank_arrays<P> arrays(w, reference::slice(w, placement::block(cfg), r));
      moe_layer<P> layer(cfg, c, arrays.views(cfg, 4));
      auto x = io::upload(std::vector<float>(20 * 16, 0.5f));
      auto y = io::upload(std::vector<float>(20 * 16));
      io::poison(y, layer.space());
      const index_t width = r == 1 ? 15 : 16;  // rank 1's x is too narrow
      try {
        layer.forward({x.data(), 20, width}, {y.data(), 20, 16});
        layer.synchronize();  // static shapes: where a peer's rejection arrives
      } catch (const input_error&) {
        ++input_errors[r];
      } catch (const config_error&) {
        ++config_errors[r];
      }
      const auto out = io::download(y, layer.space());
      untouched[r] = std::all_of(out.begin(), out.end(), [](float v) { return std::isnan(v); });
    });
    CHECK(config_errors == std::vector<int>{0, 1});
    CHECK(input_errors == std::vector<int>{1, 0});
    CHECK(untouched == std::vector<int>{1, 1});
  };
  SECTION("dynamic: rejected at the counts, before a row moves") {
    run(device_policies<router::topk_softmax<2>, capacity::dropless, comm::threads>{});
  }
  SECTION("static shapes: nothing waits; the reduce writes nothing, synchronize() throws") {
    run(device_policies<router::topk_softmax<2>, capacity::factor<true>, comm::threads>{});
  }
}

}  // namespace device_tests
