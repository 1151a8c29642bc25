// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
#include <catch2/catch.hpp>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <span>
#include <vector>

#include "uniform.hpp"
#include <epmoe/core/concepts.hpp>
#include <epmoe/expert/mlp.hpp>
#include <epmoe/expert/swiglu.hpp>
#include <epmoe/reference/backward.hpp>
#include <epmoe/reference/compare.hpp>
#include <epmoe/space/host.hpp>

// The expert backward's building blocks on space::host (docs/training.md): the backward's
// grouped GEMMs against plain double loops (BLAS and portable paths), and each expert's
// backward (dX and every dW, recomputing the hidden layers) against reference::expert_grad in
// float64, row by row. Outputs start as NaN, so a value never written fails the comparison.
using namespace epmoe;

static_assert(training_space<space::host>);

namespace {

constexpr float nan = std::numeric_limits<float>::quiet_NaN();

// Groups of rows: offsets from counts (starting at `first`, as a unit's slice would).
std::vector<index_t> offsets_of(const std::vector<index_t>& counts, index_t first = 0) {
  std::vector<index_t> o{first};
  for (index_t c : counts) o.push_back(o.back() + c);
  return o;
}

// --- the GEMMs ------------------------------------------------------------------------------

// c_g (+)= a_g b_g, b_g [K, N]: a grouped matrix a [rows, K] (stride lda), through `gemm`,
// against a double loop; c starts as NaN (or as ones when accumulating).
template <class Gemm>
int check_nn(const std::vector<index_t>& counts, index_t K, index_t N, index_t lda, index_t align,
             bool accumulate, Gemm&& gemm) {
  const auto off = offsets_of(counts, 3);
  const int G = static_cast<int>(counts.size());
  const index_t rows = off.back() - off.front();
  const std::vector<float> a = test::uniform(static_cast<std::size_t>(rows * lda), 1);
  const std::vector<float> b = test::uniform(static_cast<std::size_t>(G * K * N), 2);
  const grouped_rows<const float> ag{a.data(), K, lda, G, off.data(), off.data(), align};
  std::vector<float> c(static_cast<std::size_t>(ag.elements(N)), accumulate ? 1.f : nan);
  const grouped_rows<float> cg = ag.over(c.data(), N);
  gemm(ag, stacked_view<const float>{b.data(), G, K, N}, cg, accumulate);
  std::vector<double> want, got;
  for (int g = 0; g < G; ++g)
    for (index_t r = off[g] - off[0]; r < off[g + 1] - off[0]; ++r)
      for (index_t j = 0; j < N; ++j) {
        double s = accumulate ? 1.0 : 0.0;
        for (index_t k = 0; k < K; ++k) s += double{a[r * lda + k]} * b[(g * K + k) * N + j];
        want.push_back(s);
        got.push_back(c[r * cg.stride + j]);
      }
  CHECK(want.size() == static_cast<std::size_t>(rows * N));
  CHECK(reference::max_relative_error(got, want) <= 1e-5);
  return 1;
}

// c_g [M, N] (+)= a_gᵀ b_g over each group's rows (a [rows, M], b [rows, N] over() a's groups);
// c starts as NaN (or ones when accumulating); an empty group gives zeros (or ones).
template <class Gemm>
int check_tn(const std::vector<index_t>& counts, index_t M, index_t N, index_t lda, index_t align,
             bool accumulate, Gemm&& gemm) {
  const auto off = offsets_of(counts, 2);
  const int G = static_cast<int>(counts.size());
  const index_t rows = off.back() - off.front();
  const std::vector<float> a = test::uniform(static_cast<std::size_t>(rows * lda), 3);
  const grouped_rows<const float> ag{a.data(), M, lda, G, off.data(), off.data(), align};
  const std::vector<float> b = test::uniform(static_cast<std::size_t>(ag.elements(N)), 4);
  const grouped_rows<const float> bg = ag.over(b.data(), N);
  const index_t ldc = N + 2;  // a strided stack
  std::vector<float> c(static_cast<std::size_t>(G * M * ldc), accumulate ? 1.f : nan);
  gemm(ag, bg, stacked_view<float>{c.data(), G, M, N, ldc, M * ldc}, accumulate);
  std::vector<double> want, got;
  for (int g = 0; g < G; ++g)
    for (index_t i = 0; i < M; ++i)
      for (index_t j = 0; j < N; ++j) {
        double s = accumulate ? 1.0 : 0.0;
        for (index_t r = off[g] - off[0]; r < off[g + 1] - off[0]; ++r)
          s += double{a[r * lda + i]} * b[r * bg.stride + j];
        want.push_back(s);
        got.push_back(c[(g * M + i) * ldc + j]);
      }
  CHECK(reference::max_relative_error(got, want) <= 1e-5);
  return 1;
}

const auto host_nn = [](auto a, auto b, auto c, bool acc) {
  space::host{}.grouped_gemm_nn(a, b, c, acc);
};
const auto host_tn = [](auto a, auto b, auto c, bool acc) {
  space::host{}.grouped_gemm_tn_accumulate(a, b, c, acc);
};
// The portable loops, whether or not the build found a BLAS.
const auto portable_nn = [](grouped_rows<const float> a, stacked_view<const float> b,
                            grouped_rows<float> c, bool acc) {
  for (int g = 0; g < a.groups; ++g)
    space::detail::gemm_nn_portable(a.group(g), b[g], c.group(g), acc);
};
const auto portable_tn = [](grouped_rows<const float> a, grouped_rows<const float> b,
                            stacked_view<float> c, bool acc) {
  for (int g = 0; g < a.groups; ++g)
    space::detail::gemm_tn_portable(a.group(g), b.group(g), c[g], acc);
};

}  // namespace

TEST_CASE("host: grouped_gemm_nn matches a double loop, empty groups, strided and aligned rows",
          "[expert][backward][gemm]") {
  const std::vector<index_t> counts{3, 0, 41, 1, 0};
  int ran = 0;
  for (bool acc : {false, true}) {
    ran += check_nn(counts, 19, 13, 19, 1, acc, host_nn);
    ran += check_nn(counts, 19, 13, 23, 8, acc, host_nn);
    ran += check_nn(counts, 19, 13, 19, 1, acc, portable_nn);
    ran += check_nn(counts, 19, 13, 23, 8, acc, portable_nn);
  }
  ran += check_nn({0, 0}, 5, 7, 5, 1, false, host_nn);
  CHECK(ran == 9);
}

TEST_CASE("host: grouped_gemm_tn_accumulate matches a double loop, empty groups give zeros",
          "[expert][backward][gemm]") {
  const std::vector<index_t> counts{3, 0, 41, 1, 0};
  int ran = 0;
  for (bool acc : {false, true}) {
    ran += check_tn(counts, 11, 17, 11, 1, acc, host_tn);
    ran += check_tn(counts, 11, 17, 14, 8, acc, host_tn);
    ran += check_tn(counts, 11, 17, 11, 1, acc, portable_tn);
    ran += check_tn(counts, 11, 17, 14, 8, acc, portable_tn);
  }
  ran += check_tn({0, 0}, 5, 7, 5, 1, false, host_tn);
  CHECK(ran == 9);
}

// --- the experts' backward ------------------------------------------------------------------

namespace {

// The layer's weight bundle over all of full_weights' experts (one rank holds them all).
template <class Expert>
typename Expert::weights layer_weights(const reference::full_weights& w) {
  const index_t E = w.cfg.experts, H = w.cfg.hidden, F = w.cfg.ffn;
  if constexpr (requires(typename Expert::weights x) { x.w3; })
    return {w.w1_view(), w.w3_view(), w.w2_view()};
  else if constexpr (Expert::biases)
    return {w.w1_view(), w.w2_view(), {w.b1.data(), E, 1, F}, {w.b2.data(), E, 1, H}};
  else
    return {w.w1_view(), w.w2_view()};
}

struct expert_case {
  std::vector<index_t> counts;  // rows per local expert
  index_t x_stride_pad = 0;     // extra elements per row of x, dy, dx
  index_t align = 1;            // the hidden layers' row alignment (over())
  bool dx_in_dy = false;        // dx written over dy
  bool dx_in_x = false;         // dx written over x
};

// Runs Expert::backward on space::host and compares dx and every dW with the float64
// reference (accumulated row by row); then once more with accumulate (every dW doubles).
// Returns the number of comparisons made.
template <class Expert>
int check_expert(const expert_case& k, std::uint64_t seed) {
  constexpr bool glu = requires(typename Expert::weights x) { x.w3; };
  const int L = static_cast<int>(k.counts.size());
  const layer_config cfg{
      .hidden = 24, .ffn = 20, .experts = L, .top_k = 1, .ranks = 1, .max_tokens = 64};
  const index_t H = cfg.hidden, F = cfg.ffn;
  const reference::full_weights w = reference::full_weights::random(cfg, seed);
  const typename Expert::weights lw = layer_weights<Expert>(w);

  const auto off = offsets_of(k.counts);
  const index_t rows = off.back(), ld = H + k.x_stride_pad;
  std::vector<float> x = test::uniform(static_cast<std::size_t>(rows * ld), seed + 1);
  const std::vector<float> x0 = x;
  std::vector<float> dy = test::uniform(static_cast<std::size_t>(rows * ld), seed + 2);
  const std::vector<float> dy0 = dy;
  std::vector<float> dx_own(static_cast<std::size_t>(rows * ld), nan);
  std::vector<float>& dx = k.dx_in_dy ? dy : k.dx_in_x ? x : dx_own;
  const grouped_rows<const float> xg{x.data(), H, ld, L, off.data(), off.data(), k.align};
  const grouped_rows<float> dyg{dy.data(), H, ld, L, off.data(), off.data(), k.align};
  const grouped_rows<float> dxg{dx.data(), H, ld, L, off.data(), off.data(), k.align};

  std::vector<float> dw1(L * F * H, nan), dw3(L * F * H, nan), dw2(L * H * F, nan);
  std::vector<float> db1(L * F, nan), db2(L * H, nan);
  typename Expert::grads g;
  if constexpr (glu)
    g = {{dw1.data(), L, F, H}, {dw3.data(), L, F, H}, {dw2.data(), L, H, F}};
  else if constexpr (Expert::biases)
    g = {
        {dw1.data(), L, F, H}, {dw2.data(), L, H, F}, {db1.data(), L, 1, F}, {db2.data(), L, 1, H}};
  else
    g = {{dw1.data(), L, F, H}, {dw2.data(), L, H, F}};

  const index_t Fp = (F + k.align - 1) / k.align * k.align;
  std::vector<float> scratch(static_cast<std::size_t>(rows * Expert::backward_scratch_per_row(Fp)),
                             nan);
  const space::host host;
  Expert::backward(host, lw, xg, grouped_rows<const float>(dyg), dxg, g, scratch.data());

  // The reference, row by row.
  auto ref = reference::gradients::zeros(cfg, rows);
  for (int e = 0; e < L; ++e)
    for (index_t r = off[e]; r < off[e + 1]; ++r) {
      std::vector<double> dout(dy0.begin() + r * ld, dy0.begin() + r * ld + H);
      reference::expert_grad<Expert>::add(w, {false, e}, x0.data() + r * ld, 1.0, dout, ref,
                                          std::span<double>(ref.dx).subspan(r * H, H));
    }
  int compared = 0;
  const auto compare = [&](const std::vector<float>& got, const std::vector<double>& want,
                           const char* what, double factor) {
    std::vector<double> scaled(want);
    for (double& v : scaled) v *= factor;
    INFO(what);
    CHECK(reference::max_relative_error(got, scaled) <= 1e-4);
    ++compared;
  };
  std::vector<float> dx_rows;  // dx without the row padding
  for (index_t r = 0; r < rows; ++r)
    dx_rows.insert(dx_rows.end(), dx.begin() + r * ld, dx.begin() + r * ld + H);
  compare(dx_rows, ref.dx, "dx", 1.0);
  const auto compare_weights = [&](double factor) {
    compare(dw1, ref.dw1, "dw1", factor);
    compare(dw2, ref.dw2, "dw2", factor);
    if constexpr (glu) compare(dw3, ref.dw3, "dw3", factor);
    if constexpr (!glu) {
      if constexpr (Expert::biases) {
        compare(db1, ref.db1, "db1", factor);
        compare(db2, ref.db2, "db2", factor);
      }
    }
  };
  compare_weights(1.0);
  // Accumulating: a second pass over the same rows doubles every weight gradient.
  if (!k.dx_in_dy && !k.dx_in_x) {
    Expert::backward(host, lw, xg, grouped_rows<const float>(dyg), dxg, g, scratch.data(), true);
    compare_weights(2.0);
  }
  return compared;
}

template <class Expert>
void check_expert_cases(int tensors) {
  int compared = 0;
  // 37 rows: over the streaming kernel's 32 (sgemm when BLAS is found); one group empty.
  compared += check_expert<Expert>({{5, 0, 37, 3}}, 11);
  compared += check_expert<Expert>({{2, 9, 0, 1}, 3, 8}, 12);     // strided x, aligned hidden rows
  compared += check_expert<Expert>({{4, 0, 6}, 0, 1, true}, 13);  // dx over dy
  compared += check_expert<Expert>({{0, 7, 2}, 0, 4, false, true}, 14);  // dx over x
  CHECK(compared == (1 + 2 * tensors) * 2 + 2 * (1 + tensors));
}

}  // namespace

TEST_CASE("expert backward: glu silu (SwiGLU) matches the float64 reference",
          "[expert][backward]") {
  check_expert_cases<expert::glu<act::silu>>(3);
}

TEST_CASE("expert backward: glu gelu_tanh matches the float64 reference", "[expert][backward]") {
  check_expert_cases<expert::glu<act::gelu_tanh>>(3);
}

TEST_CASE("expert backward: mlp relu with biases matches the float64 reference",
          "[expert][backward]") {
  check_expert_cases<expert::mlp<act::relu, true>>(4);
}

TEST_CASE("expert backward: mlp gelu matches the float64 reference", "[expert][backward]") {
  check_expert_cases<expert::mlp<act::gelu>>(2);
}

TEST_CASE("activation grad matches the float64 derivative", "[expert][backward]") {
  int ran = 0;
  for (float a = -4.f; a <= 4.f; a += 0.37f) {
    CHECK(std::abs(act::silu::grad(a) - reference::activation_grad<act::silu>::of(a)) <= 1e-6);
    CHECK(std::abs(act::gelu::grad(a) - reference::activation_grad<act::gelu>::of(a)) <= 1e-6);
    CHECK(std::abs(act::gelu_tanh::grad(a) - reference::activation_grad<act::gelu_tanh>::of(a)) <=
          1e-6);
    CHECK(act::relu::grad(a) == reference::activation_grad<act::relu>::of(a));
    ++ran;
  }
  CHECK(ran == 22);
}
