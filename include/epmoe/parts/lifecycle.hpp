// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include <cmath>
#include <cstdint>
#include <string>

#include "epmoe/core/agreement.hpp"
#include "epmoe/core/config.hpp"
#include "epmoe/core/error.hpp"
#include "epmoe/core/exchange/message.hpp"
#include "epmoe/core/stats.hpp"

// The lifecycle guard of a layer: what it checks at construction (every rank validates, then
// all agree), and what every collective call goes through: the failed state, the space
// entered and left on every path, and a failure past the agreement told to every peer.
namespace epmoe::parts {

/// Every check a layer's config, comm, policies and weights must pass (throws config_error
/// naming the field): at construction and when the weights are rebound.
template <class Layer, class Comm, class Weights, class Router, class Placement>
void check_layer(const layer_config& cfg, const Comm& comm, const Weights& w, const Router& router,
                 const Placement& placement) {
  using X = typename Layer::expert_type;
  check_layer_policies(cfg, comm.size(), router, placement);
  if constexpr (Router::uses_gate)  // E + Z rows: the zero experts are scored too
    detail::require_shape(w.gate, cfg.scored_experts(), cfg.hidden, "weights.gate");
  if constexpr (router_with_gate_bias<Router>)
    detail::require_shape(w.gate_bias, 1, cfg.scored_experts(), "weights.gate_bias");
  X::validate(w.experts, placement.slots_per_rank(), cfg.hidden, cfg.ffn, "weights.experts");
  if (cfg.shared_experts > 0)
    X::validate(w.shared, cfg.shared_experts, cfg.hidden, cfg.shared_width(), "weights.shared");
  if (cfg.shared_gate)
    detail::require_shape(w.shared_gate, cfg.shared_experts, cfg.hidden, "weights.shared_gate");
  if (cfg.output_bias) detail::require_shape(w.output_bias, 1, cfg.hidden, "weights.output_bias");
  const int G = node_size_of(cfg, comm);
  if (G != cfg.ranks_per_node)  // the comm's
    detail::require(G >= 0 && G <= cfg.ranks && (G == 0 || cfg.ranks % G == 0), "ranks_per_node", G,
                    "from the comm (config ranks_per_node = 0) must divide ranks: set "
                    "ranks_per_node in the config, or place as many ranks on every node");
  if constexpr (Layer::hierarchical)
    detail::require(G <= 64, "ranks_per_node", G,
                    "must be <= 64 with options.hierarchical (a row's mask of the node's ranks is "
                    "64 bits)");
  if constexpr (Layer::options.low_latency)
    detail::require(!cfg.training, "training", "true",
                    "must be false with options.low_latency (an inference exchange: its slots "
                    "carry no backward)");
  if (cfg.max_recv_rows > 0) {
    detail::require(!Layer::capacity_type::pads, "max_recv_rows", cfg.max_recv_rows,
                    "must be 0 with padded capacity (its blocks are fixed): use "
                    "capacity::dropless or capacity::factor<false> for a receive bound");
    detail::require(cfg.max_recv_rows >= cfg.ranks * Layer::units_in_flight, "max_recv_rows",
                    cfg.max_recv_rows,
                    ("must be >= ranks * " + std::to_string(Layer::units_in_flight) +
                     " (rounds this schedule keeps in flight): every pair moves a row per round")
                        .c_str());
  }
}

/// Collective start-up check: every rank validates its own inputs, then all ranks compare
/// their configs and policy bundle in one exchange. Any failure or difference makes every
/// rank throw (the failing rank its own error), so no rank is left waiting in an exchange.
template <class Layer, class Policies, class Comm, class Weights, class Router, class Placement>
const layer_config& agreed_config(const layer_config& cfg, Comm& comm, const Weights& w,
                                  const Router& router, const Placement& placement) {
  // The deadline covers the agreement's own exchange too (a bad value: check_layer names it).
  if constexpr (requires { comm.set_timeout(1.0); })
    if (std::isfinite(cfg.exchange_timeout) && cfg.exchange_timeout >= 0 &&
        cfg.exchange_timeout <= 1e9)
      comm.set_timeout(cfg.exchange_timeout);
  agree_on_layer<Policies>(cfg, comm, placement,
                           [&] { check_layer<Layer>(cfg, comm, w, router, placement); });
  return cfg;
}

/// The stage a pass is in (what a failure names).
using stage_field = double stage_times::*;  // (an alias: nvcc warns on the plain form)
inline const char* stage_name(stage_field s) {
  if (s == &stage_times::route) return "route";
  if (s == &stage_times::plan) return "plan";
  if (s == &stage_times::permute) return "permute";
  if (s == &stage_times::shared) return "shared";
  if (s == &stage_times::dispatch) return "dispatch";
  if (s == &stage_times::experts) return "experts";
  if (s == &stage_times::combine) return "combine";
  if (s == &stage_times::reduce) return "reduce";
  return "start";
}

/// A layer's state across its collective calls: whether one failed mid-exchange (every later
/// call is then refused: an exchange in flight cannot be resumed), and where the running call
/// is (its stage and unit, named when it fails).
class lifecycle {
 public:
  /// Throws when an earlier call failed mid-exchange.
  void usable() const {
    if (!failed_.empty())
      throw comm_aborted("epmoe: this layer is unusable: an earlier pass failed mid-exchange (" +
                         failed_ +
                         "); its exchanges cannot be resumed: build a new layer and comm");
  }
  /// The running call is in stage s (of unit u, or -1).
  void at(stage_field s, int u) {
    stage_ = s;
    unit_ = u;
  }
  int unit() const { return unit_; }
  /// The failure about to be thrown is thrown by every rank at the same exchange (a rejected
  /// input, ranks that make different calls): the layer stays usable, no peer is told.
  void agreed() { agreed_ = true; }

  /// Runs one collective call `f` on `space` (entered, and left on every path). A failure
  /// every rank agreed on leaves the layer usable; any other marks it failed, tells the peers
  /// through the comm's abort() within their next exchange, and names the call, pass, stage
  /// and unit (`unit_text(u)`: its chunk and round).
  template <class Space, class Comm, class UnitText, class F>
  void run(const Space& space, Comm& comm, call_kind kind, std::uint64_t pass, UnitText&& unit_text,
           F&& f) {
    usable();
    agreed_ = false;
    at(nullptr, -1);
    struct scope {
      const Space& s;
      explicit scope(const Space& sp) : s(sp) { s.enter(); }
      ~scope() { s.leave(); }
    } entered(space);
    try {
      f();
    } catch (...) {
      if (!agreed_) fail(comm, kind, pass, unit_text);  // rethrows, named
      throw;
    }
  }

 private:
  // Called inside a catch handler: marks the layer failed and rethrows what failed, named.
  template <class Comm, class UnitText>
  [[noreturn]] void fail(Comm& comm, call_kind kind, std::uint64_t pass, UnitText& unit_text) {
    std::string where =
        std::string("epmoe: ") + call_name(kind) +
        (kind == call_kind::forward || kind == call_kind::backward ? " pass " : " after pass ") +
        std::to_string(pass);
    if (stage_) where += std::string(", stage ") + stage_name(stage_);
    if (unit_ >= 0) where += " (" + unit_text(unit_) + ")";
    const auto tell_peers = [&](const std::string& why) {
      if constexpr (requires { comm.abort(why); }) comm.abort(why);
    };
    try {
      throw;
    } catch (const comm_timeout& e) {
      failed_ = where + ": " + e.what();
      tell_peers(failed_);
      throw comm_timeout(failed_);
    } catch (const comm_aborted& e) {
      failed_ = where + ": " + e.what();
      throw comm_aborted(failed_, e.origin());
    } catch (const std::exception& e) {
      failed_ = where + ": " + e.what();
      tell_peers(failed_);
      throw;
    } catch (...) {
      failed_ = where + ": an exception that is no std::exception";
      tell_peers(failed_);
      throw;
    }
  }

  std::string failed_;  // what broke this layer (empty: usable)
  stage_field stage_ = nullptr;
  int unit_ = -1;
  bool agreed_ = false;
};

}  // namespace epmoe::parts
