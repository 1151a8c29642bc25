// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
// No hang, ever (issue 23), on comm::threads: a rank that throws inside the experts of a pass
// makes every rank throw comm_aborted naming it, at once; a rank that stalls past
// exchange_timeout makes the others throw comm_timeout naming it and the stage; y of a failed
// pass is untouched; the layer is unusable afterwards and says so. (tests/mpi/faults.sh: the
// same on MPI processes, and a crashed process.)
#include <algorithm>
#include <catch2/catch.hpp>
#include <chrono>
#include <cmath>
#include <limits>
#include <mutex>
#include <string>
#include <vector>

#include "faults.hpp"
#include "harness.hpp"
#include <epmoe/schedule/pipelined.hpp>

using namespace epmoe;
using test::faulty_host;

namespace {

template <class Schedule = schedule::sequential>
struct fault_policies : default_policies {
  using space = faulty_host;
  using comm = epmoe::comm::threads;
  using schedule = Schedule;
};

struct outcome {
  std::string kind;  // "comm_aborted", "comm_timeout", "runtime_error", "none"
  std::string what;
  int origin = -1;
  double seconds = 0;
  bool y_untouched = false;
  std::string next;  // what a second forward threw
};

// One pass on R thread ranks, rank `culprit` failing with `f`; every rank's outcome.
template <class P>
std::vector<outcome> failing_pass(int R, int culprit, faulty_host::fault f, double timeout,
                                  double stall = 0) {
  layer_config cfg{
      .hidden = 16, .ffn = 24, .experts = 2 * R, .top_k = 2, .ranks = R, .max_tokens = 24};
  cfg.exchange_timeout = timeout;
  const auto w = reference::full_weights::random(cfg, 3);
  const auto g = test::make_tokens(std::vector<index_t>(R, 24), cfg.hidden, 4);
  std::vector<outcome> out(static_cast<std::size_t>(R));
  comm::threads_world world(R);
  try {
    world.run([&](comm::threads c) {
      const int r = c.rank();
      const placement::block where(cfg);
      test::rank_arrays<P> arrays(w, reference::slice(w, where, r));
      const faulty_host space = r == culprit ? faulty_host(f, stall) : faulty_host();
      moe_layer<P> layer(cfg, c, arrays.views(cfg, where.slots_per_rank()), {}, {}, where, space);
      const index_t T = 24, H = cfg.hidden;
      const std::vector<float> x(g.x.begin() + g.offset(r) * H,
                                 g.x.begin() + (g.offset(r) + T) * H);
      std::vector<float> y(static_cast<std::size_t>(T * H),
                           std::numeric_limits<float>::quiet_NaN());
      outcome& o = out[static_cast<std::size_t>(r)];
      o.kind = "none";
      const auto start = std::chrono::steady_clock::now();
      try {
        layer.forward({x.data(), T, H}, {y.data(), T, H});
      } catch (const comm_timeout& e) {
        o.kind = "comm_timeout", o.what = e.what();
      } catch (const comm_aborted& e) {
        o.kind = "comm_aborted", o.what = e.what(), o.origin = e.origin();
      } catch (const std::runtime_error& e) {
        o.kind = "runtime_error", o.what = e.what();
      }
      o.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      o.y_untouched = true;
      for (float v : y) o.y_untouched = o.y_untouched && std::isnan(v);
      try {  // the layer after a failed pass
        layer.forward({x.data(), T, H}, {y.data(), T, H});
        o.next = "none";
      } catch (const std::exception& e) {
        o.next = e.what();
      }
    });
  } catch (const std::exception&) {
    // run() rethrows the culprit's error: the outcomes say more.
  }
  return out;
}

}  // namespace

TEMPLATE_TEST_CASE("faults: a rank that throws inside its experts aborts every rank at once",
                   "[faults]", schedule::sequential, schedule::pipelined<2>) {
  using P = fault_policies<TestType>;
  int checked = 0;
  for (int R : {2, 3, 4}) {
    const int culprit = R - 1;
    // A deadline far away: the abort, not the deadline, must release the others.
    const auto out = failing_pass<P>(R, culprit, faulty_host::fault::throws, 30.0);
    for (int r = 0; r < R; ++r, ++checked) {
      const outcome& o = out[static_cast<std::size_t>(r)];
      INFO("R=" << R << " rank " << r << ": " << o.kind << " after " << o.seconds
                << " s: " << o.what);
      CHECK(o.y_untouched);
      CHECK(o.seconds < 5.0);
      if (r == culprit) {
        CHECK(o.kind == "runtime_error");
        CHECK(o.what == "injected: an expert GEMM failed");
      } else {
        CHECK(o.kind == "comm_aborted");
        CHECK(o.origin == culprit);
        CHECK(o.what.find("rank " + std::to_string(culprit) + " failed mid-pass") !=
              std::string::npos);
        CHECK(o.what.find("injected: an expert GEMM failed") != std::string::npos);
      }
      // Unusable afterwards, and it says why.
      CHECK(o.next.find("unusable") != std::string::npos);
    }
  }
  CHECK(checked == 2 + 3 + 4);
}

TEMPLATE_TEST_CASE("faults: a rank that stalls past exchange_timeout times the others out",
                   "[faults]", schedule::sequential, schedule::pipelined<2>) {
  using P = fault_policies<TestType>;
  const int R = 3, culprit = 1;
  const double timeout = 0.3, stall = 1.5;
  const auto out = failing_pass<P>(R, culprit, faulty_host::fault::stalls, timeout, stall);
  int checked = 0;
  for (int r = 0; r < R; ++r) {
    const outcome& o = out[static_cast<std::size_t>(r)];
    INFO("rank " << r << ": " << o.kind << " after " << o.seconds << " s: " << o.what);
    CHECK(o.y_untouched);
    CHECK(o.kind == "comm_timeout");
    if (r == culprit) continue;  // it learns when it wakes
    ++checked;
    // Within the deadline and a margin, long before the stalled rank wakes.
    CHECK(o.seconds >= 0.5 * timeout);
    CHECK(o.seconds < stall);
    CHECK(o.what.find("for rank(s) 1, which did not reach the exchange") != std::string::npos);
    // Waiting for the stalled rank's rows: its combine, or (pipelined) the next dispatch.
    CHECK((o.what.find("stage combine") != std::string::npos ||
           o.what.find("stage dispatch (chunk 1") != std::string::npos));
  }
  CHECK(checked == R - 1);
}

TEST_CASE("faults: exchange_timeout is checked, agreed, and 0 turns the deadline off") {
  layer_config cfg{.hidden = 8, .ffn = 8, .experts = 2, .top_k = 2, .max_tokens = 4};
  cfg.exchange_timeout = -1;
  CHECK_THROWS_WITH(cfg.validate(), Catch::Contains("exchange_timeout = -1") &&
                                        Catch::Contains("must be finite and >= 0"));
  cfg.exchange_timeout = std::numeric_limits<double>::infinity();
  CHECK_THROWS_WITH(cfg.validate(), Catch::Contains("exchange_timeout"));
  cfg.exchange_timeout = 0;
  CHECK_NOTHROW(cfg.validate());
  CHECK(layer_config{}.exchange_timeout == 600.0);  // the default: ten minutes
  // Ranks that disagree on it all throw, naming it.
  cfg.ranks = 2;
  std::vector<std::string> errors(2);
  comm::threads_world world(2);
  world.run([&](comm::threads c) {
    layer_config mine = cfg;
    mine.exchange_timeout = 10.0 + c.rank();
    const auto w = reference::full_weights::random(mine, 1);
    const placement::block where(mine);
    test::rank_arrays<fault_policies<>> arrays(w, reference::slice(w, where, c.rank()));
    try {
      moe_layer<fault_policies<>> layer(mine, c, arrays.views(mine, where.slots_per_rank()));
    } catch (const config_error& e) {
      errors[static_cast<std::size_t>(c.rank())] = e.what();
    }
  });
  for (const std::string& e : errors) {
    INFO(e);
    CHECK(e.find("exchange_timeout") != std::string::npos);
  }
}

namespace {
struct table_policies : default_policies {
  using placement = epmoe::placement::table;
  using comm = epmoe::comm::threads;
};

// 8 experts on 8 ranks, two slots each: rank r holds experts r and r + 1 (mod 8), so every
// expert has a copy on two neighbouring ranks.
placement::table ring_of_copies(int R) {
  std::vector<int> phy;
  for (int r = 0; r < R; ++r) phy.insert(phy.end(), {r, (r + 1) % R});
  return placement::table(R, R, phy);
}
}  // namespace

TEST_CASE("faults: losing ranks, the survivors' layer equals the reference without them",
          "[faults]") {
  const int R = 8;
  const layer_config cfg{
      .hidden = 16, .ffn = 20, .experts = R, .top_k = 2, .ranks = R, .max_tokens = 12};
  const placement::table where = ring_of_copies(R);
  const auto w = reference::full_weights::random(cfg, 21);
  const auto g = test::make_tokens(std::vector<index_t>(R, 12), cfg.hidden, 22);
  const std::vector<char> lost{0, 0, 1, 0, 0, 1, 0, 0};  // ranks 2 and 5 die
  const float nan = std::numeric_limits<float>::quiet_NaN();
  std::vector<float> y(g.x.size(), nan), y_before(g.x.size(), nan);
  std::vector<int> new_rank(R, -1), new_size(R, 0);
  std::string lost_both;  // the error when 2 and 3 die: expert 3 had no other copy
  comm::threads_world world(R);
  world.run([&](comm::threads c) {
    const int r = c.rank();
    test::rank_arrays<table_policies> arrays(w, reference::slice(w, where, r));
    moe_layer<table_policies> layer(cfg, c, arrays.views(cfg, where.slots_per_rank()), {}, {},
                                    where);
    const index_t T = 12, H = cfg.hidden;
    const float* x = g.x.data() + g.offset(r) * H;
    layer.forward({x, T, H}, {y_before.data() + g.offset(r) * H, T, H});
    if (lost[static_cast<std::size_t>(r)]) return;  // this rank dies: it never calls again
    if (r == 0) {  // losing 2 and 3 as well: local, thrown before any exchange
      const std::vector<char> too_many{0, 0, 1, 1, 0, 0, 0, 0};
      try {
        (void)layer.exclude_ranks(too_many);
      } catch (const config_error& e) {
        lost_both = e.what();
      }
    }
    auto survivors = layer.exclude_ranks(lost);
    new_rank[static_cast<std::size_t>(r)] = survivors.rank();
    new_size[static_cast<std::size_t>(r)] = survivors.config().ranks;
    survivors.forward({x, T, H}, {y.data() + g.offset(r) * H, T, H});
  });
  // The survivors, renumbered in rank order.
  CHECK(new_rank == std::vector<int>{0, 1, -1, 2, 3, -1, 4, 5});
  CHECK(new_size == std::vector<int>{6, 6, 0, 6, 6, 0, 6, 6});
  // Their outputs: the reference over their tokens alone (every expert still computed, by a
  // surviving copy); the lost ranks' rows stay unwritten.
  const placement::table after = placement::surviving(where, lost);
  CHECK(after.ranks() == 6);
  auto w6 = w;
  w6.cfg.ranks = 6;
  std::vector<float> x6, want6;
  std::vector<index_t> tokens6;
  for (int r = 0; r < R; ++r)
    if (!lost[static_cast<std::size_t>(r)]) {
      x6.insert(x6.end(), g.x.begin() + g.offset(r) * cfg.hidden,
                g.x.begin() + (g.offset(r) + 12) * cfg.hidden);
      tokens6.push_back(12);
    }
  want6.assign(x6.size(), nan);
  const index_t n6 = static_cast<index_t>(x6.size()) / cfg.hidden;
  reference::forward(w6, router::topk_softmax<2>{}, capacity::dropless{}, after,
                     {x6.data(), n6, cfg.hidden}, tokens6, {want6.data(), n6, cfg.hidden});
  std::vector<float> got6;
  int rows_lost = 0;
  for (int r = 0; r < R; ++r) {
    const auto first = y.begin() + g.offset(r) * cfg.hidden, last = first + 12 * cfg.hidden;
    if (lost[static_cast<std::size_t>(r)]) {
      rows_lost += std::all_of(first, last, [](float v) { return std::isnan(v); });
      continue;
    }
    got6.insert(got6.end(), first, last);
  }
  CHECK(rows_lost == 2);
  CHECK(test::relative_error(got6, want6) <= 1e-5);
  // The 8-rank pass before: the reference with every rank.
  std::vector<float> want8(g.x.size(), nan);
  reference::forward(w, router::topk_softmax<2>{}, capacity::dropless{}, where,
                     {g.x.data(), g.total(), cfg.hidden}, g.per_rank,
                     {want8.data(), g.total(), cfg.hidden});
  CHECK(test::relative_error(y_before, want8) <= 1e-5);
  // Without a surviving copy: the error names the expert.
  INFO(lost_both);
  CHECK(lost_both.find("expert(s) 3 ") != std::string::npos);
  CHECK(lost_both.find("without a surviving copy") != std::string::npos);
}
