// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include <cmath>
#include <cstdint>
#include <exception>
#include <span>
#include <string>
#include <string_view>
#include <typeinfo>
#include <vector>

#include "epmoe/core/concepts.hpp"
#include "epmoe/core/config.hpp"
#include "epmoe/core/error.hpp"
#include "epmoe/core/view.hpp"

// Start-up agreement: ranks that disagree on shapes or policies would otherwise hang or
// exchange garbage in the first all-to-all; one exchange of a few numbers catches it first.
namespace epmoe {

/// What every layer checks of its config and policies before the agreement (the host and the
/// CUDA layer alike): the config's rules, the placement's and the router's own, and that the
/// config's top_k and ranks match the router's and the communicator's.
template <class Router, class Placement>
void check_layer_policies(const layer_config& cfg, int comm_size, const Router& router,
                          const Placement& placement) {
  cfg.validate();
  if constexpr (placement_with_validate<Placement>) placement.validate(cfg);
  if constexpr (Router::top_k > 0)
    detail::require(
        cfg.top_k == Router::top_k, "top_k", cfg.top_k,
        ("must equal the router's top_k (" + std::to_string(Router::top_k) + ")").c_str());
  detail::require(
      cfg.ranks == comm_size, "ranks", cfg.ranks,
      ("must equal the communicator's size (" + std::to_string(comm_size) + ")").c_str());
  // Zero experts are scored by the gate like the routed ones and picked per token.
  if (cfg.zero_experts > 0)
    detail::require(Router::uses_gate && Router::top_k > 0, "zero_experts", cfg.zero_experts,
                    "needs a router that scores every expert from its gate and picks top_k per "
                    "token (not expert choice, hash or another gate-less router)");
  if constexpr (router_with_validate<Router>) router.validate(cfg.router_view());
}

/// One value every rank must hold identically, with the name reported when they differ.
struct agreement_field {
  const char* name;
  std::int64_t value;
};

/// 64-bit FNV-1a of a string, as int64 (for agreement_field values).
constexpr std::int64_t hash_text(std::string_view text) {
  std::uint64_t h = 14695981039346656037ull;
  for (char c : text) {
    h ^= static_cast<unsigned char>(c);
    h *= 1099511628211ull;
  }
  return static_cast<std::int64_t>(h);
}

/// A hash of T's name, e.g. of a policy bundle. Stable within one build; two compilers may
/// name a type differently, so ranks built by different compilers will disagree.
template <class T>
std::int64_t type_hash() {
  return hash_text(typeid(T).name());
}

/// Collective: every rank of `comm` passes the same field names, in the same order, and
/// learns every rank's values with one alltoall. If any field differs between ranks, every
/// rank throws the same config_error naming the first such field, e.g.
/// "epmoe: hidden = rank 0: 64, rank 2: 32: must be the same on every rank", so none hangs
/// in a later exchange. Allocates (it runs once, at construction).
template <class Comm>
void agree_on(Comm& comm, std::span<const agreement_field> fields) {
  const std::size_t R = static_cast<std::size_t>(comm.size()), F = fields.size();
  std::vector<std::int64_t> send(R * F), recv(R * F);  // the same F values to every peer
  for (std::size_t r = 0; r < R; ++r)
    for (std::size_t f = 0; f < F; ++f) send[r * F + f] = fields[f].value;
  comm.alltoall(send.data(), recv.data(), static_cast<index_t>(F));
  // Every rank now holds the same [R, F] table, so every rank reaches the same verdict.
  for (std::size_t f = 0; f < F; ++f)
    for (std::size_t r = 1; r < R; ++r)
      if (recv[r * F + f] != recv[f])
        throw config_error(fields[f].name,
                           "rank 0: " + std::to_string(recv[f]) + ", rank " + std::to_string(r) +
                               ": " + std::to_string(recv[r * F + f]),
                           "must be the same on every rank");
}

/// A layer's collective start-up check (host and CUDA layers alike): `check()` validates
/// this rank's own inputs (throwing config_error); then all ranks compare their configs,
/// policy bundle and placement (every slot's expert) in one exchange. Any failure or
/// difference makes every rank throw (the failing rank its own error), so no rank is left
/// waiting in an exchange.
/// Ranks per node a layer uses: the config's ranks_per_node, else the comm's (one that knows
/// its nodes: comm::mpi, or a comm told to pretend), else 0 (every rank on one node).
template <class Comm>
int node_size_of(const layer_config& cfg, const Comm& comm) {
  if (cfg.ranks_per_node > 0) return cfg.ranks_per_node;
  if constexpr (requires { comm.ranks_per_node(); })
    return comm.ranks_per_node();
  else
    return 0;
}

template <class Policies, class Comm, class Placement, class Check>
void agree_on_layer(const layer_config& cfg, Comm& comm, const Placement& placement,
                    Check&& check) {
  std::exception_ptr local;
  std::uint64_t where = 0;  // every slot's expert, hashed: all ranks must share one table
  try {
    check();
    for (int r = 0; r < cfg.ranks; ++r)  // unsigned: the hash wraps (signed would be UB)
      for (int j = 0; j < placement.slots_per_rank(); ++j)
        where = where * 1000003u + static_cast<std::uint64_t>(placement.expert_at(r, j) + 1);
  } catch (const config_error&) {
    local = std::current_exception();
  }
  const auto scaled = [](double v) { return static_cast<std::int64_t>(std::llround(v * 1e9)); };
  const agreement_field fields[] = {
      {"config_valid (another rank rejected its config or weights)", local ? 0 : 1},
      {"hidden", cfg.hidden},
      {"ffn", cfg.ffn},
      {"experts", cfg.experts},
      {"zero_experts", cfg.zero_experts},
      {"top_k", cfg.top_k},
      {"ranks", cfg.ranks},
      {"max_tokens", cfg.max_tokens},
      {"shared_experts", cfg.shared_experts},
      {"shared_ffn", cfg.shared_ffn},
      {"shared_gate", cfg.shared_gate},
      {"output_bias", cfg.output_bias},
      {"seq_len", cfg.seq_len},
      {"chunks", cfg.chunks},
      {"max_recv_rows", cfg.max_recv_rows},
      {"ranks_per_node (the config's, else the comm's)", node_size_of(cfg, comm)},
      {"training", cfg.training},
      {"recompute", cfg.recompute},
      {"capacity_factor (x1e9)", scaled(cfg.capacity_factor)},
      {"aux_loss_coef (x1e9)", scaled(cfg.aux_loss_coef)},
      {"exchange_timeout (x1e9)", scaled(cfg.exchange_timeout)},
      {"dispatch_rows", static_cast<std::int64_t>(cfg.dispatch_rows)},
      {"policies (hash of the policy bundle type)", type_hash<Policies>()},
      {"placement (hash of every slot's expert)", static_cast<std::int64_t>(where)}};
  try {
    agree_on(comm, std::span<const agreement_field>(fields));
  } catch (const config_error&) {
    if (local) std::rethrow_exception(local);
    throw;
  }
  if (local) std::rethrow_exception(local);  // every rank failed: each reports its own
}

}  // namespace epmoe
