// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "epmoe/moe_layer.hpp"

namespace epmoe {

/// A moe_layer that keeps several split passes in flight (two-batch overlap, docs/decode.md):
/// one lane per in-flight pass, each a moe_layer with its own workspace and its own comm (MPI:
/// its own communicator, so two passes' exchanges never match each other's), all over the
/// same weights. start(x, y) posts a micro-batch's dispatch on the next lane; finish(h) runs
/// its experts and combine. Handles finish in the order they started (every rank's comms
/// meet in that order), at most max_in_flight() at once. Forward only.
template <class Policies = default_policies>
class split_layer {
 public:
  using layer_type = moe_layer<Policies>;
  using comm_type = typename layer_type::comm_type;
  using value_type = typename layer_type::value_type;
  using weights = typename layer_type::weights;

  /// One lane per comm (max_in_flight = comms.size() >= 1), each built as
  /// moe_layer(cfg, comms[i], w, router, capacity): collective, lane after lane. The lanes'
  /// workspaces are sized here; a pass allocates nothing.
  split_layer(const layer_config& cfg, std::vector<comm_type> comms, const weights& w,
              typename layer_type::router_type router = {},
              typename layer_type::capacity_type capacity = {}) {
    detail::require(!comms.empty(), "comms", comms.size(),
                    "must hold one comm per in-flight pass (max_in_flight >= 1)");
    lanes_.reserve(comms.size());
    for (auto& c : comms)
      lanes_.push_back(std::make_unique<layer_type>(cfg, std::move(c), w, router, capacity));
    held_.resize(lanes_.size());
  }

  int max_in_flight() const { return static_cast<int>(lanes_.size()); }
  /// Passes started and not finished.
  int in_flight() const { return static_cast<int>(next_ - oldest_); }

  /// Posts y = MoE(x)'s dispatch on the next lane ([T, H], valid until finish). Collective,
  /// checked as moe_layer::start (a rejected input: every rank throws, nothing is written,
  /// nothing is in flight).
  split_handle start(matrix_view<const value_type> x, matrix_view<value_type> y,
                     std::span<const std::int64_t> token_ids = {}) {
    detail::require(in_flight() < max_in_flight(), "start", in_flight(),
                    ("passes are in flight, the most this split_layer keeps (max_in_flight = " +
                     std::to_string(max_in_flight()) + "): finish the oldest first")
                        .c_str());
    const int lane = static_cast<int>(next_ % lanes_.size());
    held_[lane] = lanes_[lane]->start(x, y, token_ids);  // throws: nothing in flight
    return {next_++, lane};
  }

  /// Optional, between start and finish: waits for h's dispatch, runs its experts and posts
  /// its combine (any pass in flight, once; every rank in the same order).
  void experts(split_handle h) {
    detail::require(h.id >= oldest_ && h.id < next_, "experts(handle)", h.id,
                    "must name a pass in flight (started, not finished)");
    const std::size_t lane = static_cast<std::size_t>(h.id % lanes_.size());
    lanes_[lane]->experts(held_[lane]);
  }

  /// Waits for h's combine (running its experts first unless experts(h) did), writes its y.
  /// h: the oldest pass in flight, once.
  void finish(split_handle h) {
    if (h.id < oldest_ || h.id >= next_)
      throw config_error("finish(handle)", "pass " + std::to_string(h.id),
                         h.id < oldest_ ? "was finished already: finish each handle once"
                                        : "was not started by this split_layer");
    if (h.id != oldest_)
      throw config_error("finish(handle)", "pass " + std::to_string(h.id),
                         "is out of order: finish passes in the order they started (pass " +
                             std::to_string(oldest_) +
                             " first), the order in which every rank's comms meet");
    ++oldest_;  // whatever happens next
    const std::size_t lane = static_cast<std::size_t>(h.id % lanes_.size());
    lanes_[lane]->finish(held_[lane]);
  }

  /// A plain pass: start then finish.
  void forward(matrix_view<const value_type> x, matrix_view<value_type> y,
               std::span<const std::int64_t> token_ids = {}) {
    finish(start(x, y, token_ids));
  }

  /// Lane i (its stats(), config(), settings); the lane of handle h is h.lane.
  layer_type& lane(int i) { return *lanes_.at(static_cast<std::size_t>(i)); }
  const layer_type& lane(int i) const { return *lanes_.at(static_cast<std::size_t>(i)); }
  const layer_config& config() const { return lanes_.front()->config(); }

 private:
  std::vector<std::unique_ptr<layer_type>> lanes_;
  std::vector<split_handle> held_;  // each lane's pass in flight
  std::uint64_t next_ = 0, oldest_ = 0;  // the next pass's number, the oldest in flight
};

}  // namespace epmoe
