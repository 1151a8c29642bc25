// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
#include <algorithm>
#include <catch2/catch.hpp>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <tuple>
#include <vector>

#include <epmoe/capacity/factor.hpp>
#include <epmoe/epmoe.hpp>
#include <epmoe/reference/weights.hpp>

using epmoe::index_t;
using epmoe::layer_config;
using epmoe::matrix_view;
using epmoe::stacked_view;

namespace {

template <class Capacity>
struct policies : epmoe::default_policies {
  using capacity = Capacity;
};
using dropless_policies = policies<epmoe::capacity::dropless>;

layer_config good_cfg() {
  layer_config c;
  c.hidden = 8;
  c.ffn = 12;
  c.experts = 4;
  c.top_k = 2;  // = default_policies' router top_k
  c.ranks = 1;
  c.max_tokens = 16;
  c.capacity_factor = 1.0;
  return c;
}

// Weights of good_cfg() for rank 0 of 1; every case starts from these and breaks one thing.
struct setup {
  layer_config cfg = good_cfg();
  epmoe::reference::full_weights full = epmoe::reference::full_weights::random(good_cfg(), 5);
  epmoe::reference::rank_weights mine =
      epmoe::reference::slice(full, epmoe::placement::block(good_cfg()), 0);

  template <class P>
  typename epmoe::moe_layer<P>::weights weights() const {
    return {full.gate_view(), mine.experts()};
  }
};

// Builds moe_layer<P> and returns the field of the config_error it threw.
template <class P>
std::string construction_error(const layer_config& cfg,
                               const typename epmoe::moe_layer<P>::weights& w) {
  try {
    epmoe::moe_layer<P> layer(cfg, epmoe::comm::local{}, w);
  } catch (const epmoe::config_error& e) {
    return e.field();
  }
  return "<constructed without error>";
}

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

using all_capacities =
    std::tuple<policies<epmoe::capacity::dropless>, policies<epmoe::capacity::factor<>>,
               policies<epmoe::capacity::padded_factor>>;

TEMPLATE_LIST_TEST_CASE("layer errors: the unbroken setup constructs and runs", "[layer][error]",
                        all_capacities) {
  const setup s;
  epmoe::moe_layer<TestType> layer(s.cfg, epmoe::comm::local{}, s.weights<TestType>());
  const auto x = epmoe::reference::random_tokens(5, s.cfg.hidden, 1);
  std::vector<float> y(5 * 8, std::numeric_limits<float>::quiet_NaN());
  layer.forward({x.data(), 5, 8}, {y.data(), 5, 8});
  for (float v : y) CHECK(std::isfinite(v));
}

TEMPLATE_LIST_TEST_CASE("layer errors: top_k > experts is rejected", "[layer][error]",
                        all_capacities) {
  const setup s;
  layer_config c = s.cfg;
  c.experts = 1;  // top_k 2 = the router's, but only one expert
  CHECK(construction_error<TestType>(c, s.weights<TestType>()) == "top_k");
}

TEMPLATE_LIST_TEST_CASE("layer errors: top_k < 1 is rejected", "[layer][error]", all_capacities) {
  const setup s;
  layer_config c = s.cfg;
  c.top_k = 0;
  CHECK(construction_error<TestType>(c, s.weights<TestType>()) == "top_k");
}

TEMPLATE_LIST_TEST_CASE("layer errors: experts = 0 is rejected", "[layer][error]", all_capacities) {
  const setup s;
  layer_config c = s.cfg;
  c.experts = 0;
  CHECK(construction_error<TestType>(c, s.weights<TestType>()) == "experts");
}

TEMPLATE_LIST_TEST_CASE("layer errors: hidden = 0 is rejected", "[layer][error]", all_capacities) {
  const setup s;
  layer_config c = s.cfg;
  c.hidden = 0;
  CHECK(construction_error<TestType>(c, s.weights<TestType>()) == "hidden");
}

TEMPLATE_LIST_TEST_CASE("layer errors: ffn = 0 is rejected", "[layer][error]", all_capacities) {
  const setup s;
  layer_config c = s.cfg;
  c.ffn = 0;
  CHECK(construction_error<TestType>(c, s.weights<TestType>()) == "ffn");
}

TEMPLATE_LIST_TEST_CASE("layer errors: experts not divisible by ranks is rejected",
                        "[layer][error]", all_capacities) {
  const setup s;
  layer_config c = s.cfg;
  c.ranks = 3;
  CHECK(construction_error<TestType>(c, s.weights<TestType>()) == "experts");
}

TEMPLATE_LIST_TEST_CASE("layer errors: capacity_factor <= 0 is rejected", "[layer][error]",
                        all_capacities) {
  const setup s;
  layer_config c = s.cfg;
  c.capacity_factor = GENERATE(0.0, -1.0);
  CHECK(construction_error<TestType>(c, s.weights<TestType>()) == "capacity_factor");
}

TEMPLATE_LIST_TEST_CASE("layer errors: config top_k != the router's top_k is rejected",
                        "[layer][error]", all_capacities) {
  const setup s;
  layer_config c = s.cfg;
  c.top_k = GENERATE(1, 3);  // valid on its own (<= 4 experts), but the router picks 2
  try {
    epmoe::moe_layer<TestType> layer(c, epmoe::comm::local{}, s.weights<TestType>());
    FAIL("a layer with config top_k " << c.top_k << " and a top-2 router was built");
  } catch (const epmoe::config_error& e) {
    CHECK(e.field() == "top_k");
    CHECK(e.value() == std::to_string(c.top_k));
    CHECK_THAT(e.rule(), Catch::Matchers::Contains("router"));
  }
}

TEMPLATE_LIST_TEST_CASE("layer errors: config ranks != the communicator's size is rejected",
                        "[layer][error]", all_capacities) {
  const setup s;
  layer_config c = s.cfg;
  c.ranks = 2;  // 4 experts / 2 ranks is valid, but comm::local is one rank
  try {
    epmoe::moe_layer<TestType> layer(c, epmoe::comm::local{}, s.weights<TestType>());
    FAIL("a 2-rank config was accepted with comm::local");
  } catch (const epmoe::config_error& e) {
    CHECK(e.field() == "ranks");
    CHECK(e.value() == "2");
  }
}

TEMPLATE_LIST_TEST_CASE("layer errors: a gate of the wrong shape is rejected", "[layer][error]",
                        all_capacities) {
  const setup s;
  auto w = s.weights<TestType>();
  const index_t E = s.cfg.experts, H = s.cfg.hidden;
  SECTION("too few experts") { w.gate = matrix_view<const float>(s.full.gate.data(), E - 1, H); }
  SECTION("too narrow") { w.gate = matrix_view<const float>(s.full.gate.data(), E, H - 1); }
  SECTION("transposed") { w.gate = matrix_view<const float>(s.full.gate.data(), H, E); }
  SECTION("null") { w.gate = matrix_view<const float>(nullptr, E, H); }
  CHECK(construction_error<TestType>(s.cfg, w) == "weights.gate");
}

TEMPLATE_LIST_TEST_CASE("layer errors: an expert w1 of the wrong shape is rejected",
                        "[layer][error]", all_capacities) {
  const setup s;
  auto w = s.weights<TestType>();
  const index_t L = 4, F = s.cfg.ffn, H = s.cfg.hidden;
  SECTION("transposed") { w.experts.w1 = stacked_view<const float>(s.mine.w1.data(), L, H, F); }
  SECTION("too few experts") {
    w.experts.w1 = stacked_view<const float>(s.mine.w1.data(), L - 1, F, H);
  }
  CHECK(construction_error<TestType>(s.cfg, w) == "weights.experts.w1");
}

TEMPLATE_LIST_TEST_CASE("layer errors: an expert w3 of the wrong shape is rejected",
                        "[layer][error]", all_capacities) {
  const setup s;
  auto w = s.weights<TestType>();
  const index_t L = 4, F = s.cfg.ffn, H = s.cfg.hidden;
  SECTION("transposed") { w.experts.w3 = stacked_view<const float>(s.mine.w3.data(), L, H, F); }
  SECTION("ffn too small") {
    w.experts.w3 = stacked_view<const float>(s.mine.w3.data(), L, F - 1, H);
  }
  CHECK(construction_error<TestType>(s.cfg, w) == "weights.experts.w3");
}

TEMPLATE_LIST_TEST_CASE("layer errors: an expert w2 of the wrong shape is rejected",
                        "[layer][error]", all_capacities) {
  const setup s;
  auto w = s.weights<TestType>();
  const index_t L = 4, F = s.cfg.ffn, H = s.cfg.hidden;
  SECTION("transposed") { w.experts.w2 = stacked_view<const float>(s.mine.w2.data(), L, F, H); }
  SECTION("too many experts") {
    w.experts.w2 = stacked_view<const float>(s.mine.w2.data(), L + 1, H, F);
  }
  CHECK(construction_error<TestType>(s.cfg, w) == "weights.experts.w2");
}

TEMPLATE_LIST_TEST_CASE("layer errors: forward with more than max_tokens rows is rejected",
                        "[layer][error]", all_capacities) {
  const setup s;
  epmoe::moe_layer<TestType> layer(s.cfg, epmoe::comm::local{}, s.weights<TestType>());
  const index_t T = s.cfg.max_tokens + 1, H = s.cfg.hidden;
  const auto x = epmoe::reference::random_tokens(T, H, 2);
  std::vector<float> y(static_cast<std::size_t>(T * H), std::numeric_limits<float>::quiet_NaN());
  try {
    layer.forward({x.data(), T, H}, {y.data(), T, H});
    FAIL("forward accepted " << T << " tokens with max_tokens " << s.cfg.max_tokens);
  } catch (const epmoe::config_error& e) {
    CHECK(e.field() == "x.rows");
    CHECK(e.value() == std::to_string(T));
  }
  // At the limit it runs, and writes every row (y starts as NaN).
  CHECK_NOTHROW(layer.forward({x.data(), T - 1, H}, {y.data(), T - 1, H}));
  CHECK(std::all_of(y.begin(), y.begin() + (T - 1) * H, [](float v) { return std::isfinite(v); }));
}

TEMPLATE_LIST_TEST_CASE("layer errors: forward with x of the wrong width is rejected",
                        "[layer][error]", all_capacities) {
  const setup s;
  epmoe::moe_layer<TestType> layer(s.cfg, epmoe::comm::local{}, s.weights<TestType>());
  const index_t H = s.cfg.hidden;
  const auto x = epmoe::reference::random_tokens(4, H + 1, 3);
  std::vector<float> y(static_cast<std::size_t>(4 * H));
  CHECK(field_of([&] { layer.forward({x.data(), 4, H + 1}, {y.data(), 4, H}); }) == "x");
  CHECK(field_of([&] { layer.forward({x.data(), 4, H, H - 1}, {y.data(), 4, H}); }) == "x");
}

TEMPLATE_LIST_TEST_CASE("layer errors: forward with y of the wrong shape is rejected",
                        "[layer][error]", all_capacities) {
  const setup s;
  epmoe::moe_layer<TestType> layer(s.cfg, epmoe::comm::local{}, s.weights<TestType>());
  const index_t H = s.cfg.hidden;
  const auto x = epmoe::reference::random_tokens(4, H, 4);
  std::vector<float> y(static_cast<std::size_t>(5 * (H + 1)));
  CHECK(field_of([&] { layer.forward({x.data(), 4, H}, {y.data(), 3, H}); }) == "y");
  CHECK(field_of([&] { layer.forward({x.data(), 4, H}, {y.data(), 5, H}); }) == "y");
  CHECK(field_of([&] { layer.forward({x.data(), 4, H}, {y.data(), 4, H + 1}); }) == "y");
  CHECK(field_of([&] { layer.forward({x.data(), 4, H}, {nullptr, 4, H}); }) == "y");
}

TEST_CASE("layer errors: NaN inputs do not crash and do not leak into other tokens",
          "[layer][error][nan]") {
  const setup s;
  const index_t T = 8, H = s.cfg.hidden, E = s.cfg.experts, K = s.cfg.top_k;
  epmoe::moe_layer<dropless_policies> layer(s.cfg, epmoe::comm::local{},
                                            s.weights<dropless_policies>());
  constexpr float nan_f = std::numeric_limits<float>::quiet_NaN();
  const std::vector<index_t> nan_rows{2, 5};

  auto x = epmoe::reference::random_tokens(T, H, 9);
  std::vector<float> clean;  // the same tokens without the NaN rows
  for (index_t t = 0; t < T; ++t)
    if (t != 2 && t != 5) clean.insert(clean.end(), x.begin() + t * H, x.begin() + (t + 1) * H);
  for (index_t h = 0; h < H; ++h) x[2 * H + h] = nan_f;  // all NaN
  x[5 * H + 3] = nan_f;                                  // one NaN

  // Outputs start as NaN: a row the layer leaves unwritten fails the comparisons below.
  const index_t Tc = T - 2;
  std::vector<float> y_clean(static_cast<std::size_t>(Tc * H), nan_f);
  layer.forward({clean.data(), Tc, H}, {y_clean.data(), Tc, H});

  std::vector<float> y(static_cast<std::size_t>(T * H), nan_f);
  REQUIRE_NOTHROW(layer.forward({x.data(), T, H}, {y.data(), T, H}));

  const epmoe::routing_view routing = layer.last_routing();
  REQUIRE(routing.tokens() == T);
  for (index_t t = 0; t < T; ++t) {
    CAPTURE(t);
    for (index_t k = 0; k < K; ++k) CHECK((routing.ids(t, k) >= 0 && routing.ids(t, k) < E));
    CHECK(routing.ids(t, 0) != routing.ids(t, 1));
  }
  CHECK(layer.stats().dropped == 0);

  index_t c = 0;
  for (index_t t = 0; t < T; ++t) {
    if (t == 2 || t == 5) continue;
    for (index_t h = 0; h < H; ++h) {
      CAPTURE(t, h);
      const float v = y[t * H + h];
      CHECK(std::isfinite(v));
      CHECK(v == Approx(y_clean[c * H + h]).margin(1e-6));
    }
    ++c;
  }
  CHECK(c == Tc);  // every clean token was compared

  // A NaN pass leaves nothing behind: the clean tokens give the same outputs again.
  std::vector<float> y_again(static_cast<std::size_t>(Tc * H), nan_f);
  layer.forward({clean.data(), Tc, H}, {y_again.data(), Tc, H});
  for (std::size_t i = 0; i < y_again.size(); ++i)
    CHECK(y_again[i] == Approx(y_clean[i]).margin(1e-6));
}

namespace {
struct dedup_policies : epmoe::default_policies {
  static constexpr epmoe::layer_options options{.dedup = true};
};
}  // namespace

TEST_CASE("layer errors: a receive bound that would make more blocks than an int holds is named",
          "[layer][error]") {
  // Windows of one token each: blocks = windows x ranks x local experts. 2^22 tokens of 1024
  // experts on one rank would make 2^32 blocks (and their arrays: tens of GB).
  layer_config c = good_cfg();
  c.experts = 1024;
  c.max_tokens = index_t{1} << 22;
  c.max_recv_rows = 1;
  const auto L = c.experts;
  // The layout says so before anything is sized ...
  try {
    (void)epmoe::workspace_layout::of(
        c, 2, static_cast<int>(L), 1, 1, false, [](index_t T) { return T; }, 0, 4, 0, false, true);
    FAIL("a layout of 2^32 blocks was accepted");
  } catch (const epmoe::config_error& e) {
    CHECK(e.field() == "max_recv_rows");
    CHECK(std::string(e.what()).find("blocks") != std::string::npos);
  }
  // ... and so does the layer, before it allocates anything.
  std::vector<float> gate(static_cast<std::size_t>(L * c.hidden)),
      w1(static_cast<std::size_t>(L * c.ffn * c.hidden));
  const stacked_view<const float> e1(w1.data(), L, c.ffn, c.hidden);
  const stacked_view<const float> e2(w1.data(), L, c.hidden, c.ffn);
  using layer_t = epmoe::moe_layer<dedup_policies>;
  const layer_t::weights w{{gate.data(), L, c.hidden}, {e1, e1, e2}};
  int named = 0;
  try {
    layer_t layer(c, epmoe::comm::local{}, w);
  } catch (const epmoe::config_error& e) {
    named = e.field() == "max_recv_rows";
  }
  CHECK(named == 1);
}
