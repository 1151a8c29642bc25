// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
//
// The host space's own kernels: the streaming GEMM for few rows (every head/tail/odd-row
// path, helper threads, two callers at once) and the vectorised SiLU gate.
#include <catch2/catch.hpp>
#include <cmath>
#include <limits>
#include <random>
#include <thread>
#include <vector>

#include "uniform.hpp"
#include <epmoe/expert/swiglu.hpp>
#include <epmoe/space/host.hpp>

using epmoe::index_t;
using epmoe::matrix_view;

namespace {

// c = a b^T on (M, N, K) with padded strides and data starting `shift` floats into its
// buffer (so rows are not 32-byte aligned), by `gemm`; checked against a double loop, with the
// padding untouched.
template <class Gemm>
void check_gemm(index_t M, index_t N, index_t K, index_t shift, Gemm&& gemm) {
  CAPTURE(M, N, K, shift);
  const index_t lda = K + 3, ldb = K + 1, ldc = N + 2;
  const auto a = test::uniform(static_cast<std::size_t>(M * lda + shift), 1);
  const auto b = test::uniform(static_cast<std::size_t>(N * ldb + shift), 2);
  constexpr float sentinel = -777.f;
  std::vector<float> c(static_cast<std::size_t>(M * ldc), sentinel);
  gemm(matrix_view<const float>(a.data() + shift, M, K, lda),
       matrix_view<const float>(b.data() + shift, N, K, ldb),
       matrix_view<float>(c.data(), M, N, ldc));
  for (index_t i = 0; i < M; ++i) {
    for (index_t j = 0; j < N; ++j) {
      double s = 0, mag = 0;
      for (index_t k = 0; k < K; ++k) {
        const double p = double{a[shift + i * lda + k]} * b[shift + j * ldb + k];
        s += p;
        mag += std::abs(p);
      }
      CAPTURE(i, j);
      CHECK(std::abs(c[i * ldc + j] - s) <= 1e-6 * mag + 1e-7);
    }
    for (index_t j = N; j < ldc; ++j) CHECK(c[i * ldc + j] == sentinel);
  }
}

}  // namespace

TEST_CASE("host: gemm_nt matches a double loop on the streaming and the BLAS paths",
          "[expert][gemm]") {
  // M <= 32 streams b (odd M: the single-row path); more rows go to BLAS. K covers no vector
  // step, a masked tail only, and long rows; N % 4 != 0 the last columns.
  const index_t M = GENERATE(1, 2, 3, 4, 7, 12, 13, 32, 33);
  const index_t N = GENERATE(1, 4, 6, 9, 37);
  const index_t K = GENERATE(1, 5, 8, 9, 64, 203);
  const index_t shift = GENERATE(0, 1, 3);
  check_gemm(M, N, K, shift, [](auto a, auto b, auto c) { epmoe::space::host{}.gemm_nt(a, b, c); });
}

TEST_CASE("host: the streaming GEMM split over helper threads matches", "[expert][gemm]") {
  const int threads = GENERATE(2, 3);
  const index_t N = GENERATE(5, 40, 203);
  epmoe::space::detail::stream_helpers helpers;  // a space's own helper threads
  check_gemm(5, N, 77, 1, [&](auto a, auto b, auto c) {
    epmoe::space::detail::gemm_nt_stream(a, b, c, threads, &helpers);
  });
}

TEST_CASE("host: two threads streaming at once both get the right answer", "[expert][gemm]") {
  // One finds the helpers busy and runs its GEMM alone; neither waits on the other forever.
  const index_t M = 6, N = 96, K = 150;
  const auto a = test::uniform(M * K, 3), b = test::uniform(N * K, 4);
  std::vector<double> want(M * N);
  for (index_t i = 0; i < M; ++i)
    for (index_t j = 0; j < N; ++j)
      for (index_t k = 0; k < K; ++k) want[i * N + j] += double{a[i * K + k]} * b[j * K + k];
  std::vector<std::vector<float>> got(2, std::vector<float>(M * N));
  epmoe::space::detail::stream_helpers helpers;  // shared by both callers
  std::vector<std::thread> callers;
  for (int t = 0; t < 2; ++t)
    callers.emplace_back([&, t] {
      for (int rep = 0; rep < 50; ++rep)
        epmoe::space::detail::gemm_nt_stream({a.data(), M, K}, {b.data(), N, K},
                                             {got[t].data(), M, N}, 2, &helpers);
    });
  for (auto& c : callers) c.join();
  for (int t = 0; t < 2; ++t)
    for (index_t i = 0; i < M * N; ++i) CHECK(got[t][i] == Approx(want[i]).margin(1e-4));
}

TEST_CASE("host: silu_mul matches expert::silu_mul, extremes included", "[expert]") {
  std::vector<float> a, b;
  for (float x = -100.f; x < 100.f; x += 0.37f) a.push_back(x);
  for (float x : {0.f, -0.f, 1e-30f, -1e-30f, 30.f, -30.f, 88.5f, -88.5f, 1e4f, -1e4f, 3e38f,
                  -3e38f, std::numeric_limits<float>::infinity()})
    a.push_back(x);
  a.push_back(std::numeric_limits<float>::quiet_NaN());
  for (std::size_t i = 0; i < a.size(); ++i) b.push_back(0.25f + static_cast<float>(i % 7));
  std::vector<float> got = a;
  epmoe::space::host{}.silu_mul(got.data(), b.data(), static_cast<index_t>(got.size()));
  for (std::size_t i = 0; i < a.size(); ++i) {
    CAPTURE(a[i], b[i]);
    const float want = epmoe::expert::silu_mul(a[i], b[i]);
    if (std::isnan(want)) {
      CHECK(std::isnan(got[i]));
    } else if (std::isinf(want)) {
      CHECK(got[i] == want);
    } else if (std::abs(want) < 1e-30f) {
      CHECK(std::abs(got[i]) < 1e-30f);
    } else {
      CHECK(got[i] == Approx(want).epsilon(1e-6));
    }
  }
}
