// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
// The layer over packed expert weights (layer_options::pack_weights, moe_layer::pack_weights;
// issue 22): equal to the reference on every kernel path this CPU runs, fp32 and bf16 copies
// (odd H and F, rows per expert that are no multiple of any block, shared experts, padded
// capacity, 1-3 ranks; AVX512-BF16's pair dot products within bf16 rounding of the inputs),
// and
// the packing's life cycle: copies of the values at pack time, refreshed by pack_weights(),
// set_weights() and apply_placement(), dropped by unpack_weights().
#include <catch2/catch.hpp>
#include <cmath>
#include <limits>
#include <vector>

#include "harness.hpp"
#include <epmoe/placement/table.hpp>

using namespace epmoe;
using space::cpu_path;

namespace {

// The host space on one kernel path (the best one the CPU runs when it lacks this one).
template <cpu_path Path>
struct host_on : space::host {
  host_on() { set_cpu_path(Path); }
};

template <class Space, class Capacity = capacity::dropless, class Placement = placement::block,
          packed_precision As = packed_precision::fp32>
struct packed_policies : default_policies {
  using space = Space;
  using router = epmoe::router::topk_softmax<2>;
  using capacity = Capacity;
  using placement = Placement;
  using comm = epmoe::comm::threads;
  static constexpr layer_options options{.pack_weights = true, .pack_as = As};
};

// The weights a bf16-packed layer computes with: the experts' rounded to bf16 (the gate is
// not packed).
reference::full_weights bf16_experts(reference::full_weights w) {
  for (auto* v : {&w.w1, &w.w3, &w.w2, &w.shared_w1, &w.shared_w3, &w.shared_w2})
    for (float& x : *v) x = space::bf16_rounded(x);
  return w;
}

struct local_packed : default_policies {
  static constexpr layer_options options{.pack_weights = true};
};

template <cpu_path Path, class Capacity, packed_precision As = packed_precision::fp32>
int check_path() {
  if (!space::cpu_runs(Path)) return 0;
  using P = packed_policies<host_on<Path>, Capacity, placement::block, As>;
  const bool bf16 = As == packed_precision::bf16;
  int runs = 0;
  for (int R : {1, 2, 3})
    for (index_t T : {1, 7, 61, 300}) {
      const layer_config cfg{.hidden = 37,
                             .ffn = 45,
                             .experts = 6,
                             .top_k = 2,
                             .ranks = R,
                             .max_tokens = static_cast<int>(T),
                             .capacity_factor = 1.0,
                             .shared_experts = 2,  // the second one: a slice at j = 1
                             .shared_ffn = 33};
      const auto w = reference::full_weights::random(cfg, 17 + R);
      const auto g = test::make_tokens(std::vector<index_t>(R, T), cfg.hidden, 3 * R + T);
      const auto got = test::run_layer<P>(cfg, w, g);
      INFO(space::name_of(Path) << " R=" << R << " T=" << T << " bf16 " << bf16);
      const double err =
          test::relative_error(got.y, test::run_reference<P>(cfg, bf16 ? bf16_experts(w) : w, g));
      if (bf16 && Path == cpu_path::avx512_bf16) {
        // Dot products of bf16 pairs: the experts' inputs rounded to bf16 too, which shows.
        CHECK(err <= 1e-2);
        CHECK(err > 1e-6);
      } else {
        CHECK(err <= 1e-4);
      }
      // bf16 against the fp32 weights: within bf16's rounding (2^-9 relative per weight).
      if (bf16) CHECK(test::relative_error(got.y, test::run_reference<P>(cfg, w, g)) <= 2e-2);
      ++runs;
    }
  return runs;
}

}  // namespace

TEST_CASE("packed layer: equals the reference on every kernel path this CPU runs") {
  int runs = 0;
  runs += check_path<cpu_path::portable, capacity::dropless>();
  runs += check_path<cpu_path::avx2, capacity::dropless>();
  runs += check_path<cpu_path::avx512, capacity::dropless>();
  runs += check_path<space::cpu_path::portable, capacity::factor<true>>();
  runs += check_path<space::cpu_path::avx512, capacity::factor<true>>();
  constexpr auto bf16 = packed_precision::bf16;
  runs += check_path<cpu_path::portable, capacity::dropless, bf16>();
  runs += check_path<cpu_path::avx2, capacity::dropless, bf16>();
  runs += check_path<cpu_path::avx512, capacity::dropless, bf16>();
  runs += check_path<cpu_path::avx512_bf16, capacity::dropless, bf16>();
  runs += check_path<cpu_path::avx512_bf16, capacity::factor<true>, bf16>();
  CHECK(runs >= 3 * 12);  // portable three times at least
  INFO("best path here: " << space::name_of(space::best_cpu_path()));
  CHECK(space::cpu_runs(space::best_cpu_path()));
}

TEST_CASE("packed layer: copies of the values at pack time, refreshed by pack_weights") {
  const layer_config cfg{.hidden = 19, .ffn = 23, .experts = 4, .top_k = 2, .max_tokens = 9};
  const auto w = reference::full_weights::random(cfg, 5);
  auto mine = reference::slice(w, placement::block(cfg), 0);
  const auto x = reference::random_tokens(9, cfg.hidden, 6);
  const float nan = std::numeric_limits<float>::quiet_NaN();
  moe_layer<local_packed> layer(cfg, comm::local{}, {w.gate_view(), mine.experts()});
  CHECK(layer.weights_packed());
  const auto run = [&] {
    std::vector<float> y(x.size(), nan);
    layer.forward({x.data(), 9, cfg.hidden}, {y.data(), 9, cfg.hidden});
    return y;
  };
  const auto y0 = run();
  std::vector<float> minus(y0.size());
  for (std::size_t i = 0; i < y0.size(); ++i) minus[i] = -y0[i];
  for (float& v : mine.w2) v = -v;              // y = W2 h: negating W2 negates y
  CHECK(test::relative_error(run(), y0) == 0);  // still the packed copies of the old values
  layer.pack_weights();
  CHECK(test::relative_error(run(), minus) <= 1e-6);
  layer.unpack_weights();  // reads the weights themselves again
  CHECK_FALSE(layer.weights_packed());
  CHECK(test::relative_error(run(), minus) <= 1e-5);
  // set_weights onto other arrays repacks (packing on again first).
  layer.pack_weights();
  const auto other = reference::full_weights::random(cfg, 8);
  const auto theirs = reference::slice(other, placement::block(cfg), 0);
  layer.set_weights({other.gate_view(), theirs.experts()});
  std::vector<float> want(x.size(), nan);
  const router::topk_softmax<2> router{};
  const std::vector<index_t> tokens{9};
  reference::forward(other, router, capacity::dropless{}, {x.data(), 9, cfg.hidden}, tokens,
                     {want.data(), 9, cfg.hidden});
  CHECK(test::relative_error(run(), want) <= 1e-5);
  CHECK(layer.weights_packed());
  // bf16 copies of the same weights, chosen at run time; repacks keep bf16.
  layer.pack_weights(packed_precision::bf16);
  const auto round_theirs = bf16_experts(other);
  std::vector<float> want16(x.size(), nan);
  reference::forward(round_theirs, router, capacity::dropless{}, {x.data(), 9, cfg.hidden}, tokens,
                     {want16.data(), 9, cfg.hidden});
  const auto y16 = run();
  // (AVX512-BF16 rounds the experts' inputs to bf16 too.)
  const bool dot = space::best_cpu_path() == cpu_path::avx512_bf16;
  CHECK(test::relative_error(y16, want16) <= (dot ? 1e-2 : 1e-5));
  CHECK(test::relative_error(y16, want) > 1e-6);  // the rounding shows: bf16 did run
  auto theirs_changed = theirs;  // set_weights packs copies of these values, then reads them
  layer.set_weights({other.gate_view(), theirs_changed.experts()});
  for (float& v : theirs_changed.w2) v = -v;
  CHECK(test::relative_error(run(), y16) == 0);
}

TEST_CASE("packed layer: a live re-placement repacks the slots' new experts") {
  const layer_config cfg{.hidden = 21,
                         .ffn = 27,
                         .experts = 8,
                         .top_k = 2,
                         .ranks = 4,
                         .max_tokens = 33,
                         .capacity_factor = 1.0};
  using P = packed_policies<space::host, capacity::dropless, placement::table>;
  const auto w = reference::full_weights::random(cfg, 12);
  const auto g = test::make_tokens({33, 5, 0, 20}, cfg.hidden, 13);
  const placement::table start(cfg), next(8, 4, {1, 0, 2, 3, 5, 4, 6, 7});
  std::vector<int> packed(4, 0);  // Catch assertions stay on the test's thread
  test::run_options<P> opt{.passes = 2, .placement = start};
  opt.between = [&](moe_layer<P>& layer) {
    if (layer.passes() != 1) return;
    layer.apply_placement(next);
    packed[layer.rank()] = layer.weights_packed();
  };
  const auto got = test::run_layer<P>(cfg, w, g, opt);
  CHECK(packed == std::vector<int>(4, 1));
  const auto want = test::run_reference<P>(cfg, w, g);
  CHECK(test::relative_error(got.ys[0], want) <= 1e-4);
  CHECK(test::relative_error(got.ys[1], want) <= 1e-4);  // slots 0 <-> 1, 4 <-> 5 swapped
}
