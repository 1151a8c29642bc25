// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include <cstddef>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "epmoe/core/error.hpp"
#include "epmoe/core/view.hpp"

namespace epmoe::comm {

/// A communicator known only at run time: what a framework implements to lend the layer its
/// own process group (python/src/c10d_endpoint.hpp: a torch.distributed group). Exchanges move
/// bytes; counts and displacements are per rank, in bytes. Collective like every comm.
class endpoint {
 public:
  virtual ~endpoint() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  /// Blocking all-to-all-v.
  virtual void alltoallv(const std::byte* send, const index_t* send_counts,
                         const index_t* send_displs, std::byte* recv, const index_t* recv_counts,
                         const index_t* recv_displs) = 0;
  /// Starts one and returns a ticket for wait(); the arrays and buffers stay valid until then.
  /// The default runs it at once (ticket -1): a blocking endpoint is a correct one.
  virtual int start(const std::byte* send, const index_t* send_counts, const index_t* send_displs,
                    std::byte* recv, const index_t* recv_counts, const index_t* recv_displs) {
    alltoallv(send, send_counts, send_displs, recv, recv_counts, recv_displs);
    return -1;
  }
  /// Completes a started exchange (throws comm_error on failure).
  virtual void wait(int /*ticket*/) {}
  virtual bool test(int /*ticket*/) { return true; }
  /// Seconds an exchange may wait for its peers (0: no limit); the layer sets its config's
  /// exchange_timeout. The default ignores it: the framework's own timeout applies.
  virtual void set_timeout(double /*seconds*/) {}
  /// This rank failed mid-pass (why: its error): tell the peers, where the endpoint can, so
  /// that their waiting exchanges throw comm_aborted. The default does nothing.
  virtual void abort(const std::string& /*why*/) {}
  /// Ranks of one node (fast links among them; rank r on node r / G), or 0 when unknown: the
  /// layer then takes its config's layer_config::ranks_per_node (docs/architecture.md).
  virtual int ranks_per_node() const { return 0; }
};

/// The comm policy over an endpoint: element counts become byte counts, in slots owned here
/// (one for blocking calls, `max_in_flight` for pending ones), so no exchange allocates. The
/// endpoint must outlive the comm. One virtual call per exchange: nothing next to its cost.
class any {
 public:
  class request;

  explicit any(endpoint& ep, int max_in_flight = 8)
      : ep_(&ep),
        ranks_(ep.size()),
        bytes_(4 * static_cast<std::size_t>(ranks_) * (1 + max_in_flight)),
        busy_(static_cast<std::size_t>(max_in_flight)) {}

  int rank() const { return ep_->rank(); }
  int size() const { return ranks_; }
  endpoint& native() const { return *ep_; }
  void set_timeout(double seconds) { ep_->set_timeout(seconds); }
  void abort(const std::string& why) { ep_->abort(why); }
  int ranks_per_node() const { return ep_->ranks_per_node(); }

  /// n elements to every rank, block r of send to rank r.
  template <class T>
  void alltoall(const T* send, T* recv, index_t n) {
    index_t* b = bytes_.data();
    const index_t s = n * static_cast<index_t>(sizeof(T));
    for (int r = 0; r < ranks_; ++r)
      b[r] = b[2 * ranks_ + r] = s, b[ranks_ + r] = b[3 * ranks_ + r] = r * s;
    ep_->alltoallv(bytes_of(send), b, b + ranks_, bytes_of(recv), b + 2 * ranks_, b + 3 * ranks_);
  }

  template <class T>
  void alltoallv(const T* send, const index_t* sc, const index_t* sd, T* recv, const index_t* rc,
                 const index_t* rd) {
    index_t* b = in_bytes<T>(0, sc, sd, rc, rd);
    ep_->alltoallv(bytes_of(send), b, b + ranks_, bytes_of(recv), b + 2 * ranks_, b + 3 * ranks_);
  }

  template <class T>
  request ialltoallv(const T* send, const index_t* sc, const index_t* sd, T* recv,
                     const index_t* rc, const index_t* rd);

 private:
  template <class T>
  static const std::byte* bytes_of(const T* p) {
    return reinterpret_cast<const std::byte*>(p);
  }
  template <class T>
  static std::byte* bytes_of(T* p) {
    return reinterpret_cast<std::byte*>(p);
  }
  // The four arrays of slot k, times sizeof(T).
  template <class T>
  index_t* in_bytes(std::size_t k, const index_t* sc, const index_t* sd, const index_t* rc,
                    const index_t* rd) {
    index_t* b = bytes_.data() + 4 * static_cast<std::size_t>(ranks_) * k;
    constexpr index_t e = sizeof(T);
    for (int r = 0; r < ranks_; ++r) {
      b[r] = sc[r] * e, b[ranks_ + r] = sd[r] * e;
      b[2 * ranks_ + r] = rc[r] * e, b[3 * ranks_ + r] = rd[r] * e;
    }
    return b;
  }

  endpoint* ep_;
  int ranks_;
  std::vector<index_t> bytes_;       // 4R per slot: counts, displs (send, then receive)
  std::vector<unsigned char> busy_;  // one flag per pending slot
};

/// A started exchange; wait() completes it, the destructor waits for one still pending.
class any::request {
 public:
  request() = default;
  request(request&& o) noexcept
      : ep_(std::exchange(o.ep_, nullptr)),
        ticket_(o.ticket_),
        busy_(std::exchange(o.busy_, nullptr)) {}
  request& operator=(request&& o) noexcept {
    if (this != &o) {
      finish_quietly();
      ep_ = std::exchange(o.ep_, nullptr);
      ticket_ = o.ticket_;
      busy_ = std::exchange(o.busy_, nullptr);
    }
    return *this;
  }
  request(const request&) = delete;
  request& operator=(const request&) = delete;
  ~request() { finish_quietly(); }

  void wait() {
    if (!ep_) return;
    endpoint* ep = std::exchange(ep_, nullptr);
    release();  // the slot is free whatever wait() says
    ep->wait(ticket_);
  }
  bool test() { return !ep_ || ep_->test(ticket_); }

 private:
  friend class any;
  request(endpoint* ep, int ticket, unsigned char* busy) : ep_(ep), ticket_(ticket), busy_(busy) {}
  void release() noexcept {
    if (busy_) *std::exchange(busy_, nullptr) = 0;
  }
  void finish_quietly() noexcept {
    try {
      wait();
    } catch (...) {  // a destructor cannot throw; the pass that dropped it already failed
    }
  }

  endpoint* ep_ = nullptr;
  int ticket_ = -1;
  unsigned char* busy_ = nullptr;
};

template <class T>
any::request any::ialltoallv(const T* send, const index_t* sc, const index_t* sd, T* recv,
                             const index_t* rc, const index_t* rd) {
  std::size_t slot = 0;
  while (slot < busy_.size() && busy_[slot]) ++slot;
  if (slot == busy_.size())
    throw comm_error("epmoe: comm::any: more than " + std::to_string(busy_.size()) +
                     " exchanges pending; wait() for one, or construct comm::any with a larger "
                     "max_in_flight");
  index_t* b = in_bytes<T>(slot + 1, sc, sd, rc, rd);
  const int ticket =
      ep_->start(bytes_of(send), b, b + ranks_, bytes_of(recv), b + 2 * ranks_, b + 3 * ranks_);
  if (ticket < 0) return {};  // done already
  busy_[slot] = 1;
  return request(ep_, ticket, &busy_[slot]);
}

/// A typed comm (comm::threads, comm::mpi, comm::local) as an endpoint: in-process thread
/// ranks behind comm::any, and the tests of comm::any itself.
template <class Comm>
class endpoint_of final : public endpoint {
  static constexpr bool async =
      requires(Comm & c, const std::byte* s, std::byte* r, const index_t* n) {
    c.ialltoallv(s, n, n, r, n, n).wait();
  };
  template <bool Async, class = void>
  struct request_of {
    using type = int;  // unused
  };
  template <class V>
  struct request_of<true, V> {
    using type = decltype(std::declval<Comm&>().ialltoallv(
        std::declval<const std::byte*>(), std::declval<const index_t*>(),
        std::declval<const index_t*>(), std::declval<std::byte*>(), std::declval<const index_t*>(),
        std::declval<const index_t*>()));
  };
  using request_type = typename request_of<async>::type;

 public:
  explicit endpoint_of(Comm comm, int max_in_flight = 8)
      : comm_(std::move(comm)), pending_(static_cast<std::size_t>(max_in_flight)) {}

  int rank() const override { return comm_.rank(); }
  int size() const override { return comm_.size(); }
  Comm& comm() { return comm_; }

  void alltoallv(const std::byte* send, const index_t* sc, const index_t* sd, std::byte* recv,
                 const index_t* rc, const index_t* rd) override {
    comm_.alltoallv(send, sc, sd, recv, rc, rd);
  }
  int start(const std::byte* send, const index_t* sc, const index_t* sd, std::byte* recv,
            const index_t* rc, const index_t* rd) override {
    if constexpr (async) {
      for (std::size_t t = 0; t < pending_.size(); ++t)
        if (!pending_[t]) {
          pending_[t].emplace(comm_.ialltoallv(send, sc, sd, recv, rc, rd));
          return static_cast<int>(t);
        }
    }
    alltoallv(send, sc, sd, recv, rc, rd);  // no slot (or no ialltoallv): blocking
    return -1;
  }
  void wait(int ticket) override {
    if constexpr (async) {
      std::optional<request_type>& p = pending_[static_cast<std::size_t>(ticket)];
      std::optional<request_type> r = std::move(p);
      p.reset();
      r->wait();
    }
  }
  bool test(int ticket) override {
    if constexpr (async)
      return pending_[static_cast<std::size_t>(ticket)]->test();
    else
      return true;
  }
  void set_timeout(double seconds) override {
    if constexpr (requires { comm_.set_timeout(seconds); }) comm_.set_timeout(seconds);
  }
  void abort(const std::string& why) override {
    if constexpr (requires { comm_.abort(why); }) comm_.abort(why);
  }
  int ranks_per_node() const override {
    if constexpr (requires { comm_.ranks_per_node(); })
      return comm_.ranks_per_node();
    else
      return 0;
  }

 private:
  Comm comm_;
  std::vector<std::optional<request_type>> pending_;
};

}  // namespace epmoe::comm
