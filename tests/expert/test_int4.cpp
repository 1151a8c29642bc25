// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
//
// The group-wise packed weights (int4, int4_asym, int8_group; space/host_int4.hpp, issue 37):
// the packing against the format's scalar definition (reference::group_weights), and every
// kernel this CPU runs against the double loop over the dequantised values: odd K, K no
// multiple of the group (the last group partial), rows 1..64, zero and ±max groups, NaN and
// Inf; the loader (repack_grouped) and its checks.
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
using epmoe::reference::group_weights;
using epmoe::space::int8_kernel;

namespace {

const weights_format formats[] = {weights_format::int4_g32, weights_format::int4_g128,
                                  weights_format::int4_asym_g32, weights_format::int4_asym_g128,
                                  weights_format::int8_g32};

std::vector<int8_kernel> kernels_here() {
  std::vector<int8_kernel> out;
  for (int8_kernel k :
       {int8_kernel::portable, int8_kernel::avx2, int8_kernel::avx512, int8_kernel::avx512_vnni})
    if (epmoe::space::cpu_runs(k)) out.push_back(k);
  return out;
}

// The same weights packed from the definition's q, scales and offsets (a loader's path).
epmoe::space::packed_nt given(const group_weights& r) {
  epmoe::space::packed_nt p;
  p.repack_grouped(r.format, {r.q.data(), r.rows, r.cols}, r.scale.data(), r.offset.data());
  return p;
}

// c = a wᵀ with b packed in f on `kernel`, c NaN before the call, against
// reference::gemm_grouped: W4A8 / W8A8 on VNNI (a group's int32 sum exact, then fp32: G + 5
// roundings of the magnitude), W4A16 / W8A16 elsewhere (each weight rounded once, fp32 sums:
// K + 3). Returns the cells checked.
index_t check(int8_kernel kernel, weights_format f, const std::vector<float>& a,
              const std::vector<float>& b, index_t M, index_t N, index_t K) {
  CAPTURE(name_of(kernel, f), f.group, M, N, K);
  const index_t ldc = N + 3;
  const matrix_view<const float> av(a.data(), M, K), bv(b.data(), N, K);
  const epmoe::space::packed_nt packed(bv, f);
  const auto ref = group_weights::quantise(bv, f);
  const bool a8 = kernel == int8_kernel::avx512_vnni;
  std::vector<double> mag;
  const auto want = epmoe::reference::gemm_grouped(av, ref, a8, &mag);
  std::vector<float> c(static_cast<std::size_t>(M * ldc), std::numeric_limits<float>::quiet_NaN());
  epmoe::space::gemm_nt_grouped(av, packed, matrix_view<float>(c.data(), M, N, ldc), kernel);
  const double u = std::ldexp(1.0, -24), G = double(ref.groups());
  index_t checked = 0;
  for (index_t i = 0; i < M; ++i)
    for (index_t j = 0; j < ldc; ++j) {
      const float got = c[std::size_t(i * ldc + j)];
      if (j >= N) {  // the row's padding: untouched
        CHECK(std::isnan(got));
        continue;
      }
      const double w = want[std::size_t(i * N + j)], m = mag[std::size_t(i * N + j)];
      const double tol = (a8 ? G + 5 : double(K) + 3) * u * m + 1e-30;
      CAPTURE(i, j, got, w, tol);
      CHECK(std::abs(got - w) <= tol);  // false for NaN
      ++checked;
    }
  return checked;
}

index_t check(int8_kernel kernel, weights_format f, index_t M, index_t N, index_t K) {
  return check(kernel, f, test::uniform(std::size_t(M * K), 3 + M + K),
               test::uniform(std::size_t(N * K), 5 + N + K), M, N, K);
}

}  // namespace

TEST_CASE("int4 packing: quantised from fp32 as the format defines, the loader's bytes equal") {
  index_t values = 0;
  for (weights_format f : formats)
    for (index_t N : {1, 31, 33, 70})
      for (index_t K : {1, 5, 31, 32, 33, 100, 130, 257}) {
        CAPTURE(f.name(), f.group, N, K);
        auto b = test::uniform(std::size_t(N * K), 11 + N * K);
        for (index_t k = 0; k < K; ++k) b[std::size_t(k)] = 0;  // channel 0: all zero
        if (N > 1)
          for (index_t k = 0; k < K; ++k) b[std::size_t(K + k)] = 0.25f;  // channel 1: constant
        const matrix_view<const float> bv(b.data(), N, K);
        const epmoe::space::packed_nt from_fp32(bv, f);
        const auto ref = group_weights::quantise(bv, f);
        const index_t G = (K + f.group - 1) / f.group;
        REQUIRE(ref.groups() == G);
        const index_t block = f.group / 4 * (f.id == weights_format::kind::int8_group ? 128 : 64) +
                              (f.id == weights_format::kind::int4_asym ? 256 : 128);
        CHECK(from_fp32.packed_bytes() == from_fp32.panels() * G * block);
        const auto loaded = given(ref);
        REQUIRE(loaded.packed_bytes() == from_fp32.packed_bytes());
        CHECK(std::memcmp(loaded.panel<std::byte>(0), from_fp32.panel<std::byte>(0),
                          std::size_t(loaded.packed_bytes())) == 0);
        // unpack: fma(s, q, m), the values the W4A16 kernels multiply by; |w - s q - m| <=
        // s / 2 (int8_group, int4: q within its range; int4_asym: q in [0, 15]).
        std::vector<float> w(b.size(), std::numeric_limits<float>::quiet_NaN());
        from_fp32.unpack(w.data());
        for (index_t n = 0; n < N; ++n)
          for (index_t k = 0; k < K; ++k) {
            const std::size_t at = std::size_t(n * K + k);
            CHECK(w[at] == ref.value_fp32(n, k));
            CHECK(std::abs(w[at] - b[at]) <= ref.s(n, k) * 0.5f * (1 + 1e-5f) + 1e-7f);
            ++values;
          }
        // The zero channel: scale 0 (and offset 0); the constant one exact.
        for (index_t t = 0; t < G; ++t) CHECK(ref.scale[std::size_t(t)] == 0);
        if (N > 1 && f.id == weights_format::kind::int4_asym)
          for (index_t k = 0; k < K; ++k) CHECK(w[std::size_t(K + k)] == 0.25f);
      }
  CHECK(values > 0);
}

TEST_CASE("int4 packing: the integers reach their range, -8 and 7 (int4), 0 and 15 (asym)") {
  const index_t K = 64;
  std::vector<float> b(static_cast<std::size_t>(K));
  for (index_t k = 0; k < K; ++k) b[std::size_t(k)] = -1 + 2.f * float(k) / float(K - 1);
  for (weights_format f : formats) {
    const auto ref = group_weights::quantise({b.data(), 1, K}, f);
    const auto [lo, hi] = std::minmax_element(ref.q.begin(), ref.q.end());
    CAPTURE(f.name());
    // (int4: -max / (max / 7.5) is -7.5 give or take a rounding of the scale: -8 or -7)
    CHECK(int{*lo} <= (f.id == weights_format::kind::int4        ? -7
                       : f.id == weights_format::kind::int4_asym ? 0
                                                                 : -127));
    CHECK(int{*hi} == (f.id == weights_format::kind::int4        ? 7
                       : f.id == weights_format::kind::int4_asym ? 15
                                                                 : 127));
  }
}

TEST_CASE("int4 gemm: every kernel this CPU runs equals the format's definition, odd shapes") {
  const auto kernels = kernels_here();
  REQUIRE(kernels.front() == int8_kernel::portable);
  index_t cells = 0;
  for (int8_kernel kernel : kernels)
    for (weights_format f : formats)
      for (index_t M : {1, 2, 5, 6, 7, 9, 13, 25, 64})
        for (index_t N : {1, 17, 32, 33, 70})
          for (index_t K : {1, 3, 5, 32, 37, 67, 131, 260}) cells += check(kernel, f, M, N, K);
  CHECK(cells > 0);
  INFO(
      "int4 kernels here: " << kernels.size() << ", best "
                            << name_of(epmoe::space::int8_kernel_for(epmoe::space::best_cpu_path()),
                                       weights_format::int4_g32));
  CHECK(epmoe::space::cpu_runs(epmoe::space::int8_kernel_for(epmoe::space::best_cpu_path())));
}

TEST_CASE("int4 gemm: zero and ±max groups, zero rows, long sums") {
  // K = 4099: the last group holds 3 (g 32) or 3 (g 128) inputs; group sums at their int32
  // reach on VNNI; channels all zero, all +max, alternating ±max, a single nonzero.
  const index_t M = 5, N = 40, K = 4099;
  auto a = test::uniform(std::size_t(M * K), 21), b = test::uniform(std::size_t(N * K), 22);
  for (index_t k = 0; k < K; ++k) {
    b[std::size_t(0 * K + k)] = 0;
    b[std::size_t(1 * K + k)] = 3e4f;
    b[std::size_t(2 * K + k)] = k % 2 ? -3e4f : 3e4f;
    b[std::size_t(3 * K + k)] = k == K - 1 ? -1e-3f : 0;
    a[std::size_t(0 * K + k)] = -2.5f;               // qx = -127 everywhere
    a[std::size_t(1 * K + k)] = 0;                   // a zero row
    a[std::size_t(2 * K + k)] = k % 3 ? 7.f : -7.f;  // ±max
  }
  index_t cells = 0;
  for (int8_kernel kernel : kernels_here())
    for (weights_format f : formats) {
      cells += check(kernel, f, a, b, M, N, K);
      CAPTURE(name_of(kernel, f), f.group);
      const epmoe::space::packed_nt packed(matrix_view<const float>(b.data(), N, K), f);
      std::vector<float> c(std::size_t(M * N), -1.f);
      epmoe::space::gemm_nt_grouped({a.data(), M, K}, packed, {c.data(), M, N}, kernel);
      for (index_t j = 0; j < N; ++j) CHECK(c[std::size_t(N + j)] == 0);  // the zero row
      for (index_t i = 0; i < M; ++i) CHECK(c[std::size_t(i * N)] == 0);  // the zero channel
      // -max x +max: int4 holds +max as 7 (max / 7.5), the others exactly.
      const double top = f.id == weights_format::kind::int4 ? 3e4 / 7.5 * 7 : 3e4;
      CHECK(c[1] == Approx(-2.5 * top * K).epsilon((K + 3) * 0x1p-24));  // fp32 sums
    }
  CHECK(cells == index_t(kernels_here().size()) * 5 * M * N);
}

TEST_CASE("int4: NaN and Inf (weights refused at pack time, activations spread per row)") {
  const index_t N = 20, K = 45;
  auto b = test::uniform(std::size_t(N * K), 31);
  for (weights_format f : formats)
    for (float bad :
         {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity(),
          -std::numeric_limits<float>::infinity()}) {
      auto w = b;
      w[std::size_t(7 * K + 40)] = bad;
      epmoe::space::packed_nt p;
      CHECK_THROWS_WITH(
          p.repack({w.data(), N, K}, f),
          Catch::Contains(std::string("pack_weights(") + f.name() + ")") &&
              Catch::Contains("output channel 7, group " + std::to_string(40 / f.group)) &&
              Catch::Contains("NaN or Inf"));
    }
  // Activations: a row holding NaN or Inf gives non-finite outputs (VNNI: NaN in every
  // column; W4A16: as fp32 arithmetic); the other rows are unaffected.
  for (weights_format f : formats) {
    const epmoe::space::packed_nt packed({b.data(), N, K}, f);
    const auto ref = group_weights::quantise({b.data(), N, K}, f);
    for (int8_kernel kernel : kernels_here())
      for (float bad :
           {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity()}) {
        CAPTURE(name_of(kernel, f), bad);
        auto a = test::uniform(std::size_t(3 * K), 32);
        a[std::size_t(K + 2)] = bad;
        std::vector<float> c(std::size_t(3 * N), 0.f);
        epmoe::space::gemm_nt_grouped({a.data(), 3, K}, packed, {c.data(), 3, N}, kernel);
        const auto want = epmoe::reference::gemm_grouped({a.data(), 3, K}, ref,
                                                         kernel == int8_kernel::avx512_vnni);
        for (index_t j = 0; j < N; ++j) {
          CHECK_FALSE(std::isfinite(c[std::size_t(N + j)]));
          if (kernel == int8_kernel::avx512_vnni) CHECK(std::isnan(c[std::size_t(N + j)]));
          for (index_t i : {0, 2})
            CHECK(c[std::size_t(i * N + j)] == Approx(want[std::size_t(i * N + j)]).margin(1e-5));
        }
      }
  }
}

TEST_CASE("int4 loader: repack_grouped checks the integers, scales, offsets and the group") {
  const index_t N = 3, K = 40;
  std::vector<std::int8_t> q(std::size_t(N * K), 1);
  std::vector<float> s(std::size_t(N * 2), 0.5f), m(s.size(), -1.f);
  epmoe::space::packed_nt p;
  q[5] = 8;  // past int4's 7
  CHECK_THROWS_WITH(p.repack_grouped(weights_format::int4_g32, {q.data(), N, K}, s.data()),
                    Catch::Contains("repack_grouped(int4).q") && Catch::Contains("[-8, 7]"));
  q[5] = -1;  // below int4_asym's 0
  CHECK_THROWS_WITH(
      p.repack_grouped(weights_format::int4_asym_g32, {q.data(), N, K}, s.data(), m.data()),
      Catch::Contains("repack_grouped(int4_asym).q") && Catch::Contains("[0, 15]"));
  q[5] = 1;
  CHECK_THROWS_WITH(p.repack_grouped(weights_format::int4_asym_g32, {q.data(), N, K}, s.data()),
                    Catch::Contains("offsets") && Catch::Contains("needs an offset"));
  s[3] = std::numeric_limits<float>::infinity();
  CHECK_THROWS_WITH(
      p.repack_grouped(weights_format::int8_g32, {q.data(), N, K}, s.data()),
      Catch::Contains("repack_grouped(int8_group).scales") && Catch::Contains("finite"));
  s[3] = 0.5f, m[4] = std::numeric_limits<float>::quiet_NaN();
  CHECK_THROWS_WITH(
      p.repack_grouped(weights_format::int4_asym_g32, {q.data(), N, K}, s.data(), m.data()),
      Catch::Contains("offsets") && Catch::Contains("finite"));
  CHECK_THROWS_WITH(p.repack_grouped(weights_format::int8_channel, {q.data(), N, K}, s.data()),
                    Catch::Contains("group-wise"));
  for (int g : {0, 16, 48, 8192}) {
    std::vector<float> w(std::size_t(N * K), 1.f);
    CHECK_THROWS_WITH(p.repack({w.data(), N, K}, {weights_format::kind::int4, g}),
                      Catch::Contains("pack_weights(int4).group") &&
                          Catch::Contains("multiple of 32, at most 4096"));
  }
  // Group 64 (GPTQ/AWQ's other common size) packs and computes as the rest.
  const weights_format g64{weights_format::kind::int4_asym, 64};
  index_t cells = 0;
  for (int8_kernel kernel : kernels_here()) cells += check(kernel, g64, 7, 33, 150);
  CHECK(cells == index_t(kernels_here().size()) * 7 * 33);
}

TEST_CASE("int4 act order: a copy holding its inputs in another order multiplies them gathered") {
  // An act-order checkpoint (GPTQ's desc_act) quantises the inputs in the order `order`: the
  // copy's column j is input order[j]. c = a wᵀ must then equal the definition over a's
  // inputs gathered in that order, on every kernel, and unpack() give w in its own order.
  index_t cells = 0;
  for (weights_format f : {weights_format::int4_asym_g32, weights_format::int8_g32})
    for (const index_t K : {37, 96, 131}) {
      const index_t M = 5, N = 33;
      const std::vector<float> a = test::uniform(std::size_t(M * K), 7 + K);
      const std::vector<float> b = test::uniform(std::size_t(N * K), 9 + K);
      std::vector<index_t> order(static_cast<std::size_t>(K));
      for (index_t j = 0; j < K; ++j) order[std::size_t(j)] = (j * 17 + 5) % K;  // (17 ⊥ K)
      std::vector<float> gathered(a.size());
      for (index_t i = 0; i < M; ++i)
        for (index_t j = 0; j < K; ++j)
          gathered[std::size_t(i * K + j)] = a[std::size_t(i * K + order[std::size_t(j)])];
      const auto ref = group_weights::quantise({b.data(), N, K}, f);
      epmoe::space::packed_nt packed = given(ref);
      packed.set_input_order(order);
      std::vector<float> values(std::size_t(N * K)), plain(values.size());
      packed.unpack(values.data());
      given(ref).unpack(plain.data());
      for (index_t n = 0; n < N; ++n)
        for (index_t j = 0; j < K; ++j)
          REQUIRE(values[std::size_t(n * K + order[std::size_t(j)])] ==
                  plain[std::size_t(n * K + j)]);
      for (int8_kernel kernel : kernels_here()) {
        CAPTURE(name_of(kernel, f), K);
        const bool a8 = kernel == int8_kernel::avx512_vnni;
        std::vector<double> mag;
        const auto want = epmoe::reference::gemm_grouped({gathered.data(), M, K}, ref, a8, &mag);
        std::vector<float> c(std::size_t(M * N), std::numeric_limits<float>::quiet_NaN());
        epmoe::space::gemm_nt_grouped({a.data(), M, K}, packed, {c.data(), M, N}, kernel);
        const double tol = (a8 ? double(ref.groups()) + 5 : double(K) + 3) * std::ldexp(1.0, -24);
        for (std::size_t i = 0; i < c.size(); ++i) {
          CHECK(std::abs(c[i] - want[i]) <= tol * mag[i] + 1e-30);  // false for NaN
          ++cells;
        }
      }
      packed.repack({b.data(), N, K}, f);  // packed from values: their own order again
      CHECK(packed.input_order().empty());
    }
  CHECK(cells == 2 * 3 * 5 * 33 * index_t(kernels_here().size()));

  const index_t N = 3, K = 40;
  std::vector<std::int8_t> q(std::size_t(N * K), 1);
  std::vector<float> s(std::size_t(N * 2), 0.5f);
  epmoe::space::packed_nt p;
  p.repack_grouped(weights_format::int8_g32, {q.data(), N, K}, s.data());
  std::vector<index_t> order(static_cast<std::size_t>(K));
  for (index_t j = 0; j < K; ++j) order[std::size_t(j)] = K - 1 - j;
  order[3] = order[4];  // twice
  CHECK_THROWS_WITH(p.set_input_order(order), Catch::Contains("repack_grouped.order") &&
                                                  Catch::Contains("permutation of [0, K)"));
  order[3] = K;  // out of range
  CHECK_THROWS_WITH(p.set_input_order(order), Catch::Contains("permutation"));
  CHECK_THROWS_WITH(p.set_input_order(std::span(order).first(K - 1)),
                    Catch::Contains("one index per input"));
  CHECK(p.input_order().empty());  // (nothing set by a refused order)
  std::vector<float> w(std::size_t(N * K), 1.f);
  p.repack({w.data(), N, K}, weights_format::bf16);
  order[3] = K - 4;
  CHECK_THROWS_WITH(p.set_input_order(order), Catch::Contains("group-wise"));
}
