// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include <type_traits>
#include <utility>
#include <variant>

#include "epmoe/core/exchange/core.hpp"
#include "epmoe/core/exchange/dedup.hpp"
#include "epmoe/core/exchange/flat.hpp"
#include "epmoe/core/exchange/low_latency.hpp"
#include "epmoe/core/exchange/message.hpp"
#include "epmoe/core/exchange/ops.hpp"

// The exchange of moe_layer: one mode object, chosen once at construction from the row format
// (flat, dedup, hierarchical, or low latency's fixed slots: the bundle's options; the rows at the activation type or 8-bit:
// the config's dispatch_rows) and the unit layout (whole chunks, or with
// config max_recv_rows row rounds (flat) or windows of tokens (dedup)). Each mode runs the
// counts all-to-all, then per unit the dispatch all-to-all, the regroup to expert-major, the
// reverse regroup and the combine all-to-all; rows move through transport<Comm, Space>, and
// copies and per-row math run as the space's primitives and EPMOE_HD functors, so a device
// runs the host's code. The layer drives it stage by stage (docs/architecture.md).
namespace epmoe {

template <class Comm, class Space, bool Dedup, bool Hierarchical = false, bool LowLatency = false>
class exchange {
  using flat_modes = std::variant<flat_exchange<Comm, Space>, flat_rounds_exchange<Comm, Space>>;
  using dedup_modes = std::variant<dedup_exchange<Comm, Space, whole_chunks, Hierarchical>,
                                   dedup_exchange<Comm, Space, token_windows, Hierarchical>>;
  // One mode: its constructor refuses a receive bound (low_latency.hpp).
  using fixed_modes = std::variant<low_latency_exchange<Comm, Space>,
                                   low_latency_exchange<Comm, Space>>;
  using modes = std::conditional_t<LowLatency, fixed_modes,
                                   std::conditional_t<Dedup, dedup_modes, flat_modes>>;

 public:
  using value_type = typename Space::value_type;
  using context = exchange_context<Space>;
  static constexpr bool async = transport<Comm, Space>::async;

  /// The mode the layout asks for: a receive bound (quota > 0) splits each chunk in units.
  exchange(Comm& comm, const Space& space, const workspace_layout& w)
      : m_(w.quota > 0 ? modes(std::in_place_index<1>, comm, space, w)
                       : modes(std::in_place_index<0>, comm, space, w)) {}

  /// Rows of the receive buffer (bounded: units in flight x ranks x per-pair quota rows).
  index_t receive_buffer_rows() const { return as_core().receive_buffer_rows(); }
  value_type* send_buffer() const { return as_core().send_buffer(); }
  /// 8-bit rows (config dispatch_rows): the tokens' wire rows and the send buffer's.
  std::uint8_t* wire_tokens() const { return as_core().wire_tokens(); }
  std::uint8_t* wire_send_buffer() const { return as_core().wire_send_buffer(); }
  /// Units of the pass: its chunks, or with a row bound every round of every chunk.
  int units(const dispatch_plan& p) const {
    return std::visit([&](const auto& e) { return e.units(p); }, m_);
  }
  int chunk_of_unit(const dispatch_plan& p, int u) const {
    return std::visit([&](const auto& e) { return e.chunk_of_unit(p, u); }, m_);
  }
  int round_of_unit(const dispatch_plan& p, int u) const {
    return std::visit([&](const auto& e) { return e.round_of_unit(p, u); }, m_);
  }

  /// The counts all-to-all with every rank's call header: returns the first rank that
  /// rejected its inputs, -1, or verdict_pending (static shapes deferred on a device: read
  /// by resolve() after the pass); throws config_error on every rank when ranks make
  /// different calls. The space's synchronize() here also brings the plan's host arrays.
  int counts(context& x, const call_header& h, index_t static_rows = 0, bool defer = false) {
    return std::visit([&](auto& e) { return e.counts(x, h, static_rows, defer); }, m_);
  }
  int resolve(context& x) {
    return std::visit([&](auto& e) { return e.resolve(x); }, m_);
  }
  /// Every rank's call header in the space's memory, verdict_stride() apart: a deferred
  /// pass's reduce writes nothing unless all accepted and agree.
  const index_t* verdicts() const {
    return std::visit([&](const auto& e) { return e.verdicts(); }, m_);
  }
  index_t verdict_stride() const {
    return std::visit([&](const auto& e) { return e.verdict_stride(); }, m_);
  }
  /// A call that moves no rows: its header alone (see exchange_core::agree).
  int agree(const Space& space, const call_header& h) { return as_core().agree(space, h); }

  void start_dispatch(context& x, int u) {
    std::visit([&](auto& e) { e.start_dispatch(x, u); }, m_);
  }
  void wait_dispatch(context& x, int u) {
    std::visit([&](auto& e) { e.wait_dispatch(x, u); }, m_);
  }
  /// The rows every local expert computes in unit u: groups of the expert buffer.
  grouped_rows<value_type> expert_rows(const context& x, int u) const {
    return std::visit([&](const auto& e) { return e.expert_rows(x, u); }, m_);
  }
  template <bool Backward>
  void start_combine(context& x, int u) {
    std::visit([&](auto& e) { e.template start_combine<Backward>(x, u); }, m_);
  }
  template <bool Backward>
  void wait_combine(context& x, int u) {
    std::visit([&](auto& e) { e.template wait_combine<Backward>(x, u); }, m_);
  }

  /// Dedup backward: routing-weight gradients of the received rows and of the send rows,
  /// and the received rows of unit c (dedup_exchange).
  float* weight_grad_recv() const requires Dedup {
    return std::visit([](const auto& e) { return e.weight_grad_recv(); }, m_);
  }
  float* weight_grad_send() const requires Dedup {
    return std::visit([](const auto& e) { return e.weight_grad_send(); }, m_);
  }
  received_rows received(const dispatch_plan& p, int c) const requires Dedup {
    return std::visit([&](const auto& e) { return e.received(p, c); }, m_);
  }

  void synchronize(const Space& s) const { as_core().synchronize(s); }
  void progress() { as_core().progress(); }

 private:
  exchange_core<Comm, Space>& as_core() {
    return std::visit([](auto& e) -> exchange_core<Comm, Space>& { return e; }, m_);
  }
  const exchange_core<Comm, Space>& as_core() const {
    return std::visit([](const auto& e) -> const exchange_core<Comm, Space>& { return e; }, m_);
  }

  modes m_;
};

}  // namespace epmoe
