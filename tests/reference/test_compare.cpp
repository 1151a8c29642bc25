// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
#include <catch2/catch.hpp>
#include <cmath>
#include <limits>
#include <vector>

#include "../layer/harness.hpp"
#include <epmoe/reference/compare.hpp>

// The acceptance tests' error measure must be able to fail: NaN, Inf and a size mismatch
// are an infinite error, so a layer that writes a NaN, or leaves a NaN-filled row unwritten,
// fails every comparison against the reference.
using namespace epmoe;
using reference::max_relative_error;

namespace {

constexpr float nan_f = std::numeric_limits<float>::quiet_NaN();
constexpr float inf_f = std::numeric_limits<float>::infinity();
constexpr double inf = std::numeric_limits<double>::infinity();

const std::vector<float> want{0.5f, -2.f, 4.f, 1.f, -0.25f};

}  // namespace

TEST_CASE("compare: equal vectors measure 0, a difference measures diff / max |want|",
          "[reference][compare]") {
  CHECK(max_relative_error(want, want) == 0.0);
  CHECK(test::relative_error(want, want) == 0.0);
  auto got = want;
  got[1] = -1.f;  // |diff| 1, max |want| 4
  CHECK(max_relative_error(got, want) == 0.25);
  CHECK(test::relative_error(got, want) == 0.25);
  // float against double (the reference's own precision) measures the same.
  const std::vector<double> want_d(want.begin(), want.end());
  CHECK(max_relative_error(got, want_d) == 0.25);
  // Two empty ranges agree; an all-zero reference is scaled by a tiny, not divided by 0.
  CHECK(max_relative_error(std::vector<float>{}, std::vector<float>{}) == 0.0);
  CHECK(max_relative_error(std::vector<float>{0.f, 0.f}, std::vector<float>{0.f, 0.f}) == 0.0);
  CHECK(max_relative_error(std::vector<float>{1e-20f}, std::vector<float>{0.f}) > 1e9);
}

TEST_CASE("compare: a NaN anywhere on either side is an infinite error", "[reference][compare]") {
  int checked = 0;
  for (std::size_t i = 0; i < want.size(); ++i) {
    CAPTURE(i);
    auto got = want;
    got[i] = nan_f;  // std::max(diff, |NaN|) keeps diff: the old measure scored this 0
    CHECK(max_relative_error(got, want) == inf);
    CHECK(test::relative_error(got, want) == inf);
    CHECK_FALSE(test::relative_error(got, want) <= 1e-4);
    auto bad_want = want;
    bad_want[i] = nan_f;
    CHECK(max_relative_error(want, bad_want) == inf);
    ++checked;
  }
  CHECK(checked == static_cast<int>(want.size()));
}

TEST_CASE("compare: an all-NaN output is an infinite error, not 0", "[reference][compare]") {
  const std::vector<float> got(want.size(), nan_f);
  CHECK(max_relative_error(got, want) == inf);
  CHECK(test::relative_error(got, want) == inf);
  // Both sides NaN: still a failure, not "equal".
  CHECK(max_relative_error(got, got) == inf);
}

TEST_CASE("compare: +Inf and -Inf are an infinite error", "[reference][compare]") {
  for (float bad : {inf_f, -inf_f}) {
    CAPTURE(bad);
    auto got = want;
    got[2] = bad;
    CHECK(max_relative_error(got, want) == inf);
    CHECK(test::relative_error(got, want) == inf);
    CHECK(max_relative_error(want, got) == inf);  // an Inf in the reference too
    CHECK(max_relative_error(got, got) == inf);   // Inf - Inf is NaN; never "equal"
  }
}

TEST_CASE("compare: a size mismatch is an infinite error", "[reference][compare]") {
  const std::vector<float> shorter(want.begin(), want.end() - 1);
  auto longer = want;
  longer.push_back(0.f);
  CHECK(max_relative_error(shorter, want) == inf);  // a prefix that matches still fails
  CHECK(max_relative_error(longer, want) == inf);
  CHECK(max_relative_error(std::vector<float>{}, want) == inf);
  CHECK(max_relative_error(want, std::vector<float>{}) == inf);
  CHECK(test::relative_error(shorter, want) == inf);
}

TEST_CASE("compare: one NaN in a real layer's output fails the check against the reference",
          "[reference][compare][layer]") {
  using P = test::threads_policies<2>;
  const layer_config cfg{
      .hidden = 12, .ffn = 10, .experts = 8, .top_k = 2, .ranks = 2, .max_tokens = 20};
  const auto w = reference::full_weights::random(cfg, 31);
  const auto g = test::make_tokens({20, 13}, cfg.hidden, 32);
  auto got = test::run_layer<P>(cfg, w, g).y;
  const auto want = test::run_reference<P>(cfg, w, g);
  REQUIRE(got.size() == want.size());
  // run_layer fills y with NaN first: the layer wrote every element of both ranks' rows.
  for (float v : got) REQUIRE(std::isfinite(v));
  CHECK(test::relative_error(got, want) <= 1e-4);
  // One element of one row on the second rank.
  got[(g.offset(1) + 5) * cfg.hidden + 3] = nan_f;
  CHECK(test::relative_error(got, want) == inf);
  CHECK_FALSE(test::relative_error(got, want) <= 1e-4);
}
