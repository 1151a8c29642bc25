// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
#include <algorithm>
#include <atomic>
#include <catch2/catch.hpp>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <future>
#include <memory>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <epmoe/comm/any.hpp>
#include <epmoe/comm/local.hpp>
#include <epmoe/comm/threads.hpp>
#include <epmoe/comm/throttled.hpp>
#include <epmoe/core/concepts.hpp>
#include <epmoe/core/error.hpp>

using epmoe::index_t;
using epmoe::comm::threads;
using epmoe::comm::threads_world;

namespace {

// Runs f on its own thread and rethrows what it threw. A hang (a rank never released) ends
// the whole test binary with a message instead of blocking CTest until its timeout.
template <class F>
void finishes_within(std::chrono::seconds limit, F&& f) {
  std::packaged_task<void()> task(std::forward<F>(f));
  std::future<void> done = task.get_future();
  std::thread runner(std::move(task));
  if (done.wait_for(limit) != std::future_status::ready) {
    std::fprintf(stderr, "test_threads: a threads_world::run did not return within %llds\n",
                 static_cast<long long>(limit.count()));
    std::_Exit(3);
  }
  runner.join();
  done.get();
}

constexpr std::chrono::seconds kLimit{20};

// Elements rank s sends rank r in the uneven tests: rank-specific, zero for some pairs.
index_t uneven(int s, int r, int round) { return (3 * s + 2 * r + round) % 4; }
// The value of element i of the block s sends r: says where it came from.
int tag(int s, int r, index_t i, int round = 0) {
  return round * 1000000 + s * 10000 + r * 100 + static_cast<int>(i);
}

// One alltoallv with counts uneven(., ., round) on rank `me` of R; checks what arrives.
// The receive buffer leaves a one-element gap before every block, set to -1 and checked, so
// displacements are exercised on both sides.
template <class Comm>
void uneven_exchange(Comm& c, int round) {
  const int R = c.size(), me = c.rank();
  std::vector<index_t> sc(R), sd(R), rc(R), rd(R);
  index_t sn = 0, rn = 0;
  for (int r = 0; r < R; ++r) {
    sc[r] = uneven(me, r, round);
    sd[r] = sn;
    sn += sc[r];
    rc[r] = uneven(r, me, round);
    rd[r] = rn + 1;  // gap
    rn += rc[r] + 1;
  }
  std::vector<int> send(static_cast<std::size_t>(sn)), recv(static_cast<std::size_t>(rn), -1);
  for (int r = 0; r < R; ++r)
    for (index_t i = 0; i < sc[r]; ++i) send[sd[r] + i] = tag(me, r, i, round);
  c.alltoallv(send.data(), sc.data(), sd.data(), recv.data(), rc.data(), rd.data());
  for (int s = 0; s < R; ++s) {
    if (recv[rd[s] - 1] != -1)
      throw std::logic_error("gap before block from rank " + std::to_string(s) + " overwritten");
    for (index_t i = 0; i < rc[s]; ++i)
      if (recv[rd[s] + i] != tag(s, me, i, round))
        throw std::logic_error("rank " + std::to_string(me) + " round " + std::to_string(round) +
                               ": wrong element " + std::to_string(i) + " from rank " +
                               std::to_string(s));
  }
}

// What a rank's run ended with.
enum class outcome { none, completed, aborted, comm_error, other };

}  // namespace

TEST_CASE("threads satisfies communicator, and local does too", "[comm]") {
  STATIC_REQUIRE(epmoe::communicator<threads>);
  STATIC_REQUIRE(epmoe::communicator<epmoe::comm::local>);
}

TEST_CASE("threads: a world of 0 ranks is rejected", "[comm]") {
  try {
    threads_world w(0);
    FAIL("threads_world(0) was accepted");
  } catch (const epmoe::config_error& e) {
    CHECK(e.field() == "ranks");
  }
}

TEST_CASE("threads: run gives every rank its endpoint", "[comm]") {
  const int R = GENERATE(1, 2, 3, 4, 8);
  threads_world world(R);
  REQUIRE(world.size() == R);
  std::vector<int> seen(static_cast<std::size_t>(R), -1), sizes(static_cast<std::size_t>(R), -1);
  finishes_within(kLimit, [&] {
    world.run([&](threads c) {
      seen[c.rank()] = c.rank();
      sizes[c.rank()] = c.size();
    });
  });
  for (int r = 0; r < R; ++r) {
    CHECK(seen[r] == r);
    CHECK(sizes[r] == R);
  }
}

TEST_CASE("threads: alltoall delivers block r of rank s to rank r at position s", "[comm]") {
  const int R = GENERATE(1, 2, 3, 4, 8);
  CAPTURE(R);
  constexpr index_t n = 3;
  threads_world world(R);
  std::vector<std::vector<int>> got(static_cast<std::size_t>(R));
  finishes_within(kLimit, [&] {
    world.run([&](threads c) {
      const int me = c.rank();
      std::vector<int> send(static_cast<std::size_t>(R * n)),
          recv(static_cast<std::size_t>(R * n), -1);
      for (int r = 0; r < R; ++r)
        for (index_t i = 0; i < n; ++i) send[r * n + i] = tag(me, r, i);
      c.alltoall(send.data(), recv.data(), n);
      got[me] = recv;
    });
  });
  for (int r = 0; r < R; ++r)
    for (int s = 0; s < R; ++s)
      for (index_t i = 0; i < n; ++i) {
        CAPTURE(r, s, i);
        CHECK(got[r][s * n + i] == tag(s, r, i));
      }
}

TEST_CASE("threads: alltoallv with uneven and zero counts delivers exact contents", "[comm]") {
  const int R = GENERATE(1, 2, 3, 4, 8);
  CAPTURE(R);
  threads_world world(R);
  REQUIRE_NOTHROW(
      finishes_within(kLimit, [&] { world.run([&](threads c) { uneven_exchange(c, 0); }); }));
}

TEST_CASE("threads: many back-to-back exchanges stay correct", "[comm]") {
  const int R = GENERATE(1, 2, 3, 4, 8);
  CAPTURE(R);
  threads_world world(R);
  REQUIRE_NOTHROW(finishes_within(kLimit, [&] {
    world.run([&](threads c) {
      for (int round = 0; round < 60; ++round) {
        uneven_exchange(c, round);
        // A fixed-size exchange in between reuses the endpoint's scratch.
        std::vector<index_t> send(static_cast<std::size_t>(c.size()), c.rank() + round),
            recv(static_cast<std::size_t>(c.size()), -1);
        c.alltoall(send.data(), recv.data(), 1);
        for (int s = 0; s < c.size(); ++s)
          if (recv[s] != s + round)
            throw std::logic_error("alltoall round " + std::to_string(round));
      }
    });
  }));
  // A world that ran cleanly can run again.
  REQUIRE_NOTHROW(
      finishes_within(kLimit, [&] { world.run([&](threads c) { uneven_exchange(c, 7); }); }));
}

TEST_CASE("threads: a count mismatch throws comm_error and releases the other ranks",
          "[comm][error]") {
  const int R = GENERATE(2, 3, 4, 8);
  CAPTURE(R);
  constexpr index_t n = 4;
  const int bad = R - 1;  // expects one element more from rank 0 than rank 0 sends
  // Every array an exchange points to lives outside run, so it outlives every rank's use.
  const auto uR = static_cast<std::size_t>(R);
  std::vector<std::vector<float>> send(uR, std::vector<float>(uR * n, 1.f)),
      recv(uR, std::vector<float>(uR * n + 1, 0.f));
  std::vector<std::vector<index_t>> sc(uR, std::vector<index_t>(uR, n)), displs(uR),
      rc(uR, std::vector<index_t>(uR, n));
  for (int r = 0; r < R; ++r)
    for (int p = 0; p < R; ++p) displs[r].push_back(p * n);
  rc[bad][0] = n + 1;
  std::vector<outcome> first(uR, outcome::none), second(uR, outcome::none);

  threads_world world(R);
  auto record = [](outcome& into, auto&& exchange) {
    try {
      exchange();
      into = outcome::completed;
    } catch (const epmoe::comm_aborted&) {
      into = outcome::aborted;
      throw;
    } catch (const epmoe::comm_error&) {
      into = outcome::comm_error;
      throw;
    } catch (...) {
      into = outcome::other;
      throw;
    }
  };
  bool threw_comm_error = false, threw_aborted = false;
  try {
    finishes_within(kLimit, [&] {
      world.run([&](threads c) {
        const auto me = static_cast<std::size_t>(c.rank());
        record(first[me], [&] {
          c.alltoallv(send[me].data(), sc[me].data(), displs[me].data(), recv[me].data(),
                      rc[me].data(), displs[me].data());
        });
        // Whoever got through the failed exchange must be released from the next one.
        std::vector<int> one(uR, 1), got(uR, 0);
        record(second[me], [&] { c.alltoall(one.data(), got.data(), 1); });
      });
    });
  } catch (const epmoe::comm_aborted&) {
    threw_aborted = true;
  } catch (const epmoe::comm_error& e) {
    threw_comm_error = true;
    CHECK_THAT(e.what(), Catch::Matchers::Contains("rank " + std::to_string(bad)));
  }
  CHECK(threw_comm_error);
  CHECK_FALSE(threw_aborted);
  CHECK(first[bad] == outcome::comm_error);
  for (int r = 0; r < R; ++r) {
    if (r == bad) continue;
    CAPTURE(r);
    const outcome f = first[r], s = second[r];
    CHECK((f == outcome::completed || f == outcome::aborted));
    if (f == outcome::completed) CHECK(s == outcome::aborted);
  }
}

TEST_CASE("threads: ranks may free their buffers as soon as a failed exchange returns",
          "[comm][error]") {
  // Like a layer unwinding: every array of the exchange is local to the rank and dies with
  // it. No rank may still read a peer's arrays once that peer has left the exchange (under
  // ASan a violation is a use-after-free; without it, garbage counts or a crash).
  const int R = GENERATE(2, 3, 4, 8);
  CAPTURE(R);
  const int bad = R - 1;
  std::vector<outcome> first(static_cast<std::size_t>(R), outcome::none);
  bool threw_comm_error = false;
  try {
    finishes_within(kLimit, [&] {
      threads_world world(R);
      world.run([&](threads c) {
        const index_t n = 1 << 14;
        std::vector<index_t> sc(R, n), displs(R), rc(R, n);
        for (int r = 0; r < R; ++r) displs[r] = r * n;
        if (c.rank() == bad) rc[0] = n + 1;
        std::vector<float> send(static_cast<std::size_t>(R * n), 1.f),
            recv(static_cast<std::size_t>(R * n + 1));
        outcome& mine = first[static_cast<std::size_t>(c.rank())];
        try {
          c.alltoallv(send.data(), sc.data(), displs.data(), recv.data(), rc.data(), displs.data());
          mine = outcome::completed;
        } catch (const epmoe::comm_aborted&) {
          mine = outcome::aborted;
          throw;
        } catch (const epmoe::comm_error&) {
          mine = outcome::comm_error;
          throw;
        }
      });
    });
  } catch (const epmoe::comm_aborted&) {
    FAIL("run rethrew comm_aborted, not the mismatch");
  } catch (const epmoe::comm_error& e) {
    threw_comm_error = true;
    CHECK_THAT(e.what(), Catch::Matchers::Contains("rank " + std::to_string(bad) + " expects"));
  }
  CHECK(threw_comm_error);
  for (int r = 0; r < R; ++r) {
    CAPTURE(r);
    const outcome o = first[static_cast<std::size_t>(r)];
    if (r == bad)
      CHECK(o == outcome::comm_error);
    else
      CHECK((o == outcome::completed || o == outcome::aborted));
  }
}

TEST_CASE("threads: a failing exchange returns only after peers stopped reading its buffers",
          "[comm][error]") {
  // Rank 1 expects a wrong count from rank 0 and throws; on the way out it overwrites its
  // send buffer (as freeing and reusing the memory would). Rank 0 first copies a large block
  // from itself, then reads rank 1's block: it must see the data rank 1 sent, not what rank
  // 1's buffer held after it had already left the exchange.
  constexpr index_t big = index_t{16} << 20;  // 64 MB from rank 0 to itself: a few ms
  constexpr index_t small = 4096;             // rank 1 -> rank 0
  std::vector<float> send0(static_cast<std::size_t>(big + small), 1.f);
  std::vector<float> send1(static_cast<std::size_t>(small + small), 2.f);
  std::vector<float> recv1(static_cast<std::size_t>(small + small), 0.f);
  // Left untouched (fresh pages) so rank 0's big copy also pays its page faults.
  std::unique_ptr<float[]> recv0_owner(new float[big + small]);
  float* recv0 = recv0_owner.get();
  std::fill(recv0 + big, recv0 + big + small, 0.f);
  std::atomic<bool> rank1_threw{false};

  auto body = [&](threads c) {
    if (c.rank() == 0) {
      const index_t sc[] = {big, small}, sd[] = {0, big};
      const index_t rc[] = {big, small}, rd[] = {0, big};
      c.alltoallv(send0.data(), sc, sd, recv0, rc, rd);
    } else {
      const index_t sc[] = {small, small}, sd[] = {0, small};
      const index_t rc[] = {small + 1, small}, rd[] = {0, small};  // wrong count from rank 0
      try {
        c.alltoallv(send1.data(), sc, sd, recv1.data(), rc, rd);
      } catch (const epmoe::comm_error&) {
        rank1_threw = true;
        std::fill(send1.begin(), send1.end(), -9.f);
        throw;
      }
    }
  };
  threads_world world(2);
  CHECK_THROWS_AS(finishes_within(kLimit, [&] { world.run(body); }), epmoe::comm_error);
  REQUIRE(rank1_threw);
  // Rank 0 either completed the exchange or was aborted after copying: what it copied from
  // rank 1 must be rank 1's data.
  std::size_t poisoned = 0;
  for (index_t i = big; i < big + small; ++i) poisoned += recv0[i] == -9.f;
  CHECK(poisoned == 0);
}

TEST_CASE("threads: a rank that throws before an exchange makes run rethrow that error",
          "[comm][error]") {
  const int R = GENERATE(2, 3, 4, 8);
  const int culprit = GENERATE(0, 1);
  CAPTURE(R, culprit);
  threads_world world(R);
  std::vector<outcome> seen(static_cast<std::size_t>(R), outcome::none);
  bool got_original = false;
  try {
    finishes_within(kLimit, [&] {
      world.run([&](threads c) {
        const auto me = static_cast<std::size_t>(c.rank());
        if (c.rank() == culprit) {
          seen[me] = outcome::other;
          throw std::runtime_error("boom from the culprit");
        }
        std::vector<int> send(static_cast<std::size_t>(R), 1), recv(static_cast<std::size_t>(R));
        try {
          c.alltoall(send.data(), recv.data(), 1);
          seen[me] = outcome::completed;
        } catch (const epmoe::comm_aborted&) {
          seen[me] = outcome::aborted;
          throw;
        }
      });
    });
  } catch (const epmoe::comm_error& e) {
    FAIL("run rethrew a comm_error instead of the original exception: " << e.what());
  } catch (const std::runtime_error& e) {
    got_original = std::string(e.what()) == "boom from the culprit";
  }
  CHECK(got_original);
  for (int r = 0; r < R; ++r)
    if (r != culprit) CHECK(seen[r] == outcome::aborted);
}

TEST_CASE("local: alltoall and alltoallv copy", "[comm]") {
  epmoe::comm::local c;
  CHECK(c.rank() == 0);
  CHECK(c.size() == 1);

  const std::vector<int> send{1, 2, 3, 4, 5};
  std::vector<int> recv(5, 0);
  c.alltoall(send.data(), recv.data(), 5);
  CHECK(recv == send);

  const std::vector<double> sv{9, 8, 7, 6, 5, 4};
  std::vector<double> rv(6, -1);
  const index_t sc[] = {3}, sd[] = {2}, rc[] = {3}, rd[] = {1};
  c.alltoallv(sv.data(), sc, sd, rv.data(), rc, rd);
  CHECK(rv == std::vector<double>{-1, 7, 6, 5, -1, -1});

  const index_t zero[] = {0};
  std::vector<double> untouched(2, -1);
  c.alltoallv(sv.data(), zero, zero, untouched.data(), zero, zero);
  CHECK(untouched == std::vector<double>{-1, -1});
}

TEST_CASE("local: alltoallv with mismatched counts throws comm_error", "[comm][error]") {
  epmoe::comm::local c;
  const std::vector<float> send(4, 1.f);
  std::vector<float> recv(4, 0.f);
  const index_t sc[] = {3}, rc[] = {4}, d[] = {0};
  CHECK_THROWS_AS(c.alltoallv(send.data(), sc, d, recv.data(), rc, d), epmoe::comm_error);
}

// comm::any: a comm known at run time (a framework's process group) behind one endpoint;
// endpoint_of<threads> stands in for it here.
TEST_CASE("any: over endpoint_of<threads>, exchanges deliver exactly what threads does", "[comm]") {
  static_assert(epmoe::host_communicator<epmoe::comm::any>);
  const int R = GENERATE(1, 2, 3, 4);
  CAPTURE(R);
  threads_world world(R);
  std::vector<int> checked(static_cast<std::size_t>(R), 0);
  finishes_within(kLimit, [&] {
    world.run([&](threads c) {
      const int me = c.rank();
      epmoe::comm::endpoint_of<threads> ep(std::move(c));
      epmoe::comm::any a(ep);
      // (no Catch assertions on the rank threads: Catch2 v2 is not thread-safe)
      if (a.rank() != me || a.size() != R) throw std::logic_error("comm::any: rank or size");
      uneven_exchange(a, 0);
      uneven_exchange(a, 1);
      // Fixed-size, 8-byte elements: byte counts scale with the element.
      constexpr index_t n = 3;
      std::vector<std::int64_t> send(static_cast<std::size_t>(R * n)), recv(send.size(), -1);
      for (int r = 0; r < R; ++r)
        for (index_t i = 0; i < n; ++i) send[r * n + i] = tag(me, r, i);
      a.alltoall(send.data(), recv.data(), n);
      for (int s = 0; s < R; ++s)
        for (index_t i = 0; i < n; ++i) checked[me] += recv[s * n + i] == tag(s, me, i) ? 1 : -1000;
      // Two started, waited in order (a pipelined schedule's pattern).
      std::vector<index_t> cnt(static_cast<std::size_t>(R), 1), dis(static_cast<std::size_t>(R));
      for (int r = 0; r < R; ++r) dis[r] = r;
      std::vector<float> s1(static_cast<std::size_t>(R)), s2(s1.size()), r1(s1.size(), -1.f),
          r2(s1.size(), -1.f);
      for (int r = 0; r < R; ++r) s1[r] = static_cast<float>(tag(me, r, 0)), s2[r] = -s1[r];
      auto q1 = a.ialltoallv(s1.data(), cnt.data(), dis.data(), r1.data(), cnt.data(), dis.data());
      auto q2 = a.ialltoallv(s2.data(), cnt.data(), dis.data(), r2.data(), cnt.data(), dis.data());
      q1.wait();
      q2.wait();
      for (int s = 0; s < R; ++s) {
        checked[me] += r1[s] == static_cast<float>(tag(s, me, 0)) ? 1 : -1000;
        checked[me] += r2[s] == -static_cast<float>(tag(s, me, 0)) ? 1 : -1000;
      }
    });
  });
  for (int r = 0; r < R; ++r) CHECK(checked[r] == 3 * R + 2 * R);
}

TEST_CASE("any: more exchanges pending than its slots is a comm_error, not a hang", "[comm]") {
  threads_world world(1);
  finishes_within(kLimit, [&] {
    world.run([&](threads c) {
      epmoe::comm::endpoint_of<threads> ep(std::move(c));
      epmoe::comm::any a(ep, 1);
      index_t n = 1, d = 0;
      float s = 1.f, r = 0.f, r2 = 0.f;
      auto q = a.ialltoallv(&s, &n, &d, &r, &n, &d);
      CHECK_THROWS_WITH(a.ialltoallv(&s, &n, &d, &r2, &n, &d),
                        Catch::Contains("more than 1 exchanges pending"));
      q.wait();
      CHECK(r == 1.f);
      auto again = a.ialltoallv(&s, &n, &d, &r2, &n, &d);  // the slot is free again
      again.wait();
      CHECK(r2 == 1.f);
    });
  });
}

TEST_CASE("throttled: two link classes price each part of an exchange at its own link",
          "[comm][throttled]") {
  // 4 ranks as 2 nodes x 2: rank 0's node peer is rank 1; ranks 2 and 3 are across the NIC.
  const epmoe::comm::node_links links{.intra = {.bandwidth = 1000.0, .latency = 1.0},
                                      .inter = {.bandwidth = 10.0, .latency = 2.0},
                                      .ranks_per_node = 2};
  using throttled = epmoe::comm::throttled<threads>;
  std::vector<double> got;  // read on rank 0's thread, checked here (Catch is not thread-safe)
  int per_node = -1, one_per_node = -1, any_per_node = -1, any_plain = -1;
  threads_world world(4);
  world.run([&](threads c) {
    if (c.rank() != 0) return;
    const throttled t(c, links);
    per_node = t.ranks_per_node();
    const index_t none[4] = {0, 0, 0, 0}, intra[4] = {5, 2000, 0, 0}, inter[4] = {0, 0, 30, 10},
                  both[4] = {0, 2000, 10, 10};
    got = {t.seconds<float>(intra, none), t.seconds<float>(none, inter),
           t.seconds<float>(both, both), t.seconds<float>(none, none)};
    const throttled one(c, links.inter);  // one class, as before: every link is `inter`
    one_per_node = one.ranks_per_node();
    got.push_back(one.seconds<float>(intra, none));
    // comm::any passes the nodes on from the comm it wraps.
    epmoe::comm::endpoint_of<throttled> ep(t);
    any_per_node = epmoe::comm::any(ep).ranks_per_node();
    epmoe::comm::endpoint_of<threads> plain(c);
    any_plain = epmoe::comm::any(plain).ranks_per_node();
  });
  CHECK(per_node == 2);
  CHECK(one_per_node == 0);
  CHECK(any_per_node == 2);
  CHECK(any_plain == 0);
  REQUIRE(got.size() == 5);
  // 4-byte floats; the count to itself never moves.
  CHECK(got[0] == Approx(1.0 + 8000.0 / 1000.0));
  CHECK(got[1] == Approx(2.0 + 160.0 / 10.0));
  CHECK(got[2] == Approx(std::max(1.0 + 8.0, 2.0 + 8.0)));  // the classes side by side
  CHECK(got[3] == Approx(2.0));                             // an empty exchange: latency
  CHECK(got[4] == Approx(2.0 + 8000.0 / 10.0));
  std::string error;
  threads_world three(3);
  three.run([&](threads c) {
    if (c.rank() != 0) return;
    try {
      throttled bad(c, links);
    } catch (const epmoe::config_error& e) {
      error = e.what();
    }
  });
  CHECK_THAT(error, Catch::Contains("node_links.ranks_per_node = 2") &&
                        Catch::Contains("divide the comm's size (3)"));
}

// The low-latency exchange writes straight into peers' windows (issue 38). A rank that gives
// up on a meeting must not leave (and free its buffers) while a peer's write into them is in
// flight, and a rank that wakes after the others gave up must write nothing.
TEST_CASE("threads: a timed-out rank leaves only after a peer's put into its window lands",
          "[comm][timeout]") {
  threads_world world(2);
  world.set_timeout(0.1);
  std::atomic<bool> landed{false};
  int seen = 0;  // what rank 1 finds in its window when it leaves
  std::vector<std::string> kind(2, "none");
  bool left_after_put = false, late_put_refused = false;
  finishes_within(kLimit, [&] {
    world.run([&](threads c) {
      const int me = c.rank();
      const threads::window win = c.open_window(4 * sizeof(int));
      if (me == 0) {
        {
          const auto writing = c.put();
          std::this_thread::sleep_for(std::chrono::milliseconds(400));  // past rank 1's deadline
          const int v = 7;
          std::memcpy(win.peers[1], &v, sizeof v);
          landed = true;
        }
        try {
          (void)c.put();
        } catch (const epmoe::comm_timeout&) {
          late_put_refused = true;
        }
      } else {
        try {
          c.barrier();
        } catch (const epmoe::comm_timeout&) {
          kind[1] = "comm_timeout";
          left_after_put = landed.load();
          std::memcpy(&seen, win.own.get(), sizeof seen);
        }
      }
    });
  });
  CHECK(kind[1] == "comm_timeout");
  CHECK(left_after_put);
  CHECK(late_put_refused);
  CHECK(seen == 7);
}
