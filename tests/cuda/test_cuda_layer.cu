// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
//
// The CUDA layer equals the host reference: fp32, bf16, fp16; dropless, capacity with
// drops, padded capacity; 1 and 4 in-process ranks on one GPU (some ranks without tokens).
#include <catch2/catch.hpp>

#include "harness.cuh"

namespace {
using namespace epmoe;
using namespace epmoe::test;

layer_config small_config(int ranks, int experts, int k, index_t max_tokens) {
  layer_config c;
  c.hidden = 64;
  c.ffn = 96;
  c.experts = experts;
  c.top_k = k;
  c.ranks = ranks;
  c.max_tokens = max_tokens;
  c.capacity_factor = 1.0;
  return c;
}

template <class P>
void check_against_reference(const layer_config& cfg, std::vector<index_t> per_rank,
                             std::uint64_t seed, const run_options<P>& opt = {}) {
  using T = typename P::space::value_type;
  INFO("dtype " << dtype<T>::name << ", ranks " << cfg.ranks << ", experts " << cfg.experts);
  CHECK(error_vs_reference<P>(cfg, std::move(per_rank), seed, opt) <= tolerance<T>());
}

template <class T>
void dtype_suite() {
  using R2 = router::topk_softmax<2>;
  for (int ranks : {1, 4}) {
    SECTION("dropless, ranks " + std::to_string(ranks)) {
      const auto cfg = small_config(ranks, 8, 2, 67);
      std::vector<index_t> tokens(ranks, 67);
      if (ranks > 1) tokens[1] = 0;  // a rank without tokens still joins every exchange
      check_against_reference<cuda_policies<T, R2>>(cfg, tokens, 11);
    }
    SECTION("capacity with drops, ranks " + std::to_string(ranks)) {
      const auto cfg = small_config(ranks, 8, 2, 64);
      check_against_reference<cuda_policies<T, R2, capacity::factor<false>>>(
          cfg, std::vector<index_t>(ranks, 64), 12);
    }
    SECTION("padded capacity, ranks " + std::to_string(ranks)) {
      const auto cfg = small_config(ranks, 8, 2, 64);
      check_against_reference<cuda_policies<T, R2, capacity::factor<true>>>(
          cfg, std::vector<index_t>(ranks, 64), 13);
    }
  }
}

TEST_CASE("cuda layer fp32 equals the reference", "[cuda]") { dtype_suite<float>(); }
TEST_CASE("cuda layer bf16 equals the reference within bf16 rounding", "[cuda]") {
  dtype_suite<__nv_bfloat16>();
}
TEST_CASE("cuda layer fp16 equals the reference within fp16 rounding", "[cuda]") {
  dtype_suite<__half>();
}

TEST_CASE("cuda layer on comm::local equals the reference, dynamic and static mode", "[cuda]") {
  using R2 = router::topk_softmax<2>;
  const auto cfg = small_config(1, 8, 2, 96);
  check_against_reference<cuda_policies<float, R2, capacity::dropless, comm::local>>(cfg, {96}, 21);
  check_against_reference<cuda_policies<float, R2, capacity::factor<true>, comm::local>>(cfg, {96},
                                                                                         22);
  STATIC_REQUIRE(
      moe_layer<cuda_policies<float, R2, capacity::factor<true>, comm::local>>::static_mode);
  STATIC_REQUIRE(!moe_layer<cuda_policies<float, R2, capacity::factor<true>>>::static_mode);
}

TEST_CASE("cuda layer stats count what the host layer counts", "[cuda]") {
  using P = cuda_policies<float, router::topk_softmax<2>, capacity::factor<false>>;
  using H = threads_policies<2, capacity::factor<false>>;
  const auto cfg = small_config(4, 8, 2, 64);
  const auto w = reference::full_weights::random(cfg, 31);
  const global_tokens g = make_tokens({64, 40, 0, 64}, cfg.hidden, 32);
  const cuda_result dev = run_cuda<P>(cfg, w, g);
  const run_result host = run_layer<H>(cfg, w, g);
  for (int r = 0; r < cfg.ranks; ++r) {
    const pass_stats &a = dev.stats[r], &b = host.stats[r][0];
    INFO("rank " << r);
    CHECK(a.tokens == b.tokens);
    CHECK(a.assignments == b.assignments);
    CHECK(a.dropped == b.dropped);
    CHECK(a.routed_per_expert == b.routed_per_expert);
    CHECK(a.rows_sent == b.rows_sent);
    CHECK(a.rows_received == b.rows_received);
    CHECK(a.rows_per_local_expert == b.rows_per_local_expert);
    CHECK(a.expert_flops == b.expert_flops);
    CHECK(a.time.total > 0);
  }
}

}  // namespace
