// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
#pragma once

// Include only when linking epmoe::mpi (it brings <mpi.h> and the MPI library, through
// mpi_runtime.hpp).

#include <algorithm>
#include <chrono>
#include <climits>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <initializer_list>
#include <memory>
#include <numeric>
#include <span>
#include <string>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include "epmoe/comm/mpi_runtime.hpp"
#include "epmoe/core/error.hpp"
#include "epmoe/core/transport.hpp"
#include "epmoe/core/view.hpp"

namespace epmoe::comm {

/// Expert-parallel ranks as the processes of an MPI communicator. Collective: every rank
/// calls the same sequence of exchanges. Counts and displacements are in elements (int64);
/// exchanges past INT_MAX elements go in larger units (see detail::mpi_block). Every MPI
/// failure throws comm_error with the call and MPI's error text.
///
/// The communicator is duplicated at construction (collective), so that the layer's
/// exchanges never match the caller's own collectives and its error handler
/// (MPI_ERRORS_RETURN) leaves the caller's communicator untouched. The duplicate is freed by
/// the destructor, which must run before MPI_Finalize (e.g. before mpi_session ends).
///
/// Nodes: the ranks that share memory (MPI_Comm_split_type, MPI_COMM_TYPE_SHARED), unless
/// the environment variable EPMOE_RANKS_PER_NODE = G (a positive integer dividing the size)
/// pretends nodes of G consecutive ranks (rank r on node r / G), e.g. to run a hierarchical
/// layer on one machine. Every rank must read the same value: a bad or differing one throws
/// config_error on every rank. See ranks_per_node(), node_comm() and cross_comm().
///
/// No exchange waits forever: every one is posted non-blocking and waited for in a loop
/// that also watches (a) a deadline (set_timeout; on expiry comm_timeout names the call) and
/// (b) abort messages: a rank that fails mid-pass calls abort(why), which sends its text to
/// every peer on the duplicate, and a peer's waiting exchange throws comm_aborted naming
/// that rank. MPI cannot cancel a collective: after either the comm is unusable (every call
/// throws the same error again) and the process should end; see docs/reliability.md.
class mpi {
 public:
  class request;
  class window;     // mpi_window.hpp
  class put_guard;  // mpi_window.hpp
  /// Parts one low-latency round may have (post_at_most).
  static constexpr int at_most_parts = 2;

  /// `max_in_flight`: how many ialltoallv may be pending at once (their int counts are kept
  /// in slots allocated here, so posting allocates nothing). 8: a pipelined hierarchical pass
  /// holds up to 5 (chunk c+1's rows, masks and metadata; the combines of c-1 and c), and a
  /// backward adds its gradient exchanges. `windows`: false makes open_window() open none
  /// (the low-latency exchange then sends messages, as across nodes).
  explicit mpi(MPI_Comm comm, int max_in_flight = 8, bool windows = true) : windows_(windows) {
    if (max_in_flight < 0)
      throw config_error("max_in_flight", std::to_string(max_in_flight), "must be >= 0");
    detail::mpi_check(MPI_Comm_dup(comm, &comm_), "MPI_Comm_dup");
    try {  // the destructor will not run: free what was made
      detail::mpi_check(MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN),
                        "MPI_Comm_set_errhandler");
      detail::mpi_check(MPI_Comm_rank(comm_, &rank_), "MPI_Comm_rank");
      detail::mpi_check(MPI_Comm_size(comm_, &size_), "MPI_Comm_size");
      find_nodes();
      // Slot 0 serves the blocking calls; slots 1.. the pending non-blocking ones.
      ints_.resize(8 * static_cast<std::size_t>(size_) * (1 + max_in_flight));
      busy_.resize(static_cast<std::size_t>(max_in_flight));
      p2p_.resize(2 * at_most_parts * static_cast<std::size_t>(size_));
      // A receive for a peer's abort message, pending for the comm's life.
      state_ = std::make_shared<failure>();
      detail::mpi_check(MPI_Irecv(state_->inbox, sizeof state_->inbox, MPI_CHAR, MPI_ANY_SOURCE,
                                  abort_tag, comm_, &state_->listen),
                        "MPI_Irecv");
    } catch (...) {
      release();
      throw;
    }
  }

  mpi(mpi&& o) noexcept
      : comm_(std::exchange(o.comm_, MPI_COMM_NULL)),
        node_(std::exchange(o.node_, MPI_COMM_NULL)),
        cross_(std::exchange(o.cross_, MPI_COMM_NULL)),
        rank_(o.rank_),
        size_(o.size_),
        ranks_per_node_(o.ranks_per_node_),
        int_limit_(o.int_limit_),
        ints_(std::move(o.ints_)),
        busy_(std::move(o.busy_)),
        p2p_(std::move(o.p2p_)),
        p2p_posted_(std::exchange(o.p2p_posted_, 0)),
        barrier_(std::exchange(o.barrier_, MPI_REQUEST_NULL)),
        windows_(o.windows_),
        state_(std::move(o.state_)),
        timeout_(o.timeout_) {}
  mpi& operator=(mpi&& o) noexcept {
    if (this != &o) {
      release();
      comm_ = std::exchange(o.comm_, MPI_COMM_NULL);
      node_ = std::exchange(o.node_, MPI_COMM_NULL);
      cross_ = std::exchange(o.cross_, MPI_COMM_NULL);
      rank_ = o.rank_;
      size_ = o.size_;
      ranks_per_node_ = o.ranks_per_node_;
      int_limit_ = o.int_limit_;
      ints_ = std::move(o.ints_);
      busy_ = std::move(o.busy_);
      p2p_ = std::move(o.p2p_);
      p2p_posted_ = std::exchange(o.p2p_posted_, 0);
      barrier_ = std::exchange(o.barrier_, MPI_REQUEST_NULL);
      windows_ = o.windows_;
      state_ = std::move(o.state_);
      timeout_ = o.timeout_;
    }
    return *this;
  }
  mpi(const mpi&) = delete;
  mpi& operator=(const mpi&) = delete;
  ~mpi() { release(); }

  int rank() const { return rank_; }
  int size() const { return size_; }
  /// The duplicated communicator the exchanges run on.
  MPI_Comm native() const { return comm_; }

  /// G when every node holds G consecutive ranks (rank = node * G + index in the node), else
  /// 0; the same on every rank. The layer's ranks_per_node when its config's is 0.
  int ranks_per_node() const { return ranks_per_node_; }
  /// This rank's node: its ranks in rank order (the second level of a hierarchical exchange).
  MPI_Comm node_comm() const { return node_; }
  /// The ranks with this rank's index in their node, one per node, in rank order (the first
  /// level). Neither has an abort listener or a deadline of its own: exchanges posted there
  /// are to be waited for through this comm, which watches both.
  MPI_Comm cross_comm() const { return cross_; }

  /// Fixed-size all-to-all (MPI_Alltoall): n elements to every rank, block r of send to rank r.
  template <class T>
  void alltoall(const T* send, T* recv, index_t n) {
    const index_t block = detail::mpi_block({{&n, 1}}, int_limit_);
    const detail::mpi_block_type<T> type(block);
    const int count = static_cast<int>(n / block);
    usable();
    MPI_Request req = MPI_REQUEST_NULL;
    detail::mpi_check(MPI_Ialltoall(send, count, type.get(), recv, count, type.get(), comm_, &req),
                      "MPI_Ialltoall");
    wait_for(req, "MPI_Ialltoall");
  }

  /// All-to-all-v (MPI_Alltoallv); counts and displacements per rank, in elements. The
  /// receive counts must match what each peer sends (normally from a preceding alltoall).
  /// With a level (exchange_level::node / cross, ranks_per_node() > 0): the exchange reaches
  /// only that level's ranks and runs on node_comm() / cross_comm(); a count outside it throws
  /// comm_error. Every rank of the level must post it at that level.
  template <class T>
  void alltoallv(const T* send, const index_t* send_counts, const index_t* send_displs, T* recv,
                 const index_t* recv_counts, const index_t* recv_displs,
                 exchange_level level = exchange_level::all) {
    int* c = ints_.data();
    const detail::mpi_block_type<T> type(
        to_ints(send_counts, send_displs, recv_counts, recv_displs, c));
    usable();
    int n = size_;
    const MPI_Comm on = at_level(level, c, n);
    MPI_Request req = MPI_REQUEST_NULL;
    detail::mpi_check(MPI_Ialltoallv(send, c, c + n, type.get(), recv, c + 2 * n, c + 3 * n,
                                     type.get(), on, &req),
                      "MPI_Ialltoallv");
    wait_for(req, "MPI_Ialltoallv");
  }
  /// One round of point-to-point messages (the low-latency exchange's fixed slots): to each
  /// rank r send_n[r] elements from send + send_d[r]; from each rank r at most recv_n[r]
  /// elements into recv + recv_d[r]. A point-to-point receive may be longer than its message
  /// (a collective's may not), so a slot moves only its used rows and no counts round comes
  /// first. Waited under the deadline and the peers' aborts, as the collectives.
  template <class T>
  void exchange_at_most(const T* send, const index_t* send_n, const index_t* send_d, T* recv,
                        const index_t* recv_n, const index_t* recv_d) {
    post_at_most(send, send_n, send_d, recv, recv_n, recv_d);
    wait_at_most();
  }
  /// The same round, posted: wait_at_most() completes it (one round in flight per comm; its
  /// buffers stay in use until then). A split start posts its dispatch so. A round may have
  /// up to at_most_parts parts, each posted by its own call before the wait (the slots'
  /// heads and their rows, sent from where each lies: no copy into a send slot). Every rank
  /// posts the parts in the same order; part i has its own tag, so its messages match only
  /// part i's receives.
  template <class T>
  void post_at_most(const T* send, const index_t* send_n, const index_t* send_d, T* recv,
                    const index_t* recv_n, const index_t* recv_d) {
    usable();
    if (p2p_posted_ == at_most_parts)
      throw comm_error("epmoe: comm::mpi: a low-latency round holds at most " +
                       std::to_string(at_most_parts) +
                       " parts: wait for it (wait_at_most) before the next");
    const auto bytes = [&](index_t n) {
      const index_t b = n * static_cast<index_t>(sizeof(T));
      if (b > int_limit_)
        throw comm_error("epmoe: comm::mpi: a low-latency slot of " + std::to_string(b) +
                         " bytes exceeds the int limit of one message");
      return static_cast<int>(b);
    };
    MPI_Request* q = p2p_.data() + 2 * size_ * p2p_posted_;
    const int tag = slot_tag + p2p_posted_;
    for (int r = 0; r < size_; ++r)
      detail::mpi_check(
          MPI_Irecv(recv + recv_d[r], bytes(recv_n[r]), MPI_BYTE, r, tag, comm_, q + r),
          "MPI_Irecv");
    for (int r = 0; r < size_; ++r)
      detail::mpi_check(
          MPI_Isend(send + send_d[r], bytes(send_n[r]), MPI_BYTE, r, tag, comm_, q + size_ + r),
          "MPI_Isend");
    ++p2p_posted_;
    ++posted_[0];
  }
  /// Completes the posted round (none posted: returns), under the deadline and the peers'
  /// aborts.
  void wait_at_most() {
    const int parts = std::exchange(p2p_posted_, 0);
    if (parts == 0) return;
    try {
      wait_all(p2p_.data(), 2 * size_ * parts, "MPI_Isend/MPI_Irecv of the low-latency slots");
    } catch (const comm_error&) {
      // A late peer's message must not land in a buffer the caller frees after this throw:
      // the round's receives are cancelled (a cancelled receive completes locally).
      for (int part = 0; part < parts; ++part)
        for (MPI_Request& q : std::span(p2p_).subspan(2 * size_ * part, size_))
          if (q != MPI_REQUEST_NULL) {
            MPI_Cancel(&q);
            MPI_Wait(&q, MPI_STATUS_IGNORE);
          }
      throw;
    }
  }

  /// `bytes` of shared memory for this rank that every rank writes into (the low-latency
  /// exchange's puts; collective): one MPI_Win_allocate_shared window. Empty (no peers) when
  /// the ranks do not all share one node's memory, or a rank's comm was built with
  /// windows = false. See mpi_window.hpp.
  window open_window(std::size_t bytes);
  /// Held while this rank writes into peers' windows: refused (throws) once this comm failed
  /// or a peer's abort message arrived.
  [[nodiscard]] put_guard put();
  /// Meets every rank (MPI_Ibarrier, under the deadline and the peers' aborts); orders the
  /// writes into windows before it ahead of the peers' reads after it.
  void barrier();
  /// The same meeting, posted: wait_barrier() completes it (one posted at a time).
  void post_barrier();
  void wait_barrier();

  /// Exchanges posted at each level so far (all, node, cross): all-to-alls, and the parts of
  /// low-latency rounds (not meetings: a window's rows move by stores).
  long posted(exchange_level level) const { return posted_[static_cast<int>(level)]; }

  /// Seconds an exchange may wait for its peers before it throws comm_timeout (0: no limit,
  /// the default of the comm; the layer sets layer_config::exchange_timeout).
  void set_timeout(double seconds) {
    if (!(seconds >= 0) || seconds > 1e9)
      throw config_error("exchange_timeout", std::to_string(seconds),
                         "must be >= 0 seconds (0: no limit) and finite");
    timeout_ = seconds;
  }
  double timeout() const { return timeout_; }

  /// Tells every peer that this rank failed mid-pass (why: its error's text, cut to 400
  /// bytes): their waiting exchanges throw comm_aborted naming this rank (comm_timeout when
  /// this rank's own failure was a timeout). Local and non-blocking; this comm is unusable
  /// afterwards. Only the first call sends.
  void abort(const std::string& why) {
    if (!state_ || !state_->outbox.empty()) return;
    // The first byte says which: 'T' a timeout, 'A' any other failure.
    state_->outbox.assign(1, state_->timed_out ? 'T' : 'A');
    state_->outbox.append(why, 0, 400);
    state_->outbox.push_back('\0');
    for (int r = 0; r < size_; ++r) {
      if (r == rank_) continue;
      MPI_Request req = MPI_REQUEST_NULL;
      // The outbox lives as long as this comm: the sends complete without a wait.
      if (MPI_Isend(state_->outbox.data(), static_cast<int>(state_->outbox.size()), MPI_CHAR, r,
                    abort_tag, comm_, &req) == MPI_SUCCESS)
        MPI_Request_free(&req);
    }
    if (state_->error.empty()) {
      state_->error = "epmoe: comm::mpi: this rank aborted the exchanges: " + why;
      state_->origin = rank_;
    }
  }

  /// Whether an exchange failed (timeout or abort): every later call throws that error.
  bool broken() const { return state_ && !state_->error.empty(); }

  /// Non-blocking alltoallv (MPI_Ialltoallv) for pipelined schedules: same arguments; the
  /// buffers must stay untouched until the returned request's wait() (or its destructor).
  template <class T>
  request ialltoallv(const T* send, const index_t* send_counts, const index_t* send_displs, T* recv,
                     const index_t* recv_counts, const index_t* recv_displs,
                     exchange_level level = exchange_level::all);

 private:
  friend struct detail::mpi_test_access;

  static constexpr int abort_tag = 0x4550;  // "EP": the abort messages' tag on the duplicate
  static constexpr int slot_tag = 0x4551;   // exchange_at_most's messages (+ the part)

  // What a failure leaves: the pending receive for a peer's abort message, what this rank
  // sent, and the error every later call throws. On the heap: MPI holds their addresses.
  struct failure {
    MPI_Request listen = MPI_REQUEST_NULL;
    char inbox[512] = {};
    std::string outbox;
    std::string error;  // empty: usable
    int origin = -1;
    bool timed_out = false;
  };

  void release() noexcept {
    int finalized = 1;
    MPI_Finalized(&finalized);
    if (!finalized && state_ && state_->listen != MPI_REQUEST_NULL) {
      MPI_Cancel(&state_->listen);
      MPI_Wait(&state_->listen, MPI_STATUS_IGNORE);
    }
    for (MPI_Comm* c : {&cross_, &node_, &comm_}) {
      if (*c != MPI_COMM_NULL && !finalized) MPI_Comm_free(c);
      *c = MPI_COMM_NULL;
    }
  }

  // node_, cross_ and ranks_per_node_ (collective on comm_). Each rank reads its own
  // environment: the ranks agree on the value before any acts on it, so that one with another
  // value throws with the others instead of leaving them waiting in a split.
  void find_nodes() {
    std::string value, rule;
    const int pretend = detail::env_ranks_per_node(size_, value, rule);
    int range[2] = {pretend, -pretend};  // max and -min over the ranks
    detail::mpi_check(MPI_Allreduce(MPI_IN_PLACE, range, 2, MPI_INT, MPI_MAX, comm_),
                      "MPI_Allreduce");
    if (pretend < 0) throw config_error("EPMOE_RANKS_PER_NODE", value, rule);
    if (range[0] != -range[1])
      throw config_error("EPMOE_RANKS_PER_NODE", value.empty() ? "(unset)" : value,
                         "must be the same on every rank (another rank read a different or "
                         "invalid value)");
    if (pretend > 0)
      detail::mpi_check(MPI_Comm_split(comm_, rank_ / pretend, rank_, &node_), "MPI_Comm_split");
    else
      detail::mpi_check(
          MPI_Comm_split_type(comm_, MPI_COMM_TYPE_SHARED, rank_, MPI_INFO_NULL, &node_),
          "MPI_Comm_split_type");
    int local = 0, count = 1, first = rank_;
    detail::mpi_check(MPI_Comm_rank(node_, &local), "MPI_Comm_rank");
    detail::mpi_check(MPI_Comm_size(node_, &count), "MPI_Comm_size");
    detail::mpi_check(MPI_Allreduce(MPI_IN_PLACE, &first, 1, MPI_INT, MPI_MIN, node_),
                      "MPI_Allreduce");
    detail::mpi_check(MPI_Comm_split(comm_, local, rank_, &cross_), "MPI_Comm_split");
    // One number names the layout only when nodes are blocks of G consecutive ranks. A
    // launcher may place ranks otherwise (nodes of different sizes, or round-robin over the
    // hosts, so a node's ranks are not consecutive): then 0, and the layer takes all ranks
    // as one node unless layer_config::ranks_per_node says otherwise.
    int shape[3] = {count, -count, rank_ == first + local ? 0 : 1};
    detail::mpi_check(MPI_Allreduce(MPI_IN_PLACE, shape, 3, MPI_INT, MPI_MAX, comm_),
                      "MPI_Allreduce");
    ranks_per_node_ = shape[0] == -shape[1] && shape[2] == 0 ? count : 0;
  }

  // Throws the error of an earlier failure.
  void usable() const {
    if (!broken()) return;
    if (state_->timed_out) throw comm_timeout(state_->error);
    throw comm_aborted(state_->error, state_->origin);
  }

  // Completes req, watching the deadline and the peers' abort messages. On either the comm
  // is broken (a collective cannot be cancelled: req stays with MPI) and the error thrown.
  void wait_for(MPI_Request& req, const char* call) { wait_all(&req, 1, call); }
  // The same for n requests (exchange_at_most's point-to-point ones).
  void wait_all(MPI_Request* reqs, int n, const char* call) {
    const auto start = std::chrono::steady_clock::now();
    bool patient = false;  // waited past spin_seconds: sleep between polls
    for (int i = 0;; ++i) {
      int flag = 0;
      detail::mpi_check(MPI_Testall(n, reqs, &flag, MPI_STATUSES_IGNORE), "MPI_Testall");
      if (flag) return;
      if (i % 16 == 0) {
        check_peers();
        const double waited =
            std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
        patient = waited > spin_seconds;
        if (timeout_ > 0 && waited > timeout_) {
          char secs[32];
          std::snprintf(secs, sizeof secs, "%g", timeout_);
          state_->error = "epmoe: comm::mpi: rank " + std::to_string(rank_) + ": " + call +
                          " did not complete within " + secs +
                          " s (exchange_timeout): a peer rank stalled, crashed or called "
                          "another collective (MPI cannot tell which); end the job";
          state_->timed_out = true;
          usable();
        }
      }
      // A decode step's rounds last microseconds, and a 20 us sleep wakes 60-100 us later on a
      // loaded machine (3x a T = 1 step's time on 2 processes): for the first spin_seconds
      // the wait yields the core to runnable threads between polls; past that, it sleeps.
      if (patient)
        std::this_thread::sleep_for(std::chrono::microseconds(20));
      else if (i > 256)
        std::this_thread::yield();
    }
  }

  // Throws comm_aborted when a peer's abort message arrived.
  void check_peers() {
    if (!state_ || state_->listen == MPI_REQUEST_NULL) return;
    int flag = 0;
    MPI_Status status;
    detail::mpi_check(MPI_Test(&state_->listen, &flag, &status), "MPI_Test");
    if (!flag) return;
    state_->inbox[sizeof state_->inbox - 1] = '\0';
    state_->origin = status.MPI_SOURCE;
    state_->timed_out = state_->inbox[0] == 'T';
    state_->error = "epmoe: rank " + std::to_string(status.MPI_SOURCE) +
                    (state_->timed_out ? " timed out: " : " failed mid-pass: ") +
                    std::string(state_->inbox + 1);
    usable();
  }

  // The four arrays as ints, in one common unit, into out[0, 4R); returns the unit. Peers may
  // pick different units: MPI matches type signatures (n floats), not datatypes.
  // The communicator of `level` (all ranks without nodes), with the 4R counts and
  // displacements at c moved to the level's n ranks, in its rank order (c then points there:
  // the slot's second half).
  MPI_Comm at_level(exchange_level level, int*& c, int& n) {
    n = size_;
    posted_[static_cast<int>(
        level == exchange_level::all || ranks_per_node_ == 0 ? exchange_level::all : level)] += 1;
    if (level == exchange_level::all || ranks_per_node_ == 0) return comm_;
    const int R = size_, G = ranks_per_node_, node = rank_ / G, local = rank_ % G;
    const bool in_node = level == exchange_level::node;
    n = in_node ? G : R / G;
    int* out = c + 4 * R;
    std::fill(out, out + 4 * n, 0);
    for (int p = 0; p < R; ++p) {
      const bool inside = in_node ? p / G == node : p % G == local;
      if (inside) {
        const int i = in_node ? p % G : p / G;
        for (int a = 0; a < 4; ++a) out[a * n + i] = c[a * R + p];
      } else if (c[p] != 0 || c[2 * R + p] != 0) {
        throw comm_error("epmoe: comm::mpi: an exchange posted on " +
                         std::string(in_node ? "this rank's node" : "its cross-node peers") +
                         " moves rows with rank " + std::to_string(p) + ", outside it");
      }
    }
    c = out;
    return in_node ? node_ : cross_;
  }

  index_t to_ints(const index_t* sc, const index_t* sd, const index_t* rc, const index_t* rd,
                  int* out) const {
    const std::size_t R = static_cast<std::size_t>(size_);
    const std::span<const index_t> parts[4] = {{sc, R}, {sd, R}, {rc, R}, {rd, R}};
    const index_t block = detail::mpi_block({parts[0], parts[1], parts[2], parts[3]}, int_limit_);
    for (std::size_t i = 0; i < 4; ++i) detail::mpi_to_int(parts[i], block, out + i * R);
    return block;
  }

  MPI_Comm comm_ = MPI_COMM_NULL;
  MPI_Comm node_ = MPI_COMM_NULL;   // this rank's node
  MPI_Comm cross_ = MPI_COMM_NULL;  // one rank per node: those of this rank's local index
  int rank_ = 0;
  int size_ = 1;
  int ranks_per_node_ = 0;
  index_t int_limit_ = INT_MAX;
  std::vector<int> ints_;  // 8R ints per slot: counts, displs (send, then receive); then the
                           //   same for the ranks of one level
  long posted_[3] = {0, 0, 0};
  std::vector<unsigned char> busy_;         // one flag per non-blocking slot
  std::vector<MPI_Request> p2p_;            // a low-latency round's 2R requests per part
  int p2p_posted_ = 0;                      // parts posted, waiting for wait_at_most
  MPI_Request barrier_ = MPI_REQUEST_NULL;  // a posted barrier (post_barrier)
  bool windows_ = true;                     // open_window may open one
  std::shared_ptr<failure> state_;          // shared with the windows (whose free it may skip)
  double timeout_ = 0;
  static constexpr double spin_seconds = 2e-3;  // a wait polls without sleeping this long
};

}  // namespace epmoe::comm

#include "epmoe/comm/mpi_request.hpp"
#include "epmoe/comm/mpi_window.hpp"
