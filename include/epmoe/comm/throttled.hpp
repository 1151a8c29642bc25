// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include <algorithm>
#include <chrono>
#include <string>
#include <thread>
#include <utility>

#include "epmoe/core/view.hpp"

namespace epmoe::comm {

/// A link model: an exchange costs latency + bytes / bandwidth, the bytes being the larger
/// of what a rank sends to and receives from other ranks (its NIC is the bottleneck).
struct link {
  double bandwidth = 25e9;  // bytes per second
  double latency = 10e-6;   // seconds per exchange
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

  throttled(Inner inner, link l) : inner_(std::move(inner)), link_(l) {}

  int rank() const { return inner_.rank(); }
  int size() const { return inner_.size(); }
  const link& model() const { return link_; }
  Inner& inner() { return inner_; }

  /// The inner comm's deadline and abort (docs/reliability.md), where it has them.
  void set_timeout(double seconds) requires requires(Inner& i) { i.set_timeout(seconds); }
  { inner_.set_timeout(seconds); }
  void abort(const std::string& why) requires requires(Inner& i) { i.abort(why); }
  { inner_.abort(why); }

  /// Seconds the link needs for an exchange with these per-rank element counts.
  template <class T>
  double seconds(const index_t* send_counts, const index_t* recv_counts) const {
    index_t out = 0, in = 0;
    for (int r = 0; r < size(); ++r)
      if (r != rank()) {
        out += send_counts[r];
        in += recv_counts[r];
      }
    return link_.latency + static_cast<double>(std::max(out, in)) * sizeof(T) / link_.bandwidth;
  }

  template <class T>
  void alltoall(const T* send, T* recv, index_t n) {
    const auto deadline =
        clock::now() +
        to_duration(link_.latency + double(n) * (size() - 1) * sizeof(T) / link_.bandwidth);
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

 private:
  static clock::duration to_duration(double s) {
    return std::chrono::duration_cast<clock::duration>(std::chrono::duration<double>(s));
  }

  Inner inner_;
  link link_;
};

}  // namespace epmoe::comm
