// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
#include <catch2/catch.hpp>
#include <cmath>
#include <random>
#include <string>
#include <vector>

#include <epmoe/core/concepts.hpp>
#include <epmoe/core/config.hpp>
#include <epmoe/core/error.hpp>
#include <epmoe/expert/swiglu.hpp>
#include <epmoe/space/host.hpp>

using epmoe::index_t;
using epmoe::matrix_view;
using epmoe::stacked_view;
using epmoe::expert::swiglu;

namespace {

std::vector<float> random_vector(std::size_t n, std::uint64_t seed, float scale = 1.f) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> d(-scale, scale);
  std::vector<float> v(n);
  for (float& x : v) x = d(rng);
  return v;
}

epmoe::layer_config small_cfg(int experts) {
  epmoe::layer_config c;
  c.hidden = 13;
  c.ffn = 19;
  c.experts = experts;
  c.top_k = 1;
  c.ranks = 1;
  c.max_tokens = 8;
  c.validate();
  return c;
}

// The config's L = experts local experts, dense, PyTorch [out, in] layout.
struct expert_weights {
  index_t L, H, F;
  std::vector<float> w1, w3, w2;
  explicit expert_weights(const epmoe::layer_config& c)
      : L(c.experts_per_rank()),
        H(c.hidden),
        F(c.ffn),
        w1(random_vector(static_cast<std::size_t>(L * F * H), 1, 0.3f)),
        w3(random_vector(static_cast<std::size_t>(L * F * H), 2, 0.3f)),
        w2(random_vector(static_cast<std::size_t>(L * H * F), 3, 0.3f)) {}
  swiglu::weights view() const {
    return {{w1.data(), L, F, H}, {w3.data(), L, F, H}, {w2.data(), L, H, F}};
  }
};

template <class F>
std::string field_of(F&& f) {
  try {
    f();
  } catch (const epmoe::config_error& e) {
    return e.field();
  }
  return "<no config_error>";
}

}  // namespace

TEST_CASE("swiglu: satisfies expert_policy", "[expert]") {
  STATIC_REQUIRE(epmoe::expert_policy<swiglu, epmoe::space::host>);
  STATIC_REQUIRE(epmoe::space_policy<epmoe::space::host>);
}

TEST_CASE("swiglu: forward on space::host matches a double-precision loop", "[expert]") {
  const auto cfg = small_cfg(3);
  const expert_weights w(cfg);
  const index_t H = w.H, F = w.F, stride = H + 5;
  const index_t rows = GENERATE(0, 1, 7);
  const index_t j = GENERATE(0, 2);  // the last local expert exercises the batch stride
  CAPTURE(rows, j);

  // Strided input; the gap between rows holds a sentinel the expert must not touch.
  constexpr float sentinel = 12345.f;
  std::vector<float> buf(static_cast<std::size_t>(std::max<index_t>(rows, 1) * stride), sentinel);
  const auto input = random_vector(static_cast<std::size_t>(rows * H), 42);
  for (index_t i = 0; i < rows; ++i)
    for (index_t h = 0; h < H; ++h) buf[i * stride + h] = input[i * H + h];

  std::vector<float> scratch(static_cast<std::size_t>(rows * swiglu::scratch_per_row(cfg)), -1.f);
  swiglu::forward(epmoe::space::host{}, w.view(), j,
                  matrix_view<float>(buf.data(), rows, H, stride), scratch.data());

  const float* w1 = w.w1.data() + j * F * H;
  const float* w3 = w.w3.data() + j * F * H;
  const float* w2 = w.w2.data() + j * H * F;
  for (index_t i = 0; i < rows; ++i) {
    std::vector<double> h(static_cast<std::size_t>(F));
    for (index_t f = 0; f < F; ++f) {
      double a = 0, b = 0;
      for (index_t k = 0; k < H; ++k) {
        a += double{w1[f * H + k]} * input[i * H + k];
        b += double{w3[f * H + k]} * input[i * H + k];
      }
      h[f] = a / (1.0 + std::exp(-a)) * b;
    }
    for (index_t o = 0; o < H; ++o) {
      double y = 0;
      for (index_t f = 0; f < F; ++f) y += double{w2[o * F + f]} * h[f];
      CAPTURE(i, o);
      CHECK(buf[i * stride + o] == Approx(y).margin(1e-5));
    }
    for (index_t g = H; g < stride; ++g) CHECK(buf[i * stride + g] == sentinel);
  }
  if (rows == 0) CHECK(buf[0] == sentinel);
}

TEST_CASE("swiglu: silu_mul at 0, large positive and large negative", "[expert]") {
  using epmoe::expert::silu_mul;
  CHECK(silu_mul(0.f, 5.f) == 0.f);
  CHECK(silu_mul(1.f, 1.f) == Approx(1.0 / (1.0 + std::exp(-1.0))).epsilon(1e-6));
  CHECK(silu_mul(-1.f, 2.f) == Approx(-2.0 / (1.0 + std::exp(1.0))).epsilon(1e-6));
  CHECK(silu_mul(30.f, 2.f) == Approx(60.0).epsilon(1e-6));  // silu(a) -> a
  CHECK(silu_mul(1e4f, 0.5f) == Approx(5e3).epsilon(1e-6));
  for (float a : {-30.f, -100.f, -1e4f, -3e38f}) {  // silu(a) -> 0, never NaN
    CAPTURE(a);
    const float v = silu_mul(a, 3.f);
    CHECK(std::isfinite(v));
    CHECK(std::abs(v) < 1e-10f);
  }
}

TEST_CASE("swiglu: validate names the weight with the wrong shape", "[expert][error]") {
  const auto cfg = small_cfg(2);
  const expert_weights w(cfg);
  const index_t L = w.L, H = w.H, F = w.F;
  CHECK_NOTHROW(swiglu::validate(cfg, w.view()));

  SECTION("w1") {
    auto v = w.view();
    v.w1 = stacked_view<const float>(w.w1.data(), L, F, H - 1);
    CHECK(field_of([&] { swiglu::validate(cfg, v); }) == "weights.experts.w1");
    v.w1 = stacked_view<const float>(w.w1.data(), L - 1, F, H);
    CHECK(field_of([&] { swiglu::validate(cfg, v); }) == "weights.experts.w1");
  }
  SECTION("w3") {
    auto v = w.view();
    v.w3 = stacked_view<const float>(w.w3.data(), L, H, F);  // transposed
    CHECK(field_of([&] { swiglu::validate(cfg, v); }) == "weights.experts.w3");
    v.w3 = stacked_view<const float>(nullptr, L, F, H);
    CHECK(field_of([&] { swiglu::validate(cfg, v); }) == "weights.experts.w3");
  }
  SECTION("w2") {
    auto v = w.view();
    v.w2 = stacked_view<const float>(w.w2.data(), L, F, H);  // transposed
    CHECK(field_of([&] { swiglu::validate(cfg, v); }) == "weights.experts.w2");
    v.w2 = stacked_view<const float>(w.w2.data(), L, H, F, F - 1, H * F);  // stride < cols
    CHECK(field_of([&] { swiglu::validate(cfg, v); }) == "weights.experts.w2");
  }
}

TEST_CASE("swiglu: flops_per_row is 6*H*F and scratch is 2*F per row", "[expert]") {
  const auto cfg = small_cfg(1);
  CHECK(swiglu::flops_per_row(cfg) == 6.0 * 13 * 19);
  CHECK(swiglu::scratch_per_row(cfg) == 2 * 19);
  epmoe::layer_config big = cfg;
  big.hidden = 4096;
  big.ffn = 14336;
  CHECK(swiglu::flops_per_row(big) == 6.0 * 4096 * 14336);
}

TEST_CASE("host: gemm_nt matches a double loop with strided operands", "[expert][gemm]") {
  // c[M,N] = a[M,K] * b[N,K]^T; N not a multiple of 4 covers the fallback's tail columns.
  const index_t M = GENERATE(1, 5), N = GENERATE(1, 7, 9), K = 11;
  CAPTURE(M, N);
  const index_t lda = K + 2, ldb = K + 5, ldc = N + 3;
  const auto a = random_vector(static_cast<std::size_t>(M * lda), 7);
  const auto b = random_vector(static_cast<std::size_t>(N * ldb), 8);
  constexpr float sentinel = -777.f;
  std::vector<float> c(static_cast<std::size_t>(M * ldc), sentinel);
  epmoe::space::host{}.gemm_nt({a.data(), M, K, lda}, {b.data(), N, K, ldb}, {c.data(), M, N, ldc});
  for (index_t i = 0; i < M; ++i) {
    for (index_t j = 0; j < N; ++j) {
      double s = 0;
      for (index_t k = 0; k < K; ++k) s += double{a[i * lda + k]} * b[j * ldb + k];
      CAPTURE(i, j);
      CHECK(c[i * ldc + j] == Approx(s).margin(1e-5));
    }
    for (index_t j = N; j < ldc; ++j) CHECK(c[i * ldc + j] == sentinel);
  }
}

TEST_CASE("host: gemm_nt with no rows or columns writes nothing", "[expert][gemm]") {
  const std::vector<float> a(12, 1.f), b(12, 1.f);
  std::vector<float> c(4, 5.f);
  epmoe::space::host{}.gemm_nt({a.data(), 0, 3}, {b.data(), 4, 3}, {c.data(), 0, 4});
  epmoe::space::host{}.gemm_nt({a.data(), 4, 3}, {b.data(), 0, 3}, {c.data(), 4, 0, 1});
  CHECK(c == std::vector<float>(4, 5.f));
}

TEST_CASE("host: allocate zero-fills and copy_blocks moves row blocks", "[expert]") {
  const epmoe::space::host s;
  auto buf = s.allocate<float>(6);
  REQUIRE(buf.size() == 6);
  for (index_t i = 0; i < 6; ++i) CHECK(buf.data()[i] == 0.f);
  CHECK(s.allocate<int>(0).data() == nullptr);

  // src rows 0..3 (2 cols, stride 3); blocks: rows [0,2) -> dst row 2, row [3,4) -> dst row 0.
  const std::vector<float> src{0, 1, -1, 10, 11, -1, 20, 21, -1, 30, 31, -1};
  std::vector<float> dst(8, 9.f);
  const index_t src_off[] = {0, 3}, dst_off[] = {2, 0}, count[] = {2, 1};
  s.copy_blocks({src.data(), 4, 2, 3}, {dst.data(), 4, 2}, 2, src_off, dst_off, count);
  CHECK(dst == std::vector<float>{30, 31, 9, 9, 0, 1, 10, 11});
}
