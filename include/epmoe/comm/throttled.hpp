// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include <algorithm>
#include <chrono>
#include <string>
#include <thread>
#include <utility>

#include "epmoe/core/error.hpp"
#include "epmoe/core/transport.hpp"
#include "epmoe/core/view.hpp"

namespace epmoe::comm {

/// A link model: an exchange costs latency + bytes / bandwidth, the bytes being the larger
/// of what a rank sends to and receives from other ranks (its NIC is the bottleneck).
struct link {
  double bandwidth = 25e9;  // bytes per second
  double latency = 10e-6;   // seconds per exchange
};

/// Two classes of link (issue 24): among the `ranks_per_node` ranks of a node (NVLink, shared
/// memory) and between nodes (the NIC), each with its own bandwidth and latency. Rank r is on
/// node r / ranks_per_node. The two run side by side: an exchange takes as long as the
/// slower of its two parts.
struct node_links {
  link intra{.bandwidth = 150e9, .latency = 3e-6};
  link inter{.bandwidth = 25e9, .latency = 10e-6};
  int ranks_per_node = 1;
};

/// A communicator whose exchanges take as long as `link` would: the inner exchange runs,
/// then the call (or the request's wait) sleeps until start + modeled time. On one machine
/// this reproduces the regime of a real cluster, where the all-to-alls cost about as much as
/// the expert GEMMs, so that a pipelined schedule has something to hide. A non-blocking
/// exchange's wire time starts at ialltoallv and runs while the caller computes.
template <class Inner>
class throttled {
 public:
  using clock = std::chrono::steady_clock;

  throttled(Inner inner, link l) : inner_(std::move(inner)), link_(l), intra_(l) {}
  /// Two link classes; the layer learns the nodes from ranks_per_node().
  throttled(Inner inner, node_links n)
      : inner_(std::move(inner)), link_(n.inter), intra_(n.intra), per_node_(n.ranks_per_node) {
    if (per_node_ < 1 || inner_.size() % per_node_ != 0)
      throw config_error(
          "node_links.ranks_per_node", std::to_string(per_node_),
          "must be >= 1 and divide the comm's size (" + std::to_string(inner_.size()) + ")");
  }

  int rank() const { return inner_.rank(); }
  int size() const { return inner_.size(); }
  /// The link between nodes (with one class: every link).
  const link& model() const { return link_; }
  /// Ranks per node of a two-class model; else the inner comm's, where it knows them.
  int ranks_per_node() const {
    if (per_node_ > 0) return per_node_;
    if constexpr (requires { inner_.ranks_per_node(); })
      return inner_.ranks_per_node();
    else
      return 0;
  }
  Inner& inner() { return inner_; }

  /// The inner comm's deadline and abort (docs/reliability.md), where it has them.
  void set_timeout(double seconds) requires requires(Inner& i) { i.set_timeout(seconds); }
  { inner_.set_timeout(seconds); }
  void abort(const std::string& why) requires requires(Inner& i) { i.abort(why); }
  { inner_.abort(why); }

  /// Seconds the links need for an exchange with these per-rank element counts: per class,
  /// latency + the larger of what this rank sends and receives over it / its bandwidth; the
  /// classes in parallel.
  template <class T>
  double seconds(const index_t* send_counts, const index_t* recv_counts) const {
    return seconds_of<T>([&](int r) { return send_counts[r]; },
                         [&](int r) { return recv_counts[r]; });
  }

  template <class T>
  void alltoall(const T* send, T* recv, index_t n) {
    const auto each = [n](int) { return n; };
    const auto deadline = clock::now() + to_duration(seconds_of<T>(each, each));
    inner_.alltoall(send, recv, n);
    std::this_thread::sleep_until(deadline);
  }

  template <class T>
  void alltoallv(const T* send, const index_t* send_counts, const index_t* send_displs, T* recv,
                 const index_t* recv_counts, const index_t* recv_displs) {
    const auto deadline = clock::now() + to_duration(seconds<T>(send_counts, recv_counts));
    inner_.alltoallv(send, send_counts, send_displs, recv, recv_counts, recv_displs);
    std::this_thread::sleep_until(deadline);
  }

  /// A started exchange: wait() completes the inner one, then the modeled wire time.
  class request {
   public:
    request() = default;
    request(typename Inner::request inner, clock::time_point deadline, double modeled)
        : inner_(std::move(inner)), deadline_(deadline), modeled_(modeled) {}
    void wait() {
      inner_.wait();
      std::this_thread::sleep_until(deadline_);
    }
    bool test() { return clock::now() >= deadline_ && inner_.test(); }
    /// The link model's time for this exchange, in seconds.
    double modeled_seconds() const { return modeled_; }

   private:
    typename Inner::request inner_{};
    clock::time_point deadline_{};
    double modeled_ = 0;
  };

  template <class T>
  request ialltoallv(const T* send, const index_t* send_counts, const index_t* send_displs, T* recv,
                     const index_t* recv_counts, const index_t* recv_displs) {
    const double t = seconds<T>(send_counts, recv_counts);
    const auto deadline = clock::now() + to_duration(t);
    return request(
        inner_.ialltoallv(send, send_counts, send_displs, recv, recv_counts, recv_displs), deadline,
        t);
  }
  /// One level of a hierarchical exchange, where the inner comm posts levels (comm::mpi).
  template <class T>
  request ialltoallv(const T* send, const index_t* send_counts, const index_t* send_displs, T* recv,
                     const index_t* recv_counts, const index_t* recv_displs,
                     exchange_level level) requires requires(Inner& i) {
    i.ialltoallv(send, send_counts, send_displs, recv, recv_counts, recv_displs, level);
  }
  {
    const double t = seconds<T>(send_counts, recv_counts);
    const auto deadline = clock::now() + to_duration(t);
    return request(
        inner_.ialltoallv(send, send_counts, send_displs, recv, recv_counts, recv_displs, level),
        deadline, t);
  }

 private:
  template <class T, class Out, class In>
  double seconds_of(Out out_of, In in_of) const {
    index_t out[2] = {0, 0}, in[2] = {0, 0};  // [intra, inter]
    const int G = per_node_ > 0 ? per_node_ : size();
    for (int r = 0; r < size(); ++r)
      if (r != rank()) {
        const int c = r / G == rank() / G ? 0 : 1;
        out[c] += out_of(r);
        in[c] += in_of(r);
      }
    double t = 0;
    const link* links[2] = {&intra_, &link_};
    for (int c = 0; c < 2; ++c)
      if (out[c] + in[c] > 0 || (c == 1 && t == 0))  // an empty exchange still pays latency
        t = std::max(t, links[c]->latency + static_cast<double>(std::max(out[c], in[c])) *
                                                sizeof(T) / links[c]->bandwidth);
    return t;
  }

  static clock::duration to_duration(double s) {
    return std::chrono::duration_cast<clock::duration>(std::chrono::duration<double>(s));
  }

  Inner inner_;
  link link_;         // between nodes (one class: every link)
  link intra_;        // inside a node
  int per_node_ = 0;  // two classes: ranks per node; 0: one class
};

}  // namespace epmoe::comm
