// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
// The expert backward's building blocks on space::cuda<float> against the same calls on
// space::host (which tests/expert/test_expert_backward.cpp checks against the float64
// reference): the two backward GEMMs (an empty group, accumulate on and off) and
// glu<silu>::backward, mlp<relu, biases>::backward. Device outputs start as NaN (0xff bytes).
#include <cuda_runtime.h>

#include <catch2/catch.hpp>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#include <epmoe/space/cuda.cuh>
// clang-format off
#include <epmoe/expert/mlp.hpp>
#include <epmoe/expert/swiglu.hpp>
#include <epmoe/reference/compare.hpp>
#include <epmoe/space/host.hpp>
// clang-format on

// A namespace per file: tests/cuda compiles several of these files in one unit.
namespace expert_backward_tests {
using namespace epmoe;

static_assert(training_space<space::cuda<float>>);

namespace {

std::vector<float> uniform(std::size_t n, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> u(-1.f, 1.f);
  std::vector<float> v(n);
  for (float& x : v) x = u(rng);
  return v;
}
template <class U>
device_buffer<U> up(const std::vector<U>& v) {
  device_buffer<U> d(static_cast<index_t>(v.size()));
  if (!v.empty())
    EPMOE_CUDA_CHECK(cudaMemcpy(d.data(), v.data(), sizeof(U) * v.size(), cudaMemcpyHostToDevice));
  return d;
}
template <class U>
device_buffer<U> nans(std::size_t n) {
  device_buffer<U> d(static_cast<index_t>(n));
  if (n > 0) EPMOE_CUDA_CHECK(cudaMemset(d.data(), 0xff, sizeof(U) * n));
  return d;
}
template <class U>
std::vector<U> down(const device_buffer<U>& d) {
  std::vector<U> h(static_cast<std::size_t>(d.size()));
  if (!h.empty())
    EPMOE_CUDA_CHECK(cudaMemcpy(h.data(), d.data(), sizeof(U) * h.size(), cudaMemcpyDeviceToHost));
  return h;
}

// A device space ready for a pass of up to `groups` groups.
space::cuda<float> ready_space(int groups) {
  space::cuda<float> s;
  s.reserve(16, groups, 64);
  s.enter();
  return s;
}

const std::vector<index_t> counts{5, 0, 37, 3};
std::vector<index_t> offsets() {
  std::vector<index_t> o{0};
  for (index_t c : counts) o.push_back(o.back() + c);
  return o;
}

}  // namespace

TEST_CASE("cuda: the backward GEMMs match space::host, empty groups, accumulate",
          "[cuda][backward]") {
  const auto off = offsets();
  const device_buffer<index_t> doff = up(off);
  const int G = static_cast<int>(counts.size());
  const index_t rows = off.back(), K = 19, N = 13;
  const std::vector<float> a = uniform(rows * K, 1), b = uniform(G * K * N, 2),
                           bt = uniform(rows * N, 3);
  const device_buffer<float> da = up(a), db = up(b), dbt = up(bt);
  int compared = 0;
  for (bool acc : {false, true}) {
    // nn: c [rows, N] (+)= a_g [., K] x b[g] [K, N]
    std::vector<float> c(rows * N, acc ? 1.f : 0.f);
    device_buffer<float> dc = acc ? up(c) : nans<float>(c.size());
    space::host{}.grouped_gemm_nn({a.data(), K, K, G, off.data(), off.data()},
                                  stacked_view<const float>{b.data(), G, K, N},
                                  {c.data(), N, N, G, off.data(), off.data()}, acc);
    const auto s = ready_space(G);
    s.grouped_gemm_nn({da.data(), K, K, G, off.data(), doff.data()},
                      stacked_view<const float>{db.data(), G, K, N},
                      {dc.data(), N, N, G, off.data(), doff.data()}, acc);
    s.synchronize();
    CHECK(reference::max_relative_error(down(dc), c) <= 1e-4);
    ++compared;
    // tn: w[g] [K, N] (+)= a_gᵀ x bt_g
    std::vector<float> w(G * K * N, acc ? 1.f : 0.f);
    device_buffer<float> dw = acc ? up(w) : nans<float>(w.size());
    space::host{}.grouped_gemm_tn_accumulate({a.data(), K, K, G, off.data(), off.data()},
                                             {bt.data(), N, N, G, off.data(), off.data()},
                                             stacked_view<float>{w.data(), G, K, N}, acc);
    s.grouped_gemm_tn_accumulate({da.data(), K, K, G, off.data(), doff.data()},
                                 {dbt.data(), N, N, G, off.data(), doff.data()},
                                 stacked_view<float>{dw.data(), G, K, N}, acc);
    s.synchronize();
    CHECK(reference::max_relative_error(down(dw), w) <= 1e-4);
    ++compared;
  }
  CHECK(compared == 4);
}

TEST_CASE("cuda: the experts' GEMM, grouped and one GEMM per group, matches space::host",
          "[cuda][gemm]") {
  const auto off = offsets();
  const device_buffer<index_t> doff = up(off);
  const int G = static_cast<int>(counts.size());
  const index_t rows = off.back(), K = 19, N = 13;
  const std::vector<float> a = uniform(rows * K, 4), b = uniform(G * N * K, 5);
  const device_buffer<float> da = up(a), db = up(b);
  // c [rows, N] = a_g [., K] x b[g] [N, K]^T
  std::vector<float> c(rows * N);
  space::host{}.grouped_gemm_nt({a.data(), K, K, G, off.data(), off.data()},
                                stacked_view<const float>{b.data(), G, N, K},
                                {c.data(), N, N, G, off.data(), off.data()});
  int compared = 0;
  for (index_t per_group_rows : {index_t{0}, index_t{1} << 30}) {  // per group; grouped
    CAPTURE(per_group_rows);
    const auto s = ready_space(G);
    s.set_per_group_gemm_rows(per_group_rows);
    device_buffer<float> dc = nans<float>(c.size());
    s.grouped_gemm_nt({da.data(), K, K, G, off.data(), doff.data()},
                      stacked_view<const float>{db.data(), G, N, K},
                      {dc.data(), N, N, G, off.data(), doff.data()});
    s.synchronize();
    CHECK(reference::max_relative_error(down(dc), c) <= 1e-4);
    ++compared;
  }
  CHECK(compared == 2);
}

namespace {

// Expert::backward on both spaces from the same random weights and rows; every output
// compared. Returns the number of comparisons.
template <class Expert>
int check_expert_backward() {
  constexpr bool glu = requires(typename Expert::weights x) { x.w3; };
  const auto off = offsets();
  const device_buffer<index_t> doff = up(off);
  const int L = static_cast<int>(counts.size());
  const index_t H = 24, F = 20, rows = off.back();
  std::vector<std::vector<float>> w;  // w1, w3 (or b1), w2, b2
  w.push_back(uniform(L * F * H, 1));
  w.push_back(uniform(glu ? L * F * H : L * F, 2));
  w.push_back(uniform(L * H * F, 3));
  w.push_back(uniform(L * H, 4));
  std::vector<device_buffer<float>> dw;
  for (const auto& v : w) dw.push_back(up(v));
  const auto weights = [&](auto& arrays) {
    using W = typename Expert::weights;
    if constexpr (glu)
      return W{
          {arrays[0].data(), L, F, H}, {arrays[1].data(), L, F, H}, {arrays[2].data(), L, H, F}};
    else
      return W{{arrays[0].data(), L, F, H},
               {arrays[2].data(), L, H, F},
               {arrays[1].data(), L, 1, F},
               {arrays[3].data(), L, 1, H}};
  };
  const std::vector<float> x = uniform(rows * H, 5), dy = uniform(rows * H, 6);
  const device_buffer<float> dx_in = up(x), ddy = up(dy);
  // The gradients: [w1, w3 or b1, w2, b2] shaped as the weights.
  std::vector<std::vector<float>> g;
  std::vector<device_buffer<float>> dg;
  for (const auto& v : w) g.emplace_back(v.size()), dg.push_back(nans<float>(v.size()));
  const auto grads = [&](auto& arrays) {
    using Gr = typename Expert::grads;
    if constexpr (glu)
      return Gr{
          {arrays[0].data(), L, F, H}, {arrays[1].data(), L, F, H}, {arrays[2].data(), L, H, F}};
    else
      return Gr{{arrays[0].data(), L, F, H},
                {arrays[2].data(), L, H, F},
                {arrays[1].data(), L, 1, F},
                {arrays[3].data(), L, 1, H}};
  };
  std::vector<float> dx(rows * H), scratch(rows * Expert::backward_scratch_per_row(F));
  Expert::backward(space::host{}, weights(w),
                   grouped_rows<const float>{x.data(), H, H, L, off.data(), off.data()},
                   grouped_rows<const float>{dy.data(), H, H, L, off.data(), off.data()},
                   grouped_rows<float>{dx.data(), H, H, L, off.data(), off.data()}, grads(g),
                   scratch.data());
  device_buffer<float> ddx = nans<float>(dx.size()), dscratch = nans<float>(scratch.size());
  const auto s = ready_space(L);
  Expert::backward(s, weights(dw),
                   grouped_rows<const float>{dx_in.data(), H, H, L, off.data(), doff.data()},
                   grouped_rows<const float>{ddy.data(), H, H, L, off.data(), doff.data()},
                   grouped_rows<float>{ddx.data(), H, H, L, off.data(), doff.data()}, grads(dg),
                   dscratch.data());
  s.synchronize();
  int compared = 0;
  CHECK(reference::max_relative_error(down(ddx), dx) <= 1e-4);
  ++compared;
  for (std::size_t i = 0; i < g.size(); ++i) {
    if (!glu || i < 3) {
      INFO("gradient " << i);
      CHECK(reference::max_relative_error(down(dg[i]), g[i]) <= 1e-4);
      ++compared;
    }
  }
  return compared;
}

}  // namespace

TEST_CASE("cuda: glu silu backward matches space::host", "[cuda][backward]") {
  CHECK(check_expert_backward<expert::swiglu>() == 4);
}

TEST_CASE("cuda: mlp relu with biases backward matches space::host", "[cuda][backward]") {
  CHECK(check_expert_backward<expert::mlp<act::relu, true>>() == 5);
}

}  // namespace expert_backward_tests
