// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
#pragma once

// The entries of an experiment: a named policy bundle with its treatment, and the
// bundle on the ranks' comm (with turns for thread ranks sharing one machine's cores).

#include <algorithm>
#include <cstddef>
#include <memory>
#include <mutex>
#include <string_view>
#include <utility>

#include "epmoe/core/concepts.hpp"
#include "epmoe/space/host.hpp"

namespace epmoe::experiment {

// --- the bundles ------------------------------------------------------------------------------

/// A bundle's name as a template argument: bundle<"mixtral top-2", P>.
template <std::size_t N>
struct name_string {
  char text[N]{};
  constexpr name_string(const char (&s)[N]) { std::copy_n(s, N, text); }
  constexpr std::string_view view() const { return {text, N - 1}; }
};

/// What the experiment does to a bundle besides running it.
struct treatment {
  bool throttled = false;  // exchanges take as long as options.link says (comm::throttled):
                           //   a cluster's all-to-all cost on one machine
  bool from_load = false;  // the placement is made from the load of a first pass of the
                           //   bundle (detail::placement_for)
  int extra_slots = 0;     // with from_load and placement::table: replicas the balancer adds
  int bias_steps = 0;      // with a router that has a bias (DeepSeek-V3's aux-loss-free
                           //   balancing): untimed passes, each followed by update_router,
                           //   before the timed ones; the timed passes use the learnt bias
};

/// One entry of the experiment: a name, a policy bundle (its comm is replaced by the ranks'
/// own; a router with settings comes from `static router make_router(const layer_config&)`
/// in the bundle) and a treatment.
template <name_string Name, class Policies, treatment How = {}>
struct bundle {
  static constexpr std::string_view name = Name.view();
  using policies = Policies;
  static constexpr treatment how = How;
};

template <class... Bundles>
struct list {};

/// Bundle P on communicator Comm.
template <class P, class Comm>
struct on_comm : P {
  using comm = Comm;
};

// --- ranks that share one machine take turns ---------------------------------------------------

/// The host space, with a lock its copies share: the experts stage of a rank that runs under
/// in_turns<> waits for it. Thread ranks share this machine's cores, so concurrent expert
/// GEMMs slow each other down and a rank's expert time would measure the contention; taking
/// turns makes it the rank's own work, as on a cluster where each rank has its own device.
class turn_space : public space::host {
 public:
  turn_space() = default;
  /// Each rank its own space (its own GEMM helper threads), the lock shared; a null lock:
  /// turn() does not lock (ranks run their experts together).
  explicit turn_space(std::shared_ptr<std::mutex> lock) : turn_(std::move(lock)) {}
  std::unique_lock<std::mutex> turn() const {
    return turn_ ? std::unique_lock<std::mutex>(*turn_) : std::unique_lock<std::mutex>();
  }

 private:
  std::shared_ptr<std::mutex> turn_;
};

/// Schedule S with each experts stage taken in turn (the wait is outside its timer).
template <class S>
struct in_turns {
  static constexpr int default_chunks = S::default_chunks;
  static constexpr int units_in_flight = units_in_flight_of<S>();

  template <class Stages>
  struct taking_turns {
    Stages& s;
    int chunks() const { return s.chunks(); }
    void route() { s.route(); }
    void plan() { s.plan(); }
    void permute() { s.permute(); }
    void shared() { s.shared(); }
    void counts() { s.counts(); }
    void dispatch_start(int u) { s.dispatch_start(u); }
    void dispatch_wait(int u) { s.dispatch_wait(u); }
    void experts(int u) {
      const auto lock = s.space().turn();
      s.experts(u);
    }
    void combine_start(int u) { s.combine_start(u); }
    void combine_wait(int u) { s.combine_wait(u); }
    void reduce() { s.reduce(); }
  };

  template <class Stages>
  static void run(Stages& s) {
    if constexpr (requires { s.space().turn(); }) {
      taking_turns<Stages> t{s};
      S::run(t);
    } else {
      S::run(s);  // a space without turns (its own device per rank)
    }
  }
};

/// Bundle P on communicator Comm, its experts in turns on turn_space (thread ranks).
template <class P, class Comm>
struct in_turns_on : P {
  using comm = Comm;
  using space = turn_space;
  using schedule = in_turns<typename P::schedule>;
};

}  // namespace epmoe::experiment
