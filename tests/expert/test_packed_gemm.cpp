// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
//
// The packed-weights GEMM (space/host_packed.hpp, issue 22) on every path this CPU runs and
// the portable one: odd rows, columns and K, row strides, a panel range, repacking in place.
#include <catch2/catch.hpp>
#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include "uniform.hpp"
#include <epmoe/space/host_packed.hpp>

using epmoe::index_t;
using epmoe::matrix_view;
using epmoe::space::cpu_path;

namespace {

std::vector<cpu_path> paths_here() {
  std::vector<cpu_path> out;
  for (cpu_path p : {cpu_path::portable, cpu_path::avx2, cpu_path::avx512, cpu_path::avx512_bf16})
    if (epmoe::space::cpu_runs(p)) out.push_back(p);
  return out;
}

// c = a bᵀ on (M, N, K) with padded strides, c NaN before the call (a cell nobody wrote
// fails), against a double loop; columns outside [first column, last) and the padding keep
// their sentinel. Returns the cells checked.
index_t check(cpu_path path, index_t M, index_t N, index_t K, index_t p0 = 0, index_t p1 = -1,
              epmoe::packed_precision as = epmoe::packed_precision::fp32) {
  const bool bf16 = as == epmoe::packed_precision::bf16;
  CAPTURE(epmoe::space::name_of(path), M, N, K, p0, p1, bf16);
  const index_t lda = K + 3, ldb = K + 1, ldc = N + 2;
  const auto a = test::uniform(static_cast<std::size_t>(M * lda), 1 + M);
  const auto b = test::uniform(static_cast<std::size_t>(N * ldb), 2 + N);
  const epmoe::space::packed_nt packed(matrix_view<const float>(b.data(), N, K, ldb), as);
  if (p1 < 0) p1 = packed.panels();
  // AVX512-BF16 multiplies bf16 by bf16: a rounded as well.
  const bool round_a = epmoe::space::packed_reads_bf16_pairs(packed, path);
  CHECK(round_a == (bf16 && path == cpu_path::avx512_bf16));
  const float nan = std::numeric_limits<float>::quiet_NaN();
  std::vector<float> c(static_cast<std::size_t>(M * ldc), nan);
  epmoe::space::gemm_nt_packed(matrix_view<const float>(a.data(), M, K, lda), packed,
                               matrix_view<float>(c.data(), M, N, ldc), p0, p1, path);
  const index_t j0 = p0 * 32, j1 = std::min(N, p1 * 32);
  index_t checked = 0;
  for (index_t i = 0; i < M; ++i)
    for (index_t j = 0; j < ldc; ++j) {
      const float got = c[i * ldc + j];
      if (j < j0 || j >= j1) {  // not this call's columns, or padding: untouched
        CHECK(std::isnan(got));
        continue;
      }
      double s = 0, mag = 0;
      for (index_t k = 0; k < K; ++k) {
        const float w = b[j * ldb + k];
        const float x = a[i * lda + k];
        const double p = double{round_a ? epmoe::space::bf16_rounded(x) : x} *
                         (bf16 ? epmoe::space::bf16_rounded(w) : w);
        s += p;
        mag += std::abs(p);
      }
      CAPTURE(i, j, got, s);
      CHECK(std::abs(got - s) <= 1e-6 * mag + 1e-7);  // false for NaN
      ++checked;
    }
  return checked;
}

}  // namespace

TEST_CASE("packed gemm: every path this CPU runs equals a double loop, odd shapes") {
  const auto paths = paths_here();
  REQUIRE(paths.front() == cpu_path::portable);
  index_t cells = 0;
  for (cpu_path path : paths)
    for (index_t M : {1, 2, 3, 5, 6, 7, 13, 40})
      for (index_t N : {1, 17, 32, 33, 70})
        for (index_t K : {1, 3, 16, 37}) cells += check(path, M, N, K);
  CHECK(cells > 0);
  INFO("paths: " << paths.size() << ", best "
                 << epmoe::space::name_of(epmoe::space::best_cpu_path()));
  CHECK(epmoe::space::cpu_runs(epmoe::space::best_cpu_path()));
}

TEST_CASE("packed gemm: bf16 panels, every path, equal a double loop over the rounded weights") {
  index_t cells = 0;
  for (cpu_path path : paths_here())
    for (index_t M : {1, 5, 12, 13, 40})
      for (index_t N : {1, 17, 33, 70})
        for (index_t K : {1, 3, 16, 37})
          cells += check(path, M, N, K, 0, -1, epmoe::packed_precision::bf16);
  CHECK(cells > 0);
  // Rounding: to nearest even, NaN kept, bf16 values exact.
  using epmoe::space::bf16_rounded;
  CHECK(bf16_rounded(1.f) == 1.f);
  CHECK(bf16_rounded(1.f + 1.f / 256) == 1.f);               // a tie rounds to even
  CHECK(bf16_rounded(1.f + 3.f / 256) == 1.f + 4.f / 256);   // a tie rounds to even (up)
  CHECK(bf16_rounded(1.f + 1.5f / 256) == 1.f + 2.f / 256);  // nearest
  CHECK(std::isnan(bf16_rounded(std::numeric_limits<float>::quiet_NaN())));
  CHECK(std::isinf(bf16_rounded(std::numeric_limits<float>::infinity())));
}

TEST_CASE("packed gemm: a range of panels writes only its columns") {
  for (cpu_path path : paths_here()) {
    CHECK(check(path, 7, 100, 19, 1, 3) == 7 * 64);
    CHECK(check(path, 7, 100, 19, 3, 4) == 7 * 4);  // the last panel: 4 of its 32 columns
  }
}

TEST_CASE("packed gemm: repack refills in place, a new shape reallocates") {
  const index_t N = 40, K = 9;
  auto b = test::uniform(static_cast<std::size_t>(N * K), 7);
  epmoe::space::packed_nt p(matrix_view<const float>(b.data(), N, K));
  const float* first = p.panel<float>(0);
  for (float& v : b) v = -v;  // a training step changed the weights
  p.repack(matrix_view<const float>(b.data(), N, K));
  CHECK(p.panel<float>(0) == first);
  const auto x = test::uniform(static_cast<std::size_t>(K), 8);
  std::vector<float> y(static_cast<std::size_t>(N));
  epmoe::space::gemm_nt_packed(matrix_view<const float>(x.data(), 1, K), p,
                               matrix_view<float>(y.data(), 1, N));
  int compared = 0;
  for (index_t j = 0; j < N; ++j) {
    double s = 0;
    for (index_t k = 0; k < K; ++k) s += double{x[k]} * b[j * K + k];
    CHECK(std::abs(y[j] - s) <= 1e-5);
    ++compared;
  }
  CHECK(compared == N);
  p.repack(matrix_view<const float>(b.data(), N / 2, K));  // another shape
  CHECK(p.rows() == N / 2);
  CHECK(p.panels() == 1);
  CHECK(p.packed_bytes() == 32 * K * 4);
  p.repack(matrix_view<const float>(b.data(), N / 2, K), epmoe::packed_precision::bf16);
  CHECK(p.packed_bytes() == 32 * (K + 1) * 2);  // half the bytes (K odd: one zero per pair row)
}

TEST_CASE("packed gemm: rows to bf16 pairs, every path, equal the scalar rounding") {
  int rows = 0;
  for (cpu_path path : paths_here())
    for (index_t K : {1, 2, 31, 32, 33, 70}) {
      CAPTURE(epmoe::space::name_of(path), K);
      const index_t M = 3, lda = K + 5, stride = (K + 1) / 2 + 2;
      auto a = test::uniform(static_cast<std::size_t>(M * lda), 11 + K);
      a[0] = 1.f + 1.f / 256;  // a tie: to even
      std::vector<std::uint32_t> out(static_cast<std::size_t>(M * stride), 0xDEADBEEFu);
      epmoe::space::to_bf16_pairs(matrix_view<const float>(a.data(), M, K, lda), out.data(), stride,
                                  path);
      for (index_t i = 0; i < M; ++i, ++rows)
        for (index_t w = 0; w < stride; ++w) {
          const std::uint32_t got = out[i * stride + w];
          if (w >= (K + 1) / 2) {  // past the row: untouched
            CHECK(got == 0xDEADBEEFu);
            continue;
          }
          const index_t k = 2 * w;
          const std::uint32_t lo = epmoe::space::bf16_bits(a[i * lda + k]);
          const std::uint32_t hi = k + 1 < K ? epmoe::space::bf16_bits(a[i * lda + k + 1]) : 0u;
          CAPTURE(i, w);
          CHECK(got == (lo | hi << 16));
        }
    }
  CHECK(rows == 3 * 6 * static_cast<int>(paths_here().size()));
}
