// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
#include <algorithm>
#include <catch2/catch.hpp>
#include <cmath>
#include <limits>
#include <span>
#include <stdexcept>
#include <vector>

#include "harness.hpp"
#include <epmoe/split_layer.hpp>

// The decode paths (issue 38, docs/decode.md) on every space: the low-latency exchange against
// the default one and the reference, and split passes (two in flight) against plain passes.
// Written once over test::spaces; tests/cuda/test_decode.cu runs it on the GPU, where the
// exchange's rounds are posted by the counts step deferred to the stream (static shapes).
// Rank threads write no Catch assertions (Catch2 v2 is not thread-safe): they record, the test
// checks after the run.
namespace decode_spaces_tests {
using namespace epmoe;

namespace {

template <class Space, bool LowLatency>
struct policies : test::threads_policies<2, capacity::dropless, Space> {
  static constexpr layer_options options{.deterministic = true, .low_latency = LowLatency};
};

layer_config config(int ranks) {
  return {.hidden = 12,
          .ffn = 10,
          .experts = 8,
          .top_k = 2,
          .ranks = ranks,
          .max_tokens = 16,
          .shared_experts = 1};
}

// Micro-batch m's tokens on rank r (some ranks have none in some batches).
index_t tokens_of(int m, int r) { return (m * 7 + r * 5) % 17 == 3 ? 0 : (m * 7 + r * 5) % 17; }

// The same rows through the same experts: bit for bit on the host (options.deterministic); a
// device's GEMM library may pick another kernel for another row count, so within rounding.
template <class Space>
void check_same(const std::vector<float>& got, const std::vector<float>& want) {
  for (float v : want) REQUIRE(std::isfinite(v));
  if constexpr (device_space<Space>)
    CHECK(test::relative_error(got, want) <= test::tolerance<Space>(1e-6));
  else
    CHECK(got == want);
}

constexpr int batches = 5;

// Micro-batch m's tokens on every rank (some ranks have none in some batches).
std::vector<test::global_tokens> batch_tokens(const layer_config& cfg) {
  std::vector<test::global_tokens> gs;
  for (int m = 0; m < batches; ++m) {
    std::vector<index_t> per_rank;
    for (int r = 0; r < cfg.ranks; ++r) per_rank.push_back(tokens_of(m, r));
    gs.push_back(test::make_tokens(per_rank, cfg.hidden, 100 + m));
  }
  return gs;
}

// Every batch's y, global order: plain passes of a moe_layer, or split passes started two
// ahead (start 0, start 1, experts 1, finish 0, start 2, finish 1, ...).
template <class P>
std::vector<std::vector<float>> run(const layer_config& cfg, const reference::full_weights& w,
                                    const std::vector<test::global_tokens>& gs, bool split) {
  using io = test::space_io<typename P::space>;
  const index_t H = cfg.hidden;
  std::vector<std::vector<float>> out;
  for (const auto& g : gs) out.emplace_back(g.x.size(), std::numeric_limits<float>::quiet_NaN());
  comm::threads_world world(cfg.ranks);
  world.run([&](comm::threads c) {
    const int r = c.rank();
    const typename P::placement where(cfg);
    test::rank_arrays<P> arrays(w, reference::slice(w, where, r));
    const auto views = arrays.views(cfg, where.slots_per_rank());
    const typename P::space space{};
    std::vector<typename io::array> x, y;
    for (const auto& g : gs) {
      const index_t T = g.per_rank[r];
      x.push_back(io::upload(std::span(g.x).subspan(g.offset(r) * H, T * H)));
      y.push_back(io::upload(std::vector<float>(static_cast<std::size_t>(T * H))));
      io::poison(y.back(), space);
    }
    const auto xv = [&](int m) {
      return matrix_view<const float>{io::data(x[m]), gs[m].per_rank[r], H};
    };
    const auto yv = [&](int m) { return matrix_view<float>{io::data(y[m]), gs[m].per_rank[r], H}; };
    if (!split) {
      moe_layer<P> layer(cfg, c, views);
      for (int m = 0; m < batches; ++m) layer.forward(xv(m), yv(m));
    } else {
      split_layer<P> layer(cfg, {c, c}, views);
      std::vector<split_handle> h(batches);
      h[0] = layer.start(xv(0), yv(0));
      for (int m = 1; m < batches; ++m) {
        h[m] = layer.start(xv(m), yv(m));
        if (layer.in_flight() != 2) throw std::logic_error("two passes should be in flight");
        if (m % 2) layer.experts(h[m]);  // the newer's experts before the older's finish
        layer.finish(h[m - 1]);
      }
      layer.finish(h[batches - 1]);
      if (layer.in_flight() != 0) throw std::logic_error("no pass should be in flight");
    }
    for (int m = 0; m < batches; ++m) {
      const auto yh = io::download(y[m], space);
      std::copy(yh.begin(), yh.end(), out[m].begin() + gs[m].offset(r) * H);
    }
  });
  return out;
}

// Split passes against plain passes and both against the reference, every batch.
template <class Space, bool LowLatency>
void split_equals_plain() {
  using P = policies<Space, LowLatency>;
  int compared = 0;
  for (int R : {1, 2, 4}) {
    CAPTURE(R);
    const layer_config cfg = config(R);
    const auto w = reference::full_weights::random(cfg, 7);
    const auto gs = batch_tokens(cfg);
    const auto plain = run<P>(cfg, w, gs, false);
    const auto split = run<P>(cfg, w, gs, true);
    for (int m = 0; m < batches; ++m) {
      CAPTURE(m);
      const auto ref = test::run_reference<P>(cfg, w, gs[m]);
      CHECK(test::relative_error(plain[m], ref) <= test::tolerance<Space>(1e-5));
      CHECK(test::relative_error(split[m], ref) <= test::tolerance<Space>(1e-5));
      check_same<Space>(split[m], plain[m]);
      compared += static_cast<int>(plain[m].size());
    }
  }
  CHECK(compared > 0);
}

}  // namespace

TEMPLATE_LIST_TEST_CASE("decode spaces: low latency equals the default exchange and the reference",
                        "[layer][low_latency][decode]", test::spaces) {
  using Space = TestType;
  int checked = 0;
  for (int R : {1, 2, 4}) {
    CAPTURE(R);
    const layer_config cfg = config(R);
    const auto w = reference::full_weights::random(cfg, 31 + R);
    std::vector<index_t> per_rank;
    for (int r = 0; r < R; ++r) per_rank.push_back(r == 1 ? 0 : 16 - 3 * r);  // rank 1: T = 0
    const auto g = test::make_tokens(per_rank, cfg.hidden, 7 + R);
    const auto ll = test::run_layer<policies<Space, true>>(cfg, w, g, {.passes = 2});
    const auto flat = test::run_layer<policies<Space, false>>(cfg, w, g, {.passes = 2});
    const auto ref = test::run_reference<policies<Space, true>>(cfg, w, g);
    for (int p = 0; p < 2; ++p, ++checked) {
      CAPTURE(p);
      CHECK(test::relative_error(ll.ys[p], ref) <= test::tolerance<Space>(1e-5));
      check_same<Space>(ll.ys[p], flat.ys[p]);
    }
    for (int r = 0; r < R; ++r, ++checked) {
      CHECK(ll.stats[r].back().alltoalls == 2);  // no counts round
      CHECK(flat.stats[r].back().alltoalls == 3);
    }
  }
  CHECK(checked == 3 * 2 + 1 + 2 + 4);
}

TEMPLATE_LIST_TEST_CASE("decode spaces: two split passes in flight equal plain passes",
                        "[split][decode]", test::spaces) {
  split_equals_plain<TestType, false>();
}

TEMPLATE_LIST_TEST_CASE("decode spaces: split low-latency passes in flight equal plain passes",
                        "[split][low_latency][decode]", test::spaces) {
  split_equals_plain<TestType, true>();
}

}  // namespace decode_spaces_tests
