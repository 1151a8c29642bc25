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
#include <cstring>
#include <limits>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "faults.hpp"
#include "harness.hpp"
#include <epmoe/router/sigmoid_bias.hpp>
#include <epmoe/schedule/pipelined.hpp>
#include <epmoe/schedule/sequential.hpp>

// A namespace per file: the test programs compile their files as one unit.
namespace faults_tests {
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
      } catch (const input_error& e) {
        o.kind = "input_error", o.what = e.what();
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

TEMPLATE_TEST_CASE("faults: a rank that fails before the first exchange runs an empty pass",
                   "[faults]", schedule::sequential, schedule::pipelined<2>) {
  // Any local error before the pass's first collective (here the gate's GEMM throws) is an
  // agreed failure, like a rejected input: the rank goes on with no tokens up to the counts
  // exchange, which tells every peer; all throw at once, nothing is written, and the layer
  // stays usable.
  using P = fault_policies<TestType>;
  int checked = 0;
  for (int R : {2, 3}) {
    const int culprit = R - 1;
    const auto out = failing_pass<P>(R, culprit, faulty_host::fault::gate_throws, 30.0);
    for (int r = 0; r < R; ++r, ++checked) {
      const outcome& o = out[static_cast<std::size_t>(r)];
      INFO("R=" << R << " rank " << r << ": " << o.kind << " after " << o.seconds
                << " s: " << o.what << "; next: " << o.next);
      CHECK(o.y_untouched);
      CHECK(o.seconds < 5.0);
      if (r == culprit) {
        CHECK(o.kind == "runtime_error");
        CHECK(o.what == "injected: the gate's GEMM failed");
      } else {
        CHECK(o.kind == "input_error");
        CHECK(o.what.find("rank " + std::to_string(culprit)) != std::string::npos);
      }
      CHECK(o.next == "none");  // usable: the next pass runs
    }
  }
  CHECK(checked == 2 + 3);
}

namespace {
struct train_fault_policies : fault_policies<schedule::pipelined<2>> {};

// One training layer per thread rank and everything its calls need.
struct train_rank {
  using P = train_fault_policies;
  using layer_t = moe_layer<P>;
  layer_config cfg;
  placement::block where;
  test::rank_arrays<P> arrays;
  layer_t layer;
  index_t T = 8, H;
  std::vector<float> x, y, dy, dx;
  std::vector<std::vector<float>> grad_memory;
  layer_t::gradients grads;
  static layer_config config(int R, double timeout) {
    layer_config c{
        .hidden = 8, .ffn = 12, .experts = 2 * R, .top_k = 2, .ranks = R, .max_tokens = 8};
    c.training = true;
    c.chunks = 2;
    c.exchange_timeout = timeout;
    return c;
  }
  train_rank(comm::threads c, const reference::full_weights& w, double timeout)
      : cfg(config(c.size(), timeout)),
        where(cfg),
        arrays(w, reference::slice(w, where, c.rank())),
        layer(cfg, c, arrays.views(cfg, where.slots_per_rank())),
        H(cfg.hidden),
        x(reference::random_tokens(T, H, 50 + static_cast<std::uint64_t>(c.rank()))),
        y(x.size()),
        dy(x.size(), 0.25f),
        dx(x.size()) {
    const index_t L = where.slots_per_rank(), E = cfg.experts, F = cfg.ffn;
    for (index_t n : {E * H, L * F * H, L * F * H, L * H * F})
      grad_memory.emplace_back(static_cast<std::size_t>(n));
    grads.gate = {grad_memory[0].data(), E, H};
    grads.experts = {{grad_memory[1].data(), L, F, H},
                     {grad_memory[2].data(), L, F, H},
                     {grad_memory[3].data(), L, H, F}};
    poison();
  }
  void poison() {
    const float nan = std::numeric_limits<float>::quiet_NaN();
    for (auto* v : {&y, &dx}) std::fill(v->begin(), v->end(), nan);
    for (auto& v : grad_memory) std::fill(v.begin(), v.end(), nan);
  }
  bool untouched() const {
    for (const auto* v : {&y, &dx})
      for (float f : *v)
        if (!std::isnan(f)) return false;
    for (const auto& v : grad_memory)
      for (float f : v)
        if (!std::isnan(f)) return false;
    return true;
  }
  void forward() { layer.forward({x.data(), T, H}, {y.data(), T, H}); }
  void backward() { layer.backward({dy.data(), T, H}, {dx.data(), T, H}, grads); }
  void reduce() { layer.reduce_gradients(grads); }
};

// What a call threw: "config_error <field>: <what>", another exception's what(), or "none".
template <class F>
std::string thrown(F&& f) {
  try {
    f();
  } catch (const config_error& e) {
    return "config_error " + e.field() + ": " + e.what();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "none";
}
}  // namespace

TEST_CASE("faults: ranks that make different calls all throw, naming the call, nothing is written",
          "[faults]") {
  const int R = 2;
  const auto w = reference::full_weights::random(train_rank::config(R, 5.0), 51);
  std::vector<std::vector<std::string>> said(R);
  std::vector<int> untouched(R, 0), recovered(R, 0), steps(R, 0);
  comm::threads_world world(R);
  world.run([&](comm::threads c) {
    const int r = c.rank();
    train_rank t(c, w, 5.0);
    auto& s = said[static_cast<std::size_t>(r)];
    int clean = 1;
    t.forward();
    t.poison();
    // Forward on rank 0, backward (of the pass before) on rank 1.
    s.push_back(thrown([&] { r == 0 ? t.forward() : t.backward(); }));
    clean &= t.untouched();
    t.forward();
    t.backward();
    // Chunks set on one rank only.
    if (r == 1) t.layer.set_chunks(1);
    t.poison();
    s.push_back(thrown([&] { t.forward(); }));
    clean &= t.untouched();
    t.layer.set_chunks(2);
    // A side collective against a pass.
    s.push_back(thrown([&] { r == 0 ? t.reduce() : t.forward(); }));
    clean &= t.untouched();
    // Every rank agrees again: a training step runs.
    t.forward();
    t.backward();
    t.reduce();
    recovered[r] = !t.untouched() && std::isfinite(t.dx[0]) && std::isfinite(t.grad_memory[0][0]);
    untouched[r] = clean;
    steps[r] = static_cast<int>(t.layer.passes());
  });
  for (int i = 0; i < 3; ++i) {
    INFO("call " << i << ": rank 0: " << said[0][i] << "\nrank 1: " << said[1][i]);
    CHECK(said[0][i].rfind("config_error call: ", 0) == 0);
    CHECK(said[0][i] == said[1][i]);  // one verdict, the same text on every rank
  }
  CHECK(said[0][0].find("rank 0: forward") != std::string::npos);
  CHECK(said[0][0].find("rank 1: backward") != std::string::npos);
  CHECK(said[0][1].find("chunks") != std::string::npos);
  CHECK(said[0][2].find("reduce_gradients") != std::string::npos);
  CHECK(untouched == std::vector<int>{1, 1});
  CHECK(recovered == std::vector<int>{1, 1});
  CHECK(steps == std::vector<int>{3, 3});
}

TEST_CASE("faults: a side collective that times out makes the layer refuse further calls",
          "[faults]") {
  const int R = 2, late = 1;
  const double timeout = 0.3, stall = 1.5;
  const auto w = reference::full_weights::random(train_rank::config(R, timeout), 52);
  std::vector<std::string> got(R), next(R);
  std::vector<double> seconds(R, 0);
  comm::threads_world world(R);
  try {
    world.run([&](comm::threads c) {
      const int r = c.rank();
      train_rank t(c, w, timeout);
      t.forward();
      t.backward();
      if (r == late) std::this_thread::sleep_for(std::chrono::duration<double>(stall));
      const auto start = std::chrono::steady_clock::now();
      got[r] = thrown([&] { t.reduce(); });
      seconds[r] = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      next[r] = thrown([&] { t.forward(); });
    });
  } catch (const std::exception&) {
  }
  for (int r = 0; r < R; ++r) {
    INFO("rank " << r << ": " << got[r] << " after " << seconds[r] << " s; next: " << next[r]);
    CHECK(got[r] != "none");
    CHECK(next[r].find("unusable") != std::string::npos);
    CHECK(next[r].find("reduce_gradients") != std::string::npos);
  }
  CHECK(seconds[0] < stall);
  CHECK(got[0].find("waited 0.3 s (exchange_timeout)") != std::string::npos);
}

namespace {
struct ring_policies : default_policies {
  using placement = epmoe::placement::table;
  using comm = epmoe::comm::threads;
};
// R experts on R ranks, two slots each: rank r holds experts r and r + step (mod R).
placement::table ring(int R, int step) {
  std::vector<int> phy;
  for (int r = 0; r < R; ++r) phy.insert(phy.end(), {r, (r + step) % R});
  return placement::table(R, R, phy);
}
}  // namespace

TEST_CASE("faults: the survivors' layer owns what it reads (packed copies, re-placed experts)",
          "[faults]") {
  // exclude_ranks builds a layer that must not read the old one's memory: its packed copies
  // (the old layer repacks in bf16 afterwards, or is destroyed), or the experts the old layer
  // owns after a live re-placement (it re-places them again afterwards).
  const int R = 4;
  const layer_config cfg{
      .hidden = 16, .ffn = 20, .experts = R, .top_k = 2, .ranks = R, .max_tokens = 12};
  const auto w = reference::full_weights::random(cfg, 53);
  const auto g = test::make_tokens(std::vector<index_t>(R, 12), cfg.hidden, 54);
  const std::vector<char> lost{0, 0, 1, 0};
  std::vector<int> same(R, -1), compared(R, 0);
  for (const bool replaced : {false, true}) {
    comm::threads_world world(R);
    world.run([&](comm::threads c) {
      const int r = c.rank();
      const placement::table first = ring(R, 1);
      test::rank_arrays<ring_policies> arrays(w, reference::slice(w, first, r));
      std::optional<moe_layer<ring_policies>> old;
      old.emplace(cfg, c, arrays.views(cfg, 2), router::topk_softmax<2>{}, capacity::dropless{},
                  first);
      if (replaced) old->apply_placement(ring(R, 2));
      old->pack_weights();
      const index_t T = 12, H = cfg.hidden;
      const float* x = g.x.data() + g.offset(r) * H;
      const float nan = std::numeric_limits<float>::quiet_NaN();
      std::vector<float> y1(T * H, nan), y2(T * H, nan), y3(T * H, nan);
      // A pass first: the old layer's space has read its packed copies (a space that kept
      // them would hand them to the survivors' copy of it, which packs nothing itself).
      old->forward({x, T, H}, {y1.data(), T, H});
      if (lost[static_cast<std::size_t>(r)]) {
        if (replaced) old->apply_placement(ring(R, 3));  // the old layer's collective
        return;
      }
      auto survivors = old->exclude_ranks(lost);
      survivors.forward({x, T, H}, {y1.data(), T, H});
      // Only the old layer changes: repacked in bf16, or its experts re-placed again.
      if (replaced)
        old->apply_placement(ring(R, 3));
      else
        old->pack_weights(packed_precision::bf16);
      survivors.forward({x, T, H}, {y2.data(), T, H});
      old.reset();  // and gone
      survivors.forward({x, T, H}, {y3.data(), T, H});
      same[r] = std::memcmp(y1.data(), y2.data(), y1.size() * sizeof(float)) == 0 &&
                std::memcmp(y1.data(), y3.data(), y1.size() * sizeof(float)) == 0 &&
                std::all_of(y1.begin(), y1.end(), [](float v) { return std::isfinite(v); });
      compared[r] += 1;
    });
    INFO("replaced " << replaced);
    CHECK(same == std::vector<int>{1, 1, -1, 1});
  }
  CHECK(compared == std::vector<int>{2, 2, 0, 2});
}

}  // namespace faults_tests
