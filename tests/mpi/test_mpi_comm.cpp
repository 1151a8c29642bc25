// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
#include <algorithm>
#include <catch2/catch.hpp>
#include <chrono>
#include <climits>
#include <cstdint>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <epmoe/comm/mpi.hpp>
#include <epmoe/core/agreement.hpp>
#include <epmoe/core/concepts.hpp>

using Catch::Matchers::Contains;
using epmoe::index_t;
using epmoe::comm::mpi;

namespace epmoe::comm::detail {
struct mpi_test_access {
  static void set_int_limit(mpi& c, index_t limit) { c.int_limit_ = limit; }
};
}  // namespace epmoe::comm::detail

static_assert(epmoe::communicator<mpi>);

namespace {

// Elements rank s sends rank r, in units: rank-specific, zero for some pairs.
index_t uneven(int s, int r, int round) { return (3 * s + 2 * r + round) % 4; }
// Element i of the block s sends r: says where it came from (fits in uint8 for small runs).
int tag(int s, int r, index_t i) { return (s * 37 + r * 11 + static_cast<int>(i)) % 101; }

// One alltoallv with counts uneven(., ., round) * unit; the receive buffer leaves a gap of one
// unit (set to -1 and checked) before every block, so displacements count on both sides.
template <class T>
void uneven_exchange(mpi& c, int round, index_t unit, bool nonblocking = false) {
  const int R = c.size(), me = c.rank();
  std::vector<index_t> sc(R), sd(R), rc(R), rd(R);
  index_t sn = 0, rn = 0;
  for (int r = 0; r < R; ++r) {
    sc[r] = uneven(me, r, round) * unit;
    sd[r] = sn;
    sn += sc[r];
    rn += unit;  // the gap
    rc[r] = uneven(r, me, round) * unit;
    rd[r] = rn;
    rn += rc[r];
  }
  std::vector<T> send(sn), recv(rn, static_cast<T>(-1));
  for (int r = 0; r < R; ++r)
    for (index_t i = 0; i < sc[r]; ++i) send[sd[r] + i] = static_cast<T>(tag(me, r, i));
  if (nonblocking) {
    mpi::request req =
        c.ialltoallv(send.data(), sc.data(), sd.data(), recv.data(), rc.data(), rd.data());
    req.wait();
  } else {
    c.alltoallv(send.data(), sc.data(), sd.data(), recv.data(), rc.data(), rd.data());
  }
  int wrong = 0;
  for (int s = 0; s < R; ++s) {
    for (index_t i = 0; i < unit; ++i) wrong += recv[rd[s] - unit + i] != static_cast<T>(-1);
    for (index_t i = 0; i < rc[s]; ++i) wrong += recv[rd[s] + i] != static_cast<T>(tag(s, me, i));
  }
  CHECK(wrong == 0);
}

}  // namespace

TEST_CASE("mpi: rank and size are the communicator's, on a duplicate", "[mpi][comm]") {
  int rank = -1, size = -1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  mpi c(MPI_COMM_WORLD);
  CHECK(c.rank() == rank);
  CHECK(c.size() == size);
  int same = MPI_UNEQUAL;
  MPI_Comm_compare(c.native(), MPI_COMM_WORLD, &same);
  CHECK(same == MPI_CONGRUENT);  // same group, separate context: our traffic never mixes
  mpi moved(std::move(c));
  CHECK(moved.rank() == rank);
  CHECK(c.native() == MPI_COMM_NULL);
}

TEMPLATE_TEST_CASE("mpi: alltoall and uneven alltoallv deliver every block", "[mpi][comm]", float,
                   double, std::int32_t, std::int64_t, std::uint8_t) {
  mpi c(MPI_COMM_WORLD);
  const int R = c.size(), me = c.rank();
  const index_t n = 3;
  std::vector<TestType> send(R * n), recv(R * n);
  for (int r = 0; r < R; ++r)
    for (index_t i = 0; i < n; ++i) send[r * n + i] = static_cast<TestType>(tag(me, r, i));
  c.alltoall(send.data(), recv.data(), n);
  int wrong = 0;
  for (int s = 0; s < R; ++s)
    for (index_t i = 0; i < n; ++i)
      wrong += recv[s * n + i] != static_cast<TestType>(tag(s, me, i));
  CHECK(wrong == 0);
  for (int round = 0; round < 4; ++round) uneven_exchange<TestType>(c, round, 1);
}

TEST_CASE("mpi: zero counts everywhere is a valid exchange", "[mpi][comm]") {
  mpi c(MPI_COMM_WORLD);
  std::vector<index_t> zero(c.size(), 0);
  float none = 0, nothing = 0;
  c.alltoallv(&none, zero.data(), zero.data(), &nothing, zero.data(), zero.data());
  c.alltoall(&none, &nothing, 0);
  SUCCEED();
}

TEST_CASE("mpi: past the int limit, exchanges go in derived-datatype blocks", "[mpi][comm]") {
  mpi c(MPI_COMM_WORLD);
  // Lower the limit from INT_MAX to 16 elements so that small buffers take the large path
  // (on 2+ ranks the displacements reach 65 elements, in units of 5).
  epmoe::comm::detail::mpi_test_access::set_int_limit(c, 16);
  const int R = c.size();
  for (int round = 0; round < 4; ++round) {
    uneven_exchange<float>(c, round, 5);  // counts and displacements are multiples of 5
    uneven_exchange<std::int64_t>(c, round, 5, true);
  }
  // alltoall of 20 elements: gcd 20 is over 16, so blocks of 10, 2 blocks per peer.
  const index_t twenty = 20;
  CHECK(epmoe::comm::detail::mpi_block({{&twenty, 1}}, 16) == 10);
  std::vector<float> send(20 * R), recv(20 * R, -1.f);
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < 20; ++i) send[20 * r + i] = static_cast<float>(tag(c.rank(), r, i));
  c.alltoall(send.data(), recv.data(), 20);
  int wrong = 0;
  for (int s = 0; s < R; ++s)
    for (int i = 0; i < 20; ++i)
      wrong += recv[20 * s + i] != static_cast<float>(tag(s, c.rank(), i));
  CHECK(wrong == 0);
  const index_t coprime[] = {17, 1};
  CHECK_THROWS_AS(epmoe::comm::detail::mpi_block({coprime}, 16), epmoe::comm_error);
}

TEST_CASE("mpi: the count conversion never truncates", "[mpi][large]") {
  using epmoe::comm::detail::mpi_block;
  const index_t G = index_t{1} << 31;  // INT_MAX + 1
  const index_t fits[] = {0, 1, INT_MAX};
  CHECK(mpi_block({fits}) == 1);
  // gcd 2^31 is itself too big for an int count: the block is 2^30, values 2 and 4 blocks.
  const index_t pow2[] = {G, 2 * G, 0};
  CHECK(mpi_block({pow2}) == G / 2);
  int out[3] = {};
  epmoe::comm::detail::mpi_to_int(pow2, G / 2, out);
  CHECK((out[0] == 2 && out[1] == 4 && out[2] == 0));
  // Several arrays share one block: rows of H = 4096 floats, 600k rows.
  const index_t n = index_t{600000} * 4096;
  const index_t rows[] = {n, 0}, displs[] = {0, n};
  const index_t b = mpi_block({rows, displs});
  CHECK(b > 1);
  CHECK(n % b == 0);
  CHECK(n / b <= INT_MAX);
  const index_t alone[] = {3 * G};
  CHECK(mpi_block({alone}) == 3 * G / 4);
  // No common block: G + 1 and 1 are coprime; a prime past INT_MAX has no usable divisor.
  const index_t coprime[] = {G + 1, 1};
  CHECK_THROWS_WITH(mpi_block({coprime}), Contains("exceeds MPI's int range"));
  const index_t prime[] = {2147483659};
  CHECK_THROWS_AS(mpi_block({prime}), epmoe::comm_error);
}

TEST_CASE("mpi: ialltoallv requests complete by wait, test or destruction", "[mpi][comm]") {
  mpi c(MPI_COMM_WORLD, 2);
  const int R = c.size(), me = c.rank();
  std::vector<index_t> counts(R, 2), displs(R);
  for (int r = 0; r < R; ++r) displs[r] = 2 * r;
  std::vector<std::int32_t> s1(2 * R), s2(2 * R), r1(2 * R, -1), r2(2 * R, -1), r3(2 * R, -1);
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < 2; ++i) {
      s1[2 * r + i] = tag(me, r, i);
      s2[2 * r + i] = tag(me, r, i + 2);
    }
  const auto* n = counts.data();
  const auto* d = displs.data();
  mpi::request a = c.ialltoallv(s1.data(), n, d, r1.data(), n, d);
  mpi::request b = c.ialltoallv(s2.data(), n, d, r2.data(), n, d);
  CHECK(a.pending());
  // Both slots are taken: a third exchange is refused on every rank, before any MPI call.
  CHECK_THROWS_WITH(c.ialltoallv(s1.data(), n, d, r3.data(), n, d), Contains("max_in_flight"));
  while (!b.test()) {
  }
  CHECK_FALSE(b.pending());
  mpi::request moved = std::move(a);
  CHECK_FALSE(a.pending());
  moved.wait();
  CHECK_FALSE(moved.pending());
  { mpi::request dropped = c.ialltoallv(s1.data(), n, d, r3.data(), n, d); }  // waits
  int wrong = 0;
  for (int s = 0; s < R; ++s)
    for (int i = 0; i < 2; ++i) {
      wrong += r1[2 * s + i] != tag(s, me, i);
      wrong += r2[2 * s + i] != tag(s, me, i + 2);
      wrong += r3[2 * s + i] != tag(s, me, i);
    }
  CHECK(wrong == 0);
}

TEST_CASE("mpi: a low-latency round of two parts: each message lands in its own part's receive",
          "[mpi][comm][low_latency]") {
  mpi c(MPI_COMM_WORLD);
  const int R = c.size(), me = c.rank();
  // Part 0: one int64 header per peer; part 1: up to 8 floats per peer, rank s sends s + 1
  // of them (shorter than the receive), as the low-latency dispatch sends heads and rows.
  constexpr index_t S = 8;
  std::vector<std::int64_t> head_send(R), head_recv(R, -1);
  std::vector<float> rows_send(R * S), rows_recv(R * S, -1.f);
  std::vector<index_t> hn(R, 1), hd(R), rn(R, S), rd(R), sn(R, me % S + 1);
  for (int r = 0; r < R; ++r) {
    hd[r] = r;
    rd[r] = r * S;
    head_send[r] = tag(me, r, 0);
    for (index_t i = 0; i < S; ++i) rows_send[r * S + i] = static_cast<float>(tag(me, r, i + 1));
  }
  const auto heads = [&] {
    c.post_at_most(head_send.data(), hn.data(), hd.data(), head_recv.data(), hn.data(), hd.data());
  };
  const auto rows = [&] {
    c.post_at_most(rows_send.data(), sn.data(), rd.data(), rows_recv.data(), rn.data(), rd.data());
  };
  heads();
  rows();
  // A third part is refused before any MPI call (every rank alike: nobody waits for it).
  CHECK_THROWS_WITH(heads(), Contains("at most 2 parts"));
  c.wait_at_most();
  int wrong = 0, checked = 0;
  for (int s = 0; s < R; ++s) {
    wrong += head_recv[s] != tag(s, me, 0);
    const index_t sent = s % S + 1;
    for (index_t i = 0; i < S; ++i, ++checked)
      wrong += rows_recv[s * S + i] != (i < sent ? static_cast<float>(tag(s, me, i + 1)) : -1.f);
  }
  CHECK(checked == R * S);
  CHECK(wrong == 0);
  // The round is complete: the next one posts again.
  std::fill(head_recv.begin(), head_recv.end(), -1);
  c.exchange_at_most(head_send.data(), hn.data(), hd.data(), head_recv.data(), hn.data(),
                     hd.data());
  for (int s = 0; s < R; ++s) CHECK(head_recv[s] == tag(s, me, 0));
}

TEST_CASE("mpi: a timed-out low-latency round cancels its receives: a late message lands nowhere",
          "[mpi][comm][low_latency]") {
  mpi c(MPI_COMM_WORLD);
  const int R = c.size(), me = c.rank();
  if (R < 2) {
    SUCCEED("needs two ranks");
    return;
  }
  c.set_timeout(0.2);
  constexpr index_t n = 4;
  constexpr float sentinel = -7.f;
  std::vector<index_t> sn(R, n), sd(R), rn(R, n), rd(R);
  for (int r = 0; r < R; ++r) sd[r] = rd[r] = r * n;
  std::vector<float> send(R * n, static_cast<float>(me)), recv(R * n, sentinel);
  // Rank 1 posts its round after every other rank timed out waiting for it.
  if (me == 1) std::this_thread::sleep_for(std::chrono::milliseconds(700));
  bool timed_out = false;
  try {
    c.exchange_at_most(send.data(), sn.data(), sd.data(), recv.data(), rn.data(), rd.data());
  } catch (const epmoe::comm_timeout&) {
    timed_out = true;
    std::fill(recv.begin(), recv.end(), sentinel);  // as if the caller reused the buffer
  }
  // Rank 1's messages are sent by now; a receive still posted would take them in here.
  MPI_Barrier(MPI_COMM_WORLD);
  for (int i = 0; i < 100; ++i) {
    int flag = 0;
    MPI_Iprobe(MPI_ANY_SOURCE, MPI_ANY_TAG, MPI_COMM_WORLD, &flag, MPI_STATUS_IGNORE);
  }
  MPI_Barrier(MPI_COMM_WORLD);
  if (me != 1) {
    CHECK(timed_out);
    CHECK(std::count(recv.begin(), recv.end(), sentinel) == R * n);
  }
}

// The low-latency exchange's windows: every rank's memory, written by stores, read after one
// meeting; none when built with windows = false (any rank's choice holds on every rank).
TEST_CASE("mpi: a shared window takes every rank's stores; the meeting orders them",
          "[mpi][comm][low_latency]") {
  mpi c(MPI_COMM_WORLD);
  const int R = c.size(), me = c.rank();
  constexpr int n = 1000;  // ints per writer
  const mpi::window w = c.open_window(static_cast<std::size_t>(R) * n * sizeof(int));
  REQUIRE(static_cast<int>(w.peers.size()) == R);
  for (int round = 0; round < 3; ++round) {
    {
      [[maybe_unused]] const auto writing = c.put();
      for (int r = 0; r < R; ++r) {
        int* at = reinterpret_cast<int*>(w.peers[r]) + me * n;
        for (int i = 0; i < n; ++i) at[i] = tag(me, r, i) + round;
      }
    }
    if (round == 1) {  // posted: nothing is read before the wait
      c.post_barrier();
      CHECK_THROWS_WITH(c.post_barrier(), Contains("already posted"));
      c.wait_barrier();
    } else {
      c.barrier();
    }
    const int* mine = reinterpret_cast<const int*>(w.peers[me]);
    int wrong = 0, checked = 0;
    for (int s = 0; s < R; ++s)
      for (int i = 0; i < n; ++i, ++checked) wrong += mine[s * n + i] != tag(s, me, i) + round;
    CHECK(checked == R * n);
    CHECK(wrong == 0);
    c.barrier();  // every rank read before the next round writes
  }
  CHECK(c.posted(epmoe::exchange_level::all) == 0);  // stores, not messages

  // One rank without windows: none anywhere (the caller sends messages instead).
  mpi d(MPI_COMM_WORLD, 8, me != R - 1);
  CHECK(d.open_window(64).peers.empty());
}

TEST_CASE("mpi: a rank that never meets makes the others' barrier time out; puts are refused after",
          "[mpi][comm][low_latency][timeout]") {
  mpi c(MPI_COMM_WORLD);
  const int R = c.size(), me = c.rank();
  if (R < 2) {
    SUCCEED("needs two ranks");
    return;
  }
  const mpi::window w = c.open_window(sizeof(int));
  c.set_timeout(0.2);
  const auto t0 = std::chrono::steady_clock::now();
  bool timed_out = false;
  if (me != 1) {
    try {
      c.barrier();
    } catch (const epmoe::comm_timeout&) {
      timed_out = true;
    }
    const double waited =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    CHECK(timed_out);
    CHECK(waited < 5);
    CHECK(c.broken());
    CHECK_THROWS_AS(c.put(), epmoe::comm_timeout);  // a broken comm writes nothing
    c.abort("timed out in the test");
  } else {
    std::this_thread::sleep_for(std::chrono::milliseconds(600));
    // The peers gave up and told this rank: its late put is refused, nothing is written.
    bool refused = false;
    for (int i = 0; i < 1000 && !refused; ++i) {  // (up to 5 s: a loaded machine's skew)
      try {
        (void)c.put();
        std::this_thread::sleep_for(std::chrono::milliseconds(5));
      } catch (const epmoe::comm_aborted&) {
        refused = true;
      } catch (const epmoe::comm_timeout&) {
        refused = true;
      }
    }
    CHECK(refused);
  }
  MPI_Barrier(MPI_COMM_WORLD);  // (the window stays: a broken comm never frees it)
}

TEST_CASE("mpi: a failing MPI call throws comm_error with the call and MPI's text",
          "[mpi][errors]") {
  mpi c(MPI_COMM_WORLD);
  float x = 0, y = 0;
  // Every rank passes the same invalid count, so MPI rejects it on every rank before any
  // communication: nobody is left waiting.
  CHECK_THROWS_WITH(c.alltoall(&x, &y, -1), Contains("MPI_Ialltoall") && Contains("count"));
  CHECK_THROWS_WITH(epmoe::comm::detail::mpi_check(MPI_ERR_TRUNCATE, "MPI_Recv"),
                    Contains("MPI_Recv failed with code") && Contains("truncat"));
  // The communicator still works after a rejected call.
  uneven_exchange<float>(c, 1, 1);
}

TEST_CASE("mpi: agree_on passes when ranks agree and fails on every rank when one differs",
          "[mpi][agreement]") {
  mpi c(MPI_COMM_WORLD);
  const int R = c.size(), me = c.rank();
  const epmoe::agreement_field same[] = {{"hidden", 64}, {"experts", 8}};
  CHECK_NOTHROW(epmoe::agree_on(c, std::span<const epmoe::agreement_field>(same)));
  if (R < 2) return;  // every rank takes this branch: the group stays in step
  const epmoe::agreement_field odd[] = {{"hidden", 64}, {"experts", me == R - 1 ? 9 : 8}};
  std::string got = "no error";
  try {
    epmoe::agree_on(c, std::span<const epmoe::agreement_field>(odd));
  } catch (const epmoe::config_error& e) {
    got = e.field() + " = " + e.value();
  }
  CHECK(got == "experts = rank 0: 8, rank " + std::to_string(R - 1) + ": 9");
}
