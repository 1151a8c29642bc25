// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
//
// fp8_block and mxfp4 packed weights (space/host_fp8.hpp, host_mxfp4.hpp, issue 37): the
// decoding and rounding against the formats' definitions (reference/quantised.hpp), the
// packing from fp32 and from a checkpoint's tensors byte for byte, and every kernel this CPU
// runs against the double loop over the dequantised values: odd K, K no multiple of a block,
// N no multiple of a block, rows 1..64, zero, ±max and subnormal blocks, NaN and Inf.
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
using epmoe::space::minifloat_kernel;
namespace ref = epmoe::reference;

namespace {

constexpr float nan_f = std::numeric_limits<float>::quiet_NaN();

std::vector<minifloat_kernel> kernels_here() {
  std::vector<minifloat_kernel> out;
  for (minifloat_kernel k :
       {minifloat_kernel::portable, minifloat_kernel::avx2, minifloat_kernel::avx512,
        minifloat_kernel::avx512_vbmi, minifloat_kernel::avx512_bf16})
    if (epmoe::space::cpu_runs(k)) out.push_back(k);
  return out;
}

// The format's definition of weights b [N, K] (quantised by the reference), and the same
// codes packed from the checkpoint's tensors (the loaders).
struct fp8_case {
  static constexpr weights_format format = weights_format::fp8_block;
  using def = ref::fp8_block;
  static def quantise(matrix_view<const float> b) { return def::quantise(b); }
  static void load(epmoe::space::packed_nt& p, const def& d) {
    p.repack_fp8({d.q.data(), d.rows, d.cols}, d.scale.data());
  }
};
struct mxfp4_case {
  static constexpr weights_format format = weights_format::mxfp4;
  using def = ref::mxfp4;
  static def quantise(matrix_view<const float> b) { return def::quantise(b); }
  static void load(epmoe::space::packed_nt& p, const def& d) {
    const auto blocks = d.packed_blocks();
    p.repack_mxfp4(d.cols, {blocks.data(), d.rows, d.blocks() * 16},
                   {d.scale.data(), d.rows, d.blocks()});
  }
};

// c = a wᵀ over b packed from fp32 on `kernel`, c NaN before the call (and its padding
// columns checked untouched), against reference::gemm_dequantised (tokens rounded to bf16 on
// avx512_bf16). The kernels' sums are fp32 over K terms, each weight value * scale rounded at
// most once: |c - want| <= (K + 4) u Σ|a w|. Returns the cells checked.
template <class F>
index_t check(minifloat_kernel kernel, const std::vector<float>& a, const std::vector<float>& b,
              index_t M, index_t N, index_t K) {
  CAPTURE(epmoe::space::name_of(kernel), F::format.name(), M, N, K);
  const index_t ldc = N + 3;
  const matrix_view<const float> av(a.data(), M, K), bv(b.data(), N, K);
  const epmoe::space::packed_nt packed(bv, F::format);
  std::vector<double> mag;
  const auto want =
      ref::gemm_dequantised(av, F::quantise(bv), kernel == minifloat_kernel::avx512_bf16, &mag);
  std::vector<float> c(static_cast<std::size_t>(M * ldc), nan_f);
  epmoe::space::gemm_nt_minifloat(av, packed, matrix_view<float>(c.data(), M, N, ldc), kernel);
  const double u = std::ldexp(1.0, -24);
  index_t checked = 0;
  for (index_t i = 0; i < M; ++i)
    for (index_t j = 0; j < ldc; ++j) {
      const float got = c[std::size_t(i * ldc + j)];
      if (j >= N) {
        CHECK(std::isnan(got));
        continue;
      }
      const double w = want[std::size_t(i * N + j)];
      const double tol = (K + 4) * u * mag[std::size_t(i * N + j)];
      CAPTURE(i, j, got, w, tol);
      CHECK(std::abs(got - w) <= tol);  // false for NaN
      ++checked;
    }
  return checked;
}

}  // namespace

TEST_CASE("minifloat decoding: every code against the formats' definitions") {
  int n = 0;
  for (int b = 0; b < 256; ++b) {
    const auto u = static_cast<std::uint8_t>(b);
    const double want = ref::e4m3_value(u);
    const float got = epmoe::space::e4m3_float(u);
    CAPTURE(b, want, got);
    if ((b & 0x7f) == 0x7f) {
      CHECK((std::isnan(want) && std::isnan(got)));
    } else {
      CHECK(double{got} == want);
      CHECK(epmoe::space::e4m3_bits(got) == u);  // rounding a value gives its own code
    }
    ++n;
  }
  CHECK(ref::e4m3_value(0x7e) == 448);
  CHECK(ref::e4m3_value(0x01) == std::ldexp(1.0, -9));  // the smallest subnormal
  CHECK(ref::e4m3_value(0x08) == std::ldexp(1.0, -6));  // the smallest normal
  for (int c = 0; c < 16; ++c) {
    const auto u = static_cast<std::uint8_t>(c);
    CHECK(double{epmoe::space::e2m1_float(u)} == ref::e2m1_value(u));
    CHECK(epmoe::space::e2m1_code(epmoe::space::e2m1_float(u), 127) == u);
  }
  for (int e = 0; e < 253; ++e)
    CHECK(double{epmoe::space::e8m0_float(static_cast<std::uint8_t>(e))} ==
          ref::e8m0_value(static_cast<std::uint8_t>(e)));
  CHECK(std::isnan(ref::e8m0_value(0xff)));
  CHECK(n == 256);
}

TEST_CASE("minifloat rounding: nearest, ties to even, saturation, as the definitions") {
  // Midpoints between neighbouring codes round to the even one; just past them, up.
  for (int c = 0; c < 0x7e; ++c) {
    const double lo = ref::e4m3_value(std::uint8_t(c)), hi = ref::e4m3_value(std::uint8_t(c + 1));
    const auto mid = static_cast<float>((lo + hi) / 2);  // exact in fp32
    CAPTURE(c, mid);
    CHECK(epmoe::space::e4m3_bits(mid) == (c % 2 ? c + 1 : c));
    CHECK(epmoe::space::e4m3_bits(-mid) == (0x80 | (c % 2 ? c + 1 : c)));
    CHECK(epmoe::space::e4m3_bits(std::nextafter(mid, 1e9f)) == c + 1);
  }
  CHECK(epmoe::space::e4m3_bits(463.9f) == 0x7e);
  CHECK(epmoe::space::e4m3_bits(1e30f) == 0x7e);
  CHECK(epmoe::space::e4m3_bits(-0.f) == 0x80);
  // E2M1 at scale 2^0: 0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4,
  // 7 -> 6 (saturated).
  const std::pair<float, int> e2m1[] = {{0.25f, 0}, {0.26f, 1}, {0.75f, 2}, {1.25f, 2}, {1.75f, 4},
                                        {2.5f, 4},  {3.5f, 6},  {5.f, 6},   {5.5f, 7},  {7.9f, 7}};
  for (auto [v, code] : e2m1) {
    CHECK(epmoe::space::e2m1_code(v, 127) == code);
    CHECK(epmoe::space::e2m1_code(-v, 127) == (8 | code));
    const double mag[8] = {0, 0.5, 1, 1.5, 2, 3, 4, 6};
    CHECK(ref::nearest_code(v, mag, 8) == code);
  }
  CHECK(epmoe::space::mxfp4_scale(0.f) == 0);
  CHECK(epmoe::space::mxfp4_scale(6.f) == 127);   // floor(log2 6) - 2 = 0
  CHECK(epmoe::space::mxfp4_scale(7.9f) == 127);  // (7.9 saturates to 6)
  CHECK(epmoe::space::mxfp4_scale(8.f) == 128);
}

TEMPLATE_TEST_CASE("minifloat packing: from fp32 and from a checkpoint's tensors, byte for byte",
                   "", fp8_case, mxfp4_case) {
  for (index_t N : {1, 31, 33, 130, 260})
    for (index_t K : {1, 3, 32, 37, 128, 130, 300}) {
      CAPTURE(TestType::format.name(), N, K);
      auto b = test::uniform(std::size_t(N * K), 11 + N * K);
      for (index_t k = 0; k < K; ++k) b[std::size_t(k)] = 0;  // row 0: zero (a zero mxfp4 block)
      for (std::size_t i = 0; i < b.size(); i += 7) b[i] *= 1e-4f;  // small values: subnormals
      const matrix_view<const float> bv(b.data(), N, K);
      const epmoe::space::packed_nt from_fp32(bv, TestType::format);
      const auto def = TestType::quantise(bv);
      epmoe::space::packed_nt given;
      TestType::load(given, def);
      REQUIRE(given.packed_bytes() == from_fp32.packed_bytes());
      CHECK(std::memcmp(given.panel<std::byte>(0), from_fp32.panel<std::byte>(0),
                        std::size_t(given.packed_bytes())) == 0);
      CHECK(given.precision() == TestType::format);
      // unpack: the definition's values (fp8: value * scale rounded to fp32 once; mxfp4:
      // exact), within the format's rounding of the fp32 weights.
      std::vector<float> w(b.size(), nan_f);
      from_fp32.unpack(w.data());
      for (index_t n = 0; n < N; ++n)
        for (index_t k = 0; k < K; ++k) {
          const std::size_t at = std::size_t(n * K + k);
          CHECK(w[at] == static_cast<float>(def.value(n, k)));
        }
    }
}

TEST_CASE("minifloat packing: bytes per weight, the checkpoint's own sizes") {
  const index_t K = 4096, N = 64;
  std::vector<float> b(std::size_t(N * K), 0.5f);
  const epmoe::space::packed_nt f8({b.data(), N, K}, weights_format::fp8_block);
  const epmoe::space::packed_nt f4({b.data(), N, K}, weights_format::mxfp4);
  CHECK(f8.packed_bytes() == 2 * (K * 32 + 32 * 4 + 0));  // 1 byte a weight, 4 per 128 x 32
  CHECK(f4.packed_bytes() == 2 * (K * 16 + K));           // half a byte, 1 per 32 weights
}

TEMPLATE_TEST_CASE("minifloat gemm: every kernel this CPU runs equals the definition, odd shapes",
                   "", fp8_case, mxfp4_case) {
  const auto kernels = kernels_here();
  REQUIRE(kernels.front() == minifloat_kernel::portable);
  index_t cells = 0;
  for (minifloat_kernel kernel : kernels)
    for (index_t M : {1, 2, 3, 5, 8, 9, 13, 25, 64})
      for (index_t N : {1, 17, 33, 130})
        for (index_t K : {1, 3, 31, 33, 64, 129, 257}) {
          auto b = test::uniform(std::size_t(N * K), 5 + N + K);
          for (std::size_t i = 0; i < b.size(); i += 5) b[i] *= 1e-3f;  // subnormal codes
          cells +=
              check<TestType>(kernel, test::uniform(std::size_t(M * K), 3 + M + K), b, M, N, K);
        }
  CHECK(cells > 0);
  INFO("minifloat kernels here: " << kernels.size() << ", best "
                                  << name_of(epmoe::space::minifloat_kernel_for(
                                         epmoe::space::best_cpu_path())));
  CHECK(epmoe::space::cpu_runs(epmoe::space::minifloat_kernel_for(epmoe::space::best_cpu_path())));
  // The best path picks the best kernel the CPU runs (kernels_here: best last).
  CHECK(epmoe::space::minifloat_kernel_for(epmoe::space::best_cpu_path()) == kernels.back());
  // fp32 tokens (the AVX-512 path) take the VBMI kernel wherever the CPU has it, BF16 CPUs too.
  if (epmoe::space::cpu_runs(minifloat_kernel::avx512_vbmi))
    CHECK(epmoe::space::minifloat_kernel_for(epmoe::space::cpu_path::avx512) ==
          minifloat_kernel::avx512_vbmi);
  CHECK(epmoe::space::minifloat_kernel_for(epmoe::space::cpu_path::portable) ==
        minifloat_kernel::portable);
}

TEMPLATE_TEST_CASE("minifloat gemm: zero, ±max and tiny blocks, zero rows, long sums", "", fp8_case,
                   mxfp4_case) {
  // K = 4099 (33 fp8 blocks, 129 mxfp4 blocks); rows all zero, all +max, alternating ±max,
  // one tiny value (a subnormal code), values in [-1e-30, 1e-30] (tiny scales); tokens at ±
  // their max and a row of zeros.
  const index_t M = 5, N = 40, K = 4099;
  auto a = test::uniform(std::size_t(M * K), 21), b = test::uniform(std::size_t(N * K), 22);
  for (index_t k = 0; k < K; ++k) {
    b[std::size_t(0 * K + k)] = 0;
    b[std::size_t(1 * K + k)] = 3e4f;
    b[std::size_t(2 * K + k)] = k % 2 ? -3e4f : 3e4f;
    b[std::size_t(3 * K + k)] = k == K - 1 ? -1e-3f : 0;
    b[std::size_t(4 * K + k)] *= 1e-30f;
    a[std::size_t(0 * K + k)] = -2.5f;
    a[std::size_t(1 * K + k)] = 0;
    a[std::size_t(2 * K + k)] = k % 3 ? 7.f : -7.f;
  }
  index_t cells = 0;
  for (minifloat_kernel kernel : kernels_here()) {
    cells += check<TestType>(kernel, a, b, M, N, K);
    const epmoe::space::packed_nt packed({b.data(), N, K}, TestType::format);
    std::vector<float> c(std::size_t(M * N), -1.f);
    epmoe::space::gemm_nt_minifloat({a.data(), M, K}, packed, {c.data(), M, N}, kernel);
    for (index_t j = 0; j < N; ++j) CHECK(c[std::size_t(N + j)] == 0);  // the zero row
    for (index_t i = 0; i < M; ++i) CHECK(c[std::size_t(i * N)] == 0);  // the zero channel
    // -2.5 x +max: 3e4 is its fp8 block's max (448 * scale); mxfp4 saturates it (3e4 / 2^12 =
    // 7.3 -> 6): K times the definition's value, summed in fp32.
    const double w1 = TestType::quantise({b.data() + K, 1, K}).value(0, 0);
    CHECK(w1 == Approx(TestType::format == weights_format::fp8_block ? 3e4 : 6 * 4096.0));
    CHECK(c[1] == Approx(-2.5 * w1 * K).epsilon((K + 4) * 0x1p-24));
  }
  CHECK(cells == index_t(kernels_here().size()) * M * N);
}

TEST_CASE("mxfp4 W4A8 (AVX512-VNNI): the definition over the tokens quantised per row") {
  // Twice an E2M1 value is an integer: int8 dot products per block of 32, exact, times the
  // block's scale / 2 and the row's (reference::int8_token: the W8A8 rows' rounding), summed
  // in fp32: |c - want| <= (K + 4) u Σ|a8 w| as the other kernels'.
  if (!epmoe::space::mxfp4_w4a8(epmoe::space::cpu_path::avx512)) {
    WARN("no AVX512-VNNI with VBMI here: the W4A8 kernel is not run");
    return;
  }
  index_t cells = 0;
  for (index_t M : {1, 2, 5, 7, 13, 64})
    for (index_t N : {1, 17, 33, 130})
      for (index_t K : {1, 3, 31, 33, 64, 129, 257, 4099}) {
        CAPTURE(M, N, K);
        auto a = test::uniform(std::size_t(M * K), 7 + M + K);
        auto b = test::uniform(std::size_t(N * K), 9 + N + K);
        for (std::size_t i = 0; i < b.size(); i += 7) b[i] *= 1e-3f;  // subnormal codes
        if (N > 1)
          for (index_t k = 0; k < K; ++k) b[std::size_t(K + k)] = k % 2 ? -3e4f : 3e4f;  // ±max
        const index_t ldc = N + 3;
        const epmoe::space::packed_nt packed({b.data(), N, K}, weights_format::mxfp4);
        const auto w = ref::mxfp4::quantise({b.data(), N, K});
        std::vector<float> c(std::size_t(M * ldc), nan_f);
        epmoe::space::gemm_nt_mxfp4_w4a8({a.data(), M, K}, packed, {c.data(), M, N, ldc});
        for (index_t i = 0; i < M; ++i) {
          const auto t = ref::int8_token(a.data() + i * K, K);
          for (index_t j = 0; j < ldc; ++j) {
            const float got = c[std::size_t(i * ldc + j)];
            if (j >= N) {
              CHECK(std::isnan(got));  // the padding columns untouched
              continue;
            }
            double want = 0, mag = 0;
            for (index_t k = 0; k < K; ++k) {
              want += t[std::size_t(k)] * w.value(j, k);
              mag += std::abs(t[std::size_t(k)] * w.value(j, k));
            }
            CAPTURE(i, j, got, want);
            CHECK(std::abs(got - want) <= (K + 4) * 0x1p-24 * mag);  // false for NaN
            ++cells;
          }
        }
      }
  CHECK(cells == (1 + 2 + 5 + 7 + 13 + 64) * (1 + 17 + 33 + 130) * 8);  // Σ M x Σ N x Ks
  // Activations: a row holding NaN or Inf is all NaN (int8_token's rule), the others clean.
  const index_t N = 20, K = 45;
  const auto b = test::uniform(std::size_t(N * K), 31);
  const epmoe::space::packed_nt packed({b.data(), N, K}, weights_format::mxfp4);
  for (float bad : {nan_f, std::numeric_limits<float>::infinity()}) {
    auto a = test::uniform(std::size_t(3 * K), 32);
    std::vector<float> c(std::size_t(3 * N), 0.f), clean(c.size(), 0.f);
    epmoe::space::gemm_nt_mxfp4_w4a8({a.data(), 3, K}, packed, {clean.data(), 3, N});
    a[std::size_t(K + 2)] = bad;
    epmoe::space::gemm_nt_mxfp4_w4a8({a.data(), 3, K}, packed, {c.data(), 3, N});
    for (index_t j = 0; j < N; ++j) {
      CHECK(std::isnan(c[std::size_t(N + j)]));
      for (index_t i : {0, 2}) CHECK(c[std::size_t(i * N + j)] == clean[std::size_t(i * N + j)]);
    }
  }
}

TEST_CASE("minifloat: NaN and Inf (weights refused at pack time, activations spread per row)") {
  const index_t N = 20, K = 9;
  auto b = test::uniform(std::size_t(N * K), 31);
  for (float bad :
       {nan_f, std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity()}) {
    auto w = b;
    w[std::size_t(7 * K + 4)] = bad;
    epmoe::space::packed_nt p;
    CHECK_THROWS_WITH(p.repack({w.data(), N, K}, weights_format::fp8_block),
                      Catch::Contains("pack_weights(fp8_block)") &&
                          Catch::Contains("output channel 7") && Catch::Contains("NaN or Inf"));
    CHECK_THROWS_WITH(p.repack({w.data(), N, K}, weights_format::mxfp4),
                      Catch::Contains("pack_weights(mxfp4)") &&
                          Catch::Contains("output channel 7") && Catch::Contains("NaN or Inf"));
  }
  // A checkpoint's fp8 NaN code, a bad block scale, an E8M0 NaN (0xff) or overflowing scale,
  // blocks of the wrong shape.
  const auto f8 = ref::fp8_block::quantise({b.data(), N, K});
  epmoe::space::packed_nt p;
  for (std::uint8_t nan_code : {std::uint8_t{0x7f}, std::uint8_t{0xff}}) {
    auto q = f8.q;
    q[std::size_t(3 * K + 2)] = nan_code;
    CHECK_THROWS_WITH(p.repack_fp8({q.data(), N, K}, f8.scale.data()),
                      Catch::Contains("weight [3, 2]") && Catch::Contains("NaN"));
  }
  for (float s : {-1.f, nan_f, std::numeric_limits<float>::infinity(), 1e37f}) {
    auto scale = f8.scale;
    scale[0] = s;
    CHECK_THROWS_WITH(p.repack_fp8({f8.q.data(), N, K}, scale.data()),
                      Catch::Contains("scale_inv") && Catch::Contains("finite, >= 0"));
  }
  const auto f4 = ref::mxfp4::quantise({b.data(), N, K});
  const auto blocks = f4.packed_blocks();
  for (std::uint8_t e : {std::uint8_t{0xff}, std::uint8_t{253}}) {
    auto s = f4.scale;
    s[5] = e;
    CHECK_THROWS_WITH(p.repack_mxfp4(K, {blocks.data(), N, 16}, {s.data(), N, 1}),
                      Catch::Contains("pack_weights(mxfp4).scales") && Catch::Contains("[5, 0]") &&
                          Catch::Contains("at most 252"));
  }
  CHECK_THROWS_WITH(p.repack_mxfp4(K + 32, {blocks.data(), N, 16}, {f4.scale.data(), N, 1}),
                    Catch::Contains("ceil(K / 32) * 16"));
  // Activations: a row holding NaN or Inf gives non-finite outputs in its row (fp32 and bf16
  // arithmetic), the other rows are unaffected.
  for (weights_format format : {weights_format::fp8_block, weights_format::mxfp4}) {
    const epmoe::space::packed_nt packed({b.data(), N, K}, format);
    for (minifloat_kernel kernel : kernels_here())
      for (float bad : {nan_f, std::numeric_limits<float>::infinity()}) {
        CAPTURE(format.name(), name_of(kernel), bad);
        auto a = test::uniform(std::size_t(3 * K), 32);
        a[std::size_t(K + 2)] = bad;
        std::vector<float> c(std::size_t(3 * N), 0.f), clean(c.size(), 0.f);
        epmoe::space::gemm_nt_minifloat({a.data(), 3, K}, packed, {c.data(), 3, N}, kernel);
        a[std::size_t(K + 2)] = 0;
        epmoe::space::gemm_nt_minifloat({a.data(), 3, K}, packed, {clean.data(), 3, N}, kernel);
        for (index_t j = 0; j < N; ++j) {
          CHECK_FALSE(std::isfinite(c[std::size_t(N + j)]));
          for (index_t i : {0, 2})
            CHECK(c[std::size_t(i * N + j)] == clean[std::size_t(i * N + j)]);
        }
      }
  }
}
