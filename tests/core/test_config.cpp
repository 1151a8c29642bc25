// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
#include <catch2/catch.hpp>
#include <cmath>
#include <limits>
#include <string>

#include <epmoe/core/config.hpp>
#include <epmoe/core/error.hpp>
#include <epmoe/placement/block.hpp>

namespace {

using epmoe::layer_config;

layer_config good() {
  layer_config c;
  c.hidden = 16;
  c.ffn = 32;
  c.experts = 8;
  c.top_k = 2;
  c.ranks = 2;
  c.max_tokens = 64;
  c.capacity_factor = 1.25;
  return c;
}

// validate() must throw config_error naming `field`, carrying `value`, and saying both in
// what().
void require_rejected(const layer_config& c, const std::string& field, const std::string& value) {
  try {
    c.validate();
    FAIL("validate() accepted a config whose " << field << " is " << value);
  } catch (const epmoe::config_error& e) {
    CHECK(e.field() == field);
    CHECK(e.value() == value);
    CHECK_FALSE(e.rule().empty());
    CHECK_THAT(e.what(), Catch::Matchers::Contains(field));
    CHECK_THAT(e.what(), Catch::Matchers::Contains(value));
  }
}

}  // namespace

TEST_CASE("config: a valid config passes validate", "[config]") {
  CHECK_NOTHROW(good().validate());

  layer_config k_equals_e = good();
  k_equals_e.top_k = k_equals_e.experts;
  CHECK_NOTHROW(k_equals_e.validate());

  layer_config one_expert_per_rank = good();
  one_expert_per_rank.ranks = one_expert_per_rank.experts;
  CHECK_NOTHROW(one_expert_per_rank.validate());
  CHECK(one_expert_per_rank.experts_per_rank() == 1);

  layer_config small_factor = good();
  small_factor.capacity_factor = 1e-3;
  CHECK_NOTHROW(small_factor.validate());

  CHECK(good().experts_per_rank() == 4);
}

TEST_CASE("config: top_k > experts is rejected", "[config]") {
  layer_config c = good();
  c.top_k = c.experts + 1;
  require_rejected(c, "top_k", "9");
}

TEST_CASE("config: top_k < 1 is rejected", "[config]") {
  layer_config c = good();
  c.top_k = GENERATE(0, -1);
  require_rejected(c, "top_k", std::to_string(c.top_k));
}

TEST_CASE("config: experts = 0 is rejected", "[config]") {
  layer_config c = good();
  c.experts = 0;
  c.top_k = 1;
  require_rejected(c, "experts", "0");
}

TEST_CASE("config: hidden = 0 is rejected", "[config]") {
  layer_config c = good();
  c.hidden = 0;
  require_rejected(c, "hidden", "0");
}

TEST_CASE("config: ffn = 0 is rejected", "[config]") {
  layer_config c = good();
  c.ffn = 0;
  require_rejected(c, "ffn", "0");
}

TEST_CASE("config: experts not divisible by ranks is the placement's to reject", "[config]") {
  // A replicated table may spread 6 experts over 8 slots on 4 ranks; block placement cannot.
  layer_config c = good();
  c.experts = 6;
  c.ranks = 4;
  CHECK_NOTHROW(c.validate());
  try {
    epmoe::placement::block(c).validate(c);
    FAIL("placement::block accepted 6 experts on 4 ranks");
  } catch (const epmoe::config_error& e) {
    CHECK(e.field() == "experts");
    CHECK(e.value() == "6");
  }
}

TEST_CASE("config: ranks = 0 is rejected", "[config]") {
  layer_config c = good();
  c.ranks = 0;
  require_rejected(c, "ranks", "0");
}

TEST_CASE("config: capacity_factor <= 0 is rejected", "[config]") {
  layer_config c = good();
  c.capacity_factor = GENERATE(0.0, -0.5);
  require_rejected(c, "capacity_factor", c.capacity_factor == 0.0 ? "0" : "-0.5");
}

TEST_CASE("config: capacity_factor NaN is rejected", "[config]") {
  layer_config c = good();
  c.capacity_factor = std::numeric_limits<double>::quiet_NaN();
  require_rejected(c, "capacity_factor", "nan");
}

TEST_CASE("config: capacity_factor infinite is rejected", "[config]") {
  layer_config c = good();
  c.capacity_factor = std::numeric_limits<double>::infinity();
  require_rejected(c, "capacity_factor", "inf");
}

TEST_CASE("config: max_tokens = 0 is rejected", "[config]") {
  layer_config c = good();
  c.max_tokens = 0;
  require_rejected(c, "max_tokens", "0");
}

TEST_CASE("config: max_tokens * top_k * ranks >= 2^31 is rejected", "[config]") {
  layer_config c = good();
  c.max_tokens = 1 << 28;  // * top_k 2 * ranks 2 = 2^30: fine
  CHECK_NOTHROW(c.validate());
  c.ranks = 4;  // 2^31: out of 32-bit row range
  require_rejected(c, "max_tokens", std::to_string(1 << 28));
}

TEST_CASE("config: the message names the field, the value and the rule", "[config]") {
  layer_config c = good();
  c.top_k = 11;
  try {
    c.validate();
    FAIL("validate() accepted top_k = 11 with 8 experts");
  } catch (const epmoe::config_error& e) {
    const std::string what = e.what();
    CHECK(what == "epmoe: top_k = 11: " + e.rule());
    CHECK_THAT(e.rule(), Catch::Matchers::Contains("experts"));
  }
  // A config_error is an invalid_argument: callers that catch the standard type see it.
  CHECK_THROWS_AS(c.validate(), std::invalid_argument);
}
