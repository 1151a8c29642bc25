// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <exception>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include "epmoe/core/error.hpp"
#include "epmoe/core/view.hpp"

namespace epmoe::comm {

class threads;

/// R ranks as threads of one process, exchanging rows through shared memory.
/// The world is an explicit object (no global state); `run` starts one thread per rank and
/// hands each its `comm::threads` endpoint. If a rank throws (or calls threads::abort), the
/// others are released from any exchange with `comm_aborted` naming it and its error, and
/// `run` rethrows the first real error. With a timeout (set_timeout), a rank that waits
/// longer than that for its peers throws `comm_timeout` naming the ranks that did not arrive,
/// and so do the other waiting ranks.
class threads_world {
 public:
  /// `ranks_per_node` > 0 emulates nodes of that many consecutive ranks (issue 24): the
  /// ranks' comm::threads report it, and a layer with options.hierarchical exchanges in two
  /// levels without the config naming them.
  explicit threads_world(int ranks, int ranks_per_node = 0)
      : ranks_(ranks), per_node_(ranks_per_node), slots_(static_cast<std::size_t>(ranks)) {
    if (ranks < 1) throw config_error("ranks", std::to_string(ranks), "must be >= 1");
    if (ranks_per_node < 0 || (ranks_per_node > 0 && ranks % ranks_per_node != 0))
      throw config_error("ranks_per_node", std::to_string(ranks_per_node),
                         "must be 0 (one node) or divide ranks (" + std::to_string(ranks) + ")");
  }
  threads_world(const threads_world&) = delete;
  threads_world& operator=(const threads_world&) = delete;

  int size() const { return ranks_; }
  int ranks_per_node() const { return per_node_; }

  /// Runs fn(comm::threads) on `size()` threads, one per rank, and joins them.
  template <class Fn>
  void run(Fn&& fn);

  /// Makes a world that failed usable again, between runs (no rank inside an exchange): for
  /// callers that recover from an error every rank saw, e.g. inputs the layer rejected.
  void reset() {
    std::lock_guard lock(mutex_);
    aborted_ = failed_ = timed_out_ = false;
    why_.clear();
    origin_ = -1;
    waiting_ = 0;
    std::fill(arrived_.begin(), arrived_.end(), 0);
  }

  /// Seconds a rank may wait in an exchange for the others (0: no limit), for every rank.
  void set_timeout(double seconds) {
    if (!(seconds >= 0) || seconds > 1e9)
      throw config_error("exchange_timeout", std::to_string(seconds),
                         "must be >= 0 seconds (0: no limit) and finite");
    std::lock_guard lock(mutex_);
    timeout_ = seconds;
  }

 private:
  friend class threads;

  // The world of the ranks that survive `lost` (threads::exclude): made by the first survivor
  // that asks, found by the others; the survivors' endpoints keep it alive.
  std::shared_ptr<threads_world> survivors(const std::vector<char>& lost) {
    std::lock_guard lock(mutex_);
    for (auto& [mask, w] : children_)
      if (mask == lost) return w;
    const int n = static_cast<int>(std::count(lost.begin(), lost.end(), 0));
    auto w = std::make_shared<threads_world>(n);
    w->timeout_ = timeout_;
    children_.emplace_back(lost, w);
    return w;
  }

  // What a rank publishes for one exchange: its send buffer and per-peer counts/displs.
  struct slot {
    const void* send = nullptr;
    const index_t* counts = nullptr;
    const index_t* displs = nullptr;
    std::size_t elem_size = 0;
  };

  // A barrier that can be broken: waiting ranks throw comm_aborted instead of hanging, and
  // comm_timeout past the deadline (then the world is aborted: every rank learns it).
  // A waiter spins a few microseconds before it sleeps when every rank has a core of its
  // own: waking a sleeping thread costs 30-80 us on a VM, two per exchange, which would
  // price a counts exchange like a megabyte of rows. Oversubscribed, it sleeps at once.
  void barrier(int rank) {
    const auto entered = std::chrono::steady_clock::now();
    std::unique_lock lock(mutex_);
    if (aborted_) leave(lock);
    const std::uint64_t gen = generation_.load(std::memory_order_relaxed);
    arrived_[static_cast<std::size_t>(rank)] = 1;
    if (++waiting_ == ranks_) {
      waiting_ = 0;
      std::fill(arrived_.begin(), arrived_.end(), 0);
      generation_.store(gen + 1, std::memory_order_release);
      cv_.notify_all();
      return;
    }
    if (spin_) {
      lock.unlock();
      const auto until = std::chrono::steady_clock::now() + spin_time;
      for (int i = 1;; ++i) {
        if (generation_.load(std::memory_order_acquire) != gen) return;
        if (i % 64 == 0 && std::chrono::steady_clock::now() > until) break;
        pause();
      }
      lock.lock();
    }
    const auto released = [&] {
      return generation_.load(std::memory_order_relaxed) != gen || aborted_;
    };
    if (timeout_ > 0) {
      const auto deadline = entered + std::chrono::duration_cast<std::chrono::nanoseconds>(
                                          std::chrono::duration<double>(timeout_));
      if (!cv_.wait_until(lock, deadline, released)) time_out(rank, lock);
    } else {
      cv_.wait(lock, released);
    }
    if (generation_.load(std::memory_order_relaxed) == gen) leave(lock);
  }

  // Under the lock: rank waited past the deadline. Aborts the world with the ranks that did
  // not arrive, and throws comm_timeout.
  [[noreturn]] void time_out(int rank, std::unique_lock<std::mutex>& lock) {
    std::string missing;
    for (int r = 0; r < ranks_; ++r)
      if (!arrived_[static_cast<std::size_t>(r)])
        missing += (missing.empty() ? "" : ", ") + std::to_string(r);
    char secs[32];
    std::snprintf(secs, sizeof secs, "%g", timeout_);
    abort_locked(-1,
                 "epmoe: comm::threads: rank " + std::to_string(rank) + " waited " + secs +
                     " s (exchange_timeout) for rank(s) " + missing +
                     ", which did not reach the exchange: a rank stalled, or ranks called "
                     "different sequences of collectives",
                 true);
    leave(lock);
  }

  // Under the lock, the world aborted: returns once no rank is writing into a peer's window
  // (put), so no late write lands in a buffer whose owner has gone on.
  void drain(std::unique_lock<std::mutex>& lock) {
    cv_.wait(lock, [&] { return putting_ == 0; });
  }
  // ... and this rank leaves the exchange.
  [[noreturn]] void leave(std::unique_lock<std::mutex>& lock) {
    drain(lock);
    throw_abort();
  }

  // A put into peers' windows (threads::put_guard): refused once the world aborted.
  void begin_put() {
    std::unique_lock lock(mutex_);
    if (aborted_) leave(lock);
    ++putting_;
  }
  void end_put() {
    std::lock_guard lock(mutex_);
    if (--putting_ == 0) cv_.notify_all();
  }

  [[noreturn]] void throw_abort() const {
    if (timed_out_) throw comm_timeout(why_);
    if (why_.empty()) throw comm_aborted();
    throw comm_aborted(why_, origin_);
  }

  static void pause() {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    asm volatile("yield");
#endif
  }

  // Rank `origin` failed (why: its error): every rank waiting, or arriving later, throws.
  // The first reason is kept. Returns once no put is in flight: the caller may then free what
  // its peers write into.
  void abort(int origin, const std::string& why) {
    std::unique_lock lock(mutex_);
    abort_locked(
        origin,
        origin < 0 ? why : "epmoe: rank " + std::to_string(origin) + " failed mid-pass: " + why,
        false);
    drain(lock);
  }
  void abort_locked(int origin, std::string why, bool timed_out) {
    if (!aborted_) {
      aborted_ = true;
      origin_ = origin;
      why_ = std::move(why);
      timed_out_ = timed_out;
    }
    cv_.notify_all();
  }

  // Marks the current exchange as failed; every rank throws once it has left it.
  void fail() {
    std::lock_guard lock(mutex_);
    failed_ = true;
  }
  bool failed() {
    std::lock_guard lock(mutex_);
    return failed_;
  }

  int ranks_;
  int per_node_ = 0;  // emulated nodes (0: none)
  std::vector<slot> slots_;
  std::mutex mutex_;
  std::condition_variable cv_;
  int waiting_ = 0;
  int putting_ = 0;                           // ranks inside a put_guard
  std::atomic<std::uint64_t> generation_{0};  // written under mutex_; read by spinners
  // Spin before sleeping only when every rank can have a core.
  bool spin_ = ranks_ > 1 && static_cast<unsigned>(ranks_) <= std::thread::hardware_concurrency();
  static constexpr std::chrono::microseconds spin_time{50};
  bool aborted_ = false;
  bool failed_ = false;
  bool timed_out_ = false;  // the abort was a deadline's
  int origin_ = -1;         // the rank that failed, or -1
  std::string why_;
  double timeout_ = 0;  // seconds; 0: none
  std::vector<char> arrived_ = std::vector<char>(static_cast<std::size_t>(ranks_));
  std::vector<std::pair<std::vector<char>, std::shared_ptr<threads_world>>> children_;
};

/// One rank's endpoint in a threads_world. Exchanges are collective: every rank calls the
/// same sequence. Rows are pulled by the receiver straight from the sender's buffer, so an
/// exchange costs one copy.
class threads {
 public:
  class request;

  threads(threads_world& world, int rank)
      : world_(&world), rank_(rank), scratch_(2 * static_cast<std::size_t>(world.size())) {}

  int rank() const { return rank_; }
  int size() const { return world_->size(); }
  /// The world's emulated nodes (0: none).
  int ranks_per_node() const { return world_->ranks_per_node(); }

  /// Fixed-size all-to-all: n elements to every rank, block r of send goes to rank r.
  template <class T>
  void alltoall(const T* send, T* recv, index_t n) {
    const int R = size();
    std::vector<index_t>& cd = scratch_;  // counts then displs, n per peer
    for (int r = 0; r < R; ++r) {
      cd[r] = n;
      cd[R + r] = r * n;
    }
    alltoallv(send, cd.data(), cd.data() + R, recv, cd.data(), cd.data() + R);
  }

  /// All-to-all-v; counts and displacements per rank, in elements. The receive counts must
  /// match what each peer sends (they normally come from a preceding alltoall of counts).
  template <class T>
  void alltoallv(const T* send, const index_t* send_counts, const index_t* send_displs, T* recv,
                 const index_t* recv_counts, const index_t* recv_displs) {
    alltoallv_with(
        send, send_counts, send_displs, recv, recv_counts, recv_displs,
        [](void* dst, const void* src, std::size_t bytes) { std::memcpy(dst, src, bytes); }, [] {});
  }

  /// The same with the row copies made by copy(dst, src, bytes) (device memory: an
  /// asynchronous device copy), and finish() run once this rank's copies are queued, before
  /// the ranks meet again (it must complete them: peers then reuse their buffers).
  template <class T, class Copy, class Finish>
  void alltoallv_with(const T* send, const index_t* send_counts, const index_t* send_displs,
                      T* recv, const index_t* recv_counts, const index_t* recv_displs, Copy&& copy,
                      Finish&& finish) {
    static_assert(std::is_trivially_copyable_v<T>, "comm::threads moves trivially copyable data");
    threads_world& w = *world_;
    w.slots_[rank_] = {send, send_counts, send_displs, sizeof(T)};
    w.barrier(rank_);  // every sender published
    int bad_peer = -1;
    index_t bad_count = 0;
    for (int s = 0; s < size(); ++s) {
      const threads_world::slot& peer = w.slots_[s];
      const index_t n = peer.counts[rank_];
      if (n != recv_counts[s] || peer.elem_size != sizeof(T)) {
        if (bad_peer < 0) {
          bad_peer = s;
          bad_count = n;
        }
        continue;
      }
      if (n > 0)
        copy(recv + recv_displs[s], static_cast<const T*>(peer.send) + peer.displs[rank_],
             static_cast<std::size_t>(n) * sizeof(T));
    }
    finish();
    // A rank that found a mismatch still waits for the others: peers may be reading its
    // send buffer, which must stay valid until every copy of this exchange is done.
    if (bad_peer >= 0) w.fail();
    w.barrier(rank_);  // every receiver done: senders may reuse their buffers
    if (bad_peer >= 0)
      throw comm_error("epmoe: comm::threads: rank " + std::to_string(rank_) + " expects " +
                       std::to_string(recv_counts[bad_peer]) + " elements from rank " +
                       std::to_string(bad_peer) + ", which sends " + std::to_string(bad_count));
    if (w.failed())
      throw comm_aborted(
          "epmoe: comm::threads: a peer rank found a count mismatch in this "
          "exchange");
  }

  /// `bytes` of this rank's memory (zeroed) and the address of every rank's: ranks write
  /// straight into a peer's. The window owns this rank's part.
  struct window {
    std::vector<std::byte*> peers;     // [rank]: that rank's memory
    std::unique_ptr<std::byte[]> own;  // this rank's
  };
  /// Collective, once per buffer (the low-latency exchange opens two at construction). A
  /// rank then writes into a peer's memory and meets the others (barrier) before the peer
  /// reads it: one copy and one meeting per exchange, where alltoall publishes, copies and
  /// meets twice. The writer must never write where a peer may still read (the layer writes
  /// each direction into its own window: the other direction's meeting separates a read from
  /// the next write).
  window open_window(std::size_t bytes) {
    threads_world& w = *world_;
    window out{std::vector<std::byte*>(static_cast<std::size_t>(size())),
               std::make_unique<std::byte[]>(std::max<std::size_t>(bytes, 1))};
    w.slots_[rank_] = {out.own.get(), nullptr, nullptr, 0};
    w.barrier(rank_);  // every rank published
    for (int r = 0; r < size(); ++r)
      out.peers[r] = static_cast<std::byte*>(const_cast<void*>(w.slots_[r].send));
    w.barrier(rank_);  // every rank read the slots: the next exchange may reuse them
    return out;
  }
  /// Held while this rank writes into peers' windows, released before it meets them: a rank
  /// leaves an aborted or timed-out exchange (and abort() returns) only when no put is in
  /// flight, so a stalled rank's late write never lands in a buffer its owner freed. Throws
  /// as the exchange would when the world has already aborted.
  class put_guard {
   public:
    explicit put_guard(threads_world& w) : w_(&w) { w.begin_put(); }
    put_guard(const put_guard&) = delete;
    put_guard& operator=(const put_guard&) = delete;
    ~put_guard() { w_->end_put(); }

   private:
    threads_world* w_;
  };
  [[nodiscard]] put_guard put() { return put_guard(*world_); }
  /// Meets every rank (deadline and abort as in an exchange).
  void barrier() { world_->barrier(rank_); }

  /// Every exchange of this world waits at most `seconds` for the other ranks (0: no limit).
  void set_timeout(double seconds) { world_->set_timeout(seconds); }
  /// This rank's endpoint among the ranks that survive `lost` (lost[r] != 0: rank r is gone
  /// and will not call again; size: size()), renumbered in rank order, in a world of their
  /// own with this one's timeout. Collective over the survivors (moe_layer::exclude_ranks).
  threads exclude(std::span<const char> lost) const {
    if (static_cast<int>(lost.size()) != size())
      throw config_error("lost ranks (mask size)", std::to_string(lost.size()),
                         "must be the comm's size " + std::to_string(size()));
    if (lost[static_cast<std::size_t>(rank_)])
      throw config_error("lost ranks", "rank " + std::to_string(rank_),
                         "the rank that calls exclude must survive");
    auto w = world_->survivors(std::vector<char>(lost.begin(), lost.end()));
    const auto before = lost.subspan(0, static_cast<std::size_t>(rank_));
    threads t(*w, static_cast<int>(std::count(before.begin(), before.end(), 0)));
    t.keep_ = std::move(w);
    return t;
  }

  /// Tells every rank that this one failed mid-pass (why: its error's text): their exchanges
  /// throw comm_aborted naming this rank, now or when they next arrive.
  void abort(const std::string& why) { world_->abort(rank_, why); }

  /// Non-blocking all-to-all-v, deferred: the exchange runs in wait(), where the ranks meet.
  /// Ranks must wait() in the order they started (a schedule's fixed order). Shared memory
  /// has no wire to hide: the copy would take the same cores as compute; a throttled<>
  /// link's wire time is what a schedule overlaps. Buffers stay in use until wait().
  template <class T>
  request ialltoallv(const T* send, const index_t* send_counts, const index_t* send_displs, T* recv,
                     const index_t* recv_counts, const index_t* recv_displs);

 private:
  threads_world* world_;
  std::shared_ptr<threads_world> keep_;  // a survivors' world (exclude), else empty
  int rank_;
  std::vector<index_t> scratch_;  // 2R entries, sized once: exchanges allocate nothing
};

/// A started exchange of comm::threads (see ialltoallv); wait() runs it. Holds no memory.
class threads::request {
 public:
  request() = default;
  void wait() {
    if (run_) std::exchange(run_, nullptr)(*this);
  }
  bool test() { return run_ == nullptr; }

 private:
  friend class threads;
  threads* comm_ = nullptr;
  const void* send_ = nullptr;
  void* recv_ = nullptr;
  const index_t *send_counts_ = nullptr, *send_displs_ = nullptr;
  const index_t *recv_counts_ = nullptr, *recv_displs_ = nullptr;
  void (*run_)(request&) = nullptr;

  template <class T>
  static void run(request& r) {
    r.comm_->alltoallv(static_cast<const T*>(r.send_), r.send_counts_, r.send_displs_,
                       static_cast<T*>(r.recv_), r.recv_counts_, r.recv_displs_);
  }
};

template <class T>
threads::request threads::ialltoallv(const T* send, const index_t* send_counts,
                                     const index_t* send_displs, T* recv,
                                     const index_t* recv_counts, const index_t* recv_displs) {
  request r;
  r.comm_ = this;
  r.send_ = send;
  r.recv_ = recv;
  r.send_counts_ = send_counts;
  r.send_displs_ = send_displs;
  r.recv_counts_ = recv_counts;
  r.recv_displs_ = recv_displs;
  r.run_ = &request::run<T>;
  return r;
}

template <class Fn>
void threads_world::run(Fn&& fn) {
  std::vector<std::exception_ptr> errors(static_cast<std::size_t>(ranks_));
  {
    std::vector<std::jthread> pool;
    pool.reserve(static_cast<std::size_t>(ranks_));
    for (int r = 0; r < ranks_; ++r)
      pool.emplace_back([&, r] {
        try {
          fn(threads(*this, r));
        } catch (const std::exception& e) {
          errors[r] = std::current_exception();
          abort(r, e.what());
        } catch (...) {
          errors[r] = std::current_exception();
          abort(r, "an exception that is no std::exception");
        }
      });
  }
  // A world is reusable after a clean run; after a failure it stays aborted.
  std::exception_ptr aborted;
  for (auto& e : errors) {
    if (!e) continue;
    try {
      std::rethrow_exception(e);
    } catch (const comm_aborted&) {
      aborted = e;
    } catch (const comm_timeout&) {
      if (!aborted) aborted = e;
    } catch (...) {
      throw;
    }
  }
  if (aborted) std::rethrow_exception(aborted);
}

}  // namespace epmoe::comm
