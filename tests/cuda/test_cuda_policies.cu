// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
//
// Every per-token router and every placement through the CUDA layer vs the reference;
// shared experts; the static-mode forward captured in a CUDA graph and replayed; errors.
#include <algorithm>
#include <catch2/catch.hpp>
#include <cmath>

#include "harness.cuh"
#include <epmoe/placement/round_robin.hpp>
#include <epmoe/router/expert_choice.hpp>
#include <epmoe/router/hash.hpp>
#include <epmoe/router/jitter.hpp>
#include <epmoe/router/noisy_topk.hpp>
#include <epmoe/router/sigmoid_bias.hpp>
#include <epmoe/router/sinkhorn.hpp>

namespace {
using namespace epmoe;
using namespace epmoe::test;

layer_config config(int ranks, int experts, int k) {
  layer_config c;
  c.hidden = 32;
  c.ffn = 48;
  c.experts = experts;
  c.top_k = k;
  c.ranks = ranks;
  c.max_tokens = 80;
  return c;
}

// 80 tokens on every rank; weights and tokens rounded to the element type, held to its
// tolerance (fp32: 1e-4).
template <class P>
void same_as_reference(const layer_config& cfg, const run_options<P>& opt = {},
                       std::uint64_t seed = 5) {
  using T = typename P::space::value_type;
  INFO("dtype " << dtype<T>::name);
  CHECK(error_vs_reference<P>(cfg, std::vector<index_t>(cfg.ranks, 80), seed, opt) <=
        tolerance<T>());
}

TEST_CASE("cuda routers equal the reference", "[cuda]") {
  SECTION("switch top-1") {
    same_as_reference<cuda_policies<float, router::switch_top1>>(config(4, 8, 1));
  }
  SECTION("qwen top-4 without renormalisation") {
    same_as_reference<cuda_policies<float, router::topk_softmax<4, false>>>(config(4, 16, 4));
  }
  SECTION("group-limited top-4") {
    run_options<cuda_policies<float, router::topk_softmax<4>>> opt;
    opt.router.groups = 4;
    opt.router.top_groups = 2;
    same_as_reference(config(4, 16, 4), opt);
  }
  SECTION("sigmoid with bias (DeepSeek-V3)") {
    using P = cuda_policies<float, router::sigmoid_bias<4>>;
    run_options<P> opt;
    opt.router.groups = 4;
    opt.router.top_groups = 2;
    opt.router.scaling = 2.5f;
    for (int e = 0; e < 16; ++e) opt.bias.push_back(e % 3 == 0 ? 0.25f : -0.125f);
    same_as_reference(config(4, 16, 4), opt);
  }
  SECTION("hash routing over device token ids") {
    using P = cuda_policies<float, router::hash<2>>;
    run_options<P> opt;
    for (int i = 0; i < 4 * 80; ++i) opt.token_ids.push_back((i * 7919) % 1000);
    same_as_reference(config(4, 8, 2), opt);
  }
}

TEST_CASE("cuda batch and training-noise routers equal the reference", "[cuda]") {
  SECTION("expert choice (routed on the host)") {
    auto cfg = config(4, 8, 2);
    cfg.capacity_factor = 1.0;
    same_as_reference<cuda_policies<float, router::expert_choice>>(cfg);
  }
  SECTION("sinkhorn top-2 (routed on the host)") {
    same_as_reference<cuda_policies<float, router::sinkhorn<2>>>(config(4, 8, 2));
  }
  SECTION("noisy top-2 while training") {
    using P = cuda_policies<float, router::noisy_topk<2>>;
    run_options<P> opt;
    opt.router.training = true;
    same_as_reference(config(4, 8, 2), opt);
  }
  SECTION("switch jitter while training") {
    using P = cuda_policies<float, router::jitter<router::switch_top1>>;
    run_options<P> opt;
    opt.router.training = true;
    same_as_reference(config(4, 8, 1), opt);
  }
}

TEST_CASE("cuda router losses equal the host layer's", "[cuda]") {
  auto cfg = config(4, 8, 2);
  cfg.aux_loss_coef = 0.01;
  const auto w = reference::full_weights::random(cfg, 61);
  const global_tokens g = make_tokens(std::vector<index_t>(4, 80), cfg.hidden, 62);
  const cuda_result dev = run_cuda<cuda_policies<float, router::topk_softmax<2>>>(cfg, w, g);
  const run_result host = run_layer<threads_policies<2>>(cfg, w, g);
  for (int r = 0; r < 4; ++r) {
    CHECK(dev.stats[r].losses.aux == Approx(host.stats[r][0].losses.aux).epsilon(1e-5));
    CHECK(dev.stats[r].losses.z == Approx(host.stats[r][0].losses.z).epsilon(1e-5));
  }
}

TEST_CASE("cuda placements equal the reference", "[cuda]") {
  SECTION("round robin") {
    same_as_reference<cuda_policies<float, router::topk_softmax<2>, capacity::dropless,
                                    comm::threads, placement::round_robin>>(config(4, 8, 2));
  }
  SECTION("table with replicas of hot experts, capacity per copy") {
    using P = cuda_policies<float, router::topk_softmax<2>, capacity::factor<false>, comm::threads,
                            placement::table>;
    const auto cfg = config(4, 8, 2);
    // 8 experts in 12 slots: experts 0..3 have a second copy on another rank.
    std::vector<int> phy = {0, 1, 4, 2, 3, 5, 6, 7, 0, 1, 2, 3};
    run_options<P> opt;
    opt.placement = placement::table(8, 4, phy);
    same_as_reference(cfg, opt);
  }
}

TEST_CASE("cuda shared experts equal the reference", "[cuda]") {
  auto cfg = config(4, 8, 2);
  cfg.shared_experts = 2;
  cfg.shared_ffn = 40;
  same_as_reference<cuda_policies<float, router::topk_softmax<2>>>(cfg);
  same_as_reference<cuda_policies<__nv_bfloat16, router::topk_softmax<2>>>(cfg);
}

TEST_CASE("cuda static-mode forward captured in a CUDA graph replays to the same output",
          "[cuda]") {
  using P =
      cuda_policies<__nv_bfloat16, router::topk_softmax<2>, capacity::factor<true>, comm::local>;
  const auto cfg = config(1, 8, 2);
  const auto w = reference::full_weights::random(cfg, 41);
  const global_tokens g = make_tokens({80}, cfg.hidden, 42);
  cuda_rank<P> dev(cfg, w, placement::block(cfg), 0);
  moe_layer<P> layer(cfg, comm::local{}, dev.views(cfg, 8));
  const auto x = upload<__nv_bfloat16>(g.x);
  device_buffer<__nv_bfloat16> y1(80 * 32), y2(80 * 32);
  // 0xff bytes are NaN in bf16: an output the eager pass or the replays leave unwritten fails.
  EPMOE_CUDA_CHECK(cudaMemset(y1.data(), 0xff, sizeof(__nv_bfloat16) * 80 * 32));
  EPMOE_CUDA_CHECK(cudaMemset(y2.data(), 0xff, sizeof(__nv_bfloat16) * 80 * 32));
  EPMOE_CUDA_CHECK(cudaDeviceSynchronize());  // the layer's stream does not wait for these
  layer.forward({x.data(), 80, 32}, {y1.data(), 80, 32});  // eager, also sets the layout
  layer.synchronize();  // static mode does not sync the host; the copy below must wait
  const std::vector<float> eager = download(y1.data(), 80 * 32);
  CHECK(std::all_of(eager.begin(), eager.end(), [](float v) { return std::isfinite(v); }));

  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  EPMOE_CUDA_CHECK(cudaStreamBeginCapture(layer.stream(), cudaStreamCaptureModeThreadLocal));
  layer.forward({x.data(), 80, 32}, {y2.data(), 80, 32});
  EPMOE_CUDA_CHECK(cudaStreamEndCapture(layer.stream(), &graph));
  EPMOE_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  for (int i = 0; i < 3; ++i) EPMOE_CUDA_CHECK(cudaGraphLaunch(exec, layer.stream()));
  layer.synchronize();
  CHECK(download(y2.data(), 80 * 32) == eager);
  CHECK(layer.stats().padding_rows + layer.stats().assignments - layer.stats().dropped ==
        8 * capacity::factor<true>{}.limit(cfg, 80));
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
}

TEST_CASE("cuda layer rejects what it does not run, naming the field", "[cuda]") {
  using P = cuda_policies<float, router::topk_softmax<2>, capacity::dropless, comm::local>;
  auto cfg = config(1, 8, 2);
  cfg.chunks = 2;
  const auto w = reference::full_weights::random(config(1, 8, 2), 1);
  cuda_rank<P> dev(cfg, w, placement::block(cfg), 0);
  CHECK_THROWS_WITH(moe_layer<P>(cfg, comm::local{}, dev.views(cfg, 8)),
                    Catch::Contains("chunks") && Catch::Contains("space::cuda"));
  cfg.chunks = 0;
  cfg.top_k = 4;
  CHECK_THROWS_WITH(moe_layer<P>(cfg, comm::local{}, dev.views(cfg, 8)), Catch::Contains("top_k"));
}

}  // namespace
