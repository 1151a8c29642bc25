// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
//
// int8_channel packed weights (space/host_int8.hpp, issue 37): the packing against the
// format's scalar definition (reference/quantised.hpp), byte for byte, and every int8 kernel
// this CPU runs against the double loop over the dequantised values: odd K, K no multiple of
// a quad or a vector, rows 1..64, zero and ±max channels, zero rows, NaN and Inf.
#include <catch2/catch.hpp>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "uniform.hpp"
#include <epmoe/reference/quantised.hpp>
#include <epmoe/space/host_packed.hpp>

using epmoe::index_t;
using epmoe::matrix_view;
using epmoe::weights_format;
using epmoe::space::int8_kernel;

namespace {

std::vector<int8_kernel> kernels_here() {
  std::vector<int8_kernel> out;
  for (int8_kernel k :
       {int8_kernel::portable, int8_kernel::avx2, int8_kernel::avx512, int8_kernel::avx512_vnni})
    if (epmoe::space::cpu_runs(k)) out.push_back(k);
  return out;
}

// c = a wᵀ with b packed from fp32 (quantised at pack time) on `kernel`, c NaN before the
// call, against reference::gemm_int8: W8A8 on VNNI (int32 sums exact: a few fp32 roundings
// of the result), W8A16 elsewhere (fp32 sums: K roundings). Returns the cells checked.
index_t check(int8_kernel kernel, const std::vector<float>& a, const std::vector<float>& b,
              index_t M, index_t N, index_t K) {
  CAPTURE(epmoe::space::name_of(kernel), M, N, K);
  const index_t ldc = N + 3;
  const matrix_view<const float> av(a.data(), M, K), bv(b.data(), N, K);
  const epmoe::space::packed_nt packed(bv, weights_format::int8_channel);
  const auto ref = epmoe::reference::int8_channel::quantise(bv);
  const bool a8 = kernel == int8_kernel::avx512_vnni;
  std::vector<double> mag;
  const auto want = epmoe::reference::gemm_int8(av, ref, a8, &mag);
  std::vector<float> c(static_cast<std::size_t>(M * ldc), std::numeric_limits<float>::quiet_NaN());
  epmoe::space::gemm_nt_int8(av, packed, matrix_view<float>(c.data(), M, N, ldc), kernel);
  const double u = std::ldexp(1.0, -24);
  index_t checked = 0;
  for (index_t i = 0; i < M; ++i)
    for (index_t j = 0; j < ldc; ++j) {
      const float got = c[std::size_t(i * ldc + j)];
      if (j >= N) {  // the row's padding: untouched
        CHECK(std::isnan(got));
        continue;
      }
      const double w = want[std::size_t(i * N + j)], m = mag[std::size_t(i * N + j)];
      // (+ a denormal per rounding: the absolute unit of fp32 results below FLT_MIN)
      const double tiny = (K + 2) * double{std::numeric_limits<float>::denorm_min()};
      const double tol = (a8 ? 4 * u * std::abs(w) + 1e-12 * m : (K + 2) * u * m) + tiny;
      CAPTURE(i, j, got, w, tol);
      CHECK(std::abs(got - w) <= tol);  // false for NaN
      ++checked;
    }
  return checked;
}

index_t check(int8_kernel kernel, index_t M, index_t N, index_t K) {
  return check(kernel, test::uniform(std::size_t(M * K), 3 + M + K),
               test::uniform(std::size_t(N * K), 5 + N + K), M, N, K);
}

}  // namespace

TEST_CASE("int8 packing: quantised from fp32 as the format defines, byte for byte") {
  for (index_t N : {1, 31, 33, 70})
    for (index_t K : {1, 3, 4, 5, 37, 130}) {
      CAPTURE(N, K);
      auto b = test::uniform(std::size_t(N * K), 11 + N * K);
      for (index_t k = 0; k < K; ++k) b[std::size_t(k)] = 0;  // channel 0: all zero
      const matrix_view<const float> bv(b.data(), N, K);
      const epmoe::space::packed_nt from_fp32(bv, weights_format::int8_channel);
      const auto ref = epmoe::reference::int8_channel::quantise(bv);
      // The same weights quantised elsewhere (a checkpoint's q and scales): the same bytes.
      epmoe::space::packed_nt given;
      given.repack_int8(matrix_view<const std::int8_t>(ref.q.data(), N, K), ref.scale.data());
      REQUIRE(given.packed_bytes() == from_fp32.packed_bytes());
      CHECK(given.packed_bytes() == from_fp32.panels() * ((K + 3) / 4 * 128 + 256));
      CHECK(std::memcmp(given.panel<std::byte>(0), from_fp32.panel<std::byte>(0),
                        std::size_t(given.packed_bytes())) == 0);
      // unpack: scale * q, the values the kernels multiply by; |w - scale q| <= scale / 2.
      std::vector<float> w(b.size(), std::numeric_limits<float>::quiet_NaN());
      from_fp32.unpack(w.data());
      int max_q = 0;
      for (index_t n = 0; n < N; ++n)
        for (index_t k = 0; k < K; ++k) {
          const std::size_t at = std::size_t(n * K + k);
          CHECK(w[at] == static_cast<float>(ref.value(n, k)));
          CHECK(std::abs(w[at] - b[at]) <= ref.scale[std::size_t(n)] * 0.5f * (1 + 1e-6f));
          max_q = std::max(max_q, std::abs(int{ref.q[at]}));
        }
      CHECK(ref.scale[0] == 0);           // the zero channel
      CHECK(max_q == (N > 1 ? 127 : 0));  // every other channel's largest weight
    }
}

TEST_CASE("int8 gemm: every kernel this CPU runs equals the format's definition, odd shapes") {
  const auto kernels = kernels_here();
  REQUIRE(kernels.front() == int8_kernel::portable);
  index_t cells = 0;
  for (int8_kernel kernel : kernels)
    for (index_t M : {1, 2, 3, 5, 11, 12, 13, 25, 64})
      for (index_t N : {1, 17, 32, 33, 70})
        for (index_t K : {1, 3, 4, 5, 17, 37, 64, 67}) cells += check(kernel, M, N, K);
  CHECK(cells > 0);
  INFO("int8 kernels here: " << kernels.size() << ", best "
                             << name_of(
                                    epmoe::space::int8_kernel_for(epmoe::space::best_cpu_path())));
  CHECK(epmoe::space::cpu_runs(epmoe::space::int8_kernel_for(epmoe::space::best_cpu_path())));
}

TEST_CASE("int8 gemm: zero and ±max channels, zero rows, long sums") {
  // K = 4099: int32 sums near 255 * 127 * K on VNNI; channels all zero, all +max, alternating
  // ±max, a single nonzero; activations at ±their max and one row of zeros.
  const index_t M = 5, N = 40, K = 4099;
  auto a = test::uniform(std::size_t(M * K), 21), b = test::uniform(std::size_t(N * K), 22);
  for (index_t k = 0; k < K; ++k) {
    b[std::size_t(0 * K + k)] = 0;
    b[std::size_t(1 * K + k)] = 3e4f;
    b[std::size_t(2 * K + k)] = k % 2 ? -3e4f : 3e4f;
    b[std::size_t(3 * K + k)] = k == K - 1 ? -1e-3f : 0;
    a[std::size_t(0 * K + k)] = -2.5f;               // u8 = 1 everywhere
    a[std::size_t(1 * K + k)] = 0;                   // a zero row
    a[std::size_t(2 * K + k)] = k % 3 ? 7.f : -7.f;  // ±max
  }
  index_t cells = 0;
  for (int8_kernel kernel : kernels_here()) {
    cells += check(kernel, a, b, M, N, K);
    const epmoe::space::packed_nt packed(matrix_view<const float>(b.data(), N, K),
                                         weights_format::int8_channel);
    std::vector<float> c(std::size_t(M * N), -1.f);
    epmoe::space::gemm_nt_int8({a.data(), M, K}, packed, {c.data(), M, N}, kernel);
    for (index_t j = 0; j < N; ++j) CHECK(c[std::size_t(N + j)] == 0);  // the zero row
    for (index_t i = 0; i < M; ++i) CHECK(c[std::size_t(i * N)] == 0);  // the zero channel
    CHECK(c[1] == Approx(-2.5 * 3e4 * K).epsilon(1e-6));                // -max x +max
  }
  CHECK(cells == index_t(kernels_here().size()) * M * N);
}

TEST_CASE("int8 W8A8: a row too small for 127 / max |x| in fp32 quantises to zeros") {
  // max |x| = 1e-38 and a row of subnormals: 127 / max |x| overflows (an int conversion of
  // ±Inf or NaN before the fix); a normal row beside them keeps its values.
  const index_t M = 3, N = 33, K = 37;
  auto a = test::uniform(std::size_t(M * K), 41), b = test::uniform(std::size_t(N * K), 42);
  for (index_t k = 0; k < K; ++k) {
    b[std::size_t(5 * K + k)] = k % 4 ? 0.f : 1e-44f;  // a channel whose scale underflows to 0
    a[std::size_t(k)] = k % 2 ? 1e-38f : -5e-39f;
    a[std::size_t(K + k)] = k == 3 ? 2e-39f : (k % 3 ? 1e-42f : 0.f);
  }
  const epmoe::space::packed_nt packed(matrix_view<const float>(b.data(), N, K),
                                       weights_format::int8_channel);
  index_t rows = 0;
  for (int8_kernel kernel : kernels_here()) {
    CAPTURE(epmoe::space::name_of(kernel));
    CHECK(check(kernel, a, b, M, N, K) == M * N);
    std::vector<float> c(std::size_t(M * N), std::numeric_limits<float>::quiet_NaN());
    epmoe::space::gemm_nt_int8({a.data(), M, K}, packed, {c.data(), M, N}, kernel);
    for (index_t i = 0; i < 2; ++i, ++rows)
      for (index_t j = 0; j < N; ++j) {
        const float got = c[std::size_t(i * N + j)];
        CHECK(std::isfinite(got));
        CHECK(std::abs(got) < 1e-30f);  // 0 on W8A8; the tiny products on W8A16
      }
  }
  CHECK(rows == 2 * index_t(kernels_here().size()));
}

TEST_CASE("int8: NaN and Inf (weights refused at pack time, activations spread per row)") {
  const index_t N = 20, K = 9;
  auto b = test::uniform(std::size_t(N * K), 31);
  for (float bad : {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity(),
                    -std::numeric_limits<float>::infinity()}) {
    auto w = b;
    w[std::size_t(7 * K + 4)] = bad;
    epmoe::space::packed_nt p;
    CHECK_THROWS_WITH(p.repack({w.data(), N, K}, weights_format::int8_channel),
                      Catch::Contains("pack_weights(int8_channel)") &&
                          Catch::Contains("output channel 7") && Catch::Contains("NaN or Inf"));
  }
  // A bad scale of pre-quantised weights, and K past the int32 sums' reach.
  std::vector<std::int8_t> q(std::size_t(N * K), 1);
  std::vector<float> s(std::size_t(N), 0.5f);
  s[3] = -1;
  epmoe::space::packed_nt p;
  CHECK_THROWS_WITH(p.repack_int8({q.data(), N, K}, s.data()),
                    Catch::Contains("pack_weights(int8_channel)") && Catch::Contains(">= 0"));
  const index_t wide = epmoe::space::int8_max_cols + 1;
  std::vector<float> one(std::size_t(wide), 1.f);
  CHECK_THROWS_WITH(p.repack({one.data(), 1, wide}, weights_format::int8_channel),
                    Catch::Contains("at most 66311"));
  // Activations: a row holding NaN or Inf gives non-finite outputs (VNNI: NaN in every
  // column; W8A16: as fp32 arithmetic); the other rows are unaffected.
  const epmoe::space::packed_nt packed({b.data(), N, K}, weights_format::int8_channel);
  const auto ref = epmoe::reference::int8_channel::quantise({b.data(), N, K});
  for (int8_kernel kernel : kernels_here())
    for (float bad :
         {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity()}) {
      CAPTURE(name_of(kernel), bad);
      auto a = test::uniform(std::size_t(3 * K), 32);
      a[std::size_t(K + 2)] = bad;
      std::vector<float> c(std::size_t(3 * N), 0.f);
      epmoe::space::gemm_nt_int8({a.data(), 3, K}, packed, {c.data(), 3, N}, kernel);
      const auto want =
          epmoe::reference::gemm_int8({a.data(), 3, K}, ref, kernel == int8_kernel::avx512_vnni);
      for (index_t j = 0; j < N; ++j) {
        CHECK_FALSE(std::isfinite(c[std::size_t(N + j)]));
        if (kernel == int8_kernel::avx512_vnni) CHECK(std::isnan(c[std::size_t(N + j)]));
        for (index_t i : {0, 2})
          CHECK(c[std::size_t(i * N + j)] == Approx(want[std::size_t(i * N + j)]).margin(1e-5));
      }
    }
}
